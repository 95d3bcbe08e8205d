"""Text around the token ids, shared by the batch job, the server and training: prompt
files, chat templates and stop ids.

Prompts file: JSONL (``.jsonl`` / ``.json``), one object per line with an ``id`` and one
of ``prompt`` (text), ``messages`` (a chat: ``[{"role", "content"}, ...]``) or
``prompt_ids`` (token ids); or any other file as plain text, one prompt per line, whose
id is its line number (from 1). Blank JSONL lines are skipped.

The bundled evaluation sets (`tev_jax.data.prompts`) are prompts files too: give
``bundled:NAME`` or their path (``tev_jax/data/prompts/gsm.jsonl``); chat sets become
one-turn ``messages``, HumanEval its ``prompt``.

`chat_formatter` renders a model's chat template, `encode_records` turns records into
checked `tev_jax.prompts.Request` s, and `stop_token_ids` names the ids a generation ends
on.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tev_jax.prompts import Request, check_context, check_prompt

PROMPT_FIELDS = ("prompt", "messages", "prompt_ids")


BUNDLED_PREFIX = "bundled:"  # a bundled prompt set as a prompts file: bundled:gsm


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """One line of the prompts file.

    Attributes:
      id: the record's id (a JSON string or number; the line number for plain text).
      line: its line number (from 1).
      kind: 'prompt', 'messages' or 'prompt_ids'.
      value: the text, the message list or the token-id list.
    """

    id: Any
    line: int
    kind: str
    value: Any


def read_prompts(path: str | Path, *, line_ids: bool = False) -> list[PromptRecord]:
    """Reads and checks a prompts file (format by suffix: ``.jsonl``/``.json`` or text).

    ``bundled:NAME`` (or the path of a bundled set's file) reads a bundled evaluation
    set (`tev_jax.data.prompts.PROMPT_SETS`) as such a file. The one prompt reader of
    ``tev-jax generate --prompts`` and ``tev-train rollouts --prompts-file``.

    Args:
      path: the file, or ``bundled:NAME``.
      line_ids: a JSONL record without an id gets its line number (training prompt
        files need no ids); by default a missing id is an error (results are resumed
        by id).

    Raises:
      ValueError: naming the file and line: malformed JSON, not an object, a missing or
        duplicate id, not exactly one prompt field, an empty prompt, malformed messages
        or token ids, text that is not UTF-8; or a file that cannot be read.
    """
    bundled = bundled_set(path)
    if bundled is not None:
        return _bundled_records(bundled)
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path}: a directory; give a prompts file (JSONL records, or "
                         "text with one prompt per line)")
    if not path.is_file():
        raise ValueError(f"{path}: no such prompts file")
    lines = read_text(path).splitlines()
    if path.suffix in (".jsonl", ".json"):
        first = next((line.strip() for line in lines if line.strip()), "")
        if first.startswith("["):
            raise ValueError(f"{path}: a JSON array; a prompts file is JSONL: one JSON "
                             "object per line")
        records = [_json_record(path, n, line, line_ids) for n, line in enumerate(lines, 1)
                   if line.strip()]
    else:
        while lines and not lines[-1].strip():
            lines.pop()
        records = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                raise ValueError(f"{path}:{n}: empty prompt")
            records.append(PromptRecord(id=n, line=n, kind="prompt", value=line))
    if not records:
        raise ValueError(f"{path}: no prompts")
    seen: dict[Any, int] = {}
    for r in records:
        if id_key(r.id) in seen:
            raise ValueError(f"{path}:{r.line}: id {r.id!r} already used on line "
                             f"{seen[id_key(r.id)]}")
        seen[id_key(r.id)] = r.line
    return records


def read_text(path: str | Path) -> str:
    """A UTF-8 text file's text (a leading byte-order mark dropped, as editors on Windows
    write one); a ValueError naming the file, line and column of the first byte that is
    not UTF-8, or why the file cannot be read."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror or e})") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at "
                         f"column {column}); save the file as UTF-8") from None


