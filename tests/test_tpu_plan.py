"""Compiling for TPU slices from this machine (libtpu, ahead of time, no chip needed).

A bundled-size target (V 4096, width 256, 4 layers) with the real models' divisibility
(16 query and 8 key/value heads) and a 1-layer DFlash drafter, bfloat16, B 8, budget 16:
the whole generation, a round, an AR step and the continuous-batching rounds program
compile for a single-host slice (``v5e:2x4``: tensor 8, data 2 x tensor 4) and a
multi-host one (``v5e:4x4``, 16 chips on 4 hosts). Each program's per-chip peak must stay
under a bound computed from the shapes: twice an even share of the parameters and the
decode floor (caches, tree logits and mask) per chip plus 64 MiB of code and slack. A
layout that replicated the weights or the caches on every chip would need about
n_chips / 2 times that share and fail. The roofline arithmetic and the JSON contract of
``tev-jax plan --topology`` are checked too.

Skipped only where libtpu is not installed (CI installs the ``tpu`` extra).
"""

from __future__ import annotations

import importlib.util
import json
import math

import jax
import jax.numpy as jnp
import pytest

from tev_jax import cli
from tev_jax import sharding as shd
from tev_jax.costs import chips, op_costs, plan
from tev_jax.decode import STAGES, DecodeConfig
from tev_jax.models import ModelConfig

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed (pip install -e '.[tpu]')")

CFG = ModelConfig("qwen3", vocab_size=4096, hidden_size=256, intermediate_size=768,
                  num_layers=4, num_heads=16, num_kv_heads=8, head_dim=64, qk_norm=True,
                  tie_word_embeddings=True)
CONFIG = DecodeConfig(max_new_tokens=32, budget=16, prompt_len=64)
B = 8
SLACK = 64 * 2**20


def _bound(n_devices: int) -> int:
    target, drafter = plan.abstract_models(CFG, CONFIG, dtype=jnp.bfloat16)
    params = sum(math.prod(x.shape) * x.dtype.itemsize
                 for x in jax.tree.leaves((target, drafter))
                 if isinstance(x, jax.ShapeDtypeStruct))
    floor = sum(plan.decode_floor(target, drafter, CONFIG, B).values())
    return 2 * (params + floor) // n_devices + SLACK


@needs_libtpu
@pytest.mark.slow  # issue 58, item 11: the fast tier keeps the v5e:2x4 compiles
@pytest.mark.parametrize("name,axes,programs", [
    # tensor 8 on v5e:2x4: every program, in test_plan_command_json_for_a_topology; data 2
    # x tensor 4 there: the rounds, in test_continuous_batching_rounds_compile_for_a_tpu_slice
    ("v5e:4x4", dict(data=2, tensor=8, fsdp=1), ("generation",))])
def test_decode_programs_compile_for_a_tpu_slice(name, axes, programs):
    mesh, tpu = chips.slice_mesh(name, **axes)
    result = plan.plan_decode_programs(CFG, CONFIG, B, dtype=jnp.bfloat16, mesh=mesh,
                                       programs=programs, chip=tpu.chip,
                                       devices_per_chip=tpu.devices_per_chip)
    bound = _bound(mesh.devices.size)
    for p in programs:
        report = result.programs[p]
        assert report.peak_bytes <= bound, (p, report.peak_bytes, bound)
        assert report.flops > 0 and report.bytes_accessed > 0
    if "round" in programs:  # a round verifies B x (budget + 1) tokens, an AR step B
        assert result.programs["round"].flops > 4 * result.programs["ar_step"].flops
        assert result.break_even_tau > 1


