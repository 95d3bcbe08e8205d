"""Training prompts for the demo drafter's rollouts, drawn from the corpus' train split.

The target answers these prompts and the drafter learns from the answers, so they must
look like the evaluation prompts without being them (the evaluation sets never enter
the corpus, see ``tev_jax/data/prompts.py``):

* chat documents (code / GSM / competition-math questions in the chat template): the
  user turn up to and including ``<|assistant|>\\n``, like the chat evaluation sets;
* code: a few lines that end at a ``def`` or ``class`` line of a training file, like a
  HumanEval signature (the target writes the body);
* GSM and math in plain form: the question up to and including ``Answer:`` /
  ``Solution:``;
* prose: the document's first sentences.

    python -m train.demo.prompts --out runs/prompts.jsonl --count 3000
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np

from tev_jax.data.tokenizer import ASSISTANT
from train.demo.corpus import CorpusConfig, build_documents

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATA_DIR = REPO_ROOT / "data"
_DEF_LINE = re.compile(r"^[ \t]*(def|class) \w+", re.MULTILINE)
_ANSWER_MARKERS = ("\nAnswer:", "\nSolution:")


def chat_prompt(text: str) -> str | None:
    """The user turn of a chat document, ending with the assistant marker."""
    cut = text.find(ASSISTANT)
    return None if cut < 0 else text[: cut + len(ASSISTANT)] + "\n"


def code_prompt(text: str, rng: np.random.Generator, context_lines: int = 6) -> str | None:
    """Up to ``context_lines`` lines before a random ``def``/``class`` line, and that line."""
    starts = [m.start() for m in _DEF_LINE.finditer(text)]
    if not starts:
        return None
    at = starts[rng.integers(len(starts))]
    line_end = text.find("\n", at)
    line_end = len(text) if line_end < 0 else line_end + 1
    before = text[:at].splitlines(keepends=True)[-context_lines:]
    return "".join(before) + text[at:line_end]


def question_prompt(text: str) -> str | None:
    """A plain question document up to and including its answer marker."""
    cuts = [text.find(m) for m in _ANSWER_MARKERS if m in text]
    return None if not cuts else text[: min(cuts)] + text[min(cuts):].split(":", 1)[0] + ": "


def prose_prompt(text: str, max_chars: int = 240) -> str:
    """The document's opening, cut after the last sentence end within ``max_chars``."""
    head = text[:max_chars]
    cut = max(head.rfind(". "), head.rfind("\n"))
    return head[: cut + 1] if cut > 40 else head


def training_prompts(corpus: CorpusConfig, count: int, seed: int = 0) -> list[dict]:
    """``count`` prompts, domains taking turns, documents drawn without replacement.

    Args:
      corpus: the corpus whose train split is used (the one the target learnt from).
      count: number of prompts.
      seed: document order and code cut points.

    Returns:
      Records ``{"prompt": str, "domain": str, "doc": document id}``.
    """
    rng = np.random.default_rng(seed)
    by_domain: dict[str, list] = {}
    for doc in build_documents(corpus):
        if doc.split == "train":
            by_domain.setdefault(doc.domain, []).append(doc)
    queues = {d: list(rng.permutation(len(docs))) for d, docs in sorted(by_domain.items())}
    out: list[dict] = []
    while len(out) < count and any(queues.values()):
        for domain, queue in queues.items():
            if not queue or len(out) >= count:
                continue
            doc = by_domain[domain][queue.pop()]
            if domain == "chat":
                prompt = chat_prompt(doc.text)
            elif domain == "code":
                prompt = code_prompt(doc.text, rng)
            elif domain in ("gsm", "math"):
                prompt = question_prompt(doc.text)
            else:
                prompt = prose_prompt(doc.text)
            if prompt and prompt.strip():
                out.append({"prompt": prompt, "domain": domain, "doc": doc.id})
    if len(out) < count:
        raise ValueError(f"the corpus gives only {len(out)} prompts, {count} were asked for")
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR))
    p.add_argument("--out", default="runs/prompts.jsonl")
    p.add_argument("--count", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    records = training_prompts(CorpusConfig(data_dir=args.data_dir), args.count, args.seed)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in records))
    counts = {d: sum(r["domain"] == d for r in records) for d in sorted({r["domain"] for r in records})}
    print(f"wrote {len(records)} prompts to {args.out}: {counts}")


if __name__ == "__main__":
    main()
