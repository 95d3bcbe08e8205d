"""Issue 47: the user's path, round three — a trainer that cannot lose a run, messages
that say what is true, and the bundled models accepted wherever a model is named.

Each test names the numbered item of issue 47 it pins. The training runs use the tiny
models of `train_fixtures`; both command lines are called in-process.
"""

from __future__ import annotations

import pytest

import train_fixtures as tf
from tev_jax import batch_io
from tev_jax.models.bundled import bundled_paths
from tev_jax.models.checkpoint_io import weights_fingerprint
from tev_jax.models import save_target
from tev_jax.models.drafter_io import save_drafter
from train import __main__ as train_cli
from train.checkpoint import steps_in
from train.rollouts import RolloutSet, write_rollouts


@pytest.fixture(scope="module")
def train_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target, drafter = tf.models()
    save_target(target, root / "target")
    save_drafter(drafter, root / "drafter")
    data = tf.progressions()
    write_rollouts(root / "data", [t[:s] for t, (s, _) in zip(data.tokens, data.spans)],
                   [t[s:e] for t, (s, e) in zip(data.tokens, data.spans)],
                   info={"target": str(root / "target"),
                         "target_fingerprint": weights_fingerprint(root / "target")})
    return root


def _train(root, out, *extra):
    return ["run", "--target-path", str(root / "target"), "--drafter-path",
            str(root / "drafter"), "--data-dir", str(root / "data"), "--out-dir", str(out),
            "--loss", "token", "--batch-size", "8", "--num-anchors", "2", "--steps", "6",
            "--lr", "0.01", "--warmup-steps", "0", "--checkpoint-every", "2", "--no-progress",
            *extra]


READ = RolloutSet.batch_at


def _interrupt_at(monkeypatch, micro_step):
    read = READ

    def batch_at(self, seed, step, *args, **kw):
        if step == micro_step:
            raise KeyboardInterrupt
        return read(self, seed, step, *args, **kw)

    monkeypatch.setattr(RolloutSet, "batch_at", batch_at)


def test_an_interrupted_run_says_which_checkpoint_is_kept(train_dirs, tmp_path, capsys,
                                                           monkeypatch):
    """Item 2: interrupted before its first checkpoint, a run says that nothing is saved
    (not that checkpoints "are kept"); interrupted later, it names the update of the
    newest checkpoint, which is the one on disk."""
    out = tmp_path / "run"
    _interrupt_at(monkeypatch, 1)
    assert train_cli.main(_train(train_dirs, out)) == 75
    err = capsys.readouterr().err
    assert "are kept" not in err and "interrupted (SIGINT); no checkpoint was written yet" in err
    assert "the first comes at update 2" in err and steps_in(out / "checkpoints") == []

    _interrupt_at(monkeypatch, 4)            # during update 5: updates 2 and 4 are saved
    assert train_cli.main(_train(train_dirs, out)) == 75
    err = capsys.readouterr().err
    assert "the newest checkpoint, at update 4, is in" in err, err
    assert steps_in(out / "checkpoints")[-1] == 4


def test_a_new_out_dir_is_announced_and_resume_true_refuses_it(train_dirs, tmp_path, capsys):
    """Item 3: a mistyped --out-dir starts a new run only saying so, and with --resume
    true it is refused in one line, before anything is written."""
    typo = tmp_path / "runs" / "exti"
    assert train_cli.main(_train(train_dirs, typo, "--resume", "true")) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert f"--resume true but {typo / 'checkpoints'} holds no checkpoint" in err
    assert f"is --out-dir ({typo}) mistyped?" in err
    assert not (tmp_path / "runs").exists()

    assert train_cli.main(_train(train_dirs, typo, "--until-update", "2")) == 0
    assert f"starting a new run in {typo} (no checkpoint in" in capsys.readouterr().err
    assert train_cli.main(_train(train_dirs, typo, "--until-update", "4", "--resume",
                                 "true")) == 0
    err = capsys.readouterr().err
    assert "starting a new run" not in err and steps_in(typo / "checkpoints")[-1] == 4


def test_two_runs_on_one_out_dir_are_refused(train_dirs, tmp_path, capsys):
    """Item 4: a second run on an --out-dir that a run holds is refused, naming the
    holder; nothing of the first run's is touched."""
    out = tmp_path / "run"
    with batch_io.lock_output(out / "run", command="tev-train run (the first)"):
        assert train_cli.main(_train(train_dirs, out)) == 2
        err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{out} is being written by another process (pid" in err
    assert "tev-train run (the first)" in err and "use another --out-dir" in err
    assert not out.exists()


def test_bundled_names_a_training_target_and_drafter():
    """Item 5: --target-path bundled and --drafter-path bundled[:NAME] name the bundled
    models, as tev-train rollouts --target bundled does."""
    paths = bundled_paths()
    ns = train_cli.build_parser().parse_args(
        ["run", "--target-path", "bundled", "--drafter-path", "bundled:dflash",
         "--data-dir", "d"])
    cfg = train_cli.config_from_args(ns)
    assert cfg.target_path == str(paths.target)
    assert cfg.drafter_path == str(paths.drafters["dflash"])
    ns = train_cli.build_parser().parse_args(["run", "--drafter-path", "bundled"])
    assert train_cli.config_from_args(ns).drafter_path == str(paths.drafter)
    ns = train_cli.build_parser().parse_args(["run", "--drafter-path", "bundled:nope"])
    with pytest.raises(ValueError, match="unknown bundled drafter 'nope'"):
        train_cli.config_from_args(ns)
