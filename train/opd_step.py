"""One Draft-OPD training step: the drafter replays its own rounds, one jitted sharded call.

Per micro-batch (B rollout sequences, A of their rounds each; `train.opd_rollouts`)::

    target pass   frozen target over [prompt ; response]   -> context features
    drafter       the A rounds' blocks in one forward      -> draft hidden [B, A, H, D]  (vjp)
    objective     `tev_jax.draft_opd.opd_loss` over the rows (vocabulary-blocked head)
    update        vjp -> drafter grads -> optax (as `train.step`)

A round's anchor is its root's position in the sequence: the block sees the committed
context before it and its root, exactly what the drafter saw when it drafted that round
(`tev_jax.models.drafter.anchor_hidden`). The supervision arrays (committed tokens, the
rejected tail and the target's log-probabilities of both) come from the round trace
(`tev_jax.draft_opd.round_targets`) and carry no gradient; the target pass only gives
the drafter its context features (no cache, no scoring pass, no trees).

The optimiser, the train state and the shardings are `train.step`'s and
`train.placement`'s; the batch's extra [B, A, H] arrays are split over the batch axes
like its tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from tev_jax import sharding as shd
from tev_jax.draft_opd import OpdConfig, opd_loss
from tev_jax.models import lm_head
from tev_jax.models.drafter import draft_head
from tev_jax.tree_scoring import target_context
from train.optimizer import OptimConfig, make_optimizer
from train.placement import Placement, abstract_state, placement
from train.state import Frozen, Graphs, TrainState, merge_drafter, split_models
from train.step import ProgramCache, apply_grads, check_pass_options, drafter_pass


@struct.dataclass
class OpdBatch:
    """A device micro-batch of rounds.

    Attributes:
      tokens: int32 [B, L] rollout sequences ``[prompt ; response]``.
      anchors: int32 [B, A] each round's root position.
      valid: bool [B, A] real rounds (a sequence with fewer than A rounds is padded).
      response, rejected: int32 [B, A, H] `tev_jax.draft_opd.RoundTargets` tokens (-1:
        no term).
      response_logp, rejected_logp: float32 [B, A, H] their target log-probabilities.
    """

    tokens: jax.Array
    anchors: jax.Array
    valid: jax.Array
    response: jax.Array
    response_logp: jax.Array
    rejected: jax.Array
    rejected_logp: jax.Array


@dataclasses.dataclass(frozen=True)
class OpdStepConfig:
    """Static settings of an OPD step (hashable).

    Attributes:
      opd: the objective's weights (`tev_jax.draft_opd.OpdConfig`).
      taps, horizon, compute_dtype, remat, target_sharding: as `train.step.StepConfig`.
      vocab_block: vocabulary entries per block of the LM-head reductions.
    """

    opd: OpdConfig
    taps: tuple[int, ...]
    horizon: int
    compute_dtype: str | None = None
    remat: str = "none"
    target_sharding: str = "fsdp"
    vocab_block: int = lm_head.BLOCK

    def __post_init__(self):
        check_pass_options(self.compute_dtype, self.remat, self.target_sharding)


def opd_loss_and_grads(params, graphs: Graphs, frozen: Frozen, batch: OpdBatch,
                       cfg: OpdStepConfig):
    """Drafter gradients of the Draft-OPD objective and per-step metrics (un-jitted).

    Returns:
      (grads (like params), metrics dict of float32 [])
    """
    target = nnx.merge(graphs.target, frozen.target)
    feats, _ = target_context(target, batch.tokens, cfg.taps, with_cache=False)
    head = draft_head(merge_drafter(graphs, frozen, params), target)

    hidden, pullback = drafter_pass(params, graphs, frozen, target, feats, batch.tokens,
                                    batch.anchors, cfg.compute_dtype, cfg.remat)
    rows = lambda h: lm_head.head_rows(h, head, cfg.vocab_block)
    (total, aux), dhidden = jax.value_and_grad(
        lambda h: opd_loss(rows(h), batch.response, batch.response_logp, batch.rejected,
                           batch.rejected_logp, batch.valid, cfg.opd),
        has_aux=True)(hidden)
    (grads,) = pullback(dhidden)
    # the drafter's greedy token against the committed one (accepted drafts + correction)
    top = lm_head.top_k(hidden, head, 1, block=cfg.vocab_block)[1][..., 0]
    mask = batch.valid[..., None] & (batch.response >= 0)
    metrics = dict(aux)
    metrics["loss"] = total
    metrics["token_acc"] = jnp.sum((top == batch.response) & mask) / jnp.maximum(
        jnp.sum(mask), 1)
    metrics["grad_norm"] = optax.tree.norm(grads)
    return grads, metrics


def opd_train_step(state: TrainState, batch: OpdBatch, frozen: Frozen, *, graphs: Graphs,
                   cfg: OpdStepConfig, optimizer, lr_schedule=None):
    """One micro-batch: gradients, optimiser update (un-jitted; see `make_opd_step_fn`)."""
    grads, metrics = opd_loss_and_grads(state.params, graphs, frozen, batch, cfg)
    return apply_grads(state, grads, metrics, optimizer, lr_schedule)


def opd_batch_shardings(mesh, batch_shape: tuple[int, int, int], horizon: int):
    """`OpdBatch` of shardings (None without a mesh): every array split over the batch
    axes.

    Args:
      batch_shape: (B, L, A).
    """
    if mesh is None:
        return None
    b, length, a = batch_shape
    rows = shd.logical_sharding(("batch", None), (b, a), mesh)
    blocks = shd.logical_sharding(("batch", None, None), (b, a, horizon), mesh)
    return OpdBatch(tokens=shd.logical_sharding(("batch", "seq"), (b, length), mesh),
                    anchors=rows, valid=rows, response=blocks, response_logp=blocks,
                    rejected=blocks, rejected_logp=blocks)


@dataclasses.dataclass
class OpdProgram:
    """A jitted OPD step with its optimiser and shardings (see `opd_program`).

    Attributes:
      place: the state and frozen-model shardings (`train.placement.Placement`).
      batch: the `OpdBatch` shardings (None without a mesh).
      optimizer, lr_schedule: `train.optimizer.make_optimizer`'s.
      step_fn: ``(state, OpdBatch, frozen) -> (state, metrics)``, state donated.
    """

    place: Placement
    batch: Any
    optimizer: Any
    lr_schedule: Any
    step_fn: Any


def _build(graphs, cfg: OpdStepConfig, ocfg: OptimConfig, mesh, param_state, frozen,
           batch_shape, donate: bool = True) -> OpdProgram:
    optimizer, lr_schedule = make_optimizer(ocfg)
    place = placement(mesh, graphs, frozen, param_state, optimizer, batch_shape,
                      cfg.target_sharding)
    batch_sh = opd_batch_shardings(mesh, batch_shape, cfg.horizon)
    fn = functools.partial(opd_train_step, graphs=graphs, cfg=cfg, optimizer=optimizer,
                           lr_schedule=lr_schedule)
    donate_argnums = (0,) if donate else ()
    if mesh is None:
        step_fn = jax.jit(fn, donate_argnums=donate_argnums)
    else:
        step_fn = jax.jit(fn, in_shardings=(place.state, batch_sh, place.frozen),
                          out_shardings=(place.state, shd.replicated(mesh)),
                          donate_argnums=donate_argnums)
    return OpdProgram(place, batch_sh, optimizer, lr_schedule, step_fn)


_PROGRAMS = ProgramCache()


def opd_program(graphs: Graphs, cfg: OpdStepConfig, ocfg: OptimConfig, mesh, param_state,
                frozen: Frozen, batch_shape: tuple[int, int, int]) -> OpdProgram:
    """The OPD step for one (models, settings, mesh, batch shape), built once per
    process (`train.step.ProgramCache`).

    Args:
      param_state: the drafter's ``nnx.Param`` state (for its logical axes).
      frozen: the frozen model state (for the target's logical axes).
      batch_shape: (B, L, A).
    """
    return _PROGRAMS.get((graphs, cfg, ocfg, mesh, tuple(batch_shape)),
                         lambda: _build(graphs, cfg, ocfg, mesh, param_state, frozen,
                                        batch_shape))


def place_opd_batch(arrays: OpdBatch, program: OpdProgram) -> OpdBatch:
    """Device arrays of a host `OpdBatch` (numpy; every process holds the whole global
    batch, and each places the shards of its own devices)."""
    if program.place.mesh is None:
        return jax.tree.map(jnp.asarray, arrays)
    return jax.tree.map(
        lambda x, s: jax.make_array_from_callback(x.shape, s, lambda idx: x[idx]),
        arrays, program.batch)


def lower_opd(target, drafter, step_config: OpdStepConfig, optim_config: OptimConfig, mesh,
              batch_shape: tuple[int, int, int]):
    """The jax ``Lowered`` of one OPD update on ``mesh`` (abstract models work: nothing
    is allocated; see `train.step.lower`).

    Args:
      batch_shape: (B, L, A).
    """
    graphs, frozen, params = split_models(target, drafter)
    _, param_state, _ = nnx.split(drafter, nnx.Param, ...)
    program = _build(graphs, step_config, optim_config, mesh, param_state, frozen,
                     batch_shape)
    b, length, a = batch_shape
    h = step_config.horizon
    shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
    state = abstract_state(jax.tree.map(shape, params), program.optimizer, program.place)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    batch = OpdBatch(tokens=i32(b, length), anchors=i32(b, a),
                     valid=jax.ShapeDtypeStruct((b, a), jnp.bool_), response=i32(b, a, h),
                     response_logp=f32(b, a, h), rejected=i32(b, a, h),
                     rejected_logp=f32(b, a, h))
    with program.place.context():
        return program.step_fn.lower(state, batch, jax.tree.map(shape, frozen))


__all__ = ["OpdBatch", "OpdProgram", "OpdStepConfig", "lower_opd", "opd_batch_shardings",
           "opd_loss_and_grads", "opd_program", "opd_train_step", "place_opd_batch"]
