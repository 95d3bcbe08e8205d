"""One drafter training step: DFlash token objective + ExitTrain, one jitted sharded call.

Per micro-batch (B sequences, A anchors each, docs/design.md §8)::

    target pass   frozen target over the sequences       -> context features, sequence K/V
    drafter       all A blocks of a row in one forward   -> draft hidden [B, A, H, D]  (vjp)
    trees         DDTree from the detached rows' top-K    -> DraftTree [B, A, N]
    scoring       one target forward over all tree nodes  -> target hidden [B, A, N, D]
                  (or only over the nodes with children, ``score_capacities``)
    exit weights  exit law (detached)                     -> weights [B, A, N], coverage
    objective     token CE + lambda * exit loss           -> d loss / d hidden
    update        vjp -> drafter grads -> optax (clip, AdamW, warmup + cosine, MultiSteps)

The objective (trees, scoring, exit weights, losses) is `tev_jax.exit_train`'s, set by
the `tev_jax.exit_train.ExitTrainConfig` inside `StepConfig`; this module wires it to
the drafter's forward and the optimiser (`train.optimizer`), over the state and
shardings of `train.state` and `train.placement`.

No [rows, V] logits array is formed: every read of the target's LM head (the drafter's
log-normalisers, top-K and label / node logits; the exit law's per-node log-normaliser
and child logits) goes over vocabulary blocks (`tev_jax.models.lm_head`). Only a target
sampling transform with top-k, top-p or T = 0 scores dense [B, A, N, V] logits.

Only the drafter's ``nnx.Param`` values are differentiated: the drafter forward is the
one function under ``jax.vjp``, and the target's state is a separate, non-differentiated
argument. The trees, the target scoring pass and the exit weights are built from
``stop_gradient`` logits, so they carry no gradient either.

Sharding (`train.placement`): drafter parameters and optimiser state follow their
logical axes, the batch is split over data and fsdp, and the frozen target's parameters
are sharded like the drafter's (``target_sharding='fsdp'``) or replicated over data /
fsdp and split only along tensor ('replicated'; `tev_jax.sharding.frozen_target_rules`).

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
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from tev_jax import ddtree
from tev_jax import sharding as shd
from tev_jax.exit_train import ExitTrainConfig, block_labels, exit_targets, objective
from tev_jax.models import lm_head
from tev_jax.models.drafter import anchor_hidden, draft_head
from tev_jax.tree_scoring import target_context
from train.optimizer import OptimConfig, make_optimizer
from train.placement import Placement, abstract_state, placement
from train.state import Batch, Frozen, Graphs, TrainState, merge_drafter, split_models

DTYPES = ("float32", "bfloat16")
REMAT = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static settings of a step (hashable).

    Attributes:
      objective: the ExitTrain objective (loss, budget, lambda, sampling, normaliser,
        floor, scoring capacities, vocabulary block; `tev_jax.exit_train`).
      taps: target layers feeding the drafter.
      horizon: H.
      compute_dtype: None, or 'float32' / 'bfloat16': the drafter's parameters are cast
        to it for the forward (they and the optimiser state keep their own dtype).
      remat: rematerialisation of each drafter layer in the backward pass (`REMAT`):
        'none', 'full' (save only the layer inputs) or 'dots' (save matmul outputs
        without batch dimensions).
      target_sharding: 'fsdp' (the frozen target's parameters sharded over fsdp and
        tensor like the drafter's) or 'replicated' (replicated over data / fsdp, split
        over tensor only: `tev_jax.sharding.frozen_target_rules`).
    """

    objective: ExitTrainConfig
    taps: tuple[int, ...]
    horizon: int
    compute_dtype: str | None = None
    remat: str = "none"
    target_sharding: str = "fsdp"

    def __post_init__(self):
        check_pass_options(self.compute_dtype, self.remat, self.target_sharding)


def check_pass_options(compute_dtype, remat: str, target_sharding: str) -> None:
    """ValueError naming a compute dtype, remat policy or target sharding a step does not
    know (the options every drafter step shares)."""
    if compute_dtype not in (None,) + DTYPES:
        raise ValueError(f"compute_dtype must be None or one of {DTYPES}, got "
                         f"{compute_dtype!r}")
    if remat not in REMAT:
        raise ValueError(f"remat must be one of {tuple(REMAT)}, got {remat!r}")
    if target_sharding not in shd.TARGET_SHARDINGS:
        raise ValueError(f"target_sharding must be one of {shd.TARGET_SHARDINGS}, got "
                         f"{target_sharding!r}")


def drafter_pass(params, graphs: Graphs, frozen: Frozen, target, feats, tokens, anchors,
                 compute_dtype, remat: str):
    """The drafter's hidden states at the anchors and their pullback: ``jax.vjp`` of the
    drafter's forward in its trained ``params`` (cast to ``compute_dtype`` where set,
    rematerialised as ``remat`` says). -> (hidden, pullback)."""
    def forward(p):
        if compute_dtype is not None:
            p = jax.tree.map(lambda x: x.astype(compute_dtype), p)
        drafter = merge_drafter(graphs, frozen, p)
        return anchor_hidden(drafter, target, feats, tokens, anchors, REMAT[remat])

    return jax.vjp(forward, params)


