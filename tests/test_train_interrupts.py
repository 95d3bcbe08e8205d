"""``tev-train``'s long commands interrupted (issue 51; the mechanism and ``tev-jax``'s
commands: tests/test_interrupts.py): a training run and a rollout generation get one
signal at a random time (seeded), from the first second (imports, compiling) to past
their first checkpoint or shard. Never a segfault, a traceback, a lost signal, or a lost
checkpoint or shard that the message says is on disk. The slow tier interrupts each
command 20 times; the fast tier the training run once. The message of an interrupted
run (which checkpoint is kept) is also checked in-process, on tiny models (issue 47)."""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from cli_fixtures import train_run_argv
from interrupting import before_the_command, check_exit, env, interrupt, interrupts
from train_fixtures import train_dirs  # noqa: F401  (a fixture)

from train import __main__ as train_cli
from train.checkpoint import steps_in
from train.rollouts import RolloutSet

RUN_FLAGS = ["--target-path", "bundled", "--drafter-path", "bundled:dflash", "--loss", "exit",
             "--budget", "16", "--num-anchors", "8", "--batch-size", "4", "--steps", "40",
             "--checkpoint-every", "2", "--no-progress"]


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    out = tmp_path_factory.mktemp("rollouts") / "ro"
    done = subprocess.run(
        [sys.executable, "-m", "train", "rollouts", "--target", "bundled", "--prompt-set",
         "gsm", "--limit", "8", "--out", str(out), "--max-new-tokens", "32",
         "--batch-size", "8"], env=env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def _check_run(cwd, code, err, sig):
    from train.checkpoint import steps_in

    if code == 0:  # finished: its last checkpoint is the last update's
        assert steps_in(cwd / "run" / "checkpoints")[-1] == 40
        return
    if before_the_command(code, err, sig):
        assert not (cwd / "run").exists()
        return
    assert code == 75, err[-2000:]
    steps = steps_in(cwd / "run" / "checkpoints")
    preempted = re.search(r"train run: (preempted \(SIGTERM\)|interrupted \(SIGINT\)) at "
                          r"update (\d+): checkpoint saved", err)
    if preempted:  # the signal taken after an update: a checkpoint at that update
        assert steps and steps[-1] == int(preempted.group(2)), err[-2000:]
        assert preempted.group(1).endswith(f"({signal.Signals(sig).name})"), err[-2000:]
        return
    newest = re.search(r"the newest checkpoint, at update (\d+), is in", err)
    if newest:
        assert steps and steps[-1] == int(newest.group(1))
    else:
        assert ("no checkpoint was written yet" in err
                or "before anything was written" in err), err[-2000:]
        assert steps == []


def _check_rollouts(cwd, code, err, sig):
    if code == 0:  # finished: all 24 prompts, in shards of 4
        assert len(list((cwd / "ro").glob("shard-*-of-*.json"))) == 6
        return
    if before_the_command(code, err, sig):
        assert not (cwd / "ro").exists()
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



COMMANDS = {
    # name: (argv without the program, what its output says once its work is done, check)
    "run": (["-m", "train", "run", *RUN_FLAGS, "--out-dir", "run"], "(compilation included)",
            _check_run),
    "rollouts": (["-m", "train", "rollouts", "--target", "bundled", "--prompt-set", "gsm",
                  "--limit", "24", "--out", "ro", "--max-new-tokens", "32", "--batch-size",
                  "4", "--shard-size", "4"], "sequences of length", _check_rollouts),
}


def _argv(name, rollouts):
    argv = COMMANDS[name][0]
    return [sys.executable, *argv] + (["--data-dir", str(rollouts)] if name == "run" else [])


@pytest.mark.slow  # the fast tier's time (README: under 10 minutes here), 2026-12-06
def test_one_interrupt_ends_cleanly(tmp_path, rollouts):
    """Fast tier: SIGINT at a random time in the first seconds (imports, compiling, the
    first updates) of a training run."""
    _, done, check = COMMANDS["run"]
    sig, delay = signal.SIGINT, random.Random(4).uniform(2.0, 8.0)
    code, err = interrupt(_argv("run", rollouts), tmp_path, delay, sig, done)
    code = check_exit("run", code, err, sig, delay, done)
    check(tmp_path, code, err, sig)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_twenty_interrupts_per_command(name, tmp_path, rollouts):
    """Slow tier: 20 signals (SIGINT and SIGTERM in turn) at random times within each
    command's lifetime, until 20 interrupted it; none may end in a segfault, lose its
    signal or lose what its message says is on disk, and at most 10 runs may finish
    before their signal."""
    _, done, check = COMMANDS[name]
    codes = interrupts(name, _argv(name, rollouts), done, check, count=20,
                       seed=2 + sorted(COMMANDS).index(name), tmp_path=tmp_path)
    assert sum(c != 0 for c in codes) == 20, (
        f"{name}: {sum(c == 0 for c in codes)} of {len(codes)} runs ended before the signal")
    assert -11 not in codes and 139 not in codes


READ = RolloutSet.batch_at


def _interrupt_at(monkeypatch, micro_step):
    """A KeyboardInterrupt when a run reads the batch of ``micro_step`` (in-process)."""
    read = READ

    def batch_at(self, seed, step, *args, **kw):
        if step == micro_step:
            raise KeyboardInterrupt
        return read(self, seed, step, *args, **kw)

    monkeypatch.setattr(RolloutSet, "batch_at", batch_at)


def test_an_interrupted_run_says_which_checkpoint_is_kept(train_dirs, tmp_path,  # noqa: F811
                                                           capsys, monkeypatch):
    """In-process, on the tiny models of `train_fixtures` (issue 47, item 2): interrupted
    before its first checkpoint, a run says that nothing is saved (not that checkpoints
    "are kept"); interrupted later, it names the update of the newest checkpoint, which
    is the one on disk, and its summary says "last", not "final"; run again, it says that
    it resumes, and from which update."""
    out = tmp_path / "run"
    _interrupt_at(monkeypatch, 1)
    assert train_cli.main(train_run_argv(train_dirs, out)) == 75
    err = capsys.readouterr().err
    assert "are kept" not in err and "interrupted (SIGINT); no checkpoint was written yet" in err
    assert "the first comes at update 2" in err and steps_in(out / "checkpoints") == []

    _interrupt_at(monkeypatch, 4)            # during update 5: updates 2 and 4 are saved
    assert train_cli.main(train_run_argv(train_dirs, out)) == 75
    err = capsys.readouterr().err
    assert "the newest checkpoint, at update 4, is in" in err, err
    assert steps_in(out / "checkpoints")[-1] == 4

    # issue 58, item 8: run again, it says that it resumes and from which update; a run
    # stopped before its end sums up its last update, not its "final" one
    monkeypatch.setattr(RolloutSet, "batch_at", READ)
    assert train_cli.main(train_run_argv(train_dirs, out, "--until-update", "5")) == 0
    captured = capsys.readouterr()
    assert f"resuming the run in {out} from its checkpoint at update 4 of 6" in captured.err
    assert "last (update 5)" in captured.out and "final (update" not in captured.out
    assert train_cli.main(train_run_argv(train_dirs, out)) == 0
    assert "final (update 6)" in capsys.readouterr().out
