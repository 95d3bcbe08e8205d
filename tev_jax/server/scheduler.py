"""The server's scheduler: one thread owns the engine and runs continuous batching.

Requests wait in a bounded queue (`Scheduler.submit`). Between rounds the thread admits
them into free row slots with the engine's refill program, runs one decode round,
reads every row's new tokens and hands them to the requests' streams (one `Event` per
request per round), and frees the slot of a request that ended (a stop token or stop
string, its ``max_tokens``, the engine's M, a client gone, a drain)::

    loop:  cut (drain deadline) -> admit (refill) -> first tokens -> one round -> hand out

Every sampling setting shares one batch: the programs are compiled with
``sampling=PER_ROW`` (`tev_jax.sampling`), so a request's temperature, top-k and top-p
come with its prompt into the refill and live in its row of the decode state; a new
setting compiles nothing. Requests are admitted in arrival order, at most ``max_batch``
rows live.

The rows are a `tev_jax.slots.Slots`, the slot driver the batch job uses too. They
decode on the smallest slot program that holds the live rows (the slot counts of
`tev_jax.slots.row_buckets`: 1, 2, 4, ..., B), moving onto a larger program when
requests arrive (`tev_jax.engine.Engine.put_slots`) and onto a smaller one once they
end and nobody waits (`tev_jax.engine.Engine.take_slots`). With an automatic budget
each slot count decodes with the budget its tuning picks (`tev_jax.slots.slot_configs`),
so the tree budget follows the live batch; a fixed budget is the same for all. Programs
are compiled lazily, the first time a (slot count, prompt-width bucket) is met, or all
before listening (`warmup`).

Rows never interact: at T = 0 every request gets the greedy tokens of its prompt alone,
whatever shares the batch; at T > 0 each is an exact sample whose random numbers come
from its own row key (`tev_jax.decode.step_keys`): `request_keys` of the request's
``seed`` (choice i > 0 of a request with ``n`` choices folds i in), or of a seed the
scheduler draws. At a fixed budget the same request with the same seed gets the same
completion whatever else shares the batch, whichever slot it lands in and whenever it
arrives, as long as it decodes on programs of the same slot count (an automatic budget
changes the tree with the live rows, and with it which exact sample the key picks).
Across slot counts a near-tie between two tokens (an argmax or a draw) can resolve the
other way, because XLA's matrix products accumulate in another order for another number
of rows (measured on XLA:CPU, 2026-12-06: a product of 1 row or of 64 and more agrees
with the same rows of a larger one; of 2 to 32 rows, it differs in the last bits).
``batch_invariant`` makes every row's numbers independent of its batch: one slot count,
each prompt prefilled alone.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from tev_jax import extensions
from tev_jax.budget import AutoBudget
from tev_jax.decode import DecodeConfig
from tev_jax.sampling import Sampling, SamplingRows
from tev_jax.server.detokenize import IncrementalText, tokens_for, visible
from tev_jax.server.requests import GenerationRequest
from tev_jax.slots import (
    SlotPrograms,
    Slots,
    row_buckets,
    serving_configs,
    width_buckets,
)

log = logging.getLogger("tev_jax.server")


@jax.jit
def _seed_keys(seeds_K3: jax.Array) -> jax.Array:
    base = jax.random.key(0)

    def one(s):
        key = jax.random.fold_in(jax.random.fold_in(base, s[0]), s[1])
        return jax.lax.cond(s[2] > 0, lambda: jax.random.fold_in(key, s[2]), lambda: key)

    return jax.vmap(one)(seeds_K3)


def request_keys(seeds: Sequence[int], choices: Sequence[int] | None = None) -> jax.Array:
    """The row keys of requests with these 64-bit seeds (negative ones taken modulo
    2**64): ``fold_in(fold_in(key(0), high 32 bits), low 32 bits)``, all 64 bits used
    whatever jax's integer width; choice i > 0 of a request (``n`` > 1) folds i into
    its request's key."""
    choices = [0] * len(seeds) if choices is None else choices
    seeds_K3 = np.asarray([[(s % 2**64) >> 32, s % 2**32, c] for s, c in zip(seeds, choices)],
                          np.uint32)
    return _seed_keys(seeds_K3)

