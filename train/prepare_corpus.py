"""Builds the offline corpus: token arrays, manifest and evaluation prompts.

    python -m train.prepare_corpus                    # encode with the bundled tokenizer
    python -m train.prepare_corpus --update-bundled   # everything: retrain the tokenizer,
                                                      # re-export the bundled prompt files

Reads the shared data folder at run time (``--data-dir``, default ``../shared/data``
relative to the repository root) and the running interpreter's standard library; writes
to ``runs/corpus/`` (gitignored). See ``tev_jax/data/README.md``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tev_jax.data.corpus import CorpusConfig
from tev_jax.data.prepare import PrepareConfig, prepare_corpus
from tev_jax.data.tokenizer import TokenizerConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA_DIR = REPO_ROOT.parent / "shared" / "data"


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
