"""Issue 47: the user's path, round three — a trainer that cannot lose a run, messages
that say what is true, and the bundled models accepted wherever a model is named.

Each test names the numbered item of issue 47 it pins. The training runs use the tiny
models of `train_fixtures`; both command lines are called in-process.
"""

from __future__ import annotations

import pytest
from train_fixtures import train_dirs  # noqa: F401  (a fixture)

from tev_jax import text_io
from tev_jax.batch import outputs
from tev_jax.models.bundled import bundled_paths
from train import __main__ as train_cli
from train.checkpoint import steps_in
from train.rollouts import RolloutSet


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
    with outputs.lock_output(out / "run", command="tev-train run (the first)"):
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


# --------------------------------------------------------------------- tev-jax messages


def _refused(argv, capsys, prog="tev-jax") -> str:
    from tev_jax import cli

    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    return err


def test_prompt_file_messages(tmp_path, capsys):
    """Item 10: a UTF-8 byte-order mark is accepted; a prompts file that is also the
    output is refused (with --force too) before anything is read or written."""
    p = tmp_path / "p.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"id": "a", "prompt": "hi"}\n')
    assert [r.id for r in text_io.read_prompts(p)] == ["a"]
    text = p.read_bytes()
    err = _refused(["generate", "--prompts", str(p), "--output", str(p), "--force"], capsys)
    assert "\n" not in err and "--prompts and --output are the same file" in err
    assert p.read_bytes() == text and not (tmp_path / "p.jsonl.lock").exists()


def test_flag_messages(capsys):
    """Item 10: 'or None' reads as CLI words; a flag typo shows the subcommand's usage;
    a mesh larger than the devices gets the XLA_FLAGS hint; exit-law runs without
    --demo."""
    from tev_jax import cli

    err = _refused(["generate", "hi", "--temperature", "1", "--top-p", "2"], capsys)
    assert "--top-p must be in (0, 1] or unset, got 2.0" in err and "None" not in err
    err = _refused(["generate", "hi", "--bogus"], capsys)
    assert err.startswith("usage: tev-jax generate ") and "unrecognized arguments: --bogus" in err
    with pytest.raises(SystemExit):
        train_cli.main(["run", "--bogus"])
    err = capsys.readouterr().err
    assert "usage: " in err and " run [-h]" in err
    err = _refused(["generate", "hi", "--mesh-data", "16"], capsys)
    assert "needs 16 devices" in err and "--xla_force_host_platform_device_count" in err
    assert cli.main(["exit-law", "--draws", "200"]) == 0
    assert "mean block length over 200 draws" in capsys.readouterr().out


def test_the_bundled_target_named_by_its_folder_takes_the_bundled_drafter():
    """Item 10 (and 5): --target bundled, or the bundled target's folder, with the
    default drafter is the bundled pair (it was refused for want of --drafter)."""
    import argparse

    from tev_jax.cli import flags

    paths = bundled_paths()
    for target in ("bundled", str(paths.target)):
        args = argparse.Namespace(target=target, drafter=None, builder="ddtree")
        t, d, where = flags.checkpoint_dirs(args)
        assert (t, d) == (str(paths.target), str(paths.drafter))
        assert where == "bundled target + bundled exittrain drafter"


