"""Stopping long work by cooperation: a signal is recorded, and loops stop at safe points.

The command lines (``tev-jax``, ``tev-train``) run inside `handled_signals`, which makes
SIGINT and SIGTERM only record themselves. The library's loops call `check` between
units of work (decode chunks of a batch job, training updates, rollout shards,
``compare`` passes, ``tune``'s trees); there a recorded signal is raised as
``KeyboardInterrupt`` (SIGTERM as `tev_jax.runtime.exit_codes.Terminated`), and the loop saves what
it holds and stops. Nothing is raised inside jax's compiles, imports or callbacks, so
nothing is half-done when the process exits.

A second Ctrl-C (SIGINT after any signal) exits at once (``os._exit``, code 130): a
watcher thread reads the signals from Python's wakeup file descriptor, so that even a
compile that holds the main thread for minutes never traps the user. A repeated SIGTERM
does not: schedulers and process groups deliver it more than once, and a preempted job
must still save. Files are written atomically
or line by line with partial lines dropped on reading, so exiting there loses at most
the work in flight.

Nothing here runs on import: ``import tev_jax`` changes no signal handler. Outside
`handled_signals` (a user's own script), `check` raises nothing and Ctrl-C is Python's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

from tev_jax.runtime.exit_codes import EXIT_SIGNAL, Terminated, interrupt_exit

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received: list[int] = []   # signals recorded by the handler, in order
_previous: dict[int, object] = {}   # signal -> its handler before `handled_signals`
_watching: list[threading.Thread] = []   # the watcher of the `handled_signals` in force


def handling(signum: int = signal.SIGTERM) -> bool:
    """Whether ``signum`` is recorded for `check` now (inside `handled_signals`)."""
    return signum in _previous


def requested() -> int | None:
    """The first signal recorded since `handled_signals` began, or None."""
    return _received[0] if _received else None


def check() -> None:
    """A safe point: raises ``KeyboardInterrupt`` (`Terminated` for SIGTERM) if a signal
    was recorded, and nothing otherwise."""
    signum = requested()
    if signum == signal.SIGTERM:
        raise Terminated()
    if signum is not None:
        raise KeyboardInterrupt()


def note_late(prog: str) -> None:
    """Says on stderr that a signal came once the command's work was complete (its
    output is whole, so the command still ends with 0), and nothing if none came."""
    signum = requested()
    if signum is not None:
        what, _ = interrupt_exit(Terminated() if signum == signal.SIGTERM else None)
        print(f"{prog}: {what} once its work was complete: nothing is lost", file=sys.stderr)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _exit_at_once(signum: int, prog: str) -> None:
    _flush()
    with contextlib.suppress(Exception):
        start = "\n" if os.isatty(2) else ""  # off a progress bar's line on a terminal
        os.write(2, f"{start}{prog}: {signal.Signals(signum).name} again: stopped at once\n"
                 .encode())
    os._exit(EXIT_SIGNAL + signum)


def _record(signum, frame) -> None:
    _received.append(signum)


def _watch(read_fd: int, prog: str, signals: frozenset[int]) -> None:
    """Reads signal numbers from the wakeup pipe (written by Python's C-level handler,
    whatever the main thread is doing); exits at once on a SIGINT that follows another
    of ``signals``. A 0 byte ends it."""
    seen = 0
    while True:
        for signum in os.read(read_fd, 64):
            if signum == 0:
                return
            if signum == signal.SIGINT and seen:
                _exit_at_once(signum, prog)
            seen += signum in signals


def release(signum: int) -> None:
    """Gives ``signum`` its handler from before `handled_signals` back (``tev-train``
    under jax.distributed: jax's preemption sync takes SIGTERM, and Ctrl-C is Python's)."""
    if signum in _previous:
        signal.signal(signum, _previous.pop(signum))


@contextlib.contextmanager
def handled_signals(prog: str, signals=STOP_SIGNALS):
    """While the block runs, ``signals`` (SIGINT, SIGTERM) are recorded for `check`, and
    a SIGINT after one of them exits at once. A signal the process was started ignoring
    (``nohup``, a background job) stays ignored. For command lines only; a no-op off the
    main thread and inside another `handled_signals`.

    Args:
      prog: the command's name, for the line a second Ctrl-C prints.
      signals: which signals to record (`train.preemption` records SIGTERM alone for a
        library caller of the training loop).
    """
    if threading.current_thread() is not threading.main_thread() or _watching:
        yield
        return
    mine = [s for s in signals if signal.getsignal(s) != signal.SIG_IGN]
    _received.clear()
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    watcher = threading.Thread(target=_watch, args=(read_fd, prog, frozenset(mine)),
                               daemon=True, name="tev-jax-signals")
    watcher.start()
    _watching.append(watcher)
    _previous.update({s: signal.signal(s, _record) for s in mine})
    try:
        yield
    finally:
        # what the command printed (its summary: a script's proof that it finished) is
        # out before Python's handlers are back and a signal can end the process
        _flush()
        _watching.clear()
        for s in list(_previous):
            release(s)
        signal.set_wakeup_fd(previous_fd)
        os.write(write_fd, b"\0")
        watcher.join()
        os.close(read_fd)
        os.close(write_fd)
        _received.clear()


def exit_quietly(code: int) -> None:
    """For a command line whose work is over (``code``: its exit code): a SIGINT or
    SIGTERM that lands while the interpreter exits ends the process at once with
    ``code``, its output flushed, instead of raising inside whatever runs then (jax's
    atexit clean-up takes a second or more, and a KeyboardInterrupt there prints a
    traceback). A signal the process ignores stays ignored. Main thread only."""
    def end(signum, frame):
        _flush()
        os._exit(code)

    for s in STOP_SIGNALS:
        if signal.getsignal(s) is not signal.SIG_IGN:
            signal.signal(s, end)

__all__ = ["STOP_SIGNALS", "check", "exit_quietly", "handled_signals", "handling", "release", "requested"]
