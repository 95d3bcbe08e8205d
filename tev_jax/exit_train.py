"""ExitTrain: exit-guided draft-tree training objectives (paper §5, App. C.2; DESIGN.md §8).

The whole objective lives here, over plain arrays and a frozen `ExitTrainConfig`; the
training step (``train.step``) only wires it to the drafter's forward and the optimiser.
Per training sequence and anchor a (root ``tokens[a]``, labels ``tokens[a+1 .. a+H]``,
`block_labels`)::

    target_context   frozen target over the sequences   -> context features, K/V cache
    (drafter)        the anchors' blocks                 -> draft rows [B, A, H, V]
    exit_targets     DDTree of the detached rows, scored -> trees, node weights, coverage
                     by the target under each node's real context
    objective        token CE + lambda * exit loss      -> total, aux

For a training anchor the drafter proposes one row of logits per block position,
``q_d = log_softmax(draft_logits[d - 1])`` for depths d = 1..H. The inference-time
tree is built from those rows (no gradient; `tev_jax.ddtree.build_trees`, the builder
decoding uses), the frozen target scores every node under its real tree-parent
context, and the canonical exit law of `tev_jax.exit_law` gives node weights
(detached)::

    exit        weight(v) = w(v) = P(v) * rho(v)
    exit_depth  weight(v) = w(v) * depth(v)
    prefix      weight(v) = P(v)                    (reachability)
    reach       weight(v) = P_alpha(v)              (P with edges floored at alpha)

(or a callable of the tree and its law; with a floor alpha > 0, P_alpha replaces P in
exit and exit_depth too, as in the authors' release), and the exit loss is
``- sum_{v != root} weight(v) * log q_{depth(v)}(tokens[v])`` divided by the total
weight (normaliser 'weight') or by the number of tree nodes ('nodes', the authors'; see
`objective`). Nodes of one anchor at the same depth share one draft row, so the loss
needs one log-normaliser per (anchor, depth) row and one gathered logit per node; no
[nodes x V] tensor is formed (`exit_loss`).

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

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import struct

from tev_jax import ddtree
from tev_jax.exit_law import ExitLaw, exit_law, exit_law_from_edges, floored_reach
from tev_jax.models import lm_head
from tev_jax.models.attention import Mask, attention
from tev_jax.models.kv_cache import KVCache
from tev_jax.models.lm_head import DenseRows, Head, HeadRows
from tev_jax.sampling import Sampling
from tev_jax.tree import DraftTree, ancestor_mask, children_mask

WEIGHTINGS = ("exit", "exit_depth", "prefix", "reach")
NORMALIZERS = ("weight", "nodes")

Weighting = str | Callable[[DraftTree, ExitLaw], jax.Array]


def check_weighting(weighting: Weighting) -> None:
    """Raises ValueError unless ``weighting`` is one of `WEIGHTINGS` or a callable."""
    if not callable(weighting) and weighting not in WEIGHTINGS:
        raise ValueError(f"unknown exit weighting {weighting!r}; choose one of {WEIGHTINGS} "
                         "or pass a callable (tree, law) -> weights [N]")


def check_floor(floor: float) -> None:
    """Raises ValueError unless the edge-probability floor is a float in [0, 1)."""
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0 <= floor < 1:
        raise ValueError(f"exit_floor must be a number in [0, 1), got {floor!r}")


# ------------------------------------------------------------------- node weights


def _per_tree(fn, tree: DraftTree, law: ExitLaw) -> jax.Array:
    """``fn(tree, law) -> [N]`` of one tree, applied over any leading axes."""
    lead, n = tree.tokens.shape[:-1], tree.tokens.shape[-1]
    if not lead:
        return fn(tree, law)
    flat = lambda x: x.reshape((-1,) + x.shape[len(lead):])
    out = jax.vmap(fn)(jax.tree.map(flat, tree), jax.tree.map(flat, law))
    return out.reshape(lead + (n,))


def _checked(weighting):
    """The user's ``weighting`` with its output checked (a ValueError at trace time)."""
    def fn(tree, law):
        n = tree.num_slots
        out = weighting(tree, law)
        shape, dtype = getattr(out, "shape", None), getattr(out, "dtype", None)
        if shape != (n,) or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"exit weighting {getattr(weighting, '__name__', weighting)!r} "
                             f"must return a float array of shape ({n},) (one weight per "
                             f"tree slot), got shape {shape} and dtype {dtype}")
        return out
    return fn