def test_demo_models_help_and_errors(tmp_path, capsys):
    """Items 6 and 10: python -m train.demo.build --help names itself and documents
    --runs; a missing data folder is one line, exit 2."""
    from train.demo import build as demo_models

    with pytest.raises(SystemExit):
        demo_models.main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m train.demo.build") and "the folder every" in out
    code = demo_models.main(["--runs", str(tmp_path / "runs"), "--only", "corpus",
                             "--data-dir", str(tmp_path / "nowhere")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "lacks prose.jsonl" in err


def test_the_source_data_is_in_the_repository():
    """Item 6: the bundle's source data is in data/ of a clone, with its licences."""
    from train.demo import corpus, prepare_corpus

    assert prepare_corpus.DEFAULT_DATA_DIR == corpus.resolve_data_dir(
        prepare_corpus.DEFAULT_DATA_DIR)
    readme = (prepare_corpus.DEFAULT_DATA_DIR / "README.md").read_text()
    for name in corpus.SHARED_FILES:
        assert f"{name}" in readme


def test_chat_output_shows_the_turns(capsys):
    """Item 13: --chat prints the turns, with no leading empty line."""
    from tev_jax import cli

    assert cli.main(["generate", "What is 12 * 7?", "--chat", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("user: What is 12 * 7?\nassistant: ")


def test_quiet_tpu_runtime_fills_only_unset_variables(monkeypatch):
    """Item 12: without TPU chips, libtpu's environment is filled so that it starts
    without its errors; a variable the user set is kept, and a TPU machine is left
    alone."""
    from tev_jax.runtime import platforms

    for name in platforms.QUIET_TPU_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TPU_WORKER_ID", "3")
    monkeypatch.setattr(platforms, "tpu_chips_present", lambda: False)
    assert platforms.quiet_tpu_runtime()
    import os

    assert os.environ["TPU_WORKER_HOSTNAMES"] == "localhost" and os.environ["TPU_WORKER_ID"] == "3"
    monkeypatch.delenv("TPU_WORKER_HOSTNAMES")
    monkeypatch.setattr(platforms, "tpu_chips_present", lambda: True)
    assert not platforms.quiet_tpu_runtime() and "TPU_WORKER_HOSTNAMES" not in os.environ


def test_examples_run_from_any_folder(tmp_path):
    """Item 14: an example runs as a script from another folder (its --help here: the
    imports are what failed)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "fixed_tree_builder.py"
    run = subprocess.run([sys.executable, str(script), "--help"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "--max-new-tokens" in run.stdout, run.stderr[-500:]


def test_window_rates_ignore_bursts():
    """Item 11: rows finishing together do not read as thousands of prompts/s; the rate
    is over the window's real span."""
    from tev_jax.batch.rates import WindowRate

    now = [0.0]
    rate = WindowRate(window=10.0, min_span=2.0, clock=lambda: now[0])
    now[0] = 1.0
    for _ in range(5):                      # five rows in one call
        rate.add(prompts=1, tokens=100)
    assert rate.rate("prompts") is None     # under min_span: no rate yet
    now[0] = 4.0
    rate.add(prompts=1, tokens=100)
    assert rate.rate("prompts") == pytest.approx(6 / 4.0)
    now[0] = 20.0                           # the window moves on
    rate.add(prompts=1, tokens=50)
    assert rate.rate("tokens") is None or rate.rate("tokens") < 100


def test_exit_tree_figure_has_whole_depths_and_a_clear_root(tmp_path):
    """Item 15: the depth axis has ticks at whole depths only, and the root's label sits
    left of the root, clear of its children."""
    import matplotlib

    matplotlib.use("Agg")
    import experiment_scripts
    import matplotlib.pyplot as plt

    figures = experiment_scripts.load("figures")
    tree = dict(tokens=[1, 2, 3, 4], parents=[-1, 0, 0, 1], depths=[0, 1, 1, 2],
                reach=[1.0, 0.6, 0.3, 0.4], w=[0.1, 0.2, 0.3, 0.4], coverage=1.3)

    class Tok:
        def decode(self, ids, **kw):
            return f"t{ids[0]}"

    fig, ax = plt.subplots()
    figures.draw_tree(ax, tree, Tok(), "t", 0.4)
    assert list(ax.get_xticks()) == [0, 1, 2]
    root = [t for t in ax.texts if t.get_text().startswith("root")]
    assert len(root) == 1 and root[0].get_horizontalalignment() == "right"
    plt.close(fig)


def test_plans_check_their_arguments_before_compiling(capsys, monkeypatch):
    """Item 7: tev-train plan's fsdp axis defaults to the devices (8 here; fsdp 8 failed
    on one device), and a mesh too large, an unknown preset or a cache too short are
    refused before "compiling" is printed (tev-train plan and tev-jax plan)."""
    from train import plan as train_plan

    shapes = []

    def stop(target, **kw):
        shapes.append(kw["mesh_shape"])
        raise ValueError("stopped")

    monkeypatch.setattr(train_plan, "plan_step", stop)
    assert train_cli.main(["plan", "--target", "qwen3-0.6b", "--mesh-data", "2"]) == 2
    assert shapes == [(2, 4, 1)] and "mesh data 2 x fsdp 4 x tensor 1" in capsys.readouterr().err
    help_text = train_cli.build_parser().get_default("subcommands").choices["plan"] \
        .format_help()
    assert "every device the data and" in " ".join(help_text.split())
    for argv, named in ((["--mesh-fsdp", "16"], "needs 16 devices; the local devices have 8"),
                        (["--target", "qwen9"], "qwen9")):
        argv = ["plan", *(["--target", "qwen3-0.6b"] if "--target" not in argv else []), *argv]
        assert train_cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "compiling" not in err and named in err, err
    err = _refused(["plan", "--model", "qwen3-0.6b", "--layers", "1", "--prompt-len", "64",
                    "--cache-len", "128"], capsys)
    assert "compiling" not in err and "the cache is too short" in err
