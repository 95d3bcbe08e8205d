"""The batch job's outputs: JSONL results, resumable and sharded (prompts files are read
by `tev_jax.text_io`).

Output: ``OUT`` gets one JSON object per finished prompt, appended and flushed line by
line (``index``: its position in the prompts file; ``settings``: the fingerprint of the
settings that made it); the run's settings go to the sidecar ``<OUT stem>.settings.json``
with the number of prompts the file will hold. One process writes ``OUT`` at a time
(`tev_jax.runtime.locks.lock_output`: an exclusive lock on ``OUT.lock``; a second writer is refused with a
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
import hashlib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from tev_jax.runtime.locks import lock_output, unwritable
from tev_jax.text_io import id_key, read_text

RUN_KEY = "run"  # settings entries that may differ between a run and its resumption


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
        raise unwritable(out, e) from None


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
            raise unwritable(out, e) from None
    return len(rows)
