"""The OpenAI request bodies the server takes, checked into typed requests.

`parse_request` turns the JSON body of ``POST /v1/completions`` or ``POST
/v1/chat/completions`` into a `GenerationRequest` (token ids, a `tev_jax.sampling.Sampling`,
the stop strings, ...) or raises a `RequestError` naming the field, which the app answers
with HTTP 400 and an OpenAI-style error body (`error_body`). Nothing here touches the
engine or the HTTP stack, so every check is a plain function of the body and the
server's `Limits`.

Every field the server reads is checked for its type and size, token ids given as a
prompt must lie in the target's vocabulary, text must be valid Unicode (no lone
surrogates), and a field that would change the output but is not implemented here
(penalties, ``logit_bias``, ``logprobs``, tools, ``response_format``, vLLM's extra
sampling fields, ...) is refused with HTTP 400 naming it instead of being ignored
(`UNSUPPORTED`); its neutral values (``presence_penalty: 0``, ``logit_bias: {}``, ...) are
accepted. Fields that change nothing (``user``, ``metadata``, ``store``, ...) pass.

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
MAX_STOP_CHARS = 1000  # the longest stop string
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_ROLES = ("system", "developer", "user", "assistant")


class RequestError(ValueError):
    """A request the server refuses: its HTTP status, message, the field at fault and
    OpenAI's error ``code`` (``model_not_found``, ...; None for most)."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind
        self.code = code


