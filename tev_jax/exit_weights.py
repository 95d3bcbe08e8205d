"""ExitTrain's node weights and losses: what the exit law makes of a scored tree.

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
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from tev_jax.exit_law import ExitLaw, exit_law, floored_reach
from tev_jax.models.lm_head import as_rows
from tev_jax.sampling import Sampling
from tev_jax.tree import DraftTree

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
    rows = as_rows(draft_logits_XHV)
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
    rows = as_rows(draft_logits_XHV)
    lse_XH = rows.lse
    h = lse_XH.shape[-1]
    weights_XN = jax.lax.stop_gradient(weights_XN.astype(jnp.float32))
    row_XN = jnp.clip(trees.depths - 1, 0, h - 1).astype(jnp.int32)
    picked_XN = rows.at(row_XN, trees.tokens)
    row_weight_XH = jnp.einsum("...n,...nh->...h", weights_XN, jax.nn.one_hot(row_XN, h))
    total = jnp.sum(row_weight_XH * lse_XH) - jnp.sum(weights_XN * picked_XN)
    return LossParts(total=total, weight=jnp.sum(weights_XN))


__all__ = ["LossParts", "NORMALIZERS", "WEIGHTINGS", "Weighting", "check_floor",
           "check_weighting", "exit_loss", "node_weights", "token_loss", "tree_exit_weights"]