def node_weights(tree: DraftTree, law: ExitLaw, weighting: Weighting,
                 floor: float = 0.0) -> jax.Array:
    """Detached per-node loss weights from an exit law; float32 [..., N].

    Works on single or batched trees (any leading axes shared by ``tree`` and
    ``law``). The root and padding slots get weight 0 (the root has no exit term)::

        exit        P_f(v) * rho(v)              (w when floor = 0)
        exit_depth  P_f(v) * rho(v) * depth(v)   (the authors' 'exit')
        prefix      P(v)                         (exact reach; the floor does not apply)
        reach       P_f(v)                       (the authors' 'P_tgt')

    where ``P_f`` is the reach with edge probabilities floored at ``floor``
    (`tev_jax.exit_law.floored_reach`; ``P_f = P`` for floor 0).

    Args:
      tree: `DraftTree` with fields [..., N].
      law: its `ExitLaw` (fields [..., N]).
      weighting: a name of `WEIGHTINGS`, or a callable ``(tree, law) -> weights [N]``
        of one tree (float; the library applies it over the leading axes, detaches its
        output and zeroes the root and padding).
      floor: edge-probability floor alpha in [0, 1) of the floored reach.
    Raises:
      ValueError: an unknown name, a bad floor, or a callable whose output is not a
        float array of shape [N].
    """
    check_weighting(weighting)
    check_floor(floor)
    if callable(weighting):
        raw = _per_tree(_checked(weighting), tree, law)
    elif weighting == "prefix":
        raw = law.reach
    else:
        reach = law.reach if floor == 0 else _per_tree(
            lambda t, l: floored_reach(t, l.log_a, floor), tree, law)
        raw = reach if weighting == "reach" else reach * law.rho
        if weighting == "exit_depth":
            raw = raw * tree.depths.astype(jnp.float32)
    edge = tree.valid & (tree.depths > 0)
    return jax.lax.stop_gradient(jnp.where(edge, raw, 0.0).astype(jnp.float32))


