"""The engine's programs, jitted once, and the decode state's row slots that three of
them run (docs/design.md §7).

The programs are the decode functions of `tev_jax.decode` and the slot functions below
under ``jax.jit``, with the `tev_jax.decode.DecodeSpec` (hashable) and the graphdef
static, so every engine with the same spec and architecture shares a compilation; a
state argument that a program replaces is donated. The stage programs of the un-fused
path (`stage_jit`) are compiled once per setting of the config fields each stage reads.
`tev_jax.engine.Engine` calls them with its models and shapes.

The row slots, for continuous batching: an empty state of B free slots (`empty_state`),
the refill that prefills K new prompts into given slots (`refill`), and the moves of rows
between states of different slot counts (`put_rows`, `take_rows`); the host driver is
`tev_jax.slots`. ``state.round`` keeps counting across requests, so the per-round records
(``block_len_RB``) are not per-request there; a request's statistics come from
``rounds_B`` and ``start_B``. The slot functions are pure; they are jitted only below.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from tev_jax import decode, extensions
from tev_jax.decode import DecodeConfig, DecodeSpec, DecodeState
from tev_jax.sampling import PER_ROW, SamplingRows


# ------------------------------------------------------------------ the row slots


def abstract_rows(rows: int, spec: DecodeSpec) -> SamplingRows | None:
    """Abstract `SamplingRows` of ``rows`` rows with `PER_ROW`, else None."""
    if spec.config.sampling != PER_ROW:
        return None
    return SamplingRows(jax.ShapeDtypeStruct((rows,), jnp.float32),
                        jax.ShapeDtypeStruct((rows,), jnp.int32),
                        jax.ShapeDtypeStruct((rows,), jnp.float32),
                        jax.ShapeDtypeStruct((rows,), jnp.bool_))


def state_shapes(graphdef, params, rows: int, *, spec: DecodeSpec) -> DecodeState:
    """The abstract `DecodeState` of ``rows`` rows (``jax.ShapeDtypeStruct`` leaves)."""
    return jax.eval_shape(
        lambda p, t, n, k, s: decode.prefill(graphdef, p, t, n, k, s, spec=spec), params,
        jax.ShapeDtypeStruct((rows, decode.LEN_ALIGN), jnp.int32),
        jax.ShapeDtypeStruct((rows,), jnp.int32),
        jax.eval_shape(lambda: decode.row_keys(jax.random.key(0), jnp.arange(rows))),
        abstract_rows(rows, spec))


def row_axes(graphdef, params, *, spec: DecodeSpec) -> tuple[int | None, ...]:
    """The row axis of every `DecodeState` leaf (None for the per-batch scalars)."""
    shapes = [jax.tree.leaves(state_shapes(graphdef, params, rows, spec=spec))
              for rows in (1, 2)]
    axes = []
    for one, two in zip(*shapes):
        diff = [i for i, (a, b) in enumerate(zip(one.shape, two.shape)) if a != b]
        axes.append(diff[0] if diff else None)
    return tuple(axes)


def empty_state(graphdef, params, key, *, spec: DecodeSpec) -> DecodeState:
    """A state of ``spec.batch_size`` free slots (every row done, nothing in flight;
    the slots' keys ``tev_jax.decode.row_keys(key, range(B))`` until a prompt fills them)."""
    def zeros(s):
        if jnp.issubdtype(s.dtype, jax.dtypes.prng_key):
            return decode.row_keys(key, jnp.arange(spec.batch_size))
        return jnp.zeros(s.shape, s.dtype)

    st = jax.tree.map(zeros, state_shapes(graphdef, params, spec.batch_size, spec=spec))
    return st.replace(done_B=jnp.ones((spec.batch_size,), bool))


def refill(graphdef, params, st: DecodeState, tokens_KT, lengths_K, slots_K, key_K,
           sampling_K=None, *, spec: DecodeSpec, axes: tuple[int | None, ...]
           ) -> DecodeState:
    """Prefills K prompts into the given slots of ``st``; other rows unchanged.

    Args:
      graphdef, params: as in `tev_jax.decode.generation`.
      st: the batch state ([B] rows).
      tokens_KT: int32 [K, T] the prompts, zero-padded (T a bucket width <= P).
      lengths_K: int32 [K] prompt lengths (>= 1).
      slots_K: int32 [K] the row of ``st`` each prompt goes to; ``>= B`` drops the
        prompt (padding rows of a bucketed K).
      key_K: PRNG key [K], each prompt's row key (`tev_jax.decode.row_keys`: the j-th request of a
        continuous batch has row j's key of a plain generation).
      sampling_K: each prompt's `SamplingRows` [K] with ``sampling=PER_ROW``, else None.
      spec: the `DecodeSpec`; axes: `row_axes`.
    Returns:
      The state with those rows freshly prefilled (t0 sampled, rounds 0).
    """
    new = decode.prefill(graphdef, params, tokens_KT, lengths_K, key_K, sampling_K, spec=spec)
    return put_rows(graphdef, params, st, new, slots_K, spec=spec, axes=axes)


def put_rows(graphdef, params, st: DecodeState, rows: DecodeState, slots_K, *,
             spec: DecodeSpec, axes: tuple[int | None, ...]) -> DecodeState:
    """The K rows of ``rows`` written into the slots ``slots_K`` of ``st`` (a state of the
    same shapes but B rows; ``>= B`` drops a row); the per-batch scalars of ``st`` are
    kept and its flags OR-ed with those of ``rows``. `refill` puts freshly prefilled
    rows; a scheduler that grows its slot count puts the rows of a smaller state into
    an `empty_state`. ``axes`` is `row_axes`."""
    big, treedef = jax.tree.flatten(st)

    def put(axis, old, fresh):
        if axis is None:  # per-batch scalars: keep the loop's round, OR the flags
            return old | fresh if old.dtype == jnp.bool_ else old
        return old.at[(slice(None),) * axis + (slots_K,)].set(fresh, mode="drop")

    st = treedef.unflatten([put(a, o, f) for a, o, f in zip(axes, big, jax.tree.leaves(rows))])
    return decode.constrain_state(st, decode.merge_models(graphdef, params)[1], spec)


def take_rows(graphdef, params, st: DecodeState, rows_K, *, spec: DecodeSpec,
              axes: tuple[int | None, ...]) -> DecodeState:
    """The state of the K rows ``rows_K`` of ``st``, in that order (per-batch scalars
    kept): the rows still running, moved onto a program of ``spec.batch_size`` = K
    slots. ``axes`` is `row_axes` (the same for every batch size)."""
    leaves, treedef = jax.tree.flatten(st)
    taken = [x if a is None else jnp.take(x, rows_K, axis=a) for a, x in zip(axes, leaves)]
    drafter = decode.merge_models(graphdef, params)[1]
    return decode.constrain_state(treedef.unflatten(taken), drafter, spec)


# ------------------------------------------------------------------- the programs


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"))
def generate_jit(graphdef, params, tokens_BT, lengths_B, key, sampling_B=None, *, spec):
    return decode.generation(graphdef, params, tokens_BT, lengths_B, key, sampling_B,
                             spec=spec)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"))
def prefill_jit(graphdef, params, tokens_BT, lengths_B, key, sampling_B=None, *, spec):
    drafter = decode.merge_models(graphdef, params)[1]
    st = decode.prefill(graphdef, params, tokens_BT, lengths_B,
                        decode.row_keys(key, jnp.arange(tokens_BT.shape[0])), sampling_B,
                        spec=spec)
    return decode.constrain_state(st, drafter, spec)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"), donate_argnames=("st",))
def round_jit(graphdef, params, st, *, spec):
    drafter = decode.merge_models(graphdef, params)[1]
    return decode.constrain_state(decode.decode_round(graphdef, params, st, spec=spec),
                                  drafter, spec)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"), donate_argnames=("st",))
def traced_round_jit(graphdef, params, st, *, spec):
    drafter = decode.merge_models(graphdef, params)[1]
    st, record = decode.traced_round(graphdef, params, st, spec=spec)
    return decode.constrain_state(st, drafter, spec), record


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"), donate_argnames=("st",))
def run_jit(graphdef, params, st, *, spec):
    m = spec.config.max_new_tokens
    return decode.rounds_until(graphdef, params, st, spec.batch_size, m - st.round, spec=spec)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "axes"),
                   donate_argnames=("st",))
