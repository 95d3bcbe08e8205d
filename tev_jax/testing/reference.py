"""Slow, obvious numpy/python references for the tree code, the exit law and the verifiers.

Everything here is float64 and loops over nodes; nothing is shared with the library
except the ``DraftTree`` container read on the host. The verifiers take their random
numbers explicitly, in the same layout as the library's private cores, so a jitted
verifier and its loop twin can be compared draw by draw.

Trees are given as Python lists ``(tokens, parents)`` of their real nodes (`host_tree`
reads them off a ``DraftTree``) and target distributions as float64 log-probabilities
``logp [n, V]`` of those nodes (`log_probs` applies the sampling transform).
"""

from __future__ import annotations

import itertools

import numpy as np

__all__ = [
    "ancestors", "brute_force_joint", "brute_force_reach", "children", "depths_of",
    "exact_joint", "exit_law_loops", "follow", "greedy", "host_tree", "inverse_cdf",
    "log_probs", "predraw", "residual", "sequential_residual", "tev",
]


def host_tree(tree):
    """(tokens, parents, n) of the real nodes of a single tree, as Python lists."""
    valid = np.asarray(tree.valid)
    n = int(valid.sum())
    return (
        [int(t) for t in np.asarray(tree.tokens)[:n]],
        [int(p) for p in np.asarray(tree.parents)[:n]],
        n,
    )


def children(parents, n):
    kids = {i: [] for i in range(n)}
    for i in range(1, n):
        kids[parents[i]].append(i)
    return kids


def depths_of(parents, n):
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    return depth


def ancestors(parents, i):
    """[i, parent(i), ..., root]."""
    out = [i]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out


# ----------------------------------------------------------------------------- sampling


def log_probs(logits, temperature=1.0, top_k=None, top_p=None):
    """The sampling transform of ``tev_jax.sampling`` written row by row in float64."""
    logits = np.asarray(logits, np.float64)
    out = np.empty_like(logits)
    for r, row in enumerate(logits.reshape(-1, logits.shape[-1])):
        if temperature == 0:
            res = np.full(row.shape, -np.inf)
            res[int(np.argmax(row))] = 0.0
            out.reshape(-1, row.size)[r] = res
            continue
        x = row / temperature
        keep = np.isfinite(x)
        if top_k is not None and top_k < x.size:
            kth = sorted(x, reverse=True)[top_k - 1]
            keep &= x >= kth
        if top_p is not None and top_p < 1:
            p = np.where(keep, np.exp(x - x[keep].max()), 0.0)
            p /= p.sum()
            order = sorted(range(x.size), key=lambda i: -x[i])
            mass, kept = 0.0, []
            for i in order:
                if not keep[i]:
                    continue
                if mass >= top_p:
                    break
                kept.append(i)
                mass += p[i]
            threshold = min(x[i] for i in kept)
            keep &= x >= threshold
        x = np.where(keep, x, -np.inf)
        m = x[keep].max()
        out.reshape(-1, row.size)[r] = x - (m + np.log(np.exp(x[keep] - m).sum()))
    return out


# ----------------------------------------------------------------------------- exit law


def exit_law_loops(tokens, parents, logp):
    """P, rho, w, coverage from the definitions, one node at a time (float64)."""
    n = len(tokens)
    p = np.exp(logp)
    kids = children(parents, n)
    reach = np.zeros(n)
    reach[0] = 1.0
    for i in range(1, n):
        reach[i] = reach[parents[i]] * p[parents[i], tokens[i]]
    rho = np.zeros(n)
    for i in range(n):
        covered = {tokens[c] for c in kids[i]}
        rho[i] = sum(p[i, y] for y in range(p.shape[1]) if y not in covered)
    return reach, rho, reach * rho, reach[1:].sum()


def brute_force_joint(tokens, parents, logp):
    """Exit law by enumerating target continuations; float64 [n, V] joint law.

    Every continuation ``y_1 .. y_{D+1}`` (D = the tree's depth) is enumerated. It is
    read from the root: while ``y_k`` is the token of a child of the current node,
    move there; the first ``y_k`` that matches no child (or any ``y_k`` read at a
    leaf) makes the current node the exit and ``y_k`` the bonus. Positions after the
    exit are off the tree, where the target is not given; they are drawn uniformly,
    which sums out. Returns ``J[v, y] = Pr(exit v, bonus y)``.
    """
    n = len(tokens)
    vocab = logp.shape[1]
    p = np.exp(logp)
    child_by_token = {i: {} for i in range(n)}
    for i in range(1, n):
        child_by_token[parents[i]][tokens[i]] = i
    length = max(depths_of(parents, n)) + 1
    joint = np.zeros((n, vocab))
    for seq in itertools.product(range(vocab), repeat=length):
        node, prob = 0, 1.0
        for k, y in enumerate(seq):
            prob *= p[node, y]
            nxt = child_by_token[node].get(y)
            if nxt is None:
                joint[node, y] += prob * vocab ** -(length - 1 - k)
                break
            node = nxt
    return joint


