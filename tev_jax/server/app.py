"""The HTTP side of ``tev-jax serve``: OpenAI's routes over the scheduler.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or with
``"stream": true`` server-sent events: one event per decode round's new text, then
``data: [DONE]``), ``GET /v1/models`` and ``GET /health`` (slots, queue, τ, the
budgets the rounds ran with). A bad request gets 400 with OpenAI's error body naming
the field, a full queue 429 with ``Retry-After``, a draining server 503.

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
import json
import time
import uuid
from collections.abc import Callable, Sequence

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tev_jax.server.requests import (GenerationRequest, Limits, RequestError, error_body,
                                     parse_request, read_json)
from tev_jax.server.scheduler import Draining, Event, QueueFull, Scheduler

RETRY_AFTER_S = 1
POLL_S = 0.5  # how often a non-streamed request checks that its client is still there


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
    """

    scheduler: Scheduler
    limits: Limits
    encode: Callable[[str], Sequence[int]]
    chat_format: Callable[[list[dict]], str]
    drain_seconds: float = 0.0


def _error(e: RequestError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(e), status_code=e.status, headers=headers)


def _choice(req: GenerationRequest, text: str, finish: str | None, *, delta: bool,
            token_ids: tuple[int, ...] = ()) -> dict:
    ids = {"token_ids": list(token_ids)} if req.return_token_ids else {}
    if not req.chat:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish} | ids
    if delta:
        return {"index": 0, "delta": {"content": text} if text else {},
                "logprobs": None, "finish_reason": finish} | ids
    return {"index": 0, "message": {"role": "assistant", "content": text},
            "logprobs": None, "finish_reason": finish} | ids


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def create_app(served: Served) -> Starlette:
    """The Starlette app; its lifespan starts the scheduler and drains it on shutdown."""
    limits, scheduler = served.limits, served.scheduler
    created = int(time.time())

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": limits.model, **scheduler.snapshot()})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": limits.model, "object": "model", "created": created,
             "owned_by": "tev-jax", "max_model_len": limits.max_positions}]})

    async def generate(request: Request, chat: bool) -> Response:
        try:
            req = parse_request(read_json(await request.body()), limits, served.encode,
                                chat_format=served.chat_format if chat else None)
        except RequestError as e:
            return _error(e)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def emit(event: Event) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody listens
                loop.call_soon_threadsafe(events.put_nowait, event)

        try:
            job = scheduler.submit(req, emit)
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
            return StreamingResponse(_stream(req, job, events, head),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        text, last, ids = [req.prompt_text] if req.echo else [], None, []
        try:
            while last is None or last.finish_reason is None:
                try:
                    last = await asyncio.wait_for(events.get(), POLL_S)
                    text.append(last.text)
                    ids.extend(last.token_ids)
                except TimeoutError:
                    if await request.is_disconnected():
                        return Response(status_code=499)
        finally:
            job.cancel()
        return JSONResponse(head | {
            "choices": [_choice(req, "".join(text), last.finish_reason, delta=False,
                                token_ids=tuple(ids))],
            "usage": _usage(last.prompt_tokens, last.completion_tokens)})

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
        Route("/health", health), Route("/v1/models", models),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ], lifespan=lifespan)


async def _stream(req: GenerationRequest, job, events: asyncio.Queue, head: dict):
    """The server-sent events of one request; a client that goes away cancels it."""
    chunk_object = "chat.completion.chunk" if req.chat else "text_completion"

    def data(choices: list, **extra) -> str:
        return f"data: {json.dumps(head | {'object': chunk_object, 'choices': choices} | extra)}\n\n"

    try:
        if req.chat:
            yield data([{"index": 0, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}])
        elif req.echo:
            yield data([_choice(req, req.prompt_text, None, delta=True)])
        while True:
            event = await events.get()
            yield data([_choice(req, event.text, event.finish_reason, delta=True,
                                token_ids=event.token_ids)])
            if event.finish_reason is not None:
                break
        if req.include_usage:
            yield data([], usage=_usage(event.prompt_tokens, event.completion_tokens))
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()


__all__ = ["RETRY_AFTER_S", "Served", "create_app"]
