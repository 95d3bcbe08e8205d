"""The arrays a drafter training step reads and writes, and the models split for it.

A step is a function ``(TrainState, Batch, Frozen) -> (TrainState, metrics)`` with the
models' graph definitions (`Graphs`) static: `split_models` cuts the target and the
drafter into those parts once, `merge_drafter` puts the drafter back together inside
the step (``nnx.split`` once, a plain ``jax.jit`` over the states).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct


@struct.dataclass
class TrainState:
    """Everything a checkpoint holds besides its JSON metadata.

    Attributes:
      step: int32 [] micro-batches consumed (= updates * grad_accum).
      params: the drafter's ``nnx.Param`` values as a nested dict.
      opt_state: the optax state.
    """

    step: jax.Array
    params: Any
    opt_state: Any


@struct.dataclass
class Batch:
    """A device micro-batch.

    Attributes:
      tokens: int32 [B, L].
      anchors: int32 [B, A].
      valid: bool [B, A].
      in_bounds: int32 [B, A] labels of each anchor inside the response; None: all H
        of every valid anchor. Anchors with fewer (drawn ``partial``) train the token
        loss on those labels only and build no tree.
    """

    tokens: jax.Array
    anchors: jax.Array
    valid: jax.Array
    in_bounds: jax.Array | None = None

    def label_mask(self, horizon: int) -> jax.Array:
        """bool [B, A, H]: the labels the token loss counts."""
        mask = jnp.broadcast_to(self.valid[:, :, None], self.valid.shape + (horizon,))
        if self.in_bounds is None:
            return mask
        return mask & (jnp.arange(horizon) < self.in_bounds[:, :, None])

    def full(self, horizon: int) -> jax.Array:
        """bool [B, A]: the valid anchors with all H labels (those that build trees)."""
        if self.in_bounds is None:
            return self.valid
        return self.valid & (self.in_bounds >= horizon)


@struct.dataclass
class Frozen:
    """The non-differentiated model state: the target's and the drafter's non-params."""

    target: Any
    drafter_rest: Any


@dataclasses.dataclass(frozen=True)
class Graphs:
    """Graph definitions of the target and the drafter (static)."""

    target: Any
    drafter: Any


def split_models(target, drafter) -> tuple[Graphs, Frozen, Any]:
    """(graphs, frozen state, drafter params as a nested dict)."""
    tg, ts = nnx.split(target)
    dg, params, rest = nnx.split(drafter, nnx.Param, ...)
    return Graphs(tg, dg), Frozen(ts, rest), nnx.to_pure_dict(params)


def merge_drafter(graphs: Graphs, frozen: Frozen, params):
    """The drafter module of ``params`` (its ``nnx.Param`` values) and the frozen rest."""
    return nnx.merge(graphs.drafter, params, frozen.drafter_rest)


__all__ = ["Batch", "Frozen", "Graphs", "TrainState", "merge_drafter", "split_models"]
