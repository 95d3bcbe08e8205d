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

Sharding (names resolved by `tev_jax.sharding`): drafter parameters and optimiser state
follow their logical axes (``embed`` -> fsdp, heads / MLP / vocab -> tensor), the batch
is split over data and fsdp, and the frozen target's parameters are sharded like the
drafter's (``target_sharding='fsdp'``: over fsdp and tensor, gathered by XLA layer by
layer) or replicated over data / fsdp and split only along tensor ('replicated',
`target_rules`).

Precision: the drafter's parameters (and optimiser state) keep their dtype (float32
master weights); ``StepConfig.compute_dtype`` casts them for the forward. The target
runs in its own dtype. ``StepConfig.remat`` rematerialises each drafter layer in the
backward pass.
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


DTYPES = ("float32", "bfloat16")
TARGET_SHARDINGS = ("fsdp", "replicated")
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
      grad_accum: micro-batches per optimiser update (for the logged learning rate).
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
        over tensor only: `target_rules`).
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
    grad_accum: int = 1
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
        if self.target_sharding not in TARGET_SHARDINGS:
            raise ValueError(f"target_sharding must be one of {TARGET_SHARDINGS}, got "
                             f"{self.target_sharding!r}")
        if not isinstance(self.vocab_block, int) or self.vocab_block < 1:
            raise ValueError(f"vocab_block must be a positive int, got {self.vocab_block!r}")

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


def target_rules_for(target_sharding: str) -> shd.Rules:
    """The frozen target's logical rules: the current ones for 'fsdp', `target_rules`
    for 'replicated'."""
    if target_sharding not in TARGET_SHARDINGS:
        raise ValueError(f"target_sharding must be one of {TARGET_SHARDINGS}, got "
                         f"{target_sharding!r}")
    return shd.current_rules() if target_sharding == "fsdp" else target_rules()


def placement(mesh, graphs: Graphs, frozen: Frozen, abstract_params, optimizer,
              batch_shape: tuple[int, int, int], target_sharding: str = "fsdp") -> Placement:
    """Shardings of the train state, the batch and the frozen models on ``mesh``.

    Args:
      mesh: a mesh from `tev_jax.sharding.make_mesh`, or None (one device).
      abstract_params: the drafter's ``nnx.Param`` state (abstract or concrete), whose
        variables carry the logical axis names.
      batch_shape: (B, L, A).
      target_sharding: 'fsdp' or 'replicated' (`StepConfig.target_sharding`).
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
    target_sh = shd.state_shardings(frozen.target, mesh, target_rules_for(target_sharding))
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
    place = placement(mesh, graphs, frozen, param_state, optimizer, batch_shape,
                      cfg.target_sharding)
    program = StepProgram(place, optimizer, schedule,
                          make_step_fn(graphs, cfg, optimizer, place, schedule))
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
    optimizer, schedule = make_optimizer(optim_config)
    place = placement(mesh, graphs, frozen, param_state, optimizer, batch_shape,
                      step_config.target_sharding)
    step_fn = make_step_fn(graphs, step_config, optimizer, place, schedule)
    b, length, a = batch_shape
    shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
    state = jax.eval_shape(lambda p: TrainState(step=jnp.zeros((), jnp.int32), params=p,
                                                opt_state=optimizer.init(p)),
                           jax.tree.map(shape, params))
    batch = Batch(tokens=jax.ShapeDtypeStruct((b, length), jnp.int32),
                  anchors=jax.ShapeDtypeStruct((b, a), jnp.int32),
                  valid=jax.ShapeDtypeStruct((b, a), jnp.bool_))
    with place.context():
        return step_fn.lower(state, batch, jax.tree.map(shape, frozen))


__all__ = [
    "Batch", "DTYPES", "Frozen", "Graphs", "OptimConfig", "Placement", "REMAT", "StepConfig",
    "StepProgram", "TARGET_SHARDINGS", "TrainState", "abstract_models", "abstract_state",
    "block_labels", "exit_targets", "init_state",
    "loss_and_grads", "lower", "make_optimizer", "make_step_fn", "merge_drafter",
    "objective", "place_batch", "place_frozen", "placement", "split_models", "step_program",
    "target_rules", "target_rules_for", "train_step",
]