@pytest.mark.slow
@needs_libtpu
def test_continuous_batching_rounds_compile_for_a_tpu_slice():
    from tev_jax.engine import Engine

    tpu = chips.slice_devices("v5e:2x4")
    mesh = shd.make_mesh(data=2, tensor=4, fsdp=1, devices=tpu.devices)
    target, drafter = plan.abstract_models(CFG, CONFIG, dtype=jnp.bfloat16)
    engine = Engine.create(target, drafter, CONFIG, B, mesh=mesh)
    compiled = engine.lower("run_rounds").compile()
    report = plan.ProgramReport.of(compiled)
    assert report.peak_bytes <= _bound(8)
    # the per-op table (tev-jax plan --ops) accounts for the compiler's FLOPs (within 0.4 %
    # for Qwen3-8B rounds, 2.4 % at this size) when each op is counted once, as the
    # compiler counts a loop body; its bytes follow a simpler model than the compiler's,
    # which counts some operands more than once, and never exceed them
    ops = op_costs.op_costs(compiled.as_text())
    once = lambda field: sum(getattr(o, field) / o.count for o in ops)
    cost = compiled.cost_analysis()
    assert once("flops") == pytest.approx(cost["flops"], rel=0.05)
    assert 0 < once("hbm_bytes") <= once("bytes") <= 1.1 * cost["bytes accessed"]
    # the table multiplies the scan over the 4 layers (a counted loop) by its trip count,
    # and so does the report: the compiler's counts scaled alike
    layer_ops = [o for o in ops if "/verify/" in o.scope and ("Linear.__call__" in o.source
                                                             or "stacked_matmul" in o.source)]
    assert layer_ops and all(o.count == CFG.num_layers for o in layer_ops)
    totals = op_costs.totals(ops)
    assert report.flops == pytest.approx(totals["flops"], rel=0.05)
    assert report.flops > 1.5 * cost["flops"]
    verify = op_costs.by_stage(ops, STAGES)["verify"]
    assert verify["flops"] > 0.5 * totals["loop_flops"]
    # the attention over the cache is one Pallas kernel per layer (kernels/cache_attention),
    # reading the stacked cache in place: no other attention or cache op in the rounds
    # reads a whole cache (a layout copy for the kernel would)
    kernels = [o for o in ops if o.opcode == "custom-call" and "cache_attention" in o.source]
    assert kernels and all(o.in_loop for o in kernels)
    cache_bytes = (CFG.num_layers * B // 2 * engine.spec.max_len * CFG.num_kv_heads // 4
                   * CFG.head_dim * 2)                     # keys, per chip (data 2, tensor 4)
    assert not [o for o in ops if o.in_loop and o not in kernels
                and ("attention" in o.source or "kv_cache" in o.source)
                and o.bytes / o.count >= cache_bytes], "a round reads a whole stacked cache"


