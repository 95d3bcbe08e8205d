"""``tev-jax serve`` end to end: the server in a subprocess on 127.0.0.1 with the bundled
models, and the ``openai`` client (and httpx for raw bodies) against it.

Slow tier: each server loads the models and compiles its programs on first use. Every
request loop is bounded, every wait has a timeout, and nothing leaves loopback.
"""

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tev-jax-bundled"
MAX_BATCH = 4
MAX_TOKENS = 48
# the budget per live-row count: a tuning table (as `tev-jax tune --json` writes it)
TUNING = {"best": {"1": {"budget": 8}, "2": {"budget": 4}, "4": {"budget": 6}}, "model": {}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``tev-jax serve`` subprocess; ready once ``GET /health`` answers."""

    def __init__(self, *flags: str, wait_s: float = 180.0):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tev_jax.cli", "serve", "--port", str(self.port), *flags],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
            env=os.environ | {"PYTHONPATH": str(ROOT)})
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the server did not start in {wait_s} s:\n{self.output()}")

    def output(self) -> str:
        return Path(self.log.name).read_text()

    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0,
                             timeout=120)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def wait_idle(self, tries: int = 100) -> dict:
        for _ in range(tries):
            h = self.health()
            if h["live"] == 0 and h["waiting"] == 0:
                return h
            time.sleep(0.1)
        return h

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tuning = tmp_path_factory.mktemp("serve") / "tune.json"
    tuning.write_text(json.dumps(TUNING))
    s = Server("--budget", "auto", "--tuning", str(tuning), "--max-batch", str(MAX_BATCH),
               "--max-tokens", str(MAX_TOKENS), "--max-prompt-tokens", "64",
               "--max-queue", "64", "--seed", "0")
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def bundled():
    from tev_jax.models.bundled import load_bundled

    return load_bundled()


def _prompts(tokenizer, n: int) -> list[str]:
    """n texts from the bundled prompt sets, cut to fit the 64-token prompt buffer."""
    from tev_jax.data.prompts import prompt_set

    texts = prompt_set("gsm") + prompt_set("humaneval") + prompt_set("mt_bench")
    out = []
    for t in texts[:n]:
        while len(tokenizer.encode(t).ids) > 40:
            t = t[: len(t) * 3 // 4]
        out.append(t)
    return out


def _greedy(bundled, texts: list[str], max_tokens: list[int], chat: bool = False):
    """The greedy AR continuation (text, token count) of each text, each cut at its
    max_tokens: `tev_jax.generate_ar`, the reference."""
    from tev_jax.data.tokenizer import STOP_IDS, format_chat
    from tev_jax.decode import DecodeConfig
    from tev_jax.engine import generate_ar

    target, _, tok = bundled
    ids = [tok.encode(format_chat(t) if chat else t).ids for t in texts]
    gen = generate_ar(target, ids, DecodeConfig(max_new_tokens=MAX_TOKENS,
                                                stop_token_ids=STOP_IDS))
    out = []
    for row, m in zip(gen.rows(), max_tokens):
        row = row[:m]
        out.append((tok.decode(row), len(row)))
    return out


def _complete(client, text, max_tokens, **kw):
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=max_tokens,
                                  temperature=0, **kw)
    return r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason


def test_greedy_completions_equal_ar_at_every_concurrency(server, bundled):
    texts = _prompts(bundled[2], 10)
    lengths = [MAX_TOKENS, 5, 17, MAX_TOKENS, 9, 30, 1, MAX_TOKENS, 12, 24]
    want = _greedy(bundled, texts, lengths)
    client = server.client()
    for text, m, (w_text, w_n) in list(zip(texts, lengths, want))[:3]:   # concurrency 1
        got, n, _ = _complete(client, text, m)
        assert (got, n) == (w_text, w_n)
    # 10 at once over 4 slots, mixed with sampled requests (another lane): queued,
    # admitted as slots free, on 1-, 2- and 4-slot programs
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        greedy = [pool.submit(_complete, client, t, m) for t, m in zip(texts, lengths)]
        sampled = [pool.submit(client.completions.create, model=MODEL, prompt=t,
                               max_tokens=8, temperature=1.0) for t in texts[:2]]
        got = [f.result(timeout=300) for f in greedy]
        assert all(f.result(timeout=300).usage.completion_tokens >= 1 for f in sampled)
    for (g_text, g_n, reason), (w_text, w_n), m in zip(got, want, lengths):
        assert (g_text, g_n) == (w_text, w_n)
        assert reason == "stop" if g_n < m else reason in ("stop", "length")
    h = server.wait_idle()
    assert h["slots_free"] == MAX_BATCH and h["live"] == 0


def test_chat_and_streaming(server, bundled):
    client = server.client()
    text = _prompts(bundled[2], 1)[0]
    (want, want_n), = _greedy(bundled, [text], [20], chat=True)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                       max_tokens=20, temperature=0)
    assert r.choices[0].message.content == want and r.usage.completion_tokens == want_n
    assert r.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=20,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == want
    assert len([p for p in pieces if p]) >= 2  # round by round, not all at the end
    assert chunks[-1].usage.completion_tokens == want_n
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    stream = client.completions.create(model=MODEL, prompt=text, max_tokens=20,
                                       temperature=0, stream=True)
    (plain, _), = _greedy(bundled, [text], [20])
    assert "".join(c.choices[0].text for c in stream) == plain
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_bad_requests_get_400_naming_the_field(server):
    client = server.client()
    cases = [
        ("max_tokens", dict(model=MODEL, prompt="hi", max_tokens=-1)),
        ("max_tokens", dict(model=MODEL, prompt="hi", max_tokens=MAX_TOKENS + 1)),
        ("prompt", dict(model=MODEL, prompt="word " * 200)),  # longer than the cache's P
        ("n", dict(model=MODEL, prompt="hi", n=MAX_BATCH + 1)),
        ("temperature", dict(model=MODEL, prompt="hi", temperature=3)),
    ]
    for param, kw in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**kw)
        assert e.value.status_code == 400 and e.value.body["param"] == param, kw
    with pytest.raises(openai.NotFoundError) as e:  # as OpenAI answers an unknown model
        client.completions.create(model="gpt-4", prompt="hi")
    assert e.value.status_code == 404 and e.value.body["code"] == "model_not_found"
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    assert e.value.body["param"] == "messages"


def test_client_that_disconnects_frees_its_slot(server, bundled):
    before = server.wait_idle()["finish_reasons"].get("abort", 0)
    text = _prompts(bundled[2], 1)[0]
    body = {"model": MODEL, "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True, "stop": ["never-in-the-text-xyz"]}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # the first event; then the client goes away
    h = server.wait_idle()
    assert h["live"] == 0 and h["slots_free"] == MAX_BATCH
    assert h["finish_reasons"].get("abort", 0) == before + 1


def test_32_concurrent_streams_lose_and_repeat_nothing(server, bundled):
    texts = _prompts(bundled[2], 32)
    want = _greedy(bundled, texts, [16] * 32)
    client = server.client()

    def stream(text):
        chunks = list(client.completions.create(
            model=MODEL, prompt=text, max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"return_token_ids": True}))
        ids = [i for c in chunks if c.choices for i in c.choices[0].model_extra["token_ids"]]
        return "".join(c.choices[0].text for c in chunks if c.choices), ids, chunks[-1].usage

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        got = list(pool.map(stream, texts, timeout=600))
    for (text, ids, usage), (w_text, w_n) in zip(got, want):
        assert text == w_text and len(ids) == w_n == usage.completion_tokens
        assert bundled[2].decode(ids) == w_text
    h = server.wait_idle()
    assert h["slots_free"] == MAX_BATCH and h["live"] == 0 and h["waiting"] == 0
    # rounds ran on the 4-slot program with the tuning's budget for 4 rows
    assert h["slot_counts"].get("4", 0) > 0 and h["budgets"].get("6", 0) > 0


@pytest.fixture(scope="module")
def fixed_server():
    s = Server("--budget", "6", "--max-batch", str(MAX_BATCH), "--max-tokens",
               str(MAX_TOKENS), "--max-prompt-tokens", "64", "--seed", "0",
               "--per-request-spec-decode-metrics", "summary")
    yield s
    assert s.stop() == 0, s.output()


def test_a_seed_gives_the_same_completion_whatever_shares_the_batch(fixed_server, bundled):
    """``seed`` at T = 1 with a fixed budget: a request sent alone, then 4 copies of it
    among 8 unseeded sampled requests and 4 greedy ones (one batch, every slot count,
    other join rounds), all give one text; the same request with another seed gives
    another (the negative control: 32 tokens at T = 1 of the bundled target). (With
    ``--budget auto`` the tree follows the live rows, and with it which exact sample a
    key picks.)"""
    server = fixed_server
    client = server.client()
    text = _prompts(bundled[2], 3)[2]

    def sampled(seed=None, temperature=1.0):
        kw = {} if seed is None else {"seed": seed}
        r = client.completions.create(model=MODEL, prompt=text, max_tokens=32,
                                      temperature=temperature, **kw)
        return r.choices[0].text

    alone = sampled(seed=1234)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        runs = [pool.submit(sampled, 1234) for _ in range(4)]
        others = ([pool.submit(sampled) for _ in range(8)]
                  + [pool.submit(sampled, None, 0.0) for _ in range(4)])
        assert [f.result(timeout=300) for f in runs] == [alone] * 4
        assert len({f.result(timeout=300) for f in others[:8]}) > 1  # unseeded: not fixed
    assert sampled(seed=1235) != alone
    assert server.wait_idle()["slots_free"] == MAX_BATCH


def _metrics(server) -> dict[tuple, float]:
    """``GET /metrics`` parsed by prometheus_client: (sample name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(r.text)
            for sample in family.samples}


def _sum(metrics: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in metrics.items()
               if n == name and all(dict(ls).get(k) == v for k, v in labels.items()))


def test_metrics_count_the_tokens_served(fixed_server, bundled):
    """Issue 59, item 3: ``/metrics`` parses with prometheus_client, under vLLM's names;
    over a wave of 12 requests (greedy and sampled, n = 2 among them, every slot count)
    the generation tokens are the completion tokens served, and each request's tokens
    after its first are its drafts plus its accepted draft tokens (every round of a
    tree row gives one draft, its accepted tokens and the bonus token); every choice
    counts as a finished request; and the responses' own acceptance, in vLLM's
    per-request shape (``metrics.speculative_decoding``), adds up to the counters."""
    server = fixed_server
    client = server.client()
    texts = _prompts(bundled[2], 6)
    before = _metrics(server)

    def complete(i):
        r = client.completions.create(model=MODEL, prompt=texts[i % 6], max_tokens=8 + i,
                                      temperature=(0.0, 1.0)[i % 2], n=1 + (i % 4 == 3))
        spec = r.model_extra["metrics"]["speculative_decoding"]
        hist = spec["acceptance_histogram"]
        assert spec["num_spec_steps"] == sum(hist) and spec["num_spec_tokens"] == 6
        assert spec["num_accepted_draft_tokens"] == sum(j * c for j, c in enumerate(hist))
        assert spec["num_spec_steps"] + spec["num_accepted_draft_tokens"] == (
            r.usage.completion_tokens - len(r.choices))
        return r.usage.completion_tokens, len(r.choices), spec

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        served = list(pool.map(complete, range(12), timeout=300))
    server.wait_idle()
    after = _metrics(server)
    delta = lambda name, **kw: _sum(after, name, **kw) - _sum(before, name, **kw)
    tokens, choices = sum(t for t, _, _ in served), sum(c for _, c, _ in served)
    assert delta("vllm:generation_tokens_total") == tokens
    drafts = delta("vllm:spec_decode_num_drafts_total")
    accepted = delta("vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and drafts + accepted == tokens - choices, (drafts, accepted)
    assert drafts == sum(s["num_spec_steps"] for _, _, s in served)
    assert accepted == sum(s["num_accepted_draft_tokens"] for _, _, s in served)
    assert delta("vllm:spec_decode_num_draft_tokens_total") == 6 * drafts  # --budget 6
    per_pos = [delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
               for p in range(6)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert sum(delta("vllm:request_success_total", finished_reason=r)
               for r in ("length", "stop")) == choices
    assert delta("vllm:time_to_first_token_seconds_count") == choices
    assert _sum(after, "vllm:num_requests_running") == 0


@pytest.fixture(scope="module")
def settings_server():
    s = Server("--budget", "6", "--max-batch", str(MAX_BATCH), "--batch-invariant",
               "--max-tokens", "16", "--max-prompt-tokens", "64", "--seed", "0")
    yield s
    assert s.stop() == 0, s.output()


class Watchdog:
    """Polls ``GET /health`` in a thread and remembers the longest stretch in which
    requests waited while the server was idle (no live row, none being admitted)."""

    def __init__(self, server: Server, every_s: float = 0.25):
        self.server, self.every_s = server, every_s
        self.longest_idle_s, self._since = 0.0, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self):
        while not self._stop.wait(self.every_s):
            h = self.server.health()
            now = time.monotonic()
            if h["waiting"] and not h["live"] and not h.get("admitting", 0):
                self._since = self._since or now
                self.longest_idle_s = max(self.longest_idle_s, now - self._since)
            else:
                self._since = None

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)


def test_many_settings_in_one_batch_all_complete_as_alone(settings_server, bundled):
    """Issues 60 and 59: six sampling settings in one batch of four slots, sent
    concurrently twice and then in waves of two: every request completes and equals the
    same request sent alone (seed i, fixed budget, ``--batch-invariant``), ``/health``
    returns to ``waiting: 0``, and a watchdog polling ``/health`` never sees requests
    waiting on an idle server for 5 s (with one lane per setting, four of eight such
    requests once waited forever after the lanes had been used)."""
    server = settings_server
    client = server.client()
    text = _prompts(bundled[2], 2)[1]
    settings = [dict(temperature=round(0.3 + 0.1 * i, 1), top_p=(1.0, 0.9)[i % 2], seed=i)
                for i in range(6)]

    def complete(kw):
        r = client.completions.create(model=MODEL, prompt=text, max_tokens=12, **kw)
        return r.choices[0].text, r.usage.completion_tokens

    with Watchdog(server) as watchdog:
        alone = [complete(kw) for kw in settings]
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            for _ in range(2):  # all at once, twice over
                assert list(pool.map(complete, settings, timeout=300)) == alone
            for i in range(0, 6, 2):  # waves of two new settings
                assert list(pool.map(complete, settings[i:i + 2], timeout=300)) == alone[i:i + 2]
        h = server.wait_idle()
    assert h["waiting"] == 0 and h["live"] == 0 and h["stalls"] == 0, h
    assert watchdog.longest_idle_s < 5, watchdog.longest_idle_s


def _first_two_law(bundled, prompt_ids, temperature, top_k):
    """The exact law of (t0, t1), the first two tokens, under the sampling transform:
    ``joint[i, y] = p(c_i) p(y | c_i)`` over the top-k candidates c of t0."""
    from tev_jax.models import score
    from tev_jax.testing import reference as ref

    target = bundled[0]
    p0 = np.exp(ref.log_probs(np.asarray(score(target, np.asarray([prompt_ids])))[0, -1],
                              temperature, top_k))
    cands = np.flatnonzero(p0 > 0)
    rows = np.asarray([list(prompt_ids) + [int(c)] for c in cands])
    p1 = np.exp(ref.log_probs(np.asarray(score(target, rows))[:, -1], temperature, top_k))
    return cands, p0[cands, None] * p1


@pytest.fixture(scope="module")
def mesh_server():
    """A server on a data 2 x tensor 2 mesh of the simulated CPU devices (issue 59)."""
    s = Server("--budget", "6", "--max-batch", str(MAX_BATCH), "--max-tokens",
               str(MAX_TOKENS), "--max-prompt-tokens", "64", "--seed", "0",
               "--mesh-data", "2", "--mesh-tensor", "2", wait_s=300)
    yield s
    assert s.stop() == 0, s.output()


def test_a_mesh_server_gives_the_single_devices_greedy_completions(mesh_server, bundled):
    """Issue 59, item 1: greedy completions through a data 2 x tensor 2 server, sent
    together (slot counts 2 and 4), equal the single device's AR reference."""
    client = mesh_server.client()
    texts = _prompts(bundled[2], 6)
    lengths = [MAX_TOKENS - 5 * i for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda a: _complete(client, *a)[:2], zip(texts, lengths),
                            timeout=600))
    assert got == _greedy(bundled, texts, lengths)
    h = mesh_server.wait_idle()
    assert set(h["slot_counts"]) <= {"2", "4"}, h  # the mesh divides no odd count


