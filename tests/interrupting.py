"""Sending a command one signal at a random time and checking how it ended: the harness
of tests/test_interrupts.py (``tev-jax``'s commands and the mechanism) and
tests/test_train_interrupts.py (``tev-train``'s)."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def env() -> dict:
    """The environment of a command under test: this checkout first on the path."""
    out = dict(os.environ)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), out.get("PYTHONPATH")) if p)
    return out


LOST_AFTER = 2.0
"""Seconds after its signal that a command may still end with 0 (it was finishing)."""


def interrupt(argv, cwd, delay, sig, done: str, *,
              sigint=signal.SIG_DFL) -> tuple[int, str]:
    """Runs ``argv`` with SIGINT set to ``sigint`` at its start, sends ``sig`` after
    ``delay`` seconds (unless it ended; with SIGINT ignored, SIGINT first), -> (exit code,
    stdout and stderr); a process killed by a signal has a negative code. A command that
    ends with 0 after its signal must have finished its work before it (its output then
    already said ``done``: a signal during the interpreter's exit changes nothing) or
    ended within `LOST_AFTER` seconds; else it lost the signal."""
    log = cwd / "stderr.txt"
    with open(log, "w") as err:
        # as from a terminal by default: SIGINT handled (a test run in the background
        # ignores it, and its children would inherit that)
        p = subprocess.Popen(argv, cwd=cwd, env=env(), stdout=err, stderr=subprocess.STDOUT,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, sigint))
        sent, said = None, ""
        try:
            p.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            said = log.read_text()
            if sigint == signal.SIG_IGN:
                p.send_signal(signal.SIGINT)
            p.send_signal(sig)
            sent = time.perf_counter()
        code = p.wait(timeout=600)
    out = log.read_text()
    if sent is not None and code == 0 and done not in said:
        late = time.perf_counter() - sent
        assert late < LOST_AFTER, (f"{signal.Signals(sig).name} after {delay:.1f} s was "
                                   f"lost: the command ran {late:.0f} s more and ended "
                                   f"with 0: {out[-1500:]}")
    return code, out


def check_exit(name, code, err, sig, delay, done) -> int:
    """The exit is the command's own (the signal is handled from the command's first
    line on), with no traceback, unless the command had finished: a signal that lands
    after it said ``done`` and gave Python's handlers back, while the interpreter exits,
    ends the process by the signal (-sig), as it would any program. -> the exit code,
    with that case read as 0 (finished before the signal; the caller checks its work)."""
    if code == -sig and done in err:
        return 0
    assert code >= 0 and code != 139 and "Traceback" not in err, (
        f"{name}: {signal.Signals(sig).name} after {delay:.1f} s ended with {code}: "
        f"{err[-1500:]}")
    return code


def before_the_command(code, err, sig) -> bool:
    """Whether the signal came before the command line was parsed (during the imports):
    then the exit is 128 + the signal with one line, ``PROG: interrupted (SIGINT)`` or
    ``PROG: terminated (SIGTERM)``, and the caller checks that nothing was written."""
    if code != 128 + sig:
        return False
    what = "interrupted" if sig == signal.SIGINT else "terminated"
    assert re.fullmatch(rf"[^\n:]+: {what} \({signal.Signals(sig).name}\)\n", err), err[-2000:]
    return True


def duration(argv, cwd) -> float:
    """Wall seconds of one uninterrupted run of ``argv`` (which must end with 0)."""
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, env=env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return time.perf_counter() - start


def interrupts(name, argv, done, check, *, count, seed, tmp_path) -> list[int]:
    """Runs of the command ``argv``, each sent one signal (SIGINT and SIGTERM in turn) at
    a random time within its lifetime (measured first, uninterrupted: its imports,
    compiles, work and exit), each checked by ``check(cwd, code, output, signal)``, until
    ``count`` of them were interrupted (a run that finished before its signal is checked
    too and does not count; at most ``count // 2`` of those); -> the exit codes of all
    runs (0 for those that finished).

    The lifetime is one run's, and a command that runs beside other tests (CI's two
    workers) can take half as long again or less, so some draws land after its end.
    """
    (tmp_path / "timing").mkdir()
    lifetime = duration(argv, tmp_path / "timing")
    rng = random.Random(seed)
    codes = []
    for i in range(count + count // 2):
        if sum(c != 0 for c in codes) == count:
            break
        cwd = tmp_path / f"{name}-{i}"
        cwd.mkdir()
        sig = (signal.SIGINT, signal.SIGTERM)[i % 2]
        delay = rng.uniform(0.3, 0.85 * lifetime)
        code, err = interrupt(argv, cwd, delay, sig, done)
        code = check_exit(name, code, err, sig, delay, done)
        codes.append(code)
        check(cwd, code, err, sig)
    return codes
