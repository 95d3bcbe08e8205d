"""One drafter training step: DFlash token objective + ExitTrain, one jitted sharded call.

Per micro-batch (B sequences, A anchors each, DESIGN.md §8)::

    target pass   frozen target over the sequences       -> context features, sequence K/V
    drafter       all A blocks of a row in one forward   -> draft hidden [B, A, H, D]  (vjp)
    trees         DDTree from the detached rows' top-K    -> DraftTree [B, A, N]
    scoring       one target forward over all tree nodes  -> target hidden [B, A, N, D]
                  (or only over the nodes with children, ``score_capacities``)
    exit weights  exit law (detached)                     -> weights [B, A, N], coverage
    objective     token CE + lambda * exit loss           -> d loss / d hidden
    update        vjp -> drafter grads -> optax (clip, AdamW, warmup + cosine, MultiSteps)

No [rows, V] logits array is formed: every read of the target's LM head (the drafter's
log-normalisers, top-K and label / node logits; the exit law's per-node log-normaliser
and child logits) goes over vocabulary blocks (`tev_jax.models.lm_head`). Only a target
sampling transform with top-k, top-p or T = 0 scores dense [B, A, N, V] logits.

Only the drafter's ``nnx.Param`` values are differentiated: the drafter forward is the
one function under ``jax.vjp``, and the target's state is a separate, non-differentiated
argument. The trees, the target scoring pass and the exit weights are built from
``stop_gradient`` logits, so they carry no gradient either.

The step runs over the state of `train.state`, with the optimiser of `train.optimizer`
and the shardings of `train.placement`: drafter parameters and optimiser state follow
their logical axes, the batch is split over data and fsdp, and the frozen target's
parameters are sharded like the drafter's (``target_sharding='fsdp'``) or replicated
over data / fsdp and split only along tensor ('replicated';
`tev_jax.sharding.frozen_target_rules`).

Precision: the drafter's parameters (and optimiser state) keep their dtype (float32
master weights); ``StepConfig.compute_dtype`` casts them for the forward. The target
runs in its own dtype. ``StepConfig.remat`` rematerialises each drafter layer in the
backward pass.

Compiled programs: `step_program` keeps the last few jitted steps in a module-level
cache keyed by (graphs, configs, mesh, batch shape), so that runs of the same shapes in
one process (a resumed run, the tests) trace and compile once; `lower` builds the same
program for planning without touching the cache.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from tev_jax import ddtree
from tev_jax import sharding as shd
from tev_jax.exit_train import (
    blocked_law_ok,
    edge_log_probs_blocked,
    exit_laws_from_edges,
    NORMALIZERS,
    LossParts,
    check_floor,
    check_weighting,
    exit_loss,
    node_weights,
    score_parent_hidden,
    score_tree_hidden,
    target_context,
    token_loss,
    tree_exit_weights,
)
from tev_jax.models import lm_head
from tev_jax.models.drafter import anchor_hidden
from tev_jax.sampling import Sampling
from train.optimizer import OptimConfig, make_optimizer
from train.placement import Placement, abstract_state, placement
from train.state import Batch, Frozen, Graphs, TrainState, merge_drafter, split_models


DTYPES = ("float32", "bfloat16")
REMAT = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def check_score_capacities(caps) -> None:
    """Raises ValueError unless ``caps`` is a tuple of fractions in (0, 1)."""
    if not isinstance(caps, tuple) or any(not 0 < c < 1 for c in caps):
        raise ValueError(f"score_capacities must be a tuple of fractions in (0, 1), "
                         f"got {caps!r}")


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static settings of a step (hashable).

    Attributes:
      loss: 'token', or the ExitTrain node weighting: a name of
        `tev_jax.exit_train.WEIGHTINGS` or a callable ``(tree, law) -> weights [N]``.
      budget: DDTree budget (N = budget + 1).
      exit_lambda: weight of the exit loss.
      exit_normalizer: the exit term is the weighted NLL sum divided by the total
        weight ('weight') or by the number of tree nodes, root excluded, of the valid
        anchors ('nodes', the authors' release: the term then shrinks with the weights).
      exit_floor: edge-probability floor alpha of the reach in the node weights
        (`tev_jax.exit_train.node_weights`; the authors use 1e-4).
      sampling: target sampling transform of the exit law.
      taps: target layers feeding the drafter.
      horizon: H.
      decay_gamma: optional DFlash position decay of the token loss.
      tree_metrics: build and score trees with loss='token' too (logs tau).
      score_capacities: empty: the scoring pass runs over every tree node. Fractions
        in (0, 1), e.g. (0.25, 0.5, 0.75): it runs over the nodes the exit law reads
        (nodes with children, of valid anchors) in the smallest of
        ``ceil(fraction * A * N)`` query slots per row that holds them, else over every
        node (`tev_jax.exit_train.score_parent_nodes`); same losses and gradients, a
        cost that follows the trees, one more compiled scoring pass per fraction.
      compute_dtype: None, or 'float32' / 'bfloat16': the drafter's parameters are cast
        to it for the forward (they and the optimiser state keep their own dtype).
      remat: rematerialisation of each drafter layer in the backward pass (`REMAT`):
        'none', 'full' (save only the layer inputs) or 'dots' (save matmul outputs
        without batch dimensions).
      target_sharding: 'fsdp' (the frozen target's parameters sharded over fsdp and
        tensor like the drafter's) or 'replicated' (replicated over data / fsdp, split
        over tensor only: `tev_jax.sharding.frozen_target_rules`).
      vocab_block: vocabulary entries per block of the LM-head reductions.
    """

    loss: str
    budget: int
    exit_lambda: float
    sampling: Sampling
    taps: tuple[int, ...]
    horizon: int
    decay_gamma: float | None = None
    tree_metrics: bool = False
    score_capacities: tuple[float, ...] = ()
    compute_dtype: str | None = None
    remat: str = "none"
    target_sharding: str = "fsdp"
    vocab_block: int = lm_head.BLOCK
    exit_normalizer: str = "weight"
    exit_floor: float = 0.0

    def __post_init__(self):
        if self.loss != "token":
            check_weighting(self.loss)
        check_floor(self.exit_floor)
        if self.exit_normalizer not in NORMALIZERS:
            raise ValueError(f"exit_normalizer must be one of {NORMALIZERS}, got "
                             f"{self.exit_normalizer!r}")
        check_score_capacities(self.score_capacities)
        if self.compute_dtype not in (None,) + DTYPES:
            raise ValueError(f"compute_dtype must be None or one of {DTYPES}, got "
                             f"{self.compute_dtype!r}")
        if self.remat not in REMAT:
            raise ValueError(f"remat must be one of {tuple(REMAT)}, got {self.remat!r}")
        if self.target_sharding not in shd.TARGET_SHARDINGS:
            raise ValueError(f"target_sharding must be one of {shd.TARGET_SHARDINGS}, got "
                             f"{self.target_sharding!r}")
        if not isinstance(self.vocab_block, int) or self.vocab_block < 1:
            raise ValueError(f"vocab_block must be a positive int, got {self.vocab_block!r}")

    @property
    def builds_trees(self) -> bool:
        return self.loss != "token" or self.tree_metrics

    @property
    def weighting(self):
        return "exit" if self.loss == "token" else self.loss


