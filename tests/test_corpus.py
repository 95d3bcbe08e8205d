"""The training corpus (train.demo.corpus, train.demo.token_corpus, train.demo.prepare_corpus): documents
and splits, token arrays on disk, training windows, the exported prompt files."""

import json
from pathlib import Path

import numpy as np
import pytest

from tev_jax.data import prompts, tokenizer
from tev_jax.data.tokenizer import format_chat
from train.demo import corpus, prepare_corpus, token_corpus
from train.demo.corpus import CorpusConfig
from train.demo.token_corpus import WindowConfig, train_batch, validation_windows

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT / "data"  # the source data, in the repository (issue 47, item 6)


@pytest.fixture(scope="module")
def bundled():
    return tokenizer.load_default_tokenizer()


# --- corpus documents and splits ---------------------------------------------------------


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture()
def fake_data_dir(tmp_path):
    """A tiny stand-in for the shared data folder with every expected file."""
    _write_jsonl(tmp_path / "prose.jsonl", [
        {"id": f"owt_{i:04d}", "source": "openwebtext", "text": f"Open text {i}."} for i in range(40)
    ] + [
        {"id": f"wiki_{i:04d}", "source": "wikipedia", "text": f"Wiki text {i}."} for i in range(40)
    ])
    _write_jsonl(tmp_path / "code_io.jsonl", [
        {"id": f"codeio_hq_{i:04d}", "task": f"Task {i}", "code": f"def main_solution():\n    return {i}\n"}
        for i in range(60)
    ])
    _write_jsonl(tmp_path / "gsm_train.jsonl", [
        {"id": f"gsm_train_{i:04d}", "question": f"What is {i}+1?", "answer": f"{i}+1={i + 1}\n#### {i + 1}",
         "generator": "generate_0"} for i in range(80)
    ])
    _write_jsonl(tmp_path / "gsm_eval.jsonl", [
        {"id": f"gsm_eval_{i:04d}", "question": f"Eval {i}?", "answer": f"#### {i}", "generator": "g"}
        for i in range(128)
    ])
    categories = {"Number-Theory": 80, "Inequality": 50, "Polynomial": 50, "Sequence": 50,
                  "Combinatorics": 40}
    _write_jsonl(tmp_path / "math_champ.jsonl", [
        {"id": f"P_{c}_{i}", "problem": f"{c} problem {i}", "solution": f"Answer {i}."}
        for c, n in categories.items() for i in range(1, n + 1)
    ])
    _write_jsonl(tmp_path / "humaneval.jsonl", [
        {"id": f"HumanEval/{i}", "prompt": f"def f{i}():\n", "canonical_solution": "    pass\n",
         "entry_point": f"f{i}"} for i in range(164)
    ])
    _write_jsonl(tmp_path / "mt_bench.jsonl", [
        {"id": 81 + i, "category": "writing", "turns": [f"Write {i}.", "Again."]} for i in range(80)
    ])
    return tmp_path


def _fake_config(data_dir, **kwargs):
    return CorpusConfig(data_dir=str(data_dir), include_stdlib=False, include_python_docs=False,
                        val_fraction=0.2, math_val_fraction=0.2, **kwargs)


def test_documents_splits_are_disjoint_and_complete(fake_data_dir):
    documents = corpus.build_documents(_fake_config(fake_data_dir))
    ids = [d.id for d in documents]
    assert len(ids) == len(set(ids))
    train = {d.id for d in documents if d.split == "train"}
    val = {d.id for d in documents if d.split == "val"}
    assert train and val and not train & val
    assert {d.domain for d in documents} == set(corpus.DOMAINS)
    for domain in corpus.DOMAINS:
        assert {d.split for d in documents if d.domain == domain} == {"train", "val"}
    # 40 openwebtext + 60 code + 80 gsm + (270 - 70) math; Wikipedia and eval files absent.
    assert len(documents) == 40 + 60 + 80 + 200
    assert not any("wiki" in d.id or "eval" in d.id for d in documents)
    chat = [d for d in documents if d.domain == "chat"]
    assert chat and all(d.text.startswith("<|user|>\n") and d.text.endswith("<|end|>") for d in chat)
    assert not any("<|" in d.text for d in documents if d.domain != "chat")


def test_documents_are_deterministic_and_wikipedia_is_opt_in(fake_data_dir):
    config = _fake_config(fake_data_dir)
    assert corpus.build_documents(config) == corpus.build_documents(config)
    with_wiki = corpus.build_documents(_fake_config(fake_data_dir, include_wikipedia=True))
    assert sum(d.source == "wikipedia" for d in with_wiki) == 40


