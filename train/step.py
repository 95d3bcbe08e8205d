"""One drafter training step: DFlash token objective + ExitTrain, one jitted sharded call.

Per micro-batch (B sequences, A anchors each, DESIGN.md §8)::

    target pass   frozen target over the sequences       -> context features, sequence K/V
    drafter       all A blocks of a row in one forward   -> draft logits [B, A, H, V]  (vjp)
    trees         DDTree from the detached rows           -> DraftTree [B, A, N]
    scoring       one target forward over all tree nodes  -> target logits [B, A, N, V]
                  (or only over the nodes with children, ``score_capacities``)
    exit weights  exit law (detached)                     -> weights [B, A, N], coverage
    objective     token CE + lambda * exit loss           -> d loss / d logits
    update        vjp -> drafter grads -> optax (clip, AdamW, warmup + cosine, MultiSteps)

Only the drafter's ``nnx.Param`` values are differentiated: the drafter forward is the
one function under ``jax.vjp``, and the target's state is a separate, non-differentiated
argument. The trees, the target scoring pass and the exit weights are built from
``stop_gradient`` logits, so they carry no gradient either.

Sharding (names resolved by `tev_jax.sharding`): drafter parameters and optimiser state
follow their logical axes (``embed`` -> fsdp, heads / MLP / vocab -> tensor), the batch
is split over data and fsdp, and the target's parameters are replicated except along
tensor (`target_rules`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct

from tev_jax import ddtree
from tev_jax import sharding as shd
from tev_jax.exit_train import (
    NORMALIZERS,
    LossParts,
    check_floor,
    check_weighting,
    exit_loss,
    score_parent_nodes,
    score_tree_nodes,
    target_context,
    token_loss,
    tree_exit_weights,
)
from tev_jax.models.drafter import anchor_logits
from tev_jax.sampling import Sampling
from tev_jax.tree import DraftTree


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
      grad_accum: micro-batches per optimiser update (for the logged learning rate).
      score_capacities: empty: the scoring pass runs over every tree node. Fractions
        in (0, 1), e.g. (0.25, 0.5, 0.75): it runs over the nodes the exit law reads
        (nodes with children, of valid anchors) in the smallest of
        ``ceil(fraction * A * N)`` query slots per row that holds them, else over every
        node (`tev_jax.exit_train.score_parent_nodes`); same losses and gradients, a
        cost that follows the trees, one more compiled scoring pass per fraction.
    """

    loss: str
    budget: int
    exit_lambda: float
    sampling: Sampling
    taps: tuple[int, ...]
    horizon: int
    decay_gamma: float | None = None
    tree_metrics: bool = False
    grad_accum: int = 1
    score_capacities: tuple[float, ...] = ()
    exit_normalizer: str = "weight"
    exit_floor: float = 0.0

    def __post_init__(self):
        if self.loss != "token":
            check_weighting(self.loss)
        check_floor(self.exit_floor)
        if self.exit_normalizer not in NORMALIZERS:
            raise ValueError(f"exit_normalizer must be one of {NORMALIZERS}, got "
                             f"{self.exit_normalizer!r}")
        caps = self.score_capacities
        if not isinstance(caps, tuple) or any(not 0 < c < 1 for c in caps):
            raise ValueError(f"score_capacities must be a tuple of fractions in (0, 1), "
                             f"got {caps!r}")

    @property
    def builds_trees(self) -> bool:
        return self.loss != "token" or self.tree_metrics

    @property
    def weighting(self):
        return "exit" if self.loss == "token" else self.loss


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
    """

    tokens: jax.Array
    anchors: jax.Array
    valid: jax.Array


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


# ------------------------------------------------------------------------- models


def split_models(target, drafter) -> tuple[Graphs, Frozen, Any]:
    """(graphs, frozen state, drafter params as a nested dict)."""
    tg, ts = nnx.split(target)
    dg, params, rest = nnx.split(drafter, nnx.Param, ...)
    return Graphs(tg, dg), Frozen(ts, rest), nnx.to_pure_dict(params)


def merge_drafter(graphs: Graphs, frozen: Frozen, params):
    return nnx.merge(graphs.drafter, params, frozen.drafter_rest)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup + cosine decay and global-norm clipping (hashable).

    Attributes:
      lr: peak learning rate.
      steps: optimiser updates of the run (the cosine's length).
      warmup_steps: linear warmup from 0 (0: start at ``lr``).
      end_lr_ratio: the cosine ends at ``lr * end_lr_ratio``.
      weight_decay: AdamW decay of matrices (vectors, i.e. norm scales, are not decayed).
      b1, b2, eps: Adam moments and denominator epsilon.
      grad_clip: global-norm clipping threshold.
      grad_accum: micro-batches per update (``optax.MultiSteps``).
    """

    lr: float
    steps: int
    warmup_steps: int = 0
    end_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    grad_accum: int = 1


