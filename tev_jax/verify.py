"""Exact tree verifiers (paper §4, App. A.4, B.1; docs/design.md §4).

Every verifier returns a ``Verdict``: the accepted path from the root, the output
block length and the bonus token. All of them are exact: the probability of stopping
at node v with bonus y is ``P(v) * p_v(y)`` for every y that is not a child token of v,
so the output block is distributed as the target's own continuation.

- ``tev``: draw the exit node from the exit law ``w``, then the bonus from the
  residual of ``p_exit`` without the exit's child tokens. Two draws.
- ``predraw``: draw ``y_i ~ p_i`` at every node and follow matching children
  (DDTree's verifier). ``method="blocked"`` is a blocked inverse-CDF sampler (one
  uniform per node, the logits read about once); ``method="gumbel"`` is the naive
  Gumbel-max over N x V noise.
- ``sequential_residual``: at each node test the children in slot order, accepting
  child j with probability ``a(c_j) / (1 - sum_{m<j} a(c_m))``; on rejection of all,
  draw the bonus from the residual (EAGLE-style).
- ``greedy``: follow the target argmax (what all of the above do at T = 0).

All are pure functions, jittable (``sampling`` and ``horizon`` static) and vmappable
over keys, trees and logits. None of them loops over nodes: a node's coin or draw is
fixed before the walk, so "is this node on the accepted path" is a masked reduction
over the ancestor mask, and the exit is the deepest accepted node. Logits must be
checked on the host with ``tev_jax.sampling.check_finite``; inside jit nothing is
checked. At T = 0 ``greedy`` is the cheap path (the others materialise a one-hot
[N, V] distribution and return the same verdict).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from tev_jax.exit_law import edge_log_probs, exit_law_from_edges
from tev_jax.sampling import Sampling
from tev_jax.tree import DraftTree, ancestor_mask, path_to
from tev_jax.vocab import (Scores, argmax, first_above, inverse_cdf, target_scores,
                           uniform)


@struct.dataclass
class Verdict:
    """A verifier's decision for one tree.

    Attributes:
      path: int32 [H+1], slot indices from the root to the exit node, -1 padded.
      length: int32 [], slots on the path = accepted draft tokens + 1 = output block
        length (the path's tokens after the root, then the bonus).
      bonus: int32 [], the target token emitted after the path.
      exit_node: int32 [], the last slot on the path.
    """

    path: jax.Array
    length: jax.Array
    bonus: jax.Array
    exit_node: jax.Array


def _verdict(tree: DraftTree, exit_node: jax.Array, bonus: jax.Array, horizon: int) -> Verdict:
    exit_node = exit_node.astype(jnp.int32)
    return Verdict(
        path=path_to(tree, exit_node, horizon),
        length=(tree.depths[exit_node] + 1).astype(jnp.int32),
        bonus=bonus.astype(jnp.int32),
        exit_node=exit_node,
    )


def _exit_of_choices(tree: DraftTree, chosen_N: jax.Array) -> jax.Array:
    """Deepest node whose every non-root ancestor (itself included) was chosen.

    ``chosen[j]`` says node j is the child its parent passes to; at most one child
    per parent is chosen, so the reached nodes form one path from the root.
    """
    slots = jnp.arange(tree.num_slots)
    ok_N = chosen_N | (slots == 0)
    reached_N = tree.valid & ~jnp.any(ancestor_mask(tree) & ~ok_N[None, :], axis=-1)
    return jnp.argmax(jnp.where(reached_N, tree.depths, -1)).astype(jnp.int32)


def _child_of(tree: DraftTree, node: jax.Array) -> jax.Array:
    """bool [N]: slot j is a (valid) child of ``node``."""
    return tree.valid & (tree.parents == node) & (jnp.arange(tree.num_slots) > 0)


def _residual_draw(u: jax.Array, tree: DraftTree, scores: Scores, node: jax.Array) -> jax.Array:
    """Bonus ``y`` from ``p_node`` without ``node``'s child tokens, renormalised.

    The residual is formed in log space, so a residual of mass 1e-30 is still sampled
    exactly. If it has no mass at all (the children hold every token of the support,
    so the exact exit weight of ``node`` is 0 and it is chosen only through float32
    rounding) the bonus falls back to ``p_node`` itself.
    """
    if scores.top is not None:   # T = 0: the argmax (a child never holds it at an exit)
        return scores.top[node]
    vocab = scores.x.shape[-1]
    x_V = scores.x[node]
    child_tok_N = jnp.where(_child_of(tree, node), tree.tokens, vocab)
    covered_V = jnp.zeros((vocab,), bool).at[child_tok_N].set(True, mode="drop")
    resid_V = jnp.where(covered_V, -jnp.inf, x_V)
    resid_V = jnp.where(jnp.any(resid_V > -jnp.inf), resid_V, x_V)
    return inverse_cdf(u[None], Scores(resid_V[None, :], scores.scale))[0]


def _tev(u_2: jax.Array, tree, target_logits_NV, sampling, *, horizon) -> Verdict:
    scores = target_scores(target_logits_NV, sampling)
    law = exit_law_from_edges(tree, edge_log_probs(tree, scores))
    w_N = law.w
    cum_N = jnp.cumsum(w_N)
    exit_node = first_above(cum_N[None], u_2[0:1] * cum_N[-1], w_N[None])[0]
    bonus = _residual_draw(u_2[1], tree, scores, exit_node)
    return _verdict(tree, exit_node, bonus, horizon)


def tev(
    key: jax.Array,
    tree: DraftTree,
    target_logits_NV: jax.Array,
    sampling: Sampling,
    *,
    horizon: int,
) -> Verdict:
    """Tree Exit Verification: exit ``v* ~ w``, bonus from the residual at ``v*``.

    Cost: one log-normaliser per row (the reduction every exact verifier pays), N
    gathers, O(N^2) mask work, one draw over N and one blocked draw over V.

    Args:
      key: a PRNG key (two uniforms are drawn from it).
      tree: a valid ``DraftTree`` with N slots and depth at most ``horizon``.
      target_logits_NV: [N, V] target logits at the tree's nodes.
      sampling: the target's sampling transform (static).
      horizon: H, static; the path has H+1 entries.

    Returns:
      A ``Verdict``.
    """
    return _tev(uniform(key, (2,)), tree, target_logits_NV, sampling, horizon=horizon)


def _predraw(u_N, tree, target_logits_NV, sampling, *, horizon) -> Verdict:
    draws_N = inverse_cdf(u_N, target_scores(target_logits_NV, sampling))
    return _follow(tree, draws_N, horizon)


def _follow(tree: DraftTree, draws_N: jax.Array, horizon: int) -> Verdict:
    """Walk into the child whose token equals the parent's draw; bonus = exit's draw."""
    parent_N = jnp.maximum(tree.parents, 0)
    chosen_N = _child_of_any(tree) & (tree.tokens == draws_N[parent_N])
    exit_node = _exit_of_choices(tree, chosen_N)
    return _verdict(tree, exit_node, draws_N[exit_node], horizon)


def _child_of_any(tree: DraftTree) -> jax.Array:
    return tree.valid & (jnp.arange(tree.num_slots) > 0)


def predraw(
    key: jax.Array,
    tree: DraftTree,
    target_logits_NV: jax.Array,
    sampling: Sampling,
    *,
    horizon: int,
    method: str = "blocked",
) -> Verdict:
    """Predraw-and-follow (DDTree): ``y_i ~ p_i`` at every node, follow matches.

    Args:
      key: a PRNG key.
      tree, target_logits_NV, sampling, horizon: as in ``tev``.
      method: ``"blocked"`` (one uniform per node, blocked inverse CDF; the fast one)
        or ``"gumbel"`` (argmax of the logits plus N x V Gumbel noise; the naive one).

    Returns:
      A ``Verdict``.
    """
    if method == "blocked":
        return _predraw(
            uniform(key, (tree.num_slots,)), tree, target_logits_NV, sampling, horizon=horizon
        )
    if method == "gumbel":
        scores = target_scores(target_logits_NV, sampling)
        draws_N = (scores.top if scores.top is not None else
                   jax.random.categorical(key, scores.x * jnp.float32(scores.scale), axis=-1))
        return _follow(tree, draws_N, horizon)
    raise ValueError(f"predraw method must be 'blocked' or 'gumbel', got {method!r}")


def _sequential_residual(
    u_N1, tree, target_logits_NV, sampling, *, horizon, strict: bool = True
) -> Verdict:
    """Sequential residual from uniforms: ``u[j]`` is child j's coin, ``u[N]`` the bonus.

    ``strict=False`` accepts on ``u <= prob``; it exists only as a negative control.
    """
    n = tree.num_slots
    scores = target_scores(target_logits_NV, sampling)
    log_a_N = edge_log_probs(tree, scores)
    is_child_N = _child_of_any(tree)
    a_N = jnp.where(is_child_N, jnp.exp(log_a_N), 0.0)
    slots = jnp.arange(n)
    # earlier[j, m]: m is a sibling of j tested before it (slot order).
    earlier_NN = (
        is_child_N[:, None]
        & is_child_N[None, :]
        & (tree.parents[:, None] == tree.parents[None, :])
        & (slots[None, :] < slots[:, None])
    )
    left_N = 1.0 - jnp.sum(jnp.where(earlier_NN, a_N[None, :], 0.0), axis=-1)
    # a / left, guarded: rounding can push `left` to or below a (or 0) when earlier
    # siblings hold (almost) all mass; the coin is then reached with probability ~0.
    prob_N = jnp.where(
        a_N <= 0, 0.0, jnp.where(a_N >= left_N, 1.0, a_N / jnp.maximum(left_N, 1e-30))
    )
    coin_N = u_N1[:n]
    accept_N = is_child_N & ((coin_N < prob_N) if strict else (coin_N <= prob_N))
    chosen_N = accept_N & ~jnp.any(earlier_NN & accept_N[None, :], axis=-1)
    exit_node = _exit_of_choices(tree, chosen_N)
    bonus = _residual_draw(u_N1[n], tree, scores, exit_node)
    return _verdict(tree, exit_node, bonus, horizon)


def sequential_residual(
    key: jax.Array,
    tree: DraftTree,
    target_logits_NV: jax.Array,
    sampling: Sampling,
    *,
    horizon: int,
) -> Verdict:
    """EAGLE-style sequential residual verification over the tree.

    At node i the children are tested in slot order; child j is accepted with
    probability ``a(c_j) / (1 - sum_{m<j} a(c_m))`` (strict ``u < prob``); the walk
    descends into an accepted child; if all are rejected the bonus is drawn from the
    residual of ``p_i``. Each node's coin is drawn up front (a node is tested at most
    once), so the data-dependent walk becomes a level-parallel reduction.

    Args:
      key, tree, target_logits_NV, sampling, horizon: as in ``tev``.

    Returns:
      A ``Verdict``.
    """
    u = uniform(key, (tree.num_slots + 1,))
    return _sequential_residual(u, tree, target_logits_NV, sampling, horizon=horizon)


def greedy(tree: DraftTree, target_logits_NV: jax.Array, *, horizon: int) -> Verdict:
    """Follow the target argmax (lowest index on ties); the bonus is the exit's argmax.

    Equal to every exact verifier at T = 0. Reads the logits once (no exp).
    """
    return _follow(tree, argmax(target_logits_NV), horizon)
