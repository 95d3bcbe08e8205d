"""Planning a training step on abstract models (`train.step.lower`, `train.plan`,
``python -m train plan``): the compiled step's per-device arguments shrink when the
frozen target is sharded over fsdp, by the target's fsdp-sharded bytes; the plan
command's flags and mesh are checked before anything compiles (issue 38, item 13;
issue 47, item 7).

A training run whose update would not fit is refused before it writes anything (issue
51, item 3): one line naming the flag, exit code 2, no ``--out-dir`` left behind. Absurd
settings are refused at once from shapes (`train.plan.check_step_floor`, and
``--num-anchors`` above a sequence's anchor positions); the rest after the step compiles
and before the first write (`train.plan.check_step_fits`). Those runs use the tiny models
of `train_fixtures`, called in-process; the free memory is set by patching
`train.plan.available_bytes`, so the refusals do not depend on this machine.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import train_fixtures as tf
from cli_fixtures import refused_message, train_refused_one_line
from flax import nnx
from train_fixtures import train_dirs  # noqa: F401  (a fixture)

from tev_jax import sharding as shd
from tev_jax.costs.plan import abstract_target
from train import plan as train_plan
from train.__main__ import build_parser, main
from train.plan import plan_step, target_config_from

PLAN = dict(drafter_layers=1, num_taps=2, block_size=tf.BLOCK, batch=8, seq_len=tf.SEQ_LEN,
            anchors=2, budget=8, mesh_shape=(1, 8, 1))


def _embed_sharded_bytes(config) -> int:
    """Bytes of the target's parameters with an ``embed`` axis (split by fsdp)."""
    target = abstract_target(config)
    total = 0
    for _, v in nnx.to_flat_state(nnx.state(target, nnx.Param)):
        if "embed" in (shd.variable_axes(v) or ()):
            total += math.prod(v.get_value().shape) * v.get_value().dtype.itemsize
    return total


@pytest.mark.slow
@pytest.mark.skipif(not shd.device_count_ok(8), reason="needs 8 (host) devices")
def test_fsdp_sharded_target_shrinks_the_step_arguments(tmp_path, capsys):
    config_json = tmp_path / "config.json"
    config_json.write_text(json.dumps(tf.TARGET.to_hf()))
    assert target_config_from(str(tmp_path)).num_layers == tf.TARGET.num_layers
    replicated = plan_step(tf.TARGET, target_sharding="replicated", **PLAN)
    args = ["plan", "--target", str(config_json), "--drafter-layers", "1", "--num-taps", "2",
            "--block-size", str(tf.BLOCK), "--batch", "8", "--seq-len", str(tf.SEQ_LEN),
            "--anchors", "2", "--budget", "8", "--mesh-fsdp", "8", "--json"]
    assert main(args) == 0
    fsdp = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert fsdp["target_sharding"] == "fsdp" and fsdp["mesh"] == "1x8x1"
    # Only the target's placement differs: fsdp 8 keeps 1/8 of every parameter with an
    # embed axis (hidden 32 divides by 8). With `embed_replicated_rules` (embed
    # unsharded) the two plans would have equal arguments.
    saved = replicated.report.argument_bytes - fsdp["argument_bytes"]
    np.testing.assert_allclose(saved, 7 / 8 * _embed_sharded_bytes(tf.TARGET), rtol=0.02)
    assert replicated.report.temp_bytes > 0 and fsdp["temp_bytes"] > 0
    assert fsdp["output_bytes"] == replicated.report.output_bytes   # the donated train state
    assert main(["plan", "--target", "no-such-model"]) == 2
    assert "neither a preset" in capsys.readouterr().err


# --------------------------------------------------------------- the plan command


@pytest.mark.parametrize("flags, named", [
    (["--anchors", "0"], "--anchors must be >= 1"), (["--seq-len", "0"], "--seq-len must be"),
    (["--target-dtype", "fp8"], "--target-dtype must be one of float32, bfloat16"),
    (["--host-devices", "-1"], "--host-devices must be >= 0"),
    (["--batch", "0"], "--batch must be >= 1"), (["--budget", "0"], "--budget must be >= 1"),
    (["--num-taps", "0"], "--num-taps must be >= 1")])
def test_train_plan_flags_are_checked(capsys, flags, named):
    """Issue 38, item 13 (tev-train plan): each bad flag is one line naming it, before
    compiling."""
    assert named in train_refused_one_line(["plan", "--target", "qwen3-0.6b", *flags], capsys)


