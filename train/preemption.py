"""Preemption: stop between updates with a checkpoint when the job gets SIGTERM (or SIGINT).

Two mechanisms, chosen by how the job runs:

- **distributed runtime** (``jax.distributed.initialize`` was called, any number of
  processes): jax's preemption sync manager catches SIGTERM in every process, tells
  the others through the coordinator, and
  ``jax.experimental.multihost_utils.reached_preemption_sync_point(step)`` (through
  orbax's ``CheckpointManager.reached_preemption``) becomes True at the same update
  everywhere (the fastest process's next update), so every process saves the same
  step. ``tev-train`` leaves SIGTERM to jax there (`tev_jax.runtime.signals.release`).
- **one process without it**: the signal is recorded (`tev_jax.runtime.signals`: ``tev-train``
  records SIGINT and SIGTERM; a library caller gets SIGTERM recorded while the loop
  runs) and the loop reads it after each update.

Either way the loop saves (forced) at that update, waits for the save to commit and
returns; rerunning the same command resumes from it.
"""

from __future__ import annotations

import contextlib
import signal

import jax

from tev_jax.runtime import signals


class PreemptionWatch:
    """Context manager answering "save and stop after this update?".

    Args:
      checkpointer: a `train.checkpoint.TrainCheckpointer` (for the sync point).
    """

    def __init__(self, checkpointer):
        self._checkpointer = checkpointer
        self._distributed = jax.distributed.is_initialized()
        self._handled = contextlib.ExitStack()

    def __enter__(self):
        if not self._distributed and not signals.handling(signal.SIGTERM):
            self._handled.enter_context(signals.handled_signals("train", (signal.SIGTERM,)))
        return self

    def __exit__(self, *exc):
        self._handled.close()

    def reached(self, update: int) -> bool:
        """Call once after every update (all processes): True means save and stop."""
        if self._distributed:
            return self._checkpointer.reached_preemption(update)
        return signals.requested() is not None

    @property
    def signal(self) -> int:
        """The signal that stopped the loop (SIGTERM under jax.distributed)."""
        return signals.requested() or signal.SIGTERM


__all__ = ["PreemptionWatch"]
