"""The server's scheduler: one thread owns the engine and runs continuous batching.

Requests wait in a bounded queue (`Scheduler.submit`). Between rounds the thread admits
them into free row slots with the engine's refill program, runs one decode round,
reads every row's new tokens and hands them to the requests' streams (one `Event` per
request per round), and frees the slot of a request that ended (a stop token or stop
string, its ``max_tokens``, the engine's M, a client gone, a drain)::

    loop:  cut (drain deadline) -> admit (refill) -> first tokens -> one round -> hand out

Sampling settings are not per row in the decode state (the `tev_jax.sampling.Sampling`
is a static field of the `tev_jax.decode.DecodeConfig`: every program is compiled for
one), so requests are grouped by their setting: each setting in use has a *lane*, its
own decode state and programs, and the lanes take turns, a round each. At most
``max_batch`` rows are live over all lanes, and at most ``max_lanes`` settings at once.
A lane whose rows have all ended is retired at the end of the round (its programs stay
compiled), and requests are admitted in arrival order: one whose setting finds no lane
waits, with everyone behind it, until a lane's current rows end.

A lane is a `tev_jax.slots.Slots`, the slot driver the batch job uses too. It decodes
on the smallest slot program that holds its live rows (the slot counts
of `tev_jax.slots.row_buckets`: 1, 2, 4, ..., B); it moves its rows onto a larger
program when requests arrive (`tev_jax.engine.Engine.put_slots`) and onto a smaller
one once they end and nobody waits (`tev_jax.engine.Engine.take_slots`). With an
automatic budget each slot count decodes with the budget its tuning picks
(`tev_jax.slots.slot_configs`), so the tree budget follows the live batch; a fixed
budget is the same for all. Programs are compiled lazily, the first time a (setting,
slot count, prompt-width bucket) is met, and then reused.

Rows never interact: at T = 0 every request gets the greedy tokens of its prompt alone,
whatever shares the batch; at T > 0 each is an exact sample whose random numbers come
from its own row key (`tev_jax.decode.step_keys`): `request_key` of the request's
``seed``, or of a seed the scheduler draws. At a fixed budget the same request with the
same seed gets the same completion whatever else shares the batch, whichever slot it
lands in and whenever it arrives, as long as it decodes on programs of the same slot
count (an automatic budget changes the tree with the live rows, and with it which exact
sample the key picks). Across slot counts a near-tie between two tokens (an argmax or a
draw) can resolve the other way, because XLA's matrix products accumulate in another
order for another number of rows (measured on XLA:CPU, 2026-12-06: a product of 1 row
or of 64 and more agrees with the same rows of a larger one; of 2 to 32 rows, it differs
in the last bits). ``batch_invariant`` makes every row's numbers independent of its
batch: one slot count, each prompt prefilled alone.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from tev_jax import extensions
from tev_jax.budget import AutoBudget
from tev_jax.decode import DecodeConfig
from tev_jax.sampling import Sampling
from tev_jax.server.detokenize import IncrementalText, tokens_for, visible
from tev_jax.server.requests import GenerationRequest
from tev_jax.slots import SlotPrograms, Slots, row_buckets, slot_configs, width_buckets

log = logging.getLogger("tev_jax.server")


@jax.jit
def _seed_keys(seeds_K2: jax.Array) -> jax.Array:
    base = jax.random.key(0)
    return jax.vmap(lambda s: jax.random.fold_in(jax.random.fold_in(base, s[0]), s[1]))(
        seeds_K2)


def request_keys(seeds: Sequence[int]) -> jax.Array:
    """The row keys of requests with these 64-bit seeds (negative ones taken modulo
    2**64): ``fold_in(fold_in(key(0), high 32 bits), low 32 bits)``, all 64 bits used
    whatever jax's integer width."""
    seeds_K2 = np.asarray([[(s % 2**64) >> 32, s % 2**32] for s in seeds], np.uint32)
    return _seed_keys(seeds_K2)

STOP, LENGTH, ABORT, ERROR = "stop", "length", "abort", "error"
"""The finish reasons: a stop token or string, ``max_tokens`` (or the server's M), a
drain that cut the request, an engine error."""


