"""Running the server: the models loaded into a `Served`, and uvicorn serving it.

`serve` loads the target, the drafter and the tokenizer, builds the `Scheduler`
(`tev_jax.server.scheduler`) and the app (`tev_jax.server.app`), and runs uvicorn until
SIGINT / SIGTERM. On a signal it stops admitting and drains the scheduler: the waiting
requests end at once and the running ones at the end of the current round (or after
``drain_seconds``), each with its ``finish_reason``. The server keeps listening while
the scheduler drains, so a request that arrives then gets 503 (and ``GET /health``
says ``draining``) rather than a refused connection; once the scheduler has finished,
uvicorn closes the connections and `serve` returns (exit 0). A second signal stops
listening at once.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import signal
import socket
import sys
import threading

import uvicorn

from tev_jax.decode import DecodeConfig
from tev_jax.server.app import DEFAULT_MAX_BODY_BYTES, Served, create_app
from tev_jax.server.requests import Limits
from tev_jax.server.scheduler import Scheduler


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """``tev-jax serve``'s settings.

    Attributes:
      target: the target checkpoint directory.
      drafter: the drafter's (None for plain AR).
      config: builder, budget, verifier, ``max_new_tokens`` (the most a request may ask
        for) and ``prompt_len`` (the longest prompt); sampling comes per request.
      model: the served model's name (``GET /v1/models``).
      host, port: where to listen (loopback by default).
      max_batch, max_queue: the `Scheduler`'s.
      drain_seconds: on SIGTERM, how long running requests may go on.
      seed: the scheduler's key.
      dtype: parameter and cache dtype.
      mesh: the (data, fsdp, tensor) device counts the models and the decode state are
        sharded over; (1, 1, 1) is one device.
      warmup: compile every program before listening (else each compiles when first
        met, and the request that meets it waits for it).
      batch_invariant: the `Scheduler`'s: a seed holds bit for bit whatever shares the
        batch (every round on the max-batch program, every prompt prefilled alone).
      api_key: when set, ``/v1/*`` needs ``Authorization: Bearer <key>``.
      max_body_bytes: the largest request body read (more: 413).
      spec_metrics: every response carries vLLM's per-request speculative-decoding
        summary (``--per-request-spec-decode-metrics summary``).
    """

    target: str
    drafter: str | None
    config: DecodeConfig
    model: str = "tev-jax"
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 8
    max_queue: int = 64
    drain_seconds: float = 0.0
    seed: int = 0
    dtype: str = "float32"
    mesh: tuple[int, int, int] = (1, 1, 1)
    warmup: bool = False
    batch_invariant: bool = False
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    spec_metrics: bool = False


def build(options: ServeOptions) -> Served:
    """Loads the models and builds the scheduler (not started) and the request limits.

    Raises:
      ValueError: a mesh the devices or the models do not divide, or a configuration
        whose decode state does not fit the devices' memory (`check_fits`).
    """
    import jax.numpy as jnp

    from tev_jax import sharding, text_io
    from tev_jax.budget import AutoBudget, check_tuned_for
    from tev_jax.data.tokenizer import BOS
    from tev_jax.models import load_drafter, load_target, load_tokenizer
    from tev_jax.server.metrics import ServerMetrics
    from tev_jax.text_io import stop_token_ids

    dtype = jnp.dtype(options.dtype)
    mesh = None if options.mesh == (1, 1, 1) else sharding.make_mesh(*options.mesh)
    target = load_target(options.target, dtype=dtype, mesh=mesh)
    tokenizer = load_tokenizer(options.target)
    drafter = (None if options.drafter is None
               else load_drafter(options.drafter, target, dtype=dtype, mesh=mesh))
    config = options.config
    if not config.stop_token_ids:
        config = dataclasses.replace(config, stop_token_ids=stop_token_ids(target, tokenizer))
    if isinstance(config.budget, AutoBudget) and config.builder == "ddtree":
        check_tuned_for(config.budget, target, drafter)
    check_fits(target, drafter, config, options.max_batch, mesh)
    # tokenizer_config.json's chat_template, or chat_template.jinja beside it
    chat = text_io.chat_formatter(options.target)
    has_bos = tokenizer.token_to_id(BOS) is not None

    def encode(text: str) -> list[int]:  # a chat template that writes BOS itself
        # encode_batch releases the GIL while it works (encode holds it: seconds for a
        # megabyte, the event loop stalled)
        return tokenizer.encode_batch(
            [text], add_special_tokens=not (has_bos and text.startswith(BOS)))[0].ids

    metrics = ServerMetrics(options.model)
    scheduler = Scheduler(target, drafter, config, tokenizer.decode,
                          max_batch=options.max_batch, max_queue=options.max_queue,
                          seed=options.seed, batch_invariant=options.batch_invariant,
                          mesh=mesh, metrics=metrics)
    limits = Limits(model=options.model, prompt_len=config.prompt_len,
                    max_tokens=config.max_new_tokens,
                    max_positions=target.config.max_position_embeddings,
                    vocab_size=target.config.vocab_size, max_n=options.max_batch)
    return Served(scheduler, limits, encode, chat, options.drain_seconds,
                  api_key=options.api_key, max_body_bytes=options.max_body_bytes,
                  metrics=metrics, spec_metrics=options.spec_metrics)


SERVE_FLAGS = {"budget": "--budget", "max_new_tokens": "--max-tokens",
               "batch size": "--max-batch", "cache length": "--max-prompt-tokens"}
"""How `tev_jax.costs.plan.shortfall`'s advice names the settings on ``tev-jax serve``."""


def check_fits(target, drafter, config: DecodeConfig, max_batch: int, mesh) -> None:
    """Refuses, in one line naming the flag to lower, a server whose largest slot
    program's buffers (the caches of ``max_batch`` rows, a round's tree logits and each
    row's transformed logits; `tev_jax.costs.plan.decode_floor`, from shapes alone) do
    not fit each device's free memory (`tev_jax.costs.plan.check_decode_floor`)."""
    from tev_jax.costs import plan
    from tev_jax.slots import serving_configs

    for slots, slot_config in serving_configs(config, max_batch, mesh).items():
        if slots == max_batch:
            plan.check_decode_floor(target, drafter, slot_config, slots, mesh=mesh,
                                    names=SERVE_FLAGS)


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (``host``, ``port``); port 0 takes any free port (read it
    with ``getsockname``). Raises OSError naming the address if it cannot be bound."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} is not a TCP port (1 to 65535, or 0: any free one)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port} ({e.strerror})") from None
    return sock


def log_config() -> dict:
    """uvicorn's logging with every line on stderr (its access log included, which it
    writes to stdout by default), as the rest of ``tev-jax serve`` writes."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    for handler in config["handlers"].values():
        handler["stream"] = "ext://sys.stderr"
    return config


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class _DrainingServer(uvicorn.Server):
    """uvicorn's server whose exit signal drains the scheduler at once (running streams
    end within a round, or after ``drain_seconds``, instead of uvicorn waiting for them)
    and lets uvicorn stop only once the scheduler has finished: until then it keeps
    listening, and a new request gets 503. A second signal stops listening at once (a
    third SIGINT is uvicorn's forced exit)."""

    def __init__(self, config: uvicorn.Config, served: Served):
        super().__init__(config)
        self.served = served
        self._drained: threading.Thread | None = None

    def handle_exit(self, sig, frame) -> None:
        if self._drained is not None:
            super().handle_exit(sig, frame)
            return
        self.served.scheduler.drain(self.served.drain_seconds)
        self._drained = threading.Thread(target=self._exit_when_drained, args=(sig,),
                                         name="tev-jax-drain", daemon=True)
        self._drained.start()

    def _exit_when_drained(self, sig) -> None:
        self.served.scheduler.join()
        super().handle_exit(sig, None)


@contextlib.contextmanager
def _quiet_signals():
    """uvicorn raises the signal it caught again once it has shut down; here that
    re-raise finds a handler that ignores it, so a drained server exits 0."""
    old = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def serve(options: ServeOptions, served: Served | None = None) -> int:
    """Serves until SIGINT / SIGTERM; 0 after a drained shutdown."""
    served = served or build(options)
    if options.warmup:
        print("tev-jax serve: compiling every program (each slot count, prompt bucket and "
              "move) ...", file=sys.stderr, flush=True)
        served.scheduler.warmup()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    sock = listening_socket(options.host, options.port)
    config = uvicorn.Config(create_app(served), log_level="info", log_config=log_config(),
                            timeout_graceful_shutdown=30)
    server = _DrainingServer(config, served)
    host, port = sock.getsockname()[:2]
    print(f"tev-jax serve: {options.model} on http://{_url_host(host)}:{port}/v1 "
          f"(max batch {options.max_batch})", file=sys.stderr, flush=True)
    with _quiet_signals():
        server.run(sockets=[sock])
    return 0 if served.scheduler.join(30) else 1


__all__ = ["SERVE_FLAGS", "ServeOptions", "build", "check_fits", "serve"]