# ------------------------------------------------------------------ step pieces


def block_labels(tokens_BL: jax.Array, anchors_BA: jax.Array, horizon: int) -> jax.Array:
    """int32 [B, A, H]: ``tokens[anchor + 1 .. anchor + H]`` (clipped at the end)."""
    seq_len = tokens_BL.shape[1]
    idx = anchors_BA.astype(jnp.int32)[:, :, None] + 1 + jnp.arange(horizon, dtype=jnp.int32)
    idx = jnp.clip(idx, 0, seq_len - 1)
    b, a, h = idx.shape
    return jnp.take_along_axis(tokens_BL.astype(jnp.int32), idx.reshape(b, a * h),
                               axis=1).reshape(b, a, h)


def exit_targets(target, cache, draft, batch: Batch, cfg: StepConfig, top=None):
    """Trees, detached node weights and exit-law coverage of every anchor.

    Args:
      draft: [B, A, H, V] draft logits or their `HeadRows` (detached).
      top: optional precomputed ``ddtree.draft_top_k(draft, ddtree.tree_k(draft,
        cfg.budget))``.
    Returns:
      (trees [B, A, N], weights float32 [B, A, N] (0 for invalid anchors),
       coverage float32 [B, A])
    """
    roots = jnp.take_along_axis(batch.tokens.astype(jnp.int32),
                                batch.anchors.astype(jnp.int32), axis=1)
    trees = ddtree.build_trees(draft, roots, cfg.budget, block=cfg.vocab_block, top=top)
    if not cfg.score_capacities:
        hidden = score_tree_hidden(target, cache, trees, batch.anchors)
    else:
        slots = batch.anchors.shape[1] * (cfg.budget + 1)
        capacities = [min(slots, math.ceil(f * slots)) for f in cfg.score_capacities]
        hidden = score_parent_hidden(target, cache, trees, batch.anchors, capacities,
                                     batch.valid)
    if blocked_law_ok(cfg.sampling):
        log_a = edge_log_probs_blocked(trees, hidden, lm_head.head_of(target), cfg.sampling,
                                       cfg.vocab_block)
        law = exit_laws_from_edges(trees, log_a)
        weights = node_weights(trees, law, cfg.weighting, cfg.exit_floor)
    else:   # top-k / top-p / greedy transform whole rows: dense [B, A, N, V] logits
        weights, law = tree_exit_weights(trees, target.unembed(hidden), cfg.sampling,
                                         cfg.weighting, cfg.exit_floor)
    weights = jnp.where(batch.valid[:, :, None], weights, 0.0)
    return trees, weights, law.coverage


