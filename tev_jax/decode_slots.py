"""The decode state's row slots, for continuous batching (docs/design.md §7): an empty
state of B free slots, the refill program that prefills K new prompts into given slots,
and the moves of rows between states of different slot counts.

Two programs run over one state (the host driver is `tev_jax.slots`): `refill`
prefills K prompts into a small state with `tev_jax.decode.prefill` and scatters its
rows into the big state at given slots; `tev_jax.decode.rounds_until` runs rounds until
some more rows have finished. ``state.round`` keeps counting across requests, so the
per-round records (``block_len_RB``) are not per-request there; a request's statistics
come from ``rounds_B`` and ``start_B``. Like `tev_jax.decode`, nothing here is jitted:
`tev_jax.engine.Engine` jits these at its call sites.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tev_jax import decode
from tev_jax.decode import DecodeSpec, DecodeState
from tev_jax.sampling import PER_ROW, SamplingRows


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


__all__ = ["abstract_rows", "empty_state", "put_rows", "refill", "row_axes", "state_shapes",
           "take_rows"]
