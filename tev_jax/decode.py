"""The speculative decoding engine (DESIGN.md §7).

One round for every row b of a batch, with static shapes::

    draft   : drafter(new context, [root, MASK x H] at start..start+H) -> draft logits [B, H, V]
    build   : ddtree / chain / root only                              -> DraftTree [B, N]
    verify  : target.verify_tree at positions start + depth           -> logits [B, N, V], taps
    decide  : verifier(key, tree, logits)                 -> path [B, H+1], length, bonus
    commit  : KV slot start+j <- start+path[j]; output += path tokens after the root, then
              the bonus; the path's taps become the drafter's next context;
              start += length; root <- bonus

Conventions. ``start[b]`` is the number of tokens the target has consumed (its committed
KV length); ``root[b]`` is the pending token at position ``start[b]`` that the target has
not consumed yet. The prefill consumes the whole prompt and samples the first output token
t0 from its last logits (a plain autoregressive step, counted as output but not as a
round); t0 is the first root. Every round emits ``length`` tokens (accepted draft tokens
plus the bonus), so the mean of ``length`` over rounds is the acceptance length τ.

The whole generation is one ``lax.while_loop`` inside one ``jax.jit`` (`generate`): B rows
run in lock-step, each with its own start, tree and stop; a finished row stops changing
(its updates are masked and its forward passes only write scratch slots past its
committed length). With ``builder='none'`` the tree is the root alone and a round is one
autoregressive step of the target: that is the AR baseline (`generate_ar`).

`profile_generate` is a second, un-fused path: the same five stage functions, each jitted
on its own and timed with ``block_until_ready`` from a Python loop over rounds. Its
per-stage seconds are the only stage timings; end-to-end tokens/s should be measured on
the fused path (`generate`, see `timed_generate`).

Drafters plug in through the `DrafterProtocol`. The engine splits the target and the
drafter together (``nnx.split((target, drafter))``, so a drafter that shares the target's
embedding or head is not copied) and merges them inside the jitted function.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import NamedSharding

from tev_jax import extensions
from tev_jax import sharding as shd
from tev_jax import verify as verify_lib
from tev_jax.exit_law import exit_law, target_scores
from tev_jax.models import kv_cache as kvc
from tev_jax.sampling import Sampling
from tev_jax.tree import DraftTree, ancestor_mask

BUILDERS = tuple(extensions.BUILDERS)
VERIFIERS = ("tev", "predraw", "sequential", "greedy")
PAD_TOKEN = -1
_LEN_ALIGN = 8  # prompt and cache lengths are rounded up to this, to share compilations

VerifierFn = Callable[..., verify_lib.Verdict]


class DrafterProtocol(Protocol):
    """What the engine needs from a drafter.

    The drafter is an ``nnx.Module`` used inside jit (split together with the target,
    which every method receives, so a drafter may borrow the target's embedding and
    head without holding them). Its context is a pytree of static-shape buffers (e.g. a
    KV cache over context positions) covering the committed positions ``< start`` of
    every row. A DFlash `tev_jax.models.drafter.Drafter` is adapted by `as_drafter`.

    Attributes:
      block_size: H + 1, the block ``[root, MASK x H]``; the drafter proposes H rows.
      target_layer_ids: target layers whose hidden states (concatenated, F features per
        position) are the drafter's context features; ``()`` if it reads tokens only.
    """

    block_size: int
    target_layer_ids: tuple[int, ...]

    def init_context(self, target, batch: int, max_len: int) -> Any:
        """An empty context for ``batch`` rows and ``max_len`` positions."""

    def extend_context(self, target, ctx: Any, tokens_BP: jax.Array, feats_BPF: jax.Array,
                       start_B: jax.Array, count_B: jax.Array) -> Any:
        """Appends committed positions ``start .. start+count-1`` of every row.

        Args:
          target: the `Target`.
          ctx: the context, covering positions ``< start``.
          tokens_BP: int32 [B, P] committed tokens; entries ``>= count`` are padding.
          feats_BPF: [B, P, F] the target's tapped hidden states at those tokens.
          start_B: int32 [B] position of the first new entry.
          count_B: int32 [B] number of real entries per row (0 leaves the row as is).
        """

    def draft(self, target, ctx: Any, root_B: jax.Array, start_B: jax.Array
              ) -> tuple[jax.Array, Any]:
        """Draft logits for the block ``[root, MASK x H]`` at positions ``start..start+H``.

        Returns:
          (float32 logits [B, H, V], row d-1 for the token at depth d; the context, which
          may hold scratch past ``start`` but must still cover positions ``< start``).
        """


class DFlashDrafter(nnx.Module):
    """The `DrafterProtocol` over a DFlash `tev_jax.models.drafter.Drafter`."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.block_size = int(drafter.config.block_size)
        self.target_layer_ids = tuple(int(i) for i in drafter.config.target_layer_ids)

    def init_context(self, target, batch, max_len):
        from tev_jax.models import drafter as dflash

        return dflash.init_drafter_cache(self.drafter.config, batch, max_len, self.drafter.dtype)

    def extend_context(self, target, ctx, tokens_BP, feats_BPF, start_B, count_B):
        from tev_jax.models import drafter as dflash

        # The DFlash cache tracks its own lengths, which equal ``start`` here.
        return dflash.append_context(self.drafter, ctx, feats_BPF, count_B)

    def draft(self, target, ctx, root_B, start_B):
        from tev_jax.models import drafter as dflash

        return dflash.draft_logits(self.drafter, target, ctx, root_B), ctx

    def context_axes(self, ctx):
        """Logical axes of the context cache (optional in the protocol: for meshes)."""
        from tev_jax.models import drafter as dflash

        return dflash.DrafterCache(k=kvc.CACHE_AXES, v=kvc.CACHE_AXES, lengths=("batch",))


