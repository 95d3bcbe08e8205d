"""Builds the offline corpus: token arrays, manifest and evaluation prompts.

    python -m train.demo.prepare_corpus                    # encode with the bundled tokenizer
    python -m train.demo.prepare_corpus --update-bundled   # everything: retrain the tokenizer,
                                                      # re-export the bundled prompt files

Reads the shared data folder at run time (``--data-dir``, default ``data/``
relative to the repository root) and the running interpreter's standard library; writes
to ``runs/corpus/`` (gitignored). See ``tev_jax/data/README.md``.

The pipeline (`prepare_corpus`): documents (`train.demo.corpus`) -> tokenizer -> token arrays
and manifest (`train.demo.token_corpus`), plus the evaluation prompt files that
`tev_jax.data.prompts` reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from tokenizers import Tokenizer

from tev_jax.data.prompts import PROMPT_COUNTS, prompts_dir, read_jsonl
from tev_jax.data.tokenizer import (
    TokenizerConfig,
    default_tokenizer_path,
    load_tokenizer,
    tokenizer_sha256,
    train_tokenizer,
)
from train.demo.corpus import (
    CorpusConfig,
    build_documents,
    input_hashes,
    math_holdout_ids,
    python_version,
    resolve_data_dir,
    tokenizer_training_texts,
)
from train.demo.token_corpus import MANIFEST, write_token_corpus

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATA_DIR = REPO_ROOT / "data"


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


def export_prompt_records(data_dir: str | Path) -> dict[str, list[dict]]:
    """Builds the bundled prompt records from the shared data (what gets committed).

    Keeps only what the experiments need: MT-Bench first turns, HumanEval prompts and
    entry points, GSM eval questions with their final answers, and the held-out CHAMP
    problems with their solutions.
    """
    data_dir = resolve_data_dir(data_dir)
    mt_bench = [
        {"id": r["id"], "category": r["category"], "turn": r["turns"][0]}
        for r in read_jsonl(data_dir / "mt_bench.jsonl")
    ]
    humaneval = [
        {"id": r["id"], "prompt": r["prompt"], "entry_point": r["entry_point"]}
        for r in read_jsonl(data_dir / "humaneval.jsonl")
    ]
    gsm = []
    for r in read_jsonl(data_dir / "gsm_eval.jsonl"):
        if "####" not in r["answer"]:
            raise ValueError(f"{r['id']}: answer has no '#### <number>' line")
        gsm.append(
            {"id": r["id"], "question": r["question"],
             "answer": r["answer"].rsplit("####", 1)[1].strip()}
        )
    math_records = read_jsonl(data_dir / "math_champ.jsonl")
    held_out = math_holdout_ids(math_records)
    math = [
        {"id": r["id"], "problem": r["problem"], "solution": r["solution"]}
        for r in math_records
        if r["id"] in held_out
    ]
    sets = {"mt_bench": mt_bench, "humaneval": humaneval, "gsm": gsm, "math": math}
    for name, records in sets.items():
        if len(records) != PROMPT_COUNTS[name]:
            raise ValueError(f"{name}: {len(records)} records, expected {PROMPT_COUNTS[name]}")
    return sets


def write_prompt_records(sets: Mapping[str, list[dict]], out_dir: str | Path) -> None:
    """Writes one ``<set>.jsonl`` per prompt set (UTF-8, one record per line)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, records in sets.items():
        lines = [json.dumps(record, ensure_ascii=False) for record in records]
        (out_dir / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


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


def parse_args(argv: list[str] | None = None) -> PrepareConfig:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR))
    parser.add_argument("--out", default=str(REPO_ROOT / "runs" / "corpus"))
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json (default: bundled)")
    parser.add_argument("--retrain-tokenizer", action="store_true")
    parser.add_argument("--update-bundled", action="store_true",
                        help="retrain the tokenizer and rewrite tev_jax/data's bundled files")
    parser.add_argument("--vocab-size", type=int, default=TokenizerConfig.vocab_size)
    parser.add_argument("--include-wikipedia", action="store_true",
                        help="also train on the CC BY-SA Wikipedia passages")
    parser.add_argument("--no-stdlib", action="store_true")
    args = parser.parse_args(argv)
    return PrepareConfig(
        corpus=CorpusConfig(
            data_dir=args.data_dir,
            include_wikipedia=args.include_wikipedia,
            include_stdlib=not args.no_stdlib,
        ),
        out_dir=args.out,
        tokenizer=args.tokenizer,
        retrain_tokenizer=args.retrain_tokenizer or args.update_bundled,
        tokenizer_config=TokenizerConfig(vocab_size=args.vocab_size),
        update_bundled=args.update_bundled,
    )


def main(argv: list[str] | None = None) -> None:
    manifest = prepare_corpus(parse_args(argv))
    print(f"{'domain':8} {'split':5} {'docs':>6} {'chars':>11} {'tokens':>10} {'bytes/tok':>9}")
    for domain, splits in manifest["domains"].items():
        for split, info in splits.items():
            print(f"{domain:8} {split:5} {info['documents']:6d} {info['chars']:11,d} "
                  f"{info['tokens']:10,d} {info['bytes_per_token']:9.3f}")


if __name__ == "__main__":
    main()
