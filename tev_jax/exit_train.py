"""ExitTrain: exit-guided draft-tree training objectives (paper §5, App. C.2; docs/design.md §8).

The whole objective lives here, over plain arrays and a frozen `ExitTrainConfig`; the
training step (``train.step``) only wires it to the drafter's forward and the optimiser.
Per training sequence and anchor a (root ``tokens[a]``, labels ``tokens[a+1 .. a+H]``,
`block_labels`)::

    target_context   frozen target over the sequences   -> context features, K/V cache
    (drafter)        the anchors' blocks                 -> draft rows [B, A, H, V]
    exit_targets     DDTree of the detached rows, scored -> trees, node weights, coverage
                     by the target under each node's real context
    objective        token CE + lambda * exit loss      -> total, aux

The node weights and the losses live in `tev_jax.exit_weights`, the target's scoring
pass over the trees in `tev_jax.tree_scoring`; this module holds the objective's
settings (`ExitTrainConfig`) and the two functions the training step calls.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from tev_jax import ddtree
from tev_jax.exit_weights import (NORMALIZERS, LossParts, Weighting, check_floor,
                                  check_weighting, exit_loss, node_weights, token_loss,
                                  tree_exit_weights)
from tev_jax.models import lm_head
from tev_jax.models.kv_cache import KVCache
from tev_jax.sampling import Sampling
from tev_jax.tree import DraftTree
from tev_jax.tree_scoring import (blocked_law_ok, edge_log_probs_blocked,
                                  exit_laws_from_edges, score_parent_hidden,
                                  score_tree_hidden, score_window_hidden)


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


__all__ = ["ExitTrainConfig", "block_labels", "check_prefix_window", "check_score_capacities",
           "exit_targets", "objective"]
