"""The server's `Scheduler` in process, with the bundled models and no HTTP: every
sampling setting shares one batch (issue 59; issue 60: a fifth setting used to wait
forever for a lane), requests are admitted in arrival order, and a new setting compiles
nothing. Those tests are in the fast tier; the scheduler's others (a request or a
program that fails, stop strings, warm-up, batch invariance, n choices) compile more and
are in the slow tier."""

import dataclasses
import logging
import threading

import pytest

from tev_jax.budget import AutoBudget
from tev_jax.data.tokenizer import STOP_IDS
from tev_jax.decode import DecodeConfig
from tev_jax.sampling import Sampling
from tev_jax.server.requests import GenerationRequest
from tev_jax.server.scheduler import Scheduler

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def bundled():
    from tev_jax.models.bundled import load_bundled

    return load_bundled()


class Recorder:
    """Collects each job's events with the order in which they arrived."""

    def __init__(self, n: int):
        self.events = {i: [] for i in range(n)}
        self.order: list[int] = []
        self._n, self._done = n, threading.Event()
        self._lock = threading.Lock()

    def emit(self, i: int):
        def emit(event):
            with self._lock:
                self.events[i].append(event)
                self.order.append(i)
                if sum(bool(e) and e[-1].finish_reason is not None
                       for e in self.events.values()) == self._n:
                    self._done.set()
        return emit

    def wait(self, seconds: float) -> bool:
        return self._done.wait(seconds)

    def tokens(self, i: int) -> tuple[int, ...]:
        return tuple(t for e in self.events[i] for t in e.token_ids)


def _scheduler(bundled, **kw) -> Scheduler:
    target, drafter, tok = bundled
    config = DecodeConfig(max_new_tokens=MAX_TOKENS, prompt_len=16, budget=4,
                          stop_token_ids=STOP_IDS)
    return Scheduler(target, drafter, config, tok.decode, widths=[16], **kw)


def _request(tok, temperature: float, seed: int) -> GenerationRequest:
    return GenerationRequest(chat=False, prompt_ids=tuple(tok.encode("Once upon a time").ids),
                             max_tokens=MAX_TOKENS, sampling=Sampling(temperature=temperature),
                             seed=seed)


def _run(scheduler: Scheduler, requests, seconds: float = 240.0) -> Recorder:
    """Submits the requests in order (before the thread starts, so the first admission
    sees them all), starts the scheduler and waits for every request to end."""
    rec = Recorder(len(requests))
    for i, r in enumerate(requests):
        scheduler.submit(r, rec.emit(i))
    scheduler.start()
    assert rec.wait(seconds), f"requests never ended: {scheduler.snapshot()}"
    return rec


def test_settings_share_one_batch_in_arrival_order(bundled, caplog):
    """Two slots, three requests: A (T 0.5), B (T 0.9), C (T 0.5). Every request ends
    (issue 60: with one lane per setting B waited forever once A's lane had emptied), B
    is admitted before C, the queue ends empty with no watchdog stall, and each
    completion equals the same request alone (seeded, fixed budget, batch-invariant
    programs); then a second wave of settings never seen and B's is admitted too. Each
    program's first use is logged once, and the new settings compile nothing."""
    caplog.set_level(logging.INFO, logger="tev_jax.server")
    tok = bundled[2]
    requests = [_request(tok, 0.5, 1), _request(tok, 0.9, 2), _request(tok, 0.5, 3)]
    s = _scheduler(bundled, max_batch=2, batch_invariant=True)
    rec = _run(s, requests)
    assert [rec.events[i][-1].finish_reason for i in range(3)] == ["length"] * 3
    assert rec.order.index(1) < rec.order.index(2), rec.order  # B's first event before C's
    snap = s.snapshot()
    assert (snap["waiting"], snap["live"], snap["stalls"]) == (0, 0, 0)
    compiled = [r.getMessage() for r in caplog.records if "compiling" in r.getMessage()]
    for i, r in enumerate(requests):  # one at a time through the same scheduler
        alone = Recorder(1)
        s.submit(r, alone.emit(0))
        assert alone.wait(120), s.snapshot()
        assert alone.tokens(0) == rec.tokens(i), i
    wave = Recorder(3)  # a second wave: settings never seen, and B's
    s.submit(_request(tok, 0.7, 4), wave.emit(0))
    s.submit(requests[1], wave.emit(1))
    s.submit(dataclasses.replace(_request(tok, 1.0, 5),
                                 sampling=Sampling(1.3, top_k=7, top_p=0.8)), wave.emit(2))
    assert wave.wait(120), s.snapshot()
    assert wave.tokens(1) == rec.tokens(1)
    s.drain()
    assert s.join(30)
    assert s.snapshot()["stalls"] == 0
    compiles = [r.getMessage() for r in caplog.records if "compiling" in r.getMessage()]
    assert compiles == compiled, compiles  # the new settings compiled nothing
    assert [m for m in compiles if "the round on 2 slot(s)" in m] != [], compiles
    assert len(compiles) == len(set(compiles)), compiles  # each first use logged once