def objective(draft_logits_BAHV, labels_BAH, valid_BA, trees, weights_BAN, cfg: StepConfig):
    """total = token + lambda * exit (exit only for the ExitTrain losses).

    ``draft_logits_BAHV`` is [B, A, H, V] logits or their `HeadRows` (the step's).
    The exit term is normalised by its total weight or by the tree-node count of the
    valid anchors (``cfg.exit_normalizer``).

    Returns:
      (total loss [], aux dict of [] arrays)
    """
    mask = jnp.broadcast_to(valid_BA[:, :, None], labels_BAH.shape)
    tok = token_loss(draft_logits_BAHV, labels_BAH, mask, cfg.decay_gamma)
    aux = {"token_loss": tok.mean}
    total = tok.mean
    if cfg.loss != "token":
        ex = exit_loss(draft_logits_BAHV, trees, weights_BAN)
        if cfg.exit_normalizer == "nodes":
            nodes = trees.valid & (trees.depths > 0) & valid_BA[:, :, None]
            ex = LossParts(total=ex.total, weight=jnp.sum(nodes).astype(jnp.float32))
        aux["exit_loss"] = ex.mean
        aux["exit_weight"] = jnp.sum(weights_BAN)
        total = total + cfg.exit_lambda * ex.mean
    return total, aux