def tree_exit_weights(trees: DraftTree, target_logits_XNV: jax.Array, sampling: Sampling,
                      weighting: Weighting, floor: float = 0.0) -> tuple[jax.Array, ExitLaw]:
    """Exit laws and node weights of a batch of trees (any leading axes X).

    Args:
      trees: `DraftTree` with fields [*X, N].
      target_logits_XNV: [*X, N, V] target logits of every node (row i = next-token
        logits after the path root..i).
      sampling: the target's sampling transform (static).
      weighting, floor: see `node_weights`.
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
    return node_weights(trees, law, weighting, floor), law


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


def _rows(draft):
    """`HeadRows` as given, a logits array as `DenseRows`."""
    return draft if isinstance(draft, (HeadRows, DenseRows)) else DenseRows(draft)


def token_loss(draft_logits_XHV, labels_XH: jax.Array, mask_XH: jax.Array,
               decay_gamma: float | None = None) -> LossParts:
    """The DFlash token objective: cross-entropy of each block row vs its label.

    Args:
      draft_logits_XHV: [*X, H, V] draft logits (row d-1 predicts depth d), or their
        `HeadRows` (hidden states + the frozen head: no [.., V] array is formed).
      labels_XH: int [*X, H], ``tokens[anchor + 1 .. anchor + H]``.
      mask_XH: bool or float [*X, H], which rows count.
      decay_gamma: optional DFlash position decay, row d weighted ``exp(-(d-1)/gamma)``.
    Returns:
      `LossParts` of the weighted cross-entropy (``.mean`` is the loss).
    """
    rows = _rows(draft_logits_XHV)
    h = labels_XH.shape[-1]
    row_XH = jnp.broadcast_to(jnp.arange(h, dtype=jnp.int32), labels_XH.shape)
    picked = rows.at(row_XH, labels_XH)
    weight = mask_XH.astype(jnp.float32)
    if decay_gamma is not None:
        weight = weight * jnp.exp(-jnp.arange(h, dtype=jnp.float32) / decay_gamma)
    return LossParts(total=jnp.sum(weight * (rows.lse - picked)), weight=jnp.sum(weight))


def exit_loss(draft_logits_XHV, trees: DraftTree, weights_XN: jax.Array) -> LossParts:
    """The exit-guided loss without a [nodes x V] tensor (App. C.2).

    ``sum_v weight(v) * (lse_{depth(v)} - logit_{depth(v)}(tokens[v]))``: one
    log-normaliser per (anchor, depth) row, multiplied by the summed weight of that
    row's nodes, and one gathered logit per node.

    Args:
      draft_logits_XHV: [*X, H, V] draft logits of each anchor, or their `HeadRows`.
      trees: `DraftTree` with fields [*X, N] (built from these rows).
      weights_XN: float [*X, N] detached node weights, 0 at the root and on padding.
    Returns:
      `LossParts` (``.mean`` is the loss normalised by the total weight).
    """
    rows = _rows(draft_logits_XHV)
    lse_XH = rows.lse
    h = lse_XH.shape[-1]
    weights_XN = jax.lax.stop_gradient(weights_XN.astype(jnp.float32))
    row_XN = jnp.clip(trees.depths - 1, 0, h - 1).astype(jnp.int32)
    picked_XN = rows.at(row_XN, trees.tokens)
    row_weight_XH = jnp.einsum("...n,...nh->...h", weights_XN, jax.nn.one_hot(row_XN, h))
    total = jnp.sum(row_weight_XH * lse_XH) - jnp.sum(weights_XN * picked_XN)
    return LossParts(total=total, weight=jnp.sum(weights_XN))


# ---------------------------------------------------------------- scoring pass


def _causal_attention(q_BTHd, k_BTKd, v_BTKd):
    """Causal GQA self-attention of a whole sequence."""
    return attention(q_BTHd, ((k_BTKd, v_BTKd, Mask.causal(q_BTHd.shape[1])),))


def _anchor_attention(q_BTHd, k_BTKd, v_BTKd, cache, layer, anchors_BA, anc_BANN):
    """GQA attention of T = A * N tree queries: prefix ``< anchor`` + own ancestors.

    One joint softmax over two key segments: the sequence's cached keys (layer
    ``layer`` of ``cache``, read in place; shared by the anchors of a row, masked per
    anchor) and the keys of the trees, where a query sees its own tree's slots (a key
    range) that are its ancestors (the block-diagonal of the ancestor masks).
    """
    b, a, n, _ = anc_BANN.shape
    own = jnp.eye(a, dtype=bool)[None, :, None, :, None]
    tree = (anc_BANN[:, :, :, None, :] & own).reshape(b, a * n, a * n)
    prefix = Mask(end=jnp.repeat(anchors_BA, n, axis=1))
    return attention(q_BTHd, ((cache.k, cache.v, prefix, layer),
                              (k_BTKd, v_BTKd, Mask.blocks(a * n, n).replace(dense=tree))))


def _pooled_attention(q_BMHd, k_BMKd, v_BMKd, cache, layer, prefix_end_BM, tree_BMM):
    """GQA attention of M queries of any anchors: prefix ``< prefix_end`` of layer
    ``layer`` of ``cache`` + the ``tree`` mask over their own keys."""
    return attention(q_BMHd, ((cache.k, cache.v, Mask(end=prefix_end_BM), layer),
                              (k_BMKd, v_BMKd, tree_BMM)))


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

    def attend(i, q, k, v, cache):
        if cache is not None:
            cache = KVCache(k=cache.k.at[i].set(k), v=cache.v.at[i].set(v))
        return _causal_attention(q, k, v), cache

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

    def attend(i, q, k, v, carry):
        return _anchor_attention(q, k, v, cache, i, anchors, anc_BANN), carry

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

    def attend(i, q, k, v, carry):
        return attention(q, ((k, v, mask_XLL),)), carry

    hidden, _, _ = target.layer_stack(tokens.reshape(b * a, w + n),
                                      positions.reshape(b * a, w + n), attend)
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

    def attend(i, q, k, v, carry):
        return _pooled_attention(q, k, v, cache, i, prefix_end, tree_BMM), carry

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


# ------------------------------------------------------------------ the objective


def check_score_capacities(caps) -> None:
    """Raises ValueError unless ``caps`` is a tuple of fractions in (0, 1)."""
    if not isinstance(caps, tuple) or any(not 0 < c < 1 for c in caps):
        raise ValueError(f"score_capacities must be a tuple of fractions in (0, 1), "
                         f"got {caps!r}")


def check_prefix_window(window) -> None:
    """Raises ValueError unless ``window`` is None or an int >= 0."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 0):
        raise ValueError(f"prefix_window must be None or an int >= 0, got {window!r}")


