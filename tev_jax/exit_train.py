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

    keys:          sequence 0..L-1      | the tree of anchor a
    query (a, v):  positions < anchor_a | ancestors of v (v included)

Its cost is about one target forward over the A * N tree nodes (plus their LM head).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import struct

from tev_jax.exit_law import ExitLaw, exit_law
from tev_jax.models.kv_cache import KVCache
from tev_jax.models.layers import rope_inv_freq
from tev_jax.sampling import Sampling
from tev_jax.sharding import constrain
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


def _anchor_attention(q_BTHd, k_BTKd, v_BTKd, kc_BLKd, vc_BLKd, anchors_BA, anc_BANN):
    """GQA attention of T = A * N tree queries: prefix ``< anchor`` + own ancestors.

    One joint softmax over two key segments: the sequence's cached keys (shared by the
    anchors of a row, masked per anchor) and the keys of the query's own tree (masked by
    the ancestor mask). Blocking by anchor keeps the tree part at [A, N, N] per row
    instead of a block-diagonal [A*N, A*N].
    """
    b, t, hq, hd = q_BTHd.shape
    a = anchors_BA.shape[1]
    n, kh = t // a, k_BTKd.shape[2]
    g = hq // kh
    f32 = jnp.float32
    q = q_BTHd.reshape(b, a, n, kh, g, hd)
    k = k_BTKd.reshape(b, a, n, kh, hd).astype(q.dtype)
    v = v_BTKd.reshape(b, a, n, kh, hd)
    scale = hd ** -0.5
    s_pre = jnp.einsum("bankgd,blkd->bakgnl", q, kc_BLKd.astype(q.dtype),
                       preferred_element_type=f32) * scale
    s_tree = jnp.einsum("bankgd,bamkd->bakgnm", q, k, preferred_element_type=f32) * scale
    positions = jnp.arange(kc_BLKd.shape[1])
    m_pre = (positions[None, None, :] < anchors_BA[:, :, None])[:, :, None, None, None, :]
    m_tree = anc_BANN[:, :, None, None]
    neg = jnp.finfo(f32).min
    s_pre = jnp.where(m_pre, s_pre, neg)
    s_tree = jnp.where(m_tree, s_tree, neg)
    mx = jnp.maximum(jnp.max(s_pre, -1, keepdims=True), jnp.max(s_tree, -1, keepdims=True))
    p_pre = jnp.where(m_pre, jnp.exp(s_pre - mx), 0.0)
    p_tree = jnp.where(m_tree, jnp.exp(s_tree - mx), 0.0)
    # Every query sees itself, so the denominator is >= 1.
    denom = jnp.sum(p_pre, -1, keepdims=True) + jnp.sum(p_tree, -1, keepdims=True)
    out = (jnp.einsum("bakgnl,blkd->bankgd", (p_pre / denom).astype(vc_BLKd.dtype), vc_BLKd,
                      preferred_element_type=f32)
           + jnp.einsum("bakgnm,bamkd->bankgd", (p_tree / denom).astype(v.dtype), v,
                        preferred_element_type=f32))
    return out.reshape(b, t, hq, hd).astype(q_BTHd.dtype)


def score_tree_nodes(target, cache: KVCache, trees: DraftTree, anchors_BA: jax.Array
                     ) -> jax.Array:
    """Target logits of every node of every anchor's tree in one forward.

    The T = A * N nodes of a row are the queries of one pass through the target's
    layers (the same sub-modules and order as ``DecoderLayer``), with anchor-blocked
    attention (`_anchor_attention`): node v of anchor a, at position
    ``anchor_a + depth(v)``, sees the cached sequence positions ``< anchor_a`` and its
    tree ancestors (itself included).

    Args:
      target: the frozen `Target`.
      cache: the sequence's keys/values from `target_context` (L slots).
      trees: `DraftTree` with fields [B, A, N]; slot 0 of anchor a holds
        ``tokens[anchor_a]``.
      anchors_BA: int [B, A].
    Returns:
      float32 [B, A, N, V]; row (a, v) is the target's next-token logits after
      ``tokens[:anchor_a]`` and the path root..v. Detached.
    """
    b, a, n = trees.tokens.shape
    anchors = anchors_BA.astype(jnp.int32)
    anc_BANN = jax.vmap(jax.vmap(ancestor_mask))(trees)
    tokens = trees.tokens.reshape(b, a * n).astype(jnp.int32)
    positions = (anchors[:, :, None] + trees.depths.astype(jnp.int32)).reshape(b, a * n)
    inv_freq = rope_inv_freq(target.config)
    x = target.embed(tokens)
    for i, layer in enumerate(target.layers):
        q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), positions, inv_freq)
        att = _anchor_attention(q, k, v, cache.k[i], cache.v[i], anchors, anc_BANN)
        x = constrain(x + layer.self_attn.out(att), ("batch", "seq", "act_embed"))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        x = constrain(x, ("batch", "seq", "act_embed"))
    logits = target.unembed(target.norm(x))
    return jax.lax.stop_gradient(logits.reshape(b, a, n, logits.shape[-1]))


__all__ = [
    "LossParts", "WEIGHTINGS", "check_weighting", "exit_loss", "node_weights",
    "score_tree_nodes", "target_context", "token_loss", "tree_exit_weights",
]

