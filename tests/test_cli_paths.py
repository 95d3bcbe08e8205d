"""A missing input path of ``tev-jax`` or ``tev-train`` is refused before any work in one
line that names the flag and the path as the user typed it (``./nope`` stays ``./nope``),
exit code 2, with nothing written (issue 58, item 12); and the files of ``--quick``
experiment runs are ignored by git. The commands are called in-process from a temporary
folder, so every ``./...`` path is relative to it.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tev_jax import cli
from tev_jax.runtime.exit_codes import check_readable
from train import __main__ as train_cli

ROOT = Path(__file__).resolve().parent.parent


def tev_jax_line(argv, capsys) -> str:
    """The one stderr line of a refused ``tev-jax`` command (exit code 2)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def tev_train_line(argv, capsys) -> str:
    """The one stderr line of a refused ``tev-train`` command (exit code 2)."""
    capsys.readouterr()
    assert train_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A temporary working folder holding one folder ``dir`` and one file ``file.txt``."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dir").mkdir()
    (tmp_path / "file.txt").write_text("w1 w2\n")
    return tmp_path


def written(folder: Path) -> list[str]:
    """What is in ``folder`` besides the fixture's ``dir`` and ``file.txt``."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if p.name not in ("dir", "file.txt"))


TEV_JAX_MISSING = [
    # (argv, the flag, the path as typed, what)
    (["generate", "--prompts", "./nope.jsonl", "--output", "./o.jsonl"],
     "--prompts", "./nope.jsonl", "no such prompts file"),
    (["generate", "--prompts", "bundled:gsm", "--output", "./o.jsonl", "--target", "./nope",
      "--drafter", "./d"], "--target", "./nope", "no such target checkpoint folder"),
    (["generate", "hi", "--target", "./nope", "--drafter", "./d"],
     "--target", "./nope", "no such target checkpoint folder"),
    (["generate", "hi", "--drafter", "./nope"],
     "--drafter", "./nope", "no such drafter checkpoint folder"),
    (["generate", "hi", "--budget", "auto", "--tuning", "./nope.json"],
     "--tuning", "./nope.json", "no such tuning file"),
    (["generate", "--prompts", "./dir", "--output", "./o.jsonl"],
     "--prompts", "./dir", "a folder, not a prompts file"),
    (["generate", "hi", "--target", "./file.txt", "--drafter", "./dir"],
     "--target", "./file.txt", "a file, not a target checkpoint folder"),
    (["tune", "--prompts", "./nope.jsonl"], "--prompts", "./nope.jsonl",
     "no such prompts file"),
    (["tune", "--prompts", "bundled:gsm", "--target", "./nope", "--drafter", "./dir"],
     "--target", "./nope", "no such target checkpoint folder"),
    (["tune", "--prompts", "bundled:gsm", "--drafter", "./nope"],
     "--drafter", "./nope", "no such drafter checkpoint folder"),
]


@pytest.mark.parametrize("argv, flag, path, why", TEV_JAX_MISSING,
                         ids=[f"{a[0]} {f} {w.split()[0]}" for a, f, _, w in TEV_JAX_MISSING])
def test_tev_jax_names_the_flag_and_the_path_as_typed(argv, flag, path, why, here, capsys):
    line = tev_jax_line(argv, capsys)
    assert line == f"tev-jax {argv[0]}: error: {flag} {path}: {why}"
    assert written(here) == []


TEV_TRAIN_MISSING = [
    (["rollouts", "--target", "bundled", "--prompts-file", "./nope.txt", "--out", "./r"],
     "--prompts-file", "./nope.txt", "no such prompts file"),
    (["rollouts", "--target", "./nope", "--prompt-set", "gsm", "--out", "./r"],
     "--target", "./nope", "no such target checkpoint folder"),
    (["rollouts", "--target", "bundled", "--tokenizer", "./nope", "--prompt-set", "gsm",
      "--out", "./r"], "--tokenizer", "./nope", "no such tokenizer file or folder"),
    (["run", "--config", "./nope.json", "--out-dir", "./o"],
     "--config", "./nope.json", "no such config file"),
    (["run", "--target-path", "./nope", "--data-dir", "./dir", "--out-dir", "./o"],
     "--target-path", "./nope", "no such target checkpoint folder"),
    (["run", "--target-path", "bundled", "--drafter-path", "./nope", "--data-dir", "./dir",
      "--out-dir", "./o"], "--drafter-path", "./nope", "no such drafter checkpoint folder"),
    # --init-from is --drafter-path's other spelling: the line gives the flag's name
    (["run", "--init-from", "./nope", "--out-dir", "./o"],
     "--drafter-path", "./nope", "no such drafter checkpoint folder"),
    (["run", "--target-path", "bundled", "--data-dir", "./nope", "--out-dir", "./o"],
     "--data-dir", "./nope", "no such rollout folder"),
    (["run", "--data-dir", "./file.txt", "--out-dir", "./o"],
     "--data-dir", "./file.txt", "a file, not a rollout folder"),
]


@pytest.mark.parametrize("argv, flag, path, why", TEV_TRAIN_MISSING,
                         ids=[f"{a[0]} {f} {w.split()[0]}" for a, f, _, w in TEV_TRAIN_MISSING])
def test_tev_train_names_the_flag_and_the_path_as_typed(argv, flag, path, why, here, capsys):
    line = tev_train_line(argv, capsys)
    assert line.endswith(f" {argv[0]}: error: {flag} {path}: {why}"), line
    assert written(here) == []


def test_tev_train_plan_names_the_flag_of_an_unknown_target(here, capsys):
    line = tev_train_line(["plan", "--target", "./nope"], capsys)
    assert ": error: --target ./nope: neither a preset (" in line
    assert "nor a config.json or its folder" in line


# ------------------------------------------------------------- negative controls


def test_existing_paths_pass_the_checks(here, capsys):
    """Existing paths are not refused by the check: each command goes on to the next
    check, which refuses something else (so nothing heavy runs)."""
    (here / "tuning.json").write_text("{")
    # generate: the tuning file is read (and its malformed JSON refused there)
    line = tev_jax_line(["generate", "hi", "--target", "./dir", "--drafter", "./dir",
                         "--budget", "auto", "--tuning", "./tuning.json"], capsys)
    assert "cannot read the tuning file ./tuning.json" in line
    # generate --prompts: the shard flags come after the path checks
    line = tev_jax_line(["generate", "--prompts", "./file.txt", "--output", "./o.jsonl",
                         "--target", "./dir", "--drafter", "./dir", "--process-index", "0"],
                        capsys)
    assert "give both --process-index and --process-count" in line
    # tune: --json's folder is checked after the inputs
    line = tev_jax_line(["tune", "--prompts", "./file.txt", "--target", "./dir",
                         "--drafter", "./dir", "--json", "./none/t.json"], capsys)
    assert line.startswith("tev-jax tune: error: --json ./none/t.json: cannot write it")
    # a drafter that --builder none does not use is not checked
    line = tev_jax_line(["generate", "hi", "--builder", "none", "--drafter", "./nope",
                         "--target", "./dir", "--budget", "auto", "--tuning",
                         "./tuning.json"], capsys)
    assert "cannot read the tuning file ./tuning.json" in line
    # tev-train rollouts: --stop-ids is read after the path checks
    line = tev_train_line(["rollouts", "--target", "./dir", "--tokenizer", "./file.txt",
                           "--prompts-file", "./file.txt", "--out", "./r",
                           "--stop-ids", "x"], capsys)
    assert "--stop-ids takes comma-separated token ids" in line
    # tev-train run: the (empty) folders pass the checks; loading the target refuses it
    (here / "base.json").write_text("{}")
    line = tev_train_line(["run", "--config", "./base.json", "--target-path", "./dir",
                           "--drafter-path", "./dir", "--data-dir", "./dir",
                           "--out-dir", "./o"], capsys)
    assert "no config.json" in line and "no such" not in line
    assert written(here) == ["base.json", "tuning.json"]


def test_check_readable_keeps_the_path_as_typed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "f.json").write_text("{}")
    for ok in (None, "./f.json", str(tmp_path / "f.json"), "gs://bucket/x"):
        check_readable(ok, "--tuning", "tuning file", folder=False)
    check_readable(".", "--target", "target folder", folder=True)
    check_readable("./f.json", "--tokenizer", "tokenizer file or folder")
    with pytest.raises(ValueError, match=r"^--tuning \./x/\./y\.json: no such tuning file$"):
        check_readable("./x/./y.json", "--tuning", "tuning file", folder=False)


# ---------------------------------------------------------------- quick results


def test_quick_results_of_experiments_are_ignored_by_git():
    """``--quick`` runs write results_quick.json beside run.py; git ignores them (the two
    committed on purpose stay tracked: git never ignores a tracked file)."""
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and the repository's work tree")

    def ignored(path):
        rc = subprocess.run([git, "check-ignore", "-q", path], cwd=ROOT,
                            capture_output=True, check=False).returncode
        assert rc in (0, 1), f"git check-ignore failed for {path}"
        return rc == 0

    assert ignored("experiments/tree_builder/results_quick.json")
    assert ignored("experiments/scale/results_quick.json")
    assert not ignored("experiments/tree_builder/results.json")   # negative control
    tracked = subprocess.run([git, "ls-files", "--", "*results_quick.json"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    assert all(not ignored(p) for p in tracked), tracked