def as_drafter(drafter) -> DrafterProtocol | None:
    """Wraps a DFlash drafter module in `DFlashDrafter`; returns protocol drafters as is."""
    if drafter is None:
        return None
    from tev_jax.models import drafter as dflash

    if isinstance(drafter, dflash.Drafter):
        return DFlashDrafter(drafter)
    missing = [m for m in ("block_size", "target_layer_ids", "init_context",
                           "extend_context", "draft") if not hasattr(drafter, m)]
    if missing:
        raise ValueError(f"drafter {type(drafter).__name__} lacks {missing} of "
                         "tev_jax.decode.DrafterProtocol")
    return drafter


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """How to decode (static and hashable: it decides shapes).

    Attributes:
      max_new_tokens: M, output tokens per row (the first, from the prefill, included).
      builder: 'ddtree' (best-first tree of ``budget`` nodes, N = budget + 1), 'chain'
        (the drafter's argmax per row, N = H + 1), 'none' (plain autoregressive
        decoding from the target, N = 1; no drafter), or a hashable callable
        ``(draft_logits_HV, root_token) -> DraftTree`` for one row (a
        `tev_jax.extensions.TreeBuilder`; N is read from its output shape).
      budget: DDTree node budget (non-root nodes); ignored by the other builders.
      verifier: 'tev', 'predraw', 'sequential', 'greedy' (T = 0 only), or a callable
        ``(key, tree, target_logits_NV, sampling, *, horizon) -> Verdict`` (for
        experiments and tests). Ignored when ``builder='none'``.
      sampling: the target's sampling transform (default greedy, T = 0).
      stop_token_ids: a row ends after emitting any of these (the stop token is kept).
      prompt_len: P, a fixed prompt buffer: every batch is padded to P slots (prompts of
        up to P tokens), so that prompts of any length reuse one compilation. None pads
        to the longest prompt of the batch, rounded up to a multiple of 8.
      max_cache_len: L, target and drafter cache slots; None picks the smallest that fits
        (P or the longest prompt, + M + N, rounded up to a multiple of 8).
      track_exit_law: also record, every round, the exit law's expected block length
        ``1 + coverage`` of the verified tree (costs one exit law per round).
      prefill_chunk: run the prompt through the target in chunks of this many tokens
        (default 512), so that prefill memory does not grow with the prompt buffer;
        None: one pass. A prompt buffer of at most this many tokens is one pass anyway.
    """

    max_new_tokens: int = 256
    builder: str | extensions.TreeBuilder = "ddtree"
    budget: int = 64
    verifier: str | VerifierFn = "tev"
    sampling: Sampling = Sampling(temperature=0.0)
    stop_token_ids: tuple[int, ...] = ()
    prompt_len: int | None = None
    max_cache_len: int | None = None
    track_exit_law: bool = False
    prefill_chunk: int | None = 512

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if not isinstance(self.builder, str):
            extensions.check_hashable(self.builder, "builder")
        elif self.builder not in BUILDERS:
            raise ValueError(f"builder must be one of {BUILDERS} or a callable, "
                             f"got {self.builder!r}")
        if self.builder == "ddtree" and (not isinstance(self.budget, int) or self.budget < 1):
            raise ValueError(
                f"budget must be a positive int for builder='ddtree', got {self.budget!r}")
        if isinstance(self.verifier, str):
            if self.verifier not in VERIFIERS:
                raise ValueError(f"verifier must be one of {VERIFIERS} or a callable, "
                                 f"got {self.verifier!r}")
        else:
            extensions.check_hashable(self.verifier, "verifier")
        if not isinstance(self.sampling, Sampling):
            raise ValueError(f"sampling must be a Sampling, got {type(self.sampling).__name__}")
        if (self.verifier == "greedy" and self.builder != "none"
                and not self.sampling.greedy):
            raise ValueError("verifier='greedy' is exact only at temperature 0; got "
                             f"temperature={self.sampling.temperature} (use 'tev', "
                             "'predraw' or 'sequential')")
        if not isinstance(self.stop_token_ids, tuple):
            raise ValueError("stop_token_ids must be a tuple of ints")
        if self.prompt_len is not None and (not isinstance(self.prompt_len, int)
                                            or self.prompt_len < 1):
            raise ValueError(f"prompt_len must be a positive int or None, got {self.prompt_len!r}")
        if self.max_cache_len is not None and self.max_cache_len < 2:
            raise ValueError(f"max_cache_len must be >= 2, got {self.max_cache_len}")
        if self.prefill_chunk is not None and (not isinstance(self.prefill_chunk, int)
                                               or self.prefill_chunk < 1):
            raise ValueError(
                f"prefill_chunk must be a positive int or None, got {self.prefill_chunk!r}")


@dataclasses.dataclass(frozen=True)
class DecodeStats:
    """Statistics of one generation (host numpy arrays).

    Attributes:
      rounds: loop iterations run (the longest row's rounds).
      rounds_per_row: int [B] rounds in which the row was still active.
      kv_moves: int [B] rounds in which the accepted path was not the first slots of the
        tree, so that commit moved key/value entries (DDTree paths through later slots).
      block_lengths: int [R, B] output-block length (accepted + bonus) per round and row
        (before truncation at a stop token or at M); 0 where the row was finished.
      expected_lengths: float [R, B] the exit law's ``1 + coverage`` of the same trees
        (``track_exit_law``), else None.
      stage_seconds: per-stage wall seconds up to ``block_until_ready``, summed over
        rounds (`profile_generate` only; keys 'prefill', 'draft', 'build', 'verify',
        'decide', 'commit'; each includes the stage call's dispatch), else None.
      round_seconds: the per-round stage times behind ``stage_seconds`` (stage ->
        float [R]; the prefill has one entry), for robust statistics such as medians
        on a loaded machine (`profile_generate` only), else None.
      seconds: wall time of the timed call (`timed_generate`, `profile_generate`), else None.
    """

    rounds: int
    rounds_per_row: np.ndarray
    kv_moves: np.ndarray
    block_lengths: np.ndarray
    expected_lengths: np.ndarray | None = None
    stage_seconds: dict[str, float] | None = None
    round_seconds: dict[str, np.ndarray] | None = None
    seconds: float | None = None

    @property
    def tau(self) -> float:
        """Mean output-block length per round (bonus included), over all rows."""
        n = int(self.rounds_per_row.sum())
        return float(self.block_lengths.sum()) / n if n else float("nan")


@dataclasses.dataclass(frozen=True)
class Generation:
    """The output of `generate`.

    Attributes:
      tokens: int32 [B, M] generated tokens only; ``PAD_TOKEN`` (-1) after each row's end.
      lengths: int32 [B] generated tokens per row (a final stop token included).
      stats: `DecodeStats`.
    """

    tokens: np.ndarray
    lengths: np.ndarray
    stats: DecodeStats

    def rows(self) -> list[list[int]]:
        """The generated tokens of every row as Python lists (padding removed)."""
        return [t[:n].tolist() for t, n in zip(self.tokens, self.lengths)]