@dataclasses.dataclass(frozen=True)
class ExitTrainConfig:
    """Static settings of the ExitTrain objective (hashable: a static jit argument).

    Attributes:
      loss: 'token' (the DFlash token objective alone), or the exit loss's node
        weighting: a name of `WEIGHTINGS` or a callable ``(tree, law) -> weights [N]``.
      budget: DDTree budget of the training trees (N = budget + 1).
      exit_lambda: total = token + exit_lambda * exit.
      sampling: the target's sampling transform of the exit law.
      decay_gamma: optional DFlash position decay of the token loss.
      exit_normalizer: the exit term is the weighted NLL sum divided by the total
        weight ('weight') or by the number of tree nodes, root excluded, of the valid
        anchors ('nodes', the authors' release: the term then shrinks with the weights).
      exit_floor: edge-probability floor alpha of the reach in the node weights
        (`node_weights`; the authors use 1e-4).
      tree_metrics: build and score the trees with loss='token' too (for the coverage).
      score_capacities: empty: the scoring pass runs over every tree node. Fractions
        in (0, 1), e.g. (0.25, 0.5, 0.75): it runs over the nodes the exit law reads
        (nodes with children, of valid anchors) in the smallest of
        ``ceil(fraction * A * N)`` query slots per row that holds them, else over every
        node (`score_parent_hidden`); same losses and gradients, a cost that follows
        the trees, one more compiled scoring pass per fraction.
      vocab_block: vocabulary entries per block of the LM-head reductions.
      prefix_window: None: the scoring pass sees each anchor's whole prefix (the
        sequence pass's cache). An int W >= 0: it sees only the W tokens before the
        anchor, re-encoded without the earlier context (`score_window_hidden`), as the
        authors' trainer does (W = 64 there); not with ``score_capacities``.
    Raises:
      ValueError: a field out of its range (named in the message).
    """

    loss: Weighting
    budget: int
    exit_lambda: float
    sampling: Sampling
    decay_gamma: float | None = None
    exit_normalizer: str = "weight"
    exit_floor: float = 0.0
    tree_metrics: bool = False
    score_capacities: tuple[float, ...] = ()
    vocab_block: int = lm_head.BLOCK
    prefix_window: int | None = None

    def __post_init__(self):
        if self.loss != "token":
            check_weighting(self.loss)
        check_floor(self.exit_floor)
        if self.exit_normalizer not in NORMALIZERS:
            raise ValueError(f"exit_normalizer must be one of {NORMALIZERS}, got "
                             f"{self.exit_normalizer!r}")
        check_score_capacities(self.score_capacities)
        if not isinstance(self.vocab_block, int) or self.vocab_block < 1:
            raise ValueError(f"vocab_block must be a positive int, got {self.vocab_block!r}")
        check_prefix_window(self.prefix_window)
        if self.prefix_window is not None and self.score_capacities:
            raise ValueError("prefix_window and score_capacities cannot be combined (the "
                             "windowed scoring pass scores every tree node)")

    @property
    def needs_cache(self) -> bool:
        """Whether the scoring pass reads the sequence pass's keys/values."""
        return self.builds_trees and self.prefix_window is None

    @property
    def builds_trees(self) -> bool:
        """Whether the objective builds and scores trees (ExitTrain, or tree metrics)."""
        return self.loss != "token" or self.tree_metrics

    @property
    def weighting(self) -> Weighting:
        """The node weighting of the exit law ('exit' for the token loss's metrics)."""
        return "exit" if self.loss == "token" else self.loss


def block_labels(tokens_XL: jax.Array, anchors_XA: jax.Array, horizon: int) -> jax.Array:
    """int32 [*X, A, H]: ``tokens[anchor + 1 .. anchor + H]`` (clipped at the end).

    Args:
      tokens_XL: int [*X, L] sequences.
      anchors_XA: int [*X, A] anchor positions.
      horizon: H (static).
    """
    seq_len = tokens_XL.shape[-1]
    idx = (anchors_XA.astype(jnp.int32)[..., None] + 1
           + jnp.arange(horizon, dtype=jnp.int32))
    idx = jnp.clip(idx, 0, seq_len - 1)
    flat = idx.reshape(idx.shape[:-2] + (-1,))
    return jnp.take_along_axis(tokens_XL.astype(jnp.int32), flat, axis=-1).reshape(idx.shape)


