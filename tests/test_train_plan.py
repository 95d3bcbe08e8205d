"""Planning a training step on abstract models (`train.step.lower`, `train.plan`,
``python -m train plan``): the compiled step's per-device arguments shrink when the
frozen target is sharded over fsdp, by the target's fsdp-sharded bytes."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import train_fixtures as tf
from flax import nnx

from tev_jax import sharding as shd
from tev_jax.costs.plan import abstract_target
from train.__main__ import main
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