def make_optimizer(ocfg: OptimConfig):
    """The optax transform of an `OptimConfig`.

    Returns:
      (optax.GradientTransformation, schedule: update index -> learning rate)
    """
    c = ocfg
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0 if c.warmup_steps else c.lr, peak_value=c.lr,
        warmup_steps=c.warmup_steps, decay_steps=max(c.steps, c.warmup_steps + 1),
        end_value=c.lr * c.end_lr_ratio)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)
    tx = optax.chain(optax.clip_by_global_norm(c.grad_clip),
                     optax.adamw(schedule, b1=c.b1, b2=c.b2, eps=c.eps,
                                 weight_decay=c.weight_decay, mask=decay_mask))
    if c.grad_accum > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=c.grad_accum)
    return tx, schedule


# ------------------------------------------------------------------ step pieces


def block_labels(tokens_BL: jax.Array, anchors_BA: jax.Array, horizon: int) -> jax.Array:
    """int32 [B, A, H]: ``tokens[anchor + 1 .. anchor + H]`` (clipped at the end)."""
    seq_len = tokens_BL.shape[1]
    idx = anchors_BA.astype(jnp.int32)[:, :, None] + 1 + jnp.arange(horizon, dtype=jnp.int32)
    idx = jnp.clip(idx, 0, seq_len - 1)
    b, a, h = idx.shape
    return jnp.take_along_axis(tokens_BL.astype(jnp.int32), idx.reshape(b, a * h),
                               axis=1).reshape(b, a, h)


def build_trees(draft_logits_BAHV: jax.Array, roots_BA: jax.Array, budget: int) -> DraftTree:
    """DDTree of every anchor from its (detached) draft rows; fields [B, A, N]."""
    b, a, h, v = draft_logits_BAHV.shape
    logits = jax.lax.stop_gradient(draft_logits_BAHV).reshape(b * a, h, v)
    trees, _ = jax.vmap(lambda l, r: ddtree.build_tree(l, r, budget))(
        logits, roots_BA.reshape(b * a).astype(jnp.int32))
    return jax.tree.map(lambda x: x.reshape((b, a) + x.shape[1:]), trees)


def exit_targets(target, cache, draft_logits_BAHV, batch: Batch, cfg: StepConfig):
    """Trees, detached node weights and exit-law coverage of every anchor.

    Returns:
      (trees [B, A, N], weights float32 [B, A, N] (0 for invalid anchors),
       coverage float32 [B, A])
    """
    roots = jnp.take_along_axis(batch.tokens.astype(jnp.int32),
                                batch.anchors.astype(jnp.int32), axis=1)
    trees = build_trees(draft_logits_BAHV, roots, cfg.budget)
    if not cfg.score_capacities:
        target_logits = score_tree_nodes(target, cache, trees, batch.anchors)
    else:
        slots = batch.anchors.shape[1] * (cfg.budget + 1)
        capacities = [min(slots, math.ceil(f * slots)) for f in cfg.score_capacities]
        target_logits = score_parent_nodes(target, cache, trees, batch.anchors, capacities,
                                           batch.valid)
    weights, law = tree_exit_weights(trees, target_logits, cfg.sampling, cfg.weighting,
                                     cfg.exit_floor)
    weights = jnp.where(batch.valid[:, :, None], weights, 0.0)
    return trees, weights, law.coverage


