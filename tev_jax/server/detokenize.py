"""A completion's text as its tokens come, and where stop strings cut it.

`IncrementalText` decodes each round's new tokens with the few before them as context
(as Hugging Face's text-generation servers do), instead of the whole completion every
round: a round's cost no longer grows with the completion. A character whose UTF-8
bytes are not all generated yet waits for its last byte.

`visible` is what a request's stream may show after a round: the text up to its first
stop string, without an end that could still become one (`held_back`); `tokens_for`
is how many tokens that text took, so that usage and token ids end where the text does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tev_jax.server.requests import held_back, stop_at

Decode = Callable[[list[int]], str]
INCOMPLETE = "\ufffd"  # what the tokenizer writes for bytes that are not a whole character


class IncrementalText:
    """The text of a growing list of tokens (each call's tokens extend the previous
    call's), decoded a window at a time.

    ``prefix:read`` are tokens already in the text, kept as context for the next ones;
    the text grows only by whole characters; `read` tokens are all in it.
    """

    def __init__(self, decode: Decode):
        self.decode = decode
        self.text = ""
        self._prefix = self._read = 0

    @property
    def read(self) -> int:
        """How many leading tokens have all their text in `text`."""
        return self._read

    def update(self, tokens: Sequence[int]) -> str:
        """The text of ``tokens`` so far, without a last character whose bytes are not
        all there (the window's whole characters before it are in)."""
        tokens = list(tokens)
        before = self.decode(tokens[self._prefix:self._read])
        now = self.decode(tokens[self._prefix:])
        if len(now) <= len(before):
            return self.text
        if not now.endswith(INCOMPLETE):
            self.text += now[len(before):]
            self._prefix, self._read = self._read, len(tokens)
            return self.text
        return self.text + now[len(before):].rstrip(INCOMPLETE)

    def final(self, tokens: Sequence[int]) -> str:
        """The whole text of ``tokens``, a last incomplete character included (as the
        tokenizer decodes it)."""
        tokens = list(tokens)
        self.update(tokens)
        before = self.decode(tokens[self._prefix:self._read])
        return self.text + self.decode(tokens[self._prefix:])[len(before):]


def visible(text: IncrementalText, tokens: Sequence[int], stops: Sequence[str],
            final: bool) -> tuple[str, bool]:
    """(the text that may be shown now, whether a stop string ended it). An end that
    could be the start of a stop string is held back until the text is final."""
    full = text.final(tokens) if final else text.update(tokens)
    cut = stop_at(full, stops)
    if cut is not None:
        return full[:cut], True
    if final:
        return full, False
    return full[: len(full) - held_back(full, stops)], False


def tokens_for(chars: int, tokens: Sequence[int], decode: Decode) -> int:
    """The fewest leading tokens whose text has at least ``chars`` characters (all of
    them if none has): where a completion cut by a stop string ends."""
    lo, hi = 0, len(tokens)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(list(tokens[:mid])).rstrip(INCOMPLETE)) >= chars:
            hi = mid
        else:
            lo = mid + 1
    return lo


def next_text(tokens: Sequence[int], decode: Decode, stops: Sequence[str],
              final: bool) -> tuple[str, bool]:
    """`visible` of a whole token list at once (no earlier rounds)."""
    return visible(IncrementalText(decode), tokens, stops, final)


__all__ = ["IncrementalText", "next_text", "tokens_for", "visible"]
