"""Files of batch generation: prompts in, JSONL results out (resumable, sharded).

Prompts file: JSONL (``.jsonl`` / ``.json``), one object per line with an ``id`` and one
of ``prompt`` (text), ``messages`` (a chat: ``[{"role", "content"}, ...]``) or
``prompt_ids`` (token ids); or any other file as plain text, one prompt per line, whose
id is its line number (from 1). Blank JSONL lines are skipped.

Output: ``OUT`` gets one JSON object per finished prompt, appended and flushed line by
line; the run's settings go once to the sidecar ``<OUT stem>.settings.json``. A rerun
with the same settings skips the ids already in ``OUT``; with other settings it is
refused unless forced. With ``count`` processes, process ``index`` takes the prompts at
positions ``i % count == index`` of the file and writes ``<OUT stem>.<index>-of-<count>
<OUT suffix>``; `merge_outputs` joins the shards into ``OUT``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from tev_jax.batching import Request
from tev_jax.engine import check_prompt

PROMPT_FIELDS = ("prompt", "messages", "prompt_ids")
RUN_KEY = "run"  # settings entries that may differ between a run and its resumption


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


def read_prompts(path: str | Path) -> list[PromptRecord]:
    """Reads and checks a prompts file (format by suffix: ``.jsonl``/``.json`` or text).

    Raises:
      ValueError: naming the file and line: malformed JSON, not an object, a missing or
        duplicate id, not exactly one prompt field, an empty prompt, malformed messages
        or token ids.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such prompts file")
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix in (".jsonl", ".json"):
        records = [_json_record(path, n, line) for n, line in enumerate(lines, 1)
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


def id_key(rid) -> str:
    """How ids are compared (JSON text, so that the id 1 and the id "1" differ)."""
    return json.dumps(rid)


def _json_record(path: Path, n: int, line: str) -> PromptRecord:
    where = f"{path}:{n}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: malformed JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    rid = obj.get("id")
    if rid is None or isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
        raise ValueError(f"{where}: missing id (a non-empty string or an integer)")
    kinds = [k for k in PROMPT_FIELDS if k in obj]
    if len(kinds) != 1:
        raise ValueError(f"{where}: id {rid!r} needs exactly one of {PROMPT_FIELDS}, "
                         f"got {kinds or 'none'}")
    kind, value = kinds[0], obj[kinds[0]]
    if kind == "prompt" and not (isinstance(value, str) and value):
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


def chat_formatter(tokenizer_config: dict | None) -> Callable[[list[dict]], str]:
    """``messages -> prompt text``: the tokenizer's chat template, else the bundled one.

    With a ``chat_template`` in ``tokenizer_config`` (a tokenizer_config.json), renders
    it as Hugging Face does (Jinja, ``add_generation_prompt=True``, the special tokens
    as variables). Without one, `tev_jax.data.tokenizer.format_chat`, which takes a
    single user turn.
    """
    template = (tokenizer_config or {}).get("chat_template")
    if isinstance(template, list):  # several named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if not template:
        from tev_jax.data.tokenizer import format_chat

        def bundled(messages):
            if len(messages) != 1 or messages[0]["role"] != "user":
                raise ValueError("without a chat template in tokenizer_config.json, messages "
                                 "must be one user turn")
            return format_chat(messages[0]["content"])

        return bundled
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    compiled = env.from_string(template)
    tokens = {k: v for k, v in (tokenizer_config or {}).items()
              if k.endswith("_token") and isinstance(v, str)}
    return lambda messages: compiled.render(messages=messages, add_generation_prompt=True,
                                            **tokens)


def encode_records(records: Sequence[PromptRecord], tokenizer, chat, *, vocab_size: int,
                   prompt_len: int | None, truncate: bool, where: str = "prompts"
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

    Raises:
      ValueError: a token id outside the vocabulary, or a prompt longer than P without
        ``truncate`` (its id, line and length named).
    """
    bos = _bos_string(tokenizer)
    requests = []
    for r in records:
        if r.kind == "prompt_ids":
            ids = list(r.value)
        else:
            text = r.value if r.kind == "prompt" else chat(r.value)
            special = not (bos and text.startswith(bos))
            ids = tokenizer.encode(text, add_special_tokens=special).ids
        check_prompt(ids, vocab_size, what=f"{where}:{r.line}: id {r.id!r}")
        if prompt_len is not None and len(ids) > prompt_len:
            if not truncate:
                raise ValueError(f"{where}:{r.line}: id {r.id!r}: the prompt has {len(ids)} "
                                 f"tokens, more than the prompt buffer ({prompt_len}); raise "
                                 "--prompt-len or pass --truncate left")
            ids = ids[-prompt_len:]
        requests.append(Request(id=r.id, prompt_ids=ids))
    return requests


def _bos_string(tokenizer) -> str | None:
    from tev_jax.data.tokenizer import BOS

    return BOS if tokenizer.token_to_id(BOS) is not None else None


# ---------------------------------------------------------------------------- output


def shard_path(out: str | Path, index: int, count: int) -> Path:
    """``OUT`` for one process, else ``<stem>.<index>-of-<count><suffix>``."""
    out = Path(out)
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"process index {index} is outside [0, {count})")
    return out if count == 1 else out.with_name(f"{out.stem}.{index}-of-{count}{out.suffix}")


def settings_path(out: str | Path) -> Path:
    """The settings sidecar of an output file: ``<stem>.settings.json``."""
    out = Path(out)
    return out.with_name(f"{out.stem}.settings.json")


def shard_of(items: Sequence, index: int, count: int) -> list:
    """The items at positions ``i % count == index``."""
    return [x for i, x in enumerate(items) if i % count == index]


def _comparable(settings: dict) -> dict:
    return {k: v for k, v in settings.items() if k != RUN_KEY}


def read_done_ids(out: Path) -> set[str]:
    """JSON-encoded ids of the complete lines of ``out`` (an unfinished last line is cut).

    Raises:
      ValueError: a complete line that is not a result object (the file is not ours).
    """
    if not out.exists():
        return set()
    data = out.read_bytes()
    cut = data.rfind(b"\n") + 1
    if cut < len(data):  # an interrupted write: drop the partial line, rerun its prompt
        with out.open("r+b") as f:
            f.truncate(cut)
    done = set()
    for n, line in enumerate(data[:cut].decode("utf-8").splitlines(), 1):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{out}:{n}: not a JSON line; is this an output file?") from None
        if not isinstance(obj, dict) or "id" not in obj:
            raise ValueError(f"{out}:{n}: a line without an id; is this an output file?")
        done.add(id_key(obj["id"]))
    return done


def open_output(out: str | Path, settings: dict, *, force: bool = False
                ) -> tuple[set[str], TextIO]:
    """Checks ``out`` against the run's settings and opens it for appending.

    Args:
      out: the output path (a shard's, from `shard_path`).
      settings: JSON-able run settings; entries under ``"run"`` may change on resumption.
      force: append even if ``out`` was written with other settings (the sidecar is
        rewritten).

    Returns:
      (JSON-encoded ids already in ``out``, the file opened for appending).

    Raises:
      ValueError: the sidecar records other settings (without ``force``), or ``out``
        exists without a sidecar, or holds lines that are not results.
    """
    out = Path(out)
    side = settings_path(out)
    if side.exists():
        old = json.loads(side.read_text(encoding="utf-8"))
        if _comparable(old) != _comparable(settings) and not force:
            diff = sorted(k for k in set(old) | set(settings) if k != RUN_KEY
                          and old.get(k) != settings.get(k))
            raise ValueError(f"{out} was written with other settings ({', '.join(diff)} "
                             f"differ, see {side}); use another --output or --force")
    elif out.exists() and out.stat().st_size and not force:
        raise ValueError(f"{out} exists but has no settings file {side}; use another "
                         "--output or --force")
    done = read_done_ids(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if force or not side.exists():
        side.write_text(json.dumps(settings, indent=1) + "\n", encoding="utf-8")
    return done, out.open("a", encoding="utf-8")


def write_line(f: TextIO, record: dict) -> None:
    """Appends one JSON line and flushes it."""
    f.write(json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n")
    f.flush()


def merge_outputs(out: str | Path, *, force: bool = False) -> int:
    """Joins the shards ``<stem>.<i>-of-<n><suffix>`` of ``out`` into ``out``.

    Returns:
      The number of results written.

    Raises:
      ValueError: no shards, a missing shard, shards of different settings, or an id in
        two shards; ``out`` already exists (without ``force``).
    """
    out = Path(out)
    pattern = re.compile(rf"{re.escape(out.stem)}\.(\d+)-of-(\d+){re.escape(out.suffix)}$")
    found = {}
    for p in out.parent.glob(f"{out.stem}.*-of-*{out.suffix}"):
        m = pattern.fullmatch(p.name)
        if m:
            found.setdefault(int(m.group(2)), {})[int(m.group(1))] = p
    if not found:
        raise ValueError(f"no shards {out.stem}.<i>-of-<n>{out.suffix} next to {out}")
    if len(found) > 1:
        raise ValueError(f"shards of several process counts next to {out}: {sorted(found)}")
    (count, shards), = found.items()
    missing = sorted(set(range(count)) - set(shards))
    if missing:
        raise ValueError(f"{out}: shards {missing} of {count} are missing")
    if out.exists() and not force:
        raise ValueError(f"{out} exists; remove it or use --force")
    settings = []
    for i in range(count):
        side = settings_path(shards[i])
        if not side.exists():
            raise ValueError(f"{shards[i]}: no settings file {side}")
        settings.append(json.loads(side.read_text(encoding="utf-8")))
    if any(_comparable(s) != _comparable(settings[0]) for s in settings):
        raise ValueError(f"the shards of {out} were written with different settings")
    seen: dict[str, int] = {}
    lines = []
    for i in range(count):
        for line in _complete_lines(shards[i]):
            rid = id_key(json.loads(line)["id"])
            if rid in seen:
                raise ValueError(f"id {rid} is in shards {seen[rid]} and {i}")
            seen[rid] = i
            lines.append(line)
    merged = dict(settings[0], **{RUN_KEY: {**settings[0].get(RUN_KEY, {}),
                                            "merged_from": [str(shards[i]) for i in range(count)]}})
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    settings_path(out).write_text(json.dumps(merged, indent=1) + "\n", encoding="utf-8")
    tmp.replace(out)
    return len(lines)


def _complete_lines(path: Path) -> Iterator[str]:
    text = path.read_text(encoding="utf-8")
    yield from text[: text.rfind("\n") + 1].splitlines()