def objective(draft_logits_BAHV, labels_BAH, valid_BA, trees, weights_BAN, cfg: StepConfig):
    """total = token + lambda * exit (exit only for the ExitTrain losses).

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

    def drafter_forward(p):
        drafter = merge_drafter(graphs, frozen, p)
        return anchor_logits(drafter, target, feats, batch.tokens, batch.anchors)

    logits, pullback = jax.vjp(drafter_forward, params)
    labels = block_labels(batch.tokens, batch.anchors, cfg.horizon)
    metrics = {}
    trees = weights = None
    if cfg.builds_trees:
        trees, weights, coverage = exit_targets(target, cache, jax.lax.stop_gradient(logits),
                                                batch, cfg)
        n_valid = jnp.maximum(jnp.sum(batch.valid), 1)
        metrics["tau"] = 1.0 + jnp.sum(jnp.where(batch.valid, coverage, 0.0)) / n_valid
    (total, aux), dlogits = jax.value_and_grad(objective, has_aux=True)(
        logits, labels, batch.valid, trees, weights, cfg)
    (grads,) = pullback(dlogits)
    rows = batch.valid[:, :, None]
    correct = (jnp.argmax(logits, axis=-1) == labels) & rows
    metrics.update(aux)
    metrics["loss"] = total
    metrics["token_acc"] = jnp.sum(correct) / jnp.maximum(jnp.sum(rows) * cfg.horizon, 1)
    metrics["grad_norm"] = optax.tree.norm(grads)
    return grads, metrics


def train_step(state: TrainState, batch: Batch, frozen: Frozen, *, graphs: Graphs,
               cfg: StepConfig, optimizer, schedule=None):
    """One micro-batch: gradients, optimiser update (un-jitted; see `make_step_fn`).

    Returns:
      (new TrainState, metrics dict of float32 [])
    """
    grads, metrics = loss_and_grads(state.params, graphs, frozen, batch, cfg)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    if schedule is not None:
        metrics["lr"] = jnp.asarray(schedule(state.step // cfg.grad_accum), jnp.float32)
    metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


# ------------------------------------------------------------------------ sharding


def target_rules(rules: shd.Rules | None = None) -> shd.Rules:
    """Logical rules for the frozen target: like ``rules`` but ``embed`` unsharded.

    The target is then replicated over the batch-parallel axes and split only by
    tensor parallelism (its parameters are read, never updated, so sharding them over
    fsdp would only add all-gathers).
    """
    rules = shd.current_rules() if rules is None else rules
    return tuple((name, None) if name == "embed" else (name, ax) for name, ax in rules)


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


def _pure(state: nnx.State):
    return nnx.to_pure_dict(state)


def placement(mesh, graphs: Graphs, frozen: Frozen, abstract_params, optimizer,
              batch_shape: tuple[int, int, int]) -> Placement:
    """Shardings of the train state, the batch and the frozen models on ``mesh``.

    Args:
      mesh: a mesh from `tev_jax.sharding.make_mesh`, or None (one device).
      abstract_params: the drafter's ``nnx.Param`` state (abstract or concrete), whose
        variables carry the logical axis names.
      batch_shape: (B, L, A).
    """
    if mesh is None:
        return Placement(None, None, None, None)
    b, length, a = batch_shape
    param_sh = _pure(shd.state_shardings(abstract_params, mesh))
    pure_abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                 _pure(abstract_params))
    abstract_opt = jax.eval_shape(optimizer.init, pure_abstract)
    repl = shd.replicated(mesh)
    opt_sh = optax.tree_map_params(optimizer, lambda _, s: s, abstract_opt, param_sh,
                                   transform_non_params=lambda _: repl)
    state_sh = TrainState(step=repl, params=param_sh, opt_state=opt_sh)
    batch_sh = Batch(
        tokens=shd.logical_sharding(("batch", "seq"), (b, length), mesh),
        anchors=shd.logical_sharding(("batch", None), (b, a), mesh),
        valid=shd.logical_sharding(("batch", None), (b, a), mesh),
    )
    target_sh = shd.state_shardings(frozen.target, mesh, target_rules())
    rest_sh = shd.state_shardings(frozen.drafter_rest, mesh)
    return Placement(mesh, state_sh, batch_sh, Frozen(target_sh, rest_sh))


def place_frozen(frozen: Frozen, place: Placement) -> Frozen:
    if place.mesh is None:
        return frozen
    return jax.device_put(frozen, place.frozen)


def place_batch(host_batch, place: Placement) -> Batch:
    """Device arrays of a host batch (every process builds the same global batch)."""
    arrays = Batch(tokens=np.asarray(host_batch.tokens, np.int32),
                   anchors=np.asarray(host_batch.anchors, np.int32),
                   valid=np.asarray(host_batch.valid, bool))
    if place.mesh is None:
        return jax.tree.map(jnp.asarray, arrays)
    return jax.tree.map(
        lambda x, s: jax.make_array_from_callback(x.shape, s, lambda idx: x[idx]),
        arrays, place.batch)


def init_state(params, optimizer, place: Placement) -> TrainState:
    """A fresh train state, created directly with its shardings (no unsharded copy)."""
    fn = lambda p: TrainState(step=jnp.zeros((), jnp.int32), params=p,
                              opt_state=optimizer.init(p))
    if place.mesh is None:
        return jax.jit(fn)(params)
    params = jax.device_put(params, place.state.params)
    with place.context():
        return jax.jit(fn, out_shardings=place.state)(params)


def abstract_state(params, optimizer, place: Placement) -> TrainState:
    """``ShapeDtypeStruct``s (with shardings) of the train state, for restoring."""
    fn = lambda p: TrainState(step=jnp.zeros((), jnp.int32), params=p,
                              opt_state=optimizer.init(p))
    shapes = jax.eval_shape(fn, params)
    if place.mesh is None:
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=dev),
                            shapes)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, place.state)


def make_step_fn(graphs: Graphs, cfg: StepConfig, optimizer, place: Placement,
                 schedule=None, donate: bool = True):
    """The jitted step ``(state, batch, frozen) -> (state, metrics)``.

    Call it under ``place.context()`` (the mesh must be active while tracing).
    """
    fn = functools.partial(train_step, graphs=graphs, cfg=cfg, optimizer=optimizer,
                           schedule=schedule)
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
    schedule: Any
    step_fn: Any


_PROGRAMS: collections.OrderedDict = collections.OrderedDict()
_MAX_PROGRAMS = 8


def step_program(graphs: Graphs, cfg: StepConfig, ocfg: OptimConfig, mesh, param_state,
                 frozen: Frozen, batch_shape: tuple[int, int, int]) -> StepProgram:
    """The step for one (models, settings, mesh, batch shape), built once per process.

    Runs of the same shapes in one process (a resumed run, a test) reuse the compiled
    step instead of tracing and compiling it again.

    Args:
      param_state: the drafter's ``nnx.Param`` state (for its logical axes).
      frozen: the frozen model state (for the target's logical axes).
      batch_shape: (B, L, A).
    """
    key = (graphs, cfg, ocfg, mesh, tuple(batch_shape))
    if key in _PROGRAMS:
        _PROGRAMS.move_to_end(key)
        return _PROGRAMS[key]
    optimizer, schedule = make_optimizer(ocfg)
    place = placement(mesh, graphs, frozen, param_state, optimizer, batch_shape)
    program = StepProgram(place, optimizer, schedule,
                          make_step_fn(graphs, cfg, optimizer, place, schedule))
    _PROGRAMS[key] = program
    while len(_PROGRAMS) > _MAX_PROGRAMS:
        _PROGRAMS.popitem(last=False)
    return program


__all__ = [
    "Batch", "Frozen", "Graphs", "OptimConfig", "Placement", "StepConfig", "StepProgram",
    "TrainState", "abstract_state", "block_labels", "build_trees", "exit_targets",
    "init_state", "loss_and_grads", "make_optimizer", "make_step_fn", "merge_drafter",
    "objective", "place_batch", "place_frozen", "placement", "split_models", "step_program",
    "target_rules", "train_step",
]
