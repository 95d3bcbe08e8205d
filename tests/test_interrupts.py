"""Interrupts by cooperation (issue 51, after issue 47): the command lines record SIGINT
and SIGTERM from their first line on (`tev_jax.runtime.signals`) and stop at their next safe point
with their exit code (75 for a job whose work is on disk, 130 / 143 for one with nothing
to resume) and one line; a second signal exits at once; ``import tev_jax`` changes no
signal handler; a SIGINT the process was started ignoring stays ignored.

``tev-jax``'s batch generation and ``compare`` run as subprocesses with the bundled
models and get one signal at a random time (seeded), from the first second (imports,
compiling) to past their first results: never a segfault (139), a traceback, a lost
signal or a lost result that the message says is on disk (``tev-train``'s commands:
tests/test_train_interrupts.py; the harness: tests/interrupting.py). The slow tier
interrupts each command 20 times; the fast tier the batch generation once, and the
mechanism's own tests run in fresh interpreters whose SIGINT is set explicitly, so they
pass however the test run itself was started. The messages and exit codes are also
checked in-process, on a tiny saved target (issue 26).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys

import pytest
from cli_fixtures import AR, PROMPT, batch_argv
from cli_fixtures import target_dir  # noqa: F401  (a fixture)
from interrupting import before_the_command, check_exit, env, interrupt, interrupts

from tev_jax import cli
from tev_jax.batch import continuous
from tev_jax.costs import timing
from tev_jax.runtime import exit_codes, signals


def _check_generate(cwd, code, err, sig):
    out = cwd / "out.jsonl"
    done = re.search(r"(\d+) of the 80 results are in", err)
    if code == 0:  # finished before the signal
        assert len(out.read_text().splitlines()) == 80
        return
    if before_the_command(code, err, sig):
        assert sorted(p.name for p in cwd.iterdir()) == ["stderr.txt"]
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


def _check_compare(cwd, code, err, sig):
    if code != 0:
        assert code == 128 + sig, err[-2000:]
        assert err.endswith(f" ({signal.Signals(sig).name})\n"), err[-2000:]


COMMANDS = {
    # name: (argv without the program, what its output says once its work is done, check)
    # generate: 80 prompts of 16 new tokens each, 60 s uninterrupted on the idle 2-core
    # machine (imports, compiles of each slot and width program as they are first met,
    # results written in slot order, the summary); 48 tokens took 98 s, the extra decoding
    # adding no phase, and the slow tier's 20 runs of it were CI's longest test (23 min)
    "generate": (["-m", "tev_jax.cli", "generate", "--prompts", "bundled:mt_bench", "--output",
                  "out.jsonl", "--batch-size", "8", "--max-new-tokens", "16"],
                 "(compilation included)", _check_generate),
    "compare": (["-m", "tev_jax.cli", "compare", "--max-new-tokens", "16", "--repeats", "1"],
                "greedy outputs identical across methods", _check_compare),
}


def test_one_interrupt_ends_cleanly(tmp_path):
    """Fast tier: a batch generation started with SIGINT ignored gets SIGINT, which it
    must ignore, then SIGTERM, at a random time in its first seconds (imports, compiling,
    the first results)."""
    argv, done, check = COMMANDS["generate"]
    sig, delay = signal.SIGTERM, random.Random(3).uniform(2.0, 8.0)
    code, err = interrupt([sys.executable, *argv], tmp_path, delay, sig, done,
                          sigint=signal.SIG_IGN)
    code = check_exit("generate", code, err, sig, delay, done)
    check(tmp_path, code, err, sig)
    if code != 0:  # the ignored SIGINT changed nothing
        assert "(SIGINT)" not in err and "(SIGTERM)" in err, err[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_twenty_interrupts_per_command(name, tmp_path):
    """Slow tier: 20 signals (SIGINT and SIGTERM in turn) at random times within each
    command's lifetime, until 20 interrupted it; none may end in a segfault, lose its
    signal or lose what its message says is on disk, and at most 10 runs may finish
    before their signal."""
    argv, done, check = COMMANDS[name]
    codes = interrupts(name, [sys.executable, *argv], done, check, count=20,
                       seed=sorted(COMMANDS).index(name), tmp_path=tmp_path)
    assert sum(c != 0 for c in codes) == 20, (
        f"{name}: {sum(c == 0 for c in codes)} of {len(codes)} runs ended before the signal")
    assert -11 not in codes and 139 not in codes


def test_interrupts_end_with_one_line_and_a_documented_code(tmp_path,
                                                            target_dir,  # noqa: F811
                                                            capsys, monkeypatch):
    """In-process, on a tiny saved target (issue 26, finding 15): Ctrl-C or SIGTERM in
    batch mode ends with one line saying what is on disk and exit code 75 (resumable);
    the rerun finishes the file in input order; a single generation interrupted exits
    130."""
    real = continuous.generate_continuous
    stop = {"signal": None}

    def one_then_stop(*args, **kw):
        for i, result in enumerate(real(*args, **kw)):
            yield result
            if stop["signal"] == "int":
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(continuous, "generate_continuous", one_then_stop)

    def unhandled(*_):  # a command that left SIGTERM alone fails here, not pytest
        raise AssertionError("SIGTERM reached the test's handler")

    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        for kind, what in (("int", "interrupted (SIGINT)"), ("term", "terminated (SIGTERM)")):
            stop["signal"] = kind
            capsys.readouterr()
            try:
                code = cli.main(batch_argv(target_dir, tmp_path))
            except KeyboardInterrupt:
                pytest.fail("the interrupt escaped tev-jax generate")
            assert code == exit_codes.EXIT_RESUMABLE == 75
            err = capsys.readouterr().err.strip().splitlines()
            assert err[-1].startswith(f"tev-jax generate: {what}; ")
            assert "results are in" in err[-1] and "Traceback" not in "".join(err)
        assert signal.getsignal(signal.SIGTERM) is unhandled
    finally:
        signal.signal(signal.SIGTERM, previous)
    monkeypatch.setattr(continuous, "generate_continuous", real)
    assert cli.main(batch_argv(target_dir, tmp_path)) == 0
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(5))
    assert len({r["settings"] for r in rows}) == 1

    def interrupted(*args, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(timing, "timed_generate", interrupted)
    capsys.readouterr()
    try:
        code = cli.main(["generate", PROMPT, "--target", str(target_dir), *AR])
    except KeyboardInterrupt:
        pytest.fail("the interrupt escaped tev-jax generate")
    assert code == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["compiling the decode program (once per setting) ...",
                   "tev-jax generate: interrupted (SIGINT)"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_after_the_work_is_complete_ends_with_0_and_says_so(sig, monkeypatch,
                                                                      capsys):
    """A signal that lands after the command's last safe point, its work complete (CI,
    2026-12-06: a rollout generation that had written all its shards said "interrupted
    before anything was written"), ends with 0 and one true line; the negative control,
    a command that takes the signal at a safe point, ends with 130 / 143."""
    def add(sub, *, check):
        def work(args):
            os.kill(os.getpid(), sig)
            if check:
                signals.check()
            return 0

        sub.add_parser("work").set_defaults(func=work)

    what = {signal.SIGINT: "interrupted (SIGINT)", signal.SIGTERM: "terminated (SIGTERM)"}
    for check, code in ((False, 0), (True, 128 + sig)):
        monkeypatch.setattr(cli, "subcommands", lambda c=check: [lambda s: add(s, check=c)])
        assert cli.main(["work"]) == code
        err = capsys.readouterr().err.strip().splitlines()
        late = f"tev-jax work: {what[sig]} once its work was complete: nothing is lost"
        assert err == ([late] if code == 0 else [f"tev-jax work: {what[sig]}"])


def _python(code: str, *, sigint=signal.SIG_DFL, timeout=120,
            environ=None) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter (environment ``environ``, else `env`) started
    with SIGINT set to ``sigint`` (as from a terminal by default, whatever this test run
    was started with)."""
    return subprocess.run([sys.executable, "-c", code], env=environ or env(),
                          capture_output=True,
                          text=True, timeout=timeout,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, sigint))