def refill_jit(graphdef, params, st, tokens_KT, lengths_K, slots_K, key_K, sampling_K, *,
                spec, axes):
    return refill(graphdef, params, st, tokens_KT, lengths_K, slots_K, key_K, sampling_K,
                  spec=spec, axes=axes)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "axes"),
                   donate_argnames=("st",))
def put_rows_jit(graphdef, params, st, rows, slots_K, *, spec, axes):
    return put_rows(graphdef, params, st, rows, slots_K, spec=spec, axes=axes)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "axes"))
def take_rows_jit(graphdef, params, st, rows_K, *, spec, axes):
    return take_rows(graphdef, params, st, rows_K, spec=spec, axes=axes)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"), donate_argnames=("st",))
def run_rounds_jit(graphdef, params, st, until_done, max_rounds, *, spec):
    return decode.rounds_until(graphdef, params, st, until_done, max_rounds, spec=spec)


# The config fields each stage reads; the others are reset to their defaults so that
# configurations differing only elsewhere share that stage's compilation.
_STAGE_FIELDS = {
    "draft": (),
    "build": ("builder", "budget"),
    "verify": (),
    "decide": ("builder", "verifier", "sampling"),
    "commit": ("max_new_tokens", "stop_token_ids", "track_exit_law", "sampling"),
}
_CANONICAL = DecodeConfig(verifier="tev")
_STAGE_FNS = {"draft": decode.draft_stage, "build": decode.build_stage,
              "verify": decode.verify_stage, "decide": decode.decide_stage,
              "commit": decode.commit_stage}
