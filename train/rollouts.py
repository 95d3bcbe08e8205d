"""Target rollouts: the training sequences of the drafter (DESIGN.md §8).

`make_rollouts` generates a response to every prompt with the target's autoregressive
decode path (`tev_jax.decode.generate_ar`) and stores ``[prompt ; response]`` token ids
as sharded ``.npy`` files plus a manifest::

    <dir>/manifest.json        format, seq_len L, pad_id, shards, generation settings
    <dir>/tokens-00000.npy     int32 [S_0, L] right-padded with pad_id
    <dir>/spans-00000.npy      int32 [S_0, 2] response [start, end) per sequence

`RolloutSet` reads them back; `batch_at` is the batch of update k: a pure function of
(seed, k), so a resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

from tev_jax.sampling import Sampling
from train.anchors import sample_anchors, step_rng

FORMAT = "tev-jax-rollouts/1"


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How to generate rollouts.

    Attributes:
      max_prompt_len: prompts are cut to their last ``max_prompt_len`` tokens.
      max_new_tokens: response length cap (a stop token ends a response earlier).
      sampling: the target's sampling transform.
      stop_token_ids: tokens that end a response (kept in it).
      batch_size: prompts decoded together.
      shard_size: sequences per ``.npy`` shard.
      pad_id: padding token id.
      seed: PRNG seed (batch i uses ``fold_in(key(seed), i)``).
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


def generate_responses(target, prompts: Sequence[Sequence[int]], config: RolloutConfig,
                       progress=None) -> list[np.ndarray]:
    """The target's response to every prompt (autoregressive decoding).

    Returns:
      One int32 array per prompt: the generated tokens (a final stop token included).
    """
    from tev_jax.decode import DecodeConfig, generate_ar

    dc = DecodeConfig(max_new_tokens=config.max_new_tokens, builder="none",
                      sampling=config.sampling, stop_token_ids=tuple(config.stop_token_ids))
    key = jax.random.key(config.seed)
    out = []
    for i in range(0, len(prompts), config.batch_size):
        chunk = [list(p) for p in prompts[i:i + config.batch_size]]
        gen = generate_ar(target, chunk, dc, jax.random.fold_in(key, i // config.batch_size))
        out.extend(np.asarray(r, np.int32) for r in gen.rows())
        if progress is not None:
            progress(len(out))
    return out


def write_rollouts(out_dir: str | os.PathLike, prompts: Sequence[Sequence[int]],
                   responses: Sequence[Sequence[int]], *, pad_id: int = 0,
                   shard_size: int = 4096, seq_len: int | None = None,
                   info: dict | None = None) -> dict:
    """Writes ``[prompt ; response]`` sequences as sharded arrays plus a manifest.

    The folder is assembled in a temporary sibling and renamed into place.

    Args:
      prompts, responses: token ids per sequence.
      seq_len: L; default the longest sequence rounded up to a multiple of 8.
      info: extra JSON fields for the manifest (generation settings, target path).
    Returns:
      The manifest dict.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if not prompts:
        raise ValueError("no sequences to write")
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    if seq_len is None:
        seq_len = -(-max(lengths) // 8) * 8
    if max(lengths) > seq_len:
        raise ValueError(f"a sequence has {max(lengths)} tokens > seq_len {seq_len}")
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    shards = []
    try:
        for s, lo in enumerate(range(0, len(prompts), shard_size)):
            hi = min(lo + shard_size, len(prompts))
            tokens = np.full((hi - lo, seq_len), pad_id, np.int32)
            spans = np.zeros((hi - lo, 2), np.int32)
            for j in range(lo, hi):
                p, r = np.asarray(prompts[j], np.int32), np.asarray(responses[j], np.int32)
                tokens[j - lo, :len(p)] = p
                tokens[j - lo, len(p):len(p) + len(r)] = r
                spans[j - lo] = (len(p), len(p) + len(r))
            names = {"tokens": f"tokens-{s:05d}.npy", "spans": f"spans-{s:05d}.npy"}
            np.save(tmp / names["tokens"], tokens)
            np.save(tmp / names["spans"], spans)
            shards.append({**names, "count": hi - lo})
        manifest = {"format": FORMAT, "seq_len": int(seq_len), "pad_id": int(pad_id),
                    "num_sequences": len(prompts), "shards": shards, "info": info or {}}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def make_rollouts(target, prompts: Sequence[Sequence[int]], out_dir: str | os.PathLike,
                  config: RolloutConfig, info: dict | None = None, progress=None) -> dict:
    """Generates responses with the target and writes them (see module docstring)."""
    prompts = [list(p)[-config.max_prompt_len:] for p in prompts]
    responses = generate_responses(target, prompts, config, progress)
    settings = {"max_prompt_len": config.max_prompt_len,
                "max_new_tokens": config.max_new_tokens,
                "temperature": config.sampling.temperature, "top_k": config.sampling.top_k,
                "top_p": config.sampling.top_p, "stop_token_ids": list(config.stop_token_ids),
                "seed": config.seed}
    return write_rollouts(out_dir, prompts, responses, pad_id=config.pad_id,
                          shard_size=config.shard_size,
                          seq_len=-(-(config.max_prompt_len + config.max_new_tokens) // 8) * 8,
                          info={**settings, **(info or {})})


# ----------------------------------------------------------------------- reading


@dataclasses.dataclass(frozen=True)
class HostBatch:
    """One micro-batch on the host.

    Attributes:
      tokens: int32 [B, L] sequences.
      anchors: int32 [B, A] anchor positions.
      valid: bool [B, A] real anchors.
      indices: int64 [B] sequence ids in the set (for logging and checks).
    """

    tokens: np.ndarray
    anchors: np.ndarray
    valid: np.ndarray
    indices: np.ndarray


class RolloutSet:
    """Token sequences with their response spans, in memory.

    Attributes:
      tokens: int32 [S, L].
      spans: int32 [S, 2] response [start, end).
      manifest: the manifest dict (empty for in-memory sets).
    """

    def __init__(self, tokens: np.ndarray, spans: np.ndarray, manifest: dict | None = None):
        tokens = np.asarray(tokens)
        spans = np.asarray(spans)
        if tokens.ndim != 2 or tokens.shape[0] == 0:
            raise ValueError(f"tokens must be a non-empty [S, L] array, got {tokens.shape}")
        if spans.shape != (tokens.shape[0], 2):
            raise ValueError(f"spans must be [S, 2] = [{tokens.shape[0]}, 2], got {spans.shape}")
        if ((spans[:, 0] < 0) | (spans[:, 1] < spans[:, 0]) | (spans[:, 1] > tokens.shape[1])).any():
            bad = int(np.argmax((spans[:, 0] < 0) | (spans[:, 1] < spans[:, 0])
                                | (spans[:, 1] > tokens.shape[1])))
            raise ValueError(f"sequence {bad}: response span {spans[bad].tolist()} is not "
                             f"inside [0, {tokens.shape[1]}]")
        self.tokens = tokens.astype(np.int32)
        self.spans = spans.astype(np.int32)
        self.manifest = manifest or {}

    @property
    def num_sequences(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]

    @classmethod
    def load(cls, path: str | os.PathLike) -> "RolloutSet":
        """Reads a folder written by `write_rollouts` (validated)."""
        path = Path(path)
        mpath = path / "manifest.json"
        if not mpath.is_file():
            raise ValueError(f"{path}: no manifest.json (not a rollout folder; create one "
                             "with `python -m train rollouts`)")
        try:
            manifest = json.loads(mpath.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{mpath}: not valid JSON ({e})") from e
        if manifest.get("format") != FORMAT:
            raise ValueError(f"{mpath}: format {manifest.get('format')!r}, expected {FORMAT!r}")
        toks, spans = [], []
        for shard in manifest["shards"]:
            for key, lst in (("tokens", toks), ("spans", spans)):
                f = path / shard[key]
                if not f.is_file():
                    raise ValueError(f"{path}: shard file {shard[key]} is missing")
                try:
                    arr = np.load(f)
                except Exception as e:
                    raise ValueError(f"{f}: unreadable ({e})") from e
                if arr.shape[0] != shard["count"]:
                    raise ValueError(f"{f}: {arr.shape[0]} rows, manifest says {shard['count']}")
                lst.append(arr)
        tokens = np.concatenate(toks)
        if tokens.shape[1] != manifest["seq_len"]:
            raise ValueError(f"{path}: sequences have length {tokens.shape[1]}, manifest "
                             f"says {manifest['seq_len']}")
        return cls(tokens, np.concatenate(spans), manifest)

    def fingerprint(self) -> dict:
        """Identifies the data (stored in checkpoints, checked on resume)."""
        return {"num_sequences": self.num_sequences, "seq_len": self.seq_len,
                "token_sum": int(self.tokens.astype(np.int64).sum() % (1 << 61))}

    def indices_at(self, seed: int, step: int, batch_size: int) -> np.ndarray:
        """Sequence ids of micro-batch ``step``: epoch-wise shuffles seeded by (seed, epoch)."""
        s = self.num_sequences
        counter = step * batch_size + np.arange(batch_size, dtype=np.int64)
        epochs = counter // s
        out = np.empty(batch_size, np.int64)
        for e in np.unique(epochs):
            perm = step_rng(seed, int(e), 0).permutation(s)
            sel = epochs == e
            out[sel] = perm[counter[sel] % s]
        return out

    def batch_at(self, seed: int, step: int, batch_size: int, num_anchors: int,
                 horizon: int) -> HostBatch:
        """The micro-batch of ``step``: a pure function of (data, seed, step)."""
        idx = self.indices_at(seed, step, batch_size)
        anchors, valid = sample_anchors(step_rng(seed, step, 1), self.spans[idx, 0],
                                        self.spans[idx, 1], horizon, num_anchors)
        return HostBatch(tokens=self.tokens[idx], anchors=anchors, valid=valid, indices=idx)


__all__ = ["FORMAT", "HostBatch", "RolloutConfig", "RolloutSet", "generate_responses",
           "make_rollouts", "write_rollouts"]
