"""Where a training run's arrays live on a mesh: the shardings of the train state, the
batch and the frozen models, and the state created directly with them.

Drafter parameters and optimiser state follow their logical axes (``embed`` -> fsdp,
heads / MLP / vocab -> tensor), the batch is split over data and fsdp, and the frozen
target is placed by `tev_jax.sharding.frozen_target_rules` (its ``target_sharding``).
Without a mesh (None) everything sits on one device and the shardings are None.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from tev_jax import sharding as shd
from train.state import Batch, Frozen, Graphs, TrainState


@dataclasses.dataclass(frozen=True)
class Placement:
    """Shardings of a training run on one mesh (None: single device, no mesh)."""

    mesh: Any
    state: Any
    batch: Any
    frozen: Any

    def context(self):
        """The mesh context the step must be traced and run under."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()


def placement(mesh, graphs: Graphs, frozen: Frozen, abstract_params, optimizer,
              batch_shape: tuple[int, int, int], target_sharding: str = "fsdp") -> Placement:
    """Shardings of the train state, the batch and the frozen models on ``mesh``.

    Args:
      mesh: a mesh from `tev_jax.sharding.make_mesh`, or None (one device).
      graphs: the models' graph definitions (`train.state.split_models`).
      frozen: the frozen model state (for the target's logical axes).
      abstract_params: the drafter's ``nnx.Param`` state (abstract or concrete), whose
        variables carry the logical axis names.
      optimizer: the optax transform (its state is placed like the parameters).
      batch_shape: (B, L, A).
      target_sharding: 'fsdp' or 'replicated' (`tev_jax.sharding.frozen_target_rules`).
    """
    if mesh is None:
        return Placement(None, None, None, None)
    b, length, a = batch_shape
    param_sh = nnx.to_pure_dict(shd.state_shardings(abstract_params, mesh))
    pure_abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                 nnx.to_pure_dict(abstract_params))
    abstract_opt = jax.eval_shape(optimizer.init, pure_abstract)
    repl = shd.replicated(mesh)
    opt_sh = optax.tree_map_params(optimizer, lambda _, s: s, abstract_opt, param_sh,
                                   transform_non_params=lambda _: repl)
    state_sh = TrainState(step=repl, params=param_sh, opt_state=opt_sh)
    batch_sh = Batch(
        tokens=shd.logical_sharding(("batch", "seq"), (b, length), mesh),
        anchors=shd.logical_sharding(("batch", None), (b, a), mesh),
        valid=shd.logical_sharding(("batch", None), (b, a), mesh),
        in_bounds=shd.logical_sharding(("batch", None), (b, a), mesh),
    )
    target_sh = shd.state_shardings(frozen.target, mesh,
                                    shd.frozen_target_rules(target_sharding))
    rest_sh = shd.state_shardings(frozen.drafter_rest, mesh)
    return Placement(mesh, state_sh, batch_sh, Frozen(target_sh, rest_sh))


def place_frozen(frozen: Frozen, place: Placement) -> Frozen:
    """The frozen model state on its shardings (as is without a mesh)."""
    if place.mesh is None:
        return frozen
    return jax.device_put(frozen, place.frozen)


def host_arrays(host_batch) -> Batch:
    """The `Batch` of a `train.rollouts.HostBatch`'s numpy arrays."""
    return Batch(tokens=np.asarray(host_batch.tokens, np.int32),
                 anchors=np.asarray(host_batch.anchors, np.int32),
                 valid=np.asarray(host_batch.valid, bool),
                 in_bounds=np.asarray(host_batch.in_bounds, np.int32))


def place_batch(host_batch, place: Placement) -> Batch:
    """Device arrays of a host batch (every process builds the same global batch)."""
    arrays = host_arrays(host_batch)
    if place.mesh is None:
        return jax.tree.map(jnp.asarray, arrays)
    return jax.tree.map(
        lambda x, s: jax.make_array_from_callback(x.shape, s, lambda idx: x[idx]),
        arrays, place.batch)


def _fresh_state(params, optimizer) -> TrainState:
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=optimizer.init(params))


def init_state(params, optimizer, place: Placement) -> TrainState:
    """A fresh train state, created directly with its shardings (no unsharded copy)."""
    fn = lambda p: _fresh_state(p, optimizer)
    if place.mesh is None:
        return jax.jit(fn)(params)
    params = jax.device_put(params, place.state.params)
    with place.context():
        return jax.jit(fn, out_shardings=place.state)(params)


def abstract_state(params, optimizer, place: Placement) -> TrainState:
    """``ShapeDtypeStruct``s (with shardings) of the train state, for restoring.

    Args:
      params: the drafter's parameters (arrays or ``ShapeDtypeStruct``s).
    """
    shapes = jax.eval_shape(lambda p: _fresh_state(p, optimizer), params)
    if place.mesh is None:
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=dev),
                            shapes)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, place.state)


__all__ = ["Placement", "abstract_state", "host_arrays", "init_state", "place_batch",
           "place_frozen", "placement"]
