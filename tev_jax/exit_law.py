"""The canonical exit law of a draft tree (paper §3, docs/design.md §3).

Target flow enters the tree at the root and follows a drafted child whenever the
target's next token is that child's token; the node where it leaves is its exit node.
For every valid node v with parent u::

    a(v)   = p_u(tokens[v])                   edge probability
    P(v)   = P(u) * a(v),  P(root) = 1        reach (target flow)
    rho(v) = 1 - sum_{c child of v} a(c)      local exit (a leaf has rho = 1)
    w(v)   = P(v) * rho(v)                    exit law, sum_v w(v) = 1
    C      = sum_{v != root} P(v)             target coverage

Every exact verifier has expected output-block length ``1 + C``.

Example (the tree drawn in ``tev_jax.tree``; flow enters at the root)::

          0  P=1    rho=1-a1-a2
         / \\
        1   2       P=a1, a2
        |
        3           P=a1*a3, rho=1 (leaf)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from tev_jax.sampling import Sampling
from tev_jax.tree import DraftTree, ancestor_mask, children_mask
from tev_jax.vocab import BLOCK, Scores, block_masses, gather_blocks, target_scores


@struct.dataclass
class ExitLaw:
    """The exit law of one tree under one target (all float32).

    Attributes:
      log_a: [N] edge log-probability ``log p_parent(token)``; 0 at the root, -inf on
        padding.
      log_reach: [N] ``log P``; -inf on padding and on unreachable nodes.
      reach: [N] ``P``, the probability that target flow reaches the node.
      rho: [N] local exit, the target mass at the node not on its children's tokens;
        in [0, 1], 0 on padding.
      w: [N] exit weights ``P * rho``; sums to 1, 0 on padding.
      coverage: [] ``C = sum of P over non-root nodes``.
      expected_length: [] ``1 + C``, the expected output-block length of any exact
        verifier (accepted draft tokens + the bonus token).
    """

    log_a: jax.Array
    log_reach: jax.Array
    reach: jax.Array
    rho: jax.Array
    w: jax.Array
    coverage: jax.Array
    expected_length: jax.Array


def edge_log_probs(tree: DraftTree, scores: Scores, block: int = BLOCK) -> jax.Array:
    """``log a`` [N]: ``log p_parent(token)`` per node, 0 at the root, -inf on padding.

    Needs the row max of the parent, which ``block_masses`` keeps inside its kernel; it
    is recovered from the 128-token block B that holds the token (gathered, N x 128
    entries): with ``b = max_B x`` and ``S_B = sum_B exp((x - b) s)``, the block's mass
    ``M_B = S_B exp((b - max x) s)``, so
    ``log a = (x_tok - b) s + log M_B - log S_B - log sum_blocks M``. A token whose
    block mass underflows (probability below ~1e-38) gets ``log a = -inf``.
    """
    scale = jnp.float32(scores.scale)
    block = min(block, scores.x.shape[-1])
    slots = jnp.arange(tree.num_slots)
    edge_N = tree.valid & (slots > 0)
    parent_N = jnp.where(edge_N, tree.parents, 0)
    mass_NB = block_masses(scores, block)
    blk_N = tree.tokens // block
    seg_NK = gather_blocks(scores, parent_N, blk_N, block)
    top_N = jnp.max(seg_NK, axis=-1)
    top_N = jnp.where(jnp.isfinite(top_N), top_N, 0.0)
    seg_mass_N = jnp.sum(jnp.exp((seg_NK - top_N[:, None]) * scale), axis=-1)
    x_tok = scores.take(parent_N, tree.tokens)
    mass_B = mass_NB[parent_N, blk_N]
    log_a = ((x_tok - top_N) * scale + jnp.log(mass_B)
             - jnp.log(seg_mass_N) - jnp.log(jnp.sum(mass_NB, axis=-1))[parent_N])
    log_a = jnp.where((x_tok > -jnp.inf) & (mass_B > 0), jnp.minimum(log_a, 0.0), -jnp.inf)
    return jnp.where(edge_N, log_a, jnp.where(slots == 0, 0.0, -jnp.inf))


def _path_sum(anc_NN: jax.Array, log_a_N: jax.Array) -> jax.Array:
    """``sum of log_a over the path root..v`` per node, a masked sum over the ancestor
    mask rather than ``anc @ log_a``: the matmul would form ``-inf * 0 = NaN`` for nodes
    off a zero-probability edge."""
    return jnp.sum(jnp.where(anc_NN, log_a_N[None, :], 0.0), axis=-1)


def floored_reach(tree: DraftTree, log_a_N: jax.Array, floor: float) -> jax.Array:
    """Reach with every edge probability floored: ``prod_{u on root..v} max(a(u), floor)``.

    The authors' ExitTrain weights (``P_tgt``) use this product with ``floor = 1e-4``, so
    a node behind an edge the target almost never takes keeps a small weight. ``floor =
    0`` gives the exact reach ``P``. float32 [N], 0 on padding.

    Args:
      tree: a `DraftTree` with N slots.
      log_a_N: [N] edge log-probabilities (`ExitLaw.log_a`).
      floor: static float in [0, 1].
    """
    edge_N = tree.valid & (jnp.arange(tree.num_slots) > 0)
    log_floor = jnp.log(jnp.float32(floor))
    log_a = jnp.where(edge_N, jnp.maximum(log_a_N, log_floor), log_a_N)
    reach = jnp.exp(_path_sum(ancestor_mask(tree), log_a))
    return jnp.where(tree.valid, reach, 0.0)


def exit_law_from_edges(tree: DraftTree, log_a_N: jax.Array) -> ExitLaw:
    """The exit law from the edge log-probabilities alone (level-parallel, O(N^2))."""
    slots = jnp.arange(tree.num_slots)
    edge_N = tree.valid & (slots > 0)
    anc_NN = ancestor_mask(tree)
    log_reach = _path_sum(anc_NN, log_a_N)
    reach = jnp.exp(log_reach)
    a_N = jnp.where(edge_N, jnp.exp(log_a_N), 0.0)
    child_mass_N = jnp.sum(jnp.where(children_mask(tree), a_N[None, :], 0.0), axis=-1)
    # 1 - sum, clipped: when the children cover (almost) all mass the true rho is below
    # float32 resolution of the normaliser; the absolute error stays below ~3e-7 (tests).
    rho = jnp.where(tree.valid, jnp.clip(1.0 - child_mass_N, 0.0, 1.0), 0.0)
    w = reach * rho
    coverage = jnp.sum(jnp.where(edge_N, reach, 0.0))
    return ExitLaw(
        log_a=log_a_N,
        log_reach=log_reach,
        reach=reach,
        rho=rho,
        w=w,
        coverage=coverage,
        expected_length=1.0 + coverage,
    )


def exit_law(tree: DraftTree, target_logits_NV: jax.Array, sampling: Sampling) -> ExitLaw:
    """The canonical exit law of ``tree`` under the target (paper §3).

    Args:
      tree: a valid ``DraftTree`` with N slots (token ids in ``[0, V)``).
      target_logits_NV: [N, V] target logits; row i is the next-token logits after
        the path root..i. Rows of padding slots are ignored.
      sampling: the target's sampling transform (static); exactness is with respect
        to ``softmax(transform(logits))``.

    Returns:
      An ``ExitLaw``. Jittable (``sampling`` static) and vmappable over a batch of
      trees and logits.
    """
    return exit_law_from_edges(tree, edge_log_probs(tree, target_scores(target_logits_NV, sampling)))
