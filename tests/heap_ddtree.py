"""Reference DDTree builder: the plain best-first heap over per-row top-K arrays.

Pop the best candidate, give it the next slot, push its next sibling and its first
child. Candidates are keyed ``(-score, depth, parent slot, token rank)``, the total
order documented in ``tev_jax.ddtree``, so the pop order is the jitted builder's slot
order. Scores are float32 sums from the root down, as in the jitted builder.
"""

from __future__ import annotations

import heapq

import numpy as np


def heap_build(tokens_HK, logq_HK, root_token: int, budget: int) -> dict[str, np.ndarray]:
    """Builds the tree of ``budget`` nodes; returns numpy arrays with N = budget + 1.

    Args:
      tokens_HK: int [H, K], per-row top-K token ids, best first.
      logq_HK: float32 [H, K], their log-probabilities (non-increasing per row).
      root_token: the root token.
      budget: nodes besides the root.

    Returns:
      dict with ``tokens, parents, depths`` (int32 [N]), ``valid`` (bool [N]),
      ``logq, score`` (float32 [N]); padding as in ``tev_jax.ddtree``.
    """
    tokens_HK = np.asarray(tokens_HK)
    logq_HK = np.asarray(logq_HK, np.float32)
    horizon, k = logq_HK.shape
    n_slots = budget + 1
    out = {
        "tokens": np.zeros(n_slots, np.int32),
        "parents": np.full(n_slots, -1, np.int32),
        "depths": np.zeros(n_slots, np.int32),
        "valid": np.zeros(n_slots, bool),
        "logq": np.zeros(n_slots, np.float32),
        "score": np.zeros(n_slots, np.float32),
    }
    out["tokens"][0] = root_token
    out["valid"][0] = True
    heap: list[tuple[float, int, int, int]] = []

    def push(parent: int, depth: int, rank: int) -> None:
        score = np.float32(out["score"][parent] + logq_HK[depth - 1, rank])
        heapq.heappush(heap, (-float(score), depth, parent, rank))

    if budget > 0 and horizon > 0:
        push(0, 1, 0)
    n = 0
    while heap and n < budget:
        neg_score, depth, parent, rank = heapq.heappop(heap)
        if neg_score == np.inf:
            break
        n += 1
        out["tokens"][n] = tokens_HK[depth - 1, rank]
        out["parents"][n] = parent
        out["depths"][n] = depth
        out["valid"][n] = True
        out["logq"][n] = logq_HK[depth - 1, rank]
        out["score"][n] = -neg_score
        if rank + 1 < k:
            push(parent, depth, rank + 1)
        if depth < horizon:
            push(n, depth + 1, 0)
    return out


def numpy_topk_logq(draft_logits_HV, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-row top-k (logit descending, token id ascending on ties) in float64 numpy."""
    logits = np.asarray(draft_logits_HV, np.float64)
    order = np.lexsort((np.broadcast_to(np.arange(logits.shape[1]), logits.shape), -logits))
    order = order[:, :k]
    top = np.take_along_axis(logits, order, axis=1)
    finite_max = np.max(logits, axis=1, keepdims=True)
    lse = finite_max + np.log(np.sum(np.exp(logits - finite_max), axis=1, keepdims=True))
    return order.astype(np.int32), top - lse
