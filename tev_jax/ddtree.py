"""DDTree's best-first draft tree, built with static shapes (docs/design.md §5).

The drafter gives one row of logits per block position, ``draft_logits[d - 1]`` for
depth d = 1..H, and ``q_d = log_softmax(draft_logits[d - 1])``. A candidate node is a
token sequence ``(y_1, .., y_d)`` with each ``y_k`` among the top-K tokens of row k
(K = min(budget, V)); its score is ``s = q_1(y_1) + .. + q_d(y_d)``, summed in float32
from the root down (``s(child) = s(parent) + q_d(y_d)``, one rounding per edge). The
DDTree tree is the set of the ``budget`` best candidates. Scores never increase along a
path, so that set is prefix-closed, and a heap that pops the best candidate and pushes
its next sibling and first child returns it in order.

Order and ties. Candidates are ranked by the total order

    1. higher score first;
    2. then smaller depth (a parent always precedes its children, even when the child's
       draft log-probability is exactly 0);
    3. then, at equal depth, smaller ``i + r``, then smaller ``i``, where ``i`` is the
       parent's position among the nodes of its own depth (in this same order; the root
       is position 0 of depth 0) and ``r`` is the token's rank in its row's top-K (rows
       are ranked by logit, equal logits by smaller token id).

The tree holds the first ``budget`` candidates of this order, in this order, in slots
1..budget. A heap keyed on ``(-score, depth, i + r, i)`` pops them in exactly this
order, which is what ``tev_jax.testing.heap_ddtree`` does. (Rule 3 is a tie-break only; it
is the anti-diagonal order in which the jitted builder lists its candidate pairs, the
order that makes XLA:CPU's top_k about three times faster than a row-major one.)

Masked tokens. ``-inf`` logits are legitimate (masked vocabulary entries). A candidate
whose score is ``-inf`` is never selected: when fewer than ``budget`` candidates have a
finite score (tiny V, many masked tokens, or ``budget`` close to what H rows can give),
the remaining slots are padding (``valid = False``). NaN, ``+inf`` and rows that are
entirely ``-inf`` make the scores undefined; ``check_draft_logits`` rejects them on the
host.

Static shapes. Everything is a pure function of arrays, to be jitted at the call site
with ``budget`` static, and vmapped over a batch of logit blocks and root tokens::

    build = jax.jit(jax.vmap(build_tree, in_axes=(0, 0, None)), static_argnums=2)
    tree_BN, info_BN = build(draft_logits_BHV, roots_B, 64)

`build_trees` is the batched builder both decoding and ExitTrain use: one top-k over a
whole batch of rows (per vocabulary shard under a mesh, or over vocabulary blocks of the
LM head when the rows are hidden states), then `build_tree_from_topk` row by row.

The jitted algorithm keeps, for every depth d, the best ``budget`` candidates of that
depth in order: they are children of the kept depth-(d-1) list, and because both that
list and the row's top-K are sorted, the pair (parent position i, token rank r) is
beaten by every pair (i' <= i, r' <= r), so only pairs with (i+1)(r+1) <= budget can
make the cut (about ``budget * ln(budget)`` pairs, fixed at trace time). The tree is
then the best ``budget`` of the H kept lists.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from tev_jax import vocab
from tev_jax.models import lm_head
from tev_jax.models.lm_head import HeadRows
from tev_jax.tree import DraftTree


@struct.dataclass
class BuildInfo:
    """Per-slot draft quantities of a built tree (shapes [N] like the tree's fields).

    Attributes:
      logq: float32 [N], ``q_depth(token)``: the draft log-probability of the node's
        token in its row; 0 at the root and at padding.
      score: float32 [N], cumulative draft log-probability of the path root..node (the
        builder's priority); 0 at the root and at padding.
    """

    logq: jax.Array
    score: jax.Array


def check_draft_logits(draft_logits, budget: int | None = None, root_token=None) -> None:
    """Validates a builder's inputs on the host.

    Args:
      draft_logits: [..., H, V] drafter logits (leading axes are a batch).
      budget: the node budget (not counting the root), or None to skip the check.
      root_token: optional root token id(s); must lie in [0, V).

    Raises:
      ValueError: naming the problem: wrong rank or empty axes, a non-float dtype, a
        negative or non-integer budget, NaN or +inf logits, or a row whose logits are
        all -inf (no token could be drafted there). ``-inf`` entries are otherwise
        allowed: they are masked tokens and never enter a tree.
    """
    logits = np.asarray(draft_logits)
    if logits.ndim < 2:
        raise ValueError(f"draft_logits must have shape [..., H, V], got {logits.shape}")
    if 0 in logits.shape:
        raise ValueError(f"draft_logits must have at least one row and one token, got {logits.shape}")
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"draft_logits must be floating point, got {logits.dtype}")
    logits = logits.astype(np.float32)  # bfloat16 and float16 included
    if budget is not None and (
        isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 0
    ):
        raise ValueError(f"budget must be an int >= 0, got {budget!r}")
    for what, bad in (("NaN", np.isnan(logits)), ("+inf", np.isposinf(logits))):
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0][:-1])
            raise ValueError(f"draft_logits row {where} contains {what}")
    dead = np.all(np.isneginf(logits), axis=-1)
    if dead.any():
        where = tuple(int(i) for i in np.argwhere(dead)[0])
        raise ValueError(f"draft_logits row {where} is entirely -inf: no token can be drafted")
    if root_token is not None:
        root = np.asarray(root_token)
        if not np.issubdtype(root.dtype, np.integer):
            raise ValueError(f"root_token must be an integer token id, got dtype {root.dtype}")
        if ((root < 0) | (root >= logits.shape[-1])).any():
            raise ValueError(f"root_token must lie in [0, V={logits.shape[-1]}), got {root}")


def topk_logq(draft_logits_HV: jax.Array, k: int, lead_names=()
              ) -> tuple[jax.Array, jax.Array]:
    """Top-k tokens of every row and their draft log-probabilities.

    Args:
      draft_logits_HV: [..., H, V] drafter logits (leading axes are a batch).
      k: tokens kept per row, 1 <= k <= V (static).
      lead_names: logical axis names of the leading axes (e.g. ``("batch", None)``),
        which keep their sharding when the vocabulary is sharded over a mesh.

    Returns:
      ``(tokens_HK int32, logq_HK float32)`` [..., H, k], each row sorted by logit
      descending, equal logits by token id ascending; ``logq = logit - logsumexp(row)``.
      Exact under any mesh: a vocabulary split over devices gets a local top-k per
      shard and a merge of the winners (`tev_jax.vocab.vocab_top_k`).
    """
    logits = _canonical(draft_logits_HV)
    # On XLA:CPU the top-k result sits behind an optimization barrier; without it XLA
    # may rewrite top_k over the vocabulary into a full sort when its outputs are
    # sliced or computed on (100x slower; docs/design.md §5).
    top_HK, tokens_HK = vocab.vocab_top_k(logits, k, lead_names)
    lse_H = jax.nn.logsumexp(logits, axis=-1)
    return tokens_HK, top_HK - lse_H[..., None]


def _canonical(draft_logits_HV: jax.Array) -> jax.Array:
    """float32 logits with -0.0 turned into +0.0 (top_k orders -0.0 below +0.0)."""
    logits = draft_logits_HV.astype(jnp.float32)
    return jnp.where(logits == 0, jnp.float32(0), logits)


def _static_budget(budget) -> int:
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 0:
        raise ValueError(f"budget must be a static int >= 0, got {budget!r}")
    return int(budget)


def _root_only(root_token) -> tuple[DraftTree, BuildInfo]:
    root = jnp.asarray(root_token, jnp.int32)[None]
    zero = jnp.zeros((1,), jnp.float32)
    tree = DraftTree(root, jnp.full((1,), -1, jnp.int32), jnp.zeros((1,), jnp.int32),
                     jnp.ones((1,), bool))
    return tree, BuildInfo(zero, zero)


@functools.lru_cache(maxsize=None)
def _pairs(budget: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(parent position i, token rank r) with (i+1)(r+1) <= budget, ordered by (i+r, i)."""
    i = np.arange(budget)
    counts = np.minimum(budget // (i + 1), k)
    pi = np.repeat(i, counts)
    pr = np.arange(pi.size) - np.repeat(np.cumsum(counts) - counts, counts)
    order = np.lexsort((pi, pi + pr))
    return pi[order].astype(np.int32), pr[order].astype(np.int32)


def build_tree_from_topk(
    tokens_HK: jax.Array, logq_HK: jax.Array, root_token: jax.Array, budget: int
) -> tuple[DraftTree, BuildInfo]:
    """The DDTree of ``budget`` nodes from per-row top-K tokens and log-probabilities.

    Args:
      tokens_HK: int32 [H, K], row d-1 holds depth d's top-K tokens, best first.
      logq_HK: float32 [H, K], their draft log-probabilities, non-increasing per row
        (``-inf`` entries are never selected).
      root_token: int32 scalar, the tree's root token.
      budget: nodes besides the root (static, >= 0); N = budget + 1.

    Returns:
      ``(tree, info)``: a ``DraftTree`` with N slots in the order of the module
      docstring, and its ``BuildInfo``.
    """
    budget = _static_budget(budget)
    if budget == 0:
        return _root_only(root_token)
    horizon, k = logq_HK.shape
    root = jnp.asarray(root_token, jnp.int32)
    logq_HK = logq_HK.astype(jnp.float32)
    tokens_HK = tokens_HK.astype(jnp.int32)
    k = min(k, budget)
    logq_HK, tokens_HK = logq_HK[:, :k], tokens_HK[:, :k]

    # Depth 1: the row's top-K, padded to `budget` kept slots.
    pad = budget - k
    score1 = jnp.concatenate([logq_HK[0], jnp.full((pad,), -jnp.inf, jnp.float32)])
    rank1 = jnp.concatenate([jnp.arange(k, dtype=jnp.int32), jnp.zeros((pad,), jnp.int32)])
    parent1 = jnp.zeros((budget,), jnp.int32)

    pi, pr = _pairs(budget, k)

    def depth_step(score_prev_P, logq_K):
        pair_score_M = score_prev_P[pi] + logq_K[pr]
        score_P, idx_P = jax.lax.top_k(pair_score_M, budget)
        return score_P, (score_P, jnp.asarray(pi)[idx_P], jnp.asarray(pr)[idx_P])

    def scanned(score1, logq_HK):
        _, (score_rest, parent_rest, rank_rest) = jax.lax.scan(depth_step, score1, logq_HK[1:])
        return (jnp.concatenate([score1[None], score_rest]),
                jnp.concatenate([parent1[None], parent_rest]),
                jnp.concatenate([rank1[None], rank_rest]))

    def unrolled(score1, logq_HK):
        scores, parents, ranks = [score1], [parent1], [rank1]
        for d in range(1, horizon):
            score, (_, parent, rank) = depth_step(scores[-1], logq_HK[d])
            scores.append(score)
            parents.append(parent)
            ranks.append(rank)
        return jnp.stack(scores), jnp.stack(parents), jnp.stack(ranks)

    # On GPU the depths are unrolled: the scan launched seven kernels per depth (its
    # stacked outputs written one dynamic slice at a time), the unrolled steps two (the
    # pair scores and their top-k). XLA:CPU compiles the scan faster (0.5-1 s less).
    score_DP, parent_DP, rank_DP = jax.lax.platform_dependent(
        score1, logq_HK, cuda=unrolled, default=scanned)

    # Best `budget` over all depths; equal scores keep (depth, position) order.
    best_score, flat = jax.lax.top_k(score_DP.reshape(-1), budget)
    depth0, pos = flat // budget, flat % budget
    valid = best_score > -jnp.inf
    slot_of_flat = jnp.zeros((horizon * budget,), jnp.int32).at[flat].set(
        jnp.arange(1, budget + 1, dtype=jnp.int32))
    parent_flat = (depth0 - 1) * budget + parent_DP[depth0, pos]
    parent_slot = jnp.where(depth0 == 0, 0, slot_of_flat[jnp.maximum(parent_flat, 0)])
    rank = rank_DP[depth0, pos]
    token = tokens_HK[depth0, rank]
    logq = logq_HK[depth0, rank]

    def with_root(root_value, values, pad_value):
        return jnp.concatenate([jnp.asarray(root_value, values.dtype)[None],
                                jnp.where(valid, values, pad_value)])

    tree = DraftTree(
        tokens=with_root(root, token, 0),
        parents=with_root(-1, parent_slot, -1),
        depths=with_root(0, depth0 + 1, 0),
        valid=with_root(True, valid, False),
    )
    info = BuildInfo(logq=with_root(0.0, logq, 0.0), score=with_root(0.0, best_score, 0.0))
    return tree, info


def build_tree(
    draft_logits_HV: jax.Array, root_token: jax.Array, budget: int
) -> tuple[DraftTree, BuildInfo]:
    """DDTree's best-first tree of ``budget`` nodes from one block of draft logits.

    Args:
      draft_logits_HV: [H, V] drafter logits; row d-1 is depth d. Check them with
        ``check_draft_logits`` on the host first.
      root_token: int32 scalar, the root (last committed, not yet consumed) token.
      budget: nodes besides the root (static, >= 0); N = budget + 1, K = min(budget, V).

    Returns:
      ``(tree, info)``: the ``DraftTree`` [N] (slots ordered as in the module
      docstring, padded when fewer than ``budget`` candidates have a finite score) and
      its ``BuildInfo`` [N].
    """
    budget = _static_budget(budget)
    if budget == 0:
        return _root_only(root_token)
    tokens_HK, logq_HK = topk_logq(draft_logits_HV, min(budget, draft_logits_HV.shape[-1]))
    return build_tree_from_topk(tokens_HK, logq_HK, root_token, budget)


# ------------------------------------------------------------------ batched trees


def tree_k(draft, budget: int) -> int:
    """K of the builder for ``draft``'s rows: ``min(budget, V)``, at least 1 (static).

    Args:
      draft: [..., H, V] draft logits or their `tev_jax.models.lm_head.HeadRows`.
      budget: the node budget.
    """
    vocab = draft.head.vocab if isinstance(draft, HeadRows) else draft.shape[-1]
    return max(1, min(budget, vocab))


def draft_top_k(draft, k: int, lead_names=(), block: int = lm_head.BLOCK
                ) -> tuple[jax.Array, jax.Array]:
    """Top-k tokens of every (detached) draft row and their draft log-probabilities.

    Args:
      draft: [..., H, V] draft logits (`topk_logq`), or their `HeadRows`: hidden states
        and the frozen LM head, read over vocabulary blocks of ``block`` entries
        (`tev_jax.models.lm_head.top_k`: no [.., V] row is formed).
      k: static, 1 <= k <= V (and <= ``block`` for `HeadRows`).
      lead_names: logical axis names of the logits' leading axes (see `topk_logq`).
    Returns:
      ``(tokens int32, logq float32)`` [..., H, k], ordered as `topk_logq` orders them.
    """
    if isinstance(draft, HeadRows):
        values, tokens, lse = lm_head.top_k(draft.hidden, draft.head, k, block)
        return tokens, values - lse[..., None]
    return topk_logq(jax.lax.stop_gradient(draft), k, lead_names)


def build_trees(draft, roots_X: jax.Array, budget: int, *, lead_names=(),
                block: int = lm_head.BLOCK, top=None) -> DraftTree:
    """The DDTree of every row of a batch, from one top-k over the whole batch.

    Decoding builds its trees here from the drafter's logits [B, H, V] (through
    `tev_jax.extensions.DDTreeBuilder`), ExitTrain from the draft rows of every anchor
    [B, A, H, .] as `HeadRows`; both get the trees of `build_tree` row by row.

    Args:
      draft: [*X, H, V] draft logits, or their `HeadRows` (see `draft_top_k`).
      roots_X: int [*X] root tokens.
      budget: nodes besides the root (static, >= 0); N = budget + 1.
      lead_names: logical axis names of the logits' leading axes X, kept when the
        vocabulary is sharded over a mesh (e.g. ``("batch",)``).
      block: vocabulary entries per block of the `HeadRows` top-k.
      top: optional precomputed ``draft_top_k(draft, tree_k(draft, budget), ...)``.
    Returns:
      A `DraftTree` with fields [*X, N].
    """
    budget = _static_budget(budget)
    if top is None:
        names = tuple(lead_names) + (None,) if lead_names else ()
        top = draft_top_k(draft, tree_k(draft, budget), names, block)
    tokens_XHK, logq_XHK = top
    lead, (h, k) = tokens_XHK.shape[:-2], tokens_XHK.shape[-2:]
    build = jax.vmap(lambda t, q, r: build_tree_from_topk(t, q, r, budget)[0])
    trees = build(tokens_XHK.reshape((-1, h, k)), logq_XHK.reshape((-1, h, k)),
                  jnp.asarray(roots_X, jnp.int32).reshape(-1))
    return jax.tree.map(lambda x: x.reshape(lead + x.shape[1:]), trees)


def build_chain(draft_logits_HV: jax.Array, root_token: jax.Array) -> tuple[DraftTree, BuildInfo]:
    """The plain DFlash proposal (argmax of every row) as a chain; N = H + 1.

    Args:
      draft_logits_HV: [H, V] drafter logits; row d-1 is depth d.
      root_token: int32 scalar, the root token.

    Returns:
      ``(tree, info)``: slot d holds depth d's argmax (smallest id on ties), with parent
      d-1; ``info.score`` sums the log-probabilities in float32 from the root down, as
      the tree builder does.
    """
    logits = _canonical(draft_logits_HV)
    horizon = logits.shape[0]
    token_H = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logq_H = jnp.max(logits, axis=-1) - jax.nn.logsumexp(logits, axis=-1)

    def add(total, x):
        total = total + x
        return total, total

    _, score_H = jax.lax.scan(add, jnp.float32(0), logq_H)
    slots = jnp.arange(horizon + 1, dtype=jnp.int32)
    zero = jnp.zeros((1,), jnp.float32)
    tree = DraftTree(
        tokens=jnp.concatenate([jnp.asarray(root_token, jnp.int32)[None], token_H]),
        parents=slots - 1,
        depths=slots,
        valid=jnp.ones((horizon + 1,), bool),
    )
    return tree, BuildInfo(logq=jnp.concatenate([zero, logq_H]),
                           score=jnp.concatenate([zero, score_H]))
