"""The speculative decoding loop (docs/design.md §7): its state, its stages, its programs.

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

A whole generation is `prefill` then one ``lax.while_loop`` of `decode_round`
(`generation`): B rows run in lock-step, each with its own start, tree and stop; a
finished row stops changing (its updates are masked and its forward passes only write
scratch slots past its committed length). With ``builder='none'`` the tree is the root
alone and a round is one autoregressive step of the target: the AR baseline. The slot
programs of continuous batching (`refill`, `rounds_until`) run the same round over a
state whose rows are refilled one by one.

Everything here is un-jitted and reads its shapes from a `DecodeSpec` (static). The
models come in as ``(graphdef, params)`` of ``nnx.split((target, drafter))`` (so a
drafter that shares the target's embedding or head is not copied) and are merged inside
the traced function. `tev_jax.engine.Engine` builds the spec, places the parameters and
jits these functions; use it rather than calling them directly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import NamedSharding

from tev_jax import extensions
from tev_jax import sharding as shd
from tev_jax import verify as verify_lib
from tev_jax.budget import AutoBudget
from tev_jax.exit_law import exit_law
from tev_jax.models import kv_cache as kvc
from tev_jax.sampling import PER_ROW, Sampling, SamplingRows
from tev_jax.trace import RoundRecord, round_record
from tev_jax.tree import DraftTree, ancestor_mask
from tev_jax.vocab import row_scores, sample_token

PAD_TOKEN = -1
LEN_ALIGN = 8  # prompt and cache lengths are rounded up to this, to share compilations
STAGES = ("draft", "build", "verify", "decide", "commit")


def aligned_len(n: int) -> int:
    """``n`` rounded up to a multiple of `LEN_ALIGN` (prompt and cache lengths)."""
    return -(-n // LEN_ALIGN) * LEN_ALIGN


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
      budget: DDTree node budget (non-root nodes); ignored by the other builders. An
        `AutoBudget` (or ``'auto'`` with ``tuning``) picks it per batch size from a
        tuning (`tev_jax.costs.tune`); `tev_jax.budget.resolve_budget` turns it into an int
        (or into plain AR, where the tuning says so) before an engine is built.
      verifier: 'tev', 'predraw', 'sequential', 'greedy' (T = 0 only), or a callable
        ``(key, tree, target_logits_NV, sampling, *, horizon) -> Verdict`` (for
        experiments and tests). Ignored when ``builder='none'``.
      sampling: the target's sampling transform (default greedy, T = 0), the same for
        every row and static in the programs; or `tev_jax.sampling.PER_ROW`: each row's
        own, given with its prompt (``Engine.prompts(..., sampling=...)``, ``refill``)
        and held in the state (``DecodeState.sampling_B``), so that one program serves
        every setting, at the cost of one transformed [B, N, V] buffer per round
        (`tev_jax.vocab.row_scores`).
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
      tuning: with ``budget='auto'``, the tuning file (``tev-jax tune --json FILE``) whose
        table becomes the `AutoBudget`; ignored otherwise.
    """

    max_new_tokens: int = 256
    builder: str | extensions.TreeBuilder = "ddtree"
    budget: int | AutoBudget = 64
    verifier: str | extensions.Verifier = "tev"
    sampling: Sampling | str = Sampling(temperature=0.0)
    stop_token_ids: tuple[int, ...] = ()
    prompt_len: int | None = None
    max_cache_len: int | None = None
    track_exit_law: bool = False
    prefill_chunk: int | None = 512
    tuning: str | None = None

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if self.budget == "auto":
            if self.tuning is None:
                raise ValueError("budget='auto' needs a tuning file: DecodeConfig(budget='auto', "
                                 "tuning='tune.json'), written by `tev-jax tune --json FILE`")
            object.__setattr__(self, "budget", AutoBudget.load(self.tuning))
        if not isinstance(self.builder, str):
            extensions.check_hashable(self.builder, "builder")
        else:
            extensions.resolve_builder(self.builder, self.budget)
        if self.builder == "ddtree" and not isinstance(self.budget, AutoBudget) and (
                not isinstance(self.budget, int) or self.budget < 1):
            raise ValueError(f"budget must be a positive int or 'auto' for builder='ddtree', "
                             f"got {self.budget!r}")
        if isinstance(self.verifier, str):
            extensions.resolve_verifier(self.verifier)
        else:
            extensions.check_hashable(self.verifier, "verifier")
        if not isinstance(self.sampling, Sampling) and self.sampling != PER_ROW:
            raise ValueError(f"sampling must be a Sampling or {PER_ROW!r}, got "
                             f"{self.sampling!r}")
        if (self.verifier == "greedy" and self.builder != "none"
                and not (self.sampling != PER_ROW and self.sampling.greedy)):
            t = "per row" if self.sampling == PER_ROW else self.sampling.temperature
            raise ValueError(f"verifier='greedy' is exact only at temperature 0; got "
                             f"temperature={t} (use 'tev', 'predraw' or 'sequential')")
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
class DecodeSpec:
    """Everything that decides the decode programs' shapes and code paths (hashable: it
    is the static argument of every program).

    Attributes:
      config: the `DecodeConfig`.
      batch_size: B, rows of the decode state.
      prompt_len: P, the prompt buffer the cache was sized for.
      horizon: H, draft rows per round (0 without a drafter).
      num_slots: N, tree slots per row, root included.
      taps: the target layers whose hidden states feed the drafter.
      max_len: L, target and drafter cache slots.
      has_drafter: whether a drafter is split with the target.
      mesh: the ``jax.sharding.Mesh`` of the explicit shardings, or None.
    """

    config: DecodeConfig
    batch_size: int
    prompt_len: int
    horizon: int
    num_slots: int
    taps: tuple[int, ...]
    max_len: int
    has_drafter: bool
    mesh: Any = None


