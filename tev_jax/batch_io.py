"""Files of batch generation: prompts in, JSONL results out (resumable, sharded).

Prompts file: JSONL (``.jsonl`` / ``.json``), one object per line with an ``id`` and one
of ``prompt`` (text), ``messages`` (a chat: ``[{"role", "content"}, ...]``) or
``prompt_ids`` (token ids); or any other file as plain text, one prompt per line, whose
id is its line number (from 1). Blank JSONL lines are skipped.

The bundled evaluation sets (`tev_jax.data.prompts`) are prompts files too: give
``bundled:NAME`` or their path (``tev_jax/data/prompts/gsm.jsonl``); chat sets become
one-turn ``messages``, HumanEval its ``prompt``.

Output: ``OUT`` gets one JSON object per finished prompt, appended and flushed line by
line (``index``: its position in the prompts file; ``settings``: the fingerprint of the
settings that made it); the run's settings go to the sidecar ``<OUT stem>.settings.json``
with the number of prompts the file will hold. One process writes ``OUT`` at a time
(`lock_output`: an exclusive lock on ``OUT.lock``; a second writer is refused with a
line naming the holder). A rerun with the same settings skips the ids already in
``OUT``; with other settings it is refused unless forced (the old sidecar is then kept
as ``<OUT stem>.settings.<fingerprint>.json``, so every row's settings stay on disk).
A finished ``OUT`` is put in input order (`sort_output`). With ``count`` processes,
process ``index`` takes the prompts at positions ``i % count == index`` of the file and
writes ``<OUT stem>.<index>-of-<count><OUT suffix>``; `merge_outputs` joins complete
shards into ``OUT``, in input order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import re
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from tev_jax.batching import Request
from tev_jax.prompts import check_context, check_prompt

PROMPT_FIELDS = ("prompt", "messages", "prompt_ids")
RUN_KEY = "run"  # settings entries that may differ between a run and its resumption
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


def settings_fingerprint(settings: dict) -> str:
    """12 hex digits naming the settings that decide the results (``"run"`` entries
    excluded); every result line records the fingerprint of the settings that made it."""
    text = json.dumps(_comparable(settings), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _unwritable(out: Path, e: OSError, flag: str = "--output", what: str | None = None
                ) -> ValueError:
    file = next((p for p in (out.parent, *out.parent.parents) if p.is_file()), None)
    why = f"{file} is a file, not a folder" if file is not None else e.strerror or e
    return ValueError(f"{what or out}: cannot write there ({why}); choose another {flag}")


def read_results(out: Path) -> list[dict]:
    """The complete result lines of ``out`` (an unfinished last line is cut from the file).

    Raises:
      ValueError: a complete line that is not a result object (the file is not ours),
        text that is not UTF-8, or an id on two lines (two runs wrote the file at once).
    """
    if not out.exists():
        return []
    data = out.read_bytes()
    cut = data.rfind(b"\n") + 1
    if cut < len(data):  # an interrupted write: drop the partial line, rerun its prompt
        with out.open("r+b") as f:
            f.truncate(cut)
    rows, seen = [], {}
    for n, line in enumerate(read_text(out).splitlines(), 1):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{out}:{n}: not a JSON line; is this an output file?") from None
        if not isinstance(obj, dict) or "id" not in obj:
            raise ValueError(f"{out}:{n}: a line without an id; is this an output file?")
        key = id_key(obj["id"])
        if key in seen:
            raise ValueError(f"{out}:{n}: id {obj['id']!r} is also on line {seen[key]} (two "
                             "runs wrote this file at once?); keep one line per id")
        seen[key] = n
        rows.append(obj)
    return rows


def read_done_ids(out: Path) -> set[str]:
    """JSON-encoded ids of the complete lines of ``out`` (see `read_results`)."""
    return {id_key(r["id"]) for r in read_results(Path(out))}


def lock_path(out: str | Path) -> Path:
    """The lock file of an output: ``OUT.lock``."""
    out = Path(out)
    return out.with_name(out.name + ".lock")


@contextlib.contextmanager
def lock_output(out: str | Path, *, command: str = "tev-jax generate", flag: str = "--output",
                what: str | None = None) -> Iterator[None]:
    """Holds an exclusive lock on ``out`` (``flock`` of ``OUT.lock``, removed on exit).

    The lock file names its holder (process id, host, start time, command), so a second
    writer is refused with one line saying who writes the file (``what``, default
    ``out``) and which ``flag`` to change. Folders made for it are removed again if the
    run leaves them empty.

    Raises:
      ValueError: another process holds the lock, or ``out``'s folder is not writable.
    """
    out = Path(out)
    path = lock_path(out)
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 4096).decode("utf-8", "replace").strip() or "unknown"
                os.close(fd)
                raise ValueError(f"{what or out} is being written by another process "
                                 f"({holder}; lock {path}); wait for it to finish or use "
                                 f"another {flag}") from None
            except OSError as e:
                if e.errno not in _NO_LOCKS:
                    raise
                print(f"warning: {out.parent} cannot be locked ({e.strerror}): a second "
                      "writer of this output would not be noticed", file=sys.stderr)
                break
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False  # its holder removed it as we locked: lock the new one
            if same:
                break
            os.close(fd)
    except OSError as e:
        _remove_empty(made)
        raise _unwritable(out, e, flag, what) from None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {command}\n".encode())
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)
        _remove_empty(made)


# flock errors of filesystems without locks (some FUSE and network mounts): write unlocked
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def _remove_empty(folders: Sequence[Path]) -> None:
    for p in folders:  # deepest first
        with contextlib.suppress(OSError):
            p.rmdir()


def read_settings(side: str | Path) -> dict:
    """The JSON object of a settings file (``OUT.settings.json``); a ValueError naming
    the file (and line) when it is damaged."""
    try:
        old = json.loads(read_text(side))
    except json.JSONDecodeError as e:
        raise ValueError(f"{side}:{e.lineno}: malformed JSON ({e.msg}); the settings file "
                         "is damaged: restore it, or delete it and pass --force") from None
    if not isinstance(old, dict):
        raise ValueError(f"{side}: expected a JSON object of settings, got "
                         f"{type(old).__name__}; restore it, or delete it and pass --force")
    return old


def check_output_settings(out: str | Path, settings: dict, *, force: bool = False,
                          ids: set[str] | None = None) -> None:
    """Refuses ``out`` if it was written with other settings (without ``force``; with it,
    when it already holds a result for each of ``ids``, this run's prompts: nothing would
    be decoded with the new settings, and its settings file would name them), has results
    but no sidecar, or holds lines that are not results; writes nothing."""
    out = Path(out)
    side = settings_path(out)
    if side.exists():
        old = read_settings(side)
        if _comparable(old) != _comparable(settings):
            diff = sorted(k for k in set(old) | set(settings) if k != RUN_KEY
                          and old.get(k) != settings.get(k))
            if not force:
                raise ValueError(f"{out} was written with other settings ({', '.join(diff)} "
                                 f"differ, see {side}); use another --output or --force")
            if ids is not None and ids <= read_done_ids(out):
                raise ValueError(f"--force with other settings ({', '.join(diff)}) would "
                                 f"decode nothing: {out} already has a result for every "
                                 f"prompt, written with the settings in {side}; use "
                                 "another --output to decode them with the new settings")
    elif out.exists() and out.stat().st_size and not force:
        raise ValueError(f"{out} exists but has no settings file {side}; use another "
                         "--output or --force")
    read_results(out)


def open_output(out: str | Path, settings: dict, *, force: bool = False,
                expected: int | None = None) -> tuple[set[str], TextIO]:
    """Checks ``out`` against the run's settings and opens it for appending.

    Hold `lock_output` around it and the writing.

    Args:
      out: the output path (a shard's, from `shard_path`).
      settings: JSON-able run settings; entries under ``"run"`` may change on resumption.
      force: append even if ``out`` was written with other settings; the old sidecar
        is kept as ``<stem>.settings.<its fingerprint>.json`` (the rows written before
        name that fingerprint).
      expected: how many results ``out`` holds when complete (recorded in the sidecar
        for `merge_outputs`).

    Returns:
      (JSON-encoded ids already in ``out``, the file opened for appending).

    Raises:
      ValueError: the sidecar records other settings (without ``force``), or ``out``
        exists without a sidecar, or holds lines that are not results, or cannot be
        written.
    """
    out = Path(out)
    side = settings_path(out)
    check_output_settings(out, settings, force=force)
    done = read_done_ids(out)
    run = dict(settings.get(RUN_KEY, {}), fingerprint=settings_fingerprint(settings))
    if expected is not None:
        run["expected"] = int(expected)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if side.exists():
            old = read_settings(side)
            if _comparable(old) != _comparable(settings):  # forced: keep the old settings
                kept = side.with_name(f"{out.stem}.settings.{settings_fingerprint(old)}.json")
                if not kept.exists():
                    os.replace(side, kept)
        _write_atomic(side, json.dumps(dict(settings, **{RUN_KEY: run}), indent=1) + "\n")
        return done, out.open("a", encoding="utf-8")
    except OSError as e:
        raise _unwritable(out, e) from None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_line(f: TextIO, record: dict) -> None:
    """Appends one JSON line and flushes it."""
    f.write(json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n")
    f.flush()


def _in_order(rows: list[dict]) -> list[dict]:
    """Rows by their ``index`` (position in the prompts file); rows without one (from an
    older tev-jax) keep their place after those."""
    return sorted(rows, key=lambda r: (r.get("index") is None, r.get("index") or 0))


def sort_output(out: str | Path) -> None:
    """Rewrites ``out`` in input order (`_in_order`), atomically; a no-op when it is."""
    out = Path(out)
    rows = read_results(out)
    ordered = _in_order(rows)
    if ordered != rows:
        _write_atomic(out, "".join(json.dumps(r, ensure_ascii=False) + "\n"
                                   for r in ordered))


def merge_outputs(out: str | Path, *, force: bool = False) -> int:
    """Joins the complete shards ``<stem>.<i>-of-<n><suffix>`` of ``out`` into ``out``,
    in input order.

    Returns:
      The number of results written.

    Raises:
      ValueError: no shards, a missing shard, a shard still being written (its lock is
        held) or incomplete (fewer results than its sidecar expects), shards of
        different settings, or an id in two shards; ``out`` already exists (without
        ``force``).
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
    with contextlib.ExitStack() as locks:
        for i in range(count):
            locks.enter_context(lock_output(shards[i], command="tev-jax merge-outputs"))
        locks.enter_context(lock_output(out, command="tev-jax merge-outputs"))
        settings = []
        for i in range(count):
            side = settings_path(shards[i])
            if not side.exists():
                raise ValueError(f"{shards[i]}: no settings file {side}")
            settings.append(read_settings(side))
        if any(_comparable(s) != _comparable(settings[0]) for s in settings):
            raise ValueError(f"the shards of {out} were written with different settings")
        seen: dict[str, int] = {}
        rows = []
        for i in range(count):
            got = read_results(shards[i])
            expected = settings[i].get(RUN_KEY, {}).get("expected")
            if expected is not None and len(got) < expected:
                raise ValueError(
                    f"{shards[i]} is incomplete: {len(got)} of its {expected} results "
                    f"({expected - len(got)} missing); rerun process {i} of {count} (the "
                    "same generate command with --process-index "
                    f"{i}) to finish it, then merge")
            for r in got:
                rid = id_key(r["id"])
                if rid in seen:
                    raise ValueError(f"id {rid} is in shards {seen[rid]} and {i}")
                seen[rid] = i
            rows += got
        run = {**settings[0].get(RUN_KEY, {}),
               "merged_from": [str(shards[i]) for i in range(count)]}
        run.pop("process_index", None)
        run["expected"] = len(rows)
        try:
            _write_atomic(settings_path(out), json.dumps(dict(settings[0], **{RUN_KEY: run}),
                                                         indent=1) + "\n")
            _write_atomic(out, "".join(json.dumps(r, ensure_ascii=False) + "\n"
                                       for r in _in_order(rows)))
        except OSError as e:
            raise _unwritable(out, e) from None
    return len(rows)
