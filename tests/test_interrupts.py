"""Issue 47, item 1: SIGINT and SIGTERM end every long command with its exit code (75
for a job whose work is on disk, 130 / 143 for one with nothing to resume), never with a
segfault (139: a compile still running on XLA's threads while the interpreter exits),
and with nothing lost: what the message says is on disk is there and complete.

Each command runs as a subprocess with the bundled models and gets one signal at a
random time (seeded), from the first second (imports, compiling) to past its first
results. The slow tier interrupts each command 20 times; the fast tier two commands
once each.
A signal that comes while Python still imports the command (before its handlers exist,
nothing written yet) ends the process by that signal, which a shell or scheduler reads
as 130 / 143; that is accepted, a crash (SIGSEGV, 139) never.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
RUN_FLAGS = ["--target-path", "bundled", "--drafter-path", "bundled:dflash", "--loss", "exit",
             "--budget", "16", "--num-anchors", "8", "--batch-size", "4", "--steps", "40",
             "--checkpoint-every", "2", "--no-progress"]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    out = tmp_path_factory.mktemp("rollouts") / "ro"
    done = subprocess.run(
        [sys.executable, "-m", "train", "rollouts", "--target", "bundled", "--prompt-set",
         "gsm", "--limit", "8", "--out", str(out), "--max-new-tokens", "32",
         "--batch-size", "8"], env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def _default_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


LOST_AFTER = 2.0
"""Seconds after its signal that a command may still end with 0 (it was finishing)."""


def _interrupt(argv, cwd, delay, sig, done: str) -> tuple[int, str]:
    """Runs ``argv``, sends ``sig`` after ``delay`` seconds (unless it ended), -> (exit
    code, stdout and stderr); a process killed by a signal has a negative code. A
    command that ends with 0 after its signal must have finished its work before it
    (its output then already said ``done``: a signal during the interpreter's exit
    changes nothing) or ended within `LOST_AFTER` seconds; else it lost the signal."""
    log = cwd / "stderr.txt"
    with open(log, "w") as err:
        # as from a terminal: SIGINT handled (a test run in the background ignores it,
        # and its children would inherit that)
        p = subprocess.Popen(argv, cwd=cwd, env=_env(), stdout=err, stderr=subprocess.STDOUT,
                             preexec_fn=_default_sigint)
        sent, said = None, ""
        try:
            p.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            said = log.read_text()
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


def _check_exit(name, code, err, sig, delay):
    """The exit is the command's own, or the signal's before the command started."""
    at_startup = code == -sig and ("Traceback" not in err
                                   or err.rstrip().endswith("KeyboardInterrupt"))
    assert code >= 0 and code != 139 or at_startup, (
        f"{name}: {signal.Signals(sig).name} after {delay:.1f} s ended with {code}: "
        f"{err[-1500:]}")
    return not at_startup


def _check_generate(cwd, code, err, sig):
    out = cwd / "out.jsonl"
    done = re.search(r"(\d+) of the 80 results are in", err)
    if code == 0:  # finished before the signal
        assert len(out.read_text().splitlines()) == 80
        return
    assert code == 75, err[-2000:]
    lines = out.read_text().splitlines() if out.exists() else []
    if not done:  # interrupted before decoding started
        assert ("no result was written to out.jsonl yet" in err
                or "before anything was written" in err), err[-2000:]
        assert lines == []
        return
    assert len(lines) == int(done.group(1))
    for line in lines:
        assert json.loads(line)["text"] is not None


def _check_run(cwd, code, err, sig):
    from train.checkpoint import steps_in

    if code == 0:
        return
    assert code == 75, err[-2000:]
    steps = steps_in(cwd / "run" / "checkpoints")
    preempted = re.search(r"preempted \(SIGTERM\) at update (\d+): checkpoint saved", err)
    if preempted:  # SIGTERM between updates: a checkpoint at the update it stopped at
        assert steps and steps[-1] == int(preempted.group(1)), err[-2000:]
        return
    newest = re.search(r"the newest checkpoint, at update (\d+), is in", err)
    if newest:
        assert steps and steps[-1] == int(newest.group(1))
    else:
        assert ("no checkpoint was written yet" in err
                or "before anything was written" in err), err[-2000:]
        assert steps == []


def _check_rollouts(cwd, code, err, sig):
    if code == 0:
        return
    assert code == 75, err[-2000:]
    shards = sorted((cwd / "ro").glob("shard-*-of-*.json"))
    if "before anything was written" in err:
        assert shards == []
        return
    said = re.search(r"(\d+) complete shard\(s\)", err)
    assert said and int(said.group(1)) == len(shards), err[-2000:]
    for record in shards:
        meta = json.loads(record.read_text())
        stem = record.name[: -len(".json")]
        tokens = np.load(cwd / "ro" / f"{stem}.tokens.npy")
        assert tokens.shape == (meta["count"], meta["seq_len"])


def _check_compare(cwd, code, err, sig):
    if code != 0:
        assert code == 128 + sig, err[-2000:]


COMMANDS = {
    # name: (argv without the program, what its output says once its work is done, check)
    "generate": (["-m", "tev_jax.cli", "generate", "--prompts", "bundled:mt_bench", "--output",
                  "out.jsonl", "--batch-size", "8", "--max-new-tokens", "48"],
                 "(compilation included)", _check_generate),
    "run": (["-m", "train", "run", *RUN_FLAGS, "--out-dir", "run"], "(compilation included)",
            _check_run),
    "rollouts": (["-m", "train", "rollouts", "--target", "bundled", "--prompt-set", "gsm",
                  "--limit", "24", "--out", "ro", "--max-new-tokens", "32", "--batch-size",
                  "4", "--shard-size", "4"], "sequences of length", _check_rollouts),
    "compare": (["-m", "tev_jax.cli", "compare", "--max-new-tokens", "16", "--repeats", "1"],
                "greedy outputs identical across methods", _check_compare),
}


def _argv(name, rollouts):
    argv = COMMANDS[name][0]
    return [sys.executable, *argv] + (["--data-dir", str(rollouts)] if name == "run" else [])


def _duration(name, cwd, rollouts) -> float:
    """Wall seconds of one uninterrupted run of the command (which must end with 0)."""
    start = time.perf_counter()
    done = subprocess.run(_argv(name, rollouts), cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return time.perf_counter() - start


def _interrupts(name, count, seed, tmp_path, rollouts):
    """Runs of the command, each sent one signal (SIGINT and SIGTERM in turn) at a random
    time within its lifetime (measured first, uninterrupted: its imports, compiles, work
    and exit), all checked, until ``count`` of them were interrupted (a run that finished
    before its signal is checked too and does not count; at most ``count // 2`` of
    those); -> the exit codes of all runs.

    The lifetime is one run's, and a command that runs beside other tests (CI's two
    workers) can take half as long again or less, so some draws land after its end.
    """
    _, done, check = COMMANDS[name]
    (tmp_path / "timing").mkdir()
    lifetime = _duration(name, tmp_path / "timing", rollouts)
    rng = random.Random(seed)
    codes = []
    for i in range(count + count // 2):
        if sum(c != 0 for c in codes) == count:
            break
        cwd = tmp_path / f"{name}-{i}"
        cwd.mkdir()
        sig = (signal.SIGINT, signal.SIGTERM)[i % 2]
        delay = rng.uniform(0.3, 0.85 * lifetime)
        code, err = _interrupt(_argv(name, rollouts), cwd, delay, sig, done)
        codes.append(code)
        if _check_exit(name, code, err, sig, delay):
            check(cwd, code, err, sig)
    return codes


@pytest.mark.parametrize("name, sig_index, seed", [("generate", 0, 3), ("run", 1, 4)])
def test_one_interrupt_ends_cleanly(name, sig_index, seed, tmp_path, rollouts):
    """Fast tier: one signal to a batch generation (SIGINT) and to a training run
    (SIGTERM) at a random time in their first seconds (imports, compiling)."""
    _, done, check = COMMANDS[name]
    rng = random.Random(seed)
    sig = (signal.SIGINT, signal.SIGTERM)[sig_index]
    delay = rng.uniform(2.0, 8.0)
    code, err = _interrupt(_argv(name, rollouts), tmp_path, delay, sig, done)
    if _check_exit(name, code, err, sig, delay):
        check(tmp_path, code, err, sig)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_twenty_interrupts_per_command(name, tmp_path, rollouts):
    """Slow tier: 20 signals (SIGINT and SIGTERM in turn) at random times within each
    command's lifetime, until 20 interrupted it; none may end in a segfault, lose its
    signal or lose what its message says is on disk, and at most 10 runs may finish
    before their signal."""
    codes = _interrupts(name, 20, seed=sorted(COMMANDS).index(name), tmp_path=tmp_path,
                        rollouts=rollouts)
    assert sum(c != 0 for c in codes) == 20, (
        f"{name}: {sum(c == 0 for c in codes)} of {len(codes)} runs ended before the signal")
    assert -11 not in codes and 139 not in codes


def _sigint_then_work(indent: int) -> str:
    """Stand-in source: SIGINT to this process, then 0.3 s of Python work (where the
    signal's handler runs), at ``indent`` spaces."""
    lines = ("os.kill(os.getpid(), signal.SIGINT)", "t = time.perf_counter()",
             "while time.perf_counter() - t < 0.3:", "    pass")
    return "".join(" " * indent + line + "\n" for line in lines)


def _work(seconds: float) -> None:
    """Python work for ``seconds`` (a signal's handler runs inside it)."""
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        pass


def _raised_after(call) -> list[str]:
    """``call(log)`` under `exits.signals_as_interrupts`, then "returned" and a sleep,
    which the held interrupt must end (pytest.raises fails otherwise); -> the log."""
    from tev_jax import exits

    log = []
    with pytest.raises(KeyboardInterrupt):
        with exits.signals_as_interrupts():
            call(log)
            log.append("returned")
            time.sleep(5)  # the held interrupt comes here
    return log


def test_a_signal_during_a_compile_is_raised_after_it(tmp_path):
    """The mechanism, deterministically: SIGINT that arrives inside jax's compile call
    (here a stand-in with its file and function name) is raised once the call has
    returned, so the compile's work is not left running; without the deferral it is
    raised inside the call (the segfault of a real compile thread outliving the
    interpreter)."""
    compiler = _module(tmp_path, "compiler", (
        "import os, signal, time\n"
        "def backend_compile_and_load(log):\n"
        + _sigint_then_work(4) +
        "    log.append('compiled')\n"))
    assert _raised_after(compiler.backend_compile_and_load) == ["compiled", "returned"]


def test_a_signal_inside_a_catch_all_try_is_raised_after_it(tmp_path, monkeypatch):
    """SIGINT that arrives inside a ``try`` of jax's (here a stand-in in a folder added to
    `exits.CATCH_ALL_IN`) whose bare ``except:`` would drop it (jax reads a compiled
    program's layouts so, just after the compile) is raised once the ``try`` is left;
    raised inside it, it was dropped and the command ran on to exit 0. A catch-all that
    raises again (cleanup, then ``raise``) holds nothing."""
    from tev_jax import exits

    layouts = _module(tmp_path, "pxla_like", (
        "import os, signal, time\n"
        "def read_layouts(log):\n"
        "    try:\n"
        + _sigint_then_work(8) +
        "        log.append('read')\n"
        "    except:\n"
        "        log.append('dropped')\n"
        "def cleanup_then_raise(log):\n"
        "    try:\n"
        + _sigint_then_work(8) +
        "        log.append('finished')\n"
        "    except BaseException:\n"
        "        log.append('cleaned up')\n"
        "        raise\n"))
    assert len(exits.catch_all_spans(layouts.__file__)) == 1
    monkeypatch.setattr(exits, "CATCH_ALL_IN", (*exits.CATCH_ALL_IN, str(tmp_path)))
    assert _raised_after(layouts.read_layouts) == ["read", "returned"]
    log = []
    with pytest.raises(KeyboardInterrupt):
        with exits.signals_as_interrupts():
            layouts.cleanup_then_raise(log)
    assert log == ["cleaned up"]


def _module(folder, name: str, source: str):
    import importlib.util

    (folder / f"{name}.py").write_text(source)
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_signal_during_a_gc_callback_is_not_dropped():
    """SIGTERM that arrives inside a garbage-collector callback (jax registers one) is
    raised after it; raised inside it, Python reports and drops it and the command runs
    on."""
    import gc

    from tev_jax import exits

    def callback(phase, info):
        if phase == "start":
            os.kill(os.getpid(), signal.SIGTERM)
            _work(0.1)

    gc.callbacks.append(callback)
    try:
        with pytest.raises(exits.Terminated):
            with exits.signals_as_interrupts():
                gc.collect()
                gc.callbacks.remove(callback)
                time.sleep(5)
    finally:
        if callback in gc.callbacks:
            gc.callbacks.remove(callback)


def test_a_signal_dropped_by_python_is_sent_again():
    """SIGTERM raised inside a weakref callback, where Python reports an exception and
    drops it (as in a gc callback, which `in_swallowing_call` knows, but this one it does
    not), is sent again through ``sys.unraisablehook`` and raised after the callback;
    without that the command ran on and ended with 0 (a lost signal)."""
    import weakref

    from tev_jax import exits

    class Thing:
        pass

    def callback(ref):
        os.kill(os.getpid(), signal.SIGTERM)
        _work(0.1)

    thing = Thing()
    ref = weakref.ref(thing, callback)
    with pytest.raises(exits.Terminated):
        with exits.signals_as_interrupts():
            del thing
            time.sleep(5)
    assert ref() is None


def test_importing_tev_jax_refines_only_the_default_interrupt_handler():
    """``import tev_jax`` replaces Python's default SIGINT handler before jax is imported
    (jax's gc callback dropped Ctrl-C in the first seconds of a command half the time),
    and leaves a handler of the user's own alone."""
    code = ("import signal, sys\n"
            "import tev_jax\n"
            "h = signal.getsignal(signal.SIGINT)\n"
            "assert h is not signal.default_int_handler and h.__module__ == 'tev_jax.exits'\n"
            "mine = lambda *a: None\n"
            "signal.signal(signal.SIGINT, mine)\n"
            "from tev_jax import exits\n"
            "assert not exits.refine_default_interrupt()\n"
            "assert signal.getsignal(signal.SIGINT) is mine\n"
            "print('ok')\n")
    run = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True,
                         text=True, timeout=120)
    assert run.stdout.strip() == "ok", run.stderr[-1000:]


def test_a_signal_during_an_import_is_raised_after_it(tmp_path):
    """SIGINT that arrives while a module is imported is raised once the import is done:
    raised inside a C extension's initialisation (jaxlib's) it became an ImportError,
    which an optional import swallows, or a crash."""
    import importlib

    from tev_jax import exits

    (tmp_path / "slow_module_47.py").write_text(
        "import os, signal, time\n"
        + _sigint_then_work(0) +
        "DONE = True\n")
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(KeyboardInterrupt):
            with exits.signals_as_interrupts():
                module = importlib.import_module("slow_module_47")
                time.sleep(5)
        assert module.DONE
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("slow_module_47", None)
