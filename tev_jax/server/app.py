"""The HTTP side of ``tev-jax serve``: OpenAI's routes over the scheduler.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or with
``"stream": true`` server-sent events: one event per decode round's new text, then
``data: [DONE]``), ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``
(slots, queue, τ, the budgets the rounds ran with; 503 with ``"status": "draining"``
once a drain began) and ``GET /metrics`` (Prometheus' text format of the
`tev_jax.server.metrics.ServerMetrics` under vLLM's names; 404 when the server keeps
none; open without the API key, like ``/health``). Every answer that is not a success
is OpenAI's error body (``{"error": {"message", "type", "param", "code"}}``): a bad
request 400 naming the field, an unknown model 404 (``model_not_found``), an unknown
route 404 (``not_found``), a wrong method 405, a body over ``max_body_bytes`` 413
(refused from its Content-Length before it is read, or as soon as a chunked body passes
the limit), a missing or wrong API key on ``/v1/*`` 401 (``invalid_api_key``), a full
queue 429 with ``Retry-After``, a draining server 503, anything unexpected 500.

The body's JSON is parsed, checked and tokenized in a worker thread
(`asyncio.to_thread`), so a large prompt never holds up the event loop (``GET
/health``, the streams); the tokenizer must release the GIL while it encodes (`run`
encodes with ``encode_batch``, which does).

Starlette (with uvicorn to run it, `tev_jax.cli.serve`) is the stack: small, well kept,
the ASGI toolkit FastAPI is built on, with streaming responses that notice a client
going away; the bodies are checked by `tev_jax.server.requests`, so no pydantic.
The scheduler's thread calls each request's ``emit``; it hands the `Event` to the
request's asyncio queue on the event loop's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tev_jax.server.metrics import ServerMetrics
from tev_jax.server.requests import (
    GenerationRequest,
    Limits,
    RequestError,
    error_body,
    parse_request,
    read_json,
)
from tev_jax.server.scheduler import Draining, Event, QueueFull, Scheduler

log = logging.getLogger("tev_jax.server")

RETRY_AFTER_S = 1
POLL_S = 0.5  # how often a non-streamed request checks that its client is still there
DEFAULT_MAX_BODY_BYTES = 8 * 2**20


@dataclasses.dataclass(frozen=True)
class Served:
    """What the app serves.

    Attributes:
      scheduler: the `Scheduler` (started and drained by the app's lifespan).
      limits: the request `Limits` (the model's name among them).
      encode: ``text -> token ids``.
      chat_format: ``messages -> text``, the model's chat template.
      drain_seconds: on shutdown, how long running requests may go on before they are
        cut (0: at the end of the current round).
      api_key: when set, every ``/v1/*`` route needs ``Authorization: Bearer <key>``
        (``/health`` stays open).
      max_body_bytes: the largest request body read (more: 413).
      metrics: the `ServerMetrics` that ``GET /metrics`` shows (None: that route is 404).
      spec_metrics: each response carries vLLM's per-request speculative-decoding
        summary, ``"metrics": {"speculative_decoding": ...}`` (`spec_decoding`), in the
        body or in the stream's last chunk.
    """

    scheduler: Scheduler
    limits: Limits
    encode: Callable[[str], Sequence[int]]
    chat_format: Callable[[list[dict]], str]
    drain_seconds: float = 0.0
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    metrics: ServerMetrics | None = None
    spec_metrics: bool = False


def _error(e: RequestError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(e), status_code=e.status, headers=headers)


_HTTP_CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
               413: "request_too_large"}


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's HTTP errors (an unknown route, a wrong method) as OpenAI's error body."""
    message = {404: f"no route {request.method} {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(
                   exc.status_code, str(exc.detail))
    return _error(RequestError(message, None, status=exc.status_code,
                               code=_HTTP_CODES.get(exc.status_code)),
                  getattr(exc, "headers", None))


async def _server_error(request: Request, exc: Exception) -> Response:
    """Anything unexpected: 500 with OpenAI's error body (uvicorn logs the traceback)."""
    return _error(RequestError(f"internal error ({type(exc).__name__})", None, status=500,
                               kind="server_error"))


class _ApiKey:
    """ASGI middleware: ``/v1/*`` needs ``Authorization: Bearer <key>`` (compared in
    constant time), else 401; ``/health`` and the rest stay open."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (scope["path"] == "/v1"
                                        or scope["path"].startswith("/v1/")):
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                what = "no API key" if not given else "an invalid API key"
                response = _error(RequestError(
                    f"{what}: this server needs 'Authorization: Bearer <key>' (--api-key)",
                    None, status=401, code="invalid_api_key"),
                    {"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, at most ``limit`` bytes: a `RequestError` (413) from the
    Content-Length before anything is read, or as soon as a chunked body passes it."""
    too_large = lambda size: RequestError(
        f"the body is {size} bytes, more than this server reads ({limit} bytes, "
        f"--max-body-mb)", None, status=413, code="request_too_large")
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise RequestError(f"Content-Length {length[:20]!r} is not a number")
        if int(length) > limit:
            raise too_large(int(length))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(f"over {limit}" if length is None else size)
        chunks.append(chunk)
    return b"".join(chunks)


def _choice(req: GenerationRequest, text: str, finish: str | None, *, delta: bool,
            token_ids: tuple[int, ...] = (), index: int = 0) -> dict:
    ids = {"token_ids": list(token_ids)} if req.return_token_ids else {}
    if not req.chat:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish} | ids
    if delta:
        return {"index": index, "delta": {"content": text} if text else {},
                "logprobs": None, "finish_reason": finish} | ids
    return {"index": index, "message": {"role": "assistant", "content": text},
            "logprobs": None, "finish_reason": finish} | ids


def spec_decoding(last: dict[int, Event]) -> dict:
    """vLLM's per-request speculative-decoding summary (its ``metrics.speculative_decoding``
    with ``--per-request-spec-decode-metrics summary``) over a request's choices: tree
    rounds (``num_spec_steps``), draft tokens verified and accepted, the histogram of
    draft tokens accepted per round (entry j: rounds that accepted exactly j), the mean
    acceptance length (the bonus token included) and the acceptance rate; the budget per
    round is ``num_spec_tokens`` (its mean where an automatic budget changed it)."""
    hist = [0] * max((len(e.accepted) for e in last.values()), default=0)
    for e in last.values():
        for j, count in enumerate(e.accepted):
            hist[j] += count
    steps = sum(hist)
    accepted = sum(j * count for j, count in enumerate(hist))
    drafts = sum(e.draft_tokens for e in last.values())
    return {"mean_acceptance_length": 1 + accepted / steps if steps else None,
            "draft_acceptance_rate": accepted / drafts if drafts else None,
            "acceptance_histogram": hist, "num_spec_steps": steps,
            "num_accepted_draft_tokens": accepted, "num_draft_tokens": drafts,
            "num_spec_tokens": round(drafts / steps) if steps else 0}


def _usage(last: dict[int, Event]) -> dict:
    """OpenAI's usage of a request from its choices' last events: the prompt once, the
    completions' tokens summed."""
    prompt = next(iter(last.values())).prompt_tokens
    completion = sum(e.completion_tokens for e in last.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def create_app(served: Served) -> Starlette:
    """The Starlette app; its lifespan starts the scheduler and drains it on shutdown."""
    limits, scheduler = served.limits, served.scheduler
    created = int(time.time())

    model_object = {"id": limits.model, "object": "model", "created": created,
                    "owned_by": "tev-jax", "max_model_len": limits.max_positions}

    async def health(request: Request) -> Response:
        snapshot = scheduler.snapshot()
        draining = snapshot["draining"]
        return JSONResponse({"status": "draining" if draining else "ok",
                             "model": limits.model, **snapshot},
                            status_code=503 if draining else 200)

    async def metrics(request: Request) -> Response:
        if served.metrics is None:
            return _error(RequestError("this server keeps no metrics", None, status=404,
                                       code="not_found"))
        body, content_type = served.metrics.exposition()
        return Response(body, media_type=content_type)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_object]})

    async def model(request: Request) -> Response:
        name = request.path_params["model"]
        if name != limits.model:
            return _error(RequestError(f"The model {json.dumps(name)} does not exist; this "
                                       f"server serves {limits.model!r}", "model",
                                       status=404, code="model_not_found"))
        return JSONResponse(model_object)

    def parse(body: bytes, chat: bool) -> GenerationRequest:
        """Runs in a worker thread: JSON, checks, chat template, tokenizer."""
        try:
            return parse_request(read_json(body), limits, served.encode,
                                 chat_format=served.chat_format if chat else None)
        except RequestError:
            raise
        except RecursionError:
            raise RequestError("the body nests too deeply to be read") from None
        except Exception as e:  # a check missed something: answer, and log it
            log.exception("reading a request failed")
            raise RequestError(f"the request could not be read ({type(e).__name__})", None,
                               status=500, kind="server_error") from None

    async def generate(request: Request, chat: bool) -> Response:
        try:
            body = await read_body(request, served.max_body_bytes)
            req = await asyncio.to_thread(parse, body, chat)
        except RequestError as e:
            return _error(e)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def emit(event: Event) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody listens
                loop.call_soon_threadsafe(events.put_nowait, event)

        try:
            jobs = scheduler.submit(req, emit)
        except QueueFull as e:
            return _error(RequestError(f"{e}; retry later", None, status=429,
                                       kind="rate_limit_error"),
                          {"Retry-After": str(RETRY_AFTER_S)})
        except Draining as e:
            return _error(RequestError(str(e), None, status=503, kind="server_error"))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": limits.model}
        if req.stream:
            return StreamingResponse(_stream(req, jobs, events, head, served.spec_metrics),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        texts = {i: [req.prompt_text] if req.echo else [] for i in range(req.n)}
        ids: dict[int, list[int]] = {i: [] for i in range(req.n)}
        last: dict[int, Event] = {}
        try:
            while len(last) < req.n or any(e.finish_reason is None for e in last.values()):
                try:
                    event = await asyncio.wait_for(events.get(), POLL_S)
                except TimeoutError:
                    if await request.is_disconnected():
                        return Response(status_code=499)
                    continue
                texts[event.choice].append(event.text)
                ids[event.choice].extend(event.token_ids)
                last[event.choice] = event
        finally:
            for job in jobs:
                job.cancel()
        extra = ({"metrics": {"speculative_decoding": spec_decoding(last)}}
                 if served.spec_metrics else {})
        return JSONResponse(head | {
            "choices": [_choice(req, "".join(texts[i]), last[i].finish_reason, delta=False,
                                token_ids=tuple(ids[i]), index=i) for i in range(req.n)],
            "usage": _usage(last)} | extra)

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        try:
            yield
        finally:
            scheduler.drain(served.drain_seconds)
            await asyncio.to_thread(scheduler.join)

    return Starlette(routes=[
        Route("/health", health), Route("/metrics", metrics),
        Route("/v1/models", models), Route("/v1/models/{model:path}", model),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ], lifespan=lifespan,
        middleware=[Middleware(_ApiKey, key=served.api_key)] if served.api_key else [],
        exception_handlers={HTTPException: _http_error, Exception: _server_error})


async def _stream(req: GenerationRequest, jobs, events: asyncio.Queue, head: dict,
                  spec_metrics: bool = False):
    """The server-sent events of one request (each chunk one choice's, by ``index``;
    with ``spec_metrics`` the chunk that ends the last choice carries
    `spec_decoding`); a client that goes away cancels it."""
    chunk_object = "chat.completion.chunk" if req.chat else "text_completion"

    def data(choices: list, **extra) -> str:
        return f"data: {json.dumps(head | {'object': chunk_object, 'choices': choices} | extra)}\n\n"

    try:
        for i in range(req.n):
            if req.chat:
                yield data([{"index": i, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}])
            elif req.echo:
                yield data([_choice(req, req.prompt_text, None, delta=True, index=i)])
        last: dict[int, Event] = {}
        while len(last) < req.n or any(e.finish_reason is None for e in last.values()):
            event = await events.get()
            last[event.choice] = event
            extra = {"usage": _usage(last)} if req.continuous_usage else {}
            ended = len(last) == req.n and all(e.finish_reason for e in last.values())
            if spec_metrics and ended:
                extra["metrics"] = {"speculative_decoding": spec_decoding(last)}
            yield data([_choice(req, event.text, event.finish_reason, delta=True,
                                token_ids=event.token_ids, index=event.choice)], **extra)
        if req.include_usage:
            yield data([], usage=_usage(last))
        yield "data: [DONE]\n\n"
    finally:
        for job in jobs:
            job.cancel()


__all__ = ["DEFAULT_MAX_BODY_BYTES", "RETRY_AFTER_S", "Served", "create_app", "read_body",
           "spec_decoding"]