STOP, LENGTH, ABORT, ERROR = "stop", "length", "abort", "error"
"""The finish reasons: a stop token or string, ``max_tokens`` (or the server's M), a
drain that cut the request, an engine error."""


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
      choice: which of the request's ``n`` choices it belongs to.
      accepted: with a finish reason, the choice's tree rounds as a histogram: entry j
        counts the rounds that accepted exactly j draft tokens (the bonus not counted).
      draft_tokens: with a finish reason, the draft tokens those rounds verified (the
        tree budget of each).
    """

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    token_ids: tuple[int, ...] = ()
    choice: int = 0
    accepted: tuple[int, ...] = ()
    draft_tokens: int = 0


@dataclasses.dataclass(eq=False)
class Job:
    """One choice of a request in the scheduler (a request with ``n`` choices is ``n``
    jobs): its stream callback and what it has been given.

    ``emit`` is called from the scheduler thread (the app makes it thread-safe);
    ``cancel`` may be called from any thread."""

    request: GenerationRequest
    emit: Callable[[Event], None]
    choice: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)
    text: IncrementalText | None = None
    sent: int = 0
    sent_tokens: int = 0
    decoded: int = 0   # the row's tokens when last read (a round's block: the increase)
    cancelled: bool = False
    finish_reason: str | None = None
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    first_token: float | None = None   # when its first tokens were handed out
    accepted: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    draft_tokens: int = 0              # tree rounds: accepted draft tokens -> rounds
    last_output: float = 0.0           # ... and its latest ones

    def cancel(self) -> None:
        """The client is gone: the slot is freed at the next round."""
        self.cancelled = True


def _histogram(job: Job) -> tuple[tuple[int, ...], int]:
    """(a job's accepted-count histogram, dense from 0; its draft tokens), for its last
    `Event`."""
    top = max(job.accepted, default=-1)
    return tuple(job.accepted[j] for j in range(top + 1)), job.draft_tokens


def budget_of(config: DecodeConfig) -> int:
    """The tree budget a slot config decodes with; 0 for plain AR (with or without the
    drafter's context)."""
    if config.builder == "ddtree":
        return int(config.budget)
    return 0 if config.builder in ("none", extensions.root_only_builder) else -1


class Scheduler:
    """The thread that owns the engine (see the module docstring).

    Args:
      target, drafter: the models (drafter None for plain AR).
      config: the base `DecodeConfig`: builder, budget (an int or an `AutoBudget`),
        verifier, ``max_new_tokens`` M (the most a request may ask for),
        ``prompt_len`` P, ``stop_token_ids``; its sampling is each request's.
      decode: ``token ids -> text`` (the tokenizer's).
      max_batch: B, live rows (a request with ``n`` choices takes n).
      max_queue: requests that may wait for a slot (more: `QueueFull`).
      seed: seeds the seeds the scheduler draws for requests without one.
      widths: prompt width buckets (default three of `tev_jax.slots.width_buckets`).
      batch_invariant: a row's numbers never depend on its batch: every round runs on
        the ``max_batch``-slot program and every prompt is prefilled alone, in the
        width its own length picks (needs a fixed budget). Without it a seed holds bit
        for bit only among requests decoded on programs of the same slot count: XLA's
        matrix products accumulate in another order for another number of rows, and a
        near-tie between two tokens can then resolve the other way.
      mesh: the mesh the programs run on (`tev_jax.sharding.make_mesh`), or None.
      metrics: a `tev_jax.server.metrics.ServerMetrics` to count into, or None.
    """

    def __init__(self, target, drafter, config: DecodeConfig, decode: Callable[[list[int]], str],
                 *, max_batch: int = 8, max_queue: int = 64, seed: int = 0,
                 widths: Sequence[int] | None = None, batch_invariant: bool = False,
                 mesh=None, metrics: Any = None):
        if max_batch < 1 or max_queue < 0:
            raise ValueError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch}, "
                             f"{max_queue}")
        if batch_invariant and isinstance(config.budget, AutoBudget):
            raise ValueError("batch_invariant needs a fixed budget (an automatic one changes "
                             "the tree with the live rows)")
        self.target, self.drafter, self.decode = target, drafter, decode
        self.config = config
        self.max_batch, self.max_queue = max_batch, max_queue
        self.batch_invariant = batch_invariant
        configs = serving_configs(config, max_batch, mesh)
        self.configs = {max_batch: configs[max_batch]} if batch_invariant else configs
        self.sizes = tuple(sorted(self.configs))
        self.widths = tuple(sorted(widths or width_buckets(config.prompt_len, 3)))
        self.stop_ids = frozenset(config.stop_token_ids)
        self.programs = SlotPrograms(target, drafter, self.configs, mesh=mesh)
        self.metrics = metrics
        self._seeds = np.random.default_rng(seed)
        self._met: set[tuple] = set()  # (slots[, width]) whose programs ran
        self._slots: Slots | None = None
        self._waiting: collections.deque[Job] = collections.deque()
        self._admitting = 0  # requests taken from the queue whose refill is running
        self._cv = threading.Condition()
        self._drain_at: float | None = None
        self._thread = threading.Thread(target=self._loop, name="tev-jax-scheduler",
                                        daemon=True)
        self.stats = {"rounds": 0, "row_rounds": 0, "block_tokens": 0, "finished": 0,
                      "finish_reasons": collections.Counter(), "stalls": 0,
                      "budgets": collections.Counter(), "slot_counts": collections.Counter()}
        if metrics is not None:
            for slots, c in self.configs.items():
                metrics.set_budget(slots, max(budget_of(c), 0))

    # ----------------------------------------------------------------- other threads

    def start(self) -> Scheduler:
        self._thread.start()
        return self

    def submit(self, request: GenerationRequest, emit: Callable[[Event], None]
               ) -> list[Job]:
        """Queues a request's ``n`` choices (one job each, all or none). Raises
        `QueueFull` or `Draining`."""
        n = request.n
        with self._cv:
            if self._drain_at is not None:
                raise Draining("the server is shutting down")
            if len(self._waiting) + n > self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting for a slot")
            jobs = [Job(request, emit, choice=i) for i in range(n)]
            self._waiting.extend(jobs)
            self._cv.notify()
        if self.metrics is not None:
            self.metrics.set_rows(self.live, len(self._waiting))
        return jobs

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

    @property
    def live(self) -> int:
        slots = self._slots  # the scheduler thread may replace it
        return 0 if slots is None else slots.live

    def snapshot(self) -> dict:
        """Slots, queue and round statistics (for ``GET /health``)."""
        live = self.live
        rows = self.stats["row_rounds"]
        return {
            "max_batch": self.max_batch, "live": live, "slots_free": self.max_batch - live,
            "waiting": len(self._waiting), "admitting": self._admitting,
            "draining": self._drain_at is not None, "rounds": self.stats["rounds"],
            "finished": self.stats["finished"], "stalls": self.stats["stalls"],
            "finish_reasons": dict(self.stats["finish_reasons"]),
            "tau": round(self.stats["block_tokens"] / rows, 4) if rows else None,
            "row_rounds": rows, "block_tokens": self.stats["block_tokens"],
            "budgets": {str(k): v for k, v in sorted(self.stats["budgets"].items())},
            "slot_counts": {str(k): v for k, v in sorted(self.stats["slot_counts"].items())},
        }

    def warmup(self) -> int:
        """Compiles every program the scheduler may run (each slot count's round, each
        refill bucket, each move between slot counts) on scratch states, before `start`;
        -> the programs run. Sampling settings are values in the state, so this is
        everything any request can need. Without it each compiles when first met."""
        if self._thread.is_alive():
            raise RuntimeError("warm up before the scheduler starts")
        count, programs = 0, self.programs
        greedy = Sampling(temperature=0.0)
        for slots in self.sizes:
            engine, axes = programs.engine(slots), programs.axes(slots)
            st = programs.empty(slots, jax.random.key(0))
            for k in row_buckets(slots):
                for t in self.widths:  # every prompt dropped (slot index >= slots)
                    st = engine.refill(st, np.ones((k, t), np.int32), np.ones((k,), np.int32),
                                       np.full((k,), slots, np.int32), request_keys([0] * k),
                                       [greedy] * k, axes=axes)
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
            self._met |= {(slots,)} | {(slots, t) for t in self.widths}
        return count

    # ------------------------------------------------------------- the thread's work

    def _loop(self) -> None:
        while True:
            with self._cv:
                idle = not self._waiting and not self.live
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
                    self._end_all(ABORT)
                    continue
                self._admit(waiting)
                if self._waiting and not self.live:
                    self._unstall()
                if self.live:
                    self._round()
                self._compact()
            except Exception:  # nothing hangs: every live request ends
                log.exception("the scheduler failed a round; its %d live request(s) end "
                              "with an error", self.live)
                self._end_all(ERROR)
            if self.metrics is not None:
                self.metrics.set_rows(self.live, len(self._waiting))

    def _end_all(self, reason: str) -> None:
        """Every live request ends with ``reason``; the state is dropped (a failed
        program may have consumed it), and the next request starts a fresh one."""
        slots, self._slots = self._slots, None
        for job in [] if slots is None else slots.holders:
            if job is not None and job.finish_reason is None:
                self._finish(job, reason)

    def _seed_of(self, request: GenerationRequest) -> int:
        if request.seed is not None:
            return request.seed
        return int(self._seeds.integers(0, 2**63))

    def _unstall(self) -> None:
        """The watchdog: requests wait and no row is live, so nothing would ever free a
        slot for them. It cannot happen while `_admit` takes requests into free slots;
        if it does, it is logged, the state is dropped and the waiting are admitted."""
        self.stats["stalls"] += 1
        log.warning("%d request(s) waiting with no live rows: a fresh state, admitting",
                    len(self._waiting))
        self._slots = None
        with self._cv:
            waiting = list(self._waiting)
        self._admit(waiting)

    def _admit(self, waiting: list[Job]) -> None:
        """Waiting requests into free slots, in arrival order."""
        live = self.live
        new, taken = [], []
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
            new.append(job)
            taken.append(job)
            live += 1
        with self._cv:
            for job in taken:
                self._waiting.remove(job)
        if not new:
            return
        self._admitting = len(new)
        try:
            slots = self.programs.smallest(live)
            if self._slots is None:
                self._slots = Slots(self.programs, slots, jax.random.key(0))
            elif slots > self._slots.size:
                self._slots.resize(slots)
            now = time.perf_counter()
            for batch in ([[j] for j in new] if self.batch_invariant else [new]):
                self._refill(batch)
                if self.metrics is not None:
                    for job in batch:
                        self.metrics.on_admitted(now - job.submitted)
            self._hand_out(after_round=False)
        except Exception:  # these requests and the live ones end; the server goes on
            log.exception("admitting %d request(s) failed", len(new))
            for job in new:
                if job.finish_reason is None:
                    self._finish(job, ERROR)
            self._end_all(ERROR)
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

    def _first_use(self, slots: int, *width: int) -> None:
        """Logs a program's first use: the request that meets it waits for its compile."""
        key = (slots, *width)
        if key not in self._met:
            self._met.add(key)
            what = f"refill of prompts up to {width[0]} tokens" if width else "round"
            log.info("compiling the %s on %d slot(s) (first use; --warmup compiles every "
                     "program before listening)", what, slots)

    def _refill(self, jobs: list[Job]) -> None:
        width = next(w for w in self.widths
                     if w >= max(len(job.request.prompt_ids) for job in jobs))
        self._first_use(self._slots.size, width)
        k = self._slots.refill_rows(len(jobs))
        pad = k - len(jobs)
        keys = request_keys([self._seed_of(j.request) for j in jobs] + [0] * pad,
                            [j.choice for j in jobs] + [0] * pad)
        settings = SamplingRows.of(
            [j.request.sampling for j in jobs] + [Sampling(temperature=0.0)] * pad,
            stops=[not j.request.ignore_eos for j in jobs] + [True] * pad)
        self._slots.refill([(job, job.request.prompt_ids) for job in jobs], keys,
                           self.widths, settings)

    def _round(self) -> None:
        slots = self._slots.size
        self._first_use(slots)
        self._slots.run(slots + 1, 1)
        self.stats["rounds"] += 1
        budget = budget_of(self._slots.engine.config)
        self.stats["budgets"][budget] += 1
        self.stats["slot_counts"][slots] += 1
        self._hand_out(after_round=True, budget=budget)

    def _hand_out(self, *, after_round: bool, budget: int = 0) -> None:
        """Every row's new tokens to its request; ended requests free their slots."""
        rows = self._slots.read()
        stop_rows, accepted = [], []
        for slot, job in enumerate(self._slots.holders):
            if job is None:
                continue
            req = job.request
            decoded = min(int(rows.num_B[slot]), req.max_tokens)
            if after_round and decoded > job.decoded:  # the block less its bonus token
                accepted.append(decoded - job.decoded - 1)
                if budget > 0:
                    job.accepted[accepted[-1]] += 1
                    job.draft_tokens += budget
            job.decoded = decoded
            done = bool(rows.done_B[slot])
            if job.cancelled:
                reason = ABORT
                job.emit(Event("", reason, len(req.prompt_ids), len(job.tokens),
                               choice=job.choice))
            else:
                reason = self._next_text(job, rows.out_BM[slot, :decoded].tolist(), done)
            if reason is None:
                continue
            self._ended(job, reason)
            self.stats["row_rounds"] += int(rows.rounds_B[slot])
            self.stats["block_tokens"] += int(rows.start_B[slot]) - len(req.prompt_ids)
            if done:
                self._slots.release(slot)
            else:
                stop_rows.append(slot)
        if stop_rows:  # rows the host ended: the device stops decoding them
            self._slots.end(stop_rows)
        if after_round and self.metrics is not None:
            self.metrics.on_round(budget, accepted)

    def _next_text(self, job: Job, tokens: list[int], done: bool) -> str | None:
        """Hands a row's new text (and the tokens it took) to its request; -> the finish
        reason, None while it runs. A stop string ends the text, its usage and its token
        ids where the string starts."""
        req = job.request
        job.text = job.text or IncrementalText(self.decode)
        ended_by_token = done and tokens[-1] in self.stop_ids and not req.ignore_eos
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
            if shown > job.sent_tokens:
                self._output_time(job)
            job.emit(Event(text[job.sent:], reason, len(req.prompt_ids), len(job.tokens),
                           tuple(tokens[job.sent_tokens:shown]), job.choice,
                           *(_histogram(job) if reason else ())))
            job.sent, job.sent_tokens = max(job.sent, len(text)), shown
        return reason

    def _output_time(self, job: Job) -> None:
        """Records when a request got tokens: its first (time to first token) or the
        next (the time since its previous ones)."""
        now = time.perf_counter()
        if self.metrics is not None:
            if job.first_token is None:
                self.metrics.on_first_token(now - job.submitted)
            else:
                self.metrics.on_next_tokens(now - job.last_output)
        job.first_token = job.first_token or now
        job.last_output = now

    def _ended(self, job: Job, reason: str) -> None:
        """Counts a request that ended (its last event is out)."""
        job.finish_reason = reason
        self.stats["finish_reasons"][reason] += 1
        self.stats["finished"] += 1
        if self.metrics is not None:
            now = time.perf_counter()
            self.metrics.on_finished(
                reason, len(job.request.prompt_ids), len(job.tokens), now - job.submitted,
                None if job.first_token is None else job.first_token - job.submitted)

    def _finish(self, job: Job, reason: str) -> None:
        job.emit(Event("", reason, len(job.request.prompt_ids), len(job.tokens),
                       choice=job.choice))
        self._ended(job, reason)

    def _compact(self) -> None:
        """Unless someone waits, the live rows shrink onto the smallest program that
        holds them."""
        if self._waiting or self._slots is None:
            return
        slots = self.programs.smallest(max(self._slots.live, 1))
        if slots < self._slots.size:
            self._slots.resize(slots)


__all__ = ["ABORT", "ERROR", "LENGTH", "STOP", "Draining", "Event", "Job", "QueueFull",
           "Scheduler", "budget_of", "request_keys"]