def _text(rec: Recorder, i: int) -> str:
    return "".join(e.text for e in rec.events[i])


@pytest.mark.slow
def test_a_request_the_engine_cannot_take_ends_alone(bundled, monkeypatch):
    """Issue 57, item 1: a request with a token id outside the vocabulary (one that got
    past the app) ends with 'error' by itself while the others complete as they do
    alone (greedy); a program that fails ends the requests it held (their state is
    gone) and the scheduler goes on serving."""
    from tev_jax import slots as slots_module

    tok = bundled[2]
    greedy = _request(tok, 0.0, 0)
    bad_ids = GenerationRequest(chat=False, prompt_ids=(1, 1099511627776), max_tokens=4,
                                sampling=Sampling(temperature=0.0))
    doomed = _request(tok, 0.9, 5)
    s = _scheduler(bundled, max_batch=4)
    real = slots_module.Slots.refill

    def refill(self, entries, *args):
        if any(job.request.sampling.temperature == 0.9 for job, _ in entries):
            raise RuntimeError("a program failed")
        return real(self, entries, *args)

    monkeypatch.setattr(slots_module.Slots, "refill", refill)
    rec = _run(s, [greedy, bad_ids, greedy])
    reasons = [rec.events[i][-1].finish_reason for i in range(3)]
    assert reasons == ["length", "error", "length"], reasons
    for request, reason in ((doomed, "error"), (greedy, "length")):
        alone = Recorder(1)
        s.submit(request, alone.emit(0))
        assert alone.wait(120)
        assert alone.events[0][-1].finish_reason == reason
    assert rec.tokens(0) == rec.tokens(2) == alone.tokens(0)
    assert s.snapshot()["finish_reasons"] == {"length": 3, "error": 2}
    s.drain()
    assert s.join(30)


@pytest.mark.slow
def test_a_stop_string_ends_usage_and_token_ids_with_the_text(bundled):
    """Issue 57, item 10: with a stop string from the middle of a completion, the text
    ends before it, and the usage and the token ids end with the text (before, they
    counted every token decoded past the cut)."""
    from tev_jax.server.detokenize import tokens_for

    tok = bundled[2]
    s = _scheduler(bundled, max_batch=1).start()
    plain = Recorder(1)
    s.submit(_request(tok, 0.0, 0), plain.emit(0))
    assert plain.wait(240)
    text, ids = _text(plain, 0), list(plain.tokens(0))
    assert len(ids) == MAX_TOKENS and plain.events[0][-1].completion_tokens == MAX_TOKENS
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip() and text.find(stop) > 0, text
    cut = Recorder(1)
    s.submit(dataclasses.replace(_request(tok, 0.0, 0), stop=(stop,)), cut.emit(0))
    assert cut.wait(240)
    s.drain()
    assert s.join(30)
    want = text[: text.find(stop)]
    n = tokens_for(len(want), ids, tok.decode)
    assert _text(cut, 0) == want and cut.events[0][-1].finish_reason == "stop"
    assert cut.events[0][-1].completion_tokens == n == len(cut.tokens(0)) < len(ids)
    assert list(cut.tokens(0)) == ids[:n]


@pytest.mark.slow
def test_warmup_compiles_everything_a_client_can_send(bundled, caplog):
    """Issue 57, item 9 and issue 59: --warmup compiles every program, and sampling
    settings are values in the state, so requests of any setting log no compile.
    Negative control: without the warm-up the same requests compile."""
    caplog.set_level(logging.INFO, logger="tev_jax.server")
    tok = bundled[2]
    requests = [_request(tok, 1.0, 1), _request(tok, 0.0, 2),
                dataclasses.replace(_request(tok, 0.7, 3),
                                    sampling=Sampling(0.7, top_k=3, top_p=0.9))]
    for warm in (True, False):
        caplog.clear()
        s = _scheduler(bundled, max_batch=2)
        if warm:
            assert s.warmup() > 0
        rec = _run(s, requests)
        s.drain()
        assert s.join(30)
        assert all(rec.events[i][-1].finish_reason == "length" for i in range(3))
        compiles = [r.getMessage() for r in caplog.records if "compiling" in r.getMessage()]
        assert (compiles == []) == warm, compiles