def bundled_set(path: str | Path) -> str | None:
    """The bundled prompt set that ``path`` names (``bundled:NAME`` or the set's own
    file), else None."""
    from tev_jax.data import prompts

    text = os.fspath(path)
    if text.startswith(BUNDLED_PREFIX):
        name = text[len(BUNDLED_PREFIX):]
        if name not in prompts.PROMPT_SETS:
            raise ValueError(f"{text}: no such bundled prompt set; choose one of "
                             f"{', '.join(BUNDLED_PREFIX + n for n in prompts.PROMPT_SETS)}")
        return name
    p = Path(path)
    if p.suffix != ".jsonl" or p.stem not in prompts.PROMPT_SETS or not p.is_file():
        return None
    bundled = prompts.prompts_dir() / p.name
    return p.stem if bundled.is_file() and os.path.samefile(p, bundled) else None


def _bundled_records(name: str) -> list[PromptRecord]:
    from tev_jax.data import prompts

    return [PromptRecord(id=r["id"], line=n, kind=kind, value=r[kind])
            for n, r in enumerate(prompts.prompt_file_records(name), 1)
            for kind in PROMPT_FIELDS if kind in r]


def id_key(rid) -> str:
    """How ids are compared (JSON text, so that the id 1 and the id "1" differ)."""
    return json.dumps(rid)


def _json_record(path: Path, n: int, line: str, line_ids: bool = False) -> PromptRecord:
    where = f"{path}:{n}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: malformed JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    rid = obj.get("id", n if line_ids else None)
    if rid is None:
        raise ValueError(f"{where}: missing id (a non-empty string or an integer)")
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
        got = "an empty string" if rid == "" else type(rid).__name__
        raise ValueError(f"{where}: id {rid!r} must be a non-empty string or an integer, "
                         f"got {got}")
    kinds = [k for k in PROMPT_FIELDS if k in obj]
    if len(kinds) != 1:
        raise ValueError(f"{where}: id {rid!r} needs exactly one of {PROMPT_FIELDS}, "
                         f"got {kinds or 'none'}")
    kind, value = kinds[0], obj[kinds[0]]
    if kind == "prompt" and not isinstance(value, str):
        raise ValueError(f"{where}: id {rid!r}: prompt must be a string, got "
                         f"{type(value).__name__} {json.dumps(value)[:40]}")
    if kind == "prompt" and not value:
        raise ValueError(f"{where}: id {rid!r} has an empty prompt")
    if kind == "messages":
        ok = isinstance(value, list) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in value)
        if not ok:
            raise ValueError(f"{where}: id {rid!r}: messages must be a non-empty list of "
                             '{"role": ..., "content": ...} objects')
    if kind == "prompt_ids":
        ok = isinstance(value, list) and value and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value)
        if not ok:
            raise ValueError(f"{where}: id {rid!r}: prompt_ids must be a non-empty list "
                             "of integers")
    return PromptRecord(id=rid, line=n, kind=kind, value=value)


def chat_formatter(tokenizer_config: dict | str | os.PathLike | None,
                   template: str | None = None) -> Callable[[list[dict]], str]:
    """``messages -> prompt text``: the tokenizer's chat template, else the bundled one.

    With a chat template, renders it as Hugging Face does (Jinja, ``add_generation_prompt
    =True``, the special tokens of ``tokenizer_config`` as variables, ``raise_exception``
    and ``strftime_now``). The messages are ``{"role", "content"}`` objects (a ``name``
    passes through); a ``developer`` message (OpenAI's newer name for the system turn) is
    given to the template as ``system`` unless the template names ``developer`` itself.
    Without a template, `tev_jax.data.tokenizer.format_chat`: any system or developer
    messages, then one user turn.

    Args:
      tokenizer_config: a tokenizer_config.json's object (its ``chat_template``), or the
        folder holding tokenizer_config.json (then its ``chat_template.jinja`` is read
        too), or None.
      template: a chat template's text, which takes precedence over the config's:
        current transformers saves the template as ``chat_template.jinja`` beside
        tokenizer_config.json instead of in it.
    """
    if isinstance(tokenizer_config, (str, os.PathLike)):
        folder = Path(tokenizer_config)
        config_file, template_file = folder / "tokenizer_config.json", folder / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = read_text(template_file)
        tokenizer_config = json.loads(read_text(config_file)) if config_file.is_file() else None
    if not template:
        template = (tokenizer_config or {}).get("chat_template")
    if isinstance(template, list):  # several named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if not template:
        from tev_jax.data.tokenizer import format_chat

        def bundled(messages):
            system = [m["content"] for m in messages[:-1] if m["role"] in ("system", "developer")]
            if len(system) != len(messages) - 1 or messages[-1]["role"] != "user":
                raise ValueError("without a chat template (tokenizer_config.json or "
                                 "chat_template.jinja), messages must be one user turn, "
                                 "after any system or developer messages")
            return format_chat(messages[-1]["content"],
                               "\n\n".join(c for c in system if c) or None)

        return bundled
    import datetime

    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    compiled = env.from_string(template)
    tokens = {k: v for k, v in (tokenizer_config or {}).items()
              if k.endswith("_token") and isinstance(v, str)}
    knows_developer = "developer" in template

    def render(messages):
        if not knows_developer:
            messages = [m | {"role": "system"} if m["role"] == "developer" else m
                        for m in messages]
        return compiled.render(messages=messages, add_generation_prompt=True, **tokens)

    return render


