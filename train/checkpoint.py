"""Training checkpoints: an orbax `CheckpointManager` of (train state, JSON metadata).

Layout (one folder per step, written by orbax)::

    <directory>/
      200/  state/ (the array pytree, sharded)   meta/ (JSON: step, data position, ...)
      300/  ...

A save goes to a temporary folder that orbax renames into place only once it is
complete, so a run killed while saving leaves the last good checkpoint untouched (the
partial folder is ignored, and cleaned up by the next manager). Older steps beyond
``keep`` are deleted only after a newer save has committed.

With ``async_save`` a save returns once the arrays are copied to host memory (orbax's
default synchronous device-to-host transfer, so the caller may donate or overwrite
them) and the files are written in a background thread; the previous checkpoint is
still deleted only after the new one has committed.

Paths are `etils.epath.Path`: a ``gs://bucket/...`` directory works on a pod (local
paths are made absolute, remote ones are left as they are).

Restoring a step that is missing or unreadable raises a `ValueError` that names the
step, the path and the steps that are available; it never deletes anything.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or does not match the expected state."""


class TrainCheckpointer:
    """Saves every ``every`` steps (and on demand), keeps the last ``keep``, restores.

    Args:
      directory: checkpoint folder (created if missing), local or remote (``gs://``).
      every: save interval in steps (`save` skips other steps unless forced).
      keep: number of most recent checkpoints to keep (None keeps all).
      async_save: write in a background thread (call `wait` before reading them).
    """

    def __init__(self, directory: str | os.PathLike, *, every: int = 1000,
                 keep: int | None = 3, async_save: bool = False):
        if every < 1:
            raise ValueError(f"checkpoint interval must be >= 1, got {every}")
        if keep is not None and keep < 1:
            raise ValueError(f"checkpoints to keep must be >= 1 or None, got {keep}")
        self.directory = checkpoint_path(directory)
        self.every = int(every)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True,
            enable_async_checkpointing=async_save, cleanup_tmp_directories=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def all_steps(self) -> list[int]:
        """Committed checkpoint steps, ascending (read from disk)."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: Any, meta: dict[str, Any], *, force: bool = False) -> bool:
        """Saves ``state`` (a pytree of arrays) and JSON ``meta`` at ``step``.

        Returns:
          Whether a checkpoint was written: at multiples of ``every``, or any step with
          ``force`` (a step that already has a checkpoint is not written again).
        """
        if (not force and step % self.every) or step in self._manager.all_steps():
            return False
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  meta=ocp.args.JsonSave(dict(meta)))
        return bool(self._manager.save(int(step), args=args, force=True))

    def wait(self) -> None:
        """Blocks until pending asynchronous saves have committed."""
        self._manager.wait_until_finished()

    def reached_preemption(self, step: int) -> bool:
        """Whether every process has reached the preemption sync point ``step``.

        Needs the distributed runtime (``jax.distributed.initialize``): after any
        process gets SIGTERM, all of them agree on one step to save at. False
        without it (use a signal handler there, see `train.preemption`).
        """
        return bool(self._manager.reached_preemption(int(step)))

    def restore(self, abstract_state: Any, step: int | None = None
                ) -> tuple[Any, dict[str, Any], int]:
        """Restores a checkpoint.

        Args:
          abstract_state: pytree of ``jax.ShapeDtypeStruct`` (with ``sharding``) that
            the saved state must match; arrays come back with those shardings.
          step: the step to restore (default: the latest).
        Returns:
          (state, meta, step).
        Raises:
          CheckpointError: no checkpoint, the step is missing, or it cannot be read or
            does not match ``abstract_state``.
        """
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise CheckpointError(f"no checkpoint in {self.directory}")
            step = steps[-1]
        path = self.directory / str(step)
        if step not in steps:
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory} "
                                  f"(available steps: {steps or 'none'})")
        for item in ("state", "meta"):
            if not (path / item).is_dir():
                raise CheckpointError(f"checkpoint step {step} at {path} is incomplete: "
                                      f"'{item}' is missing (available steps: {steps})")
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                  meta=ocp.args.JsonRestore())
        try:
            out = self._manager.restore(int(step), args=args)
        except Exception as e:  # orbax / tensorstore / json raise many types
            _quiet_closed_loop_reports()
            raise CheckpointError(
                f"checkpoint step {step} at {path} cannot be restored "
                f"({type(e).__name__}: {str(e)[:300]}); other steps: "
                f"{[s for s in steps if s != step] or 'none'}") from e
        _check_restored(out.state, abstract_state, step, path)
        return out.state, dict(out.meta), int(step)

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _quiet_closed_loop_reports() -> None:
    """After a failed restore, tensorstore's pending reads call back into orbax's closed
    event loop, and Python reports each ``RuntimeError('Event loop is closed')`` through
    ``sys.unraisablehook`` (a traceback per array): drop those reports, pass the others
    on. Installed once."""
    previous = sys.unraisablehook
    if getattr(previous, "drops_closed_loop", False):
        return

    def hook(unraisable):
        e = unraisable.exc_value
        if isinstance(e, RuntimeError) and str(e) == "Event loop is closed":
            return
        previous(unraisable)

    hook.drops_closed_loop = True
    sys.unraisablehook = hook


def steps_in(directory: str | os.PathLike) -> list[int]:
    """The step folders in a checkpoint directory (committed or not), ascending; none if
    it does not exist. Reads the folder only (no orbax manager is made)."""
    path = checkpoint_path(directory)
    if not path.exists():
        return []
    return sorted(int(p.name) for p in path.iterdir() if p.name.isdigit() and p.is_dir())


def set_aside(directory: str | os.PathLike) -> tuple[list[int], epath.Path] | None:
    """Moves an earlier run's checkpoints out of the way of a run that starts over.

    Renames ``directory`` to ``<directory>.replaced-<YYYYmmdd-HHMMSS>`` (nothing is
    deleted) when it holds step folders.

    Returns:
      (the steps moved, where they are now), or None when there was nothing to move.
    Raises:
      CheckpointError: a remote directory (``gs://``; folders are not renamed there).
    """
    path = checkpoint_path(directory)
    steps = steps_in(path)
    if not steps:
        return None
    if "://" in os.fspath(directory):
        raise CheckpointError(f"{path} holds the checkpoints of an earlier run (steps "
                              f"{steps}); starting over would mix them with the new run's: "
                              "remove them or use another --checkpoint-dir")
    moved = epath.Path(f"{path}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
    path.rename(moved)
    return steps, moved


def checkpoint_path(directory: str | os.PathLike) -> epath.Path:
    """An `epath.Path`: remote URIs (``gs://...``) as given, local paths made absolute."""
    text = os.fspath(directory)
    return epath.Path(text if "://" in text else os.path.abspath(text))


def _check_restored(state, abstract_state, step, path) -> None:
    want = jax.tree.structure(abstract_state)
    got = jax.tree.structure(state)
    if want != got:
        raise CheckpointError(f"checkpoint step {step} at {path} has a different state "
                              f"structure than the run expects")
    for w, g in zip(jax.tree.leaves(abstract_state), jax.tree.leaves(state)):
        if tuple(w.shape) != tuple(g.shape) or w.dtype != g.dtype:
            raise CheckpointError(f"checkpoint step {step} at {path} holds an array "
                                  f"{g.dtype}{list(g.shape)} where the run expects "
                                  f"{w.dtype}{list(w.shape)}")


def abstract_like(state: Any) -> Any:
    """Abstract arrays (``jax.ShapeDtypeStruct``, with shardings) of a pytree of arrays."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        state)


__all__ = ["CheckpointError", "TrainCheckpointer", "abstract_like", "checkpoint_path",
           "set_aside", "steps_in"]