def loss_and_grads(params, graphs: Graphs, frozen: Frozen, batch: Batch, cfg: StepConfig):
    """Drafter gradients of the objective and per-step metrics (un-jitted).

    Returns:
      (grads (like params), metrics dict of float32 [])
    """
    target = nnx.merge(graphs.target, frozen.target)
    feats, cache = target_context(target, batch.tokens, cfg.taps)
    head = lm_head.head_of(target)

    def drafter_forward(p):
        if cfg.compute_dtype is not None:
            p = jax.tree.map(lambda x: x.astype(cfg.compute_dtype), p)
        drafter = merge_drafter(graphs, frozen, p)
        return anchor_hidden(drafter, target, feats, batch.tokens, batch.anchors,
                             REMAT[cfg.remat])

    hidden, pullback = jax.vjp(drafter_forward, params)
    rows = lambda h: lm_head.head_rows(h, head, cfg.vocab_block)
    detached = rows(jax.lax.stop_gradient(hidden))
    k = ddtree.tree_k(detached, cfg.budget) if cfg.builds_trees else 1
    top = ddtree.draft_top_k(detached, k, block=cfg.vocab_block)
    labels = block_labels(batch.tokens, batch.anchors, cfg.horizon)
    metrics = {}
    trees = weights = None
    if cfg.builds_trees:
        trees, weights, coverage = exit_targets(target, cache, detached, batch, cfg, top)
        n_valid = jnp.maximum(jnp.sum(batch.valid), 1)
        metrics["tau"] = 1.0 + jnp.sum(jnp.where(batch.valid, coverage, 0.0)) / n_valid
    (total, aux), dhidden = jax.value_and_grad(
        lambda h: objective(rows(h), labels, batch.valid, trees, weights, cfg),
        has_aux=True)(hidden)
    (grads,) = pullback(dhidden)
    row_mask = batch.valid[:, :, None]
    correct = (top[0][..., 0] == labels) & row_mask
    metrics.update(aux)
    metrics["loss"] = total
    metrics["token_acc"] = jnp.sum(correct) / jnp.maximum(jnp.sum(row_mask) * cfg.horizon, 1)
    metrics["grad_norm"] = optax.tree.norm(grads)
    return grads, metrics


def train_step(state: TrainState, batch: Batch, frozen: Frozen, *, graphs: Graphs,
               cfg: StepConfig, optimizer, lr_schedule=None):
    """One micro-batch: gradients, optimiser update (un-jitted; see `make_step_fn`).

    Args:
      lr_schedule: optional micro-batch index -> learning rate (`make_optimizer`'s), to
        log it as ``metrics['lr']``.
    Returns:
      (new TrainState, metrics dict of float32 [])
    """
    grads, metrics = loss_and_grads(state.params, graphs, frozen, batch, cfg)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    if lr_schedule is not None:
        metrics["lr"] = jnp.asarray(lr_schedule(state.step), jnp.float32)
    metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def make_step_fn(graphs: Graphs, cfg: StepConfig, optimizer, place: Placement,
                 lr_schedule=None, donate: bool = True):
    """The jitted step ``(state, batch, frozen) -> (state, metrics)``.

    Call it under ``place.context()`` (the mesh must be active while tracing).
    """
    fn = functools.partial(train_step, graphs=graphs, cfg=cfg, optimizer=optimizer,
                           lr_schedule=lr_schedule)
    donate_argnums = (0,) if donate else ()
    if place.mesh is None:
        return jax.jit(fn, donate_argnums=donate_argnums)
    repl = shd.replicated(place.mesh)
    return jax.jit(fn, in_shardings=(place.state, place.batch, place.frozen),
                   out_shardings=(place.state, repl), donate_argnums=donate_argnums)


@dataclasses.dataclass
class StepProgram:
    """A jitted step with its optimiser and shardings (see `step_program`)."""

    place: Placement
    optimizer: Any
    lr_schedule: Any
    step_fn: Any


_PROGRAMS: collections.OrderedDict = collections.OrderedDict()
_MAX_PROGRAMS = 8


