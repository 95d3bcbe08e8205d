"""Trains the byte-level BPE tokenizer on the training split of the offline corpus.

    python -m train.demo.train_tokenizer                  # rewrites tev_jax/data/tokenizer.json
    python -m train.demo.train_tokenizer --out /tmp/tokenizer.json --vocab-size 8192

Deterministic: the same data and interpreter give a byte-identical file.
"""

from __future__ import annotations

import argparse
import time

from tev_jax.data.tokenizer import TokenizerConfig, default_tokenizer_path, train_tokenizer
from train.demo.corpus import CorpusConfig, build_documents, tokenizer_training_texts
from train.demo.prepare_corpus import DEFAULT_DATA_DIR


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR))
    parser.add_argument("--out", default=str(default_tokenizer_path()))
    parser.add_argument("--vocab-size", type=int, default=TokenizerConfig.vocab_size)
    parser.add_argument("--include-wikipedia", action="store_true")
    args = parser.parse_args(argv)
    config = TokenizerConfig(vocab_size=args.vocab_size)
    start = time.perf_counter()
    documents = build_documents(
        CorpusConfig(data_dir=args.data_dir, include_wikipedia=args.include_wikipedia)
    )
    texts = tokenizer_training_texts(documents, config.max_chars_per_domain)
    tokenizer = train_tokenizer(texts, config)
    tokenizer.save(args.out, pretty=False)
    print(f"V={tokenizer.get_vocab_size()} from {sum(map(len, texts)):,} chars "
          f"in {time.perf_counter() - start:.1f} s -> {args.out}")


if __name__ == "__main__":
    main()
