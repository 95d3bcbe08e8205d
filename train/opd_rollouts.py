"""Draft-OPD rollouts: the drafter's own speculative rounds, turned into supervision.

`collect_rounds` decodes prompts with the current drafter and the frozen target through
the public engine (`tev_jax.engine.generate(..., trace=True)`, the round trace of
`tev_jax.trace`), in batches of a fixed shape, and `tev_jax.draft_opd.round_targets`
turns each row's rounds into per-round targets. A `RoundBuffer` holds them::

    tokens   int32 [S, L]  each row's [prompt ; committed response], right-padded
    row_R    int32 [R]     the sequence of every round
    anchor_R int32 [R]     its root's position in that sequence
    response_RH, response_logp_RH, rejected_RH, rejected_logp_RH   as RoundTargets

`RoundBuffer.batch_at` draws the micro-batch of a step: B sequences (epoch-wise
shuffles of the sequences that have rounds) and A of each one's rounds (without
replacement; fewer are padded and marked invalid): a pure function of (buffer, seed,
step). `save` / `load` write it to one ``.npz`` (temporary name, then rename) with a
JSON record of how it was made, so that a resumed run reads the very rounds it trained
on.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

from tev_jax.draft_opd import round_targets
from train.anchors import step_rng
from train.opd_step import OpdBatch


@dataclasses.dataclass(frozen=True)
class RolloutPlan:
    """How a rollout phase decodes (the `tev_jax.decode.DecodeConfig` of its batches).

    Attributes:
      max_new_tokens: response length cap per prompt.
      builder, budget, verifier: the engine's tree builder, node budget and verifier.
      temperature: the decode's sampling temperature (the target's log-probabilities of
        the trace are at T = 1 whatever it is).
      batch_size: prompts decoded together (a last partial batch is padded with copies
        of its first prompt, so every batch has one compiled shape).
      prompt_len: the prompt buffer of every batch (the longest prompt of the set).
      stop_token_ids: tokens that end a response.
    """

    max_new_tokens: int
    builder: str
    budget: int
    verifier: str
    temperature: float
    batch_size: int
    prompt_len: int
    stop_token_ids: tuple[int, ...] = ()

    def decode_config(self):
        from tev_jax.decode import DecodeConfig
        from tev_jax.sampling import Sampling

        return DecodeConfig(max_new_tokens=self.max_new_tokens, builder=self.builder,
                            budget=self.budget, verifier=self.verifier,
                            sampling=Sampling(self.temperature),
                            stop_token_ids=tuple(self.stop_token_ids),
                            prompt_len=self.prompt_len)

    @property
    def seq_len(self) -> int:
        """L of the buffer: prompt buffer + responses, rounded up to a multiple of 8."""
        return -(-(self.prompt_len + self.max_new_tokens) // 8) * 8


@dataclasses.dataclass(frozen=True)
class RoundBuffer:
    """The rounds of one rollout phase (host numpy; see the module docstring).

    Attributes:
      tokens: int32 [S, L].
      row_R, anchor_R: int32 [R].
      response_RH, rejected_RH: int32 [R, H]; response_logp_RH, rejected_logp_RH:
        float32 [R, H].
      block_lengths_R: int32 [R] accepted drafts + 1 of every round (its output block).
      info: JSON-able record of how the buffer was made (phase, update, key, ...).
    """

    tokens: np.ndarray
    row_R: np.ndarray
    anchor_R: np.ndarray
    response_RH: np.ndarray
    response_logp_RH: np.ndarray
    rejected_RH: np.ndarray
    rejected_logp_RH: np.ndarray
    block_lengths_R: np.ndarray
    info: dict = dataclasses.field(default_factory=dict)

    ARRAYS = ("tokens", "row_R", "anchor_R", "response_RH", "response_logp_RH",
              "rejected_RH", "rejected_logp_RH", "block_lengths_R")

    @property
    def num_rounds(self) -> int:
        return int(self.row_R.shape[0])

    @property
    def horizon(self) -> int:
        return int(self.response_RH.shape[1])

    @property
    def tau(self) -> float:
        """Mean output block per round (accepted drafts + 1): the rollouts' τ."""
        return float(self.block_lengths_R.mean()) if self.num_rounds else 0.0

    def fingerprint(self) -> int:
        """A checksum of every array (for logs and tests)."""
        total = 0
        for name in self.ARRAYS:
            x = np.ascontiguousarray(getattr(self, name))
            total = (total * 1000003 + int(np.frombuffer(x.tobytes(), np.uint8)
                                           .astype(np.int64).sum())) % (1 << 61)
        return total

    def batch_at(self, seed: int, step: int, batch_size: int, num_anchors: int) -> OpdBatch:
        """Host `OpdBatch` of micro-batch ``step``: a pure function of (buffer, seed, step)."""
        rows = np.unique(self.row_R)
        if rows.size == 0:
            raise ValueError("the rollout buffer has no rounds to train on")
        counter = step * batch_size + np.arange(batch_size, dtype=np.int64)
        picked = np.empty(batch_size, np.int64)
        for e in np.unique(counter // rows.size):
            sel = counter // rows.size == e
            picked[sel] = rows[step_rng(seed, int(e), 2).permutation(rows.size)
                               [counter[sel] % rows.size]]
        rng = step_rng(seed, step, 3)
        rounds = np.zeros((batch_size, num_anchors), np.int64)
        valid = np.zeros((batch_size, num_anchors), bool)
        for i, row in enumerate(picked):
            mine = np.flatnonzero(self.row_R == row)
            take = rng.choice(mine, size=min(num_anchors, mine.size), replace=False)
            rounds[i, :take.size] = np.sort(take)
            valid[i, :take.size] = True
        gather = lambda x, fill: np.where(valid[..., None], x[rounds], fill)
        return OpdBatch(tokens=self.tokens[picked].astype(np.int32),
                        anchors=np.where(valid, self.anchor_R[rounds], 0).astype(np.int32),
                        valid=valid,
                        response=gather(self.response_RH, -1).astype(np.int32),
                        response_logp=gather(self.response_logp_RH, 0.0).astype(np.float32),
                        rejected=gather(self.rejected_RH, -1).astype(np.int32),
                        rejected_logp=gather(self.rejected_logp_RH, 0.0).astype(np.float32))

    def save(self, path: str | os.PathLike) -> None:
        """Writes one ``.npz`` (temporary name, then rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            with tmp.open("wb") as f:
                np.savez(f, info=np.asarray(json.dumps(self.info)),
                         **{name: getattr(self, name) for name in self.ARRAYS})
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike) -> "RoundBuffer":
        """Reads a buffer written by `save`.

        Raises:
          ValueError: the file is missing an array or cannot be read.
        """
        try:
            with np.load(path) as z:
                arrays = {name: z[name] for name in cls.ARRAYS}
                info = json.loads(str(z["info"]))
        except (OSError, KeyError, ValueError) as e:
            raise ValueError(f"{path}: not a readable rollout buffer ({e})") from e
        return cls(**arrays, info=info)


def collect_rounds(target, drafter, prompts: Sequence[Sequence[int]], plan: RolloutPlan,
                   key: jax.Array, *, mesh=None, info: dict | None = None,
                   progress=None) -> RoundBuffer:
    """Decodes ``prompts`` with ``drafter`` and ``target`` and keeps every round.

    Args:
      prompts: token ids, each at most ``plan.prompt_len`` long.
      plan: the decode settings.
      key: the phase's PRNG key; batch j decodes with ``fold_in(key, j)``.
      mesh: the engine's mesh (`tev_jax.engine.generate`), or None.
      info: recorded in the buffer.
      progress: called with the number of prompts each decoded batch adds.
    Returns:
      The `RoundBuffer` (rows in prompt order).
    """
    from tev_jax.engine import generate

    if not prompts:
        raise ValueError("no prompts to roll out")
    long = [len(p) for p in prompts if not 0 < len(p) <= plan.prompt_len]
    if long:
        raise ValueError(f"a prompt of {long[0]} tokens does not fit the rollout prompt "
                         f"buffer of {plan.prompt_len}")
    config = plan.decode_config()
    h = drafter.config.horizon
    length = plan.seq_len
    tokens = np.zeros((len(prompts), length), np.int32)
    parts = {name: [] for name in ("row", "anchor", "response", "response_logp",
                                   "rejected", "rejected_logp", "blocks")}
    for j in range(0, len(prompts), plan.batch_size):
        chunk = [list(p) for p in prompts[j:j + plan.batch_size]]
        real = len(chunk)
        chunk += [chunk[0]] * (plan.batch_size - real)
        batch_key = jax.random.fold_in(key, j // plan.batch_size)
        gen = generate(target, drafter, chunk, config, batch_key, mesh=mesh, trace=True)
        trace = gen.trace
        for b, row in enumerate(gen.rows()[:real]):
            seq = chunk[b] + list(row)
            tokens[j + b, :len(seq)] = seq
            rt = round_targets(trace, b, h)
            keep = rt.anchors_R < len(seq)
            active = np.flatnonzero(trace.active_RB[:, b])[keep]
            parts["row"].append(np.full(int(keep.sum()), j + b, np.int32))
            parts["anchor"].append(rt.anchors_R[keep])
            parts["response"].append(rt.response_RH[keep])
            parts["response_logp"].append(rt.response_logp_RH[keep])
            parts["rejected"].append(rt.rejected_RH[keep])
            parts["rejected_logp"].append(rt.rejected_logp_RH[keep])
            parts["blocks"].append(trace.verdict.length[active, b].astype(np.int32))
        if progress is not None:
            progress(real)
    cat = lambda name, shape, dtype: (np.concatenate(parts[name]).astype(dtype)
                                      if parts[name] else np.zeros(shape, dtype))
    return RoundBuffer(tokens=tokens, row_R=cat("row", (0,), np.int32),
                       anchor_R=cat("anchor", (0,), np.int32),
                       response_RH=cat("response", (0, h), np.int32),
                       response_logp_RH=cat("response_logp", (0, h), np.float32),
                       rejected_RH=cat("rejected", (0, h), np.int32),
                       rejected_logp_RH=cat("rejected_logp", (0, h), np.float32),
                       block_lengths_R=cat("blocks", (0,), np.int32), info=dict(info or {}))


def training_prompts(tokens_S: np.ndarray, spans_S2: np.ndarray) -> list[list[int]]:
    """The prompt of every training sequence (the tokens before its response span)."""
    return [list(map(int, tokens_S[i, :int(spans_S2[i, 0])])) for i in range(len(spans_S2))]


def phase_prompt_ids(num_prompts: int, seed: int, phase: int, per_phase: int) -> np.ndarray:
    """The prompt ids of rollout phase ``phase``: ``per_phase`` consecutive entries of
    epoch-wise shuffles of ``range(num_prompts)`` seeded by (seed, epoch), so phases
    walk through the whole set before repeating a prompt."""
    counter = phase * per_phase + np.arange(per_phase, dtype=np.int64)
    out = np.empty(per_phase, np.int64)
    for e in np.unique(counter // num_prompts):
        sel = counter // num_prompts == e
        out[sel] = step_rng(seed, int(e), 4).permutation(num_prompts)[counter[sel] % num_prompts]
    return out


__all__ = ["RolloutPlan", "RoundBuffer", "collect_rounds", "phase_prompt_ids",
           "training_prompts"]