def exit_targets(target, cache: KVCache, draft, tokens_BL: jax.Array, anchors_BA: jax.Array,
                 valid_BA: jax.Array, cfg: ExitTrainConfig, top=None
                 ) -> tuple[DraftTree, jax.Array, jax.Array]:
    """Trees, detached node weights and exit-law coverage of every anchor.

    The trees are DDTree's from the (detached) draft rows (`tev_jax.ddtree.build_trees`),
    scored by the frozen target (`score_tree_hidden`, or `score_parent_hidden` with
    ``cfg.score_capacities``); the exit law reads the target through vocabulary blocks
    for a plain temperature, else through dense [B, A, N, V] logits.

    Args:
      target: the frozen `Target`.
      cache: the sequences' keys/values (`target_context`; None with
        ``cfg.prefix_window``).
      draft: [B, A, H, V] draft logits or their `HeadRows` (detached).
      tokens_BL: int [B, L] sequences.
      anchors_BA: int [B, A] anchor positions.
      valid_BA: bool [B, A] which anchors count.
      cfg: the objective's settings (budget, sampling, weighting, floor, capacities).
      top: optional precomputed ``ddtree.draft_top_k(draft, ddtree.tree_k(draft,
        cfg.budget))``.
    Returns:
      (trees [B, A, N], weights float32 [B, A, N] (0 for invalid anchors),
       coverage float32 [B, A])
    """
    roots = jnp.take_along_axis(tokens_BL.astype(jnp.int32), anchors_BA.astype(jnp.int32),
                                axis=1)
    trees = ddtree.build_trees(draft, roots, cfg.budget, block=cfg.vocab_block, top=top)
    if cfg.prefix_window is not None:
        hidden = score_window_hidden(target, tokens_BL, trees, anchors_BA, cfg.prefix_window)
    elif not cfg.score_capacities:
        hidden = score_tree_hidden(target, cache, trees, anchors_BA)
    else:
        slots = anchors_BA.shape[1] * (cfg.budget + 1)
        capacities = [min(slots, math.ceil(f * slots)) for f in cfg.score_capacities]
        hidden = score_parent_hidden(target, cache, trees, anchors_BA, capacities, valid_BA)
    if blocked_law_ok(cfg.sampling):
        log_a = edge_log_probs_blocked(trees, hidden, lm_head.head_of(target), cfg.sampling,
                                       cfg.vocab_block)
        law = exit_laws_from_edges(trees, log_a)
        weights = node_weights(trees, law, cfg.weighting, cfg.exit_floor)
    else:   # top-k / top-p / greedy transform whole rows: dense [B, A, N, V] logits
        weights, law = tree_exit_weights(trees, target.unembed(hidden), cfg.sampling,
                                         cfg.weighting, cfg.exit_floor)
    weights = jnp.where(valid_BA[:, :, None], weights, 0.0)
    return trees, weights, law.coverage


def objective(draft_XHV, labels_XH: jax.Array, valid_X: jax.Array, trees: DraftTree,
              weights_XN: jax.Array, cfg: ExitTrainConfig,
              label_mask_XH: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """The training loss: token + lambda * exit (the exit term only for ExitTrain losses).

    The exit term is normalised by its total weight ('weight') or by the tree-node count
    of the valid anchors ('nodes'), as ``cfg.exit_normalizer`` says.

    Args:
      draft_XHV: [*X, H, V] draft logits of each anchor, or their `HeadRows`.
      labels_XH: int [*X, H] (`block_labels`).
      valid_X: bool [*X] which anchors count.
      trees: `DraftTree` [*X, N] and weights_XN: float [*X, N] detached node weights,
        from `exit_targets` (None with loss='token').
      cfg: the objective's settings.
      label_mask_XH: optional bool [*X, H]: the labels the token loss counts (default:
        every label of a valid anchor); the authors' trainer also counts the in-bounds
        labels of anchors too near the sequence end for a tree (`train.anchors`).
    Returns:
      (total loss [], aux: {'token_loss', and for ExitTrain 'exit_loss', 'exit_weight'}
       of [] arrays)
    """
    mask = (jnp.broadcast_to(valid_X[..., None], labels_XH.shape) if label_mask_XH is None
            else label_mask_XH)
    tok = token_loss(draft_XHV, labels_XH, mask, cfg.decay_gamma)
    aux = {"token_loss": tok.mean}
    total = tok.mean
    if cfg.loss != "token":
        ex = exit_loss(draft_XHV, trees, weights_XN)
        if cfg.exit_normalizer == "nodes":
            nodes = trees.valid & (trees.depths > 0) & valid_X[..., None]
            ex = LossParts(total=ex.total, weight=jnp.sum(nodes).astype(jnp.float32))
        aux["exit_loss"] = ex.mean
        aux["exit_weight"] = jnp.sum(weights_XN)
        total = total + cfg.exit_lambda * ex.mean
    return total, aux


__all__ = [
    "ExitTrainConfig", "LossParts", "NORMALIZERS", "WEIGHTINGS", "Weighting", "block_labels",
    "blocked_law_ok", "check_floor", "check_score_capacities", "check_weighting",
    "edge_log_probs_blocked", "exit_laws_from_edges", "exit_loss", "exit_targets",
    "node_weights", "objective", "parent_mask", "score_parent_hidden", "score_parent_nodes",
    "score_tree_hidden", "score_tree_nodes", "target_context", "token_loss",
    "tree_exit_weights",
]
