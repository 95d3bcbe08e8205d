"""Anchor sampling: A block roots per training sequence, a pure function of (seed, step).

A sequence is ``[prompt ; response ; padding]`` with the response at positions
``[start, end)``. Anchor ``a`` is the root of a training block: its labels are
``tokens[a+1 .. a+H]`` and its context is ``tokens[:a]``. It is valid when every label
is a response token and the context is not empty::

    max(1, start - 1)  <=  a  <=  end - 1 - H

Sequences with fewer valid positions than A get all of them, and the remaining anchor
slots are masked (``valid = False``) so shapes stay static.
"""

from __future__ import annotations

import numpy as np


def anchor_range(start: int, end: int, horizon: int) -> tuple[int, int]:
    """Valid anchors ``[lo, hi)`` of a response at ``[start, end)`` (empty if lo >= hi)."""
    return max(1, start - 1), end - horizon


def step_rng(seed: int, step: int, stream: int) -> np.random.Generator:
    """A numpy generator determined by (seed, step, stream)."""
    return np.random.default_rng([int(seed), int(step), int(stream)])


def sample_anchors(rng: np.random.Generator, starts_B: np.ndarray, ends_B: np.ndarray,
                   horizon: int, num_anchors: int) -> tuple[np.ndarray, np.ndarray]:
    """Samples A distinct valid anchors per sequence.

    Args:
      rng: numpy generator (e.g. `step_rng`).
      starts_B, ends_B: int [B] response start and end (exclusive) per sequence.
      horizon: H.
      num_anchors: A.
    Returns:
      (anchors int32 [B, A] sorted within each row, valid bool [B, A]); invalid slots
      hold position 0.
    """
    if horizon < 1 or num_anchors < 1:
        raise ValueError(f"need horizon >= 1 and num_anchors >= 1, got {horizon}, {num_anchors}")
    b = len(starts_B)
    anchors = np.zeros((b, num_anchors), np.int32)
    valid = np.zeros((b, num_anchors), bool)
    for i in range(b):
        lo, hi = anchor_range(int(starts_B[i]), int(ends_B[i]), horizon)
        count = hi - lo
        if count <= 0:
            continue
        k = min(count, num_anchors)
        picked = np.sort(rng.choice(count, size=k, replace=False)) + lo
        anchors[i, :k] = picked
        valid[i, :k] = True
    return anchors, valid


__all__ = ["anchor_range", "sample_anchors", "step_rng"]