def loss_and_grads(params, graphs: Graphs, frozen: Frozen, batch: Batch, cfg: StepConfig):
    """Drafter gradients of the objective and per-step metrics (un-jitted).

    Returns:
      (grads (like params), metrics dict of float32 [])
    """
    ocfg = cfg.objective
    target = nnx.merge(graphs.target, frozen.target)
    feats, cache = target_context(target, batch.tokens, cfg.taps,
                                  with_cache=ocfg.needs_cache)
    head = draft_head(merge_drafter(graphs, frozen, params), target)

    hidden, pullback = drafter_pass(params, graphs, frozen, target, feats, batch.tokens,
                                    batch.anchors, cfg.compute_dtype, cfg.remat)
    rows = lambda h: lm_head.head_rows(h, head, ocfg.vocab_block)
    detached = rows(jax.lax.stop_gradient(hidden))
    k = ddtree.tree_k(detached, ocfg.budget) if ocfg.builds_trees else 1
    top = ddtree.draft_top_k(detached, k, block=ocfg.vocab_block)
    labels = block_labels(batch.tokens, batch.anchors, cfg.horizon)
    label_mask = batch.label_mask(cfg.horizon)
    full = batch.full(cfg.horizon)          # anchors whose trees count
    metrics = {}
    trees = weights = None
    if ocfg.builds_trees:
        trees, weights, coverage = exit_targets(target, cache, detached, batch.tokens,
                                                batch.anchors, full, ocfg, top)
        n_full = jnp.maximum(jnp.sum(full), 1)
        metrics["tau"] = 1.0 + jnp.sum(jnp.where(full, coverage, 0.0)) / n_full
    (total, aux), dhidden = jax.value_and_grad(
        lambda h: objective(rows(h), labels, full, trees, weights, ocfg, label_mask),
        has_aux=True)(hidden)
    (grads,) = pullback(dhidden)
    correct = (top[0][..., 0] == labels) & label_mask
    metrics.update(aux)
    metrics["loss"] = total
    metrics["token_acc"] = jnp.sum(correct) / jnp.maximum(jnp.sum(label_mask), 1)
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
    return apply_grads(state, grads, metrics, optimizer, lr_schedule)


def apply_grads(state: TrainState, grads, metrics: dict, optimizer, lr_schedule=None):
    """The optimiser update of ``state`` by ``grads``; -> (new TrainState, ``metrics``
    as float32 scalars, with the update's learning rate as 'lr' when ``lr_schedule`` is
    given)."""
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    if lr_schedule is not None:
        metrics = dict(metrics, lr=lr_schedule(state.step))
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


class ProgramCache:
    """The last few compiled train programs of this process, by (models, settings, mesh,
    batch shape): runs of the same shapes in one process (a resumed run, a test) reuse
    a step instead of tracing and compiling it again."""

    def __init__(self, size: int = 8):
        self.size = size
        self.programs: collections.OrderedDict = collections.OrderedDict()

    def get(self, key, build):
        """The program under ``key``, built by ``build()`` the first time."""
        if key in self.programs:
            self.programs.move_to_end(key)
            return self.programs[key]
        program = self.programs[key] = build()
        while len(self.programs) > self.size:
            self.programs.popitem(last=False)
        return program


_PROGRAMS = ProgramCache()


def step_program(graphs: Graphs, cfg: StepConfig, ocfg: OptimConfig, mesh, param_state,
                 frozen: Frozen, batch_shape: tuple[int, int, int]) -> StepProgram:
    """The step for one (models, settings, mesh, batch shape), built once per process
    (`ProgramCache`).

    Args:
      param_state: the drafter's ``nnx.Param`` state (for its logical axes).
      frozen: the frozen model state (for the target's logical axes).
      batch_shape: (B, L, A).
    """

    def build():
        optimizer, lr_schedule = make_optimizer(ocfg)
        place = placement(mesh, graphs, frozen, param_state, optimizer, batch_shape,
                          cfg.target_sharding)
        return StepProgram(place, optimizer, lr_schedule,
                           make_step_fn(graphs, cfg, optimizer, place, lr_schedule))

    return _PROGRAMS.get((graphs, cfg, ocfg, mesh, tuple(batch_shape)), build)


def lower(target, drafter, step_config: StepConfig, optim_config: OptimConfig, mesh,
          batch_shape: tuple[int, int, int]):
    """The jax ``Lowered`` of one optimiser update (micro-batch) on ``mesh``.

    Works on abstract models (`tev_jax.costs.plan.abstract_target`, ``nnx.eval_shape``):
    nothing is allocated, so ``lower(...).compile().memory_analysis()`` gives the
    per-device argument and temporary bytes of a step for models that would not fit
    this machine. The step is the one `step_program` jits (same shardings, state
    donated).

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
                  valid=jax.ShapeDtypeStruct((b, a), jnp.bool_),
                  in_bounds=jax.ShapeDtypeStruct((b, a), jnp.int32))
    with place.context():
        return step_fn.lower(state, batch, jax.tree.map(shape, frozen))


__all__ = ["DTYPES", "REMAT", "ProgramCache", "apply_grads", "StepConfig", "StepProgram", "loss_and_grads", "lower",
           "make_step_fn", "step_program", "train_step"]
