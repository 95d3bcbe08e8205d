"""``tev-train run``'s command line (`train.__main__`): every bad flag is refused in one
line naming the flag (not a Python field), before any model is loaded and before
anything is written; boolean flags are strict and ``none`` unsets only optional fields;
a new ``--out-dir`` is announced (and refused with ``--resume true``); one run per
``--out-dir``. Planning and memory refusals: tests/test_train_plan.py; rollouts:
tests/test_rollouts.py. From issues 26, 38 and 47; the runs use the tiny models of
`train_fixtures`, called in-process.
"""

from __future__ import annotations

import pytest
from cli_fixtures import train_refused_one_line, train_run_argv
from cli_fixtures import model_dirs  # noqa: F401  (a fixture)
from train_fixtures import train_dirs  # noqa: F401  (a fixture)

from tev_jax.runtime import locks
from train import __main__ as train_cli
from train.checkpoint import steps_in
from train.rollouts import write_rollouts


def _run_args(*extra):
    return train_cli.build_parser().parse_args(["run", *extra])


def test_config_errors_name_flags_and_short_runs_get_a_warmup(capsys):
    """Issue 26, finding 17: a config error names the flags typed, not Python fields; the
    default warmup no longer fails a run shorter than it."""
    code = train_cli.main(["run", "--steps", "6", "--warmup-steps", "10"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert "--warmup-steps must be in [0, --steps=6], got 10" in err
    ns = train_cli.build_parser().parse_args(["run", "--steps", "5"])
    assert train_cli.config_from_args(ns).warmup_steps == 5


def test_rollouts_too_short_for_the_horizon_are_refused(model_dirs, tmp_path,  # noqa: F811
                                                         capsys):
    """Issue 38, item 4: rollouts whose responses are shorter than the drafter's horizon
    are refused (every loss would be 0) before anything is written."""
    write_rollouts(tmp_path / "data", [[5, 6, 7]] * 4, [[8, 9]] * 4)
    out = tmp_path / "run"
    line = train_refused_one_line(
        ["run", "--target-path", str(model_dirs / "target"), "--data-dir",
         str(tmp_path / "data"), "--out-dir", str(out), "--block-size", "4",
         "--mask-token-id", "63", "--steps", "2", "--no-progress"], capsys)
    assert "have no anchor to train on: the longest response has 2 tokens" in line
    assert "--block-size=4 needs at least 3" in line
    assert not out.exists()


@pytest.mark.parametrize("value", ["ture", "2", ""])
def test_boolean_flags_are_strict(capsys, value):
    """Issue 38, item 5: `--resume ture` is a usage error, not false (which would move a
    run's checkpoints aside)."""
    with pytest.raises(SystemExit) as e:
        _run_args("--resume", value)
    assert e.value.code == 2
    assert f"takes true or false, got {value!r}" in capsys.readouterr().err
    assert train_cli.config_from_args(_run_args("--resume", "off")).resume is False


def test_none_sets_optional_fields_and_is_refused_elsewhere(capsys):
    """Issue 38, item 6: `--exit-prefix-window none` overrides the recipe's 64; `--steps
    none` is refused instead of becoming the default."""
    cfg = train_cli.config_from_args(_run_args("--recipe", "paper", "--exit-prefix-window",
                                               "none"))
    assert cfg.exit_prefix_window is None
    assert train_cli.config_from_args(_run_args("--recipe", "paper")).exit_prefix_window == 64
    with pytest.raises(SystemExit):
        _run_args("--steps", "none")
    assert "takes an int, not 'none'" in capsys.readouterr().err


@pytest.mark.parametrize("flags, named", [
    (["--exit-lambda", "nan"], "--exit-lambda must be a finite number >= 0, got nan"),
    (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
    (["--weight-decay", "-1"], "--weight-decay must be a finite number >= 0"),
    (["--b1", "2"], "--b1 must be a finite number in [0, 1)"),
    (["--b2", "-3"], "--b2 must be a finite number in [0, 1)"),
    (["--max-minutes", "-1"], "--max-minutes must be a number > 0"),
    (["--until-update", "0"], "--until-update must be >= 1"),
    (["--drafter-path", "d", "--block-size", "8"], "--block-size shape a new drafter")])
def test_bad_numbers_are_refused_before_training(capsys, flags, named):
    """Issue 38, item 7 (and the nits on --max-minutes, --until-update and new-drafter
    flags with --drafter-path): one line naming the flag, before any model is loaded."""
    assert named in train_refused_one_line(["run", *flags], capsys)


def test_target_layer_ids_outside_the_target_name_the_flag():
    """A new drafter's taps beyond the target's layers: one line naming the flag."""
    from tev_jax.models.bundled import bundle_root
    from train.config import TrainConfig
    from train.loop import load_models

    cfg = TrainConfig(target_path=str(bundle_root() / "target"), target_layer_ids=(0, 99))
    with pytest.raises(ValueError, match=r"^--target-layer-ids 99: the target .* has layers 0\.\.3$"):
        load_models(cfg)


def test_a_new_out_dir_is_announced_and_resume_true_refuses_it(train_dirs, tmp_path,  # noqa: F811
                                                               capsys):
    """Issue 47, item 3: a mistyped --out-dir starts a new run only saying so, and with
    --resume true it is refused in one line, before anything is written."""
    typo = tmp_path / "runs" / "exti"
    assert train_cli.main(train_run_argv(train_dirs, typo, "--resume", "true")) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert f"--resume true but {typo / 'checkpoints'} holds no checkpoint" in err
    assert f"is --out-dir ({typo}) mistyped?" in err
    assert not (tmp_path / "runs").exists()

    assert train_cli.main(train_run_argv(train_dirs, typo, "--until-update", "2")) == 0
    assert f"starting a new run in {typo} (no checkpoint there yet)" in capsys.readouterr().err
    assert train_cli.main(train_run_argv(train_dirs, typo, "--until-update", "4", "--resume",
                                         "true")) == 0
    err = capsys.readouterr().err
    assert "starting a new run" not in err and steps_in(typo / "checkpoints")[-1] == 4


def test_two_runs_on_one_out_dir_are_refused(train_dirs, tmp_path, capsys):  # noqa: F811
    """Issue 47, item 4: a second run on an --out-dir that a run holds is refused, naming
    the holder; nothing of the first run's is touched."""
    out = tmp_path / "run"
    with locks.lock_output(out / "run", command="tev-train run (the first)"):
        assert train_cli.main(train_run_argv(train_dirs, out)) == 2
        err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{out} is being written by another process (pid" in err
    assert "tev-train run (the first)" in err and "use another --out-dir" in err
    assert not out.exists()
