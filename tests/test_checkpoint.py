"""Checkpoints: a killed, or SIGTERM-preempted, and resumed run gives bitwise the same
losses; a missing, corrupted or half-written checkpoint gives a clear error and leaves
the others intact; remote checkpoint paths stay URIs; listing them logs no deprecation
warning. Through ``tev-train run`` (issue 26): a preempted run exits 75, a refused rerun
leaves its config, a damaged newest checkpoint falls back to the newest good one, and
``--resume false`` moves the earlier checkpoints aside."""

from __future__ import annotations

import logging
import os
import shutil
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_fixtures as tf
from train_fixtures import train_dirs  # noqa: F401  (a fixture)

from tev_jax import sharding as shd
from train import __main__ as train_cli
from train.checkpoint import CheckpointError, TrainCheckpointer, abstract_like, checkpoint_path
from train.loop import read_log, train
from train.rollouts import RolloutSet


def _run(cfg, **kw):
    target, drafter = tf.models()
    return train(cfg, target=target, drafter=drafter, data=tf.progressions(), progress=False,
                 save_final_drafter=False, **kw)


# On a data x fsdp mesh when 8 (host) devices exist: restoring sharded state is the
# harder path (the single-device restore is checked by the 30-step test).
MESH = dict(mesh_data=2, mesh_fsdp=4, mesh_tensor=1) if shd.device_count_ok(8) else {}


@pytest.mark.slow  # issue 58, item 11: the fast tier's headroom
def test_kill_and_resume_gives_bitwise_identical_losses(tmp_path):
    straight = _run(tf.config(tmp_path / "straight", **MESH), until_update=6)
    cfg = tf.config(tmp_path / "resumed", **MESH)
    first = _run(cfg, until_update=3)                  # "killed" after update 3
    assert [h["update"] for h in first.history] == [1, 2, 3]
    with (tmp_path / "resumed" / "train_log.jsonl").open("a") as f:
        f.write('{"update": 4, "loss": 0.0}\n')     # logged after the last checkpoint
    second = _run(cfg, until_update=6)
    assert second.start_update == 3
    keys = ("loss", "token_loss", "exit_loss", "tau", "grad_norm", "lr")
    got = [[h[k] for k in keys] for h in first.history + second.history]
    want = [[h[k] for k in keys] for h in straight.history]
    assert got == want
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(second.state.params),
                 jax.device_get(straight.state.params))
    if MESH:
        kernel = second.state.params["fc"]["kernel"]
        assert not kernel.sharding.is_fully_replicated      # restored with its sharding
    log = read_log(tmp_path / "resumed" / "train_log.jsonl")
    assert [r["update"] for r in log] == [1, 2, 3, 4, 5, 6]

    with pytest.raises(ValueError, match="config differs.*exit_lambda"):
        _run(tf.config(tmp_path / "resumed", exit_lambda=0.25, **MESH), until_update=7)


@pytest.mark.slow  # the fast tier's time (README: under 10 minutes here), 2026-12-06
def test_sigterm_saves_after_the_update_and_the_rerun_resumes_bitwise(tmp_path):
    straight = _run(tf.config(tmp_path / "straight", **MESH), until_update=6)
    data = RolloutSet(tf.progressions().tokens, tf.progressions().spans)
    read = data.batch_at

    def batch_at(seed, step, *args, **kw):       # the job gets SIGTERM during update 2
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return read(seed, step, *args, **kw)

    data.batch_at = batch_at
    handler = signal.getsignal(signal.SIGTERM)
    cfg = tf.config(tmp_path / "run", checkpoint_dir=str(tmp_path / "bucket"), **MESH)
    target, drafter = tf.models()
    first = train(cfg, target=target, drafter=drafter, data=data, until_update=6,
                  progress=False, save_final_drafter=False)
    assert first.preempted and [h["update"] for h in first.history] == [1, 2]
    assert signal.getsignal(signal.SIGTERM) is handler           # handler restored
    with TrainCheckpointer(tmp_path / "bucket") as ck:
        assert ck.all_steps() == [2]                              # not on the interval
    assert not (tmp_path / "run" / "checkpoints").exists()
    data.batch_at = read
    second = train(cfg, target=target, drafter=drafter, data=data, until_update=6,
                   progress=False, save_final_drafter=False)
    assert second.start_update == 2 and not second.preempted
    keys = ("loss", "grad_norm", "tau")
    assert ([[h[k] for k in keys] for h in first.history + second.history]
            == [[h[k] for k in keys] for h in straight.history])


