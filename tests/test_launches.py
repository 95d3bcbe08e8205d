"""Kernel launches counted in optimised GPU HLO (`tev_jax.costs.launches`), and the calibrated
GPU time (`tev_jax.costs.gpu_time`).

A hand-written module of GPU style with a known number of kernels: fusions, a cuBLAS
GEMM and a Pallas Triton call in the entry, a loop of known trip count (no condition
on the device), a counted loop without it (its condition runs every trip and once
more), a loop of unknown trip count (one round), a conditional (its largest branch)
and the free ops. With the CUDA plugin (the ``gpu`` extra), a jitted loop compiled for
an H200 launches its GEMM once per trip.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest

from tev_jax.costs import chips, gpu_time, launches, op_costs

HLO = """HloModule hand_written, entry_computation_layout={(f32[8,64]{1,0})->f32[8,64]{1,0}}

%fused_add (p0: f32[8,64]) -> f32[8,64] {
  %p0 = f32[8,64]{1,0} parameter(0)
  ROOT %add.1 = f32[8,64]{1,0} add(%p0, %p0)
}

%fused_exp (p0.1: f32[8,64]) -> f32[8,64] {
  %p0.1 = f32[8,64]{1,0} parameter(0)
  ROOT %exp.1 = f32[8,64]{1,0} exponential(%p0.1)
}

%fused_lt (p0.2: s32[]) -> pred[] {
  %p0.2 = s32[] parameter(0)
  %c5 = s32[] constant(5)
  ROOT %lt.1 = pred[] compare(%p0.2, %c5), direction=LT
}

