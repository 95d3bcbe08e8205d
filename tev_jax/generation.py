"""What a generation returns: the tokens, their lengths and the statistics of the run."""

from __future__ import annotations

import dataclasses

import numpy as np

from tev_jax.trace import RoundTrace


@dataclasses.dataclass(frozen=True)
class DecodeStats:
    """Statistics of one generation (host numpy arrays).

    Attributes:
      rounds: loop iterations run (the longest row's rounds).
      rounds_per_row: int [B] rounds in which the row was still active.
      kv_moves: int [B] rounds in which the accepted path was not the first slots of the
        tree, so that commit moved key/value entries (DDTree paths through later slots).
      block_lengths: int [R, B] output-block length (accepted + bonus) per round and row
        (before truncation at a stop token or at M); 0 where the row was finished.
      expected_lengths: float [R, B] the exit law's ``1 + coverage`` of the same trees
        (``track_exit_law``), else None.
      stage_seconds: per-stage wall seconds up to ``block_until_ready``, summed over
        rounds (`tev_jax.costs.timing.profile_generate` only; keys 'prefill', 'draft',
        'build', 'verify', 'decide', 'commit'; each includes the stage call's
        dispatch), else None.
      round_seconds: the per-round stage times behind ``stage_seconds`` (stage ->
        float [R]; the prefill has one entry), for robust statistics such as medians
        on a loaded machine (`tev_jax.costs.timing.profile_generate` only), else None.
      seconds: wall time of the timed call (`tev_jax.costs.timing`), else None.
      compile_seconds: wall time of the first (compiling) call (`tev_jax.costs.timing`),
        else None.
      experts_touched: int [R, layers] for a target with a mixture of experts: how many
        distinct experts each layer ran in each round's tree pass (over all rows; 0 for
        dense layers), i.e. how much of its expert weights the round read; else None.
    """

    rounds: int
    rounds_per_row: np.ndarray
    kv_moves: np.ndarray
    block_lengths: np.ndarray
    expected_lengths: np.ndarray | None = None
    stage_seconds: dict[str, float] | None = None
    round_seconds: dict[str, np.ndarray] | None = None
    seconds: float | None = None
    compile_seconds: float | None = None
    experts_touched: np.ndarray | None = None

    @property
    def tau(self) -> float:
        """Mean output-block length per round (bonus included), over all rows."""
        n = int(self.rounds_per_row.sum())
        return float(self.block_lengths.sum()) / n if n else float("nan")


@dataclasses.dataclass(frozen=True)
class Generation:
    """The output of a generation.

    Attributes:
      tokens: int32 [B, M] generated tokens only; ``PAD_TOKEN`` (-1) after each row's end.
      lengths: int32 [B] generated tokens per row (a final stop token included).
      stats: `DecodeStats`.
      trace: the `tev_jax.trace.RoundTrace` of every round (trees, draft
        log-probabilities, verdicts), when asked for (``trace=True``), else None.
    """

    tokens: np.ndarray
    lengths: np.ndarray
    stats: DecodeStats
    trace: RoundTrace | None = None

    def rows(self) -> list[list[int]]:
        """The generated tokens of every row as Python lists (padding removed)."""
        return [t[:n].tolist() for t, n in zip(self.tokens, self.lengths)]


__all__ = ["DecodeStats", "Generation"]
