"""Exclusive locks on output files and folders, naming their holder.

`lock_output` holds ``OUT.lock`` for as long as a command writes ``OUT`` (the batch
job's results, a training run's folder): a second writer is refused with one line
saying which process writes it and which flag to change.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path


def unwritable(out: Path, e: OSError, flag: str = "--output", what: str | None = None
                ) -> ValueError:
    file = next((p for p in (out.parent, *out.parent.parents) if p.is_file()), None)
    why = f"{file} is a file, not a folder" if file is not None else e.strerror or e
    return ValueError(f"{what or out}: cannot write there ({why}); choose another {flag}")


def lock_path(out: str | Path) -> Path:
    """The lock file of an output: ``OUT.lock``."""
    out = Path(out)
    return out.with_name(out.name + ".lock")


@contextlib.contextmanager
def lock_output(out: str | Path, *, command: str = "tev-jax generate", flag: str = "--output",
                what: str | None = None) -> Iterator[None]:
    """Holds an exclusive lock on ``out`` (``flock`` of ``OUT.lock``, removed on exit).

    The lock file names its holder (process id, host, start time, command), so a second
    writer is refused with one line saying who writes the file (``what``, default
    ``out``) and which ``flag`` to change. Folders made for it are removed again if the
    run leaves them empty.

    Raises:
      ValueError: another process holds the lock, or ``out``'s folder is not writable.
    """
    out = Path(out)
    path = lock_path(out)
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 4096).decode("utf-8", "replace").strip() or "unknown"
                os.close(fd)
                raise ValueError(f"{what or out} is being written by another process "
                                 f"({holder}; lock {path}); wait for it to finish or use "
                                 f"another {flag}") from None
            except OSError as e:
                if e.errno not in _NO_LOCKS:
                    raise
                print(f"warning: {out.parent} cannot be locked ({e.strerror}): a second "
                      "writer of this output would not be noticed", file=sys.stderr)
                break
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False  # its holder removed it as we locked: lock the new one
            if same:
                break
            os.close(fd)
    except OSError as e:
        _remove_empty(made)
        raise unwritable(out, e, flag, what) from None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {command}\n".encode())
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)
        _remove_empty(made)


# flock errors of filesystems without locks (some FUSE and network mounts): write unlocked
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def _remove_empty(folders: Sequence[Path]) -> None:
    for p in folders:  # deepest first
        with contextlib.suppress(OSError):
            p.rmdir()


__all__ = ["lock_output", "lock_path", "unwritable"]
