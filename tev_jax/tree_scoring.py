"""ExitTrain's scoring pass: the frozen target over every anchor's draft tree.

The scoring pass (`target_context`, `score_tree_nodes`) runs the target's own layers
(`tev_jax.models.target.Target.layer_stack`, with an attention of its own) and reuses
the keys/values of the target's pass over the whole sequence: the nodes of all A
anchors of a row are the queries of one forward, node v of anchor a sits at position
``anchor + depth(v)`` and sees the sequence positions ``< anchor`` plus its tree
ancestors (itself and the root, whose token is ``tokens[anchor]``, included)::

    keys:          sequence 0..L-1      | the tree of anchor a
    query (a, v):  positions < anchor_a | ancestors of v (v included)

Its cost is about one target forward over the A * N tree nodes (plus their LM head).
The exit law reads only the rows of nodes with children, and a leaf's keys/values are
seen by no other node, so `score_parent_nodes` scores only those nodes (pooled per
row into a static number of query slots, with a full pass as the fallback when they
do not fit): same weights, a cost that follows the trees' shape.

Nothing here needs a [rows, V] array: the losses take the drafter's rows either as
logits or as `tev_jax.models.lm_head.HeadRows` (hidden states + the frozen head), and
the scoring pass returns hidden states (`score_tree_hidden`) from which
`edge_log_probs_blocked` reads each node's log-normaliser and child logits over
vocabulary blocks (a plain temperature; top-k / top-p / greedy need whole rows and go
through `score_tree_nodes` + `tree_exit_weights`). Attention is the blocked
`tev_jax.models.attention.attention`, so no [T, S] score array exists either.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from tev_jax.exit_law import ExitLaw, exit_law_from_edges
from tev_jax.models import lm_head
from tev_jax.models import kv_cache as kvc
from tev_jax.models.attention import Mask, attention, windowed
from tev_jax.models.kv_cache import KVCache
from tev_jax.models.lm_head import Head
from tev_jax.sampling import Sampling
from tev_jax.tree import DraftTree, ancestor_mask, children_mask


def _causal_attention(q_BTHd, k_BTKd, v_BTKd, layer, scale):
    """Causal GQA self-attention of a whole sequence (in the layer's window)."""
    b, t = q_BTHd.shape[:2]
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return attention(q_BTHd, ((k_BTKd, v_BTKd,
                               windowed(Mask.causal(t), layer.window, positions)),),
                     scale=scale)


def _anchor_attention(q_BTHd, k_BTKd, v_BTKd, cache, layer, anchors_BA, anc_BANN,
                      positions_BT, scale):
    """GQA attention of T = A * N tree queries: prefix ``< anchor`` + own ancestors.

    One joint softmax over two key segments: the sequence's cached keys (layer
    ``layer`` of ``cache``, read in place; shared by the anchors of a row, masked per
    anchor) and the keys of the trees, where a query sees its own tree's slots (a key
    range) that are its ancestors (the block-diagonal of the ancestor masks).
    """
    b, a, n, _ = anc_BANN.shape
    own = jnp.eye(a, dtype=bool)[None, :, None, :, None]
    tree = (anc_BANN[:, :, :, None, :] & own).reshape(b, a * n, a * n)
    prefix = windowed(Mask(end=jnp.repeat(anchors_BA, n, axis=1)), layer.window,
                      positions_BT)
    tree = windowed(Mask.blocks(a * n, n).replace(dense=tree), layer.window, positions_BT,
                    key_positions_BS=positions_BT)
    k, v, row = kvc.layer_kv(cache, layer)
    return attention(q_BTHd, ((k, v, prefix, row), (k_BTKd, v_BTKd, tree)), scale=scale)


def _pooled_attention(q_BMHd, k_BMKd, v_BMKd, cache, layer, prefix_end_BM, tree_BMM,
                      positions_BM, scale):
    """GQA attention of M queries of any anchors: prefix ``< prefix_end`` of layer
    ``layer`` of ``cache`` + the ``tree`` mask over their own keys (in the window)."""
    k, v, row = kvc.layer_kv(cache, layer)
    prefix = windowed(Mask(end=prefix_end_BM), layer.window, positions_BM)
    tree = windowed(tree_BMM, layer.window, positions_BM, key_positions_BS=positions_BM)
    return attention(q_BMHd, ((k, v, prefix, row), (k_BMKd, v_BMKd, tree)), scale=scale)


def target_context(target, tokens_BL: jax.Array, taps: Sequence[int], *,
                   with_cache: bool = True) -> tuple[jax.Array, KVCache | None]:
    """The frozen target's causal pass over whole sequences, without the LM head.

    The target's own forward (`Target.layer_stack` with causal attention), each layer
    writing its keys/values to the returned cache. Without the cache (the token-only
    step) only the layers up to the last tap run.

    Args:
      target: the `Target`.
      tokens_BL: int [B, L].
      taps: target layer ids whose outputs form the drafter's context features (the
        last layer's output is taken after the final norm, as in `Target`).
      with_cache: also return the keys/values of every layer.
    Returns:
      (features [B, L, len(taps) * D], `KVCache` of the sequence with L slots or None),
      both detached.
    Raises:
      ValueError: a tap outside the target's layers.
    """
    b, length = tokens_BL.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    cache = target.init_cache(b, length) if with_cache else None

    def attend(layer, q, k, v, cache):
        if cache is not None:
            cache = kvc.set_layer(cache, layer, k, v)
        return _causal_attention(q, k, v, layer, target.config.attention_scale), cache

    last = target.config.num_layers - 1
    depth = None if with_cache or last in taps else max(taps, default=-1) + 1
    _, feats, cache = target.layer_stack(tokens_BL.astype(jnp.int32), positions, attend,
                                         cache, taps, depth)
    return jax.lax.stop_gradient((feats, cache))


def score_tree_hidden(target, cache: KVCache, trees: DraftTree, anchors_BA: jax.Array
                      ) -> jax.Array:
    """The target's final-normed hidden state of every node of every anchor's tree.

    The T = A * N nodes of a row are the queries of one pass through the target's
    layers (`Target.layer_stack`) with anchor-blocked attention: node v of anchor a, at
    position ``anchor_a + depth(v)``, sees the cached sequence positions ``< anchor_a``
    and its tree ancestors (itself included).

    Args:
      target: the frozen `Target`.
      cache: the sequence's keys/values from `target_context` (L slots).
      trees: `DraftTree` with fields [B, A, N]; slot 0 of anchor a holds
        ``tokens[anchor_a]``.
      anchors_BA: int [B, A].
    Returns:
      [B, A, N, D] in the target's dtype; ``target.unembed`` of row (a, v) is the
      target's next-token logits after ``tokens[:anchor_a]`` and the path root..v.
      Detached.
    """
    b, a, n = trees.tokens.shape
    anchors = anchors_BA.astype(jnp.int32)
    anc_BANN = jax.vmap(jax.vmap(ancestor_mask))(trees)
    tokens = trees.tokens.reshape(b, a * n).astype(jnp.int32)
    positions = (anchors[:, :, None] + trees.depths.astype(jnp.int32)).reshape(b, a * n)

    def attend(layer, q, k, v, carry):
        return _anchor_attention(q, k, v, cache, layer, anchors, anc_BANN, positions,
                                 target.config.attention_scale), carry

    hidden, _, _ = target.layer_stack(tokens, positions, attend)
    return jax.lax.stop_gradient(hidden.reshape(b, a, n, -1))


def score_tree_nodes(target, cache: KVCache, trees: DraftTree, anchors_BA: jax.Array
                     ) -> jax.Array:
    """Target logits of every node of every anchor's tree in one forward.

    Args:
      target, cache, trees, anchors_BA: as in `score_tree_hidden`.
    Returns:
      float32 [B, A, N, V]; row (a, v) is the target's next-token logits after
      ``tokens[:anchor_a]`` and the path root..v. Detached.
    """
    return target.unembed(score_tree_hidden(target, cache, trees, anchors_BA))


def score_window_hidden(target, tokens_BL: jax.Array, trees: DraftTree,
                        anchors_BA: jax.Array, window: int) -> jax.Array:
    """`score_tree_hidden` with the authors' truncated context (``prefix_window``).

    Each anchor's tree is scored by a target pass over the ``window`` tokens before the
    anchor alone, then the tree: the window's keys and values are recomputed without
    the earlier context, as the released ExitTrain trainer does (hsj576/TEV,
    ``exittrain_prefix_window: 64``). Per anchor the queries are::

        slots:   window tokens (absolute positions anchor-W .. anchor-1) | tree (root = anchor)
        window:  causal over the real window tokens (left padding near the start is hidden)
        tree:    the real window tokens and the node's ancestors (itself included)

    Args:
      target: the frozen `Target`.
      tokens_BL: int [B, L] the sequences.
      trees, anchors_BA: as in `score_tree_hidden`.
      window: static int >= 0, the tokens before each anchor that the pass sees.
    Returns:
      [B, A, N, D] hidden states of the tree nodes (detached).
    """
    b, a, n = trees.tokens.shape
    w = int(window)
    anchors = anchors_BA.astype(jnp.int32)
    pos_BAW = anchors[:, :, None] + jnp.arange(-w, 0, dtype=jnp.int32)
    real_BAW = pos_BAW >= 0
    window_BAW = jnp.take_along_axis(tokens_BL.astype(jnp.int32),
                                     jnp.maximum(pos_BAW, 0).reshape(b, a * w),
                                     axis=1).reshape(b, a, w)
    tokens = jnp.concatenate([window_BAW, trees.tokens.astype(jnp.int32)], axis=-1)
    positions = jnp.concatenate([jnp.maximum(pos_BAW, 0),
                                 anchors[:, :, None] + trees.depths.astype(jnp.int32)], axis=-1)
    sees_window = jnp.broadcast_to(real_BAW[:, :, None, :], (b, a, w + n, w))
    sees_window = sees_window & jnp.concatenate(
        [jnp.tril(jnp.ones((w, w), bool)), jnp.ones((n, w), bool)])
    sees_tree = jnp.concatenate([jnp.zeros((b, a, w, n), bool),
                                 jax.vmap(jax.vmap(ancestor_mask))(trees)], axis=2)
    mask_XLL = jnp.concatenate([sees_window, sees_tree], axis=-1).reshape(b * a, w + n, w + n)

    positions_XL = positions.reshape(b * a, w + n)

    def attend(layer, q, k, v, carry):
        mask = windowed(mask_XLL, layer.window, positions_XL, key_positions_BS=positions_XL)
        return attention(q, ((k, v, mask),), scale=target.config.attention_scale), carry

    hidden, _, _ = target.layer_stack(tokens.reshape(b * a, w + n), positions_XL, attend)
    return jax.lax.stop_gradient(hidden.reshape(b, a, w + n, -1)[:, :, w:])


def parent_mask(trees: DraftTree) -> jax.Array:
    """bool [..., N]: the valid nodes with at least one child.

    These are the only rows of the target logits the exit law reads (edge ``a(v)`` reads
    the row of v's parent; a leaf has ``rho = 1``). They are closed under ancestors, and a
    leaf's keys/values are seen by no other node, so a scoring pass over them alone gives
    the same logits on their rows.
    """
    return jnp.any(children_mask(trees), axis=-1)


def _score_pooled(target, cache: KVCache, trees: DraftTree, anchors_BA, needed_BAN,
                  capacity: int) -> jax.Array:
    """`score_tree_hidden` on the first ``capacity`` needed nodes of each row (slot order).

    Rows that are not needed come out 0; needs ``sum(needed[b]) <= capacity`` for all b.
    """
    b, a, n = trees.tokens.shape
    t = a * n
    needed_BT = needed_BAN.reshape(b, t)
    order = jnp.argsort(jnp.where(needed_BT, 0, t) + jnp.arange(t), axis=1)
    idx_BM = order[:, :capacity]
    ok_BM = jnp.take_along_axis(needed_BT, idx_BM, axis=1)
    anchor_BM, slot_BM = idx_BM // n, idx_BM % n
    flat = lambda x: jnp.take_along_axis(x.reshape(b, t).astype(jnp.int32), idx_BM, axis=1)
    anchors = anchors_BA.astype(jnp.int32)
    start_BM = jnp.take_along_axis(anchors, anchor_BM, axis=1)
    positions = start_BM + flat(trees.depths)
    anc_BANN = jax.vmap(jax.vmap(ancestor_mask))(trees)
    rows = jnp.arange(b)[:, None, None]
    tree_BMM = (anc_BANN[rows, anchor_BM[:, :, None], slot_BM[:, :, None], slot_BM[:, None, :]]
                & (anchor_BM[:, :, None] == anchor_BM[:, None, :])
                & ok_BM[:, :, None] & ok_BM[:, None, :])
    # Padding queries see only themselves (finite softmax); their outputs are dropped.
    tree_BMM = tree_BMM | jnp.eye(capacity, dtype=bool)
    prefix_end = jnp.where(ok_BM, start_BM, 0)

    def attend(layer, q, k, v, carry):
        return _pooled_attention(q, k, v, cache, layer, prefix_end, tree_BMM, positions,
                                 target.config.attention_scale), carry

    hidden_BMD, _, _ = target.layer_stack(flat(trees.tokens), positions, attend)
    # Row of slot t in the compact order (needed slots come first, in slot order), or
    # the appended zero row.
    row_BT = jnp.where(needed_BT, jnp.cumsum(needed_BT, axis=1) - 1, capacity)
    padded = jnp.concatenate([hidden_BMD, jnp.zeros_like(hidden_BMD[:, :1])], axis=1)
    hidden = jnp.take_along_axis(padded, row_BT[:, :, None], axis=1)
    return hidden.reshape(b, a, n, -1)


def score_parent_hidden(target, cache: KVCache, trees: DraftTree, anchors_BA: jax.Array,
                        capacities: int | Sequence[int], valid_BA: jax.Array | None = None
                        ) -> jax.Array:
    """`score_tree_hidden` on the rows the exit law reads, skipping leaves when they fit.

    The nodes with children (`parent_mask`) of valid anchors are gathered, per row, into
    the smallest of ``capacities`` (query slots per row) that holds every row's nodes,
    and scored in one pass (each sees the sequence before its anchor and its tree
    ancestors, as in `score_tree_hidden`). If none does, every node is scored. One
    ``lax.switch``: the result is the same whichever branch runs, only the cost follows
    the trees (about ``capacity / (A * N)`` of the full pass, a little more for the
    all-pairs tree mask of the pooled queries).

    Args:
      target, cache, trees, anchors_BA: as in `score_tree_hidden`.
      capacities: static query slots per row, each in ``1 .. A * N`` (one int or
        several; each is one compiled branch).
      valid_BA: optional bool [B, A]; rows of invalid anchors are not needed.
    Returns:
      [B, A, N, D]: on every node with children (of a valid anchor) the hidden state of
      `score_tree_hidden`; 0 on all other rows. Detached.
    """
    b, a, n = trees.tokens.shape
    caps = (capacities,) if isinstance(capacities, int) else tuple(capacities)
    if not caps or any(not 1 <= c <= a * n for c in caps):
        raise ValueError(f"capacities must be in [1, A * N = {a * n}], got {capacities}")
    caps = sorted({int(c) for c in caps if c < a * n})
    needed = parent_mask(trees)
    if valid_BA is not None:
        needed = needed & valid_BA[:, :, None]

    def full():
        hidden = score_tree_hidden(target, cache, trees, anchors_BA)
        return jnp.where(needed[..., None], hidden, 0.0).astype(hidden.dtype)

    if not caps:
        return full()
    count = jnp.max(jnp.sum(needed, axis=(1, 2)))
    branch = sum((count > c).astype(jnp.int32) for c in caps)     # smallest that fits
    pooled = [lambda c=c: _score_pooled(target, cache, trees, anchors_BA, needed, c)
              for c in caps]
    return jax.lax.stop_gradient(jax.lax.switch(branch, pooled + [full]))


def score_parent_nodes(target, cache: KVCache, trees: DraftTree, anchors_BA: jax.Array,
                       capacities: int | Sequence[int], valid_BA: jax.Array | None = None
                       ) -> jax.Array:
    """Target logits of `score_parent_hidden`: float32 [B, A, N, V], on every node with
    children (of a valid anchor) those of `score_tree_nodes`, 0 on all other rows."""
    return target.unembed(score_parent_hidden(target, cache, trees, anchors_BA, capacities,
                                              valid_BA))


# -------------------------------------------------- exit law from hidden states


def blocked_law_ok(sampling: Sampling) -> bool:
    """Whether the exit law can read the target through `lm_head` blocks: a plain
    temperature needs only each row's log-normaliser and a few logits; greedy, top-k
    and top-p transform whole rows, so they keep the dense [.., V] path."""
    return not (sampling.greedy or sampling.top_k is not None or sampling.top_p is not None)


def edge_log_probs_blocked(trees: DraftTree, hidden_XND: jax.Array, head: Head,
                           sampling: Sampling, block: int = lm_head.BLOCK) -> jax.Array:
    """``log a`` [*X, N] of `tev_jax.exit_law.edge_log_probs` from the nodes' hidden states.

    ``log a(v) = s * x_parent(tokens[v]) - logsumexp(s * x_parent)`` with ``s = 1 / T``:
    one blocked log-normaliser per node and one gathered logit per edge, no [N, V] row.
    0 at the root, -inf on padding (as the dense function).

    Args:
      trees: `DraftTree` with fields [*X, N].
      hidden_XND: [*X, N, D] final-normed target hidden states of the nodes
        (`score_tree_hidden`; rows of nodes without children are not read).
      head: the target's `lm_head.Head`.
      sampling: a plain temperature (`blocked_law_ok`).
    """
    if not blocked_law_ok(sampling):
        raise ValueError(f"the blocked exit law needs a plain temperature, got {sampling}")
    scale = 1.0 / sampling.temperature
    hidden_XND = jax.lax.stop_gradient(hidden_XND)
    n = trees.tokens.shape[-1]
    slots = jnp.arange(n)
    edge_XN = trees.valid & (slots > 0)
    parent_XN = jnp.where(edge_XN, trees.parents, 0).astype(jnp.int32)
    lse_XN = lm_head.logsumexp(hidden_XND, head, scale, block)
    h_par = jnp.take_along_axis(hidden_XND, parent_XN[..., None], axis=-2)
    x_tok = lm_head.logits_at(h_par, head, trees.tokens)
    log_a = jnp.minimum(x_tok * scale - jnp.take_along_axis(lse_XN, parent_XN, axis=-1), 0.0)
    return jnp.where(edge_XN, log_a, jnp.where(slots == 0, 0.0, -jnp.inf))


def exit_laws_from_edges(trees: DraftTree, log_a_XN: jax.Array) -> ExitLaw:
    """`exit_law_from_edges` of a batch of trees (any leading axes X); detached."""
    lead = trees.tokens.shape[:-1]
    n = trees.tokens.shape[-1]
    flat = jax.tree.map(lambda x: x.reshape((-1, n)), trees)
    law = jax.vmap(exit_law_from_edges)(flat, log_a_XN.reshape((-1, n)))
    return jax.lax.stop_gradient(jax.tree.map(lambda x: x.reshape(lead + x.shape[1:]), law))


__all__ = ["blocked_law_ok", "edge_log_probs_blocked", "exit_laws_from_edges", "parent_mask",
           "score_parent_hidden", "score_parent_nodes", "score_tree_hidden",
           "score_tree_nodes", "score_window_hidden", "target_context"]