# ------------------------------------------------------------------------------ state


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything that decides shapes or code paths (hashable)."""

    config: DecodeConfig
    horizon: int  # H
    num_slots: int  # N
    taps: tuple[int, ...]
    max_len: int  # L
    has_drafter: bool
    mesh: Any = None  # jax.sharding.Mesh of the explicit shardings, or None


@struct.dataclass
class DecodeState:
    """The loop state: fixed buffers plus lengths and masks.

    Attributes:
      key: PRNG key for the next round.
      round: int32 [] rounds run so far.
      cache: the target's `KVCache` ([layers, B, L, ...]).
      ctx: the drafter's context pytree (``()`` without a drafter).
      start_B: int32 [B] committed length; the root sits at this position.
      root_B: int32 [B] pending token.
      new_tokens_BP, new_feats_BPF, new_count_B: the last committed path (P = H+1 root
        first, its taps and length), not yet given to the drafter; its positions are
        ``start - count ..``.
      out_BM: int32 [B, M] output buffer; num_out_B: int32 [B] tokens in it.
      done_B: bool [B] the row has finished.
      rounds_B: int32 [B] rounds while active.
      moved_B: int32 [B] rounds whose accepted path was not the slots 0..length-1, so
        that commit moved key/value entries.
      block_len_RB: int32 [M, B] block length per round (0 once finished).
      expected_len_RB: float32 [M, B] exit-law expected length (zeros unless tracked).
      bad_target: bool [] a target logit was NaN or +inf.
      bad_draft: bool [] a draft logit was NaN or +inf.
    """

    key: jax.Array
    round: jax.Array
    cache: kvc.KVCache
    ctx: Any
    start_B: jax.Array
    root_B: jax.Array
    new_tokens_BP: jax.Array
    new_feats_BPF: jax.Array
    new_count_B: jax.Array
    out_BM: jax.Array
    num_out_B: jax.Array
    done_B: jax.Array
    rounds_B: jax.Array
    moved_B: jax.Array
    block_len_RB: jax.Array
    expected_len_RB: jax.Array
    bad_target: jax.Array
    bad_draft: jax.Array


# ---------------------------------------------------------------- explicit shardings
#
# With a mesh, every buffer of the loop state has a logical layout: batch rows over
# ``data`` and ``fsdp``, key/value heads of both caches over ``tensor`` (the rules of
# `tev_jax.sharding`). The state is constrained to it after the prefill and after every
# round, so the while_loop's carry has one fixed sharding that GSPMD cannot drift from.


def _state_axes(st: DecodeState, drafter) -> DecodeState:
    """Logical axis names (tuples) of every state field; None = left to GSPMD."""
    b = ("batch",)
    ctx_axes = getattr(drafter, "context_axes", None)
    return DecodeState(
        key=(), round=(), cache=kvc.KVCache(k=kvc.CACHE_AXES, v=kvc.CACHE_AXES),
        ctx=None if ctx_axes is None else ctx_axes(st.ctx),
        start_B=b, root_B=b, new_tokens_BP=("batch", None),
        new_feats_BPF=("batch", None, None), new_count_B=b, out_BM=("batch", None),
        num_out_B=b, done_B=b, rounds_B=b, moved_B=b, block_len_RB=(None, "batch"),
        expected_len_RB=(None, "batch"), bad_target=(), bad_draft=())


def _is_names(x) -> bool:
    return x is None or (isinstance(x, tuple) and all(n is None or isinstance(n, str)
                                                      for n in x))


def _constrain_state(st: DecodeState, drafter, static: _Static) -> DecodeState:
    """Pins every state buffer to its layout on ``static.mesh`` (no-op without one)."""
    if static.mesh is None:
        return st
    mesh = static.mesh

    def pin(names, x):
        if names is None:
            return x
        spec = shd.logical_to_spec(names, x.shape, mesh)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return jax.tree.map(pin, _state_axes(st, drafter), st, is_leaf=_is_names)


def _not_finite(x: jax.Array) -> jax.Array:
    return jnp.isnan(x) | (x == jnp.inf)


def sample_token(key: jax.Array, logits_BV: jax.Array, sampling: Sampling) -> jax.Array:
    """One token per row from ``softmax(transform(logits))``; int32 [B]. Argmax at T = 0.

    Uses the verifiers' samplers: their two-stage argmax, and one uniform per row with
    the blocked inverse-CDF search (cheaper on CPU than Gumbel-max, which draws V random
    numbers per row).
    """
    if sampling.greedy:
        return verify_lib.argmax(logits_BV)
    scores = target_scores(logits_BV, sampling)
    return verify_lib.inverse_cdf(verify_lib.uniform(key, (logits_BV.shape[0],)), scores)


def _stop_mask(tokens: jax.Array, stop_ids: tuple[int, ...]) -> jax.Array:
    if not stop_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(stop_ids, jnp.int32))


def _merge(graphdef, params):
    models = nnx.merge(graphdef, params)
    return models[0], (models[1] if len(models) > 1 else None)


# ----------------------------------------------------------------------------- prefill


def _prefill(graphdef, params, tokens_BT, lengths_B, key, *, static: _Static) -> DecodeState:
    """Consumes the prompts, samples t0, gives the prompt's taps to the drafter."""
    target, drafter = _merge(graphdef, params)
    cfg = static.config
    b, t = tokens_BT.shape
    h, m = static.horizon, cfg.max_new_tokens
    cache = target.init_cache(b, static.max_len)
    logits_BV, feats_BTF, cache = target.prefill(cache, tokens_BT, lengths_B, taps=static.taps,
                                                 chunk=cfg.prefill_chunk)
    key, sub = jax.random.split(key)
    t0_B = sample_token(sub, logits_BV, cfg.sampling)
    if feats_BTF is None:
        feats_BTF = jnp.zeros((b, t, 0), jnp.float32)
    zeros_B = jnp.zeros((b,), jnp.int32)
    ctx = ()
    if drafter is not None:
        ctx = drafter.init_context(target, b, static.max_len)
        ctx = drafter.extend_context(target, ctx, tokens_BT, feats_BTF, zeros_B, lengths_B)
    out_BM = jnp.full((b, m), PAD_TOKEN, jnp.int32).at[:, 0].set(t0_B)
    return DecodeState(
        key=key,
        round=jnp.zeros((), jnp.int32),
        cache=cache,
        ctx=ctx,
        start_B=lengths_B.astype(jnp.int32),
        root_B=t0_B,
        new_tokens_BP=jnp.zeros((b, h + 1), jnp.int32),
        new_feats_BPF=jnp.zeros((b, h + 1, feats_BTF.shape[-1]), feats_BTF.dtype),
        new_count_B=zeros_B,
        out_BM=out_BM,
        num_out_B=jnp.ones((b,), jnp.int32),
        done_B=_stop_mask(t0_B, cfg.stop_token_ids) | (m <= 1),
        rounds_B=zeros_B,
        moved_B=zeros_B,
        block_len_RB=jnp.zeros((m, b), jnp.int32),
        expected_len_RB=jnp.zeros((m, b), jnp.float32),
        bad_target=jnp.any(_not_finite(logits_BV)),
        bad_draft=jnp.zeros((), bool),
    )