@struct.dataclass
class DecodeState:
    """The loop state: fixed buffers plus lengths and masks.

    Attributes:
      key_B: PRNG key [B], each row's own for its whole generation (`step_keys`).
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
      experts_RL: int32 [M, layers] distinct experts each layer's mixture ran per round
        (the tree pass over all B rows; 0 for dense layers); [M, 0] for a target
        without a mixture.
      bad_target: bool [] a target logit was NaN or +inf.
      bad_draft: bool [] a draft logit was NaN or +inf.
      sampling_B: each row's `SamplingRows` [B] with ``sampling=PER_ROW``, else None.
    """

    key_B: jax.Array
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
    experts_RL: jax.Array
    bad_target: jax.Array
    bad_draft: jax.Array
    sampling_B: SamplingRows | None = None


# ---------------------------------------------------------------- explicit shardings
#
# With a mesh, every buffer of the loop state has a logical layout: batch rows over
# ``data`` and ``fsdp``, key/value heads of both caches over ``tensor`` (the rules of
# `tev_jax.sharding`). The state is constrained to it after the prefill and after every
# round, so the while_loop's carry has one fixed sharding that GSPMD cannot drift from.


def state_axes(st: DecodeState, drafter) -> DecodeState:
    """Logical axis names (tuples) of every state field; None = left to GSPMD."""
    b = ("batch",)
    ctx_axes = getattr(drafter, "context_axes", None)
    return DecodeState(
        key_B=b, round=(), cache=kvc.cache_axes(st.cache),
        ctx=None if ctx_axes is None else ctx_axes(st.ctx),
        start_B=b, root_B=b, new_tokens_BP=("batch", None),
        new_feats_BPF=("batch", None, None), new_count_B=b, out_BM=("batch", None),
        num_out_B=b, done_B=b, rounds_B=b, moved_B=b, block_len_RB=(None, "batch"),
        expected_len_RB=(None, "batch"), experts_RL=(), bad_target=(), bad_draft=(),
        sampling_B=None if st.sampling_B is None else SamplingRows(b, b, b, b))


def _is_names(x) -> bool:
    return x is None or (isinstance(x, tuple) and all(n is None or isinstance(n, str)
                                                      for n in x))


def constrain_state(st: DecodeState, drafter, spec: DecodeSpec) -> DecodeState:
    """Pins every state buffer to its layout on ``spec.mesh`` (no-op without one)."""
    if spec.mesh is None:
        return st
    mesh = spec.mesh

    def pin(names, x):
        if names is None:
            return x
        pspec = shd.logical_to_spec(names, x.shape, mesh)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, pspec))

    return jax.tree.map(pin, state_axes(st, drafter), st, is_leaf=_is_names)


def _not_finite(x: jax.Array) -> jax.Array:
    return jnp.isnan(x) | (x == jnp.inf)


def _stop_mask(tokens: jax.Array, stop_ids: tuple[int, ...]) -> jax.Array:
    if not stop_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(stop_ids, jnp.int32))


def _stops(sampling_B: SamplingRows | None, b: int) -> jax.Array:
    """bool [B]: which rows end at a stop token (all but the per-row ``stops=False``)."""
    return jnp.ones((b,), bool) if sampling_B is None else sampling_B.stops


def merge_models(graphdef, params):
    """``(target, drafter or None)`` from the split models."""
    models = nnx.merge(graphdef, params)
    return models[0], (models[1] if len(models) > 1 else None)


