"""ExitTrain: exit-guided draft-tree training objectives (paper §5, App. C.2; DESIGN.md §8).

For a training anchor the drafter proposes one row of logits per block position,
``q_d = log_softmax(draft_logits[d - 1])`` for depths d = 1..H. The inference-time
tree is built from those rows (no gradient), the frozen target scores every node under
its real tree-parent context, and the canonical exit law of `tev_jax.exit_law` gives
node weights (detached)::

    exit        weight(v) = w(v) = P(v) * rho(v)
    exit_depth  weight(v) = w(v) * depth(v)
    prefix      weight(v) = P(v)                    (reachability)

and the exit loss is ``- sum_{v != root} weight(v) * log q_{depth(v)}(tokens[v])``
divided by the total weight. Nodes of one anchor at the same depth share one draft row,
so the loss needs one log-normaliser per (anchor, depth) row and one gathered logit per
node; no [nodes x V] tensor is formed (`exit_loss`).

The scoring pass (`target_context`, `score_tree_nodes`) reuses the keys/values of the
target's pass over the whole sequence: the nodes of all A anchors of a row are the
queries of one forward, node v of anchor a sits at position ``anchor + depth(v)`` and
sees the sequence positions ``< anchor`` plus its tree ancestors (itself and the root,
whose token is ``tokens[anchor]``, included)::

    keys:     sequence 0..L-1          | anchor 0's tree | anchor 1's tree | ...
    query (a, v):  positions < anchor_a | ancestors of v  |  (only its own tree)
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import struct

from tev_jax.exit_law import ExitLaw, exit_law
from tev_jax.models.kv_cache import KVCache
from tev_jax.sampling import Sampling
from tev_jax.tree import DraftTree, ancestor_mask

WEIGHTINGS = ("exit", "exit_depth", "prefix")


def check_weighting(weighting: str) -> None:
    """Raises ValueError unless ``weighting`` is one of `WEIGHTINGS`."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"unknown exit weighting {weighting!r}; choose one of {WEIGHTINGS}")


# ------------------------------------------------------------------- node weights


def node_weights(tree: DraftTree, law: ExitLaw, weighting: str) -> jax.Array:
    """Detached per-node loss weights from an exit law; float32 [..., N].

    Works on single or batched trees (any leading axes shared by ``tree`` and
    ``law``). The root and padding slots get weight 0 (the root has no exit term).

    Args:
      tree: `DraftTree` with fields [..., N].
      law: its `ExitLaw` (fields [..., N]).
      weighting: 'exit', 'exit_depth' or 'prefix'.
    """
    check_weighting(weighting)
    if weighting == "exit":
        raw = law.w
    elif weighting == "exit_depth":
        raw = law.w * tree.depths.astype(jnp.float32)
    else:
        raw = law.reach
    edge = tree.valid & (tree.depths > 0)
    return jax.lax.stop_gradient(jnp.where(edge, raw, 0.0).astype(jnp.float32))


def tree_exit_weights(trees: DraftTree, target_logits_XNV: jax.Array, sampling: Sampling,
                      weighting: str) -> tuple[jax.Array, ExitLaw]:
    """Exit laws and node weights of a batch of trees (any leading axes X).

    Args:
      trees: `DraftTree` with fields [*X, N].
      target_logits_XNV: [*X, N, V] target logits of every node (row i = next-token
        logits after the path root..i).
      sampling: the target's sampling transform (static).
      weighting: see `node_weights`.
    Returns:
      (weights float32 [*X, N], `ExitLaw` with fields [*X, N] / [*X]); all detached.
    """
    check_weighting(weighting)
    lead = trees.tokens.shape[:-1]
    n, v = target_logits_XNV.shape[-2:]
    flat = jax.tree.map(lambda x: x.reshape((-1, n)), trees)
    logits = jax.lax.stop_gradient(target_logits_XNV).reshape((-1, n, v))
    law = jax.vmap(lambda t, z: exit_law(t, z, sampling))(flat, logits)
    law = jax.tree.map(lambda x: x.reshape(lead + x.shape[1:]), law)
    law = jax.lax.stop_gradient(law)
    return node_weights(trees, law, weighting), law


# ------------------------------------------------------------------------ losses


@struct.dataclass
class LossParts:
    """A weighted mean kept as numerator and denominator (for logging and reduction).

    Attributes:
      total: [] the sum of ``weight * loss`` terms.
      weight: [] the sum of weights.
    """

    total: jax.Array
    weight: jax.Array

    @property
    def mean(self) -> jax.Array:
        """``total / weight``; 0 when the weight is 0 (no NaN, zero gradient)."""
        safe = jnp.where(self.weight > 0, self.weight, 1.0)
        return jnp.where(self.weight > 0, self.total / safe, 0.0)


def token_loss(draft_logits_XHV: jax.Array, labels_XH: jax.Array, mask_XH: jax.Array,
               decay_gamma: float | None = None) -> LossParts:
    """The DFlash token objective: cross-entropy of each block row vs its label.

    Args:
      draft_logits_XHV: [*X, H, V] draft logits (row d-1 predicts depth d).
      labels_XH: int [*X, H], ``tokens[anchor + 1 .. anchor + H]``.
      mask_XH: bool or float [*X, H], which rows count.
      decay_gamma: optional DFlash position decay, row d weighted ``exp(-(d-1)/gamma)``.
    Returns:
      `LossParts` of the weighted cross-entropy (``.mean`` is the loss).
    """
    logits = draft_logits_XHV.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, labels_XH[..., None].astype(jnp.int32), axis=-1)[..., 0]
    weight = mask_XH.astype(jnp.float32)
    if decay_gamma is not None:
        h = logits.shape[-2]
        weight = weight * jnp.exp(-jnp.arange(h, dtype=jnp.float32) / decay_gamma)
    return LossParts(total=jnp.sum(weight * (lse - picked)), weight=jnp.sum(weight))