WARMUP = (Sampling(temperature=0.0), Sampling(temperature=1.0))
"""What ``--warmup`` compiles: greedy, and the OpenAI clients' default (temperature 1)."""


class QueueFull(RuntimeError):
    """The waiting queue is full (answered with HTTP 429)."""


class Draining(RuntimeError):
    """The server is shutting down and admits nothing (answered with HTTP 503)."""


@dataclasses.dataclass(frozen=True)
class Event:
    """What a request's stream receives after a round.

    Attributes:
      text: the new text (may be empty with a ``finish_reason``).
      finish_reason: None while it runs; then one of STOP, LENGTH, ABORT, ERROR.
      prompt_tokens, completion_tokens: the usage so far.
      token_ids: the new token ids: those whose text is all shown so far (a stop string
        ends them where it ends the text).
    """

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    token_ids: tuple[int, ...] = ()


@dataclasses.dataclass(eq=False)
class Job:
    """A request in the scheduler: its stream callback and what it has been given.

    ``emit`` is called from the scheduler thread (the app makes it thread-safe);
    ``cancel`` may be called from any thread."""

    request: GenerationRequest
    emit: Callable[[Event], None]
    tokens: list[int] = dataclasses.field(default_factory=list)
    text: IncrementalText | None = None
    sent: int = 0
    sent_tokens: int = 0
    cancelled: bool = False
    finish_reason: str | None = None
    submitted: float = dataclasses.field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        """The client is gone: the slot is freed at the next round."""
        self.cancelled = True


@dataclasses.dataclass
class _Lane:
    """One sampling setting's row slots (`tev_jax.slots.Slots`: the decode state and the
    job in each slot), None until its first request."""

    sampling: Sampling
    slots: Slots | None = None

    @property
    def live(self) -> int:
        return 0 if self.slots is None else self.slots.live

    def jobs(self) -> list[tuple[int, Job]]:
        """(slot, job) of every live row."""
        return [] if self.slots is None else [
            (i, j) for i, j in enumerate(self.slots.holders) if j is not None]


def budget_of(config: DecodeConfig) -> int:
    """The tree budget a slot config decodes with; 0 for plain AR (with or without the
    drafter's context)."""
    if config.builder == "ddtree":
        return int(config.budget)
    return 0 if config.builder in ("none", extensions.root_only_builder) else -1


def lane_configs(config: DecodeConfig, max_batch: int) -> dict[int, DecodeConfig]:
    """The config of each slot count a lane may run (`tev_jax.slots.row_buckets`),
    all with one cache length: an automatic budget's per slot count
    (`tev_jax.slots.slot_configs`), else ``config`` for every count."""
    sizes = row_buckets(max_batch)
    if isinstance(config.budget, AutoBudget) and config.builder == "ddtree":
        return slot_configs(config, max_batch)
    if isinstance(config.budget, AutoBudget):
        config = dataclasses.replace(config, budget=64, tuning=None)
    return {s: config for s in sizes}