# ------------------------------------------------------------------------ the stages


def row_sampling(spec: DecodeSpec, sampling_B: SamplingRows | None):
    """The setting the programs of ``spec`` sample with: the config's, or with
    `PER_ROW` the rows' (a ValueError while tracing when one is given without the
    other)."""
    per_row = spec.config.sampling == PER_ROW
    if per_row != (sampling_B is not None):
        raise ValueError("sampling=PER_ROW needs each row's setting (SamplingRows), and "
                         "only it takes them" if per_row else
                         f"this config samples every row with {spec.config.sampling}; "
                         "per-row settings need DecodeConfig(sampling='per_row')")
    return sampling_B if per_row else spec.config.sampling


def prefill(graphdef, params, tokens_BT, lengths_B, key_B, sampling_B=None, *,
            spec: DecodeSpec) -> DecodeState:
    """Consumes the prompts, samples t0 (row b's with ``step_keys(key_B, 0)[b]``), gives
    the prompt's taps to the drafter. ``key_B``: each row's key (`row_keys`);
    ``sampling_B``: each row's `SamplingRows` with ``sampling=PER_ROW``, else None."""
    target, drafter = merge_models(graphdef, params)
    cfg = spec.config
    sampling = row_sampling(spec, sampling_B)
    b, t = tokens_BT.shape
    h, m = spec.horizon, cfg.max_new_tokens
    cache = target.init_cache(b, spec.max_len)
    logits_BV, feats_BTF, cache = target.prefill(cache, tokens_BT, lengths_B, taps=spec.taps,
                                                 chunk=cfg.prefill_chunk)
    t0_B = sample_token(step_keys(key_B, jnp.zeros((b,), jnp.int32)), logits_BV, sampling)
    if feats_BTF is None:
        feats_BTF = jnp.zeros((b, t, 0), jnp.float32)
    zeros_B = jnp.zeros((b,), jnp.int32)
    ctx = ()
    if drafter is not None:
        ctx = drafter.init_context(target, b, spec.max_len)
        ctx = drafter.extend_context(target, ctx, tokens_BT, feats_BTF, zeros_B, lengths_B)
    out_BM = jnp.full((b, m), PAD_TOKEN, jnp.int32).at[:, 0].set(t0_B)
    return DecodeState(
        key_B=key_B,
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
        done_B=(_stop_mask(t0_B, cfg.stop_token_ids) & _stops(sampling_B, b)) | (m <= 1),
        rounds_B=zeros_B,
        moved_B=zeros_B,
        block_len_RB=jnp.zeros((m, b), jnp.int32),
        expected_len_RB=jnp.zeros((m, b), jnp.float32),
        experts_RL=jnp.zeros((m, target.config.num_layers if _has_experts(target) else 0),
                             jnp.int32),
        bad_target=jnp.any(_not_finite(logits_BV)),
        bad_draft=jnp.zeros((), bool),
        sampling_B=sampling_B,
    )


def draft_stage(graphdef, params, st: DecodeState, *, spec: DecodeSpec):
    """Drafter: consume the last committed path, then draft the block. -> (logits, ctx);
    the logits are None when the builder does not read them
    (`tev_jax.extensions.reads_draft_logits`)."""
    target, drafter = merge_models(graphdef, params)
    if drafter is None:
        return None, st.ctx
    ctx = drafter.extend_context(target, st.ctx, st.new_tokens_BP, st.new_feats_BPF,
                                 st.start_B - st.new_count_B, st.new_count_B)
    if not extensions.reads_draft_logits(
            extensions.resolve_builder(spec.config.builder, spec.config.budget)):
        return None, ctx  # AR rounds that keep the drafter's context (root-only trees)
    logits_BHV, ctx = drafter.draft(target, ctx, st.root_B, st.start_B)
    want = (st.root_B.shape[0], spec.horizon, target.config.vocab_size)
    if logits_BHV.shape != want:  # raised while tracing, i.e. on the host
        raise ValueError(f"the drafter returned draft logits of shape {logits_BHV.shape}; "
                         f"expected [B, H, V] = {list(want)}")
    return logits_BHV.astype(jnp.float32), ctx


def build_stage(draft_logits_BHV, root_B, *, spec: DecodeSpec) -> DraftTree:
    """The draft tree of every row (root = the pending token): the builder over the batch
    (its ``batched`` form when it has one, e.g. DDTree's batch-level top-k)."""
    builder = extensions.resolve_builder(spec.config.builder, spec.config.budget)
    return extensions.batched(builder)(draft_logits_BHV, root_B)


def _has_experts(target) -> bool:
    return target.config.num_experts > 0