def encode_records(records: Sequence[PromptRecord], tokenizer, chat, *, vocab_size: int,
                   prompt_len: int | None, truncate: bool, where: str = "prompts",
                   max_positions: int | None = None, max_new_tokens: int = 0
                   ) -> list[Request]:
    """Token ids for every record, checked against the vocabulary and the prompt buffer.

    Text is encoded with the tokenizer's special tokens (BOS) unless the text already
    starts with the BOS string (chat templates that write it themselves).

    Args:
      records: from `read_prompts`.
      tokenizer: a `tokenizers.Tokenizer`.
      chat: ``messages -> text`` (`chat_formatter`).
      vocab_size: the target's V.
      prompt_len: the prompt buffer P, or None (no limit).
      truncate: keep the last P tokens of a longer prompt instead of refusing it.
      where: the prompts file's name, for messages.
      max_positions: the target's context length (``max_position_embeddings``), or
        None: every prompt + ``max_new_tokens`` must fit in it.
      max_new_tokens: M, for that check.

    Raises:
      ValueError: a token id outside the vocabulary, a prompt longer than P without
        ``truncate``, or one that leaves no room for M new tokens in the context (its
        id, line and length named).
    """
    bos = _bos_string(tokenizer)
    requests = []
    for r in records:
        if r.kind == "prompt_ids":
            ids = list(r.value)
        else:
            try:
                text = r.value if r.kind == "prompt" else chat(r.value)
            except ValueError as e:
                raise ValueError(f"{where}:{r.line}: id {r.id!r}: {e}") from None
            special = not (bos and text.startswith(bos))
            ids = tokenizer.encode(text, add_special_tokens=special).ids
        check_prompt(ids, vocab_size, what=f"{where}:{r.line}: id {r.id!r}")
        if prompt_len is not None and len(ids) > prompt_len:
            if not truncate:
                raise ValueError(f"{where}:{r.line}: id {r.id!r}: the prompt has {len(ids)} "
                                 f"tokens, more than the prompt buffer ({prompt_len}); raise "
                                 "--prompt-len or pass --truncate left")
            ids = ids[-prompt_len:]
        if max_positions is not None:
            room = max(max_positions - max_new_tokens, 1)
            advice = ("lower --prompt-len or --max-new-tokens" if truncate else
                      "shorten the prompt, lower --max-new-tokens, or pass --prompt-len "
                      f"{room} --truncate left (each prompt keeps "
                      "its last tokens)")
            check_context(len(ids), max_new_tokens, max_positions,
                          what=f"{where}:{r.line}: id {r.id!r}", advice=advice)
        requests.append(Request(id=r.id, prompt_ids=ids))
    return requests


def _bos_string(tokenizer) -> str | None:
    from tev_jax.data.tokenizer import BOS

    return BOS if tokenizer.token_to_id(BOS) is not None else None


def stop_token_ids(target, tokenizer) -> tuple[int, ...]:
    """The target's ``config.json`` eos ids, else the project tokenizer's ``<|end|>`` /
    ``<|eos|>`` if it has them."""
    from tev_jax.data.tokenizer import END, EOS

    if target.config.eos_token_ids:
        return tuple(target.config.eos_token_ids)
    ids = (tokenizer.token_to_id(t) for t in (END, EOS))
    return tuple(i for i in ids if i is not None)


__all__ = ["BUNDLED_PREFIX", "PROMPT_FIELDS", "PromptRecord", "bundled_set", "chat_formatter",
           "encode_records", "id_key", "read_prompts", "read_text", "stop_token_ids"]