def test_math_holdout_is_stratified_and_never_trained(fake_data_dir):
    records = prompts.read_jsonl(fake_data_dir / "math_champ.jsonl")
    held_out = corpus.math_holdout_ids(records)
    assert len(held_out) == 70
    counts = {}
    for problem_id in held_out:
        category = problem_id.rsplit("_", 1)[0]
        counts[category] = counts.get(category, 0) + 1
    assert counts == {"P_Number-Theory": 21, "P_Inequality": 13, "P_Polynomial": 13,
                      "P_Sequence": 13, "P_Combinatorics": 10}
    documents = corpus.build_documents(_fake_config(fake_data_dir))
    assert not {f"math:{i}" for i in held_out} & {d.id for d in documents}
    exported = prepare_corpus.export_prompt_records(fake_data_dir)
    assert {r["id"] for r in exported["math"]} == held_out


def test_missing_data_dir_raises(tmp_path):
    with pytest.raises(ValueError, match="--data-dir"):
        corpus.build_documents(CorpusConfig(data_dir=str(tmp_path / "nowhere")))
    with pytest.raises(ValueError, match="val_fraction"):
        CorpusConfig(data_dir=".", val_fraction=0.0)


def test_stdlib_selection_skips_tests_and_generated_files():
    files = corpus.stdlib_files()
    paths = [relative for relative, _ in files]
    assert paths == sorted(paths) and len(paths) > 300
    assert "json/decoder.py" in paths
    assert not any(part in ("test", "tests", "idle_test", "encodings", "site-packages")
                   for p in paths for part in p.split("/")[:-1])
    assert all(path.stat().st_size <= 200_000 for _, path in files)


def test_real_corpus_splits_and_holdout():
    documents = corpus.build_documents(
        CorpusConfig(data_dir=str(SHARED_DATA), include_stdlib=False)
    )
    train = {d.id for d in documents if d.split == "train"}
    val = {d.id for d in documents if d.split == "val"}
    assert not train & val
    assert len(val) > 0.03 * len(documents)
    math_eval = {f"math:{r['id']}" for r in prompts.prompt_records("math")}
    assert len(math_eval) == 70 and not math_eval & (train | val)
    assert not any(d.source == "wikipedia" for d in documents)
    texts = {d.text for d in documents}
    assert not any(format_chat(r["question"]) in t for r in prompts.prompt_records("gsm")[:20]
                   for t in texts)


# --- tokenised corpus and windows --------------------------------------------------------


def _synthetic_streams() -> dict[str, np.ndarray]:
    """Domains with disjoint token ranges so a window's domain can be read off its ids."""
    return {
        "a": (1000 + np.arange(5_000)).astype(np.uint16),
        "b": (10_000 + np.arange(1_200)).astype(np.uint16),
        "c": (20_000 + np.arange(700)).astype(np.uint16),
    }


