"""Tokenised corpus on disk and deterministic, resumable training windows.

Layout written by ``write_token_corpus`` (``runs/corpus/`` by default)::

    manifest.json             domains, token counts, input and tokenizer hashes
    splits.json               the document ids of every (split, domain)
    {split}/{domain}.npy      uint16 [T] token stream: <|bos|> doc <|eos|> <|bos|> doc ...
    {split}/{domain}.starts.npy  int64 [docs] offset of each document's <|bos|>

Training batches are a pure function of ``(config, step)``: an epoch is a fixed multiset
of length-L windows (each domain contributes windows in proportion to its weight, cut at
an epoch-dependent offset), visited in a seeded permutation. Batch k holds the samples
``k*B .. k*B+B-1`` of that endless sequence, so a run resumed at step k sees exactly the
batches it would have seen.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from tev_jax.data.tokenizer import BOS_ID, EOS_ID, tokenizer_sha256
from train.demo.corpus import DOMAINS, SPLITS, Document

MANIFEST = "manifest.json"
SPLITS_FILE = "splits.json"
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class TokenCorpus:
    """Token streams loaded (memory-mapped) from a prepared corpus folder.

    Attributes:
      train: domain -> uint16 [T] training token stream.
      val: domain -> uint16 [T] validation token stream.
      manifest: the parsed manifest.json.
    """

    train: Mapping[str, np.ndarray]
    val: Mapping[str, np.ndarray]
    manifest: Mapping


@dataclasses.dataclass(frozen=True)
class WindowConfig:
    """Static description of the training batches.

    Attributes:
      batch_size: B, windows per batch.
      seq_len: L, tokens per window (a trainer predicts ``w[:, 1:]`` from ``w[:, :-1]``).
      seed: picks the window offsets and the visiting order.
      weights: ``((domain, weight), ...)``; a domain's share of the windows of an epoch is
        proportional to its weight (0 drops it). ``None``: proportional to its tokens,
        i.e. every window of the corpus once per epoch.
    """

    batch_size: int
    seq_len: int
    seed: int = 0
    weights: tuple[tuple[str, float], ...] | None = None

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {self.seq_len}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.weights is not None:
            names = [name for name, _ in self.weights]
            if len(set(names)) != len(names):
                raise ValueError(f"weights name a domain twice: {names}")
            if any(w < 0 for _, w in self.weights) or not any(w > 0 for _, w in self.weights):
                raise ValueError("weights must be >= 0 with at least one positive")


def encode_documents(
    tokenizer: Tokenizer, documents: Sequence[Document]
) -> dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]:
    """Tokenises documents into one stream per (split, domain).

    Each document becomes ``[BOS] + ids + [EOS]``; special-token strings in chat
    documents map to their ids. Streams keep the documents' order.

    Returns:
      (split, domain) -> (uint16 [T] tokens, int64 [docs] document start offsets).
    """
    if tokenizer.get_vocab_size() > 65536:
        raise ValueError("vocabulary too large for uint16 token arrays")
    encodings = tokenizer.encode_batch([d.text for d in documents], add_special_tokens=False)
    pieces: dict[tuple[str, str], list[list[int]]] = {}
    for document, encoding in zip(documents, encodings):
        pieces.setdefault((document.split, document.domain), []).append(
            [BOS_ID, *encoding.ids, EOS_ID]
        )
    streams = {}
    for key, docs in pieces.items():
        lengths = np.array([len(ids) for ids in docs], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        tokens = np.fromiter((t for ids in docs for t in ids), dtype=np.uint16,
                             count=int(lengths.sum()))
        streams[key] = (tokens, starts)
    return streams


def write_token_corpus(
    out_dir: str | Path,
    tokenizer: Tokenizer,
    documents: Sequence[Document],
    extra_manifest: Mapping | None = None,
) -> dict:
    """Tokenises ``documents`` and writes the arrays, splits.json and manifest.json.

    Args:
      out_dir: output folder (created).
      tokenizer: the tokenizer to encode with; its hash goes into the manifest.
      documents: the corpus (``corpus.build_documents``).
      extra_manifest: more manifest entries (input hashes, config, timings).

    Returns:
      The manifest that was written.
    """
    out_dir = Path(out_dir)
    streams = encode_documents(tokenizer, documents)
    domains: dict[str, dict] = {}
    split_ids: dict[str, dict[str, list[str]]] = {s: {} for s in SPLITS}
    for domain in DOMAINS:
        for split in SPLITS:
            docs = [d for d in documents if d.domain == domain and d.split == split]
            if not docs:
                continue
            tokens, starts = streams[(split, domain)]
            (out_dir / split).mkdir(parents=True, exist_ok=True)
            np.save(out_dir / split / f"{domain}.npy", tokens)
            np.save(out_dir / split / f"{domain}.starts.npy", starts)
            utf8_bytes = sum(len(d.text.encode("utf-8")) for d in docs)
            sources: dict[str, int] = {}
            for d in docs:
                sources[d.source] = sources.get(d.source, 0) + 1
            domains.setdefault(domain, {})[split] = {
                "file": f"{split}/{domain}.npy",
                "documents": len(docs),
                "sources": dict(sorted(sources.items())),
                "chars": sum(len(d.text) for d in docs),
                "bytes": utf8_bytes,
                "tokens": int(tokens.size),
                # BOS/EOS are not text, so they are left out of the compression ratio.
                "bytes_per_token": utf8_bytes / max(1, int(tokens.size) - 2 * len(docs)),
            }
            split_ids[split][domain] = [d.id for d in docs]
    manifest = {
        "format_version": FORMAT_VERSION,
        "dtype": "uint16",
        "tokenizer": {
            "sha256": tokenizer_sha256(tokenizer),
            "vocab_size": tokenizer.get_vocab_size(),
        },
        "domains": domains,
        **(extra_manifest or {}),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / SPLITS_FILE).write_text(json.dumps(split_ids, indent=1) + "\n")
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def load_token_corpus(
    corpus_dir: str | Path, tokenizer: Tokenizer | None = None
) -> TokenCorpus:
    """Memory-maps a corpus written by ``write_token_corpus``.

    Args:
      corpus_dir: the folder holding manifest.json.
      tokenizer: if given, its hash must match the manifest's (else ``ValueError``).
    """
    corpus_dir = Path(corpus_dir)
    manifest_path = corpus_dir / MANIFEST
    if not manifest_path.is_file():
        raise ValueError(
            f"no {MANIFEST} in {corpus_dir}; run `python -m train.demo.prepare_corpus` first"
        )
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"corpus format {manifest.get('format_version')} != {FORMAT_VERSION}")
    if tokenizer is not None and tokenizer_sha256(tokenizer) != manifest["tokenizer"]["sha256"]:
        raise ValueError(f"corpus in {corpus_dir} was tokenised with a different tokenizer")
    streams: dict[str, dict[str, np.ndarray]] = {split: {} for split in SPLITS}
    for domain, entry in manifest["domains"].items():
        for split, info in entry.items():
            streams[split][domain] = np.load(corpus_dir / info["file"], mmap_mode="r")
    return TokenCorpus(train=streams["train"], val=streams["val"], manifest=manifest)


def mixture_weights(
    streams: Mapping[str, np.ndarray], alpha: float = 0.5
) -> tuple[tuple[str, float], ...]:
    """Domain weights proportional to ``tokens ** alpha`` (for ``WindowConfig.weights``).

    ``alpha = 1`` is proportional sampling, ``alpha = 0`` uniform over domains; 0.5
    upweights the small domains (math, gsm, prose) without repeating them many times per
    pass over the large code domain.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if not streams:
        raise ValueError("no token streams given")
    raw = {name: float(streams[name].shape[0]) ** alpha for name in sorted(streams)}
    total = sum(raw.values())
    return tuple((name, value / total) for name, value in raw.items())


