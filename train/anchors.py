"""Anchor sampling: A block roots per training sequence, a pure function of (seed, step).

A sequence is ``[prompt ; response ; padding]`` with the response at positions
``[start, end)``. Anchor ``a`` is the root of a training block: its labels are
``tokens[a+1 .. a+H]`` and its context is ``tokens[:a]``. It is valid when every label
is a response token and the context is not empty::

    max(1, start - 1)  <=  a  <=  end - 1 - H

With ``partial`` (the authors' trainer) an anchor needs only its first label in the
response (``a <= end - 2``): its labels past the response end are out of bounds
(`labels_in_response`), the token loss skips them and the tree term skips the anchor.
Sequences with fewer valid positions than A get all of them, and the remaining anchor
slots are masked (``valid = False``) so shapes stay static.
"""

from __future__ import annotations

import numpy as np


def anchor_range(start: int, end: int, horizon: int, partial: bool = False
                 ) -> tuple[int, int]:
    """Valid anchors ``[lo, hi)`` of a response at ``[start, end)`` (empty if lo >= hi);
    ``partial``: anchors with at least one label in the response."""
    return max(1, start - 1), end - (1 if partial else horizon)


def step_rng(seed: int, step: int, stream: int) -> np.random.Generator:
    """A numpy generator determined by (seed, step, stream)."""
    return np.random.default_rng([int(seed), int(step), int(stream)])


def sample_anchors(rng: np.random.Generator, starts_B: np.ndarray, ends_B: np.ndarray,
                   horizon: int, num_anchors: int, partial: bool = False
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Samples A distinct valid anchors per sequence.

    Args:
      rng: numpy generator (e.g. `step_rng`).
      starts_B, ends_B: int [B] response start and end (exclusive) per sequence.
      horizon: H.
      num_anchors: A.
      partial: also anchors whose horizon runs past the response end (`anchor_range`).
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
        lo, hi = anchor_range(int(starts_B[i]), int(ends_B[i]), horizon, partial)
        count = hi - lo
        if count <= 0:
            continue
        k = min(count, num_anchors)
        picked = np.sort(rng.choice(count, size=k, replace=False)) + lo
        anchors[i, :k] = picked
        valid[i, :k] = True
    return anchors, valid


def labels_in_response(anchors_BA: np.ndarray, valid_BA: np.ndarray, ends_B: np.ndarray,
                       horizon: int) -> np.ndarray:
    """int32 [B, A]: how many of each anchor's H labels lie in the response (0 for
    masked slots; H for every anchor of a non-partial draw)."""
    room = np.asarray(ends_B)[:, None] - 1 - np.asarray(anchors_BA)
    return np.where(valid_BA, np.clip(room, 0, horizon), 0).astype(np.int32)


__all__ = ["anchor_range", "labels_in_response", "sample_anchors", "step_rng"]