def test_importing_tev_jax_changes_no_signal_handler():
    """``import tev_jax`` (and its command-line modules, and jax through it) leaves every
    signal handler, the wakeup descriptor and ``sys.unraisablehook`` as they were."""
    code = ("import signal, sys\n"
            "def state():\n"
            "    fd = signal.set_wakeup_fd(-1); signal.set_wakeup_fd(fd)\n"
            "    return ({s: signal.getsignal(s) for s in signal.valid_signals()\n"
            "             if s not in (signal.SIGKILL, signal.SIGSTOP)}, fd,\n"
            "            sys.unraisablehook)\n"
            "before = state()\n"
            "import tev_jax, tev_jax.cli, tev_jax.runtime.signals, train.__main__\n"
            "tev_jax.Engine, tev_jax.tev  # jax and the models, imported through tev_jax\n"
            "assert 'jax' in sys.modules\n"
            "after = state()\n"
            "changed = [s for s in before[0] if before[0][s] != after[0][s]]\n"
            "assert not changed, changed\n"
            "assert before[1:] == after[1:]\n"
            "print('ok')\n")
    run = _python(code)
    assert run.stdout.strip() == "ok", run.stderr[-1500:]


def test_a_signal_is_taken_at_the_next_check_only():
    """Inside `signals.handled_signals` a signal is recorded and raised by the next
    `signals.check` (SIGTERM as ``Terminated``), never in between; the handlers are given
    back afterwards."""
    code = ("import os, signal, time\n"
            "from tev_jax.runtime import exit_codes, signals, signals\n"
            "before = {s: signal.getsignal(s) for s in signals.STOP_SIGNALS}\n"
            "for sig, kind in ((signal.SIGINT, KeyboardInterrupt),\n"
            "                  (signal.SIGTERM, exit_codes.Terminated)):\n"
            "    with signals.handled_signals('test'):\n"
            "        signals.check()\n"
            "        os.kill(os.getpid(), sig)\n"
            "        time.sleep(0.3)  # the handler runs here and raises nothing\n"
            "        assert signals.requested() == sig\n"
            "        try:\n"
            "            signals.check()\n"
            "        except kind as e:\n"
            "            assert type(e) is kind\n"
            "        else:\n"
            "            raise AssertionError('check raised nothing')\n"
            "    assert signals.requested() is None\n"
            "    signals.check()  # outside: nothing recorded, nothing raised\n"
            "assert {s: signal.getsignal(s) for s in signals.STOP_SIGNALS} == before\n"
            "print('ok')\n")
    run = _python(code)
    assert run.stdout.strip() == "ok", run.stderr[-1500:]


