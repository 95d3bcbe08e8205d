"""Offline data for the bundled models: tokenizer, corpus, training windows, prompt sets.

- ``tokenizer``: the bundled byte-level BPE (V = 4096), special-token ids, chat template.
- ``corpus``: training/validation documents per domain from the shared data folder and
  the interpreter's standard library.
- ``token_corpus``: token arrays on disk, deterministic resumable training windows.
- ``prompts``: the bundled evaluation prompt sets.

Licences and attribution: ``tev_jax/data/README.md``.
"""

from tev_jax.data.prompts import PROMPT_COUNTS, PROMPT_SETS, prompt_records, prompt_set
from tev_jax.data.token_corpus import (
    TokenCorpus,
    WindowConfig,
    load_token_corpus,
    mixture_weights,
    train_batch,
    validation_windows,
)
from tev_jax.data.tokenizer import (
    ASSISTANT_ID,
    BOS_ID,
    END_ID,
    EOS_ID,
    MASK_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    STOP_IDS,
    USER_ID,
    format_chat,
    format_chat_turn,
    load_default_tokenizer,
    load_tokenizer,
)

__all__ = [
    "ASSISTANT_ID",
    "BOS_ID",
    "END_ID",
    "EOS_ID",
    "MASK_ID",
    "PAD_ID",
    "PROMPT_COUNTS",
    "PROMPT_SETS",
    "SPECIAL_TOKENS",
    "STOP_IDS",
    "TokenCorpus",
    "USER_ID",
    "WindowConfig",
    "format_chat",
    "format_chat_turn",
    "load_default_tokenizer",
    "load_token_corpus",
    "load_tokenizer",
    "mixture_weights",
    "prompt_records",
    "prompt_set",
    "train_batch",
    "validation_windows",
]