%known_body (t: (s32[], f32[8,64])) -> (s32[], f32[8,64]) {
  %t = (s32[], f32[8,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[8,64]{1,0} get-tuple-element(%t), index=1
  %a = f32[8,64]{1,0} fusion(%x), kind=kLoop, calls=%fused_add, metadata={op_name="jit(f)/verify/while/body/add"}
  %e = f32[8,64]{1,0} fusion(%a), kind=kLoop, calls=%fused_exp, metadata={op_name="jit(f)/verify/while/body/exp"}
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %r = (s32[], f32[8,64]{1,0}) tuple(%j, %e)
}

%known_cond (t.1: (s32[], f32[8,64])) -> pred[] {
  %t.1 = (s32[], f32[8,64]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%t.1), index=0
  ROOT %lt = pred[] fusion(%i.1), kind=kLoop, calls=%fused_lt
}

%counted_body (t.2: (s32[], f32[8,64])) -> (s32[], f32[8,64]) {
  %t.2 = (s32[], f32[8,64]{1,0}) parameter(0)
  %i.2 = s32[] get-tuple-element(%t.2), index=0
  %x.2 = f32[8,64]{1,0} get-tuple-element(%t.2), index=1
  %e.2 = f32[8,64]{1,0} fusion(%x.2), kind=kLoop, calls=%fused_exp, metadata={op_name="jit(f)/build/while/body/exp"}
  %one.2 = s32[] constant(1)
  %j.2 = s32[] add(%i.2, %one.2)
  ROOT %r.2 = (s32[], f32[8,64]{1,0}) tuple(%j.2, %e.2)
}

%counted_cond (t.3: (s32[], f32[8,64])) -> pred[] {
  %t.3 = (s32[], f32[8,64]{1,0}) parameter(0)
  %i.3 = s32[] get-tuple-element(%t.3), index=0
  %c5.3 = s32[] constant(5)
  ROOT %lt.3 = pred[] compare(%i.3, %c5.3), direction=LT
}

%open_body (t.5: (s32[], f32[8,64])) -> (s32[], f32[8,64]) {
  %t.5 = (s32[], f32[8,64]{1,0}) parameter(0)
  %i.5 = s32[] get-tuple-element(%t.5), index=0
  %x.5 = f32[8,64]{1,0} get-tuple-element(%t.5), index=1
  %e.5 = f32[8,64]{1,0} fusion(%x.5), kind=kLoop, calls=%fused_exp
  ROOT %r.5 = (s32[], f32[8,64]{1,0}) tuple(%i.5, %e.5)
}

%open_cond (t.4: (s32[], f32[8,64])) -> pred[] {
  %t.4 = (s32[], f32[8,64]{1,0}) parameter(0)
  %x.4 = f32[8,64]{1,0} get-tuple-element(%t.4), index=1
  ROOT %any = pred[] fusion(%x.4), kind=kLoop, calls=%fused_any
}

%fused_any (p0.5: f32[8,64]) -> pred[] {
  %p0.5 = f32[8,64]{1,0} parameter(0)
  %z = f32[] constant(0)
  ROOT %red = pred[] reduce(%p0.5, %z), dimensions={0,1}, to_apply=%fused_lt
}

%branch_small (x.6: f32[8,64]) -> f32[8,64] {
  %x.6 = f32[8,64]{1,0} parameter(0)
  ROOT %s1 = f32[8,64]{1,0} fusion(%x.6), kind=kLoop, calls=%fused_exp
}

%branch_big (x.7: f32[8,64]) -> f32[8,64] {
  %x.7 = f32[8,64]{1,0} parameter(0)
  %b1 = f32[8,64]{1,0} fusion(%x.7), kind=kLoop, calls=%fused_exp
  %b2 = f32[8,64]{1,0} fusion(%b1), kind=kLoop, calls=%fused_add
  ROOT %b3 = f32[8,64]{1,0} fusion(%b2), kind=kLoop, calls=%fused_exp
}

ENTRY %main (x.0: f32[8,64]) -> f32[8,64] {
  %x.0 = f32[8,64]{1,0} parameter(0)
  %f1 = f32[8,64]{1,0} fusion(%x.0), kind=kLoop, calls=%fused_add, metadata={op_name="jit(f)/draft/add"}
  %g = (f32[8,64]{1,0}, s8[1024]{0}) custom-call(%f1, %f1), custom_call_target="__cublas$gemm"
  %g0 = f32[8,64]{1,0} get-tuple-element(%g), index=0
  %k = f32[8,64]{1,0} custom-call(%g0), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/verify/while/body/pallas_call" source_file="/x/tev_jax/models/stacked_matmul.py" source_line=90}
  %c0 = s32[] constant(0)
  %init = (s32[], f32[8,64]{1,0}) tuple(%c0, %k)
  %w1 = (s32[], f32[8,64]{1,0}) while(%init), condition=%known_cond, body=%known_body, backend_config={"known_trip_count":{"n":"5"}}
  %y1 = f32[8,64]{1,0} get-tuple-element(%w1), index=1
  %init2 = (s32[], f32[8,64]{1,0}) tuple(%c0, %y1)
  %w2 = (s32[], f32[8,64]{1,0}) while(%init2), condition=%counted_cond, body=%counted_body
  %y2 = f32[8,64]{1,0} get-tuple-element(%w2), index=1
  %init3 = (s32[], f32[8,64]{1,0}) tuple(%c0, %y2)
  %w3 = (s32[], f32[8,64]{1,0}) while(%init3), condition=%open_cond, body=%open_body
  %y3 = f32[8,64]{1,0} get-tuple-element(%w3), index=1
  %copy.1 = f32[8,64]{1,0} copy(%y3)
  %p = s32[] constant(1)
  %c = f32[8,64]{1,0} conditional(%p, %copy.1, %copy.1), branch_computations={%branch_small, %branch_big}
  ROOT %out = f32[8,64]{1,0} bitcast(%c)
}
"""


def test_a_hand_written_program_launches_its_known_kernels():
    items = launches.launches(HLO)
    by_name = {x.name: x for x in items}
    # the entry: a fusion, the cuBLAS GEMM, the Pallas call, a copy, the conditional
    assert by_name["f1"].kind == "fusion:add" and by_name["f1"].count == 1
    assert by_name["g"].kind == "cublas" and by_name["k"].kind == "pallas"
    assert by_name["copy.1"].kind == "copy"
    # known trip count: 2 fusions x 5, no condition on the device
    assert by_name["a"].count == by_name["e"].count == 5
    assert "lt" not in by_name
    # counted loop: its fusion 5 times, its condition (a compare) 6 times + the sync
    assert by_name["e.2"].count == 5 and by_name["lt.3"].count == 6
    assert by_name["w2"].kind == "while-condition" and by_name["w2"].count == 6
    # unknown trip count: one round, in_loop, condition and sync once
    assert by_name["any"].in_loop and by_name["any"].count == 1 and by_name["w3"].in_loop
    assert by_name["e.5"].in_loop and by_name["e.5"].count == 1 and not by_name["e.2"].in_loop
    # the conditional runs its largest branch (3 fusions) and syncs once
    assert {"b1", "b2", "b3"} <= set(by_name) and "s1" not in by_name
    assert by_name["c"].kind == "conditional"
    # nothing free is counted
    assert not {"x.0", "g0", "init", "c0", "out", "i", "one"} & set(by_name)
    assert by_name["j"].kind == "add" and by_name["j"].count == 5   # an unfused op launches
    expected = (3            # entry: fusion, GEMM, Pallas call
                + 3 * 5      # known loop: 2 fusions and the counter's add
                + 2 * 5 + 6 + 6  # counted loop: body (fusion, add), condition, sync
                + 1 + 1 + 1  # open loop: one round of body, condition, sync
                + 1          # copy
                + 3 + 1)     # largest branch, sync
    assert launches.total(items) == expected
    s = launches.summary(items, ("draft", "build", "verify"), ("verify/while/body",))
    assert s["total"] == expected and s["layers"] == 1 + 10
    assert s["other_than_layers"] == expected - 11 and s["kinds"]["add"] == 10
    assert s["syncs"] == 6 + 1 + 1
    assert s["stages"]["draft"] == 1 and s["other_than_layers_by_stage"]["build"] == 5
    assert "kernel launches (11 in the layer stack" in launches.format_summary(s)


def test_the_estimate_weighs_bytes_flops_and_launches():
    """Each op takes the longest of its bytes, its FLOPs and its launches at the class's
    rate; loop conditions cost their launches. Negative control: doubling a class's
    bandwidth halves only that class's bandwidth-bound time."""
    ops = op_costs.op_costs(HLO)
    items = launches.launches(HLO)
    rate = gpu_time.Rate(1e9, 1e12)
    cal = gpu_time.Calibration("h200", {c: rate for c in gpu_time.CLASSES},
                               launch_seconds=1e-3, call_seconds=0.0, source="test")
    e = gpu_time.estimate(ops, items, cal)
    # every op here moves a few KB: each takes its launches' time, 1 ms each
    assert e["seconds"] == pytest.approx(launches.total(items) * 1e-3)
    assert e["classes"]["stacked_matmul"] == pytest.approx(1e-3)   # the Pallas call
    assert e["classes"]["gemm"] == pytest.approx(1e-3)             # the cuBLAS call
    slow = dataclasses.replace(cal, launch_seconds=0.0)
    t = gpu_time.estimate(ops, items, slow)
    k = next(o for o in ops if o.name == "k")
    assert t["classes"]["stacked_matmul"] == pytest.approx(k.hbm_bytes / 1e9)
    fast = dataclasses.replace(
        slow, rates=slow.rates | {"stacked_matmul": gpu_time.Rate(2e9, 1e12)})
    u = gpu_time.estimate(ops, items, fast)
    assert u["classes"]["stacked_matmul"] == pytest.approx(t["classes"]["stacked_matmul"] / 2)
    assert u["classes"]["memory"] == pytest.approx(t["classes"]["memory"])


def test_the_fit_recovers_rates_that_explain_the_measurements():
    """Programs timed with known rates: the fit from a first guess 1.5x off comes back
    within 5 % of each measurement; a table that is not one is refused by name."""
    ops = op_costs.op_costs(HLO)
    items = launches.launches(HLO)
    scaled = lambda f: [dataclasses.replace(o, hbm_bytes=o.hbm_bytes * f, flops=o.flops * f)
                        for o in ops]
    truth = gpu_time.Calibration(
        "h200", {c: gpu_time.Rate(1e6 * (i + 1), 1e12) for i, c in enumerate(gpu_time.CLASSES)},
        launch_seconds=1e-6, call_seconds=1e-4, source="truth")
    programs = [(scaled(f), items, gpu_time.estimate(scaled(f), items, truth)["seconds"]
                 + truth.call_seconds, True) for f in (1, 100, 10_000)]
    guess = dataclasses.replace(truth, rates={c: gpu_time.Rate(r.bytes_per_second * 1.5, 1e12)
                                              for c, r in truth.rates.items()})
    _, before = gpu_time.fit(guess, programs, peak_flops=1e15, hbm_bandwidth=1e12, rounds=0)
    fitted, after = gpu_time.fit(guess, programs, peak_flops=1e15, hbm_bandwidth=1e12,
                                 prior=0.0)
    assert before > 1.2 and after < 1.05
    with pytest.raises(ValueError, match="not a GPU calibration table"):
        gpu_time.Calibration.from_dict({"gpu": "h200"})
    with pytest.raises(ValueError, match="no rate for"):
        gpu_time.Calibration("h200", {}, 1e-6, 0.0, "")


def test_the_committed_h200_table_loads_and_other_gpus_have_none():
    cal = gpu_time.load("h200")
    assert cal is not None and cal.gpu == "h200" and set(cal.rates) == set(gpu_time.CLASSES)
    chip = chips.GPUS["h200"].chip
    assert all(r.bytes_per_second <= chip.hbm_bandwidth and r.flops_per_second <= chip.peak_flops
               for r in cal.rates.values())
    assert 0 < cal.launch_seconds < 1e-4 and gpu_time.load("a100") is None


needs_plugin = pytest.mark.skipif(
    not chips.plugin_installed(),
    reason="the CUDA plugin is not installed (pip install -e '.[gpu]')")


@needs_plugin
def test_a_compiled_loop_launches_its_gemm_once_per_trip():
    dev = chips.gpu_devices("h200x1").devices[0]
    sharding = jax.sharding.SingleDeviceSharding(dev)
    w = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16, sharding=sharding)
    x = jax.ShapeDtypeStruct((8, 256), jnp.bfloat16, sharding=sharding)

    def f(w, x):
        return jax.lax.fori_loop(0, 7, lambda i, x: jnp.tanh(x @ w), x)

    text = jax.jit(f).trace(w, x).lower(lowering_platforms=("cuda",)).compile().as_text()
    items = launches.launches(text)
    gemms = [x for x in items if x.kind in ("triton gemm", "cublas")]
    assert gemms and all(g.count == 7 for g in gemms)
    assert launches.total(items) >= 7 and not any(x.in_loop for x in items)
    assert math.isfinite(launches.total(items))


@pytest.mark.parametrize("table", sorted(gpu_time.TABLES.glob("*.json")), ids=lambda p: p.stem)
def test_a_calibration_names_only_what_the_repository_ships(table):
    """Issue 51, item 8: plan --gpu printed a 700-character source naming measurement
    files outside the repository; it now names the folder they are in (since issue 56
    in experiments/gpu, beside the script that measures them, out of the package)."""
    cal = gpu_time.load(table.stem)
    assert len(cal.source) <= 200, cal.source
    root = gpu_time.TABLES.parents[2]
    named = [w for w in cal.source.replace(",", " ").replace(";", " ").split() if "/" in w]
    assert named, cal.source
    for path in named:
        assert path.startswith(("tev_jax/", "experiments/")) and (root / path).exists(), path
