"""The round trace: what every decode round did, row by row, for research.

A round (docs/design.md §7) drafts a block, builds a tree, verifies it with the target, decides
and commits. Its `RoundRecord` keeps, per row: the tree, the drafter's and the target's
log-probabilities of every node's token (the target's under the node's tree ancestors,
at T = 1: what on-policy drafter training, `tev_jax.draft_opd`, supervises with), the
verdict (accepted path, its length, the bonus token, the exit
node), the committed length before the round and whether the row was still decoding.
`tev_jax.engine.Engine.trace`, ``generate(..., trace=True)`` and
``profile_generate(..., trace=True)`` stack a generation's records per round into a
`RoundTrace` (``Generation.trace``)::

    gen = tj.generate(target, drafter, prompts, config, key, trace=True)
    t = gen.trace                          # fields [R, B, ...], host numpy
    t.verdict.length[r, b]                 # accepted draft tokens + 1 in round r
    t.tree.tokens[r, b, t.verdict.path[r, b, :t.verdict.length[r, b]]]   # accepted path
    t.blocks(b)                            # the output block of every round of row b

The key schedule (`tev_jax.decode.row_keys` and `tev_jax.decode.step_keys`, its one
implementation): row b of a generation of key ``k`` has the key ``k_b = fold_in(k, b)``;
its first token is drawn with ``fold_in(k_b, 0)`` and the verdict of its r-th round (r =
1, 2, ...; without a drafter, its token) with ``fold_in(k_b, r)``. A row's random numbers
depend on its own key and rounds only, so a round can be replayed from its state's keys
alone, the traced, fused and profiled paths give the same tokens for the same key, and a
row gives the same tokens in any batch (continuous batching's j-th request has row
j's key).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from tev_jax.tree import DraftTree
from tev_jax.verify import Verdict


@struct.dataclass
class RoundRecord:
    """One round of B rows (device arrays; `RoundTrace` stacks them on the host).

    Attributes:
      tree: the `DraftTree` of every row, fields [B, N] (root = the pending token).
      draft_logp_BN: float32 [B, N] ``log q_{depth(v)}(tokens[v])``, the drafter's
        log-probability of each node's token in its depth's row; 0 at the root, on
        padding and without draft logits (AR rounds).
      target_logp_BN: float32 [B, N] ``log p(tokens[v] | context, ancestors of v)``, the
        target's log-probability (T = 1, no sampling transform) of each node's token
        given the committed context and the node's tree ancestors; 0 at the root and
        on padding.
      bonus_logp_B: float32 [B] the target's log-probability (T = 1) of the bonus token
        after the exit node.
      verdict: the `tev_jax.verify.Verdict` of every row: path [B, H+1] (-1 padded),
        length [B] (accepted draft tokens + 1), bonus [B], exit_node [B].
      start_B: int32 [B] committed length before the round (the root's position).
      active_B: bool [B] whether the row was still decoding (a finished row's verdict
        is computed but not committed).
    """

    tree: DraftTree
    draft_logp_BN: jax.Array
    target_logp_BN: jax.Array
    bonus_logp_B: jax.Array
    verdict: Verdict
    start_B: jax.Array
    active_B: jax.Array


def _log_probs(logits_BRV: jax.Array, row_BM: jax.Array, tokens_BM: jax.Array) -> jax.Array:
    """float32 [B, M]: ``log softmax(logits[b, row[b, m]])[tokens[b, m]]``, from one
    log-normaliser per row and one gathered logit per entry (no [B, M, V] array)."""
    logits_BRV = logits_BRV.astype(jnp.float32)
    lse_BR = jax.nn.logsumexp(logits_BRV, axis=-1)
    b_B1 = jnp.arange(row_BM.shape[0])[:, None]
    return logits_BRV[b_B1, row_BM, tokens_BM] - lse_BR[b_B1, row_BM]


def round_record(start_B: jax.Array, done_B: jax.Array, draft_logits_BHV, tree: DraftTree,
                 target_logits_BNV: jax.Array, verdict: Verdict) -> RoundRecord:
    """The `RoundRecord` of one round from its stages' outputs.

    Args:
      start_B, done_B: the state's committed lengths and finished rows before the round.
      draft_logits_BHV: float [B, H, V] the draft stage's logits, or None.
      tree: the build stage's `DraftTree` [B, N].
      target_logits_BNV: float [B, N, V] the verify stage's logits (row v: the target's
        next-token logits after node v).
      verdict: the decide stage's `Verdict` [B, ...].
    """
    b, n = tree.tokens.shape
    node_BN = tree.valid & (tree.depths > 0)
    if draft_logits_BHV is None:
        draft_logp_BN = jnp.zeros((b, n), jnp.float32)
    else:
        row_BN = jnp.clip(tree.depths - 1, 0, draft_logits_BHV.shape[1] - 1)
        draft_logp_BN = jnp.where(node_BN, _log_probs(draft_logits_BHV, row_BN, tree.tokens),
                                  0.0)
    parent_BN = jnp.maximum(tree.parents, 0)
    target_logp_BN = jnp.where(node_BN, _log_probs(target_logits_BNV, parent_BN, tree.tokens),
                               0.0)
    bonus_logp_B = _log_probs(target_logits_BNV, verdict.exit_node[:, None],
                              verdict.bonus[:, None])[:, 0]
    return RoundRecord(tree=tree, draft_logp_BN=draft_logp_BN,
                       target_logp_BN=target_logp_BN, bonus_logp_B=bonus_logp_B,
                       verdict=verdict, start_B=start_B, active_B=~done_B)


@dataclasses.dataclass(frozen=True)
class RoundTrace:
    """The records of a generation's rounds, stacked (host numpy arrays, R rounds).

    Attributes:
      tree: `DraftTree` with fields [R, B, N].
      draft_logp_RBN: float32 [R, B, N] (`RoundRecord.draft_logp_BN`).
      target_logp_RBN: float32 [R, B, N] (`RoundRecord.target_logp_BN`).
      bonus_logp_RB: float32 [R, B] (`RoundRecord.bonus_logp_B`).
      verdict: `Verdict` with path [R, B, H+1], length [R, B], bonus [R, B],
        exit_node [R, B].
      start_RB: int32 [R, B] committed length before each round.
      active_RB: bool [R, B] rows still decoding in each round.
    """

    tree: DraftTree
    draft_logp_RBN: np.ndarray
    target_logp_RBN: np.ndarray
    bonus_logp_RB: np.ndarray
    verdict: Verdict
    start_RB: np.ndarray
    active_RB: np.ndarray

    @property
    def rounds(self) -> int:
        return int(self.active_RB.shape[0])

    @property
    def block_lengths(self) -> np.ndarray:
        """int [R, B] output-block length per round (0 where the row had finished), as
        `tev_jax.generation.DecodeStats.block_lengths`."""
        return np.where(self.active_RB, self.verdict.length, 0)

    def blocks(self, row: int) -> list[list[int]]:
        """The output block of each round in which ``row`` was active: the accepted
        path's tokens after the root, then the bonus (before truncation at a stop
        token or at max_new_tokens)."""
        out = []
        for r in range(self.rounds):
            if not self.active_RB[r, row]:
                continue
            n = int(self.verdict.length[r, row])
            path = self.verdict.path[r, row, 1:n]
            out.append([int(t) for t in self.tree.tokens[r, row, path]]
                       + [int(self.verdict.bonus[r, row])])
        return out


def stack_records(records: Sequence[RoundRecord]) -> RoundTrace | None:
    """The `RoundTrace` of a generation's records in round order (None without rounds)."""
    if not records:
        return None
    host = jax.device_get(list(records))
    stacked = jax.tree.map(lambda *x: np.stack(x), *host)
    return RoundTrace(tree=stacked.tree, draft_logp_RBN=stacked.draft_logp_BN,
                      target_logp_RBN=stacked.target_logp_BN,
                      bonus_logp_RB=stacked.bonus_logp_B, verdict=stacked.verdict,
                      start_RB=stacked.start_B,
                      active_RB=stacked.active_B)


__all__ = ["RoundRecord", "RoundTrace", "round_record", "stack_records"]