def error_body(e: RequestError) -> dict:
    """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}`` (a
    message that quotes a lone surrogate has it replaced, so the body encodes)."""
    message = e.message.encode("utf-8", "replace").decode("utf-8")
    return {"error": {"message": message, "type": e.kind, "param": e.param,
                      "code": e.code}}


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the running server can take.

    Attributes:
      model: the served model's name (``model`` must equal it).
      prompt_len: P, the longest prompt in tokens (the cache's prompt part).
      max_tokens: M, the most tokens a request may ask for (the cache's output part).
      max_positions: the target's context length (prompt + max_tokens must fit).
      vocab_size: V, the target's vocabulary: token ids given as a prompt must lie in
        [0, V).
      max_n: the most choices a request may ask for (``n``; each is a row of the batch,
        so at most the server's ``--max-batch``).
    """

    model: str
    prompt_len: int
    max_tokens: int
    max_positions: int
    vocab_size: int
    max_n: int = 1


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
      continuous_usage: with ``stream``, every event carries the ``usage`` so far
        (vLLM's ``stream_options.continuous_usage_stats``).
      seed: the client's seed: the request's random numbers come from it alone, so the
        same request with the same seed gets the same completion whatever else shares
        the batch (None: the server draws one).
      echo: /v1/completions only: the answer's text starts with the prompt's.
      prompt_text: the prompt as text (for ``echo``).
      return_token_ids: the extra field ``return_token_ids``: each choice also carries
        the generated token ids (``token_ids``), as vLLM's does.
      n: the choices to generate, each an independent sample (its own row and key).
      ignore_eos: vLLM's extra field: the completion goes on past the model's stop
        tokens to ``max_tokens`` (benchmark clients send it to fix output lengths).
    """

    chat: bool
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: Sampling
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    seed: int | None = None
    echo: bool = False
    prompt_text: str = ""
    return_token_ids: bool = False
    n: int = 1
    ignore_eos: bool = False


def _not_json(constant: str):
    raise ValueError(f"{constant} is not a JSON value")


def read_json(body: bytes) -> dict:
    """The request body as a JSON object; a `RequestError` otherwise (malformed JSON,
    ``NaN`` / ``Infinity``, text that is not UTF-8, nesting too deep to read, an integer
    of more than 4300 digits, a value that is not an object)."""
    try:
        value = json.loads(body, parse_constant=_not_json)
    except RecursionError:
        raise RequestError("the body nests too deeply to be read") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer too long
        raise RequestError(f"the body is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise RequestError(f"the body must be a JSON object, got {type(value).__name__}")
    return value


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v))


def _show(v) -> str:
    """A short rendering of a JSON value for a message (never the whole of a large one)."""
    if isinstance(v, list):
        return f"a list of {len(v)}"
    if isinstance(v, dict):
        return f"an object of {len(v)} field(s)"
    text = json.dumps(v[:40] if isinstance(v, str) else v)
    return text if len(text) <= 48 else text[:45] + "..."


def _field(body: dict, name: str, check: Callable[[Any], bool], want: str, default=None):
    v = body.get(name)
    if v is None:
        return default
    if not check(v):
        raise RequestError(f"'{name}' must be {want}, got {_show(v)}", name)
    return v


def _check_text(text: str, where: str, param: str) -> None:
    """Text a tokenizer can take: a lone UTF-16 surrogate (``"\\ud800"`` in the JSON) is
    not Unicode text, and the tokenizer would raise on it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"'{where}' is not valid Unicode text ({e.reason} at character "
                           f"{e.start})", param) from None


def _same(v, neutral) -> bool:
    """``v == neutral`` with booleans and numbers kept apart (in Python ``True == 1``)."""
    if isinstance(v, bool) or isinstance(neutral, bool):
        return isinstance(v, bool) and isinstance(neutral, bool) and v == neutral
    if isinstance(neutral, (int, float)):
        return _is_number(v) and v == neutral
    return type(v) is type(neutral) and v == neutral


UNSUPPORTED: dict[str, tuple] = {
    # OpenAI's fields
    "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},),
    "best_of": (1,), "suffix": ("",), "response_format": ({"type": "text"},),
    "tools": ([],), "tool_choice": ("none", "auto"), "functions": ([],),
    "function_call": ("none", "auto"), "audio": (), "modalities": (["text"],),
    "reasoning_effort": (), "verbosity": (), "web_search_options": (),
    # vLLM's extra sampling and output fields
    "repetition_penalty": (1,), "min_p": (0,), "min_tokens": (0,),
    "use_beam_search": (False,), "length_penalty": (1,), "stop_token_ids": ([],),
    "include_stop_str_in_output": (False,), "skip_special_tokens": (True,),
    "truncate_prompt_tokens": (), "prompt_logprobs": (), "allowed_token_ids": (),
    "bad_words": ([],), "return_tokens_as_token_ids": (False,), "guided_json": (),
    "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "structured_outputs": (), "logits_processors": (), "prompt_embeds": (),
    "thinking_token_budget": (), "vllm_xargs": ({},),
}
"""The fields that would change the output and that this server does not implement,
each with the values that change nothing (null always does): any other value is
refused with 400 naming the field, never ignored."""
COMPLETION_UNSUPPORTED: dict[str, tuple] = {
    "logprobs": (False,), "top_logprobs": (0,), "add_special_tokens": (True,)}
"""The same for ``/v1/completions`` alone (its ``echo`` is served)."""
CHAT_UNSUPPORTED: dict[str, tuple] = {
    "logprobs": (False,), "top_logprobs": (), "echo": (False,),
    "add_generation_prompt": (True,), "continue_final_message": (False,),
    "add_special_tokens": (), "chat_template": (), "chat_template_kwargs": ({},),
    "documents": ([],)}
"""The same for ``/v1/chat/completions`` alone."""


def _refuse_unsupported(body: dict, chat: bool) -> None:
    table = UNSUPPORTED | (CHAT_UNSUPPORTED if chat else COMPLETION_UNSUPPORTED)
    for name, neutral in table.items():
        v = body.get(name)
        if v is None or any(_same(v, x) for x in neutral):
            continue
        ok = " or ".join(json.dumps(x) for x in neutral)
        raise RequestError(f"'{name}' is not supported by this server (got {_show(v)}); "
                           f"leave it out{' or send ' + ok if ok else ''}", name)


def sampling_of(body: dict, vocab_size: int | None = None) -> Sampling:
    """The `Sampling` of ``temperature`` (default 1, as OpenAI's), ``top_p`` and the
    extra field ``top_k`` (None or -1: off; with ``vocab_size`` V, k >= V is off too: it
    keeps every token, and one setting is one lane, so it shares the lane without it).
    At temperature 0 they are ignored."""
    t = _field(body, "temperature", lambda v: _is_number(v) and 0 <= v <= 2,
               "a number in [0, 2]", 1.0)
    top_p = _field(body, "top_p", lambda v: _is_number(v) and 0 < v <= 1,
                   "a number in (0, 1]")
    top_k = _field(body, "top_k", lambda v: _is_int(v) and (v >= 1 or v == -1),
                   "an integer >= 1 (or -1: off)")
    if t == 0:
        return Sampling(temperature=0.0)
    if top_k == -1 or (vocab_size is not None and top_k is not None and top_k >= vocab_size):
        top_k = None
    return Sampling(temperature=float(t), top_k=top_k,
                    top_p=None if top_p in (None, 1) else float(top_p))


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or len(stops) > MAX_STOPS
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)):
        raise RequestError(f"'stop' must be a non-empty string or a list of at most "
                           f"{MAX_STOPS} of them, each of at most {MAX_STOP_CHARS} "
                           f"characters", "stop")
    for s in stops:
        _check_text(s, "stop", "stop")
    return tuple(stops)


def _prompt_ids(prompt: list, vocab_size: int) -> list[int]:
    """A prompt given as token ids: each an integer in [0, V)."""
    for i, t in enumerate(prompt):
        if not _is_int(t) or not 0 <= t < vocab_size:
            raise RequestError(f"'prompt' token ids must be integers in [0, {vocab_size}) "
                               f"(the model's vocabulary); got {_show(t)} at position {i}",
                               "prompt")
    return prompt


def _content(content, where: str) -> str:
    """A message's text: a string, or a list of text parts (joined by newlines, as
    vLLM joins them)."""
    if isinstance(content, str):
        _check_text(content, where, "messages")
        return content
    if not isinstance(content, list) or not content:
        raise RequestError(f"'{where}' must be a string or a non-empty list of "
                           f"{{\"type\": \"text\", \"text\": ...}} parts, got "
                           f"{_show(content)}", "messages")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            what = f"a {_show(kind)} part" if isinstance(kind, str) else _show(part)
            raise RequestError(f"'{where}[{i}]': only text parts ({{\"type\": \"text\", "
                               f"\"text\": ...}}) are served, got {what}", "messages")
        _check_text(part["text"], f"{where}[{i}].text", "messages")
        texts.append(part["text"])
    return "\n".join(texts)


def chat_messages(messages) -> list[dict]:
    """``messages`` checked into ``[{"role", "content"(, "name")}]`` for the chat
    template: roles system, developer, user and assistant; ``content`` a string or a list
    of text parts (joined by newlines); tool calls and tool results are refused."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects",
                           "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"'{where}' must be a {{role, content}} object, got "
                               f"{_show(m)}", "messages")
        role = m.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise RequestError(f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}, got "
                               f"{_show(role)} (tool calls and tool results are not "
                               "supported by this server)", "messages")
        for name in ("tool_calls", "function_call", "audio"):
            if m.get(name) not in (None, []):
                raise RequestError(f"'{where}.{name}' is not supported by this server",
                                   "messages")
        message = {"role": role, "content": _content(m.get("content"), f"{where}.content")}
        name = m.get("name")
        if name is not None:
            if not isinstance(name, str) or len(name) > 256:
                raise RequestError(f"'{where}.name' must be a string of at most 256 "
                                   f"characters, got {_show(name)}", "messages")
            _check_text(name, f"{where}.name", "messages")
            message["name"] = name
        out.append(message)
    return out