class Scheduler:
    """The thread that owns the engine (see the module docstring).

    Args:
      target, drafter: the models (drafter None for plain AR).
      config: the base `DecodeConfig`: builder, budget (an int or an `AutoBudget`),
        verifier, ``max_new_tokens`` M (the most a request may ask for),
        ``prompt_len`` P, ``stop_token_ids``; its sampling is replaced per lane.
      decode: ``token ids -> text`` (the tokenizer's).
      max_batch: B, live rows over all lanes.
      max_queue: requests that may wait for a slot (more: `QueueFull`).
      max_lanes: sampling settings decoded at once.
      seed: seeds the seeds the scheduler draws for requests without one.
      widths: prompt width buckets (default three of `tev_jax.slots.width_buckets`).
      batch_invariant: a row's numbers never depend on its batch: every round runs on
        the ``max_batch``-slot program and every prompt is prefilled alone, in the
        width its own length picks (needs a fixed budget). Without it a seed holds bit
        for bit only among requests decoded on programs of the same slot count: XLA's
        matrix products accumulate in another order for another number of rows, and a
        near-tie between two tokens can then resolve the other way.
    """

    def __init__(self, target, drafter, config: DecodeConfig, decode: Callable[[list[int]], str],
                 *, max_batch: int = 8, max_queue: int = 64, max_lanes: int = 4,
                 seed: int = 0, widths: Sequence[int] | None = None,
                 batch_invariant: bool = False):
        if max_batch < 1 or max_queue < 0 or max_lanes < 1:
            raise ValueError(f"max_batch and max_lanes must be >= 1 and max_queue >= 0, got "
                             f"{max_batch}, {max_lanes}, {max_queue}")
        if batch_invariant and isinstance(config.budget, AutoBudget):
            raise ValueError("batch_invariant needs a fixed budget (an automatic one changes "
                             "the tree with the live rows)")
        self.target, self.drafter, self.decode = target, drafter, decode
        self.config = config
        self.max_batch, self.max_queue, self.max_lanes = max_batch, max_queue, max_lanes
        self.batch_invariant = batch_invariant
        self.configs = ({max_batch: config} if batch_invariant
                        else lane_configs(config, max_batch))
        self.sizes = tuple(sorted(self.configs))
        self.widths = tuple(sorted(widths or width_buckets(config.prompt_len, 3)))
        self.stop_ids = frozenset(config.stop_token_ids)
        self._seeds = np.random.default_rng(seed)
        self._programs: dict[Sampling, SlotPrograms] = {}  # kept after a lane retires
        self._met: set[tuple] = set()  # (setting, slots[, width]) whose programs ran
        self._lanes: dict[Sampling, _Lane] = {}
        self._waiting: collections.deque[Job] = collections.deque()
        self._admitting = 0  # requests taken from the queue whose refill is running
        self._cv = threading.Condition()
        self._drain_at: float | None = None
        self._thread = threading.Thread(target=self._loop, name="tev-jax-scheduler",
                                        daemon=True)
        self.stats = {"rounds": 0, "row_rounds": 0, "block_tokens": 0, "finished": 0,
                      "finish_reasons": collections.Counter(), "stalls": 0,
                      "budgets": collections.Counter(), "slot_counts": collections.Counter()}

    # ----------------------------------------------------------------- other threads

    def start(self) -> Scheduler:
        self._thread.start()
        return self

    def submit(self, request: GenerationRequest, emit: Callable[[Event], None]) -> Job:
        """Queues a request. Raises `QueueFull` or `Draining`."""
        with self._cv:
            if self._drain_at is not None:
                raise Draining("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting for a slot")
            job = Job(request, emit)
            self._waiting.append(job)
            self._cv.notify()
        return job

    def drain(self, seconds: float = 0.0) -> None:
        """Stops admitting; the waiting requests end now and the running ones when they
        finish or after ``seconds`` (0: at the end of the current round), with
        ``finish_reason`` 'abort'."""
        with self._cv:
            if self._drain_at is None:
                self._drain_at = time.perf_counter() + seconds
            self._cv.notify()

    def join(self, timeout: float | None = None) -> bool:
        """Waits for the thread to end (after `drain`); whether it did."""
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def snapshot(self) -> dict:
        """Slots, queue and round statistics (for ``GET /health``)."""
        lanes = list(self._lanes.copy().values())  # the scheduler thread may change it
        live = sum(lane.live for lane in lanes)
        rows = self.stats["row_rounds"]
        return {
            "max_batch": self.max_batch, "live": live, "slots_free": self.max_batch - live,
            "waiting": len(self._waiting), "admitting": self._admitting,
            "lanes": len(lanes),
            "draining": self._drain_at is not None, "rounds": self.stats["rounds"],
            "finished": self.stats["finished"], "stalls": self.stats["stalls"],
            "finish_reasons": dict(self.stats["finish_reasons"]),
            "tau": round(self.stats["block_tokens"] / rows, 4) if rows else None,
            "row_rounds": rows, "block_tokens": self.stats["block_tokens"],
            "budgets": {str(k): v for k, v in sorted(self.stats["budgets"].items())},
            "slot_counts": {str(k): v for k, v in sorted(self.stats["slot_counts"].items())},
        }

    def warmup(self, samplings: Sequence[Sampling] = WARMUP) -> int:
        """Compiles every program a lane of each of ``samplings`` may run (each slot
        count's round, each refill bucket, each move between slot counts) on scratch
        states, before `start`; -> the programs run. Without it they compile when first
        met. The default: greedy, and what OpenAI's clients send when they set nothing
        (temperature 1, no top-k or top-p)."""
        if self._thread.is_alive():
            raise RuntimeError("warm up before the scheduler starts")
        return sum(self._warm(s) for s in samplings)

    def _warm(self, sampling: Sampling) -> int:
        count = 0
        programs = self._programs_of(sampling)
        for slots in self.sizes:
            engine, axes = programs.engine(slots), programs.axes(slots)
            st = programs.empty(slots, jax.random.key(0))
            for k in row_buckets(slots):
                for t in self.widths:  # every prompt dropped (slot index >= slots)
                    st = engine.refill(st, np.ones((k, t), np.int32), np.ones((k,), np.int32),
                                       np.full((k,), slots, np.int32),
                                       request_keys([0] * k), axes=axes)
                    count += 1
            st = engine.run_rounds(st, slots + 1, 1)
            st = st.replace(done_B=st.done_B | np.zeros((slots,), bool))
            for other in self.sizes:
                scratch = programs.empty(other, jax.random.key(0))
                if other < slots:
                    st = engine.put_slots(st, scratch, np.arange(other), axes=axes)
                elif other > slots:
                    engine.take_slots(scratch, np.arange(slots), axes=axes)
                count += other != slots
            jax.block_until_ready(st.done_B)
            count += 1
            self._met |= {(sampling, slots)} | {(sampling, slots, t) for t in self.widths}
        return count

    # ------------------------------------------------------------- the thread's work

    def _loop(self) -> None:
        while True:
            with self._cv:
                idle = not self._waiting and not any(l.live for l in self._lanes.values())
                if idle and self._drain_at is not None:
                    return
                if idle:
                    self._cv.wait(0.5)
                    continue
                cut = self._drain_at is not None and time.perf_counter() >= self._drain_at
                waiting = list(self._waiting)
                if self._drain_at is not None:
                    self._waiting.clear()
            try:
                if self._drain_at is not None:
                    for job in waiting:
                        self._finish(job, ABORT)
                    waiting = []
                if cut:
                    for lane in self._lanes.values():
                        for _, job in lane.jobs():
                            self._finish(job, ABORT)
                    self._lanes.clear()
                    continue
                self._admit(waiting)
                if self._waiting and not any(lane.live for lane in self._lanes.values()):
                    self._unstall()
                for s, lane in list(self._lanes.items()):
                    if lane.live:
                        try:
                            self._round(lane)
                        except Exception:  # that lane's requests end; the others go on
                            self._fail_lane(s, lane)
                self._compact()
            except Exception:  # nothing hangs: every job of a failed lane ends
                log.exception("the scheduler failed a round")
                for lane in list(self._lanes.values()):
                    for _, job in lane.jobs():
                        self._finish(job, ERROR)
                self._lanes.clear()

    def _seed_of(self, request: GenerationRequest) -> int:
        if request.seed is not None:
            return request.seed
        return int(self._seeds.integers(0, 2**63))

    def _programs_of(self, sampling: Sampling) -> SlotPrograms:
        """The slot programs of one setting (compiled when first met, kept after its
        lane retires)."""
        if sampling not in self._programs:
            self._programs[sampling] = SlotPrograms(
                self.target, self.drafter,
                {n: dataclasses.replace(c, sampling=sampling) for n, c in self.configs.items()})
        return self._programs[sampling]

    def _unstall(self) -> None:
        """The watchdog: requests wait and no row is live, so nothing would ever free a
        lane or a slot for them. It cannot happen while `_compact` retires empty lanes;
        if it does, it is logged, every lane is retired and the waiting are admitted."""
        self.stats["stalls"] += 1
        log.warning("%d request(s) waiting with no live rows (lanes %d): retiring the "
                    "lanes and admitting", len(self._waiting), len(self._lanes))
        self._lanes.clear()
        with self._cv:
            waiting = list(self._waiting)
        self._admit(waiting)

    def _admit(self, waiting: list[Job]) -> None:
        """Waiting requests into free slots, in arrival order. A request whose setting has
        no lane while ``max_lanes`` lanes have live rows waits, and so does everyone
        behind it: requests that came later never join a lane ahead of it and keep it
        busy, so it waits at most until some lane's current rows end (`_compact` then
        retires that lane)."""
        live = sum(lane.live for lane in self._lanes.values())
        new: dict[Sampling, list[Job]] = collections.defaultdict(list)
        taken = []
        for job in waiting:
            if job.cancelled:
                taken.append(job)
                continue
            why = self._unfit(job.request)
            if why is not None:
                log.error("refused a request the app let through: %s", why)
                self._finish(job, ERROR)
                taken.append(job)
                continue
            if live >= self.max_batch:
                break
            s = job.request.sampling
            if s not in self._lanes:
                if len(self._lanes) >= self.max_lanes:
                    break
                self._lanes[s] = _Lane(s)
            new[s].append(job)
            taken.append(job)
            live += 1
        with self._cv:
            for job in taken:
                self._waiting.remove(job)
        self._admitting = sum(map(len, new.values()))
        try:
            for s, jobs in new.items():
                lane = self._lanes[s]
                try:
                    programs = self._programs_of(s)
                    slots = programs.smallest(lane.live + len(jobs))
                    if lane.slots is None:
                        lane.slots = Slots(programs, slots, jax.random.key(0))
                    elif slots > lane.slots.size:
                        lane.slots.resize(slots)
                    for batch in ([[j] for j in jobs] if self.batch_invariant else [jobs]):
                        self._refill(lane, batch)
                    self._hand_out(lane)
                except Exception:  # these requests (and their lane's) end; others go on
                    self._fail_lane(s, lane, jobs)
        finally:
            self._admitting = 0

    def _unfit(self, request: GenerationRequest) -> str | None:
        """Why a request cannot be decoded (the app checks requests first; this guards
        the engine against anything that got past it), or None."""
        ids, vocab = request.prompt_ids, self.target.config.vocab_size
        if not 1 <= len(ids) <= self.config.prompt_len:
            return f"a prompt of {len(ids)} tokens (1 to {self.config.prompt_len} fit)"
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            return f"token id {bad[0]!r} outside the vocabulary [0, {vocab})"
        if not 1 <= request.max_tokens <= self.config.max_new_tokens:
            return f"max_tokens {request.max_tokens} (1 to {self.config.max_new_tokens})"
        return None

    def _fail_lane(self, sampling: Sampling, lane: _Lane, jobs: Sequence[Job] = ()) -> None:
        """A lane whose program failed: its requests (and ``jobs``, being admitted to
        it) end with 'error' and it is retired; the other lanes are untouched."""
        log.exception("the lane of %s failed; its %d request(s) end with an error",
                      sampling, lane.live + len(jobs))
        live = [j for _, j in lane.jobs()]
        for job in live + [j for j in jobs if j not in live]:
            if job.finish_reason is None:
                self._finish(job, ERROR)
        self._lanes.pop(sampling, None)

    def _first_use(self, sampling: Sampling, slots: int, *width: int) -> None:
        """Logs a program's first use: the request that meets it waits for its compile."""
        key = (sampling, slots, *width)
        if key not in self._met:
            self._met.add(key)
            what = f"refill of prompts up to {width[0]} tokens" if width else "round"
            log.info("compiling the %s on %d slot(s) for %s (first use; --warmup compiles "
                     "the greedy programs before listening)", what, slots, sampling)

    def _refill(self, lane: _Lane, jobs: list[Job]) -> None:
        seeds = [self._seed_of(job.request) for job in jobs]
        width = next(w for w in self.widths
                     if w >= max(len(job.request.prompt_ids) for job in jobs))
        self._first_use(lane.sampling, lane.slots.size, width)
        k = lane.slots.refill_rows(len(jobs))
        lane.slots.refill([(job, job.request.prompt_ids) for job in jobs],
                          request_keys(seeds + [0] * (k - len(jobs))), self.widths)

    def _round(self, lane: _Lane) -> None:
        slots = lane.slots.size
        self._first_use(lane.sampling, slots)
        lane.slots.run(slots + 1, 1)
        self.stats["rounds"] += 1
        self.stats["budgets"][budget_of(lane.slots.engine.config)] += 1
        self.stats["slot_counts"][slots] += 1
        self._hand_out(lane)

    def _hand_out(self, lane: _Lane) -> None:
        """Every row's new tokens to its request; ended requests free their slots."""
        rows = lane.slots.read()
        stop_rows = []
        for slot, job in lane.jobs():
            req = job.request
            done = bool(rows.done_B[slot])
            if job.cancelled:
                reason = ABORT
                job.emit(Event("", reason, len(req.prompt_ids), len(job.tokens)))
            else:
                reason = self._next_text(job, rows.out_BM[slot, : min(
                    int(rows.num_B[slot]), req.max_tokens)].tolist(), done)
            if reason is None:
                continue
            job.finish_reason = reason
            self.stats["finish_reasons"][reason] += 1
            self.stats["row_rounds"] += int(rows.rounds_B[slot])
            self.stats["block_tokens"] += int(rows.start_B[slot]) - len(req.prompt_ids)
            self.stats["finished"] += 1
            if done:
                lane.slots.release(slot)
            else:
                stop_rows.append(slot)
        if stop_rows:  # rows the host ended: the device stops decoding them
            lane.slots.end(stop_rows)

    def _next_text(self, job: Job, tokens: list[int], done: bool) -> str | None:
        """Hands a row's new text (and the tokens it took) to its request; -> the finish
        reason, None while it runs. A stop string ends the text, its usage and its token
        ids where the string starts."""
        req = job.request
        job.text = job.text or IncrementalText(self.decode)
        ended_by_token = done and tokens[-1] in self.stop_ids
        at_length = len(tokens) >= req.max_tokens or done
        final = ended_by_token or at_length
        text, hit = visible(job.text, tokens, req.stop, final)
        if final and not hit:
            shown = len(tokens)
        elif not hit and len(text) >= len(job.text.text):
            shown = job.text.read  # the usual round: nothing held back
        else:  # the tokens of the text up to a (possible) stop string
            shown = tokens_for(len(text), tokens, self.decode)
        shown = max(shown, job.sent_tokens)
        job.tokens = tokens[:shown] if hit else tokens
        reason = STOP if hit or ended_by_token else LENGTH if at_length else None
        if len(text) > job.sent or shown > job.sent_tokens or reason:
            job.emit(Event(text[job.sent:], reason, len(req.prompt_ids), len(job.tokens),
                           tuple(tokens[job.sent_tokens:shown])))
            job.sent, job.sent_tokens = max(job.sent, len(text)), shown
        return reason

    def _finish(self, job: Job, reason: str) -> None:
        job.finish_reason = reason
        self.stats["finish_reasons"][reason] += 1
        job.emit(Event("", reason, len(job.request.prompt_ids), len(job.tokens)))

    def _compact(self) -> None:
        """Lanes with no live row are retired (their compiled programs stay cached), so a
        waiting request of another setting takes the lane in the next round; the others
        shrink onto the smallest program that holds them, unless someone waits."""
        for s, lane in list(self._lanes.items()):
            if not lane.live:
                del self._lanes[s]
        if self._waiting:
            return
        for lane in self._lanes.values():
            slots = lane.slots.programs.smallest(lane.live)
            if slots < lane.slots.size:
                lane.slots.resize(slots)


__all__ = ["ABORT", "ERROR", "LENGTH", "STOP", "WARMUP", "Draining", "Event", "Job", "QueueFull",
           "Scheduler", "budget_of", "lane_configs", "request_keys"]
