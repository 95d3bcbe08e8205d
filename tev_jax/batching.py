"""Continuous batching: B row slots, each refilled with the next prompt when it finishes.

`tev_jax.engine.generate` runs a static batch to its end, so every row waits for the longest.
Here the batch is a set of slots over one decode state (DESIGN.md §12)::

    free slots <- prefill the next prompts (bucketed K rows x T tokens, scattered in)
    run rounds until one more row is done            (one jitted while_loop)
    hand the finished rows back; their slots are free again

Both programs are `tev_jax.engine.Engine`'s, compiled once per shape: `run_rounds` once,
`refill` once per
(row bucket, width bucket) it meets, so prompts of any length up to
``config.prompt_len`` reuse a handful of programs. Rows never interact, so at T = 0
every request gets the tokens `tev_jax.engine.generate` gives its prompt alone; at T > 0 each
row is an exact sample of the same distribution (with different random numbers).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from tev_jax import decode, extensions, stop
from tev_jax.budget import AutoBudget, check_tuned_for
from tev_jax import sharding as shd
from tev_jax.engine import Engine, as_key
from tev_jax.prompts import check_prompt


@dataclasses.dataclass(frozen=True)
class Request:
    """One prompt to complete: its id (any JSON value), its token ids and, optionally,
    the index of its row key (`tev_jax.decode.row_keys`; default: its position in the
    stream). A batch job gives each prompt its index in the file, so that a sampled
    output does not depend on the processes, the slots or a resume."""

    id: Any
    prompt_ids: Sequence[int]
    row: int | None = None


@dataclasses.dataclass(frozen=True)
class Result:
    """One finished request.

    Attributes:
      id: the request's id.
      token_ids: the generated tokens (a final stop token included).
      rounds: decoding rounds the request ran (the prefill's first token is no round).
      tau: mean tokens per round (accepted draft tokens + bonus, before truncation at a
        stop token or at M); nan when it ran no round.
      stop_reason: 'stop' (ended with a stop token) or 'length' (hit max_new_tokens).
      prompt_tokens: the prompt's length.
    """

    id: Any
    token_ids: list[int]
    rounds: int
    tau: float
    stop_reason: str
    prompt_tokens: int


def width_buckets(prompt_len: int, count: int = 5) -> tuple[int, ...]:
    """Prompt widths ``prompt_len / 2**i`` (multiples of 8, at least 8), smallest first."""
    if prompt_len < 1 or count < 1:
        raise ValueError(f"prompt_len and count must be positive, got {prompt_len}, {count}")
    align = decode.LEN_ALIGN
    widths = {prompt_len}
    for i in range(1, count):
        widths.add(max(align, -(-(prompt_len >> i) // align) * align))
    return tuple(sorted(w for w in widths if w <= prompt_len))


def row_buckets(batch_size: int) -> tuple[int, ...]:
    """Refill sizes: powers of two below ``batch_size``, then ``batch_size``."""
    rows = [1 << i for i in range(max(batch_size - 1, 1).bit_length()) if 1 << i < batch_size]
    return tuple(rows + [batch_size])


def _bucket(n: int, sizes: Sequence[int]) -> int:
    return next(s for s in sizes if s >= n)


def slot_configs(config: decode.DecodeConfig, batch_size: int, *, mesh=None
                 ) -> dict[int, decode.DecodeConfig]:
    """The round program of each slot count continuous batching may run: slots -> config.

    A fixed budget runs one program of ``batch_size`` slots. An automatic budget
    (`tev_jax.budget.AutoBudget`) also runs the smaller slot counts of `row_buckets`
    (those the mesh divides): once no request is left, the last running rows move onto
    the smallest program that holds them, and each slot count decodes with the budget
    its tuning picks for that batch. All programs share one state layout: one cache
    length (the largest tree's), and where the tuning mixes AR with trees, the AR
    counts keep the drafter's context (`tev_jax.extensions.root_only_builder`) so that
    tree rounds can resume; where it says AR throughout, plain AR without a drafter.
    """
    auto = config.budget if isinstance(config.budget, AutoBudget) else None
    if auto is None:
        return {batch_size: config}
    if config.builder != "ddtree":  # the budget is not read
        return {batch_size: dataclasses.replace(config, budget=64, tuning=None)}
    sizes = [s for s in row_buckets(batch_size) if s == batch_size or _divides(mesh, s)]
    budgets = {s: auto.pick(s) for s in sizes}
    widest = max(budgets.values())
    max_len = config.max_cache_len or decode.aligned_len(
        config.prompt_len + config.max_new_tokens + widest + 1)
    fixed = dataclasses.replace(config, max_cache_len=max_len, tuning=None)
    if widest == 0:
        ar = dataclasses.replace(fixed, builder="none", budget=64)
        return {s: ar for s in sizes}
    return {s: dataclasses.replace(fixed, budget=b) if b else
            dataclasses.replace(fixed, builder=extensions.root_only_builder, budget=64)
            for s, b in budgets.items()}


def fit_batch(batch_size: int, rows: int, mesh=None) -> int:
    """The slots to decode ``rows`` requests with at most ``batch_size`` slots: no more
    than the rows, rounded up to a count the mesh divides (never above ``batch_size``)."""
    batch = max(1, min(batch_size, rows))
    while batch < batch_size and not _divides(mesh, batch):
        batch += 1
    return batch


def _divides(mesh, rows: int) -> bool:
    if mesh is None:
        return True
    try:
        shd.logical_to_spec(("batch",), (rows,), mesh, strict=True)
    except ValueError:
        return False
    return True


def generate_continuous(target, drafter, requests: Iterable[Request],
                        config: decode.DecodeConfig, *, batch_size: int,
                        key: jax.Array | int = 0, widths: Sequence[int] | None = None,
                        max_rounds: int | None = None, mesh=None) -> Iterator[Result]:
    """Decodes every request with continuous batching; yields results as rows finish.

    Requests are read lazily, in order, as slots free up; results come in finishing
    order. With an automatic budget (``config.budget`` an `AutoBudget`) each slot count
    decodes with the budget its tuning picks, and once the requests run out the last
    running rows move onto smaller slot programs (`slot_configs`).

    Args:
      target: a `tev_jax.models.Target`.
      drafter: a drafter (`tev_jax.drafters.DrafterProtocol`); None with ``builder='none'``.
      requests: the prompts (any iterable; consumed lazily).
      config: a `decode.DecodeConfig` with ``prompt_len`` = the longest prompt allowed.
      batch_size: B, the number of row slots.
      key: PRNG key or int seed. The j-th request (from 0) decodes with the row key
        ``decode.row_keys(key, [j])`` (or its ``row``'s), as row j of
        ``tev_jax.generate(..., key)``: its tokens do not depend on the requests beside
        it or on when it joined.
      widths: prompt width buckets (default `width_buckets(config.prompt_len)`).
      max_rounds: return to the host at least every this many rounds (default: only
        when a row finishes).
      mesh: optional mesh (`tev_jax.sharding.make_mesh`): parameters, caches and slots
        laid out as in `tev_jax.engine.generate` (slots over data and fsdp).

    Yields:
      A `Result` per request.

    Raises:
      ValueError: a bad config or batch size, an unusable request (its id named), or
        non-finite logits.
    """
    if not isinstance(config, decode.DecodeConfig) or config.prompt_len is None:
        raise ValueError("continuous batching needs a DecodeConfig with prompt_len set "
                         "(the longest prompt a slot can take)")
    if config.track_exit_law:
        raise ValueError("track_exit_law records per round of the whole batch; it is not "
                         "supported with continuous batching")
    if isinstance(config.budget, AutoBudget) and config.builder == "ddtree":
        check_tuned_for(config.budget, target, drafter)
    configs = slot_configs(config, batch_size, mesh=mesh)
    engines: dict[int, Engine] = {}

    def engine_of(slots: int) -> Engine:
        if slots not in engines:
            c = configs[slots]
            engines[slots] = Engine.create(target, None if c.builder == "none" else drafter,
                                           c, slots, mesh=mesh)
        return engines[slots]

    engine = engine_of(batch_size)
    axes = engine.slot_axes()
    widths = tuple(sorted(widths or width_buckets(config.prompt_len)))
    if widths[-1] < config.prompt_len:
        raise ValueError(f"the widest bucket ({widths[-1]}) is below prompt_len "
                         f"({config.prompt_len})")
    rows = row_buckets(batch_size)
    stop_ids = set(config.stop_token_ids)
    vocab = target.config.vocab_size
    key = as_key(key)
    st = engine.empty_slots(key)
    admitted = 0  # requests read so far (the default row key index of the next)
    in_slot: list[tuple[Any, int] | None] = [None] * batch_size  # (id, prompt length)
    pending = iter(requests)
    exhausted = False
    while True:
        stop.check()  # a safe point: the finished rows are handed back, none is in flight
        free = [i for i, r in enumerate(in_slot) if r is None]
        batch, rows_K = [], []
        while len(batch) < len(free) and not exhausted:
            request = next(pending, None)
            if request is None:
                exhausted = True
            else:
                batch.append((request.id, check_prompt(request.prompt_ids, vocab,
                                                       config.prompt_len,
                                                       what=f"request {request.id!r}")))
                rows_K.append(admitted if request.row is None else request.row)
                admitted += 1
        if batch:
            k, t = _bucket(len(batch), rows), _bucket(max(len(p) for _, p in batch), widths)
            tokens_KT = np.zeros((k, t), np.int32)
            lengths_K = np.ones((k,), np.int32)
            slots_K = np.full((k,), batch_size, np.int32)  # padding rows are dropped
            for j, ((rid, prompt), slot) in enumerate(zip(batch, free)):
                tokens_KT[j, : len(prompt)] = prompt
                lengths_K[j], slots_K[j] = len(prompt), slot
                in_slot[slot] = (rid, len(prompt))
            key_K = decode.row_keys(key, rows_K + [0] * (k - len(batch)))
            st = engine.refill(st, tokens_KT, lengths_K, slots_K, key_K, axes=axes)
        busy = sum(r is not None for r in in_slot)
        if busy == 0:
            return
        slots = len(in_slot)
        smaller = [s for s in configs if busy <= s < slots]
        if exhausted and smaller:  # the tail: the running rows onto a smaller program
            slots = min(smaller)
            keep = ([i for i, r in enumerate(in_slot) if r is not None]
                    + [i for i, r in enumerate(in_slot) if r is None])[:slots]
            engine = engine_of(slots)
            st = engine.take_slots(st, keep, axes=axes)
            in_slot = [in_slot[i] for i in keep]
        st = engine.run_rounds(st, slots - busy + 1, max_rounds or 2**30)
        done_B, num_out_B, rounds_B, start_B, out_BM, bad_target, bad_draft = jax.device_get(
            (st.done_B, st.num_out_B, st.rounds_B, st.start_B, st.out_BM, st.bad_target,
             st.bad_draft))
        if bad_target or bad_draft:
            which = "target" if bad_target else "drafter"
            raise ValueError(f"the {which} produced non-finite logits (NaN or +inf) during "
                             "generation; the output would be garbage")
        for slot, held in enumerate(in_slot):
            if held is None or not done_B[slot]:
                continue
            rid, prompt_tokens = held
            tokens = out_BM[slot, : num_out_B[slot]].tolist()
            rounds = int(rounds_B[slot])
            yield Result(
                id=rid, token_ids=tokens, rounds=rounds,
                tau=(int(start_B[slot]) - prompt_tokens) / rounds if rounds else math.nan,
                stop_reason="stop" if tokens[-1] in stop_ids else "length",
                prompt_tokens=prompt_tokens)
            in_slot[slot] = None