@pytest.mark.slow
def test_batch_invariant_rows_do_not_depend_on_their_batch(bundled):
    """Issue 57, item 7. Why a seed could break: the same row after one round on the
    1-slot program and among others on the 4-slot program has other bits in its target
    features (XLA's products accumulate in another order for another row count; the
    control). With the batch-invariant layout (one slot count, each prompt prefilled
    alone) the row's numbers are the same whatever else is in the batch, and seeded
    T = 1 requests sent together equal the same requests sent alone."""
    import jax
    import numpy as np

    from tev_jax.server.scheduler import request_keys
    from tev_jax.slots import SlotPrograms, Slots

    target, drafter, tok = bundled
    config = DecodeConfig(max_new_tokens=MAX_TOKENS, prompt_len=16, budget=4,
                          stop_token_ids=STOP_IDS, sampling=Sampling(temperature=1.0))
    programs = SlotPrograms(target, drafter, {1: config, 4: config})
    prompts = [tok.encode(t).ids for t in ("Once upon a time", "The cat sat", "In 1999 the")]

    def features(slots: int, rows: list, one_by_one: bool) -> np.ndarray:
        s = Slots(programs, slots, jax.random.key(0))
        for batch in ([[r] for r in rows] if one_by_one else [rows]):
            k = s.refill_rows(len(batch))
            s.refill([(i, prompts[i]) for i in batch],
                     request_keys([7 + i for i in batch] + [0] * (k - len(batch))), [16])
        s.run(slots + 1, 1)
        return np.asarray(s.st.new_feats_BPF[0])

    alone_1 = features(1, [0], one_by_one=True)
    batched = features(4, [0, 1, 2], one_by_one=False)
    assert not np.array_equal(alone_1, batched)  # the control: the numbers moved
    alone_4 = features(4, [0], one_by_one=True)
    assert np.array_equal(alone_4, features(4, [0, 1, 2], one_by_one=True))

    requests = [dataclasses.replace(_request(tok, 1.0, 1000 + i), prompt_ids=tuple(p))
                for i, p in enumerate(prompts)]
    s = _scheduler(bundled, max_batch=4, batch_invariant=True)
    together = _run(s, requests)
    for i, r in enumerate(requests):
        alone = Recorder(1)
        s.submit(r, alone.emit(0))
        assert alone.wait(120)
        assert alone.tokens(0) == together.tokens(i), i
    s.drain()
    assert s.join(30)
    with pytest.raises(ValueError, match="fixed budget"):
        Scheduler(target, drafter, dataclasses.replace(config, budget=AutoBudget(((1, 4),))),
                  tok.decode, batch_invariant=True)


@pytest.mark.slow
def test_n_choices_are_rows_with_their_own_keys(bundled):
    """Issue 59, item 2: ``n`` = 3 at T = 1 with a seed is three rows: three completions,
    each its own sample (choice i > 0 folds i into the request's key), choice 0 that of
    the same request with n = 1, and the whole answer the same when sent again."""
    tok = bundled[2]
    one = _request(tok, 1.0, 42)
    three = dataclasses.replace(one, n=3)
    s = _scheduler(bundled, max_batch=4, batch_invariant=True)

    def choices(request) -> list[tuple[int, ...]]:
        got = {}
        done = threading.Event()

        def emit(event):
            got.setdefault(event.choice, []).append(event)
            if len(got) == request.n and all(e[-1].finish_reason for e in got.values()):
                done.set()

        s.submit(request, emit)
        assert done.wait(120), s.snapshot()
        return [tuple(t for e in got[i] for t in e.token_ids) for i in range(request.n)]

    s.start()
    first = choices(three)
    assert len(set(first)) == 3, first  # independent samples (32 ** 6 outcomes)
    assert choices(one) == first[:1]
    assert choices(three) == first
    s.drain()
    assert s.join(30)


@pytest.mark.slow
def test_a_data_2_tensor_2_scheduler_gives_the_single_devices_greedy_completions(bundled):
    """Issue 59, item 1: the same greedy requests (and a top-k one at T = 0.0001, whose
    cut and argmax the per-row transform decides) through a scheduler on a data 2 x
    tensor 2 mesh of the simulated CPU devices (slot counts 2 and 4: the mesh divides
    no odd one) complete as on one device."""
    from tev_jax import sharding

    tok = bundled[2]
    texts = ("Once upon a time", "The cat sat on", "In the morning the")
    requests = [dataclasses.replace(_request(tok, 0.0, i), prompt_ids=tuple(tok.encode(t).ids))
                for i, t in enumerate(texts)]
    requests.append(dataclasses.replace(requests[0], sampling=Sampling(1e-4, top_k=2)))
    mesh = sharding.make_mesh(2, 1, 2)
    on_mesh = _scheduler(bundled, max_batch=4, mesh=mesh)
    assert on_mesh.sizes == (2, 4)
    one = _scheduler(bundled, max_batch=4)
    got, want = _run(on_mesh, requests), _run(one, requests)
    for s in (on_mesh, one):
        s.drain()
        assert s.join(30)
    for i in range(len(requests)):
        assert want.events[i][-1].finish_reason == "length"
        assert got.tokens(i) == want.tokens(i), i