def step_program(graphs: Graphs, cfg: StepConfig, ocfg: OptimConfig, mesh, param_state,
                 frozen: Frozen, batch_shape: tuple[int, int, int]) -> StepProgram:
    """The step for one (models, settings, mesh, batch shape), built once per process.

    Runs of the same shapes in one process (a resumed run, a test) reuse the compiled
    step instead of tracing and compiling it again (the last `_MAX_PROGRAMS` are kept).

    Args:
      param_state: the drafter's ``nnx.Param`` state (for its logical axes).
      frozen: the frozen model state (for the target's logical axes).
      batch_shape: (B, L, A).
    """
    key = (graphs, cfg, ocfg, mesh, tuple(batch_shape))
    if key in _PROGRAMS:
        _PROGRAMS.move_to_end(key)
        return _PROGRAMS[key]
    optimizer, lr_schedule = make_optimizer(ocfg)
    place = placement(mesh, graphs, frozen, param_state, optimizer, batch_shape,
                      cfg.target_sharding)
    program = StepProgram(place, optimizer, lr_schedule,
                          make_step_fn(graphs, cfg, optimizer, place, lr_schedule))
    _PROGRAMS[key] = program
    while len(_PROGRAMS) > _MAX_PROGRAMS:
        _PROGRAMS.popitem(last=False)
    return program


# ------------------------------------------------------------------------ planning


def abstract_models(target_config, drafter_config, *, target_dtype="float32",
                    param_dtype="float32"):
    """(target, drafter) with abstract parameters (``nnx.eval_shape``: no weights).

    Args:
      target_config: the target's `ModelConfig` (e.g. `tev_jax.plan.preset`).
      drafter_config: a `DrafterConfig` for it.
      target_dtype, param_dtype: parameter dtypes of the target and the drafter.
    """
    from tev_jax.models.drafter import Drafter
    from tev_jax.models.target import Target

    drafter_config.check_target(target_config)
    target = nnx.eval_shape(lambda: Target(target_config, dtype=jnp.dtype(target_dtype),
                                           rngs=nnx.Rngs(0)))
    drafter = nnx.eval_shape(lambda: Drafter(drafter_config, dtype=jnp.dtype(param_dtype),
                                             rngs=nnx.Rngs(0)))
    return target, drafter


def lower(target, drafter, step_config: StepConfig, optim_config: OptimConfig, mesh,
          batch_shape: tuple[int, int, int]):
    """The jax ``Lowered`` of one optimiser update (micro-batch) on ``mesh``.

    Works on abstract models (`abstract_models`): nothing is allocated, so
    ``lower(...).compile().memory_analysis()`` gives the per-device argument and
    temporary bytes of a step for models that would not fit this machine. The step is
    the one `step_program` jits (same shardings, state donated).

    Args:
      target, drafter: the models (abstract or concrete).
      step_config, optim_config: the step's settings.
      mesh: a ``tev_jax.sharding.make_mesh`` mesh, or None (one device).
      batch_shape: (B, L, A).
    """
    graphs, frozen, params = split_models(target, drafter)
    _, param_state, _ = nnx.split(drafter, nnx.Param, ...)
    optimizer, lr_schedule = make_optimizer(optim_config)
    place = placement(mesh, graphs, frozen, param_state, optimizer, batch_shape,
                      step_config.target_sharding)
    step_fn = make_step_fn(graphs, step_config, optimizer, place, lr_schedule)
    b, length, a = batch_shape
    shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
    state = abstract_state(jax.tree.map(shape, params), optimizer, place)
    batch = Batch(tokens=jax.ShapeDtypeStruct((b, length), jnp.int32),
                  anchors=jax.ShapeDtypeStruct((b, a), jnp.int32),
                  valid=jax.ShapeDtypeStruct((b, a), jnp.bool_))
    with place.context():
        return step_fn.lower(state, batch, jax.tree.map(shape, frozen))


__all__ = [
    "DTYPES", "REMAT", "StepConfig", "StepProgram", "abstract_models", "block_labels",
    "check_score_capacities", "exit_targets", "loss_and_grads", "lower", "make_step_fn",
    "objective", "step_program", "train_step",
]