# ------------------------------------------------------------------------ the 5 stages


def _stage_draft(graphdef, params, st: DecodeState, *, static: _Static):
    """Drafter: consume the last committed path, then draft the block. -> (logits, ctx)."""
    target, drafter = _merge(graphdef, params)
    if drafter is None:
        return None, st.ctx
    ctx = drafter.extend_context(target, st.ctx, st.new_tokens_BP, st.new_feats_BPF,
                                 st.start_B - st.new_count_B, st.new_count_B)
    logits_BHV, ctx = drafter.draft(target, ctx, st.root_B, st.start_B)
    want = (st.root_B.shape[0], static.horizon, target.config.vocab_size)
    if logits_BHV.shape != want:  # raised while tracing, i.e. on the host
        raise ValueError(f"the drafter returned draft logits of shape {logits_BHV.shape}; "
                         f"expected [B, H, V] = {list(want)}")
    return logits_BHV.astype(jnp.float32), ctx


def _stage_build(draft_logits_BHV, root_B, *, static: _Static) -> DraftTree:
    """The draft tree of every row (root = the pending token): the builder over the batch
    (its ``batched`` form when it has one, e.g. DDTree's batch-level top-k)."""
    builder = extensions.resolve_builder(static.config.builder, static.config.budget)
    return extensions.batched(builder)(draft_logits_BHV, root_B)


def _stage_verify(graphdef, params, cache, tree: DraftTree, start_B, *, static: _Static):
    """Target tree pass. -> (logits [B, N, V], taps [B, N, F] or None, cache)."""
    target, _ = _merge(graphdef, params)
    anc_BNN = jax.vmap(ancestor_mask)(tree)
    return target.verify_tree(cache, tree.tokens, tree.depths, anc_BNN, start_B,
                              taps=static.taps)


def _stage_decide(key, tree: DraftTree, logits_BNV, *, static: _Static) -> verify_lib.Verdict:
    """The verifier on every row, with one key per row."""
    cfg = static.config
    h = static.horizon
    b = logits_BNV.shape[0]
    if cfg.builder == "none":
        bonus_B = sample_token(key, logits_BNV[:, 0], cfg.sampling)
        zeros_B = jnp.zeros((b,), jnp.int32)
        return verify_lib.Verdict(path=jnp.zeros((b, 1), jnp.int32), length=zeros_B + 1,
                                  bonus=bonus_B, exit_node=zeros_B)
    keys = jax.random.split(key, b)
    v = cfg.verifier
    if v == "greedy":
        return jax.vmap(lambda t, l: verify_lib.greedy(t, l, horizon=h))(tree, logits_BNV)
    fn = {"tev": verify_lib.tev, "predraw": verify_lib.predraw,
          "sequential": verify_lib.sequential_residual}.get(v, v) if isinstance(v, str) else v
    return jax.vmap(lambda k, t, l: fn(k, t, l, cfg.sampling, horizon=h))(keys, tree, logits_BNV)


