"""The offline training corpus: documents per domain and split, built from local files.

Sources (licences in ``tev_jax/data/README.md``):

| domain  | records                                                                   |
|---------|---------------------------------------------------------------------------|
| prose   | OpenWebText passages of ``prose.jsonl`` (CC0), the interpreter's Python    |
|         | language-reference topics (``pydoc_data.topics``, PSF); Wikipedia only      |
|         | with ``include_wikipedia`` (CC BY-SA 3.0, off by default)                   |
| code    | ``code_io.jsonl`` (task as a module docstring, then the code) and the       |
|         | interpreter's standard-library ``*.py`` files (PSF)                         |
| gsm     | ``gsm_train.jsonl`` as ``Question: ...\\nAnswer: ...``                      |
| math    | ``math_champ.jsonl`` minus the evaluation hold-out, ``Problem/Solution``    |
| chat    | a hashed share of the gsm, math and code_io records in the chat template    |

Every record lands in exactly one (domain, split): the validation split takes a hashed
fraction of ids, and a hashed fraction of the gsm / math / code_io records is written as
dialogue (domain ``chat``) instead of plain text, so nothing is trained on twice per
epoch. The 70-problem competition-math hold-out (``math_holdout_ids``) and the evaluation
files (``gsm_eval``, ``humaneval``, ``mt_bench``) are never read into the corpus.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import sysconfig
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from tev_jax.data.prompts import read_jsonl
from tev_jax.data.tokenizer import format_chat_turn

DOMAINS: tuple[str, ...] = ("prose", "code", "gsm", "math", "chat")
SPLITS: tuple[str, ...] = ("train", "val")
SHARED_FILES: tuple[str, ...] = (
    "prose.jsonl",
    "code_io.jsonl",
    "gsm_train.jsonl",
    "math_champ.jsonl",
    "gsm_eval.jsonl",
    "humaneval.jsonl",
    "mt_bench.jsonl",
)
MATH_HOLDOUT_SIZE = 70

# Directory names whose files never enter the corpus: test suites, generated codec tables,
# installed third-party packages and build configuration.
_STDLIB_SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
     "encodings", "pydoc_data"}
)


@dataclasses.dataclass(frozen=True)
class CorpusConfig:
    """What goes into the corpus and how it is split.

    Attributes:
      data_dir: folder holding the shared jsonl files (its README lists licences).
      include_wikipedia: also train on the CC BY-SA Wikipedia passages of prose.jsonl.
      include_stdlib: add the running interpreter's standard-library sources.
      include_python_docs: add the interpreter's language-reference topics as prose.
      val_fraction: share of ids (by hash) held out for validation, per source.
      math_val_fraction: the same for the small competition-math source.
      chat_fraction_gsm: share of gsm_train records written in the chat template.
      chat_fraction_math: share of the trainable competition-math records in chat form.
      chat_fraction_code: share of code_io records in chat form.
      max_stdlib_file_bytes: larger standard-library files (generated tables) are skipped.
    """

    data_dir: str
    include_wikipedia: bool = False
    include_stdlib: bool = True
    include_python_docs: bool = True
    val_fraction: float = 0.05
    math_val_fraction: float = 0.10
    chat_fraction_gsm: float = 0.5
    chat_fraction_math: float = 0.5
    chat_fraction_code: float = 0.25
    max_stdlib_file_bytes: int = 200_000

    def __post_init__(self):
        for name in ("val_fraction", "math_val_fraction"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in (0, 1), got {getattr(self, name)}")
        for name in ("chat_fraction_gsm", "chat_fraction_math", "chat_fraction_code"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.max_stdlib_file_bytes < 1:
            raise ValueError("max_stdlib_file_bytes must be positive")


@dataclasses.dataclass(frozen=True)
class Document:
    """One training or validation document.

    Attributes:
      id: unique id, prefixed by its source (``stdlib:json/decoder.py``).
      domain: one of ``DOMAINS``.
      source: the record's origin (``openwebtext``, ``code_io``, ``stdlib``, ...).
      split: ``train`` or ``val``.
      text: the document text; chat documents contain the chat special tokens.
    """

    id: str
    domain: str
    source: str
    split: str
    text: str


def unit_hash(salt: str, key: str) -> float:
    """A deterministic pseudo-uniform number in [0, 1) for ``key`` (SHA-256 based)."""
    digest = hashlib.sha256(f"{salt}:{key}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def _split_of(doc_id: str, val_fraction: float) -> str:
    return "val" if unit_hash("split", doc_id) < val_fraction else "train"


def _is_chat(doc_id: str, chat_fraction: float) -> bool:
    return unit_hash("chat", doc_id) < chat_fraction


def resolve_data_dir(data_dir: str | Path) -> Path:
    """Checks that ``data_dir`` holds the shared jsonl files and returns it resolved."""
    path = Path(data_dir).expanduser().resolve()
    missing = [name for name in SHARED_FILES if not (path / name).is_file()]
    if missing:
        raise ValueError(
            f"data directory {path} lacks {', '.join(missing)}; pass --data-dir pointing at "
            "a folder with the files of the repository's data/ (its README lists them)"
        )
    return path


def math_holdout_ids(records: Sequence[Mapping]) -> frozenset[str]:
    """The competition-math evaluation hold-out: 70 problems, stratified by category.

    Each category (``P_<Category>_<n>``) gives a share proportional to its size (largest
    remainder), and inside a category the problems with the smallest ``unit_hash`` are
    taken. The result depends only on the ids.
    """
    by_category: dict[str, list[str]] = {}
    for record in records:
        by_category.setdefault(record["id"].rsplit("_", 1)[0], []).append(record["id"])
    total = sum(len(ids) for ids in by_category.values())
    if total < MATH_HOLDOUT_SIZE:
        raise ValueError(f"need at least {MATH_HOLDOUT_SIZE} math problems, got {total}")
    exact = {c: MATH_HOLDOUT_SIZE * len(ids) / total for c, ids in by_category.items()}
    quota = {c: int(q) for c, q in exact.items()}
    by_remainder = sorted(exact, key=lambda c: (-(exact[c] - quota[c]), c))
    for category in by_remainder[: MATH_HOLDOUT_SIZE - sum(quota.values())]:
        quota[category] += 1
    chosen = set()
    for category, ids in by_category.items():
        ranked = sorted(ids, key=lambda i: (unit_hash("math-holdout", i), i))
        chosen.update(ranked[: quota[category]])
    return frozenset(chosen)


def stdlib_files(
    stdlib_dir: str | Path | None = None, max_bytes: int = 200_000
) -> list[tuple[str, Path]]:
    """The standard-library sources that enter the corpus, in sorted relative-path order.

    Skips test suites, generated codec tables (``encodings``), ``pydoc_data``, installed
    packages, the build ``config-*`` folder, ``_sysconfigdata*`` and files over
    ``max_bytes``.

    Returns:
      ``(relative posix path, absolute path)`` pairs.
    """
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise ValueError(f"standard-library folder not found: {root}")
    chosen = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        parts = relative.parts
        if any(part in _STDLIB_SKIP_DIRS or part.startswith("config-") for part in parts[:-1]):
            continue
        if relative.name.startswith("_sysconfigdata") or not path.is_file():
            continue
        if path.stat().st_size > max_bytes:
            continue
        chosen.append((relative.as_posix(), path))
    return sorted(chosen)


def _read_source(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None
    return text.replace("\r\n", "\n")


def _plain_gsm(record: Mapping) -> str:
    return f"Question: {record['question']}\nAnswer: {record['answer']}"


def _plain_math(record: Mapping) -> str:
    return f"Problem: {record['problem']}\nSolution: {record['solution']}"


def _plain_code(record: Mapping) -> str:
    return f'"""{record["task"]}"""\n\n{record["code"]}'


def _chat_or_plain(
    records: Iterable[Mapping], *, prefix: str, domain: str, val_fraction: float,
    chat_fraction: float, user_key: str, assistant_key: str,
    plain: Callable[[Mapping], str],
) -> list[Document]:
    documents = []
    for record in records:
        doc_id = f"{prefix}:{record['id']}"
        split = _split_of(doc_id, val_fraction)
        if _is_chat(doc_id, chat_fraction):
            text = format_chat_turn(record[user_key], record[assistant_key])
            documents.append(Document(doc_id, "chat", prefix, split, text))
        else:
            documents.append(Document(doc_id, domain, prefix, split, plain(record)))
    return documents


def build_documents(config: CorpusConfig) -> list[Document]:
    """Assembles every training and validation document (no evaluation data).

    Args:
      config: sources and split fractions; ``config.data_dir`` must hold the shared files.

    Returns:
      Documents sorted by (domain, split, id) so the output does not depend on file order.
    """
    data_dir = resolve_data_dir(config.data_dir)
    documents: list[Document] = []

    for record in read_jsonl(data_dir / "prose.jsonl"):
        if record["source"] == "wikipedia" and not config.include_wikipedia:
            continue
        doc_id = f"{record['source']}:{record['id']}"
        documents.append(
            Document(doc_id, "prose", record["source"], _split_of(doc_id, config.val_fraction),
                     record["text"])
        )
    if config.include_python_docs:
        from pydoc_data.topics import topics

        for name, text in sorted(topics.items()):
            doc_id = f"python_docs:{name}"
            documents.append(
                Document(doc_id, "prose", "python_docs", _split_of(doc_id, config.val_fraction),
                         text.strip())
            )

    documents += _chat_or_plain(
        read_jsonl(data_dir / "code_io.jsonl"), prefix="code_io", domain="code",
        val_fraction=config.val_fraction, chat_fraction=config.chat_fraction_code,
        user_key="task", assistant_key="code", plain=_plain_code,
    )
    if config.include_stdlib:
        for relative, path in stdlib_files(max_bytes=config.max_stdlib_file_bytes):
            text = _read_source(path)
            if text is None or not text.strip():
                continue
            doc_id = f"stdlib:{relative}"
            documents.append(
                Document(doc_id, "code", "stdlib", _split_of(doc_id, config.val_fraction), text)
            )

    documents += _chat_or_plain(
        read_jsonl(data_dir / "gsm_train.jsonl"), prefix="gsm", domain="gsm",
        val_fraction=config.val_fraction, chat_fraction=config.chat_fraction_gsm,
        user_key="question", assistant_key="answer", plain=_plain_gsm,
    )

    math_records = read_jsonl(data_dir / "math_champ.jsonl")
    held_out = math_holdout_ids(math_records)
    documents += _chat_or_plain(
        [r for r in math_records if r["id"] not in held_out], prefix="math", domain="math",
        val_fraction=config.math_val_fraction, chat_fraction=config.chat_fraction_math,
        user_key="problem", assistant_key="solution", plain=_plain_math,
    )

    ids = [d.id for d in documents]
    if len(set(ids)) != len(ids):
        raise ValueError("duplicate document ids in the corpus")
    return sorted(documents, key=lambda d: (DOMAINS.index(d.domain), d.split, d.id))


def tokenizer_training_texts(
    documents: Sequence[Document], max_chars_per_domain: int
) -> list[str]:
    """The tokenizer's training texts: training documents only, at most
    ``max_chars_per_domain`` characters per domain, picked in ``unit_hash`` order so the
    sample is deterministic and spread over each domain's sources."""
    if max_chars_per_domain < 1:
        raise ValueError(f"max_chars_per_domain must be >= 1, got {max_chars_per_domain}")
    texts = []
    for domain in DOMAINS:
        pool = sorted(
            (d for d in documents if d.domain == domain and d.split == "train"),
            key=lambda d: (unit_hash("tokenizer", d.id), d.id),
        )
        used = 0
        for document in pool:
            if used >= max_chars_per_domain:
                break
            texts.append(document.text)
            used += len(document.text)
    return texts


def input_hashes(config: CorpusConfig) -> dict[str, str]:
    """SHA-256 of every input: each shared file, the standard-library file list + contents
    and the language-reference topics, so a manifest pins exactly what was read."""
    data_dir = resolve_data_dir(config.data_dir)
    hashes = {
        name: hashlib.sha256((data_dir / name).read_bytes()).hexdigest() for name in SHARED_FILES
    }
    if config.include_stdlib:
        digest = hashlib.sha256()
        for relative, path in stdlib_files(max_bytes=config.max_stdlib_file_bytes):
            digest.update(relative.encode("utf-8") + b"\0")
            digest.update(hashlib.sha256(path.read_bytes()).digest())
        hashes["stdlib"] = digest.hexdigest()
    if config.include_python_docs:
        from pydoc_data.topics import topics

        hashes["python_docs"] = hashlib.sha256(
            json.dumps(topics, sort_keys=True).encode("utf-8")
        ).hexdigest()
    return hashes


def python_version() -> str:
    """The running interpreter's version, recorded because it picks the stdlib sources."""
    return ".".join(str(part) for part in sys.version_info[:3])
