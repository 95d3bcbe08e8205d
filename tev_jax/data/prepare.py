"""The data pipeline behind ``python -m train.prepare_corpus``: documents -> tokenizer ->
token arrays + manifest, plus the evaluation prompt files."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer

from tev_jax.data.corpus import (
    CorpusConfig,
    build_documents,
    input_hashes,
    python_version,
    tokenizer_training_texts,
)
from tev_jax.data.prompts import export_prompt_records, prompts_dir, write_prompt_records
from tev_jax.data.token_corpus import MANIFEST, write_token_corpus
from tev_jax.data.tokenizer import (
    TokenizerConfig,
    default_tokenizer_path,
    load_tokenizer,
    tokenizer_sha256,
    train_tokenizer,
)


@dataclasses.dataclass(frozen=True)
class PrepareConfig:
    """One run of the data pipeline.

    Attributes:
      corpus: sources and splits.
      out_dir: where the token arrays, manifest, prompts and (re)trained tokenizer go.
      tokenizer: tokenizer.json to encode with; ``None``: the bundled one.
      retrain_tokenizer: train a tokenizer on this corpus and encode with it.
      tokenizer_config: how to train it.
      update_bundled: write the retrained tokenizer and the exported prompt files into the
        package (``tev_jax/data``); implies ``retrain_tokenizer``.
    """

    corpus: CorpusConfig
    out_dir: str = "runs/corpus"
    tokenizer: str | None = None
    retrain_tokenizer: bool = False
    tokenizer_config: TokenizerConfig = TokenizerConfig()
    update_bundled: bool = False

    def __post_init__(self):
        if self.update_bundled and not self.retrain_tokenizer:
            raise ValueError("update_bundled needs retrain_tokenizer")
        if self.tokenizer is not None and self.retrain_tokenizer:
            raise ValueError("give either a tokenizer file or retrain_tokenizer, not both")


def _save_tokenizer(tokenizer: Tokenizer, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path), pretty=False)


def _same_files(sets: dict[str, list[dict]], folder: Path) -> bool:
    for name, records in sets.items():
        path = folder / f"{name}.jsonl"
        if not path.is_file():
            return False
        lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        if lines != records:
            return False
    return True


def prepare_corpus(config: PrepareConfig, log: Callable[[str], None] = print) -> dict:
    """Runs the pipeline and returns the manifest it wrote to ``out_dir/manifest.json``.

    Steps: build the documents; train or load the tokenizer; export the evaluation
    prompts (and compare them with the bundled files); tokenise and write the arrays.
    """
    start = time.perf_counter()
    out_dir = Path(config.out_dir)
    timings = {}

    documents = build_documents(config.corpus)
    timings["documents_s"] = round(time.perf_counter() - start, 2)
    log(f"{len(documents)} documents in {timings['documents_s']} s")

    bundled_path = default_tokenizer_path()
    tokenizer_info: dict = {}
    if config.retrain_tokenizer:
        tick = time.perf_counter()
        texts = tokenizer_training_texts(documents, config.tokenizer_config.max_chars_per_domain)
        tokenizer = train_tokenizer(texts, config.tokenizer_config)
        timings["tokenizer_s"] = round(time.perf_counter() - tick, 2)
        _save_tokenizer(tokenizer, out_dir / "tokenizer.json")
        if config.update_bundled:
            _save_tokenizer(tokenizer, bundled_path)
        tokenizer_info = {
            "trained_on_chars": sum(len(t) for t in texts),
            "config": dataclasses.asdict(config.tokenizer_config),
            "path": str(out_dir / "tokenizer.json"),
        }
        log(f"trained tokenizer (V={tokenizer.get_vocab_size()}) in {timings['tokenizer_s']} s")
    else:
        path = Path(config.tokenizer) if config.tokenizer else bundled_path
        tokenizer = load_tokenizer(path)
        tokenizer_info = {"path": str(path)}
    if bundled_path.is_file():
        tokenizer_info["matches_bundled"] = (
            tokenizer_sha256(tokenizer) == tokenizer_sha256(load_tokenizer(bundled_path))
        )

    sets = export_prompt_records(config.corpus.data_dir)
    write_prompt_records(sets, out_dir / "prompts")
    if config.update_bundled:
        write_prompt_records(sets, prompts_dir())
    prompts_match = _same_files(sets, prompts_dir())
    if not prompts_match:
        log("warning: the bundled prompt files differ from the ones exported from the data")

    tick = time.perf_counter()
    extra = {
        "python_version": python_version(),
        "inputs_sha256": input_hashes(config.corpus),
        "corpus_config": dataclasses.asdict(config.corpus),
        "tokenizer_info": tokenizer_info,
        "bundled_prompts_match": prompts_match,
        "prompt_counts": {name: len(records) for name, records in sets.items()},
    }
    manifest = write_token_corpus(out_dir, tokenizer, documents, extra)
    timings["encode_write_s"] = round(time.perf_counter() - tick, 2)
    timings["total_s"] = round(time.perf_counter() - start, 2)
    manifest["timings"] = timings
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    log(f"wrote {out_dir} in {timings['total_s']} s")
    return manifest