_MODEL_STAGES = ("draft", "verify")


def _stage_spec(spec: DecodeSpec, stage: str) -> DecodeSpec:
    """``spec`` with only the config fields ``stage`` reads (shared compilations)."""
    keep = {f: getattr(spec.config, f) for f in _STAGE_FIELDS[stage]}
    if stage == "draft":  # draft only asks whether the builder reads the block
        builder = extensions.resolve_builder(spec.config.builder, spec.config.budget)
        keep["builder"] = "ddtree" if extensions.reads_draft_logits(builder) else "none"
    if stage == "decide" and keep["builder"] != "none":
        keep["builder"] = "chain"  # decide only asks whether there is a tree
    if stage == "commit" and not keep["track_exit_law"]:
        keep.pop("sampling")
    if "verifier" not in keep and "sampling" in keep:
        keep["verifier"] = "tev"  # any verifier is valid with any sampling
    return dataclasses.replace(spec, config=dataclasses.replace(_CANONICAL, **keep),
                               num_slots=0, prompt_len=0, batch_size=0)


def stage_jit(stage: str, spec: DecodeSpec, graphdef=None):
    """The jitted program of one stage (`tev_jax.decode.STAGES`) for ``spec``, compiled
    once per setting of the config fields it reads; the models' stages (draft, verify)
    have ``graphdef`` bound."""
    if stage not in _STAGE_FNS:
        raise ValueError(f"stage must be one of {decode.STAGES}, got {stage!r}")
    return _stage_jit(stage, _stage_spec(spec, stage),
                      graphdef if stage in _MODEL_STAGES else None)


@functools.lru_cache(maxsize=None)
def _stage_jit(stage: str, spec: DecodeSpec, graphdef=None):
    # The graphdef is bound here rather than passed as a static argument: hashing it on
    # every call would add a dispatch cost that dwarfs small stages.
    fn = _STAGE_FNS[stage]
    if stage in _MODEL_STAGES:
        return jax.jit(functools.partial(fn, graphdef, spec=spec))
    return jax.jit(functools.partial(fn, spec=spec))


__all__ = ["abstract_rows", "empty_state", "generate_jit", "prefill_jit", "put_rows",
           "put_rows_jit", "refill", "refill_jit", "round_jit", "row_axes", "run_jit",
           "run_rounds_jit", "stage_jit", "state_shapes", "take_rows", "take_rows_jit",
           "traced_round_jit"]
