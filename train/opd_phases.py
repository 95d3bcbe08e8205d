"""The rollout phases of a Draft-OPD run (``objective='opd'``).

An opd run alternates: phase p starts at update ``p * opd_steps``, where the current
drafter decodes ``opd_prompts`` training prompts with the frozen target
(`train.opd_rollouts.collect_rounds`: the public engine, the configured builder, budget,
verifier and temperature); the next ``opd_steps`` updates train `tev_jax.draft_opd` on
those rounds; then the rollouts are refreshed. The prompts of phase p are a pure
function of (seed, p) (`train.opd_rollouts.phase_prompt_ids`) and its decode key is
``fold_in(key(seed), p)``, so a phase's rounds are a pure function of the drafter at
its first update.

Resume: every phase's buffer is written to ``<out_dir>/opd_rollouts/phase-<p>.npz``
before its first update trains on it. A run resumed in the middle of phase p reads it
back; one resumed at the first update of p (where the buffer may not have been written)
regenerates it from the restored drafter, which is the drafter that made it, or reads
it after checking that it was made from these parameters. Either way a resumed run
trains on the same rounds as an uninterrupted one. Buffers of phases before the
oldest kept checkpoint are deleted.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from train.opd_rollouts import (
    RolloutPlan,
    RoundBuffer,
    collect_rounds,
    phase_prompt_ids,
    training_prompts,
)

FOLDER = "opd_rollouts"


def params_fingerprint(params) -> list[float]:
    """Per-leaf (sum, sum of squares) of the drafter's parameters (host floats): the
    same for the same parameters on the same devices."""
    sums = jax.tree.map(lambda x: jnp.stack([jnp.sum(x.astype(jnp.float32)),
                                             jnp.sum(jnp.square(x.astype(jnp.float32)))]),
                        params)
    return [float(v) for leaf in jax.tree.leaves(jax.device_get(sums)) for v in leaf]


class OpdPhases:
    """Produces the rollout buffer of every update of an opd run.

    Args:
      cfg: the run's `train.config.TrainConfig` (objective 'opd').
      target: the frozen target (placed for training).
      data: the `train.rollouts.RolloutSet` whose prompts are rolled out.
      merge: ``params -> drafter module`` (the step's parameters merged back).
      mesh: the training mesh (the engine decodes on it), or None.
      run_key: identifies the run (config and data); recorded in every buffer.
      stop_token_ids: tokens that end a rollout response.
      progress: show a progress bar per rollout phase.
    """

    def __init__(self, cfg, target, data, merge, mesh, run_key: str,
                 stop_token_ids=(), progress: bool = True):
        if jax.process_count() > 1:
            raise ValueError("an opd run alternates rollouts and training in one process; "
                             "multi-host opd runs are not supported")
        self.cfg = cfg
        self.target = target
        self.merge = merge
        self.mesh = mesh
        self.run_key = run_key
        self.progress = progress
        self.data = data
        starts = data.spans[:, 0]
        if (starts <= 0).any():
            raise ValueError(f"an opd run decodes the prompts of its rollouts, and sequence "
                             f"{int(np.argmax(starts <= 0))} has an empty prompt (its "
                             "response span starts at 0)")
        batch = cfg.opd_rollout_batch
        self.plan = RolloutPlan(max_new_tokens=cfg.opd_max_new_tokens,
                                builder=cfg.opd_builder, budget=cfg.budget,
                                verifier=cfg.opd_verifier, temperature=cfg.opd_temperature,
                                batch_size=batch,
                                prompt_len=int(starts.max()),
                                stop_token_ids=tuple(stop_token_ids))
        self.directory = Path(cfg.out_dir) / FOLDER
        self.phase = None
        self.buffer: RoundBuffer | None = None
        self.last_seconds = 0.0     # of the last phase rolled out (0: read back)

    def path(self, phase: int) -> Path:
        return self.directory / f"phase-{phase:06d}.npz"

    def phase_of(self, update: int) -> int:
        return update // self.cfg.opd_steps

    def buffer_at(self, update: int, params) -> RoundBuffer:
        """The buffer that update ``update`` (0-based: the update about to run) trains
        on; rolls out a new phase at its first update.

        Args:
          params: the drafter's parameters before ``update``.
        Raises:
          ValueError: resumed inside a phase whose buffer is missing or of another run.
        """
        phase = self.phase_of(update)
        if phase == self.phase:
            return self.buffer
        first = update == phase * self.cfg.opd_steps
        path = self.path(phase)
        fingerprint = params_fingerprint(params) if first else None
        buffer = self._read(path, phase, fingerprint)
        self.last_seconds = 0.0
        if buffer is None:
            if not first:
                raise ValueError(
                    f"cannot resume at update {update}: the rollouts of phase {phase} (made "
                    f"at update {phase * self.cfg.opd_steps}) are not in {path}; they are "
                    "written before the phase trains, so this folder holds another run's "
                    "checkpoints: use another out_dir or resume=False")
            buffer = self._collect(phase, update, params, fingerprint)
            buffer.save(path)
        self.phase, self.buffer = phase, buffer
        return buffer

    def _read(self, path: Path, phase: int, fingerprint) -> RoundBuffer | None:
        if not path.is_file():
            return None
        try:
            buffer = RoundBuffer.load(path)
        except ValueError as e:
            print(f"opd: rolling out phase {phase} again: {e}", file=sys.stderr)
            return None
        info = buffer.info
        if info.get("run") != self.run_key or info.get("phase") != phase:
            return None
        if fingerprint is not None and info.get("params") != fingerprint:
            return None
        return buffer

    def _collect(self, phase: int, update: int, params, fingerprint) -> RoundBuffer:
        from tqdm.auto import tqdm

        ids = phase_prompt_ids(self.data.num_sequences, self.cfg.seed, phase,
                               self.cfg.opd_prompts)
        prompts = training_prompts(self.data.read(ids), self.data.spans[ids])
        key = jax.random.fold_in(jax.random.key(self.cfg.seed), phase)
        bar = tqdm(total=len(prompts), disable=not self.progress, unit="prompt",
                   desc=f"opd rollouts (phase {phase})", leave=False)
        t0 = time.perf_counter()
        try:
            buffer = collect_rounds(self.target, self.merge(params), prompts, self.plan, key,
                                    mesh=self.mesh, progress=bar.update,
                                    info={"run": self.run_key, "phase": phase,
                                          "update": update, "params": fingerprint,
                                          "prompt_ids": [int(i) for i in ids]})
        finally:
            bar.close()
        self.last_seconds = time.perf_counter() - t0
        if buffer.num_rounds == 0:
            raise ValueError(f"the rollouts of phase {phase} have no round to train on")
        return buffer

    def metrics(self) -> dict[str, float]:
        """The current buffer's figures for the log."""
        b = self.buffer
        return {"rollout_phase": float(self.phase), "rollout_tau": b.tau,
                "rollout_rounds": float(b.num_rounds),
                "rollout_seconds": float(self.last_seconds)}

    def prune(self, kept_steps) -> None:
        """Deletes the buffers of phases before the oldest kept checkpoint's."""
        if not kept_steps or not self.directory.is_dir():
            return
        oldest = self.phase_of(min(kept_steps))
        for path in self.directory.glob("phase-*.npz"):
            if int(path.stem.split("-")[1]) < oldest:
                path.unlink(missing_ok=True)

    def set_aside(self) -> None:
        """Moves an earlier run's buffers aside (a run that starts over)."""
        if self.directory.is_dir() and any(self.directory.iterdir()):
            moved = self.directory.with_name(f"{FOLDER}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
            shutil.move(str(self.directory), moved)


def run_key(fingerprint: dict, data_fingerprint: dict) -> str:
    """The hash of a run's config and data fingerprints (recorded in its buffers)."""
    return hashlib.sha256(json.dumps([fingerprint, data_fingerprint], sort_keys=True)
                          .encode()).hexdigest()[:16]


__all__ = ["FOLDER", "OpdPhases", "params_fingerprint", "run_key"]
