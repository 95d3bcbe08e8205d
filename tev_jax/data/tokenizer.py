"""The bundled byte-level BPE tokenizer, its special tokens and the chat template.

Special tokens have fixed ids at the start of the vocabulary:

| id | token             | use                                                   |
|----|-------------------|-------------------------------------------------------|
| 0  | ``<|pad|>``       | padding (never trained on)                            |
| 1  | ``<|bos|>``       | start of every document; added by ``encode``          |
| 2  | ``<|eos|>``       | end of every training document                        |
| 3  | ``<|mask|>``      | the DFlash drafter's MASK input token                 |
| 4  | ``<|user|>``      | chat: starts a user turn                              |
| 5  | ``<|assistant|>`` | chat: starts an assistant turn                        |
| 6  | ``<|end|>``       | chat: ends a turn                                     |

Chat template (one user turn; the model continues after the last newline)::

    <|user|>\\n{user_text}<|end|>\\n<|assistant|>\\n

There is no system token: a system prompt opens the user turn (`format_chat`).

and a training dialogue is that prompt, the answer, then ``<|end|>``. ``encode`` (with
the default ``add_special_tokens=True``) prepends ``<|bos|>``; nothing appends
``<|eos|>``. Generation stops at ``<|end|>`` or ``<|eos|>`` (``STOP_IDS``).

Pre-tokenisation follows the Qwen2 / Llama-3 regex (single digits, so arithmetic sees
one token per digit), then GPT-2 byte-level mapping with no normaliser, so
``decode(encode(x, add_special_tokens=False).ids) == x`` for every string that does not
contain a special-token string.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Iterator
from importlib import resources
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

PAD, BOS, EOS, MASK = "<|pad|>", "<|bos|>", "<|eos|>", "<|mask|>"
USER, ASSISTANT, END = "<|user|>", "<|assistant|>", "<|end|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, MASK, USER, ASSISTANT, END)
PAD_ID, BOS_ID, EOS_ID, MASK_ID, USER_ID, ASSISTANT_ID, END_ID = range(len(SPECIAL_TOKENS))
STOP_IDS: tuple[int, ...] = (END_ID, EOS_ID)

DEFAULT_TOKENIZER_FILE = "tokenizer.json"

# Qwen2's split pattern: contractions, letter runs with one leading non-letter, single
# digits, punctuation runs, newline runs, and whitespace that is not followed by a word.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
    """How the bundled tokenizer is trained.

    Attributes:
      vocab_size: V including the 256 byte tokens and the special tokens.
      min_frequency: a pair must occur this often to be merged.
      max_chars_per_domain: cap on the training text taken from each domain, so the
        large code domain does not decide most merges.
    """

    vocab_size: int = 4096
    min_frequency: int = 2
    max_chars_per_domain: int = 2_000_000

    def __post_init__(self):
        minimum = 256 + len(SPECIAL_TOKENS)
        if not minimum < self.vocab_size <= 65536:
            raise ValueError(f"vocab_size must be in ({minimum}, 65536], got {self.vocab_size}")
        if self.min_frequency < 1:
            raise ValueError(f"min_frequency must be >= 1, got {self.min_frequency}")
        if self.max_chars_per_domain < 1:
            raise ValueError(
                f"max_chars_per_domain must be >= 1, got {self.max_chars_per_domain}"
            )


def format_chat(user_text: str, system: str | None = None) -> str:
    """The chat prompt for one user turn; the model's answer follows it.

    Args:
      user_text: the user's message (non-empty).
      system: the system (or developer) messages' text, or None. The tokenizer has no
        system token (its special tokens are the table above: adding one would change V
        and the trained models), so, as templates of models without a system role do
        (Gemma's), the system text opens the user turn, a blank line before the user's
        text: ``"<|user|>\\n{system}\\n\\n{user_text}<|end|>\\n<|assistant|>\\n"``, in
        the markers the models were trained on. Without it the prompt is exactly the
        one-turn prompt below (the bundled drafters were trained on it).

    Returns:
      ``"<|user|>\\n{user_text}<|end|>\\n<|assistant|>\\n"`` (no BOS: ``encode`` adds it).
    """
    if not isinstance(user_text, str) or not user_text:
        raise ValueError("user_text must be a non-empty string")
    if system is not None and not isinstance(system, str):
        raise ValueError("system must be a string or None")
    if system:
        user_text = f"{system}\n\n{user_text}"
    return f"{USER}\n{user_text}{END}\n{ASSISTANT}\n"


def format_chat_turn(user_text: str, assistant_text: str) -> str:
    """A whole training dialogue: the chat prompt, the answer and ``<|end|>``."""
    if not isinstance(assistant_text, str) or not assistant_text:
        raise ValueError("assistant_text must be a non-empty string")
    return f"{format_chat(user_text)}{assistant_text}{END}"


def _untrained_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _without_special_strings(texts: Iterable[str]) -> Iterator[str]:
    """Splits texts at special-token strings so no merge spans or includes them."""
    for text in texts:
        pieces = [text]
        for special in SPECIAL_TOKENS:
            pieces = [part for piece in pieces for part in piece.split(special)]
        yield from (piece for piece in pieces if piece)


def train_tokenizer(texts: Iterable[str], config: TokenizerConfig = TokenizerConfig()) -> Tokenizer:
    """Trains the byte-level BPE tokenizer on ``texts`` (deterministic given their order).

    Args:
      texts: training documents; special-token strings inside them are cut out.
      config: vocabulary size and merge threshold.

    Returns:
      A ``tokenizers.Tokenizer`` with the special tokens at ids 0..6 and a post-processor
      that prepends ``<|bos|>``.
    """
    tokenizer = _untrained_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        min_frequency=config.min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_without_special_strings(texts), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    check_special_tokens(tokenizer)
    return tokenizer


def check_special_tokens(tokenizer: Tokenizer) -> None:
    """Raises ``ValueError`` unless every special token has its documented id."""
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        got = tokenizer.token_to_id(token)
        if got != expected_id:
            raise ValueError(f"special token {token} has id {got}, expected {expected_id}")
    if tokenizer.get_vocab_size() > 65536:
        raise ValueError(
            f"vocabulary of {tokenizer.get_vocab_size()} does not fit the uint16 token arrays"
        )


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Loads a tokenizer.json and checks its special tokens."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"tokenizer file not found: {path}")
    tokenizer = Tokenizer.from_file(str(path))
    check_special_tokens(tokenizer)
    return tokenizer


def default_tokenizer_path() -> Path:
    """Path of the tokenizer.json bundled with the package."""
    return Path(str(resources.files("tev_jax.data").joinpath(DEFAULT_TOKENIZER_FILE)))


def load_default_tokenizer() -> Tokenizer:
    """Loads the bundled tokenizer (a fresh, independently mutable instance)."""
    return load_tokenizer(default_tokenizer_path())


def tokenizer_sha256(tokenizer: Tokenizer) -> str:
    """SHA-256 of the tokenizer's canonical JSON, identifying it in manifests."""
    return hashlib.sha256(tokenizer.to_str().encode("utf-8")).hexdigest()
