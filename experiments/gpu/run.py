"""GPU plans of real model sizes, compiled on this CPU machine with the CUDA plugin (ahead of
time, no GPU: `tev_jax.costs.chips`).

Decoding: Qwen3-8B and Qwen3-4B at full depth (the layers are one scan, so a 36-layer
program compiles about as fast as a 4-layer one), bfloat16, 1-layer DFlash drafter
(block 16), on 8 x H100 and 8 x H200 (tensor 8; data 2 x tensor 4), batch B, AR and
DDTree budgets 16 / 32 / 64 with TEV at T = 0, prompt buffer 1024, cache 2048: per GPU
the round program's memory, the roofline time of one round and of one AR step
(max(FLOPs / peak, bytes / bandwidth) with FLOPs and bytes from the optimised HLO,
`tev_jax.costs.op_costs`: the GPU compiler gives no cost analysis), the break-even τ, the
speed-up at DDTree's published τ and the budget `tev_jax.costs.round_costs.best_budgets` picks (AR
included). B 1, 8 and 64 are compiled; B 32 is interpolated linearly between 8 and 64
(marked ≈, as in experiments/tpu). Training: one ExitTrain update per target on 8 GPUs
(fsdp 8). Checks: the issue's 4-layer configuration (Qwen3-8B, B 8, budget 64, T = 1) at 4
layers and at full depth (temporaries, compile time), and the AR step's FLOPs against a
hand count. Results are cached in the output JSON (reruns skip what is there);
``--report`` prints the README tables.

    PYTHONPATH=. python experiments/gpu/run.py [--quick] [--train] [--checks]
    python experiments/gpu/run.py --report experiments/gpu/results.json
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin compiles all the same

from tev_jax.runtime.platforms import quiet_start

if __name__ == "__main__":
    quiet_start()  # before jax is imported: no libtpu or CUDA plugin lines on a CPU

import jax.numpy as jnp  # noqa: E402

from tev_jax.costs import chips, plan
from tev_jax.costs.round_costs import best_budgets
from tev_jax.decode import DecodeConfig  # noqa: E402
from tev_jax.sampling import Sampling  # noqa: E402

HERE = Path(__file__).resolve().parent
MESHES = {"tensor8": dict(tensor=8, fsdp=1), "data2_tensor4": dict(data=2, tensor=4, fsdp=1)}
GPUS = ("h100", "h200")
MODELS = ("qwen3-8b", "qwen3-4b")
PROMPT_LEN, CACHE_LEN, MAX_NEW = 1024, 2048, 256
BATCHES, COMPILED_BATCHES, BUDGETS = (1, 8, 32, 64), (1, 8, 64), (16, 32, 64)
SEQ_LEN, ANCHORS, TRAIN_BUDGET = 2048, 32, 32


def _tpu_run():
    """experiments/tpu/run.py: DDTree's published τ (one table for both experiments)."""
    spec = importlib.util.spec_from_file_location("tpu_run", HERE.parent / "tpu" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def decode_config(budget: int | None, temperature: float = 0.0,
                  max_new: int = MAX_NEW) -> DecodeConfig:
    return DecodeConfig(max_new_tokens=max_new, budget=budget or 1, verifier="tev",
                        builder="ddtree" if budget else "none", sampling=Sampling(temperature),
                        prompt_len=PROMPT_LEN, max_cache_len=CACHE_LEN)


def compile_round(model: str, gpu_name: str, mesh_name: str, batch: int, budget: int | None,
                  *, layers: int | None = None, temperature: float = 0.0,
                  max_new: int = MAX_NEW, program: str = "round") -> dict:
    """The round (or, with ``budget`` None, the AR step; or ``program``, e.g. the whole
    'generation') on 8 GPUs; -> its report as a dict (per GPU), peak bytes included."""
    mesh, _ = chips.gpu_mesh(f"{gpu_name}x8", **MESHES[mesh_name])
    cfg = plan.preset(model, num_layers=layers)
    result = plan.plan_decode_programs(cfg, decode_config(budget, temperature, max_new), batch,
                                       dtype=jnp.bfloat16, mesh=mesh, programs=(program,))
    report = result.programs[program]
    return dataclasses.asdict(report) | {"peak_bytes": report.peak_bytes}


def decode_items(grid) -> list:
    items = []
    for model, gpu_name, mesh_name in grid:
        for batch in COMPILED_BATCHES:
            if mesh_name.startswith("data2") and batch % 2:
                continue
            for budget in (None, *BUDGETS):
                key = f"decode/{model}/{gpu_name}/{mesh_name}/B{batch}/" + (
                    f"b{budget}" if budget else "ar")

                def thunk(model=model, gpu_name=gpu_name, mesh_name=mesh_name, batch=batch,
                          budget=budget):
                    entry = {"model": model, "gpu": gpu_name, "mesh": mesh_name,
                             "batch": batch, "budget": budget,
                             "layers": plan.PRESETS[model].num_layers}
                    try:
                        return entry | compile_round(model, gpu_name, mesh_name, batch, budget)
                    except Exception as e:  # the compiler's own words
                        return entry | {"error": str(e).strip().splitlines()[0][:300]}
                items.append((key, thunk))
    return items


MEASURED_H200 = {(1, None): 7.12, (1, 32): 10.38, (8, None): 7.36, (8, 32): 21.90,
                 (32, None): 8.98, (32, 32): 63.19}
"""Qwen3-8B on one H200 (2026-12-04, kernels on, dispatched rounds, ms): issue 44's table."""


def calibrated_items() -> list:
    """Qwen3-8B on one H200 at full depth, B 1 / 8 / 32 (all compiled), AR and the
    budgets: each program's calibrated estimate (`tev_jax.costs.gpu_time`, the committed H200
    table), roofline and launches."""
    items = []
    for batch in (1, 8, 32):
        for budget in (None, *BUDGETS):
            key = f"calibrated/qwen3-8b/h200x1/B{batch}/" + (f"b{budget}" if budget else "ar")

            def thunk(batch=batch, budget=budget):
                mesh, devices = chips.gpu_mesh("h200x1")
                result = plan.plan_decode_programs(
                    plan.preset("qwen3-8b"), decode_config(budget), batch, dtype=jnp.bfloat16,
                    mesh=mesh, programs=("round",), chip=devices.chip)
                report = result.programs["round"]
                return {"model": "qwen3-8b", "gpu": "h200", "batch": batch, "budget": budget,
                        **dataclasses.asdict(report),
                        "roofline_seconds": report.roofline_seconds(devices.chip)}
            items.append((key, thunk))
    return items


def calibrated_table(results: dict, tpu_run) -> str:
    """Per B: the calibrated ms of the AR step and each budget (break-even τ), the
    measured ms where the H200 was timed (estimate + one dispatch / measured), tune's
    pick and the speed-up at DDTree's τ, all on the calibrated figures."""
    rows = ["| B | AR ms (measured) | " + " | ".join(f"b {b}" for b in BUDGETS)
            + " | launches AR / b 32 (outside layers) | tune's pick (τ MATH-500) | speed-up |",
            "|---|---|" + "---|" * len(BUDGETS) + "---|---|---|"]
    for batch in (1, 8, 32):
        got = {e["budget"]: e for k, e in results.items()
               if k.startswith(f"calibrated/qwen3-8b/h200x1/B{batch}/") and "error" not in e}
        if None not in got or got[None].get("estimate") is None:
            continue
        call = got[None]["estimate"]["call_seconds"]
        t = {b: e["estimate"]["seconds"] for b, e in got.items()}

        def cell(b):
            measured = MEASURED_H200.get((batch, b))
            vs = ("" if measured is None else
                  f"; {(t[b] + call) * 1e3:.2f} + call vs {measured:.2f} measured: "
                  f"{(t[b] + call) * 1e3 / measured:.2f}x")
            return f"{t[b] * 1e3:.2f}" + ("" if b is None else f" ({t[b] / t[None]:.2f})") + vs

        tau = {b: tpu_run.ddtree_tau("qwen3-8b", b)[0] for b in BUDGETS if b in t}
        pick = best_budgets(tau, {batch: {b: t[b] for b in tau}}, {batch: t[None]})[batch]
        n = lambda b: (f"{got[b]['launches']['total']} ({got[b]['launches']['other_than_layers']})"
                       if b in got else "–")
        rows.append(f"| {batch} | {cell(None)} | " + " | ".join(
            cell(b) if b in t else "–" for b in BUDGETS)
            + f" | {n(None)} / {n(32)} | {pick['budget'] or 'AR'} | {pick['speedup']:.2f} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def check_items() -> list:
    """The issue's configuration (Qwen3-8B, h100x8 tensor 8, B 8, budget 64, T = 1, max
    new tokens 959: cache 2048) at 4 layers and at full depth, AR step and round."""
    items = []
    for layers in (4, 36):
        for budget in (None, 64):
            key = f"check/qwen3-8b/h100/tensor8/B8/{'b64' if budget else 'ar'}/T1/L{layers}"
            items.append((key, lambda layers=layers, budget=budget: compile_round(
                "qwen3-8b", "h100", "tensor8", 8, budget, layers=layers, temperature=1.0,
                max_new=CACHE_LEN - PROMPT_LEN - 65) | {"layers": layers}))
    items.append(("check/qwen3-8b/h100/tensor8/B8/generation/T1/L36",
                  lambda: compile_round("qwen3-8b", "h100", "tensor8", 8, 64, temperature=1.0,
                                        max_new=CACHE_LEN - PROMPT_LEN - 65,
                                        program="generation") | {"layers": 36}))
    return items


def train_items() -> list:
    from tev_jax.costs.plan import abstract_drafter
    from train.plan import plan_step, step_model_flops

    items = []
    for model in MODELS:
        for gpu_name in GPUS:
            def thunk(model=model, gpu_name=gpu_name):
                cfg = plan.PRESETS[model]
                step = plan_step(cfg, drafter_layers=1, batch=8, seq_len=SEQ_LEN,
                                 anchors=ANCHORS, budget=TRAIN_BUDGET, mesh_shape=(1, 8, 1),
                                 target_dtype="bfloat16", gpu=f"{gpu_name}x8")
                drafter = abstract_drafter(cfg, "float32", num_layers=1)
                return {"model": model, "gpu": gpu_name, "peak_bytes": step.peak,
                        **dataclasses.asdict(step.report),
                        "model_flops": step_model_flops(cfg, drafter, batch=8,
                                                        seq_len=SEQ_LEN, anchors=ANCHORS,
                                                        budget=TRAIN_BUDGET)}
            items.append((f"train/{model}/d1/{gpu_name}x8", thunk))
    return items


# --------------------------------------------------------------------------- report


def seconds(entry: dict, gpu_name: str) -> float:
    chip = chips.GPUS[gpu_name].chip
    return max(entry["flops"] / chip.peak_flops, entry["bytes_accessed"] / chip.hbm_bandwidth)


def groups(results: dict) -> dict:
    """(model, gpu, mesh, B) -> {budget or None: entry}; B 32 interpolated linearly
    between B 8 and 64 where not compiled (entries marked ≈)."""
    out: dict = {}
    for key, e in results.items():
        if key.startswith("decode/") and "error" not in e:
            out.setdefault((e["model"], e["gpu"], e["mesh"], e["batch"]), {})[e["budget"]] = e
    for (model, g, mesh, batch), low in list(out.items()):
        high = out.get((model, g, mesh, 64))
        if batch != 8 or high is None or (model, g, mesh, 32) in out:
            continue
        w = (32 - 8) / (64 - 8)
        out[model, g, mesh, 32] = {
            b: {k: low[b][k] + w * (high[b][k] - low[b][k])
                for k in ("flops", "bytes_accessed", "peak_bytes")} | {"mark": "≈"}
            for b in low if b in high}
    return out


def decode_table(results: dict, tpu_run) -> str:
    head = ["| model | GPU | mesh | B | AR ms | " + " | ".join(f"b {b}" for b in BUDGETS)
            + " | GiB / GPU (max) | tune's pick (τ MATH-500) | speed-up | at MT-Bench / "
            "GSM8K τ |", "|---|---|---|---|---|" + "---|" * len(BUDGETS) + "---|---|---|---|"]
    rows = []
    for (model, g, mesh, batch), entries in sorted(groups(results).items()):
        if None not in entries:
            continue
        t_ar, cells, cost = seconds(entries[None], g), [], {}
        for budget in BUDGETS:
            e = entries.get(budget)
            if e is None:
                cells.append("–")
                continue
            t = seconds(e, g)
            over = e["peak_bytes"] > chips.GPUS[g].chip.hbm_bytes
            cells.append(f"{e.get('mark', '')}{t * 1e3:.2f} ({t / t_ar:.2f})"
                         + (" > HBM" if over else ""))
            if not over:
                cost[budget] = t
        tau = {b: tpu_run.ddtree_tau(model, b)[0] for b in BUDGETS}
        pick = best_budgets(tau, {batch: cost}, {batch: t_ar})[batch]
        table = tpu_run.ddtree_tau(model, BUDGETS[0])[1]
        t_pick = cost.get(pick["budget"], t_ar)
        other = (f"{table['MT-Bench'] * t_ar / t_pick:.2f} / {table['GSM8K'] * t_ar / t_pick:.2f}"
                 if pick["budget"] else "–")
        gib = max(e["peak_bytes"] for e in entries.values()) / 2**30
        rows.append(f"| {model} | {g} | {mesh} | {batch} | "
                    f"{entries[None].get('mark', '')}{t_ar * 1e3:.2f} | " + " | ".join(cells)
                    + f" | {gib:.2f} | {pick['budget'] or 'AR'} | {pick['speedup']:.2f} | "
                    f"{other} |")
    return "\n".join(head + rows)


def compile_table(results: dict) -> str:
    rows = ["| program | layers | args GiB | temp GiB | out GiB | GFLOP | GB | compile s |",
            "|---|---|---|---|---|---|---|---|"]
    for key, e in sorted(results.items()):
        if key.startswith("check/"):
            rows.append(f"| {key.split('/')[5]}, T = 1 | {e['layers']} | "
                        f"{e['argument_bytes'] / 2**30:.3f} | {e['temp_bytes'] / 2**30:.3f} | "
                        f"{e['output_bytes'] / 2**30:.3f} | {e['flops'] / 1e9:.1f} | "
                        f"{e['bytes_accessed'] / 1e9:.2f} | {e['compile_seconds']:.0f} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def train_table(results: dict) -> str:
    rows = ["| target | GPUs | GiB / GPU | TFLOP / GPU | GB / GPU | step ms (roofline) | "
            "MFU estimate | compile s |", "|---|---|---|---|---|---|---|---|"]
    for key, e in sorted(results.items()):
        if not key.startswith("train/"):
            continue
        t, chip = seconds(e, e["gpu"]), chips.GPUS[e["gpu"]].chip
        rows.append(f"| {e['model']} | 8 x {e['gpu']} (fsdp 8) | {e['peak_bytes'] / 2**30:.2f} | "
                    f"{e['flops'] / 1e12:.2f} | {e['bytes_accessed'] / 1e9:.1f} | "
                    f"{t * 1e3:.0f} | {e['model_flops'] / (8 * chip.peak_flops * t):.1%} | "
                    f"{e['compile_seconds']:.0f} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def tables(results: dict) -> str:
    tpu_run = _tpu_run()
    return "\n\n".join(t for t in (decode_table(results, tpu_run), train_table(results),
                                     compile_table(results),
                                     calibrated_table(results, tpu_run)) if t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="Qwen3-8B on h100x8 tensor 8 only")
    ap.add_argument("--train", action="store_true", help="also the training steps")
    ap.add_argument("--checks", action="store_true",
                    help="also the issue's 4-layer configuration and its full depth")
    ap.add_argument("--calibrated", action="store_true",
                    help="also Qwen3-8B on one H200: the calibrated estimates (tev_jax.costs.gpu_time)")
    ap.add_argument("--only", default=None, help="only keys containing this text")
    ap.add_argument("--gpus", default=",".join(GPUS),
                    help="GPUs of the decode grid (default %(default)s; b200 and a100 too)")
    ap.add_argument("--out", default=None,
                    help="results file, also the cache of what was compiled (default "
                    "results.json, results_quick.json with --quick)")
    ap.add_argument("--report", default=None, metavar="JSON", help="print the tables")
    args = ap.parse_args(argv)
    args.out = args.out or str(HERE / ("results_quick.json" if args.quick else "results.json"))
    if args.report:
        print(tables(json.loads(Path(args.report).read_text())))
        return 0
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    grid = ([("qwen3-8b", "h100", "tensor8")] if args.quick else
            [(m, g, mesh) for mesh in MESHES for g in args.gpus.split(",") for m in MODELS])
    items = (check_items() if args.checks else []) + decode_items(grid)
    items += train_items() if args.train else []
    items += calibrated_items() if args.calibrated else []
    for key, thunk in items:
        if key in results or (args.only and args.only not in key):
            continue
        t0 = time.perf_counter()
        results[key] = thunk()
        out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"{key}: {time.perf_counter() - t0:.0f} s", flush=True)
    print(tables(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
