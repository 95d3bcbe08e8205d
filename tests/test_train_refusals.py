"""Issue 51, item 3: a training run whose update would not fit is refused before it writes
anything: one line naming the flag, exit code 2, no ``--out-dir`` left behind. Absurd
settings are refused at once from shapes (`train.plan.check_step_floor`, and
``--num-anchors`` above a sequence's anchor positions); the rest after the step compiles
and before the first write (`train.plan.check_step_fits`).

The runs use the tiny models of `train_fixtures`, called in-process; the free memory is
set by patching `train.plan.available_bytes`, so the refusals do not depend on this
machine.
"""

from __future__ import annotations

import re

import pytest

from train_fixtures import SEQ_LEN, train_dirs  # noqa: F401  (a fixture)
from train import __main__ as train_cli
from train import plan as train_plan


def _train(root, out, *extra):
    return ["run", "--target-path", str(root / "target"), "--drafter-path",
            str(root / "drafter"), "--data-dir", str(root / "data"), "--out-dir", str(out),
            "--loss", "token", "--batch-size", "8", "--num-anchors", "2", "--steps", "2",
            "--warmup-steps", "0", "--no-progress", *extra]


def _refused(argv, capsys) -> str:
    capsys.readouterr()
    assert train_cli.main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in captured.err, captured.err
    return err[0]


def _free(monkeypatch, *nbytes: int) -> None:
    """Free memory per device: ``nbytes`` at the first checks, the last one after."""
    answers = list(nbytes)
    monkeypatch.setattr(train_plan, "available_bytes", lambda devices=None: (
        answers.pop(0) if len(answers) > 1 else answers[0], "test memory"))


def test_more_anchors_than_positions_is_refused(train_dirs, tmp_path, capsys):
    out = tmp_path / "run"
    line = _refused(_train(train_dirs, out, "--num-anchors", str(SEQ_LEN)), capsys)
    assert re.search(rf"--num-anchors \({SEQ_LEN}\) is more than the anchor positions", line)
    most = int(re.search(r"use at most (\d+)", line).group(1))
    assert 0 < most < SEQ_LEN
    assert not out.exists()


def test_a_batch_whose_features_alone_do_not_fit_is_refused_at_once(train_dirs, tmp_path,
                                                                    capsys, monkeypatch):
    """--batch-size 100000 (the issue's setting): the target features of the batch exceed
    the 1 MiB free, refused from shapes; nothing compiled or written."""
    _free(monkeypatch, 2**20)
    out = tmp_path / "run"
    line = _refused(_train(train_dirs, out, "--batch-size", "100000"), capsys)
    assert "not enough memory: a training update needs" in line
    assert "(target features" in line and "--batch-size (100000)" in line
    assert not out.exists()


def test_an_update_that_compiles_too_big_is_refused_before_any_write(train_dirs, tmp_path,
                                                                     capsys, monkeypatch):
    """The same settings that train with enough memory: the floor from shapes passes (1 GiB
    free), and with 1 KiB free at the compiled check the update (its parameters and
    optimiser state alone are more) is refused, every part named and summing to the
    total; nothing written, not even the checkpoint folder."""
    _free(monkeypatch, 2**30, 2**10)
    out = tmp_path / "run"
    line = _refused(_train(train_dirs, out), capsys)
    need = float(re.search(r"needs ([\d.]+) MiB per device", line).group(1))
    parts = dict((k, float(v)) for k, v in re.findall(
        r"(arguments|temporaries|outputs|code) ([\d.]+)", line))
    assert set(parts) == {"arguments", "temporaries", "outputs", "code"}, line
    assert sum(parts.values()) == pytest.approx(need, abs=0.02)
    assert "--num-anchors (2) or --batch-size (8)" in line
    assert not out.exists()
    monkeypatch.undo()
    assert train_cli.main(_train(train_dirs, out)) == 0   # the control: it fits
    assert (out / "checkpoints").is_dir()