def verify_stage(graphdef, params, cache, tree: DraftTree, start_B, *, spec: DecodeSpec):
    """Target tree pass. -> (logits [B, N, V], taps [B, N, F] or None, cache, experts
    int32 [layers] distinct experts each layer ran, or None without a mixture)."""
    target, _ = merge_models(graphdef, params)
    anc_BNN = jax.vmap(ancestor_mask)(tree)
    if not _has_experts(target):
        return target.verify_tree(cache, tree.tokens, tree.depths, anc_BNN, start_B,
                                  taps=spec.taps) + (None,)
    return target.verify_tree(cache, tree.tokens, tree.depths, anc_BNN, start_B,
                              taps=spec.taps, experts_touched=True)


def per_row_logits(logits_BNV, sampling_B: SamplingRows | None, spec: DecodeSpec):
    """(what the verifier reads, its static setting): the logits and the config's
    setting, or with `PER_ROW` each row's transformed log-weights
    (`tev_jax.vocab.row_scores`) and T = 1, under which they are the rows' own
    distributions."""
    sampling = row_sampling(spec, sampling_B)
    if sampling_B is None:
        return logits_BNV, sampling
    return row_scores(logits_BNV, sampling_B).x, Sampling(temperature=1.0)


def decide_stage(key_B, tree: DraftTree, logits_BNV, sampling_B=None, *, spec: DecodeSpec
                 ) -> verify_lib.Verdict:
    """The verifier on every row, row b with the key ``key_B[b]`` (`step_keys`) and,
    with `PER_ROW`, its setting ``sampling_B`` (`per_row_logits`)."""
    cfg = spec.config
    h = spec.horizon
    b = logits_BNV.shape[0]
    if cfg.builder == "none":
        bonus_B = sample_token(key_B, logits_BNV[:, 0], row_sampling(spec, sampling_B))
        zeros_B = jnp.zeros((b,), jnp.int32)
        return verify_lib.Verdict(path=jnp.zeros((b, 1), jnp.int32), length=zeros_B + 1,
                                  bonus=bonus_B, exit_node=zeros_B)
    fn = extensions.resolve_verifier(cfg.verifier)
    logits_BNV, sampling = per_row_logits(logits_BNV, sampling_B, spec)
    return jax.vmap(lambda k, t, l: fn(k, t, l, sampling, horizon=h))(key_B, tree, logits_BNV)


def commit_stage(st: DecodeState, ctx, draft_logits_BHV, tree: DraftTree, logits_BNV,
                 feats_BNF, cache, verdict: verify_lib.Verdict, experts_L=None, *,
                 spec: DecodeSpec) -> DecodeState:
    """Moves the accepted path's KV, emits the block, updates every active row
    (``experts_L``: the verify stage's experts per layer, recorded for the round)."""
    cfg = spec.config
    b = st.start_B.shape[0]
    p = spec.horizon + 1
    m = cfg.max_new_tokens
    active_B = ~st.done_B
    length_B = jnp.where(active_B, verdict.length, 0)
    if tree.tokens.shape[-1] > 1:  # a one-slot tree (AR) is already where it belongs
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
    stop_BP = (_stop_mask(block_BP, cfg.stop_token_ids) & in_block_BP
               & _stops(st.sampling_B, b)[:, None])
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
        law_logits_BNV, sampling = per_row_logits(logits_BNV, st.sampling_B, spec)
        law = jax.vmap(lambda t, l: exit_law(t, l, sampling))(tree, law_logits_BNV)
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
        key_B=st.key_B,
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
        experts_RL=(st.experts_RL if experts_L is None else
                    st.experts_RL.at[st.round].set(experts_L, mode="drop")),
        bad_target=bad_target,
        bad_draft=bad_draft,
        sampling_B=st.sampling_B,
    )


def row_keys(key: jax.Array, index_B) -> jax.Array:
    """The key schedule, part one: row i of a generation of key ``key`` has the key
    ``fold_in(key, i)``; -> the keys of the rows ``index_B`` (int [B]). A row's key is
    its index, whatever the batch size or the rows beside it."""
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.asarray(index_B, jnp.int32))


def step_keys(key_B: jax.Array, step_B: jax.Array) -> jax.Array:
    """The key schedule, part two: row b draws its first token with ``fold_in(key_b, 0)``
    and its r-th round's verdict (r = 1, 2, ...) with ``fold_in(key_b, r)``. Each row's
    random numbers depend on its own key and rounds only: the same prompt with the same
    row key gives the same tokens in any batch, slot or join time (`tev_jax.batch.continuous`,
    the server's per-request seed). Every path (the fused loop, `traced_round`, the
    profiler's stages) draws through this function; `tev_jax.trace` states the schedule.
    """
    return jax.vmap(jax.random.fold_in)(key_B, step_B)


