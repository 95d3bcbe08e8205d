"""Reference DDTree builder: the plain best-first heap over per-row top-K arrays.

Pop the best candidate, give it the next slot, push its next sibling and its first
child. Candidates are keyed ``(-score, depth, i + r, i)`` (``i``: the parent's position
among the nodes of its depth, ``r``: the token's rank), the total order documented in
``tev_jax.ddtree``, so the pop order is the jitted builder's slot order. Scores are
float32 sums from the root down, as in the jitted builder.
"""

from __future__ import annotations

import array
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
    tokens = np.asarray(tokens_HK).tolist()
    logq = np.asarray(logq_HK, np.float32).tolist()  # exact float32 values as floats
    horizon = len(logq)
    k = len(logq[0]) if horizon else 0
    nodes = [(root_token, -1, 0, 0.0, 0.0)]  # (token, parent, depth, logq, score)
    position = [0]  # of each slot among the nodes of its depth
    per_depth = [1] + [0] * horizon
    # float32 sums: the float64 sum of two float32 values, rounded to float32, equals the
    # float32 addition (53 >= 2 * 24 + 2); storing into an 'f' array does the rounding.
    f32 = array.array("f", [0.0])
    heap: list[tuple[float, int, int, int, int, int]] = []
    if budget > 0 and horizon > 0:
        heap.append((-logq[0][0], 1, 0, 0, 0, 0))
    while heap and len(nodes) <= budget:
        neg_score, depth, _, _, parent, rank = heapq.heappop(heap)
        if neg_score == float("inf"):
            break
        score = -neg_score
        slot = len(nodes)
        nodes.append((tokens[depth - 1][rank], parent, depth, logq[depth - 1][rank], score))
        position.append(per_depth[depth])
        per_depth[depth] += 1
        if rank + 1 < k:  # next sibling
            f32[0] = nodes[parent][4] + logq[depth - 1][rank + 1]
            i = position[parent]
            heapq.heappush(heap, (-f32[0], depth, i + rank + 1, i, parent, rank + 1))
        if depth < horizon:  # first child
            f32[0] = score + logq[depth][0]
            i = position[slot]
            heapq.heappush(heap, (-f32[0], depth + 1, i, i, slot, 0))
    n_slots, n = budget + 1, len(nodes)
    columns = list(zip(*nodes))
    out = {}
    for name, col, dtype, pad in zip(("tokens", "parents", "depths", "logq", "score"), columns,
                                      (np.int32, np.int32, np.int32, np.float32, np.float32),
                                      (0, -1, 0, 0.0, 0.0)):
        out[name] = np.full(n_slots, pad, dtype)
        out[name][:n] = col
    out["valid"] = np.arange(n_slots) < n
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
