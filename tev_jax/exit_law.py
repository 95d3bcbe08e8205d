"""The canonical exit law of a draft tree (paper §3, DESIGN.md §3).

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

from tev_jax.sampling import Sampling, log_probs
from tev_jax.tree import DraftTree, ancestor_mask, children_mask


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


@struct.dataclass
class Scores:
    """Target log-weights ``z = (x - shift) * scale`` with ``p = softmax(z)`` per row.

    ``z`` is never materialised for a plain temperature: each consumer (the
    log-normaliser, the N edge gathers, one row for a bonus draw) applies the shift and
    scale to what it reads from ``x``, so XLA fuses them and the [N, V] logits are only
    read. (A shared ``z`` array with several consumers gets written out by XLA:CPU.)
    Every row maximum of ``z`` is in ``[-log V, 0]``, so ``exp(z)`` is safe.

    Attributes:
      x: [..., V] logits (raw, or already transformed for top-k / top-p / T = 0).
      shift: [...] per-row shift (the row max of ``x``, or 0).
      scale: static 1 / T (1 when ``x`` is already transformed).
    """

    x: jax.Array
    shift: jax.Array
    scale: float = struct.field(pytree_node=False)

    def full(self) -> jax.Array:
        return (self.x - self.shift[..., None]) * jnp.float32(self.scale)

    def take(self, rows: jax.Array, cols: jax.Array) -> jax.Array:
        return (self.x[rows, cols] - self.shift[rows]) * jnp.float32(self.scale)

    def row(self, i: jax.Array) -> jax.Array:
        return (self.x[i] - self.shift[i]) * jnp.float32(self.scale)


def target_scores(logits_NV: jax.Array, sampling: Sampling) -> Scores:
    """The target's log-weights for ``sampling``, unmaterialised when possible.

    For a plain temperature this is one pass over the logits (the row max; the max of
    ``x / T`` is the max of ``x`` for T > 0); with top-k, top-p or T = 0 it is the
    materialised ``sampling.log_probs``.
    """
    if sampling.greedy or sampling.top_k is not None or sampling.top_p is not None:
        logp = log_probs(logits_NV, sampling)
        return Scores(logp, jnp.zeros(logp.shape[:-1], jnp.float32), 1.0)
    x = logits_NV.astype(jnp.float32)
    return Scores(x, jnp.max(x, axis=-1), 1.0 / sampling.temperature)


BLOCK = 128  # vocabulary block of the two-stage row reductions (see block_masses)


def block_masses(scores: Scores, block: int = BLOCK) -> jax.Array:
    """``sum exp z`` over consecutive vocabulary blocks; float32 [..., ceil(V / block)].

    The first stage of a two-stage row reduction, and the block index of the
    inverse-CDF sampler. The optimization barrier keeps XLA from merging this stage
    with the next reduction into one long-row reduction, which XLA:CPU runs several
    times slower on large inputs (950 ms vs 280 ms for [8, 65, 151 936]); blocks of
    256 or more are slower again (see experiments/verifier_latency).
    """
    x, shift, scale = scores.x, scores.shift, jnp.float32(scores.scale)
    *lead, vocab = x.shape
    block = min(block, vocab)
    n_full, rem = divmod(vocab, block)
    x_blocks = x[..., : n_full * block].reshape(*lead, n_full, block)
    mass = jnp.sum(jnp.exp((x_blocks - shift[..., None, None]) * scale), axis=-1)
    if rem:
        tail = jnp.exp((x[..., n_full * block :] - shift[..., None]) * scale)
        mass = jnp.concatenate([mass, jnp.sum(tail, axis=-1, keepdims=True)], axis=-1)
    return jax.lax.optimization_barrier(mass)


def log_normalizer(scores: Scores) -> jax.Array:
    """``log sum exp z`` per row; float32 [N]. Two-stage: per-block sums, then their sum."""
    return jnp.log(jnp.sum(block_masses(scores), axis=-1))


def edge_log_probs(tree: DraftTree, scores: Scores, lse_N: jax.Array) -> jax.Array:
    """``log a`` [N]: ``log p_parent(token)`` per node, 0 at the root, -inf on padding.

    Reads N entries of the logits (one gather), not whole rows.
    """
    slots = jnp.arange(tree.num_slots)
    edge_N = tree.valid & (slots > 0)
    parent_N = jnp.where(edge_N, tree.parents, 0)
    log_a = scores.take(parent_N, tree.tokens) - lse_N[parent_N]
    return jnp.where(edge_N, log_a, jnp.where(slots == 0, 0.0, -jnp.inf))


def exit_law_from_edges(tree: DraftTree, log_a_N: jax.Array) -> ExitLaw:
    """The exit law from the edge log-probabilities alone (level-parallel, O(N^2)).

    ``log P`` is a masked sum over the ancestor mask rather than ``anc @ log_a``: the
    matmul would form ``-inf * 0 = NaN`` for nodes off a zero-probability edge.
    """
    slots = jnp.arange(tree.num_slots)
    edge_N = tree.valid & (slots > 0)
    anc_NN = ancestor_mask(tree)
    log_reach = jnp.sum(jnp.where(anc_NN, log_a_N[None, :], 0.0), axis=-1)
    reach = jnp.exp(log_reach)
    a_N = jnp.where(edge_N, jnp.exp(log_a_N), 0.0)
    child_mass_N = jnp.sum(jnp.where(children_mask(tree), a_N[None, :], 0.0), axis=-1)
    # 1 - sum, clipped: when the children cover (almost) all mass the true rho is below
    # float32 resolution of the normaliser; the absolute error stays ~1e-7 (see tests).
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
    scores = target_scores(target_logits_NV, sampling)
    return exit_law_from_edges(tree, edge_log_probs(tree, scores, log_normalizer(scores)))