def test_checkpoint_paths_keep_remote_uris(tmp_path, monkeypatch):
    assert str(checkpoint_path("gs://bucket/runs/exit")) == "gs://bucket/runs/exit"
    monkeypatch.chdir(tmp_path)
    assert str(checkpoint_path("runs/ck")) == str(tmp_path / "runs" / "ck")


def _state(x):
    return {"w": jnp.full((4, 3), float(x)), "step": jnp.int32(x)}


def _saved(tmp_path, steps=(1, 2, 3), keep=3, async_save=False):
    ck = TrainCheckpointer(tmp_path / "ck", every=1, keep=keep, async_save=async_save)
    for s in steps:
        assert ck.save(s, _state(s), {"update": s})
    ck.wait()
    return ck


def test_keeps_the_last_n_and_saves_on_the_interval(tmp_path):
    ck = TrainCheckpointer(tmp_path / "ck", every=2, keep=2)
    saved = [s for s in range(1, 8) if ck.save(s, _state(s), {"update": s})]
    assert ck.save(7, _state(7), {"update": 7}, force=True)
    assert saved == [2, 4, 6] and ck.all_steps() == [6, 7]
    state, meta, step = ck.restore(abstract_like(_state(0)))
    assert step == 7 and meta == {"update": 7} and int(state["step"]) == 7
    ck.close()


def test_missing_checkpoint_names_the_step_and_what_exists(tmp_path):
    ck = _saved(tmp_path)
    with pytest.raises(CheckpointError, match=r"no checkpoint for step 7 .*available steps: \[1, 2, 3\]"):
        ck.restore(abstract_like(_state(0)), step=7)
    empty = TrainCheckpointer(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        empty.restore(abstract_like(_state(0)))


def test_corrupted_checkpoint_gives_a_clear_error_and_keeps_the_others(tmp_path):
    ck = _saved(tmp_path)
    state_dir = tmp_path / "ck" / "3" / "state"
    for f in state_dir.rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"step 3 at .*ck/3 cannot be restored"):
        ck.restore(abstract_like(_state(0)), step=3)
    shutil.rmtree(tmp_path / "ck" / "2" / "meta")
    with pytest.raises(CheckpointError, match=r"step 2 .* incomplete: 'meta' is missing"):
        ck.restore(abstract_like(_state(0)), step=2)
    assert ck.all_steps() == [1, 2, 3]
    state, meta, step = ck.restore(abstract_like(_state(0)), step=1)
    np.testing.assert_array_equal(state["w"], _state(1)["w"])
    with pytest.raises(CheckpointError, match=r"step 1 .* cannot be restored .*shape"):
        ck.restore({"w": jax.ShapeDtypeStruct((5, 3), jnp.float32),
                    "step": jax.ShapeDtypeStruct((), jnp.int32)}, step=1)
    ck.close()


@pytest.mark.parametrize("async_save", [False, True])
def test_a_failed_save_never_replaces_the_last_good_checkpoint(tmp_path, async_save):
    ck = _saved(tmp_path, steps=(1, 2), keep=2, async_save=async_save)
    with pytest.raises(Exception):
        ck.save(3, {"w": object()}, {"update": 3})   # not serialisable: fails mid-save
    ck.wait()
    # A leftover temporary folder of a killed save is not a checkpoint either.
    (tmp_path / "ck" / "4.orbax-checkpoint-tmp-1234").mkdir()
    reopened = TrainCheckpointer(tmp_path / "ck", every=1, keep=2)
    assert reopened.all_steps() == [1, 2]
    state, meta, step = reopened.restore(abstract_like(_state(0)))
    assert step == 2 and meta == {"update": 2}
    np.testing.assert_array_equal(state["w"], _state(2)["w"])
    reopened.close()