def test_the_output_is_out_before_the_handlers_are_given_back():
    """What a command printed inside `signals.handled_signals` (its summary: how a script
    tells that it finished) is flushed before the handlers are given back, so a signal
    that ends the process just after (the interpreter exiting) cannot lose it (stdout to a
    pipe is block-buffered: without the flush the line is lost)."""
    code = ("import os, signal\n"
            "from tev_jax.runtime import signals\n"
            "with signals.handled_signals('test'):\n"
            "    print('done')\n"
            "os.kill(os.getpid(), signal.SIGTERM)  # Python's handler again: the end\n")
    buffered = {k: v for k, v in env().items() if k != "PYTHONUNBUFFERED"}
    run = _python(code, environ=buffered)
    assert (run.returncode, run.stdout) == (-signal.SIGTERM, "done\n"), run.stderr[-1500:]


@pytest.mark.parametrize("first, second", [("SIGINT", "SIGINT"), ("SIGTERM", "SIGINT")])
def test_a_second_ctrl_c_exits_at_once_while_the_main_thread_is_busy(first, second):
    """A SIGINT after a first signal ends the process at once with 130, while the main
    thread is still inside one call (here a read that waits for ever; a compile in real
    life) and never reaches a check. (A repeated SIGTERM does not: the in-process batch job of
    test_interrupts_end_with_one_line_and_a_documented_code gets one per result and still
    stops cleanly.)"""
    code = ("import os, signal, threading, time\n"
            "from tev_jax.runtime import signals\n"
            "def send():\n"
            f"    for sig in (signal.{first}, signal.{second}):\n"
            "        time.sleep(0.5)\n"
            "        os.kill(os.getpid(), sig)\n"
            "with signals.handled_signals('test'):\n"
            "    threading.Thread(target=send, daemon=True).start()\n"
            "    os.read(os.pipe()[0], 1)  # blocks: nothing is ever written\n"
            "print('not reached')\n")
    run = _python(code)
    assert run.returncode == 128 + signal.Signals[second], (run.returncode, run.stderr)
    assert "not reached" not in run.stdout
    assert run.stderr.strip() == f"test: {second} again: stopped at once"


def test_an_ignored_sigint_stays_ignored():
    """A process started with SIGINT ignored (``nohup``, a background job, some CI
    runners) keeps ignoring it inside `signals.handled_signals`; SIGTERM is still taken."""
    code = ("import os, signal, time\n"
            "from tev_jax.runtime import signals\n"
            "with signals.handled_signals('test'):\n"
            "    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    time.sleep(0.2)\n"
            "    assert signals.requested() is None\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(0.2)\n"
            "    assert signals.requested() == signal.SIGTERM\n"
            "print('ok')\n")
    run = _python(code, sigint=signal.SIG_IGN)
    assert run.stdout.strip() == "ok", run.stderr[-1500:]


START_UP = {  # a command that does its work in its first seconds: imports, parsing
    "tev-jax": ["-m", "tev_jax.cli", "generate", "--help"],
    "tev-train": ["-m", "train", "plan", "--help"],
}


@pytest.mark.parametrize("prog, sig, delay", [("tev-jax", signal.SIGTERM, 0.3),
                                              ("tev-jax", signal.SIGINT, 1.2),
                                              ("tev-train", signal.SIGINT, 0.3),
                                              ("tev-train", signal.SIGTERM, 1.2)])
def test_a_signal_during_start_up_ends_with_one_line(prog, sig, delay, tmp_path):
    """SIGTERM or SIGINT while a command still imports jax or parses its arguments ends
    it with 128 + the signal and one line, no traceback (it ended silently with -15, or
    printed a 25-line traceback)."""
    code, out = interrupt([sys.executable, *START_UP[prog]], tmp_path, delay, sig,
                           done="usage:")
    if check_exit(prog, code, out, sig, delay, "usage:") == 0:
        # it had printed its help and was exiting (a faster start-up: Python 3.12 with
        # the newest jax): Python's handler is back, and the help is whole
        assert "usage:" in out and "Traceback" not in out, out[-1500:]
        return
    name = "python -m train" if prog == "tev-train" else prog
    what = {signal.SIGINT: "interrupted (SIGINT)", signal.SIGTERM: "terminated (SIGTERM)"}
    assert (code, out.strip()) == (128 + sig, f"{name}: {what[sig]}")
