"""Offline data for the bundled models: tokenizer and evaluation prompt sets.

- ``tokenizer``: the bundled byte-level BPE (V = 4096), special-token ids, chat template.
- ``prompts``: the bundled evaluation prompt sets.

The training corpus they come from (documents, token arrays, training windows) is built
by the training package: ``train.demo.corpus``, ``train.demo.token_corpus``,
``train.demo.prepare_corpus``.

Licences and attribution: ``tev_jax/data/README.md``.
"""

from tev_jax.data.prompts import PROMPT_COUNTS, PROMPT_SETS, prompt_records, prompt_set
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
    "USER_ID",
    "format_chat",
    "format_chat_turn",
    "load_default_tokenizer",
    "load_tokenizer",
    "prompt_records",
    "prompt_set",
]