def test_checkpoints_list_without_deprecation_warnings(tmp_path, caplog):
    """Issue 26, finding 16: listing checkpoints (every tev-train run does) logs no absl
    deprecation warning."""
    with caplog.at_level(logging.WARNING):
        with TrainCheckpointer(tmp_path / "ck") as ck:
            assert ck.all_steps() == []
    assert not [r for r in caplog.records if "deprecated" in r.getMessage()]


def _train(root, out, *extra):
    """``tev-train run`` on the `train_fixtures.train_dirs` folder ``root``: 4 updates of
    the exit loss, a checkpoint after each."""
    return ["run", "--target-path", str(root / "target"), "--drafter-path",
            str(root / "drafter"), "--data-dir", str(root / "data"), "--out-dir", str(out),
            "--loss", "exit", "--budget", "8", "--batch-size", "8", "--num-anchors", "2",
            "--steps", "4", "--lr", "0.01", "--warmup-steps", "0", "--checkpoint-every", "1",
            "--no-progress", *extra]


@pytest.mark.slow
def test_a_run_preempted_refused_damaged_and_restarted(train_dirs, tmp_path,  # noqa: F811
                                                       capsys, monkeypatch):
    """Issue 26, findings 4, 5, 6, 15 and 16 on one tiny run:
    15: a preempted run (SIGTERM, checkpoint saved) exits 75, not 0;
    16: the finished run ends with a summary (the drafter's folder, updates/s, losses);
    4: a refused rerun (changed --lr) leaves config.json as it was;
    6: a corrupted newest checkpoint and an empty step folder fall back to the newest
       good one, with one line and no tracebacks;
    5: --resume false moves the earlier checkpoints aside, and the next plain run
       resumes the new ones."""
    out = tmp_path / "run"
    read = RolloutSet.batch_at

    def batch_at(self, seed, step, *args, **kw):
        if step == 1:                      # preempted during update 2
            os.kill(os.getpid(), signal.SIGTERM)
        return read(self, seed, step, *args, **kw)

    monkeypatch.setattr(RolloutSet, "batch_at", batch_at)
    assert train_cli.main(_train(train_dirs, out)) == 75
    assert "train run: preempted (SIGTERM) at update 2: checkpoint saved in " in (
        capsys.readouterr().err)
    monkeypatch.setattr(RolloutSet, "batch_at", read)

    assert train_cli.main(_train(train_dirs, out)) == 0
    summary = capsys.readouterr().out
    assert f"drafter written to {out / 'drafter'}" in summary
    assert "updates 3..4 of 4 in" in summary and "updates/s" in summary
    assert "final (update 4): loss " in summary and "exit_loss" in summary
    config = (out / "config.json").read_text()

    assert train_cli.main(_train(train_dirs, out, "--lr", "0.02")) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "config differs (lr:" in err and "--resume false" in err
    assert (out / "config.json").read_text() == config

    ckdir = out / "checkpoints"
    with TrainCheckpointer(ckdir) as ck:
        steps = ck.all_steps()
    newest = ckdir / str(steps[-1])
    for f in (newest / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    (ckdir / "9").mkdir()                      # an empty step folder
    assert train_cli.main(_train(train_dirs, out, "--steps", "5")) == 2  # steps differ
    capsys.readouterr()
    assert train_cli.main(_train(train_dirs, out, "--until-update", "4")) == 0
    out_, err = capsys.readouterr()
    assert f"resuming from step {steps[-2]}, the newest checkpoint that restores" in err
    assert "Traceback" not in err and "Event loop is closed" not in err
    assert sorted(p.name for p in ckdir.iterdir() if p.name.startswith("unreadable-"))[0] \
        .startswith("unreadable-4-")

    assert train_cli.main(_train(train_dirs, out, "--resume", "false", "--until-update",
                                 "1")) == 0
    err = capsys.readouterr().err
    assert "moved the earlier run's checkpoints" in err
    aside = [p for p in tmp_path.joinpath("run").iterdir() if ".replaced-" in p.name]
    assert len(aside) == 1
    with TrainCheckpointer(ckdir) as ck:
        assert ck.all_steps() == [1]
    assert train_cli.main(_train(train_dirs, out, "--until-update", "2")) == 0
    assert "updates 2..2 of 4" in capsys.readouterr().out
    shutil.rmtree(out)