@pytest.mark.parametrize("where", ["server", "mesh_server"])
def test_t1_first_tokens_pass_chi_square_and_the_negative_control_fails(where, bundled,
                                                                         request):
    """TEV through the server at T = 1 (top-k 4), on one device and on a data 2 x
    tensor 2 mesh: the first two tokens of 640 requests (t1 is the first round's
    verified token) against their exact law, chi-square at alpha = 1e-4
    (`tev_jax.testing.chi_square`); the same draws against the law at T = 0.5 (the
    negative control) must be rejected. Server seed 0: each request's row key from a
    seed the server draws."""
    from tev_jax.testing import chi_square

    server = request.getfixturevalue(where)
    tok = bundled[2]
    prompt = tok.encode("The best way to").ids
    cands, joint = _first_two_law(bundled, prompt, 1.0, 4)
    client = server.client()

    def draw(_):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                      temperature=1.0,
                                      extra_body={"top_k": 4, "return_token_ids": True})
        return r.choices[0].model_extra["token_ids"]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        draws = list(pool.map(draw, range(640), timeout=600))
    assert all(len(d) == 2 for d in draws)
    where = {int(c): i for i, c in enumerate(cands)}
    exits = np.asarray([where.get(d[0], -1) for d in draws])
    bonuses = np.asarray([d[1] for d in draws])
    report = chi_square(exits, bonuses, joint, alpha=1e-4)
    assert report.passed, report
    _, cold = _first_two_law(bundled, prompt, 0.5, 4)
    control = chi_square(exits, bonuses, cold, alpha=1e-4)
    assert not control.passed, control
    assert server.wait_idle()["slots_free"] == MAX_BATCH