def exit_loss(draft_logits_XHV: jax.Array, trees: DraftTree, weights_XN: jax.Array
              ) -> LossParts:
    """The exit-guided loss without a [nodes x V] tensor (App. C.2).

    ``sum_v weight(v) * (lse_{depth(v)} - logit_{depth(v)}(tokens[v]))``: one
    log-normaliser per (anchor, depth) row, multiplied by the summed weight of that
    row's nodes, and one gathered logit per node.

    Args:
      draft_logits_XHV: [*X, H, V] draft logits of each anchor.
      trees: `DraftTree` with fields [*X, N] (built from these rows).
      weights_XN: float [*X, N] detached node weights, 0 at the root and on padding.
    Returns:
      `LossParts` (``.mean`` is the loss normalised by the total weight).
    """
    h, v = draft_logits_XHV.shape[-2:]
    n = trees.tokens.shape[-1]
    logits_RHV = draft_logits_XHV.astype(jnp.float32).reshape((-1, h, v))
    r = logits_RHV.shape[0]
    weights_RN = jax.lax.stop_gradient(weights_XN.astype(jnp.float32)).reshape((r, n))
    row_RN = jnp.clip(trees.depths.reshape((r, n)) - 1, 0, h - 1)
    tok_RN = trees.tokens.reshape((r, n)).astype(jnp.int32)
    lse_RH = jax.nn.logsumexp(logits_RHV, axis=-1)
    picked_RN = logits_RHV[jnp.arange(r)[:, None], row_RN, tok_RN]
    row_weight_RH = jnp.einsum("rn,rnh->rh", weights_RN, jax.nn.one_hot(row_RN, h))
    total = jnp.sum(row_weight_RH * lse_RH) - jnp.sum(weights_RN * picked_RN)
    return LossParts(total=total, weight=jnp.sum(weights_RN))


# ---------------------------------------------------------------- scoring pass


def target_context(target, tokens_BL: jax.Array, taps: Sequence[int]
                   ) -> tuple[jax.Array, KVCache]:
    """The frozen target's causal pass over whole sequences, without the LM head.

    Args:
      target: the `Target`.
      tokens_BL: int [B, L].
      taps: target layer ids whose outputs form the drafter's context features.
    Returns:
      (features [B, L, len(taps) * D], `KVCache` of the sequence with L slots), both
      detached.
    """
    b, length = tokens_BL.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    causal = jnp.tril(jnp.ones((length, length), bool))[None]
    _, feats, k, v = target._stack(tokens_BL.astype(jnp.int32), positions, causal, taps=taps)
    return jax.lax.stop_gradient((feats, KVCache(k=k, v=v)))


@struct.dataclass
class TreeQueries:
    """Inputs of the batched tree scoring forward (T = A * N queries per row).

    Attributes:
      tokens: int32 [B, T] node tokens, anchor-major.
      positions: int32 [B, T], ``anchor + depth``.
      block_mask: bool [B, T, T], same anchor and ancestor-or-self.
      prefix_mask: bool [B, T, L], sequence position ``< anchor``.
    """

    tokens: jax.Array
    positions: jax.Array
    block_mask: jax.Array
    prefix_mask: jax.Array


def tree_queries(trees: DraftTree, anchors_BA: jax.Array, seq_len: int) -> TreeQueries:
    """Flattens the trees of all anchors into one masked forward (see module docstring).

    Args:
      trees: `DraftTree` with fields [B, A, N]; slot 0 of anchor a holds ``tokens[a]``.
      anchors_BA: int [B, A] anchor positions.
      seq_len: L.
    """
    b, a, n = trees.tokens.shape
    anchors = anchors_BA.astype(jnp.int32)
    anc_BANN = jax.vmap(jax.vmap(ancestor_mask))(trees)
    same_AA = jnp.eye(a, dtype=bool)
    block = same_AA[None, :, None, :, None] & anc_BANN[:, :, :, None, :]
    positions = anchors[:, :, None] + trees.depths.astype(jnp.int32)
    prefix = jnp.arange(seq_len, dtype=jnp.int32)[None, None, None, :] < anchors[:, :, None, None]
    prefix = jnp.broadcast_to(prefix, (b, a, n, seq_len))
    return TreeQueries(
        tokens=trees.tokens.reshape(b, a * n).astype(jnp.int32),
        positions=positions.reshape(b, a * n),
        block_mask=block.reshape(b, a * n, a * n),
        prefix_mask=prefix.reshape(b, a * n, seq_len),
    )


def score_tree_nodes(target, cache: KVCache, trees: DraftTree, anchors_BA: jax.Array
                     ) -> jax.Array:
    """Target logits of every node of every anchor's tree in one forward.

    Args:
      target: the frozen `Target`.
      cache: the sequence's keys/values from `target_context` (L slots).
      trees: `DraftTree` with fields [B, A, N].
      anchors_BA: int [B, A].
    Returns:
      float32 [B, A, N, V]; row (a, v) is the target's next-token logits after
      ``tokens[:anchor_a]`` and the path root..v. Detached.
    """
    b, a, n = trees.tokens.shape
    q = tree_queries(trees, anchors_BA, cache.max_len)
    h, _, _, _ = target._stack(q.tokens, q.positions, q.block_mask, q.prefix_mask, cache)
    logits = target.unembed(h)
    return jax.lax.stop_gradient(logits.reshape(b, a, n, logits.shape[-1]))


__all__ = [
    "LossParts", "TreeQueries", "WEIGHTINGS", "check_weighting", "exit_loss", "node_weights",
    "score_tree_nodes", "target_context", "token_loss", "tree_exit_weights", "tree_queries",
]
