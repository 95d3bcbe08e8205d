"""Row slots: the one driver of continuous batching, for the batch job and the server.

A decode state of B row slots (`tev_jax.engine.Engine.empty_slots`) runs requests that
come and go: free slots take new prompts with the engine's refill program (padded to a
few row and width buckets, so a handful of programs serve every prompt), rounds run until
rows end, and a row's slot is free again once its tokens are handed back. The live rows
may move onto a program of fewer or more slots (`tev_jax.engine.Engine.take_slots` /
``put_slots``); with an automatic budget each slot count decodes with the budget its
tuning picks (`slot_configs`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from tev_jax import decode, extensions
from tev_jax import sharding as shd
from tev_jax.budget import AutoBudget
from tev_jax.engine import Engine
from tev_jax.sampling import PER_ROW, Sampling, SamplingRows


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


def bucket(n: int, sizes: Sequence[int]) -> int:
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


def serving_configs(config: decode.DecodeConfig, max_batch: int, mesh=None
                    ) -> dict[int, decode.DecodeConfig]:
    """The config of each slot count the server's scheduler may run (the `row_buckets`
    that ``mesh`` divides, ``max_batch`` always), all with one cache length and each
    row's own sampling (`tev_jax.sampling.PER_ROW`): an automatic budget's per slot
    count (`slot_configs`), else ``config`` for every count."""
    config = dataclasses.replace(config, sampling=PER_ROW)
    sizes = [s for s in row_buckets(max_batch) if fit_batch(max_batch, s, mesh) == s]
    if isinstance(config.budget, AutoBudget) and config.builder == "ddtree":
        return slot_configs(config, max_batch, mesh=mesh)
    if isinstance(config.budget, AutoBudget):
        config = dataclasses.replace(config, budget=64, tuning=None)
    return {s: config for s in sizes}


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


# ------------------------------------------------------------------------ the driver


class SlotPrograms:
    """The programs of one set of slot configs: an `Engine` per slot count, created when
    first needed and then reused, with its slot axes and its empty state.

    Args:
      target, drafter: the models (the drafter is left out of a config whose builder is
        'none').
      configs: slot count -> `DecodeConfig` (`slot_configs`, or one config for each count
        of `row_buckets`), all with one state layout.
      mesh: optional mesh (`tev_jax.sharding.make_mesh`).
    """

    def __init__(self, target, drafter, configs: dict[int, decode.DecodeConfig], *,
                 mesh=None):
        self.target, self.drafter, self.configs, self.mesh = target, drafter, configs, mesh
        self.sizes = tuple(sorted(configs))
        self._engines: dict[int, Engine] = {}
        self._axes: dict[int, tuple] = {}
        self._empty: dict[int, Any] = {}

    def engine(self, slots: int) -> Engine:
        if slots not in self._engines:
            c = self.configs[slots]
            self._engines[slots] = Engine.create(
                self.target, None if c.builder == "none" else self.drafter, c, slots,
                mesh=self.mesh)
        return self._engines[slots]

    def axes(self, slots: int) -> tuple:
        """The row axis of every state leaf (`tev_jax.engine.Engine.slot_axes`)."""
        if slots not in self._axes:
            self._axes[slots] = self.engine(slots).slot_axes()
        return self._axes[slots]

    def empty(self, slots: int, key: jax.Array):
        """A state of ``slots`` free slots. Without a mesh it is one compiled program per
        slot count (the eager `Engine.empty_slots` traces the prefill's shapes every
        call)."""
        engine = self.engine(slots)
        if self.mesh is not None:
            return engine.empty_slots(key)
        if slots not in self._empty:
            self._empty[slots] = jax.jit(engine.empty_slots)
        return self._empty[slots](key)

    def smallest(self, rows: int) -> int:
        """The fewest slots of these programs that hold ``rows`` rows."""
        return bucket(rows, self.sizes)


@dataclasses.dataclass(frozen=True)
class RoundRows:
    """What a state's rows hold after a round, on the host (`Slots.read`).

    Attributes:
      out_BM: the generated tokens of each slot (M buffer).
      num_B: how many of them are valid.
      done_B: whether the row has ended (a stop token, M, or a free slot).
      start_B: the row's length (prompt + accepted tokens) in the cache.
      rounds_B: the decode rounds the row ran.
    """

    out_BM: np.ndarray
    num_B: np.ndarray
    done_B: np.ndarray
    start_B: np.ndarray
    rounds_B: np.ndarray


class Slots:
    """A decode state of row slots and what holds each slot (None: free): the one driver
    of continuous batching. The batch job (`tev_jax.batch.continuous`) and the server's
    scheduler both drive it.

    Args:
      programs: the `SlotPrograms` to run on.
      slots: the slot count to start on.
      key: the empty state's key (each row's own key comes with its refill).
    """

    def __init__(self, programs: SlotPrograms, slots: int, key: jax.Array):
        self.programs = programs
        self.engine = programs.engine(slots)
        self.st = programs.empty(slots, key)
        self.holders: list[Any] = [None] * slots

    @property
    def size(self) -> int:
        return len(self.holders)

    @property
    def live(self) -> int:
        return sum(h is not None for h in self.holders)

    def free(self) -> list[int]:
        return [i for i, h in enumerate(self.holders) if h is None]

    def resize(self, slots: int) -> None:
        """Moves the state onto the program of ``slots`` slots: into a fresh larger state
        (`tev_jax.engine.Engine.put_slots`), or its live rows first into a smaller one
        (`tev_jax.engine.Engine.take_slots`)."""
        if slots == self.size:
            return
        engine, axes = self.programs.engine(slots), self.programs.axes(slots)
        if slots > self.size:
            big = self.programs.empty(slots, jax.random.key(0))
            self.st = engine.put_slots(big, self.st, np.arange(self.size), axes=axes)
            self.holders = self.holders + [None] * (slots - self.size)
        else:
            order = ([i for i, h in enumerate(self.holders) if h is not None]
                     + self.free())[:slots]
            self.st = engine.take_slots(self.st, order, axes=axes)
            self.holders = [self.holders[i] for i in order]
        self.engine = engine

    def refill(self, entries: Sequence[tuple[Any, Sequence[int]]], key_K: jax.Array,
               widths: Sequence[int],
               sampling_K: Sequence[Sampling] | SamplingRows | None = None) -> list[int]:
        """Prefills prompts into the free slots, in order: ``entries`` are (holder,
        prompt ids), at most `free` of them; ``key_K`` one row key per entry, padded to
        the refill's row bucket (`refill_rows`), and on programs with each row's own
        sampling (`tev_jax.sampling.PER_ROW`) ``sampling_K`` one setting per entry
        (or their `tev_jax.sampling.SamplingRows`), padded alike. The prompts are padded to the smallest of ``widths`` that holds
        them and the rows to a `row_buckets` size (padding rows go to slot index B and
        are dropped). -> the slots taken."""
        free = self.free()
        if not entries or len(entries) > len(free):
            raise ValueError(f"{len(entries)} prompts for {len(free)} free slots")
        k = self.refill_rows(len(entries))
        t = bucket(max(len(ids) for _, ids in entries), widths)
        tokens_KT = np.zeros((k, t), np.int32)
        lengths_K = np.ones((k,), np.int32)
        slots_K = np.full((k,), self.size, np.int32)
        for row, ((holder, ids), slot) in enumerate(zip(entries, free)):
            tokens_KT[row, : len(ids)] = ids
            lengths_K[row], slots_K[row] = len(ids), slot
            self.holders[slot] = holder
        self.st = self.engine.refill(self.st, tokens_KT, lengths_K, slots_K, key_K,
                                     sampling_K, axes=self.programs.axes(self.size))
        return free[: len(entries)]

    def refill_rows(self, n: int) -> int:
        """The row bucket a refill of ``n`` prompts pads to."""
        return bucket(n, row_buckets(self.size))

    def run(self, until_done: int, max_rounds: int) -> None:
        """Runs rounds until ``until_done`` rows are done (free slots count), all are, or
        ``max_rounds`` ran (`tev_jax.engine.Engine.run_rounds`)."""
        self.st = self.engine.run_rounds(self.st, until_done, max_rounds)

    def read(self) -> RoundRows:
        """The rows' results on the host.

        Raises:
          ValueError: the target or the drafter produced non-finite logits.
        """
        st = self.st
        out_BM, num_B, done_B, start_B, rounds_B, bad_target, bad_draft = jax.device_get(
            (st.out_BM, st.num_out_B, st.done_B, st.start_B, st.rounds_B, st.bad_target,
             st.bad_draft))
        if bad_target or bad_draft:
            which = "target" if bad_target else "drafter"
            raise ValueError(f"the {which} produced non-finite logits (NaN or +inf) during "
                             "generation; the output would be garbage")
        return RoundRows(out_BM, num_B, done_B, start_B, rounds_B)

    def release(self, slot: int) -> None:
        """Frees a slot whose row the device ended (its row is done)."""
        self.holders[slot] = None

    def end(self, slots_: Sequence[int]) -> None:
        """Ends rows the host stopped (a stop string, a client gone): the device stops
        decoding them and their slots are free."""
        ended_B = np.zeros((self.size,), bool)  # one shape per slot count: one compile
        ended_B[list(slots_)] = True
        self.st = self.st.replace(done_B=self.st.done_B | ended_B)
        for slot in slots_:
            self.holders[slot] = None


__all__ = ["RoundRows", "SlotPrograms", "Slots", "bucket", "fit_batch",
           "row_buckets", "serving_configs", "slot_configs", "width_buckets"]