@pytest.fixture(scope="module")
def small_server():
    s = Server("--budget", "8", "--max-batch", "1", "--max-queue", "1", "--warmup",
               "--max-tokens", "64", "--max-prompt-tokens", "32")
    yield s
    s.stop()


def test_full_queue_answers_429_with_retry_after(small_server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 64,
            "temperature": 0, "stop": ["never-in-the-text-xyz"]}
    post = lambda _: httpx.post(small_server.url + "/v1/completions", json=body, timeout=120)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(post, range(6), timeout=300))
    codes = sorted(r.status_code for r in answers)
    assert codes.count(200) >= 2 and 429 in codes and set(codes) <= {200, 429}, codes
    busy = next(r for r in answers if r.status_code == 429)
    assert busy.headers["retry-after"] == "1"
    assert busy.json()["error"]["type"] == "rate_limit_error"
    assert small_server.wait_idle()["slots_free"] == 1


def test_sigterm_drains_within_a_round_and_exits_0(small_server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 64,
            "temperature": 0, "stream": True, "stop": ["never-in-the-text-xyz"]}
    events = []
    with httpx.stream("POST", small_server.url + "/v1/completions", json=body,
                      timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[len("data: "):])
            if len(events) == 1:
                small_server.proc.send_signal(signal.SIGTERM)
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])["choices"][0]
    assert last["finish_reason"] in ("abort", "length")
    assert small_server.proc.wait(60) == 0, small_server.output()
    with pytest.raises(httpx.HTTPError):
        httpx.get(small_server.url + "/health", timeout=5)