def _rng(*words: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(w) for w in words]))


def _epoch_plan(
    lengths: Sequence[int], weights: Sequence[float], seq_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """Windows per domain per epoch ``m`` and windows available per cut ``n``."""
    available = np.array([max(0, (n - seq_len) // seq_len) for n in lengths], dtype=np.int64)
    weights_d = np.asarray(weights, dtype=np.float64) * (available > 0)
    if not weights_d.any():
        raise ValueError(f"no selected domain has at least {2 * seq_len} tokens (2 * seq_len)")
    share = weights_d / weights_d.sum()
    per_epoch = np.where(share > 0, np.maximum(1, np.round(share * available.sum())), 0)
    return per_epoch.astype(np.int64), available


def _resolve_weights(streams: Mapping[str, np.ndarray], config: WindowConfig):
    names = sorted(streams)
    if config.weights is None:
        return names, [1.0] * len(names), True
    given = dict(config.weights)
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise ValueError(f"weights name unknown domains {unknown}; corpus has {names}")
    return names, [float(given.get(name, 0.0)) for name in names], False


def train_batch(streams: Mapping[str, np.ndarray], config: WindowConfig, step: int) -> np.ndarray:
    """Training batch ``step``: B windows of L tokens, a pure function of (config, step).

    Args:
      streams: domain -> [T] token stream (``TokenCorpus.train``).
      config: batch size, window length, seed and domain weights.
      step: batch index k >= 0.

    Returns:
      int32 [B, L] token windows.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if not streams:
        raise ValueError("no token streams given")
    names, weights, proportional = _resolve_weights(streams, config)
    lengths = [int(streams[name].shape[0]) for name in names]
    seq_len = config.seq_len
    per_epoch, available = _epoch_plan(lengths, weights, seq_len)
    if proportional:
        per_epoch = available
    epoch_size = int(per_epoch.sum())
    bounds = np.cumsum(per_epoch)

    orders: dict[int, np.ndarray] = {}
    cuts: dict[tuple[int, int, int], tuple[int, np.ndarray]] = {}
    batch = np.empty((config.batch_size, seq_len), dtype=np.int32)
    for row in range(config.batch_size):
        epoch, position = divmod(step * config.batch_size + row, epoch_size)
        if epoch not in orders:
            orders[epoch] = _rng(config.seed, 0, epoch).permutation(epoch_size)
        slot = int(orders[epoch][position])
        d = int(np.searchsorted(bounds, slot, side="right"))
        within = slot - (int(bounds[d - 1]) if d else 0)
        # A domain repeated (or subsampled) inside one epoch uses a fresh cut per pass.
        cut, index = divmod(within, int(available[d]))
        if (d, epoch, cut) not in cuts:
            rng = _rng(config.seed, 1 + d, epoch, cut)
            cuts[(d, epoch, cut)] = (int(rng.integers(seq_len)), rng.permutation(int(available[d])))
        offset, window_order = cuts[(d, epoch, cut)]
        start = offset + int(window_order[index]) * seq_len
        batch[row] = streams[names[d]][start:start + seq_len]
    return batch


def validation_windows(
    tokens: np.ndarray, seq_len: int, max_windows: int | None = None
) -> np.ndarray:
    """Consecutive non-overlapping windows of a validation stream, from its start.

    Args:
      tokens: [T] token stream (``TokenCorpus.val[domain]``).
      seq_len: L.
      max_windows: keep at most this many (evenly spaced over the stream); ``None``: all.

    Returns:
      int32 [M, L] windows, M = min(T // L, max_windows).
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    count = int(tokens.shape[0]) // seq_len
    if count == 0:
        raise ValueError(f"stream of {tokens.shape[0]} tokens is shorter than seq_len {seq_len}")
    windows = np.asarray(tokens[: count * seq_len], dtype=np.int32).reshape(count, seq_len)
    if max_windows is not None and max_windows < count:
        if max_windows < 1:
            raise ValueError(f"max_windows must be >= 1, got {max_windows}")
        windows = windows[np.linspace(0, count - 1, max_windows).round().astype(np.int64)]
    return windows
