"""Prompts on the host: the one prompt check of the library, the padded batch the
engine's programs take, and a request of continuous batching (one prompt to complete)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Prompts:
    """A batch of prompts ready for the engine: int32 tokens [B, T] (zero-padded),
    int32 lengths [B] and, for an engine whose rows each have their own setting, the
    rows' `tev_jax.sampling.SamplingRows` (else None), placed on the engine's mesh."""

    tokens_BT: jax.Array
    lengths_B: jax.Array
    sampling_B: Any = None


@dataclasses.dataclass(frozen=True)
class Request:
    """One prompt to complete: its id (any JSON value), its token ids and, optionally,
    the index of its row key (`tev_jax.decode.row_keys`; default: its position in the
    stream). A batch job gives each prompt its index in the file, so that a sampled
    output does not depend on the processes, the slots or a resume."""

    id: Any
    prompt_ids: Sequence[int]
    row: int | None = None


def check_prompt(ids, vocab_size: int, prompt_len: int | None = None, *,
                 what: str = "prompt") -> np.ndarray:
    """One prompt as int32 [T]; a ValueError starting with ``what`` if it is unusable.

    The one prompt check of the library (`generate`, continuous batching, batch files).

    Args:
      ids: the token ids (a flat sequence of integers).
      vocab_size: V; every id must be in ``[0, V)``.
      prompt_len: the prompt buffer P (at most P tokens), or None.
      what: how the message names the prompt (``"prompt 3"``, ``"request 'a'"``,
        ``"file.jsonl:3: id 'a'"``).
    """
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"{what}: the prompt must be a flat list of token ids, got shape "
                         f"{arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{what}: the prompt is empty; every prompt needs at least one token")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what}: token ids must be integers, got dtype {arr.dtype}")
    bad = (arr < 0) | (arr >= vocab_size)
    if bad.any():
        k = int(np.argmax(bad))
        raise ValueError(f"{what}: token id {int(arr[k])} is outside the vocabulary "
                         f"[0, {vocab_size}) (position {k})")
    if prompt_len is not None and arr.size > prompt_len:
        raise ValueError(f"{what}: the prompt has {arr.size} tokens, more than the prompt "
                         f"buffer ({prompt_len}); raise prompt_len or shorten the prompt")
    return arr.astype(np.int32)


def check_context(prompt_tokens: int, max_new_tokens: int, max_positions: int, *,
                  what: str = "prompt",
                  advice: str = "shorten the prompt or lower --max-new-tokens") -> None:
    """A ValueError starting with ``what`` and ending with ``advice`` unless the prompt
    and ``max_new_tokens`` fit in the target's context (``max_position_embeddings``:
    beyond it a model trained on shorter texts writes garbage), as vLLM checks its
    ``max_model_len``."""
    if prompt_tokens + max_new_tokens > max_positions:
        raise ValueError(
            f"{what}: the prompt ({prompt_tokens} tokens) + --max-new-tokens "
            f"({max_new_tokens}) = {prompt_tokens + max_new_tokens} tokens exceed the "
            f"target's context length (max_position_embeddings = {max_positions}); "
            f"{advice}")


def check_prompts(prompt_ids, vocab_size: int, prompt_len: int | None = None
                  ) -> list[np.ndarray]:
    """`check_prompt` of every prompt of a non-empty batch; -> int32 arrays."""
    if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Sequence):
        raise ValueError("prompt_ids must be a list of token-id lists")
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids is empty: give at least one prompt")
    return [check_prompt(p, vocab_size, prompt_len, what=f"prompt {i}")
            for i, p in enumerate(prompt_ids)]


__all__ = ["Prompts", "Request", "check_context", "check_prompt", "check_prompts"]
