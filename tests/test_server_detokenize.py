"""The server's text as tokens come (issue 57, items 10 and 12): incremental decoding
equals decoding the whole completion at every step, and a stop string ends the usage and
the token ids where it ends the text."""

import numpy as np
import pytest

from tev_jax.server.detokenize import IncrementalText, next_text, tokens_for, visible

TEXTS = ["héllo wörld 😀 日本語 café", "def f(x):\n    return x ** 2  # ∑ ≤ ∞",
         "plain ascii text, nothing more", "🙂🙃 emoji only 👍🏽 and a flag 🇫🇷"]


@pytest.fixture(scope="module")
def tokenizer():
    from tev_jax.models import load_tokenizer
    from tev_jax.models.bundled import bundled_paths

    return load_tokenizer(bundled_paths().target)


def _decode(tokenizer):
    calls = []

    def decode(ids):
        calls.append(len(ids))
        return tokenizer.decode(ids)

    return decode, calls


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_the_whole_decode_at_every_step(tokenizer, text):
    """After each token, the text so far is the whole decode without a last character
    whose bytes are incomplete, and the final text is exactly the whole decode."""
    ids = tokenizer.encode(text).ids
    decode, _ = _decode(tokenizer)
    inc = IncrementalText(decode)
    for i in range(1, len(ids) + 1):
        whole = tokenizer.decode(ids[:i])
        assert inc.update(ids[:i]) == whole.rstrip("\ufffd"), i
        assert inc.read <= i
        assert IncrementalText(decode).final(ids[:i]) == whole
    assert inc.final(ids) == tokenizer.decode(ids) == text


def test_random_tokens_decode_the_same_as_whole(tokenizer):
    """Arbitrary token ids (bytes that are not UTF-8 included): the final text is always
    the whole decode, and every step's text is a prefix of it."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = rng.integers(0, tokenizer.get_vocab_size(), 40).tolist()
        inc = IncrementalText(tokenizer.decode)
        for i in range(1, len(ids) + 1):
            assert tokenizer.decode(ids[:i]).startswith(inc.update(ids[:i]))
        assert inc.final(ids) == tokenizer.decode(ids)


def test_each_round_decodes_only_its_new_tokens(tokenizer):
    """A 400-token completion, one token a round: the tokens decoded per round stay
    bounded (the window), where decoding the whole completion grows with it. Negative
    control: `next_text` (everything at once) decodes all of them."""
    ids = tokenizer.encode(" ".join(TEXTS) * 6).ids[:400]
    decode, calls = _decode(tokenizer)
    inc = IncrementalText(decode)
    for i in range(1, len(ids) + 1):
        calls.clear()
        visible(inc, ids[:i], ["never there"], final=False)
        assert sum(calls) <= 24, (i, calls)
    calls.clear()
    next_text(ids, decode, [], final=False)
    assert sum(calls) >= len(ids)


def test_a_stop_string_ends_the_tokens_where_it_ends_the_text(tokenizer):
    text = "the answer is 42. Then more text follows here."
    ids = tokenizer.encode(text).ids
    shown, hit = next_text(ids, tokenizer.decode, [". Then"], final=False)
    assert (shown, hit) == ("the answer is 42", True)
    n = tokens_for(len(shown), ids, tokenizer.decode)
    assert tokenizer.decode(ids[:n]).startswith(shown)
    assert not tokenizer.decode(ids[:n - 1]).startswith(shown)  # the fewest
    assert n < len(ids)
    assert tokens_for(len(text) + 5, ids, tokenizer.decode) == len(ids)  # never more
