"""The server's Prometheus metrics (`tev_jax.server.metrics`) and ``GET /metrics``: no
server process, no engine, fast tier. Counters are checked against sums by hand and
against an obvious per-row twin; the exposition is read back with prometheus_client's
own parser."""

import numpy as np
import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from tev_jax.server.metrics import ENGINE, FINISH_REASONS, ServerMetrics

SPEC = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
        "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos")
COUNTERS = SPEC + ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success",
                   "tev_jax:rounds")
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "tev_jax:tree_budget")
HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:time_per_output_token_seconds",
              "vllm:request_time_per_output_token_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds")


def families(text: str) -> dict:
    """Family name -> prometheus_client `Metric` (the ``_created`` gauges left out)."""
    return {f.name: f for f in text_string_to_metric_families(text)
            if not f.name.endswith("_created")}


def read(metrics: ServerMetrics) -> dict[tuple, float]:
    """(sample name, its labels other than model_name and engine) -> value."""
    body, _ = metrics.exposition()
    out = {}
    for family in families(body.decode()).values():
        for s in family.samples:
            rest = tuple(sorted((k, v) for k, v in s.labels.items()
                                if k not in ("model_name", "engine")))
            out[s.name, rest] = s.value
    return out


def spec_counts(values: dict) -> tuple[float, float, float, list[float]]:
    """(drafts, draft tokens, accepted tokens, accepted per position) as exposed."""
    per_pos = sorted((int(dict(labels)["position"]), v) for (name, labels), v in values.items()
                     if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    assert [p for p, _ in per_pos] == list(range(len(per_pos)))
    return (values["vllm:spec_decode_num_drafts_total", ()],
            values["vllm:spec_decode_num_draft_tokens_total", ()],
            values["vllm:spec_decode_num_accepted_tokens_total", ()], [v for _, v in per_pos])


def test_the_exposition_parses_with_vllms_names_types_and_labels():
    metrics = ServerMetrics("tev-jax-bundled")
    body, content_type = metrics.exposition()
    assert content_type.startswith("text/plain")
    got = families(body.decode())
    want = ({n: "counter" for n in COUNTERS} | {n: "gauge" for n in GAUGES}
            | {n: "histogram" for n in HISTOGRAMS})
    assert {n: got[n].type for n in want if n in got} == want
    for family in got.values():
        for s in family.samples:
            assert s.labels["model_name"] == "tev-jax-bundled" and s.labels["engine"] == ENGINE
    # every finish reason is there from the start, at 0, as vLLM does
    values = read(metrics)
    assert {r: values["vllm:request_success_total", (("finished_reason", r),)]
            for r in FINISH_REASONS} == dict.fromkeys(FINISH_REASONS, 0.0)
    assert values["vllm:time_to_first_token_seconds_bucket", (("le", "0.001"),)] == 0
    assert values["vllm:e2e_request_latency_seconds_bucket", (("le", "7680.0"),)] == 0


def test_spec_decode_counters_equal_sums_by_hand():
    metrics = ServerMetrics("m")
    metrics.on_round(4, [0, 3, 1])
    metrics.on_round(0, [0, 0])
    values = read(metrics)
    assert spec_counts(values) == (3, 12, 4, [2, 1, 1, 0])
    assert values["tev_jax:rounds_total", ()] == 2
    # negative control: had the AR round counted its two rows as drafts, the check fails
    assert spec_counts(values) != (5, 12, 4, [2, 1, 1, 0])

    metrics.on_round(2, [2, 2, 0, 1])  # a smaller budget later: positions stay 4
    assert spec_counts(read(metrics)) == (7, 20, 9, [5, 3, 1, 0])


def test_an_autoregressive_round_changes_no_spec_decode_counter():
    metrics = ServerMetrics("m")
    metrics.on_round(3, [1, 0])
    before = read(metrics)
    metrics.on_round(0, [0, 0, 0])
    metrics.on_round(-1, [2, 5])  # a builder whose budget is unknown: rounds only
    after = read(metrics)
    assert {k: v for k, v in after.items() if k[0] != "tev_jax:rounds_total"} == {
        k: v for k, v in before.items() if k[0] != "tev_jax:rounds_total"}
    assert after["tev_jax:rounds_total", ()] == before["tev_jax:rounds_total", ()] + 2
    metrics.on_round(3, [1])  # control: a tree round does change them
    assert spec_counts(read(metrics)) != spec_counts(after)


def test_spec_decode_counters_match_a_per_row_twin():
    """Random rounds (seed 0, 50 rounds of 0 to 8 rows, budgets 0 to 12) against the
    plain definition: every row of a tree round is a draft of ``budget`` tokens, and
    position p counts the rows that accepted more than p."""
    rng = np.random.default_rng(0)
    metrics = ServerMetrics("m")
    drafts = draft_tokens = accepted_sum = 0
    per_pos = [0] * 12
    top_budget = 0
    for _ in range(50):
        budget = int(rng.integers(0, 13))
        rows = [int(a) for a in rng.integers(0, budget + 1, size=rng.integers(0, 9))]
        metrics.on_round(budget, rows)
        if budget == 0:
            continue
        top_budget = max(top_budget, budget)
        for a in rows:
            drafts, draft_tokens, accepted_sum = drafts + 1, draft_tokens + budget, accepted_sum + a
            for p in range(a):
                per_pos[p] += 1
    assert spec_counts(read(metrics)) == (drafts, draft_tokens, accepted_sum,
                                          per_pos[:top_budget])
    assert drafts > 0 and per_pos[0] > 0


def test_accepted_outside_the_budget_is_refused():
    metrics = ServerMetrics("m")
    for budget, rows in ((2, [3]), (0, [1]), (4, [-1])):
        with pytest.raises(ValueError, match="outside"):
            metrics.on_round(budget, rows)
    assert read(metrics)["tev_jax:rounds_total", ()] == 0  # a refused round counts nowhere
    assert spec_counts(read(metrics)) == (0, 0, 0, [])


def test_requests_gauges_and_histograms_count_what_was_observed():
    metrics = ServerMetrics("m")
    metrics.on_queued()
    metrics.on_queued()
    metrics.on_admitted(0.2)
    metrics.on_first_token(0.05)
    for seconds in (0.02, 0.03, 0.5):
        metrics.on_next_tokens(seconds)
    metrics.on_finished("stop", 5, 4, 1.0, 0.1)
    metrics.on_finished("abort", 3, 1, 0.5, None)  # one token: no time per output token
    metrics.set_budget(1, 8)
    metrics.set_budget(4, 0)
    v = read(metrics)
    assert v["vllm:num_requests_waiting", ()] == 1 and v["vllm:num_requests_running", ()] == 1
    assert v["vllm:prompt_tokens_total", ()] == 8 and v["vllm:generation_tokens_total", ()] == 5
    assert {r: v["vllm:request_success_total", (("finished_reason", r),)]
            for r in FINISH_REASONS} == {"stop": 1, "length": 0, "abort": 1, "error": 0}
    assert v["tev_jax:tree_budget", (("slots", "1"),)] == 8
    assert v["tev_jax:tree_budget", (("slots", "4"),)] == 0

    def hist(name):
        return (v[f"{name}_count", ()], v[f"{name}_sum", ()])

    assert hist("vllm:request_queue_time_seconds") == (1, pytest.approx(0.2))
    assert hist("vllm:time_to_first_token_seconds") == (1, pytest.approx(0.05))
    assert hist("vllm:e2e_request_latency_seconds") == (2, pytest.approx(1.5))
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        assert hist(name) == (3, pytest.approx(0.55))
        assert v[f"{name}_bucket", (("le", "0.025"),)] == 1
        assert v[f"{name}_bucket", (("le", "0.05"),)] == 2
    # (1.0 - 0.1) / (4 - 1) = 0.3 s per token, in the (0.2, 0.4] buckets
    assert hist("vllm:request_time_per_output_token_seconds") == (1, pytest.approx(0.3))
    assert v["vllm:request_time_per_output_token_seconds_bucket", (("le", "0.2"),)] == 0
    assert v["vllm:request_time_per_output_token_seconds_bucket", (("le", "0.4"),)] == 1

    metrics.set_rows(3, 0)  # the scheduler's count replaces the running tally
    metrics.on_finished("tool_calls", 1, 0, 0.1, None)  # a reason outside vLLM's set
    v = read(metrics)
    assert v["vllm:num_requests_running", ()] == 3 and v["vllm:num_requests_waiting", ()] == 0
    assert v["vllm:request_success_total", (("finished_reason", "tool_calls"),)] == 1


def test_two_servers_do_not_share_counts():
    a, b = ServerMetrics("m"), ServerMetrics("m")  # same name: no duplicate-series error
    a.on_round(4, [2])
    a.on_finished("stop", 3, 2, 1.0, 0.5)
    assert spec_counts(read(a)) == (1, 4, 2, [1, 1, 0, 0])
    assert spec_counts(read(b)) == (0, 0, 0, [])
    assert read(b)["vllm:e2e_request_latency_seconds_count", ()] == 0
    assert REGISTRY.get_sample_value("vllm:spec_decode_num_drafts_total",
                                     {"model_name": "m", "engine": ENGINE}) is None


# ------------------------------------------------------------------- GET /metrics


class _Idle:
    """What `create_app` needs of a scheduler when no request is sent."""

    def start(self):
        return self

    def drain(self, seconds=0.0):
        pass

    def join(self, timeout=None):
        return True

    def snapshot(self):
        return {"draining": False}


def _client(**served):
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from tev_jax.server.app import Served, create_app
    from tev_jax.server.requests import Limits

    limits = Limits(model="m", prompt_len=8, max_tokens=8, max_positions=16, vocab_size=50)
    app = create_app(Served(_Idle(), limits, lambda text: [1], lambda messages: "",
                            **served))
    return TestClient(app, raise_server_exceptions=False)


def test_metrics_answers_without_the_api_key():
    metrics = ServerMetrics("m")
    metrics.on_round(4, [0, 3, 1])
    client = _client(api_key="secret", metrics=metrics)
    r = client.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    got = families(r.text)
    assert [s.value for s in got["vllm:spec_decode_num_drafts"].samples] == [3]
    # control: the key is enforced where it applies
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer secret"}).status_code == 200


def test_metrics_is_404_without_metrics():
    r = _client().get("/metrics")
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == "not_found" and "metrics" in error["message"]
