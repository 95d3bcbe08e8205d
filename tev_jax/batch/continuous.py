"""Continuous batching: B row slots, each refilled with the next prompt when it finishes.

`tev_jax.engine.generate` runs a static batch to its end, so every row waits for the longest.
Here the batch is a set of slots over one decode state (docs/design.md §12)::

    free slots <- prefill the next prompts (bucketed K rows x T tokens, scattered in)
    run rounds until one more row is done            (one jitted while_loop)
    hand the finished rows back; their slots are free again

The slots are `tev_jax.slots.Slots` (the driver the server's scheduler uses too); their
programs are `tev_jax.engine.Engine`'s, compiled once per shape: `run_rounds` once,
`refill` once per (row bucket, width bucket) it meets, so prompts of any length up to
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

from tev_jax import decode
from tev_jax.budget import AutoBudget, check_tuned_for
from tev_jax.engine import as_key
from tev_jax.prompts import Request, check_prompt
from tev_jax.runtime import signals
from tev_jax.slots import SlotPrograms, Slots, slot_configs, width_buckets


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
    programs = SlotPrograms(target, drafter, slot_configs(config, batch_size, mesh=mesh),
                            mesh=mesh)
    widths = tuple(sorted(widths or width_buckets(config.prompt_len)))
    if widths[-1] < config.prompt_len:
        raise ValueError(f"the widest bucket ({widths[-1]}) is below prompt_len "
                         f"({config.prompt_len})")
    stop_ids = set(config.stop_token_ids)
    vocab = target.config.vocab_size
    key = as_key(key)
    slots = Slots(programs, batch_size, key)
    admitted = 0  # requests read so far (the default row key index of the next)
    pending = iter(requests)
    exhausted = False
    while True:
        signals.check()  # a safe point: the finished rows are handed back, none in flight
        batch, rows_K = [], []
        while len(batch) < len(slots.free()) and not exhausted:
            request = next(pending, None)
            if request is None:
                exhausted = True
            else:  # holder: (id, prompt length)
                ids = check_prompt(request.prompt_ids, vocab, config.prompt_len,
                                   what=f"request {request.id!r}")
                batch.append(((request.id, len(ids)), ids))
                rows_K.append(admitted if request.row is None else request.row)
                admitted += 1
        if batch:
            k = slots.refill_rows(len(batch))
            slots.refill(batch, decode.row_keys(key, rows_K + [0] * (k - len(batch))), widths)
        busy = slots.live
        if busy == 0:
            return
        smaller = [s for s in programs.sizes if busy <= s < slots.size]
        if exhausted and smaller:  # the tail: the running rows onto a smaller program
            slots.resize(min(smaller))
        slots.run(slots.size - busy + 1, max_rounds or 2**30)
        rows = slots.read()
        for slot, held in enumerate(slots.holders):
            if held is None or not rows.done_B[slot]:
                continue
            rid, prompt_tokens = held
            tokens = rows.out_BM[slot, : rows.num_B[slot]].tolist()
            rounds = int(rows.rounds_B[slot])
            yield Result(
                id=rid, token_ids=tokens, rounds=rounds,
                tau=(int(rows.start_B[slot]) - prompt_tokens) / rounds if rounds else math.nan,
                stop_reason="stop" if tokens[-1] in stop_ids else "length",
                prompt_tokens=prompt_tokens)
            slots.release(slot)
