"""Preemption: stop between updates with a checkpoint when the job gets SIGTERM.

Two mechanisms, chosen by how the job runs:

- **distributed runtime** (``jax.distributed.initialize`` was called, any number of
  processes): jax's preemption sync manager catches SIGTERM in every process, tells
  the others through the coordinator, and
  ``jax.experimental.multihost_utils.reached_preemption_sync_point(step)`` (through
  orbax's ``CheckpointManager.reached_preemption``) becomes True at the same update
  everywhere (the fastest process's next update), so every process saves the same
  step. No Python signal handler is installed: it would replace jax's.
- **one process without it**: a Python SIGTERM handler sets a flag that the loop reads
  after each update.

Either way the loop saves (forced) at that update, waits for the save to commit and
returns; rerunning the same command resumes from it.
"""

from __future__ import annotations

import signal
import threading

import jax


class PreemptionWatch:
    """Context manager answering "save and stop after this update?".

    Args:
      checkpointer: a `train.checkpoint.TrainCheckpointer` (for the sync point).
    """

    def __init__(self, checkpointer):
        self._checkpointer = checkpointer
        self._distributed = jax.distributed.is_initialized()
        self._flag = threading.Event()
        self._previous = None

    def __enter__(self):
        if not self._distributed and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, lambda *_: self._flag.set())
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def reached(self, update: int) -> bool:
        """Call once after every update (all processes): True means save and stop."""
        if self._distributed:
            return self._checkpointer.reached_preemption(update)
        return self._flag.is_set()


__all__ = ["PreemptionWatch"]