def _domain_of(window: np.ndarray) -> str:
    return "abc"[int(window[0]) // 10_000]


def test_train_batch_is_a_pure_function_of_seed_and_step():
    streams = _synthetic_streams()
    config = WindowConfig(batch_size=8, seq_len=16, seed=3)
    first = train_batch(streams, config, 5)
    assert first.shape == (8, 16) and first.dtype == np.int32
    train_batch(streams, config, 9)
    np.testing.assert_array_equal(first, train_batch(streams, config, 5))
    assert not np.array_equal(first, train_batch(streams, config, 6))
    assert not np.array_equal(first, train_batch(streams, WindowConfig(8, 16, seed=4), 5))
    for window in first:  # contiguous slices of one stream
        assert np.all(np.diff(window) == 1)


def test_proportional_epoch_visits_every_window_once():
    streams = _synthetic_streams()
    config = WindowConfig(batch_size=7, seq_len=32, seed=0)
    per_domain = {name: (len(s) - 32) // 32 for name, s in streams.items()}
    epoch = sum(per_domain.values())
    steps = -(-2 * epoch // 7)
    rows = np.concatenate([train_batch(streams, config, k) for k in range(steps)])
    first_epoch, second_epoch = rows[:epoch], rows[epoch:2 * epoch]
    assert len({tuple(r) for r in first_epoch}) == epoch
    for name, count in per_domain.items():
        assert sum(_domain_of(r) == name for r in first_epoch) == count
    # The second epoch cuts the streams at another offset.
    assert {tuple(r) for r in first_epoch} != {tuple(r) for r in second_epoch}


def test_weighted_mixture_follows_weights():
    streams = _synthetic_streams()
    config = WindowConfig(batch_size=64, seq_len=16, seed=1,
                          weights=(("a", 0.5), ("b", 0.5), ("c", 0.0)))
    rows = np.concatenate([train_batch(streams, config, k) for k in range(10)])
    domains = [_domain_of(r) for r in rows]
    assert "c" not in domains
    assert abs(domains.count("a") / len(domains) - 0.5) < 0.1


def test_mixture_weights():
    weights = dict(token_corpus.mixture_weights(_synthetic_streams(), alpha=0.5))
    assert abs(sum(weights.values()) - 1) < 1e-12
    assert weights["a"] > weights["b"] > weights["c"]
    uniform = dict(token_corpus.mixture_weights(_synthetic_streams(), alpha=0.0))
    assert all(abs(w - 1 / 3) < 1e-12 for w in uniform.values())


def test_window_inputs_are_validated():
    streams = _synthetic_streams()
    with pytest.raises(ValueError, match="seq_len"):
        WindowConfig(batch_size=2, seq_len=1)
    with pytest.raises(ValueError, match="unknown domains"):
        train_batch(streams, WindowConfig(2, 8, weights=(("zzz", 1.0),)), 0)
    with pytest.raises(ValueError, match="step"):
        train_batch(streams, WindowConfig(2, 8), -1)
    with pytest.raises(ValueError, match="2 \\* seq_len"):
        train_batch({"a": np.arange(10, dtype=np.uint16)}, WindowConfig(2, 8), 0)


def test_write_and_load_token_corpus(tmp_path, fake_data_dir, bundled):
    documents = corpus.build_documents(_fake_config(fake_data_dir))
    manifest = token_corpus.write_token_corpus(tmp_path / "corpus", bundled, documents)
    loaded = token_corpus.load_token_corpus(tmp_path / "corpus", bundled)
    assert set(loaded.train) == set(loaded.val) == set(corpus.DOMAINS)
    for domain in corpus.DOMAINS:
        stream = loaded.train[domain]
        assert stream.dtype == np.uint16 and stream[0] == tokenizer.BOS_ID
        assert stream[-1] == tokenizer.EOS_ID
        info = manifest["domains"][domain]["train"]
        assert info["tokens"] == stream.shape[0]
        assert (stream == tokenizer.BOS_ID).sum() == info["documents"]
    chat = bundled.decode(loaded.train["chat"][:200].tolist(), skip_special_tokens=False)
    assert chat.startswith("<|bos|><|user|>\n")
    splits = json.loads((tmp_path / "corpus" / "splits.json").read_text())
    for domain in corpus.DOMAINS:
        assert not set(splits["train"][domain]) & set(splits["val"][domain])
    other = tokenizer.train_tokenizer(["abc abd abe"] * 5, tokenizer.TokenizerConfig(vocab_size=300))
    with pytest.raises(ValueError, match="different tokenizer"):
        token_corpus.load_token_corpus(tmp_path / "corpus", other)
    with pytest.raises(ValueError, match="prepare_corpus"):
        token_corpus.load_token_corpus(tmp_path / "empty")


def test_validation_windows():
    stream = np.arange(100, dtype=np.uint16)
    windows = validation_windows(stream, 16)
    assert windows.shape == (6, 16) and windows.dtype == np.int32
    np.testing.assert_array_equal(windows.reshape(-1), np.arange(96))
    assert validation_windows(stream, 16, max_windows=2).tolist() == [
        list(range(16)), list(range(80, 96))
    ]
    with pytest.raises(ValueError, match="shorter"):
        validation_windows(stream, 200)


def test_bundled_prompts_match_shared_data():
    exported = prepare_corpus.export_prompt_records(SHARED_DATA)
    for name in prompts.PROMPT_SETS:
        assert exported[name] == prompts.prompt_records(name)


def test_the_source_data_is_in_the_repository():
    """Issue 47, item 6: the bundle's source data is in data/ of a clone, with its
    licences."""
    assert prepare_corpus.DEFAULT_DATA_DIR == corpus.resolve_data_dir(
        prepare_corpus.DEFAULT_DATA_DIR)
    readme = (prepare_corpus.DEFAULT_DATA_DIR / "README.md").read_text()
    for name in corpus.SHARED_FILES:
        assert f"{name}" in readme
