"""The OpenAI request bodies the server takes, checked into typed requests.

`parse_request` turns the JSON body of ``POST /v1/completions`` or ``POST
/v1/chat/completions`` into a `GenerationRequest` (token ids, a `tev_jax.sampling.Sampling`,
the stop strings, ...) or raises a `RequestError` naming the field, which the app answers
with HTTP 400 and an OpenAI-style error body (`error_body`). Nothing here touches the
engine or the HTTP stack, so every check is a plain function of the body and the
server's `Limits`.

The stop strings are applied to the detokenized text (`stop_at`, `held_back`): the
engine stops on token ids only.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

from tev_jax.sampling import Sampling

MAX_STOPS = 4  # as OpenAI's API: at most four stop strings
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class RequestError(ValueError):
    """A request the server refuses: its HTTP status, message and the field at fault."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


def error_body(e: RequestError) -> dict:
    """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": e.message, "type": e.kind, "param": e.param,
                      "code": None}}


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the running server can take.

    Attributes:
      model: the served model's name (``model`` must equal it).
      prompt_len: P, the longest prompt in tokens (the cache's prompt part).
      max_tokens: M, the most tokens a request may ask for (the cache's output part).
      max_positions: the target's context length (prompt + max_tokens must fit).
    """

    model: str
    prompt_len: int
    max_tokens: int
    max_positions: int


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One checked request.

    Attributes:
      chat: from ``/v1/chat/completions`` (else ``/v1/completions``).
      prompt_ids: the prompt's token ids (the chat template applied for chat).
      max_tokens: new tokens at most (the first, sampled by the prefill, included).
      sampling: temperature, top-k, top-p.
      stop: stop strings (the text is cut before the first one).
      stream: answer with server-sent events.
      include_usage: with ``stream``, a last event carrying ``usage``.
      seed: the client's seed: the request's random numbers come from it alone, so the
        same request with the same seed gets the same completion whatever else shares
        the batch (None: the server draws one).
      echo: /v1/completions only: the answer's text starts with the prompt's.
      prompt_text: the prompt as text (for ``echo``).
      return_token_ids: the extra field ``return_token_ids``: each choice also carries
        the generated token ids (``token_ids``), as vLLM's does.
    """

    chat: bool
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: Sampling
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    seed: int | None = None
    echo: bool = False
    prompt_text: str = ""
    return_token_ids: bool = False


def read_json(body: bytes) -> dict:
    """The request body as a JSON object; a `RequestError` otherwise."""
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(f"the body is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise RequestError(f"the body must be a JSON object, got {type(value).__name__}")
    return value


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v))


def _field(body: dict, name: str, check: Callable[[Any], bool], want: str, default=None):
    v = body.get(name)
    if v is None:
        return default
    if not check(v):
        raise RequestError(f"'{name}' must be {want}, got {json.dumps(v)[:80]}", name)
    return v


def sampling_of(body: dict) -> Sampling:
    """The `Sampling` of ``temperature`` (default 1, as OpenAI's), ``top_p`` and the
    extra field ``top_k`` (None or -1: off). At temperature 0 they are ignored."""
    t = _field(body, "temperature", lambda v: _is_number(v) and 0 <= v <= 2,
               "a number in [0, 2]", 1.0)
    top_p = _field(body, "top_p", lambda v: _is_number(v) and 0 < v <= 1,
                   "a number in (0, 1]")
    top_k = _field(body, "top_k", lambda v: _is_int(v) and (v >= 1 or v == -1),
                   "an integer >= 1 (or -1: off)")
    if t == 0:
        return Sampling(temperature=0.0)
    return Sampling(temperature=float(t), top_k=None if top_k in (None, -1) else top_k,
                    top_p=None if top_p in (None, 1) else float(top_p))


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops)
            or len(stops) > MAX_STOPS):
        raise RequestError(f"'stop' must be a non-empty string or a list of at most "
                           f"{MAX_STOPS} of them", "stop")
    return tuple(stops)


def _prompt_text(body: dict, chat_format: Callable[[list[dict]], str] | None) -> tuple[str, str]:
    """(text, field) of a completion's ``prompt`` or a chat's ``messages``."""
    if chat_format is None:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            return prompt, "prompt"
        if not isinstance(prompt, str) or not prompt:
            raise RequestError("'prompt' must be a non-empty string (or one list of token "
                               "ids); a list of several prompts is not served (n = 1)",
                               "prompt")
        return prompt, "prompt"
    messages = body.get("messages")
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str) for m in messages)
    if not ok:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects "
                           "with string content", "messages")
    try:
        return chat_format([{"role": m["role"], "content": m["content"]} for m in messages]
                           ), "messages"
    except ValueError as e:
        raise RequestError(f"'messages': {e}", "messages") from None


def parse_request(body: dict, limits: Limits, encode: Callable[[str], Sequence[int]], *,
                  chat_format: Callable[[list[dict]], str] | None = None
                  ) -> GenerationRequest:
    """A checked `GenerationRequest` from a completion body, or with ``chat_format``
    (``messages -> text``, the model's chat template) from a chat body.

    Args:
      body: the JSON object (`read_json`).
      limits: the server's `Limits`.
      encode: ``text -> token ids`` (the tokenizer, special tokens added).
      chat_format: for ``/v1/chat/completions``.
    Raises:
      RequestError: the field at fault named (``model``, ``prompt`` / ``messages``,
        ``max_tokens``, ``n``, ``temperature``, ``top_p``, ``top_k``, ``stop``,
        ``seed``, ``stream``).
    """
    model = body.get("model")
    if model != limits.model:
        raise RequestError(f"unknown model {json.dumps(model)}; this server serves "
                           f"{limits.model!r} (GET /v1/models)", "model",
                           kind="invalid_request_error")
    n = _field(body, "n", _is_int, "1 (one choice per request)", 1)
    if n != 1:
        raise RequestError(f"'n' must be 1 (one choice per request), got {n}", "n")
    chat = chat_format is not None
    limit_name = "max_completion_tokens" if chat and "max_completion_tokens" in body else \
        "max_tokens"
    max_tokens = _field(body, limit_name, _is_int, "a positive integer")
    if max_tokens is not None and max_tokens < 1:
        raise RequestError(f"'{limit_name}' must be a positive integer, got {max_tokens}",
                           limit_name)
    if max_tokens is not None and max_tokens > limits.max_tokens:
        raise RequestError(f"'{limit_name}' is {max_tokens}, more than this server's "
                           f"--max-tokens ({limits.max_tokens})", limit_name)
    sampling = sampling_of(body)
    stop = _stops(body)
    seed = _field(body, "seed", _is_int, "an integer")
    if seed is not None and not -2**63 <= seed < 2**64:
        raise RequestError(f"'seed' must be a 64-bit integer, got {seed}", "seed")
    stream = _field(body, "stream", lambda v: isinstance(v, bool), "true or false", False)
    options = _field(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    echo = (not chat) and _field(body, "echo", lambda v: isinstance(v, bool),
                                 "true or false", False)
    for unsupported in ("logprobs", "best_of", "tools", "suffix"):
        if body.get(unsupported) not in (None, False, 1, [], 0):
            raise RequestError(f"'{unsupported}' is not supported by this server",
                               unsupported)
    text, where = _prompt_text(body, chat_format)
    ids = list(text) if isinstance(text, list) else list(encode(text))
    if not ids:
        raise RequestError(f"'{where}' encodes to no tokens", where)
    if len(ids) > limits.prompt_len:
        raise RequestError(f"'{where}' is {len(ids)} tokens, more than the cache's prompt "
                           f"part (--max-prompt-tokens {limits.prompt_len})", where)
    if max_tokens is None:  # OpenAI's defaults: 16 for completions, the rest for chat
        room = max(1, limits.max_positions - len(ids))
        max_tokens = min(limits.max_tokens, room, limits.max_tokens if chat else
                         DEFAULT_MAX_TOKENS)
    if len(ids) + max_tokens > limits.max_positions:
        raise RequestError(f"'{where}' ({len(ids)} tokens) + '{limit_name}' ({max_tokens}) "
                           f"exceed the model's context ({limits.max_positions})", where)
    return GenerationRequest(
        chat=chat, prompt_ids=tuple(int(t) for t in ids), max_tokens=max_tokens,
        sampling=sampling, stop=stop, stream=stream,
        include_usage=bool(options.get("include_usage")), seed=seed, echo=bool(echo),
        prompt_text=text if isinstance(text, str) else "",
        return_token_ids=bool(_field(body, "return_token_ids", lambda v: isinstance(v, bool),
                                     "true or false", False)))


def stop_at(text: str, stops: Sequence[str]) -> int | None:
    """Where the text ends at its first stop string (its index), or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of ``text`` could begin a stop string, and so must
    wait for the next tokens before they are streamed."""
    longest = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


__all__ = ["DEFAULT_MAX_TOKENS", "MAX_STOPS", "GenerationRequest", "Limits", "RequestError",
           "error_body", "held_back", "parse_request", "read_json", "sampling_of", "stop_at"]
