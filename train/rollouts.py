"""Target rollouts: the training sequences of the drafter (docs/design.md §8).

`make_rollouts` generates a response to every prompt with the target's autoregressive
decode path (`tev_jax.engine.generate_ar`) and stores ``[prompt ; response]`` token ids
in row shards plus a manifest (format 2)::

    <dir>/manifest.json                     format, seq_len L, pad_id, rows per shard
    <dir>/shard-00003-of-00008.tokens.npy   int32 [S_i, L] right-padded with pad_id
    <dir>/shard-00003-of-00008.spans.npy    int32 [S_i, 2] response [start, end)
    <dir>/shard-00003-of-00008.json         rows, token sum, settings (written last)

Shard i holds prompts ``[i * shard_size, (i + 1) * shard_size)``, sampled with keys
from (seed, i), so its content does not depend on how many processes generate the set:
process p of P writes the shards with ``i % P == p`` (a shard is complete once its
``.json`` exists; a restarted process keeps its complete shards), and whichever process
completes the set writes the manifest (under a temporary name, then renamed). Format 1
folders (``tokens-00000.npy`` / ``spans-00000.npy``, one manifest) are still read.

`RolloutSet` reads a folder back: token shards are memory-mapped (a process reads only
the rows it asks for), spans are read whole (8 bytes a sequence). `batch_at` is the
batch of update k: a pure function of (data, seed, k), whatever the number of processes
that read it (each reads its own ``rows`` of it, see `train.local_input`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

from tev_jax.runtime import signals
from tev_jax.sampling import Sampling
from train.anchors import labels_in_response, sample_anchors, step_rng

FORMAT = "tev-jax-rollouts/2"
FORMAT_V1 = "tev-jax-rollouts/1"


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How to generate rollouts.

    Attributes:
      max_prompt_len: prompts are cut to their last ``max_prompt_len`` tokens.
      max_new_tokens: response length cap (a stop token ends a response earlier).
      sampling: the target's sampling transform.
      stop_token_ids: tokens that end a response (kept in it).
      batch_size: prompts decoded together.
      shard_size: sequences per shard.
      pad_id: padding token id.
      seed: PRNG seed (batch j of shard i uses ``fold_in(fold_in(key(seed), i), j)``).
    """

    max_prompt_len: int = 256
    max_new_tokens: int = 256
    sampling: Sampling = Sampling(1.0)
    stop_token_ids: tuple[int, ...] = ()
    batch_size: int = 16
    shard_size: int = 4096
    pad_id: int = 0
    seed: int = 0

    def __post_init__(self):
        for name in ("max_prompt_len", "max_new_tokens", "batch_size", "shard_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")

    @property
    def seq_len(self) -> int:
        """L: prompt + response capacity rounded up to a multiple of 8."""
        return -(-(self.max_prompt_len + self.max_new_tokens) // 8) * 8


def generate_responses(target, prompts: Sequence[Sequence[int]], config: RolloutConfig,
                       progress=None, key=None) -> list[np.ndarray]:
    """The target's response to every prompt (autoregressive decoding).

    Args:
      key: PRNG key of this list of prompts (default ``key(config.seed)``); batch j
        uses ``fold_in(key, j)``.
    Returns:
      One int32 array per prompt: the generated tokens (a final stop token included).
    """
    from tev_jax.decode import DecodeConfig
    from tev_jax.engine import generate_ar

    dc = DecodeConfig(max_new_tokens=config.max_new_tokens, builder="none",
                      sampling=config.sampling, stop_token_ids=tuple(config.stop_token_ids))
    key = jax.random.key(config.seed) if key is None else key
    out = []
    for i in range(0, len(prompts), config.batch_size):
        signals.check()  # between batches (a shard's batches so far are dropped)
        chunk = [list(p) for p in prompts[i:i + config.batch_size]]
        gen = generate_ar(target, chunk, dc, jax.random.fold_in(key, i // config.batch_size))
        out.extend(np.asarray(r, np.int32) for r in gen.rows())
        if progress is not None:
            progress(len(chunk))
    return out


# ----------------------------------------------------------------------- writing


def shard_name(index: int, num_shards: int) -> str:
    """File stem of shard ``index`` of ``num_shards``."""
    return f"shard-{index:05d}-of-{num_shards:05d}"


def pack_sequences(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                   seq_len: int, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``[prompt ; response]`` rows right-padded to ``seq_len``.

    Returns:
      (tokens int32 [S, L], spans int32 [S, 2] response [start, end)).
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    tokens = np.full((len(prompts), seq_len), pad_id, np.int32)
    spans = np.zeros((len(prompts), 2), np.int32)
    for j, (p, r) in enumerate(zip(prompts, responses)):
        end = len(p) + len(r)
        if end > seq_len:
            raise ValueError(f"sequence {j} has {end} tokens > seq_len {seq_len}")
        tokens[j, :len(p)] = p
        tokens[j, len(p):end] = r
        spans[j] = (len(p), end)
    return tokens, spans


def _write_atomic(path: Path, write) -> None:
    """Writes a file under a temporary name and renames it into place."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _token_sum(tokens: np.ndarray) -> int:
    return int(np.asarray(tokens, np.int64).sum() % (1 << 61))


def write_shard(out_dir: str | os.PathLike, index: int, num_shards: int, tokens: np.ndarray,
                spans: np.ndarray, *, pad_id: int = 0, key: str = "",
                info: dict | None = None) -> dict:
    """Writes shard ``index`` of ``num_shards``: its arrays, then its ``.json`` record.

    Args:
      tokens: int32 [S_i, L]; spans: int32 [S_i, 2].
      key: identifies the generation run (settings and prompts); shards of one set
        share it.
    Returns:
      The shard record (what the ``.json`` holds).
    """
    if not 0 <= index < num_shards:
        raise ValueError(f"shard index {index} is not in [0, {num_shards})")
    out_dir = Path(out_dir)
    stem = shard_name(index, num_shards)
    tokens = np.asarray(tokens, np.int32)
    _write_atomic(out_dir / f"{stem}.tokens.npy", lambda f: np.save(f, tokens))
    _write_atomic(out_dir / f"{stem}.spans.npy", lambda f: np.save(f, np.asarray(spans, np.int32)))
    record = {"format": FORMAT, "index": index, "num_shards": num_shards,
              "count": int(tokens.shape[0]), "seq_len": int(tokens.shape[1]),
              "pad_id": int(pad_id), "token_sum": _token_sum(tokens), "key": key,
              "info": info or {}}
    _write_atomic(out_dir / f"{stem}.json", lambda f: f.write(json.dumps(record).encode()))
    return record


def _shard_record(out_dir: Path, index: int, num_shards: int) -> dict | None:
    path = out_dir / f"{shard_name(index, num_shards)}.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e


def _num_shards_in(out_dir: Path) -> int:
    counts = sorted({int(p.name.split("-of-")[1].split(".")[0])
                     for p in out_dir.glob("shard-*-of-*.json")})
    if len(counts) != 1:
        raise ValueError(f"{out_dir}: " + ("no shards" if not counts else
                         f"shards of several layouts (-of- {counts}); give num_shards"))
    return counts[0]


def write_manifest(out_dir: str | os.PathLike, num_shards: int | None = None) -> dict:
    """Writes ``manifest.json`` for shards 0..num_shards-1 (temporary name, then rename).

    Args:
      num_shards: default: the one layout present in ``out_dir``.
    Returns:
      The manifest dict.
    Raises:
      ValueError: a shard is missing, or the shards disagree (seq_len, pad_id, run).
    """
    out_dir = Path(out_dir)
    n = _num_shards_in(out_dir) if num_shards is None else num_shards
    records = [_shard_record(out_dir, i, n) for i in range(n)]
    missing = [i for i, r in enumerate(records) if r is None]
    if missing:
        raise ValueError(f"{out_dir}: {len(missing)} of {n} shards are not written yet "
                         f"(missing {missing[:8]}{' ...' if len(missing) > 8 else ''})")
    for field in ("seq_len", "pad_id", "key"):
        values = sorted({str(r[field]) for r in records})
        if len(values) > 1:
            raise ValueError(f"{out_dir}: shards disagree on {field} ({values}); they come "
                             "from different runs")
    first = records[0]
    manifest = {"format": FORMAT, "seq_len": first["seq_len"], "pad_id": first["pad_id"],
                "num_sequences": sum(r["count"] for r in records),
                "token_sum": sum(r["token_sum"] for r in records) % (1 << 61),
                "key": first["key"], "info": first["info"],
                "shards": [{"name": shard_name(i, n), "count": r["count"]}
                           for i, r in enumerate(records)]}
    _write_atomic(out_dir / "manifest.json",
                  lambda f: f.write(json.dumps(manifest, indent=2).encode()))
    return manifest


def write_rollouts(out_dir: str | os.PathLike, prompts: Sequence[Sequence[int]],
                   responses: Sequence[Sequence[int]], *, pad_id: int = 0,
                   shard_size: int = 4096, seq_len: int | None = None,
                   info: dict | None = None) -> dict:
    """Writes in-memory sequences as a rollout folder (one process).

    The folder is assembled in a temporary sibling and renamed into place.

    Args:
      prompts, responses: token ids per sequence.
      seq_len: L; default the longest sequence rounded up to a multiple of 8.
      info: extra JSON fields for the manifest (generation settings, target path).
    Returns:
      The manifest dict.
    """
    if not prompts:
        raise ValueError("no sequences to write")
    if seq_len is None:
        seq_len = -(-max(len(p) + len(r) for p, r in zip(prompts, responses)) // 8) * 8
    tokens, spans = pack_sequences(prompts, responses, seq_len, pad_id)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        n = -(-len(prompts) // shard_size)
        for i in range(n):
            rows = slice(i * shard_size, (i + 1) * shard_size)
            write_shard(tmp, i, n, tokens[rows], spans[rows], pad_id=pad_id, info=info)
        manifest = write_manifest(tmp, n)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def make_rollouts(target, prompts: Sequence[Sequence[int]], out_dir: str | os.PathLike,
                  config: RolloutConfig, info: dict | None = None, progress=None, *,
                  process_index: int = 0, process_count: int = 1,
                  replace: bool = False) -> dict | None:
    """Generates this process's shards with the target (see module docstring).

    Every process gets the same ``prompts``. Complete shards of the same run (settings
    and prompts) already in ``out_dir`` are kept, so a restarted process continues.
    Rollouts of another run (other settings, prompts or target) in ``out_dir`` are
    refused, or with ``replace`` deleted first.

    Args:
      progress: called with the number of sequences each decoded batch adds.
      process_index, process_count: this process writes shards ``i % count == index``.
      replace: delete another run's shards and manifest instead of refusing.
    Returns:
      The manifest if this process completed the set, else None (other processes'
      shards are missing; the last one to finish writes it, or call `write_manifest`).
    Raises:
      ValueError: ``out_dir`` holds another run's rollouts (without ``replace``); the
        message names the settings that differ.
    """
    if not 0 <= process_index < process_count:
        raise ValueError(f"process index {process_index} is not in [0, {process_count})")
    if not prompts:
        raise ValueError("no prompts")
    prompts = [list(p)[-config.max_prompt_len:] for p in prompts]
    settings = {"max_prompt_len": config.max_prompt_len,
                "max_new_tokens": config.max_new_tokens,
                "temperature": config.sampling.temperature, "top_k": config.sampling.top_k,
                "top_p": config.sampling.top_p, "stop_token_ids": list(config.stop_token_ids),
                "shard_size": config.shard_size, "seed": config.seed, **(info or {})}
    run_key = hashlib.sha256(json.dumps([settings, config.pad_id, prompts]).encode()).hexdigest()
    out_dir = Path(out_dir)
    _other_runs(out_dir, run_key, settings, replace)
    created = [p for p in (out_dir, *out_dir.parents) if not p.exists()]
    out_dir.mkdir(parents=True, exist_ok=True)
    n = -(-len(prompts) // config.shard_size)
    root = jax.random.key(config.seed)
    try:
        for i in range(process_index, n, process_count):
            signals.check()  # between shards: the written ones are complete
            record = _shard_record(out_dir, i, n)
            if record is not None and record.get("key") == run_key:
                continue
            chunk = prompts[i * config.shard_size:(i + 1) * config.shard_size]
            responses = generate_responses(target, chunk, config, progress,
                                           key=jax.random.fold_in(root, i))
            tokens, spans = pack_sequences(chunk, responses, config.seq_len, config.pad_id)
            write_shard(out_dir, i, n, tokens, spans, pad_id=config.pad_id, key=run_key,
                        info=settings)
    except BaseException:
        for p in created:  # a run refused before its first shard leaves no folder behind
            with contextlib.suppress(OSError):
                p.rmdir()
        raise
    records = [_shard_record(out_dir, i, n) for i in range(n)]
    if any(r is None or r.get("key") != run_key for r in records):
        return None
    return write_manifest(out_dir, n)


def _other_runs(out_dir: Path, run_key: str, settings: dict, replace: bool) -> None:
    """Refuses (or, with ``replace``, deletes) the rollouts of another run in ``out_dir``."""
    if not out_dir.is_dir():
        return
    records = [out_dir / "manifest.json"] if (out_dir / "manifest.json").is_file() else []
    records += sorted(out_dir.glob("shard-*-of-*.json"))
    other = []
    for path in records:
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            record = {}
        if record.get("key") != run_key:
            other.append((path, record))
    if not other:
        return
    if not replace:
        old = other[0][1].get("info") or {}
        diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
        what = (f"{', '.join(diff)} differ" if diff else
                "the prompts differ" if old else "unreadable records")
        raise ValueError(f"{out_dir} holds the rollouts of another run ({what}); use another "
                         "--out, or --force to replace them")
    for path, _ in other:
        stem = path.name[: -len(".json")]
        for name in (path.name, f"{stem}.tokens.npy", f"{stem}.spans.npy"):
            (out_dir / name).unlink(missing_ok=True)


# ----------------------------------------------------------------------- reading


@dataclasses.dataclass(frozen=True)
class HostBatch:
    """A micro-batch on the host: all B rows, or the rows one process reads.

    Attributes:
      tokens: int32 [B, L] sequences.
      anchors: int32 [B, A] anchor positions.
      valid: bool [B, A] real anchors.
      indices: int64 [B] sequence ids in the set (for logging and checks).
      in_bounds: int32 [B, A] labels of each anchor inside the response
        (`train.anchors.labels_in_response`: H unless anchors are drawn ``partial``).
    """

    tokens: np.ndarray
    anchors: np.ndarray
    valid: np.ndarray
    indices: np.ndarray
    in_bounds: np.ndarray


@functools.lru_cache(maxsize=4)
def _epoch_permutation(seed: int, epoch: int, num: int) -> np.ndarray:
    return step_rng(seed, epoch, 0).permutation(num)


class RolloutSet:
    """Token sequences with their response spans.

    Args:
      tokens: int32 [S, L] (in memory), or a list of [S_i, L] row shards (e.g.
        memory-mapped files) that together are the S sequences.
      spans: int32 [S, 2] response [start, end).
      manifest: the manifest dict (empty for in-memory sets).
    """

    def __init__(self, tokens, spans: np.ndarray, manifest: dict | None = None):
        is_shards = isinstance(tokens, (list, tuple)) and tokens and all(
            isinstance(t, np.ndarray) and t.ndim == 2 for t in tokens)
        shards = list(tokens) if is_shards else [np.asarray(tokens)]
        spans = np.asarray(spans)
        widths = {s.shape[1] if s.ndim == 2 else None for s in shards}
        if len(widths) != 1 or None in widths or not sum(len(s) for s in shards):
            raise ValueError(f"tokens must be a non-empty [S, L] array, got shards of shapes "
                             f"{[s.shape for s in shards]}")
        self._shards = shards
        self._ends = np.cumsum([len(s) for s in shards])
        s, length = int(self._ends[-1]), widths.pop()
        if spans.shape != (s, 2):
            raise ValueError(f"spans must be [S, 2] = [{s}, 2], got {spans.shape}")
        bad = (spans[:, 0] < 0) | (spans[:, 1] < spans[:, 0]) | (spans[:, 1] > length)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"sequence {i}: response span {spans[i].tolist()} is not "
                             f"inside [0, {length}]")
        self.spans = spans.astype(np.int32)
        self.manifest = manifest or {}
        self._seq_len = length

    @property
    def num_sequences(self) -> int:
        return int(self._ends[-1])

    @property
    def seq_len(self) -> int:
        return self._seq_len

    @property
    def tokens(self) -> np.ndarray:
        """int32 [S, L]: every sequence (reads all shards)."""
        return self.read(np.arange(self.num_sequences))

    def read(self, indices: np.ndarray) -> np.ndarray:
        """int32 [len(indices), L]: the token rows of sequence ids ``indices``."""
        indices = np.asarray(indices, np.int64)
        out = np.empty((len(indices), self.seq_len), np.int32)
        shard_of = np.searchsorted(self._ends, indices, side="right")
        for s in np.unique(shard_of):
            sel = shard_of == s
            lo = self._ends[s - 1] if s else 0
            out[sel] = self._shards[s][indices[sel] - lo]
        return out

    @classmethod
    def load(cls, path: str | os.PathLike) -> "RolloutSet":
        """Opens a folder written by `make_rollouts` / `write_rollouts` (validated).

        Token shards are memory-mapped; only the rows that are read are loaded.
        """
        path = Path(path)
        mpath = path / "manifest.json"
        if not mpath.is_file():
            hint = ("shards are there but no manifest: processes are still writing, or run "
                    "`python -m train rollouts --merge --out DIR`"
                    if any(path.glob("shard-*.json")) else
                    "not a rollout folder; create one with `python -m train rollouts`")
            raise ValueError(f"{path}: no manifest.json ({hint})")
        try:
            manifest = json.loads(mpath.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{mpath}: not valid JSON ({e})") from e
        fmt = manifest.get("format")
        if fmt == FORMAT:
            files = [(f"{s['name']}.tokens.npy", f"{s['name']}.spans.npy", s["count"])
                     for s in manifest["shards"]]
        elif fmt == FORMAT_V1:
            files = [(s["tokens"], s["spans"], s["count"]) for s in manifest["shards"]]
        else:
            raise ValueError(f"{mpath}: format {fmt!r}, expected {FORMAT!r} (or {FORMAT_V1!r})")
        tokens, spans = [], []
        for tok_name, span_name, count in files:
            tok = _load_rows(path / tok_name, count, mmap=True)
            if tok.ndim != 2 or tok.shape[1] != manifest["seq_len"]:
                raise ValueError(f"{path / tok_name}: shape {list(tok.shape)}, manifest says "
                                 f"[{count}, {manifest['seq_len']}]")
            tokens.append(tok)
            spans.append(_load_rows(path / span_name, count, mmap=False))
        return cls(tokens, np.concatenate(spans), manifest)

    def fingerprint(self) -> dict:
        """Identifies the data (stored in checkpoints, checked on resume)."""
        token_sum = self.manifest.get("token_sum")
        if token_sum is None:   # in-memory and format-1 sets
            token_sum = sum(_token_sum(s) for s in self._shards) % (1 << 61)
        return {"num_sequences": self.num_sequences, "seq_len": self.seq_len,
                "token_sum": int(token_sum)}

    def indices_at(self, seed: int, step: int, batch_size: int) -> np.ndarray:
        """Sequence ids of micro-batch ``step``: epoch-wise shuffles seeded by (seed, epoch)."""
        s = self.num_sequences
        counter = step * batch_size + np.arange(batch_size, dtype=np.int64)
        epochs = counter // s
        out = np.empty(batch_size, np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = _epoch_permutation(int(seed), int(e), s)[counter[sel] % s]
        return out

    def batch_at(self, seed: int, step: int, batch_size: int, num_anchors: int,
                 horizon: int, rows: np.ndarray | None = None, partial: bool = False
                 ) -> HostBatch:
        """The micro-batch of ``step``: a pure function of (data, seed, step).

        Args:
          rows: positions in the micro-batch to return (default all B); only their
            token rows are read. Anchors are drawn for all B rows (from spans, in
            memory), so every subset agrees with the whole batch.
          partial: also draw anchors whose horizon runs past the response end
            (`train.anchors.sample_anchors`).
        """
        idx = self.indices_at(seed, step, batch_size)
        ends = self.spans[idx, 1]
        anchors, valid = sample_anchors(step_rng(seed, step, 1), self.spans[idx, 0], ends,
                                        horizon, num_anchors, partial)
        in_bounds = labels_in_response(anchors, valid, ends, horizon)
        if rows is not None:
            idx, anchors, valid, in_bounds = idx[rows], anchors[rows], valid[rows], in_bounds[rows]
        return HostBatch(tokens=self.read(idx), anchors=anchors, valid=valid, indices=idx,
                         in_bounds=in_bounds)


def _load_rows(path: Path, count: int, *, mmap: bool) -> np.ndarray:
    if not path.is_file():
        raise ValueError(f"{path.parent}: shard file {path.name} is missing")
    try:
        arr = np.load(path, mmap_mode="r" if mmap else None)
    except Exception as e:
        raise ValueError(f"{path}: unreadable ({e})") from e
    if arr.shape[0] != count:
        raise ValueError(f"{path}: {arr.shape[0]} rows, manifest says {count}")
    return arr


__all__ = ["FORMAT", "FORMAT_V1", "HostBatch", "RolloutConfig", "RolloutSet",
           "generate_responses", "make_rollouts", "pack_sequences", "shard_name",
           "write_manifest", "write_rollouts", "write_shard"]
