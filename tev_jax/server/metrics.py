"""The server's Prometheus metrics (``GET /metrics``), under vLLM's names.

The names, types, labels and histogram buckets are vLLM's (its v1 engine's Prometheus
logger and speculative-decoding metrics), so dashboards and PromQL written for vLLM
read a ``tev-jax serve`` unchanged. Every series carries vLLM's labels ``model_name``
(the served name) and ``engine`` (always ``"0"``: one scheduler). prometheus_client
appends ``_total`` to a counter's samples, as for vLLM.

Speculative decoding, in vLLM's terms: each live row of a round with tree budget
``b > 0`` is one *draft* of ``b`` draft tokens, of which the row accepts ``a`` (its
accepted block length minus the bonus token, ``a <= b``). Then::

    acceptance rate        = rate(vllm:spec_decode_num_accepted_tokens_total)
                             / rate(vllm:spec_decode_num_draft_tokens_total)
    mean acceptance length = 1 + rate(vllm:spec_decode_num_accepted_tokens_total)
                                 / rate(vllm:spec_decode_num_drafts_total)
    acceptance at p        = rate(vllm:spec_decode_num_accepted_tokens_per_pos_total{position="p"})
                             / rate(vllm:spec_decode_num_drafts_total)

A tree's budget counts all its nodes, of which one path at most is accepted, so its
acceptance rate reads lower than a chain's for the same accepted tokens: the mean
acceptance length is the figure to compare. Autoregressive rounds (budget 0) count in
``tev_jax:rounds`` only.

The metrics live in the instance's own `prometheus_client.CollectorRegistry`, never the
process-wide one, so several servers (and tests) share a process. prometheus_client is
thread-safe: the scheduler's thread records, the event loop reads.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, generate_latest)

ENGINE = "0"
"""The ``engine`` label: vLLM numbers its engine cores; a tev-jax server has one."""

FINISH_REASONS = ("stop", "length", "abort", "error")
"""The ``finished_reason`` values present from the start (vLLM's ``FinishReason`` strings,
which are also the scheduler's)."""

# vLLM's buckets: time to first token; inter-token and per-token times; a request's
# end-to-end and queue times.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

_LABELS = ("model_name", "engine")


class ServerMetrics:
    """The metrics of one server, in their own registry (see the module docstring).

    Args:
      model_name: the served model's name (the ``model_name`` label).

    Attributes:
      registry: the `prometheus_client.CollectorRegistry` holding them.
    """

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self._values = (model_name, ENGINE)

        def family(kind, name: str, doc: str, extra: tuple[str, ...] = (), **kw):
            return kind(name, doc, _LABELS + extra, registry=self.registry, **kw)

        def one(kind, name: str, doc: str, **kw):
            return family(kind, name, doc, **kw).labels(*self._values)

        self._drafts = one(Counter, "vllm:spec_decode_num_drafts",
                           "Number of spec decoding drafts (live rows of tree rounds).")
        self._draft_tokens = one(Counter, "vllm:spec_decode_num_draft_tokens",
                                 "Number of draft tokens (the tree budget per draft).")
        self._accepted = one(Counter, "vllm:spec_decode_num_accepted_tokens",
                             "Number of accepted tokens.")
        self._per_pos_family = family(Counter, "vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.", ("position",))
        self._per_pos: list = []  # position p's counter, for p < the largest budget seen
        self._running = one(Gauge, "vllm:num_requests_running",
                            "Number of requests in model execution batches.")
        self._waiting = one(Gauge, "vllm:num_requests_waiting",
                            "Number of requests waiting to be processed.")
        self._prompt_tokens = one(Counter, "vllm:prompt_tokens",
                                  "Number of prefill tokens processed.")
        self._generation_tokens = one(Counter, "vllm:generation_tokens",
                                      "Number of generation tokens processed.")
        self._success_family = family(Counter, "vllm:request_success",
                                      "Count of successfully processed requests.",
                                      ("finished_reason",))
        self._success = {r: self._success_family.labels(*self._values, r)
                         for r in FINISH_REASONS}
        self._ttft = one(Histogram, "vllm:time_to_first_token_seconds",
                         "Histogram of time to first token in seconds.", buckets=TTFT_BUCKETS)
        self._itl = one(Histogram, "vllm:inter_token_latency_seconds",
                        "Histogram of inter-token latency in seconds.", buckets=TOKEN_BUCKETS)
        self._tpot = one(Histogram, "vllm:time_per_output_token_seconds",
                         "Histogram of time per output token in seconds. DEPRECATED in "
                         "vLLM: the same as vllm:inter_token_latency_seconds.",
                         buckets=TOKEN_BUCKETS)
        self._request_tpot = one(Histogram, "vllm:request_time_per_output_token_seconds",
                                 "Histogram of time_per_output_token_seconds per request.",
                                 buckets=TOKEN_BUCKETS)
        self._e2e = one(Histogram, "vllm:e2e_request_latency_seconds",
                        "Histogram of e2e request latency in seconds.",
                        buckets=REQUEST_BUCKETS)
        self._queue = one(Histogram, "vllm:request_queue_time_seconds",
                          "Histogram of time spent in WAITING phase for request.",
                          buckets=REQUEST_BUCKETS)
        self._budget_family = family(Gauge, "tev_jax:tree_budget",
                                     "Tree budget a slot count decodes with (0: "
                                     "autoregressive).", ("slots",))
        self._rounds = one(Counter, "tev_jax:rounds", "Number of decode rounds.")

    def on_round(self, budget: int, accepted: Sequence[int]) -> None:
        """One decode round.

        Args:
          budget: the tree budget it ran with: > 0 a tree of that many draft tokens per
            row, 0 autoregressive (nothing drafted), < 0 a builder whose budget is not
            known (counted in ``tev_jax:rounds`` only).
          accepted: per live row, the draft tokens it accepted this round (its block
            length - 1), each in ``[0, budget]``.
        """
        accepted = [int(a) for a in accepted]
        top = max(accepted, default=0)
        if min(accepted, default=0) < 0 or (budget >= 0 and top > budget):
            raise ValueError(f"accepted tokens {accepted} outside [0, {max(budget, 0)}] "
                             f"(budget {budget})")
        self._rounds.inc()
        if budget <= 0:
            return
        while len(self._per_pos) < budget:  # a new position's series starts at 0
            self._per_pos.append(self._per_pos_family.labels(*self._values,
                                                             str(len(self._per_pos))))
        if not accepted:
            return
        self._drafts.inc(len(accepted))
        self._draft_tokens.inc(len(accepted) * budget)
        self._accepted.inc(sum(accepted))
        rows_at = [0] * (top + 1)  # rows_at[a]: rows that accepted exactly a tokens
        for a in accepted:
            rows_at[a] += 1
        beyond = 0  # rows that accepted more than p tokens, from the deepest p up
        for p in range(top - 1, -1, -1):
            beyond += rows_at[p + 1]
            self._per_pos[p].inc(beyond)

    def on_queued(self) -> None:
        """A request joined the queue (``vllm:num_requests_waiting`` + 1 until the next
        `set_rows`)."""
        self._waiting.inc()

    def on_admitted(self, queue_seconds: float) -> None:
        """A request left the queue for a slot after ``queue_seconds``."""
        self._waiting.dec()
        self._running.inc()
        self._queue.observe(queue_seconds)

    def on_first_token(self, seconds: float) -> None:
        """A request's first tokens, ``seconds`` after it arrived."""
        self._ttft.observe(seconds)

    def on_next_tokens(self, seconds: float) -> None:
        """A running request's later tokens, ``seconds`` after its previous ones: one
        observation per round that brought it tokens, however many (vLLM observes its
        inter-token latency once per engine step and request, drafts included)."""
        self._itl.observe(seconds)
        self._tpot.observe(seconds)

    def on_finished(self, reason: str, prompt_tokens: int, completion_tokens: int,
                    e2e_seconds: float, first_token_seconds: float | None) -> None:
        """A request ended.

        Args:
          reason: its finish reason ('stop', 'length', 'abort', 'error').
          prompt_tokens, completion_tokens: its usage.
          e2e_seconds: from its arrival to its end.
          first_token_seconds: from its arrival to its first tokens (None: it had none).
            With more than one completion token its time per output token,
            ``(e2e - ttft) / (completion - 1)``, is observed.
        """
        self._prompt_tokens.inc(prompt_tokens)
        self._generation_tokens.inc(completion_tokens)
        if reason not in self._success:
            self._success[reason] = self._success_family.labels(*self._values, reason)
        self._success[reason].inc()
        self._e2e.observe(e2e_seconds)
        if first_token_seconds is not None and completion_tokens > 1:
            self._request_tpot.observe(
                (e2e_seconds - first_token_seconds) / (completion_tokens - 1))

    def set_rows(self, running: int, waiting: int) -> None:
        """The requests in slots and in the queue now."""
        self._running.set(running)
        self._waiting.set(waiting)

    def set_budget(self, slots: int, budget: int) -> None:
        """The tree budget the ``slots``-slot programs decode with (0: autoregressive)."""
        self._budget_family.labels(*self._values, str(slots)).set(budget)

    def exposition(self) -> tuple[bytes, str]:
        """The registry in Prometheus' text format: (body, Content-Type)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


__all__ = ["ENGINE", "FINISH_REASONS", "REQUEST_BUCKETS", "TOKEN_BUCKETS", "TTFT_BUCKETS",
           "ServerMetrics"]
