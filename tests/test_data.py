"""Tokenizer and prompt sets (tev_jax.data); the corpus is tests/test_corpus.py."""

import sysconfig
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tev_jax.data import prompts, tokenizer
from tev_jax.data.tokenizer import SPECIAL_TOKENS, format_chat, format_chat_turn

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bundled():
    return tokenizer.load_default_tokenizer()


def _domain_samples() -> dict[str, str]:
    """Real text of every domain from what ships with the package and the interpreter."""
    stdlib = Path(sysconfig.get_paths()["stdlib"]) / "json" / "decoder.py"
    return {
        "prose": prompts.prompt_records("mt_bench")[0]["turn"],
        "code": prompts.prompt_records("humaneval")[0]["prompt"] + stdlib.read_text()[:3000],
        "gsm": prompts.prompt_records("gsm")[0]["question"],
        "math": prompts.prompt_records("math")[0]["problem"]
        + prompts.prompt_records("math")[0]["solution"],
        "chat": format_chat_turn("Add 2 and 3.", "2 + 3 = 5\n#### 5"),
        "unicode": "naïve café — ∑ x² ≤ 10⁶, 日本語, emoji 😀\t\r\n  trailing  ",
    }


# --- tokenizer ---------------------------------------------------------------------------


def test_bundled_special_tokens_have_documented_ids(bundled):
    assert bundled.get_vocab_size() == 4096
    expected = {
        "<|pad|>": 0, "<|bos|>": 1, "<|eos|>": 2, "<|mask|>": 3,
        "<|user|>": 4, "<|assistant|>": 5, "<|end|>": 6,
    }
    assert dict(zip(SPECIAL_TOKENS, range(7))) == expected
    for token, token_id in expected.items():
        assert bundled.token_to_id(token) == token_id
        assert bundled.encode(token, add_special_tokens=False).ids == [token_id]
    assert (tokenizer.PAD_ID, tokenizer.BOS_ID, tokenizer.EOS_ID, tokenizer.MASK_ID) == (0, 1, 2, 3)
    assert (tokenizer.USER_ID, tokenizer.ASSISTANT_ID, tokenizer.END_ID) == (4, 5, 6)
    assert tokenizer.STOP_IDS == (6, 2)


@pytest.mark.parametrize("domain", list(_domain_samples()))
def test_bundled_round_trip_per_domain(bundled, domain):
    text = _domain_samples()[domain]
    ids = bundled.encode(text, add_special_tokens=False).ids
    assert bundled.decode(ids, skip_special_tokens=False) == text
    assert len(ids) < len(text.encode("utf-8"))  # it compresses


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200))
def test_bundled_round_trip_any_text(bundled, text):
    assume(not any(special in text for special in SPECIAL_TOKENS))
    assert bundled.decode(bundled.encode(text, add_special_tokens=False).ids) == text


def test_encode_prepends_bos_only(bundled):
    ids = bundled.encode("def f(x):").ids
    assert ids[0] == tokenizer.BOS_ID and tokenizer.BOS_ID not in ids[1:]
    assert tokenizer.EOS_ID not in ids


def test_digits_are_single_tokens(bundled):
    assert bundled.encode("12345", add_special_tokens=False).tokens == list("12345")


def test_chat_template(bundled):
    prompt = format_chat("What is 2+3?")
    assert prompt == "<|user|>\nWhat is 2+3?<|end|>\n<|assistant|>\n"
    assert format_chat_turn("hi", "hello") == prompt.replace("What is 2+3?", "hi") + "hello<|end|>"
    ids = bundled.encode(prompt).ids
    assert ids[:2] == [tokenizer.BOS_ID, tokenizer.USER_ID]
    assert ids[-2] == tokenizer.ASSISTANT_ID and bundled.decode(ids[-1:]) == "\n"
    assert bundled.decode(ids, skip_special_tokens=False) == "<|bos|>" + prompt
    with pytest.raises(ValueError, match="user_text"):
        format_chat("")
    with pytest.raises(ValueError, match="assistant_text"):
        format_chat_turn("hi", "")


def test_train_tokenizer_is_deterministic_and_round_trips():
    texts = [f"def f{i}(x):\n    return x * {i} + 1\n" for i in range(50)]
    texts += ["The quick brown fox jumps over the lazy dog. " * 3] * 20
    texts += [format_chat_turn("What is 3+4?", "3 + 4 = 7")] * 10
    config = tokenizer.TokenizerConfig(vocab_size=300, max_chars_per_domain=10_000)
    first = tokenizer.train_tokenizer(texts, config)
    second = tokenizer.train_tokenizer(texts, config)
    assert tokenizer.tokenizer_sha256(first) == tokenizer.tokenizer_sha256(second)
    tokenizer.check_special_tokens(first)
    assert first.get_vocab_size() == 300
    assert not any("<|" in token and token not in SPECIAL_TOKENS for token in first.get_vocab())
    for text in texts[::7]:
        assert first.decode(first.encode(text).ids, skip_special_tokens=False) == "<|bos|>" + text


def test_bad_tokenizer_inputs_raise(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        tokenizer.TokenizerConfig(vocab_size=100)
    with pytest.raises(ValueError, match="not found"):
        tokenizer.load_tokenizer(tmp_path / "missing.json")
    broken = tokenizer._untrained_tokenizer()
    broken.add_special_tokens(["<|bos|>"])
    with pytest.raises(ValueError, match="special token"):
        tokenizer.check_special_tokens(broken)


# --- evaluation prompt sets --------------------------------------------------------------


@pytest.mark.parametrize("name", prompts.PROMPT_SETS)
def test_prompt_sets(name, bundled):
    texts = prompts.prompt_set(name)
    assert len(texts) == prompts.PROMPT_COUNTS[name] == len(prompts.prompt_records(name))
    assert all(isinstance(t, str) and t for t in texts)
    if name == "humaneval":
        assert texts[0].startswith("from typing import List") and "<|" not in "".join(texts)
    else:
        assert all(t.startswith("<|user|>\n") and t.endswith("<|assistant|>\n") for t in texts)
    assert max(len(bundled.encode(t).ids) for t in texts) < 1024


def test_prompt_expected_counts_and_unknown_name():
    assert dict(prompts.PROMPT_COUNTS) == {"mt_bench": 80, "humaneval": 164, "gsm": 128, "math": 70}
    with pytest.raises(ValueError, match="unknown prompt set"):
        prompts.prompt_set("mmlu")


def test_bundled_files_stay_small():
    data = REPO_ROOT / "tev_jax" / "data"
    assert sum(p.stat().st_size for p in (data / "prompts").glob("*.jsonl")) < 300_000
    assert (data / "tokenizer.json").stat().st_size < 200_000