def round_step_keys(st: DecodeState) -> jax.Array:
    """The keys of a round's decide stage: `step_keys` at each row's next round."""
    return step_keys(st.key_B, st.rounds_B + 1)


def traced_round(graphdef, params, st: DecodeState, *, spec: DecodeSpec
                 ) -> tuple[DecodeState, RoundRecord]:
    """One fused round and its `tev_jax.trace.RoundRecord` (tree, draft log-probabilities,
    verdict); the state is `decode_round`'s."""
    with jax.named_scope("draft"):
        draft_logits, ctx = draft_stage(graphdef, params, st, spec=spec)
    with jax.named_scope("build"):
        tree = build_stage(draft_logits, st.root_B, spec=spec)
    with jax.named_scope("verify"):
        logits, feats, cache, experts = verify_stage(graphdef, params, st.cache, tree,
                                                      st.start_B, spec=spec)
    with jax.named_scope("decide"):
        verdict = decide_stage(round_step_keys(st), tree, logits, st.sampling_B, spec=spec)
    with jax.named_scope("commit"):
        new = commit_stage(st, ctx, draft_logits, tree, logits, feats, cache, verdict,
                           experts, spec=spec)
    return new, round_record(st.start_B, st.done_B, draft_logits, tree, logits, verdict)


def decode_round(graphdef, params, st: DecodeState, *, spec: DecodeSpec) -> DecodeState:
    """One fused round: draft, build, verify, decide, commit (each under a
    ``jax.named_scope`` of its name, so a compiled op names its stage); `traced_round`
    without the record (which the compiler then drops)."""
    return traced_round(graphdef, params, st, spec=spec)[0]


def running(st: DecodeState, max_new_tokens: int) -> jax.Array:
    """Whether a generation goes on: some row is active and fewer than M rounds ran."""
    return jnp.any(~st.done_B) & (st.round < max_new_tokens)


def generation(graphdef, params, tokens_BT, lengths_B, key, sampling_B=None, *,
               spec: DecodeSpec) -> DecodeState:
    """A whole generation: `prefill`, then `decode_round` until every row is done.

    Args:
      graphdef, params: ``nnx.split((target,))`` or ``nnx.split((target, drafter))``.
      tokens_BT: int32 [B, T] prompts, zero-padded; lengths_B: int32 [B] their lengths.
      key: PRNG key of the whole generation (row b's is ``row_keys(key, [b])``).
      sampling_B: each row's `SamplingRows` with ``sampling=PER_ROW``, else None.
      spec: the `DecodeSpec`.
    Returns:
      The final `DecodeState` (``out_BM``, ``num_out_B`` and the per-round records).
    """
    drafter = merge_models(graphdef, params)[1]
    pin = lambda st: constrain_state(st, drafter, spec)
    st = pin(prefill(graphdef, params, tokens_BT, lengths_B,
                     row_keys(key, jnp.arange(tokens_BT.shape[0])), sampling_B, spec=spec))
    return jax.lax.while_loop(
        lambda s: running(s, spec.config.max_new_tokens),
        lambda s: pin(decode_round(graphdef, params, s, spec=spec)),
        st,
    )


def rounds_until(graphdef, params, st: DecodeState, until_done, max_rounds, *,
                 spec: DecodeSpec) -> DecodeState:
    """Runs rounds until ``until_done`` rows are done, all are, or ``max_rounds`` ran
    (both int32 scalars, traced)."""
    drafter = merge_models(graphdef, params)[1]
    pin = lambda s: constrain_state(s, drafter, spec)

    def more(carry):
        s, i = carry
        return (jnp.any(~s.done_B) & (jnp.sum(s.done_B.astype(jnp.int32)) < until_done)
                & (i < max_rounds))

    st, _ = jax.lax.while_loop(
        more, lambda c: (pin(decode_round(graphdef, params, c[0], spec=spec)), c[1] + 1),
        (st, jnp.zeros((), jnp.int32)))
    return st


__all__ = ["LEN_ALIGN", "PAD_TOKEN", "STAGES", "DecodeConfig", "DecodeSpec",
           "DecodeState", "aligned_len", "build_stage", "commit_stage",
           "constrain_state", "decide_stage", "decode_round", "draft_stage",
           "generation", "merge_models", "per_row_logits", "prefill", "round_step_keys",
           "row_keys", "row_sampling", "rounds_until", "running", "state_axes",
           "step_keys", "traced_round", "verify_stage"]