def test_plans_check_their_arguments_before_compiling(capsys, monkeypatch):
    """Issue 47, item 7: tev-train plan's fsdp axis defaults to the devices (8 here; fsdp 8
    failed on one device), and a mesh too large, an unknown preset or a cache too short
    are refused before "compiling" is printed (tev-train plan and tev-jax plan)."""
    shapes = []

    def stop(target, **kw):
        shapes.append(kw["mesh_shape"])
        raise ValueError("stopped")

    monkeypatch.setattr(train_plan, "plan_step", stop)
    assert main(["plan", "--target", "qwen3-0.6b", "--mesh-data", "2"]) == 2
    assert shapes == [(2, 4, 1)] and "mesh data 2 x fsdp 4 x tensor 1" in capsys.readouterr().err
    help_text = build_parser().get_default("subcommands").choices["plan"].format_help()
    assert "every device the data and" in " ".join(help_text.split())
    for argv, named in ((["--mesh-fsdp", "16"], "needs 16 devices; the local devices have 8"),
                        (["--target", "qwen9"], "qwen9")):
        argv = ["plan", *(["--target", "qwen3-0.6b"] if "--target" not in argv else []), *argv]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "compiling" not in err and named in err, err
    err = refused_message(["plan", "--model", "qwen3-0.6b", "--layers", "1", "--prompt-len",
                           "64", "--cache-len", "128"], capsys)
    assert "compiling" not in err and "the cache is too short" in err


# ------------------------------------------------- a run whose update would not fit


def _run_argv(root, out, *extra):
    return ["run", "--target-path", str(root / "target"), "--drafter-path",
            str(root / "drafter"), "--data-dir", str(root / "data"), "--out-dir", str(out),
            "--loss", "token", "--batch-size", "8", "--num-anchors", "2", "--steps", "2",
            "--warmup-steps", "0", "--no-progress", *extra]


def _refused_run(argv, capsys) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in captured.err, captured.err
    return err[0]


def _free(monkeypatch, *nbytes: int) -> None:
    """Free memory per device: ``nbytes`` at the first checks, the last one after."""
    answers = list(nbytes)
    monkeypatch.setattr(train_plan, "available_bytes", lambda devices=None: (
        answers.pop(0) if len(answers) > 1 else answers[0], "test memory"))


def test_more_anchors_than_positions_is_refused(train_dirs, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    line = _refused_run(_run_argv(train_dirs, out, "--num-anchors", str(tf.SEQ_LEN)), capsys)
    assert re.search(rf"--num-anchors \({tf.SEQ_LEN}\) is more than the anchor positions", line)
    most = int(re.search(r"use at most (\d+)", line).group(1))
    assert 0 < most < tf.SEQ_LEN
    assert not out.exists()


def test_a_batch_whose_features_alone_do_not_fit_is_refused_at_once(
        train_dirs, tmp_path, capsys, monkeypatch):  # noqa: F811
    """--batch-size 100000 (the issue's setting): the target features of the batch exceed
    the 1 MiB free, refused from shapes; nothing compiled or written."""
    _free(monkeypatch, 2**20)
    out = tmp_path / "run"
    line = _refused_run(_run_argv(train_dirs, out, "--batch-size", "100000"), capsys)
    assert "not enough memory: a training update needs" in line
    assert "(target features" in line and "--batch-size (100000)" in line
    assert not out.exists()


def test_an_update_that_compiles_too_big_is_refused_before_any_write(
        train_dirs, tmp_path, capsys, monkeypatch):  # noqa: F811
    """The same settings that train with enough memory: the floor from shapes passes (1 GiB
    free), and with 1 KiB free at the compiled check the update (its parameters and
    optimiser state alone are more) is refused, every part named and summing to the
    total; nothing written, not even the checkpoint folder."""
    _free(monkeypatch, 2**30, 2**10)
    out = tmp_path / "run"
    line = _refused_run(_run_argv(train_dirs, out), capsys)
    need = float(re.search(r"needs ([\d.]+) MiB per device", line).group(1))
    parts = dict((k, float(v)) for k, v in re.findall(
        r"(arguments|temporaries|outputs|code) ([\d.]+)", line))
    assert set(parts) == {"arguments", "temporaries", "outputs", "code"}, line
    assert sum(parts.values()) == pytest.approx(need, abs=0.02)
    assert "--num-anchors (2) or --batch-size (8)" in line
    assert not out.exists()
    monkeypatch.undo()
    assert main(_run_argv(train_dirs, out)) == 0   # the control: it fits
    assert (out / "checkpoints").is_dir()