def _stage_commit(st: DecodeState, ctx, draft_logits_BHV, tree: DraftTree, logits_BNV,
                  feats_BNF, cache, verdict: verify_lib.Verdict, key, *,
                  static: _Static) -> DecodeState:
    """Moves the accepted path's KV, emits the block, updates every active row."""
    cfg = static.config
    b = st.start_B.shape[0]
    p = static.horizon + 1
    m = cfg.max_new_tokens
    active_B = ~st.done_B
    length_B = jnp.where(active_B, verdict.length, 0)
    cache = kvc.commit(cache, st.start_B, verdict.path, length_B)

    path_BP = verdict.path
    on_path_BP = path_BP >= 0
    path_tok_BP = jnp.where(
        on_path_BP, jnp.take_along_axis(tree.tokens, jnp.maximum(path_BP, 0), axis=1), 0)
    j_P = jnp.arange(p, dtype=jnp.int32)
    after_root_BP = jnp.concatenate([path_tok_BP[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
    block_BP = jnp.where(j_P[None] == verdict.length[:, None] - 1, verdict.bonus[:, None],
                         after_root_BP)
    in_block_BP = j_P[None] < length_B[:, None]
    stop_BP = _stop_mask(block_BP, cfg.stop_token_ids) & in_block_BP
    hit_stop_B = jnp.any(stop_BP, axis=1)
    first_stop_B = jnp.where(hit_stop_B, jnp.argmax(stop_BP, axis=1), p)
    emit_B = jnp.minimum(jnp.minimum(length_B, first_stop_B + 1), m - st.num_out_B)
    emit_B = jnp.where(active_B, emit_B, 0)
    rows_B1 = jnp.arange(b)[:, None]
    dst_BP = jnp.where(j_P[None] < emit_B[:, None], st.num_out_B[:, None] + j_P[None], m)
    out_BM = st.out_BM.at[rows_B1, dst_BP].set(block_BP, mode="drop")
    num_out_B = st.num_out_B + emit_B
    done_B = st.done_B | (active_B & (hit_stop_B | (num_out_B >= m)))

    if feats_BNF is None:
        new_feats_BPF = st.new_feats_BPF
    else:
        new_feats_BPF = jnp.take_along_axis(
            feats_BNF, jnp.maximum(path_BP, 0)[:, :, None], axis=1).astype(st.new_feats_BPF.dtype)

    expected_RB = st.expected_len_RB
    if cfg.track_exit_law:
        law = jax.vmap(lambda t, l: exit_law(t, l, cfg.sampling))(tree, logits_BNV)
        expected_RB = expected_RB.at[st.round].set(
            jnp.where(active_B, law.expected_length, 0.0), mode="drop")

    valid_BN = tree.valid & active_B[:, None]
    bad_target = st.bad_target | jnp.any(_not_finite(logits_BNV) & valid_BN[:, :, None])
    bad_draft = st.bad_draft
    if draft_logits_BHV is not None:
        undefined_BH = (jnp.any(_not_finite(draft_logits_BHV), axis=-1)
                        | jnp.all(draft_logits_BHV == -jnp.inf, axis=-1))
        bad_draft = bad_draft | jnp.any(undefined_BH & active_B[:, None])

    return DecodeState(
        key=key,
        round=st.round + 1,
        cache=cache,
        ctx=ctx,
        start_B=st.start_B + length_B,
        root_B=jnp.where(active_B, verdict.bonus, st.root_B),
        new_tokens_BP=path_tok_BP,
        new_feats_BPF=new_feats_BPF,
        new_count_B=length_B,
        out_BM=out_BM,
        num_out_B=num_out_B,
        done_B=done_B,
        rounds_B=st.rounds_B + active_B.astype(jnp.int32),
        moved_B=st.moved_B + jnp.any(in_block_BP & (path_BP != j_P[None]), 1).astype(jnp.int32),
        block_len_RB=st.block_len_RB.at[st.round].set(length_B, mode="drop"),
        expected_len_RB=expected_RB,
        bad_target=bad_target,
        bad_draft=bad_draft,
    )


def _round(graphdef, params, st: DecodeState, *, static: _Static) -> DecodeState:
    """One fused round: draft, build, verify, decide, commit."""
    draft_logits, ctx = _stage_draft(graphdef, params, st, static=static)
    tree = _stage_build(draft_logits, st.root_B, static=static)
    logits, feats, cache = _stage_verify(graphdef, params, st.cache, tree, st.start_B,
                                         static=static)
    key, sub = jax.random.split(st.key)
    verdict = _stage_decide(sub, tree, logits, static=static)
    return _stage_commit(st, ctx, draft_logits, tree, logits, feats, cache, verdict, key,
                         static=static)


def _running(st: DecodeState, m: int) -> jax.Array:
    return jnp.any(~st.done_B) & (st.round < m)


@functools.partial(jax.jit, static_argnames=("graphdef", "static"))
def _generate_jit(graphdef, params, tokens_BT, lengths_B, key, *, static: _Static):
    drafter = _merge(graphdef, params)[1]
    pin = lambda st: _constrain_state(st, drafter, static)
    st = pin(_prefill(graphdef, params, tokens_BT, lengths_B, key, static=static))
    return jax.lax.while_loop(
        lambda s: _running(s, static.config.max_new_tokens),
        lambda s: pin(_round(graphdef, params, s, static=static)),
        st,
    )


# ------------------------------------------------------------------------ host side


def _check_prompts(prompt_ids, config: DecodeConfig, vocab: int) -> list[np.ndarray]:
    """Host validation of the prompts and stop tokens; -> int32 arrays."""
    if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Sequence):
        raise ValueError("prompt_ids must be a list of token-id lists")
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids is empty: give at least one prompt")
    prompts = []
    for i, p in enumerate(prompt_ids):
        arr = np.asarray(p)
        if arr.ndim != 1:
            raise ValueError(f"prompt {i} must be a flat list of token ids, got shape {arr.shape}")
        if arr.size == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"prompt {i} must hold integer token ids, got dtype {arr.dtype}")
        bad = (arr < 0) | (arr >= vocab)
        if bad.any():
            k = int(np.argmax(bad))
            raise ValueError(f"prompt {i}, position {k}: token id {int(arr[k])} is outside "
                             f"the vocabulary [0, {vocab})")
        prompts.append(arr.astype(np.int32))
    longest = max(len(p) for p in prompts)
    if config.prompt_len is not None and longest > config.prompt_len:
        raise ValueError(f"a prompt has {longest} tokens, more than prompt_len "
                         f"({config.prompt_len}); raise prompt_len or shorten the prompt")
    return prompts


def _place(tree, shardings):
    """``device_put`` of arrays, and shardings attached to abstract leaves."""
    def one(x, sharding):
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        return jax.device_put(x, sharding)

    return jax.tree.map(one, tree, shardings)


def _setup(target, drafter, config: DecodeConfig, batch: int, width: int, mesh):
    """Validates models, config and mesh; -> (graphdef, params, static).

    ``width`` is the prompt buffer. With a mesh the parameters are placed by their
    logical axes (strictly: a dimension the mesh does not divide is an error).
    """
    if not isinstance(config, DecodeConfig):
        raise ValueError(f"config must be a DecodeConfig, got {type(config).__name__}")
    vocab = target.config.vocab_size
    for s in config.stop_token_ids:
        if not isinstance(s, (int, np.integer)) or not 0 <= s < vocab:
            raise ValueError(f"stop token id {s!r} is outside the vocabulary [0, {vocab})")
    if config.builder == "none":
        horizon, taps = 0, ()
        drafter = None
    else:
        drafter = as_drafter(drafter)
        if drafter is None:
            raise ValueError(f"builder={config.builder!r} needs a drafter (or use builder='none')")
        horizon = int(drafter.block_size) - 1
        if horizon < 1:
            raise ValueError(f"drafter block_size must be >= 2, got {drafter.block_size}")
        taps = tuple(int(t) for t in drafter.target_layer_ids)
        for t in taps:
            if not 0 <= t < target.config.num_layers:
                raise ValueError(f"drafter taps target layer {t}, but the target has "
                                 f"{target.config.num_layers} layers")
    builder = extensions.resolve_builder(config.builder, config.budget)
    num_slots = extensions.builder_num_slots(builder, horizon, vocab)
    if callable(config.verifier) and config.builder != "none":
        extensions.check_verifier(config.verifier, num_slots, horizon, vocab, config.sampling)

    need = width + config.max_new_tokens + num_slots
    if config.max_cache_len is None:
        max_len = -(-need // _LEN_ALIGN) * _LEN_ALIGN
    else:
        max_len = config.max_cache_len
        if max_len < need:
            raise ValueError(
                f"the cache is too short: the prompt buffer ({width} tokens) + "
                f"max_new_tokens ({config.max_new_tokens}) + tree slots ({num_slots}) = "
                f"{need} > max_cache_len ({max_len})")
    models = (target,) if drafter is None else (target, drafter)
    graphdef, params = nnx.split(models)
    if mesh is not None:
        shd.logical_to_spec(("batch",), (batch,), mesh, strict=True,
                            what=f"the batch of {batch} prompts")
        params = _place(params, shd.state_shardings(params, mesh, strict=True))
    static = _Static(config=config, horizon=horizon, num_slots=num_slots, taps=taps,
                     max_len=max_len, has_drafter=drafter is not None, mesh=mesh)
    return graphdef, params, static


def _prepare(target, drafter, prompt_ids, config: DecodeConfig, mesh=None):
    """Validates inputs on the host; -> (graphdef, params, tokens_BT, lengths_B, static)."""
    if not isinstance(config, DecodeConfig):
        raise ValueError(f"config must be a DecodeConfig, got {type(config).__name__}")
    prompts = _check_prompts(prompt_ids, config, target.config.vocab_size)
    longest = max(len(p) for p in prompts)
    width = longest if config.prompt_len is None else config.prompt_len
    graphdef, params, static = _setup(target, drafter, config, len(prompts), width, mesh)
    t_pad = (config.prompt_len if config.prompt_len is not None
             else min(-(-longest // _LEN_ALIGN) * _LEN_ALIGN, static.max_len))
    tokens_BT = np.zeros((len(prompts), t_pad), np.int32)
    for i, p in enumerate(prompts):
        tokens_BT[i, : len(p)] = p
    lengths_B = np.asarray([len(p) for p in prompts], np.int32)
    if mesh is None:
        return graphdef, params, jnp.asarray(tokens_BT), jnp.asarray(lengths_B), static
    rows = lambda x: shd.logical_sharding(("batch",) + (None,) * (x.ndim - 1), x.shape, mesh)
    return (graphdef, params, jax.device_put(tokens_BT, rows(tokens_BT)),
            jax.device_put(lengths_B, rows(lengths_B)), static)


def _mesh_scope(mesh):
    """``jax.set_mesh(mesh)`` (activates the models' activation constraints), or nothing."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def lower(target, drafter, config: DecodeConfig, batch_size: int, mesh=None
          ) -> jax.stages.Lowered:
    """The jax ``Lowered`` of the whole fused generation (prefill + decode loop).

    Works on abstract models (``nnx.eval_shape(lambda: Target(cfg, rngs=nnx.Rngs(0)))``,
    no weights made), so memory can be planned for models that do not fit this host:
    ``lower(...).compile().memory_analysis()`` gives per-device argument, output and
    temporary bytes.

    Args:
      target, drafter: as in `generate` (concrete or abstract).
      config: a `DecodeConfig` with ``prompt_len`` set (it fixes the prompt buffer).
      batch_size: B.
      mesh: optional mesh; the arguments carry the shardings `generate` would use.

    Raises:
      ValueError: ``prompt_len`` unset, or anything `generate` rejects.
    """
    if not isinstance(config, DecodeConfig) or config.prompt_len is None:
        raise ValueError("decode.lower needs a DecodeConfig with prompt_len set (the "
                         "prompt buffer decides the program's shapes)")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    graphdef, params, static = _setup(target, drafter, config, batch_size,
                                      config.prompt_len, mesh)
    rows = lambda *shape: (None if mesh is None else shd.logical_sharding(
        ("batch",) + (None,) * (len(shape) - 1), shape, mesh))
    tokens = jax.ShapeDtypeStruct((batch_size, config.prompt_len), jnp.int32,
                                  sharding=rows(batch_size, config.prompt_len))
    lengths = jax.ShapeDtypeStruct((batch_size,), jnp.int32, sharding=rows(batch_size))
    params = jax.tree.map(lambda x: x if isinstance(x, jax.ShapeDtypeStruct)
                          else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          params)
    key = jax.eval_shape(lambda: jax.random.key(0))
    with _mesh_scope(mesh):
        return _generate_jit.lower(graphdef, params, tokens, lengths, key, static=static)


def _finish(st: DecodeState, config: DecodeConfig, *, stage_seconds=None,
            round_seconds=None, seconds=None) -> Generation:
    """Host checks and conversion of the final state."""
    if bool(st.bad_target):
        raise ValueError("the target produced non-finite logits (NaN or +inf) during "
                         "generation; the output would be garbage")
    if bool(st.bad_draft):
        raise ValueError("the drafter produced non-finite logits (NaN or +inf) during "
                         "generation; its trees would be garbage")
    rounds = int(st.round)
    return Generation(
        tokens=np.asarray(st.out_BM),
        lengths=np.asarray(st.num_out_B),
        stats=DecodeStats(
            rounds=rounds,
            rounds_per_row=np.asarray(st.rounds_B),
            kv_moves=np.asarray(st.moved_B),
            block_lengths=np.asarray(st.block_len_RB)[:rounds],
            expected_lengths=(np.asarray(st.expected_len_RB)[:rounds]
                              if config.track_exit_law else None),
            stage_seconds=stage_seconds,
            round_seconds=round_seconds,
            seconds=seconds,
        ),
    )


def generate(target, drafter: DrafterProtocol | None, prompt_ids: Sequence[Sequence[int]],
             config: DecodeConfig, key: jax.Array | int = 0, *, mesh=None) -> Generation:
    """Generates up to ``config.max_new_tokens`` tokens per prompt (the fused path).

    Args:
      target: a `tev_jax.models.Target`.
      drafter: a DFlash drafter or any `DrafterProtocol`; None with ``builder='none'``.
      prompt_ids: B prompts, each a non-empty list of token ids (lengths may differ).
      config: a `DecodeConfig`.
      key: PRNG key or int seed.
      mesh: optional ``('data', 'fsdp', 'tensor')`` mesh (`tev_jax.sharding.make_mesh`).
        The parameters, both caches and the loop state get explicit shardings: batch
        rows over data and fsdp; heads, MLP and vocabulary over tensor; parameters'
        ``embed`` axis over fsdp (gathered when used: use ``data`` instead to keep
        weights whole on every device). The tokens equal the single-device run's.

    Returns:
      A `Generation`: tokens [B, M] (generated only, -1 padded), lengths [B], stats.

    Raises:
      ValueError: an empty prompt list or prompt, a token id outside the vocabulary, a
        cache too short for prompt + M + N, a missing drafter, a mesh that does not
        divide a dimension (the batch, heads, vocabulary, ...: named in the message),
        or non-finite logits seen during generation.
    """
    graphdef, params, tokens_BT, lengths_B, static = _prepare(target, drafter, prompt_ids,
                                                              config, mesh)
    if isinstance(key, int):
        key = jax.random.key(key)
    with _mesh_scope(mesh):
        st = _generate_jit(graphdef, params, tokens_BT, lengths_B, key, static=static)
    return _finish(st, config)


def generate_ar(target, prompt_ids: Sequence[Sequence[int]], config: DecodeConfig,
                key: jax.Array | int = 0, *, mesh=None) -> Generation:
    """Plain autoregressive decoding from the target (the baseline and the reference).

    Same cache, prefill and stopping as `generate`; one target token per round.
    """
    return generate(target, None, prompt_ids, dataclasses.replace(config, builder="none"), key,
                    mesh=mesh)


def compiled_generate(target, drafter, prompt_ids, config: DecodeConfig, key=0, *,
                      mesh=None) -> Callable[[], Generation]:
    """Validates and compiles `generate` once; returns a function that reruns it.

    Each call of the returned function runs the fused generation once and returns its
    `Generation` with ``stats.seconds`` = wall time of the jitted call up to
    ``block_until_ready`` (host checks excluded). Benchmarks compile every
    configuration first and then time them round-robin.
    """
    graphdef, params, tokens_BT, lengths_B, static = _prepare(target, drafter, prompt_ids,
                                                              config, mesh)
    if isinstance(key, int):
        key = jax.random.key(key)

    def call():
        with _mesh_scope(mesh):
            return jax.block_until_ready(
                _generate_jit(graphdef, params, tokens_BT, lengths_B, key, static=static))

    call()

    def run() -> Generation:
        t0 = time.perf_counter()
        st = call()
        return _finish(st, config, seconds=time.perf_counter() - t0)

    return run


def timed_generate(target, drafter, prompt_ids, config: DecodeConfig, key=0, *,
                   repeats: int = 3, mesh=None) -> Generation:
    """`generate` after a compile call; ``stats.seconds`` = median over ``repeats`` runs."""
    run = compiled_generate(target, drafter, prompt_ids, config, key, mesh=mesh)
    gens = [run() for _ in range(max(repeats, 1))]
    seconds = float(np.median([g.stats.seconds for g in gens]))
    return dataclasses.replace(gens[-1], stats=dataclasses.replace(gens[-1].stats,
                                                                   seconds=seconds))


# ------------------------------------------------------------ continuous batching
#
# Two jitted programs over one decode state of B row slots (the host loop that uses
# them is `tev_jax.batching`): `refill_slots` prefills K new prompts into a small state
# with `_prefill` and scatters its rows into the big state at given slots;
# `run_rounds` runs `_round` until some more rows have finished. ``state.round`` keeps
# counting across requests, so the per-round records (``block_len_RB``) are not
# per-request there; a request's statistics come from ``rounds_B`` and ``start_B``.


def prepare_slots(target, drafter, config: DecodeConfig, batch_size: int, mesh=None):
    """Host checks for a state of ``batch_size`` slots; -> (graphdef, params, static, axes).

    ``config.prompt_len`` (required) is the longest prompt any slot takes; the cache
    length is the one `generate` would pick for that prompt buffer. With a ``mesh`` the
    parameters and the state are laid out as in `generate`. ``axes`` is the row axis of
    every `DecodeState` leaf (None for the per-batch scalars), for `refill_slots`.
    """
    if not isinstance(config, DecodeConfig) or config.prompt_len is None:
        raise ValueError("continuous batching needs a DecodeConfig with prompt_len set "
                         "(the longest prompt a slot can take)")
    if config.track_exit_law:
        raise ValueError("track_exit_law records per round of the whole batch; it is not "
                         "supported with continuous batching")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    graphdef, params, static = _setup(target, drafter, config, batch_size, config.prompt_len,
                                      mesh)
    axes = []
    with _mesh_scope(mesh):
        shapes = [jax.tree.leaves(_state_shapes(graphdef, params, static, rows))
                  for rows in (1, 2)]
    for one, two in zip(*shapes):
        diff = [i for i, (a, b) in enumerate(zip(one.shape, two.shape)) if a != b]
        axes.append(diff[0] if diff else None)
    return graphdef, params, static, tuple(axes)


def _state_shapes(graphdef, params, static: _Static, rows: int) -> DecodeState:
    return jax.eval_shape(
        functools.partial(_prefill, graphdef, static=static), params,
        jax.ShapeDtypeStruct((rows, _LEN_ALIGN), jnp.int32),
        jax.ShapeDtypeStruct((rows,), jnp.int32), jax.eval_shape(jax.random.key, 0))


def empty_slots(graphdef, params, static: _Static, batch: int, key) -> DecodeState:
    """A state of ``batch`` free slots (every row done, nothing in flight)."""
    def zeros(s):
        if jnp.issubdtype(s.dtype, jax.dtypes.prng_key):
            return key
        return jnp.zeros(s.shape, s.dtype)

    st = jax.tree.map(zeros, _state_shapes(graphdef, params, static, batch))
    return st.replace(done_B=jnp.ones((batch,), bool))


@functools.partial(jax.jit, static_argnames=("graphdef", "static", "axes"),
                   donate_argnames=("st",))
def _refill_jit(graphdef, params, st, tokens_KT, lengths_K, slots_K, key, *, static, axes):
    new = _prefill(graphdef, params, tokens_KT, lengths_K, key, static=static)
    big, treedef = jax.tree.flatten(st)

    def put(axis, old, fresh):
        if axis is None:  # per-batch scalars: keep the loop's key and round, OR the flags
            return old | fresh if old.dtype == jnp.bool_ else old
        return old.at[(slice(None),) * axis + (slots_K,)].set(fresh, mode="drop")

    st = treedef.unflatten([put(a, o, f) for a, o, f in zip(axes, big, jax.tree.leaves(new))])
    return _constrain_state(st, _merge(graphdef, params)[1], static)


def refill_slots(graphdef, params, st: DecodeState, tokens_KT, lengths_K, slots_K, key, *,
                 static: _Static, axes: tuple[int | None, ...]) -> DecodeState:
    """Prefills K prompts into the given slots of ``st`` (donated); other rows unchanged.

    Args:
      graphdef, params, static, axes: from `prepare_slots`.
      st: the batch state ([B] rows).
      tokens_KT: int32 [K, T] the prompts, zero-padded (T a bucket width <= prompt_len).
      lengths_K: int32 [K] prompt lengths (>= 1).
      slots_K: int32 [K] the row of ``st`` each prompt goes to; ``>= B`` drops the
        prompt (padding rows of a bucketed K).
      key: PRNG key of the prefill's first token.

    Returns:
      The state with those rows freshly prefilled (t0 sampled, rounds 0).
    """
    with _mesh_scope(static.mesh):
        return _refill_jit(graphdef, params, st, tokens_KT, lengths_K, slots_K, key,
                           static=static, axes=axes)


@functools.partial(jax.jit, static_argnames=("graphdef", "static"), donate_argnames=("st",))
def _run_rounds_jit(graphdef, params, st, until_done, max_rounds, *, static):
    drafter = _merge(graphdef, params)[1]
    pin = lambda s: _constrain_state(s, drafter, static)

    def running(carry):
        s, i = carry
        return (jnp.any(~s.done_B) & (jnp.sum(s.done_B.astype(jnp.int32)) < until_done)
                & (i < max_rounds))

    st, _ = jax.lax.while_loop(
        running, lambda c: (pin(_round(graphdef, params, c[0], static=static)), c[1] + 1),
        (st, jnp.zeros((), jnp.int32)))
    return st


def run_rounds(graphdef, params, st: DecodeState, until_done: int, max_rounds: int, *,
               static: _Static) -> DecodeState:
    """Runs rounds until ``until_done`` rows are done, all are, or ``max_rounds`` ran.

    Both bounds are traced, so every call reuses one compilation. ``st`` is donated.
    """
    with _mesh_scope(static.mesh):
        return _run_rounds_jit(graphdef, params, st, jnp.int32(until_done),
                               jnp.int32(max_rounds), static=static)


# ---------------------------------------------------------------------- profiling path


# The config fields each stage reads; the others are reset to their defaults so that
# configurations differing only elsewhere share that stage's compilation.
_STAGE_FIELDS = {
    "prefill": ("max_new_tokens", "sampling", "stop_token_ids", "prefill_chunk"),
    "draft": (),
    "build": ("builder", "budget"),
    "verify": (),
    "decide": ("builder", "verifier", "sampling"),
    "commit": ("max_new_tokens", "stop_token_ids", "track_exit_law", "sampling"),
}


def _reduced(static: _Static, stage: str) -> _Static:
    keep = {f: getattr(static.config, f) for f in _STAGE_FIELDS[stage]}
    if stage == "decide" and keep["builder"] != "none":
        keep["builder"] = "chain"  # decide only asks whether there is a tree
    if stage == "commit" and not keep["track_exit_law"]:
        keep.pop("sampling")
    if "verifier" not in keep and "sampling" in keep:
        keep["verifier"] = "tev"  # any verifier is valid with any sampling
    return dataclasses.replace(static, config=dataclasses.replace(_CANONICAL, **keep),
                               num_slots=0)


_CANONICAL = DecodeConfig(verifier="tev")
_STAGES = {"prefill": _prefill, "draft": _stage_draft, "build": _stage_build,
           "verify": _stage_verify, "decide": _stage_decide, "commit": _stage_commit}
_GRAPH_STAGES = ("prefill", "draft", "verify")


@functools.lru_cache(maxsize=None)
def _stage_fn(stage: str, static: _Static, graphdef=None):
    # The graphdef is bound here rather than passed as a static argument: hashing it on
    # every call would add a dispatch cost that dwarfs small stages.
    if stage in _GRAPH_STAGES:
        return jax.jit(functools.partial(_STAGES[stage], graphdef, static=static))
    return jax.jit(functools.partial(_STAGES[stage], static=static))


def _stage_fns(static: _Static, graphdef) -> dict[str, Callable]:
    fns = {stage: _stage_fn(stage, _reduced(static, stage),
                            graphdef if stage in _GRAPH_STAGES else None)
           for stage in _STAGES}
    fns["split"] = _split
    return fns


_split = jax.jit(jax.random.split)


def profile_generate(target, drafter, prompt_ids, config: DecodeConfig, key=0, *,
                     warmup: bool = True, mesh=None) -> Generation:
    """The un-fused path: every stage jitted separately and timed per round.

    Runs the same stage functions as the fused loop of `generate`, so it produces the
    same tokens for the same key. A stage is compiled once per setting of the config
    fields it reads (changing the verifier recompiles only the decide stage).
    ``stats.stage_seconds`` holds each stage's wall time up to ``block_until_ready``,
    summed over rounds; with ``warmup`` a first pass over the prefill and the first
    round compiles every stage before anything is timed (without it the times include
    compilation). Each stage's time includes its dispatch overhead, so the sum exceeds
    the fused loop's time. ``mesh`` as in `generate` (the stages run under it).
    """
    with _mesh_scope(mesh):
        return _profile(target, drafter, prompt_ids, config, key, warmup, mesh)


def _profile(target, drafter, prompt_ids, config, key, warmup, mesh) -> Generation:
    graphdef, params, tokens_BT, lengths_B, static = _prepare(target, drafter, prompt_ids,
                                                              config, mesh)
    if isinstance(key, int):
        key = jax.random.key(key)
    fns = _stage_fns(static, graphdef)
    m = config.max_new_tokens
    times = {k: [] for k in ("prefill", "draft", "build", "verify", "decide", "commit")}

    def one_round(st, record: bool):
        def timed(name, fn, *args, **kw):
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn(*args, **kw))
            if record:
                times[name].append(time.perf_counter() - t0)
            return out

        if static.has_drafter:
            draft_logits, ctx = timed("draft", fns["draft"], params, st)
        else:
            draft_logits, ctx = None, st.ctx
            if record:
                times["draft"].append(0.0)
        tree = timed("build", fns["build"], draft_logits, st.root_B)
        logits, feats, cache = timed("verify", fns["verify"], params, st.cache, tree,
                                     st.start_B)
        key, sub = fns["split"](st.key)
        verdict = timed("decide", fns["decide"], sub, tree, logits)
        return timed("commit", fns["commit"], st, ctx, draft_logits, tree, logits, feats,
                     cache, verdict, key)

    prefill = lambda: jax.block_until_ready(
        fns["prefill"](params, tokens_BT, lengths_B, key))
    if warmup:
        prefill()
    t0 = time.perf_counter()
    st = prefill()
    times["prefill"].append(time.perf_counter() - t0)
    if warmup and bool(np.any(~np.asarray(st.done_B))):
        one_round(st, record=False)
    start = time.perf_counter()
    while int(st.round) < m and bool(np.any(~np.asarray(st.done_B))):
        st = one_round(st, record=True)
    seconds = time.perf_counter() - start + times["prefill"][0]
    rounds = {k: np.asarray(v) for k, v in times.items()}
    return _finish(st, config, stage_seconds={k: float(v.sum()) for k, v in rounds.items()},
                   round_seconds=rounds, seconds=seconds)