def _prompt(body: dict, chat_format: Callable[[list[dict]], str] | None,
            vocab_size: int) -> tuple[str | list[int], str]:
    """(text or token ids, field) of a completion's ``prompt`` or a chat's ``messages``."""
    if chat_format is None:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and not any(
                isinstance(t, (str, list)) for t in prompt):
            return _prompt_ids(prompt, vocab_size), "prompt"
        if not isinstance(prompt, str) or not prompt:
            raise RequestError("'prompt' must be a non-empty string (or one list of token "
                               "ids); a list of several prompts is not served (send one "
                               "request each)",
                               "prompt")
        _check_text(prompt, "prompt", "prompt")
        return prompt, "prompt"
    messages = chat_messages(body.get("messages"))
    try:
        return chat_format(messages), "messages"
    except Exception as e:  # the template's raise_exception, or what Jinja raises
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
      RequestError: the field at fault named: 404 (code ``model_not_found``) for a
        ``model`` this server does not serve, else 400 (``model``, ``prompt`` /
        ``messages``, ``max_tokens``, ``n``, ``temperature``, ``top_p``, ``top_k``,
        ``stop``, ``seed``, ``stream``, or a field of `UNSUPPORTED`).
    """
    model = body.get("model")
    if not isinstance(model, str):
        raise RequestError(f"'model' must be the served model's name ({limits.model!r}), "
                           f"got {_show(model)}", "model")
    if model != limits.model:
        raise RequestError(f"The model {_show(model)} does not exist; this server serves "
                           f"{limits.model!r} (GET /v1/models)", "model", status=404,
                           code="model_not_found")
    chat = chat_format is not None
    _refuse_unsupported(body, chat)
    n = _field(body, "n", _is_int, "a positive integer", 1)
    if not 1 <= n <= limits.max_n:
        raise RequestError(f"'n' must be 1 to {limits.max_n} (each choice is a row of "
                           f"the batch: --max-batch {limits.max_n}), got {n}", "n")
    limit_name = ("max_completion_tokens" if body.get("max_completion_tokens") is not None
                  else "max_tokens")
    max_tokens = _field(body, limit_name, _is_int, "a positive integer")
    if max_tokens is not None and max_tokens < 1:
        raise RequestError(f"'{limit_name}' must be a positive integer, got {max_tokens}",
                           limit_name)
    if max_tokens is not None and max_tokens > limits.max_tokens:
        raise RequestError(f"'{limit_name}' is {max_tokens}, more than this server's "
                           f"--max-tokens ({limits.max_tokens})", limit_name)
    sampling = sampling_of(body, limits.vocab_size)
    stop = _stops(body)
    seed = _field(body, "seed", _is_int, "an integer")
    if seed is not None and not -2**63 <= seed < 2**64:
        raise RequestError(f"'seed' must be a 64-bit integer, got {_show(seed)}", "seed")
    stream = _field(body, "stream", lambda v: isinstance(v, bool), "true or false", False)
    options = _field(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    include_usage, continuous = (options.get(k) for k in ("include_usage",
                                                         "continuous_usage_stats"))
    for name, value in (("include_usage", include_usage),
                        ("continuous_usage_stats", continuous)):
        if value is not None and not isinstance(value, bool):
            raise RequestError(f"'stream_options.{name}' must be true or false, got "
                               f"{_show(value)}", "stream_options")
    echo = (not chat) and _field(body, "echo", lambda v: isinstance(v, bool),
                                 "true or false", False)
    return_ids = _field(body, "return_token_ids", lambda v: isinstance(v, bool),
                        "true or false", False)
    ignore_eos = _field(body, "ignore_eos", lambda v: isinstance(v, bool), "true or false",
                        False)
    text, where = _prompt(body, chat_format, limits.vocab_size)
    if isinstance(text, list):
        ids = text
    else:
        try:
            ids = list(encode(text))
        except Exception as e:  # after the checks above a tokenizer has no reason to
            raise RequestError(f"'{where}' could not be tokenized ({type(e).__name__}: "
                               f"{e})", where) from None
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
        sampling=sampling, stop=stop, stream=stream, include_usage=bool(include_usage),
        continuous_usage=bool(continuous),
        seed=seed, echo=bool(echo), prompt_text=text if isinstance(text, str) else "",
        return_token_ids=return_ids, n=n, ignore_eos=ignore_eos)


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


__all__ = ["CHAT_ROLES", "CHAT_UNSUPPORTED", "COMPLETION_UNSUPPORTED", "DEFAULT_MAX_TOKENS",
           "MAX_STOPS", "MAX_STOP_CHARS", "UNSUPPORTED", "GenerationRequest", "Limits",
           "RequestError", "chat_messages", "error_body", "held_back", "parse_request",
           "read_json", "sampling_of", "stop_at"]