@needs_libtpu
def test_slice_errors_name_the_problem(capsys):
    with pytest.raises(ValueError, match="not a TPU slice name"):
        chips.slice_devices("v5e")
    with pytest.raises(ValueError, match="unknown TPU topology 'v5e:3x3'"):
        chips.slice_devices("v5e:3x3")
    tpu = chips.slice_devices("v5e:4x4")
    assert (len(tpu.devices), tpu.hosts, tpu.chip.name) == (16, 4, "v5e")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["plan", "--model", "qwen3-0.6b", "--layers", "1", "--topology", "v5e:2x4",
                  "--mesh-tensor", "16"])
    assert exit_.value.code == 2
    assert "needs 16 devices, 8 available: the mesh does not fit the slice v5e:2x4" in (
        capsys.readouterr().err)
    with pytest.raises(SystemExit) as exit_:  # issue 38, item 13: not an AssertionError
        cli.main(["plan", "--model", "qwen3-0.6b", "--layers", "1", "--topology", "v5e:2x4",
                  "--mesh-tensor", "3"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "(3 devices) does not lay out over the slice v5e:2x4" in err[0]


def test_missing_libtpu_is_a_clear_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == "libtpu" else real(n, *a))
    with pytest.raises(ValueError, match=r"needs libtpu: pip install -e \"\.\[tpu\]\""):
        chips.slice_devices("v5e:2x4")


def test_roofline_break_even_and_estimate():
    chip = chips.CHIPS["v5e"]
    mem = dict(argument_bytes=0, output_bytes=0, temp_bytes=0, alias_bytes=0, code_bytes=0)
    ar = plan.ProgramReport(**mem, flops=1e9, bytes_accessed=819e6)        # 1 ms of bytes
    rnd = plan.ProgramReport(**mem, flops=197e12 * 4e-3, bytes_accessed=1e9)  # 4 ms of FLOPs
    assert ar.roofline_seconds(chip) == pytest.approx(1e-3)
    assert rnd.roofline_seconds(chip) == pytest.approx(4e-3)
    assert rnd.roofline_seconds(chip, devices_per_chip=2) == pytest.approx(8e-3)
    assert rnd.roofline_seconds(None) is None
    p = plan.DecodePlan({"round": rnd, "ar_step": ar}, batch_size=8, chip=chip)
    assert p.break_even_tau == pytest.approx(4.0)
    e = p.estimate(6.0)
    assert e["speedup"] == pytest.approx(1.5)
    assert e["tokens_per_second"] == pytest.approx(8 * 6.0 / 4e-3)
    assert plan.DecodePlan({"round": rnd, "ar_step": ar}, batch_size=8).estimate(6.0) is None


def test_chip_table():
    assert chips.chip_of("TPU v5 lite") is chips.CHIPS["v5e"]
    assert chips.chip_of("cpu") is None
    for chip in chips.CHIPS.values():
        assert chip.peak_flops > 1e14 and chip.hbm_bandwidth > 5e11 and chip.hbm_bytes > 1e10
        assert chip.source.startswith("https://cloud.google.com/tpu/docs/")


@pytest.mark.slow
@needs_libtpu
def test_plan_command_json_for_a_topology(tmp_path, capsys):
    """``tev-jax plan --topology v5e:2x4 --mesh-tensor 8 --ops 2 --json``: every decode
    program compiles under the per-chip bound, the JSON has the issue's shape, the round
    costs more than an AR step, and the op tables name the stages."""
    cfg_file = tmp_path / "config.json"
    cfg_file.write_text(json.dumps(CFG.to_hf()))
    out = tmp_path / "plan.json"
    argv = ["plan", "--config", str(cfg_file), "--topology", "v5e:2x4", "--mesh-tensor", "8",
            "--batch", str(B), "--budget", str(CONFIG.budget), "--prompt-len",
            str(CONFIG.prompt_len), "--max-new-tokens", str(CONFIG.max_new_tokens),
            "--dtype", "bfloat16", "--tau", "2.5", "--ops", "2", "--json", str(out)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "break-even tau" in printed and "fits:" in printed and "largest ops" in printed
    record = json.loads(out.read_text())
    programs = record["programs"]
    assert set(programs) == {"generation", "ar_step", "round", "prefill", "stages"}
    assert set(programs["stages"]) == {"draft", "build", "verify", "decide", "commit"}
    keys = {"argument_bytes", "temp_bytes", "output_bytes", "flops", "bytes_accessed",
            "roofline_seconds", "compile_seconds"}
    bound = _bound(8)
    for p in [*(programs[k] for k in ("generation", "ar_step", "round", "prefill")),
              *programs["stages"].values()]:
        assert keys <= set(p) and p["roofline_seconds"] > 0
        assert p["peak_bytes"] <= bound
    assert record["estimate"]["tau"] == 2.5
    # a round verifies B x (budget + 1) tokens, an AR step B
    assert programs["round"]["flops"] > 4 * programs["ar_step"]["flops"]
    assert record["break_even_tau"] == pytest.approx(
        programs["round"]["roofline_seconds"] / programs["ar_step"]["roofline_seconds"])
    assert record["break_even_tau"] > 1
    # the op tables of the fused loops: the round's stages, verify doing most FLOPs
    stages = programs["round"]["ops"]["stages"]
    assert set(programs["stages"]) <= set(stages)
    assert max(stages, key=lambda s: stages[s]["flops"]) == "verify"
    rows = programs["round"]["ops"]["per_round"]
    assert len(rows) == 2 and all(r["in_loop"] for r in rows)
    ar = programs["ar_step"]["ops"]
    assert "draft" not in ar["stages"]
    assert 0 < ar["totals"]["loop_flops"] < programs["round"]["ops"]["totals"]["loop_flops"] / 4


@pytest.mark.slow
@needs_libtpu
def test_exittrain_step_compiles_for_a_tpu_slice():
    """One ExitTrain update of a bundled-size bf16 target and a 1-layer float32 drafter,
    fsdp 8 on v5e:2x4: per chip under twice an even share of the parameters, the Adam
    moments and the batch's caches plus slack, with a roofline and an MFU estimate."""
    from train.plan import plan_step

    B, L, A = 8, 256, 8
    step = plan_step(CFG, drafter_layers=1, num_taps=2, block_size=8, batch=B, seq_len=L,
                     anchors=A, budget=8, mesh_shape=(1, 8, 1), target_dtype="bfloat16",
                     topology="v5e:2x4")
    target, drafter = plan.abstract_models(CFG, CONFIG, dtype=jnp.bfloat16)
    count = lambda tree: sum(math.prod(x.shape) * x.dtype.itemsize
                             for x in jax.tree.leaves(tree)
                             if isinstance(x, jax.ShapeDtypeStruct))
    kv = 2 * CFG.num_layers * B * L * CFG.num_kv_heads * CFG.head_dim * 2
    shapes = count(target) + 3 * 2 * count(drafter) + kv   # f32 drafter: params + 2 moments
    assert step.peak <= 2 * shapes // 8 + SLACK, (step.peak, shapes)
    assert step.roofline_seconds > 0 and 0 < step.mfu <= 1


@needs_libtpu
def test_the_ar_loop_does_not_copy_the_kv_cache_on_a_tpu_slice():
    """Qwen3-8B widths with 4 layers, v5e:2x4 tensor 8, B 8, cache 2048: no op of the
    rounds loop copies the whole target cache (one scatter over all layers once made the
    compiler interleave the layers in the cache layout and copy it twice per round), and
    the step's HBM bytes are at least its floor (weights + KV cache, one chip's shard)."""
    from tev_jax.engine import Engine

    cfg = plan.preset("qwen3-8b", num_layers=4)
    config = DecodeConfig(builder="none", prompt_len=1024, max_cache_len=2048,
                          max_new_tokens=256)
    mesh = chips.slice_mesh("v5e:2x4", tensor=8)[0]
    target, _ = plan.abstract_models(cfg, config, dtype=jnp.bfloat16)
    engine = Engine.create(target, None, config, 8, mesh=mesh)
    ops = plan.loop_ops(engine)
    cache = engine.abstract_state().cache.k.shape   # [layers, B, L, kv heads, hd]
    shard = f"bf16[{cache[0]},{cache[1]},{cache[2]},1,{cache[4]}]"  # kv heads over 8 chips
    copies = [o for o in ops if o.opcode == "copy" and o.shape == shard]
    assert not copies, [(o.name, o.in_loop) for o in copies]
    assert any(o.in_loop for o in ops)
    # every loop counted by its trip count and the attention kernel by its estimate (the
    # whole cache): the step reads its floor from HBM but for what the once-per-call ops
    # put on chip (the key-block loop counted once made a full-depth step read 0.90x)
    import experiment_scripts

    floor = sum(experiment_scripts.load("round_bytes").floor_bytes(engine, tied=False).values())
    t = op_costs.totals(ops)
    assert t["loop_hbm_bytes"] + t["on_chip_once"] >= floor > t["loop_hbm_bytes"] * 0.9
    assert any(o.opcode == "custom-call" and "cache_attention" in o.source for o in ops)
