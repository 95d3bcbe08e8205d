"""Compiling for NVIDIA GPUs from this machine (the CUDA plugin, ahead of time, no GPU).

Without the plugin: GPU names, their target descriptions and the errors (unknown name,
bad count, missing plugin, both or neither of --topology / --gpu). With it (the ``gpu``
extra; CI does not install it, see .ci/run): the bundled-size decode programs compile
for ``h100x8`` tensor 8 through ``tev-jax plan --gpu`` with the ``--topology`` JSON
contract, FLOPs read from the optimised HLO (the GPU compiler gives no cost analysis)
within 2 % of a hand count for the AR step, and a top-k over a long vocabulary shard
leaves no sort longer than `tev_jax.vocab.TOP_K_WIDTH` (the compiler's fallback sort).
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tev_jax import cli, decode, vocab
from tev_jax.costs import chips, plan
from tev_jax.engine import Engine
from tev_jax.runtime import platforms

needs_plugin = pytest.mark.skipif(
    not chips.plugin_installed(),
    reason="the CUDA plugin is not installed (pip install -e '.[gpu]')")


def test_gpu_names_counts_and_target_descriptions():
    spec, n = chips.parse_gpu_name("h100x8")
    assert (spec.name, n) == ("h100", 8)
    assert chips.parse_gpu_name("H200")[1] == 1 and chips.parse_gpu_name("b200x16")[1] == 16
    text = spec.target_config()
    assert "core_count: 132" in text and "major: 9" in text
    assert f"memory_bandwidth: {int(spec.chip.hbm_bandwidth)}" in text
    assert "major: 10" in chips.GPUS["b200"].target_config()
    # the CUDA runtime named is the plugin's (cuda12: 12.9; cuda13: 13.0)
    assert "runtime_version { major: 12 minor: 9 }" in text
    assert "runtime_version { major: 13 minor: 0 }" in spec.target_config(13)
    # the published figures the rooflines use, and a real GPU's device kind finds them
    assert chips.GPUS["h200"].chip.hbm_bandwidth > chips.GPUS["h100"].chip.hbm_bandwidth
    assert chips.chip_of("NVIDIA H100 80GB HBM3") is chips.GPUS["h100"].chip
    assert all(g.chip.source.startswith("https://") for g in chips.GPUS.values())


@pytest.mark.parametrize("name,message", [
    ("v100x8", r"unknown GPU 'v100'.*h100"), ("h100-8", "not a name such as 'h100x8'"),
    ("h100x12", "whole number of 8-GPU hosts"), ("h100x0", "neither 1-8")])
def test_bad_gpu_names_are_named(name, message):
    with pytest.raises(ValueError, match=message):
        chips.parse_gpu_name(name)


def test_missing_plugin_and_platforms_are_clear_errors(monkeypatch):
    monkeypatch.setattr(platforms, "cuda_plugins", lambda: {})
    with pytest.raises(ValueError, match=r"needs one of jax's CUDA plugins.*\.\[gpu\]"):
        chips.gpu_devices("h100x8")
    with pytest.raises(ValueError, match="one of a TPU slice .* not both"):
        chips.plan_mesh("v5e:2x4", "h100x8")
    with pytest.raises(ValueError, match="not neither"):
        chips.plan_mesh()


def test_the_blocked_top_k_equals_lax_top_k_with_ties():
    """The GPU branch of `vocab.top_k` (blocks of TOP_K_WIDTH, then their winners), run on
    this machine: equal values and indices to ``lax.top_k``, ties across and inside
    blocks and a vocabulary that is not a multiple of the block included."""
    width = vocab.TOP_K_WIDTH
    x = jax.random.normal(jax.random.key(0), (3, 5, 2 * width + 300))
    x = x.at[..., 7].set(4.0).at[..., width + 1].set(4.0).at[..., 2 * width + 9].set(4.0)
    x = x.at[..., 11].set(-jnp.inf)
    for k in (17, 64):
        want = jax.lax.top_k(x, k)
        got = vocab._blocked_top_k(x, k)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


@needs_plugin
def test_gpu_servers_and_a_mesh_that_does_not_fit():
    """8 and 16 abstract GPUs (16: two hosts) with the GPU's figures; a mesh larger than
    the server is refused, naming both."""
    eight, sixteen = chips.gpu_devices("h100x8"), chips.gpu_devices("h100x16")
    assert (len(eight.devices), eight.hosts, eight.chip.name) == (8, 1, "h100")
    assert (len(sixteen.devices), sixteen.hosts) == (16, 2)
    assert eight.devices[0].device_kind == chips.GPUS["h100"].chip.device_kind
    with pytest.raises(ValueError, match=r"needs 16 devices.*does not fit the GPUs h100x8"):
        chips.gpu_mesh("h100x8", tensor=16)


@needs_plugin
def test_a_long_top_k_compiles_without_a_long_sort():
    """[120, 18 992] (a Qwen3-8B vocabulary shard of a round's draft rows), k 64: no sort
    longer than TOP_K_WIDTH in the GPU program (the compiler warns it has no deviceless
    scratch size for CUB's sort of such rows and falls back to a slower sort). Negative
    control: ``lax.top_k`` itself sorts the whole row."""
    dev = chips.gpu_devices("h100x8").devices[0]
    x = jax.ShapeDtypeStruct((120, 18_992), jnp.float32,
                             sharding=jax.sharding.SingleDeviceSharding(dev))

    def sorts(fn):
        text = jax.jit(fn).trace(x).lower(lowering_platforms=("cuda",)).compile().as_text()
        return [int(m) for m in re.findall(r"= \(f32\[\d+,(\d+)\]\{[^}]*\}, s32\[[^]]*\][^)]*\) "
                                           r"sort\(", text)]

    assert max(sorts(lambda a: vocab.top_k(a, 64))) <= vocab.TOP_K_WIDTH
    assert max(sorts(lambda a: jax.lax.top_k(a, 64))) == 18_992


@needs_plugin
def test_plan_command_json_for_gpus(tmp_path, capsys):
    """``tev-jax plan --gpu h100x8 --mesh-tensor 8 --json``, Qwen3-8B cut to 2 layers: the
    AR step and a round compile, the JSON has the --topology shape, FLOPs come from the
    HLO (the GPU compiler gives no cost analysis): the AR step's within 2 % of 2 x matmul
    parameters x B plus the attention over the full cache, per GPU; the AR step reads
    its weights and cache about once (at most 1.15 x its floor: no layer's weights
    copied out of the stack, no cache relaid out); the round's temporaries stay under
    twice the AR step's plus the scores it must hold; the op tables name the stages."""
    cfg = plan.preset("qwen3-8b", num_layers=2)
    out = tmp_path / "plan.json"
    b, cache, budget = 8, 2048, 16
    argv = ["plan", "--model", "qwen3-8b", "--layers", "2", "--gpu", "h100x8",
            "--mesh-tensor", "8", "--batch", str(b), "--budget", str(budget),
            "--prompt-len", "1024", "--cache-len", str(cache), "--max-new-tokens", "256",
            "--temperature", "1", "--dtype", "bfloat16", "--programs", "ar_step,round",
            "--ops", "2", "--json", str(out)]
    assert cli.main(argv) == 0
    assert "roofline: h100" in capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["gpu"] == "h100x8" and record["chip"]["name"] == "h100"
    ar, rnd = record["programs"]["ar_step"], record["programs"]["round"]
    for p in (ar, rnd):
        assert {"argument_bytes", "temp_bytes", "output_bytes", "flops", "bytes_accessed",
                "roofline_seconds", "compile_seconds", "ops"} <= set(p)
        assert p["roofline_seconds"] > 0
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = cfg.hidden_size * (2 * q + 2 * kv) + 3 * cfg.hidden_size * cfg.intermediate_size
    matmul = cfg.num_layers * layer + cfg.vocab_size * cfg.hidden_size   # + the head
    hand = (2 * matmul * b + cfg.num_layers * 4 * b * q * cache) / 8
    assert ar["flops"] == pytest.approx(hand, rel=0.02)
    assert rnd["flops"] > 8 * ar["flops"]        # B x 17 tree tokens against B
    assert ar["bytes_accessed"] <= 1.15 * sum(ar["floor_bytes"].values())
    # what a round must hold beyond twice the AR step's: the float32 scores of the
    # target over the N tree tokens, of the drafter over its block (and twice more,
    # padded to the GPU top-k's 2048-entry blocks), and at T = 1 the vocabulary's
    # 16-entry sub-block masses, gathered (`tev_jax.vocab`)
    rows_v = b * cfg.vocab_size // 8 * 4
    held = rows_v * (budget + 1) + 3 * rows_v * 15 + rows_v * 8 * (budget + 1) // 16
    assert rnd["temp_bytes"] <= 2 * ar["temp_bytes"] + held
    assert set(rnd["ops"]["stages"]) >= {"draft", "build", "verify", "decide", "commit"}
    # kernel launches per call: the round's outside the layer stack (drafter head,
    # build, decide, commit) were 309 before issue 44 (the builder's and the path's
    # loops, the cache moves layer by layer), 157 after; the layer stack is per layer
    n = rnd["launches"]
    assert n["total"] == n["layers"] + n["other_than_layers"] and n["layers"] > 0
    assert n["other_than_layers"] <= 170, n["other_than_layers_by_stage"]
    assert n["other_than_layers_by_stage"]["commit"] <= 25
    assert ar["launches"]["total"] < n["total"]
    assert record["seconds_are"] == "floor"     # no measured table for the H100


@needs_plugin
def test_per_layer_weights_feed_xlas_gemms_without_a_copy():
    """On GPUs the engine lays the target's layers out one array per layer
    (`tev_jax.models.layer_layout`, ``layer_layout='auto'``): the AR step's GEMMs are
    XLA's own on each layer's weights where they lie (no stacked GEMM kernel, no layer
    slice copied out of a stack), the layers a loop of their own (no while over them);
    the stacked layout, its control, runs our stacked kernel in a scan."""
    mesh, _ = chips.gpu_mesh("h100x1")
    config = decode.DecodeConfig(builder="none", prompt_len=256, max_new_tokens=64)
    target, _ = plan.abstract_models(plan.preset("qwen3-8b", num_layers=2), config,
                                     dtype=jnp.bfloat16)
    texts = {}
    for layout in ("auto", "stacked"):
        e = Engine.create(target, None, config, 1, mesh=mesh, layer_layout=layout)
        texts[e.layer_layout] = e.lower("round").compile().as_text()
    per_layer, stacked = texts["per_layer"], texts["stacked"]
    copied = [np.prod([int(d) for d in shape.split(",") if d]) for shape in re.findall(
        r"= bf16\[([\d,]*)\]\{[^}]*\} (?:slice|dynamic-slice|copy|fusion)\(", per_layer)]
    assert copied and max(copied) < 4096 * 1024  # no layer weight; an embedding row
    assert "stacked_matmul" not in per_layer
    assert " while(" not in per_layer
    assert "stacked_matmul" in stacked and " while(" in stacked


@needs_plugin
def test_the_experts_are_read_in_place_on_gpu():
    """Qwen3-Coder (128 experts, top 8) cut to 2 layers, an AR step at B 8 on one H200:
    each touched expert is read in place from the layer stack (`moe._expert_dot`), so the
    step reads at most 1.25 x its floor of bytes (the weights, the experts 64 pairs
    touch at uniform routing, the cache); slicing the experts out first read 2.23 x."""
    from tev_jax.decode import DecodeConfig

    mesh, devices = chips.gpu_mesh("h200x1")
    config = DecodeConfig(max_new_tokens=256, builder="none", prompt_len=1024,
                          max_cache_len=2048)
    result = plan.plan_decode_programs(plan.preset("qwen3-coder-30b-a3b", num_layers=2),
                                       config, 8, dtype=jnp.bfloat16, mesh=mesh,
                                       programs=("ar_step",), chip=devices.chip)
    floor = plan.sum_floor(result.floors["ar_step"])
    assert result.programs["ar_step"].bytes_accessed <= 1.25 * floor