def exact_joint(tokens, parents, logp):
    """The exact law of (exit node, bonus token) by following target flow; float64 [n, V].

    Target flow reaches node v with the product of the target's probabilities of the
    tokens on its path (``P(v)``); there the target's next token y either is the token
    of a child (the flow moves on) or not (v is the exit and y the bonus). So
    ``J[v, y] = P(v) * p_v(y)`` off v's child tokens and 0 on them. This is the same
    law as `brute_force_joint` (which enumerates whole continuations and is
    exponential in the depth) at the cost of one pass over the nodes.
    """
    n = len(tokens)
    p = np.exp(np.asarray(logp, np.float64))
    reach = np.zeros(n)
    reach[0] = 1.0
    joint = np.zeros((n, p.shape[1]))
    kids = children(parents, n)
    for v in range(n):
        if v:
            reach[v] = reach[parents[v]] * p[parents[v], tokens[v]]
        joint[v] = reach[v] * p[v]
        joint[v, [tokens[c] for c in kids[v]]] = 0.0
    return joint


def brute_force_reach(tokens, parents, logp):
    """P(v) by enumeration: the mass of continuations whose walk passes through v."""
    n = len(tokens)
    joint = brute_force_joint(tokens, parents, logp)
    exit_mass = joint.sum(-1)
    reach = np.zeros(n)
    for v in range(n):
        for u in range(n):
            if v in ancestors(parents, u):
                reach[v] += exit_mass[u]
    return reach


# ----------------------------------------------------------------------------- verifiers


def inverse_cdf(u, weights):
    """First index whose cumulative weight exceeds ``u * total``."""
    weights = np.asarray(weights, np.float64)
    cum = np.cumsum(weights)
    idx = int(np.searchsorted(cum, u * cum[-1], side="right"))
    return min(idx, int(np.nonzero(weights > 0)[0][-1]))


def residual(tokens, parents, logp, node):
    p = np.exp(logp[node]).copy()
    for c in children(parents, len(tokens))[node]:
        p[tokens[c]] = 0.0
    return p if p.sum() > 0 else np.exp(logp[node])


def tev(u2, tokens, parents, logp):
    """TEV with ``u2 = (exit uniform, bonus uniform)``; returns (path, bonus)."""
    _, _, w, _ = exit_law_loops(tokens, parents, logp)
    exit_node = inverse_cdf(u2[0], w)
    bonus = inverse_cdf(u2[1], residual(tokens, parents, logp, exit_node))
    return ancestors(parents, exit_node)[::-1], bonus


def predraw(u_n, tokens, parents, logp):
    """Predraw-and-follow with one uniform per node (inverse CDF of ``p_i``)."""
    n = len(tokens)
    draws = [inverse_cdf(u_n[i], np.exp(logp[i])) for i in range(n)]
    return follow(draws, tokens, parents)


def follow(draws, tokens, parents):
    kids = children(parents, len(tokens))
    node, path = 0, [0]
    while True:
        nxt = [c for c in kids[node] if tokens[c] == draws[node]]
        if not nxt:
            return path, draws[node]
        node = nxt[0]
        path.append(node)


def sequential_residual(u, tokens, parents, logp, strict=True):
    """EAGLE-style walk: ``u[c]`` is the coin of child slot c, ``u[-1]`` the bonus."""
    p = np.exp(logp)
    kids = children(parents, len(tokens))
    node, path = 0, [0]
    while True:
        left = 1.0
        for c in kids[node]:
            a = p[node, tokens[c]]
            prob = 0.0 if a <= 0 else min(1.0, a / left) if left > 0 else 1.0
            if (u[c] < prob) if strict else (u[c] <= prob):
                node = c
                path.append(c)
                break
            left -= a
        else:
            return path, inverse_cdf(u[-1], residual(tokens, parents, logp, node))


def greedy(tokens, parents, logits):
    draws = [int(np.argmax(row)) for row in np.asarray(logits)[: len(tokens)]]
    return follow(draws, tokens, parents)
