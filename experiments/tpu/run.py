"""TPU plans of real model sizes, compiled on this CPU machine with libtpu (ahead of time).

Decoding: Qwen3-4B, Qwen3-8B and Llama-3-8B, bfloat16, 1-layer DFlash drafter (block 16),
on v5e-8 and v6e-8 slices (tensor 8; data 2 x tensor 4), batch B, DDTree budget b with
TEV, prompt buffer 1024, cache 2048: per chip the round program's memory, the roofline
time of one speculative round and of one AR step (max(FLOPs / peak, bytes / bandwidth),
`tev_jax.topology.CHIPS`), the break-even τ (round / AR step) and the estimated speed-up
at the τ DDTree reports. Training: one ExitTrain update for 4B / 8B targets with 1- and
5-layer drafters on v5p-8 (fsdp 8), v5e-16 (fsdp 16, 4 hosts) and v5p-64 (fsdp 64, 16
hosts): per-chip memory, step roofline time, MFU estimate, compile time.

Full depth by extrapolation: every layer of a model is the same program, so each
program is compiled with 1 and with 2 target layers and its FLOPs, bytes accessed,
argument and output bytes are extended linearly to the full depth
(``v(L) = v(1) + (L - 1) * (v(2) - v(1))``); temporaries are reused across layers, so
the larger of the two compiles is taken. ``--validate N`` compiles one configuration with
N layers and prints the extrapolation's error. Results are cached in the output JSON
(reruns skip what is there); ``--report`` prints the README tables.

    JAX_PLATFORMS=cpu python experiments/tpu/run.py [--quick] [--validate 6] [--train]
    python experiments/tpu/run.py --report experiments/tpu/results.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax.numpy as jnp  # noqa: E402

from tev_jax import plan, topology  # noqa: E402
from tev_jax import sharding as shd  # noqa: E402
from tev_jax.decode import DecodeConfig  # noqa: E402

HERE = Path(__file__).resolve().parent
FIELDS = ("flops", "bytes_accessed", "argument_bytes", "output_bytes", "alias_bytes",
          "code_bytes")
MESHES = {"tensor8": dict(tensor=8, fsdp=1), "data2_tensor4": dict(data=2, tensor=4, fsdp=1)}
SLICES = {"v5e": "v5e:2x4", "v6e": "v6e:2x4"}
PROMPT_LEN, CACHE_LEN, MAX_NEW = 1024, 2048, 256

# (model, chip, mesh) -> (batches, budgets): the full grid where it matters most, a
# smaller one elsewhere (a round costs two TPU compiles, about 80 s on this 2-core machine).
DECODE_GRID = {
    ("qwen3-8b", "v5e", "tensor8"): ((1, 8, 32, 64), (16, 32, 64, 128, 256)),
    ("qwen3-8b", "v6e", "tensor8"): ((8, 64), (64,)),
    ("qwen3-8b", "v5e", "data2_tensor4"): ((8,), (64,)),
    ("qwen3-4b", "v5e", "tensor8"): ((8, 64), (64,)),
    ("llama3-8b", "v5e", "tensor8"): ((8, 64), (64,)),
}
# (target, drafter layers, slice, fsdp = chips, global batch): one sequence per chip,
# 2048 tokens, 32 anchors, budget 32; bf16 frozen target, float32 drafter.
TRAIN_GRID = (
    ("qwen3-4b", 1, "v5p:2x2x2", 8), ("qwen3-8b", 1, "v5p:2x2x2", 8),
    ("qwen3-8b", 5, "v5p:2x2x2", 8), ("qwen3-8b", 1, "v5e:4x4", 16),
    ("qwen3-8b", 1, "v5p:4x4x4", 64),
)
SEQ_LEN, ANCHORS, TRAIN_BUDGET = 2048, 32, 32
QUICK_GRID = {("qwen3-8b", "v5e", "tensor8"): ((8,), (64,))}


def extrapolate(one: dict, two: dict, layers: int) -> dict:
    """Full-depth figures from the 1- and 2-layer compiles (see the module docstring)."""
    out = {k: one[k] + (layers - 1) * (two[k] - one[k]) for k in FIELDS}
    out["temp_bytes"] = max(one["temp_bytes"], two["temp_bytes"])
    out["compile_seconds"] = one["compile_seconds"] + two["compile_seconds"]
    out["peak_bytes"] = (out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"]
                         - out["alias_bytes"] + out["code_bytes"])
    return out


def _report_dict(r: plan.ProgramReport) -> dict:
    return dataclasses.asdict(r)


def decode_programs(model: str, chip: str, mesh_name: str, batch: int, budget: int | None,
                    layers: int) -> dict:
    """Compiles the round (or, with ``budget`` None, the AR step) at ``layers`` layers."""
    tpu = topology.slice_devices(SLICES[chip])
    mesh = shd.make_mesh(**MESHES[mesh_name], devices=tpu.devices)
    cfg = plan.preset(model, num_layers=layers)
    config = DecodeConfig(max_new_tokens=MAX_NEW, budget=budget or 1, verifier="tev",
                          prompt_len=PROMPT_LEN, max_cache_len=CACHE_LEN,
                          builder="ddtree" if budget else "none")
    name = "round" if budget else "ar_step"
    result = plan.plan_decode_programs(cfg, config, batch, dtype=jnp.bfloat16, mesh=mesh,
                                       programs=("round",))
    return _report_dict(result.programs["round"]) | {"program": name}


def run_decode(results: dict, grid: dict, out: Path) -> None:
    for (model, chip, mesh_name), (batches, budgets) in grid.items():
        full = plan.PRESETS[model].num_layers
        for batch in batches:
            if mesh_name.startswith("data2") and batch % 2:
                continue  # the batch must split over data 2
            for budget in (None, *budgets):
                key = f"decode/{model}/{chip}/{mesh_name}/B{batch}/" + (
                    f"b{budget}" if budget else "ar")
                if key in results:
                    continue
                t0 = time.perf_counter()
                one, two = (decode_programs(model, chip, mesh_name, batch, budget, n)
                            for n in (1, 2))
                results[key] = {"model": model, "chip": chip, "mesh": mesh_name,
                                "batch": batch, "budget": budget, "layers": full,
                                "one": one, "two": two, "full": extrapolate(one, two, full)}
                out.write_text(json.dumps(results, indent=1) + "\n")
                print(f"{key}: {time.perf_counter() - t0:.0f} s", flush=True)


def train_step(model: str, drafter_layers: int, slice_name: str, chips: int,
               layers: int) -> dict:
    from train.plan import plan_step

    step = plan_step(plan.preset(model, num_layers=layers), drafter_layers=drafter_layers,
                     batch=chips, seq_len=SEQ_LEN, anchors=ANCHORS, budget=TRAIN_BUDGET,
                     mesh_shape=(1, chips, 1), target_dtype="bfloat16", topology=slice_name)
    return _report_dict(step.report)


def run_train(results: dict, out: Path) -> None:
    from tev_jax.plan import abstract_drafter
    from train.plan import step_model_flops

    for model, drafter_layers, slice_name, chips in TRAIN_GRID:
        key = f"train/{model}/d{drafter_layers}/{slice_name}"
        if key in results:
            continue
        t0 = time.perf_counter()
        one, two = (train_step(model, drafter_layers, slice_name, chips, n) for n in (1, 2))
        cfg = plan.PRESETS[model]
        drafter = abstract_drafter(cfg, "float32", num_layers=drafter_layers)
        results[key] = {"model": model, "drafter_layers": drafter_layers,
                        "slice": slice_name, "chips": chips, "batch": chips,
                        "layers": cfg.num_layers, "one": one, "two": two,
                        "full": extrapolate(one, two, cfg.num_layers),
                        "model_flops": step_model_flops(cfg, drafter, batch=chips,
                                                        seq_len=SEQ_LEN, anchors=ANCHORS,
                                                        budget=TRAIN_BUDGET)}
        out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"{key}: {time.perf_counter() - t0:.0f} s", flush=True)


def validate(results: dict, out: Path, layers: int) -> None:
    """Qwen3-8B, v5e tensor 8, B 8, budget 64 compiled at ``layers`` layers against the
    extrapolation from its 1- and 2-layer compiles."""
    key = f"validate/qwen3-8b/v5e/tensor8/B8/b64/L{layers}"
    if key not in results:
        t0 = time.perf_counter()
        results[key] = decode_programs("qwen3-8b", "v5e", "tensor8", 8, 64, layers)
        results[key]["wall_seconds"] = time.perf_counter() - t0
        out.write_text(json.dumps(results, indent=1) + "\n")
    real = results[key]
    base = results["decode/qwen3-8b/v5e/tensor8/B8/b64"]
    ext = extrapolate(base["one"], base["two"], layers)
    for k in ("flops", "bytes_accessed", "argument_bytes", "temp_bytes", "output_bytes"):
        print(f"{k:15s} {layers} layers {real[k]:.4g}  extrapolated {ext[k]:.4g}  "
              f"({(ext[k] - real[k]) / max(real[k], 1) * 100:+.1f} %)")


# --------------------------------------------------------------------------- report

# τ that DDTree reports for its models at T = 0 (best budget per dataset), from the
# benchmark listing of arXiv 2604.12989 (DDTree: "Accelerating Speculative Decoding with
# Block Diffusion Draft Trees"): MT-Bench 6.06, GSM8K 9.27, HumanEval 9.65. The paper's
# per-model table could not be read offline; these span its reported range.
DDTREE_TAU = {"MT-Bench": 6.06, "GSM8K": 9.27, "HumanEval": 9.65}


def _seconds(entry: dict, chip: str) -> float:
    c = topology.CHIPS[chip]
    f = entry["full"]
    return max(f["flops"] / c.peak_flops, f["bytes_accessed"] / c.hbm_bandwidth)


def decode_table(results: dict) -> str:
    rows = ["| model | chip | mesh | B | budget | GiB / chip | round ms | AR ms | "
            "break-even τ | speed-up at τ " + " / ".join(f"{v}" for v in DDTREE_TAU.values())
            + " |", "|---|---|---|---|---|---|---|---|---|---|"]
    order = lambda item: (item[1]["model"], item[1]["chip"], item[1]["mesh"],
                          item[1]["batch"], item[1]["budget"])
    decode = sorted(((k, e) for k, e in results.items()
                     if k.startswith("decode/") and e["budget"] is not None), key=order)
    for key, e in decode:
        ar = results[key.rsplit("/", 1)[0] + "/ar"]
        t_round, t_ar = _seconds(e, e["chip"]), _seconds(ar, e["chip"])
        speedups = " / ".join(f"{tau * t_ar / t_round:.2f}" for tau in DDTREE_TAU.values())
        rows.append(f"| {e['model']} | {e['chip']} | {e['mesh']} | {e['batch']} | "
                    f"{e['budget']} | {e['full']['peak_bytes'] / 2**30:.2f} | "
                    f"{t_round * 1e3:.2f} | {t_ar * 1e3:.2f} | {t_round / t_ar:.2f} | "
                    f"{speedups} |")
    return "\n".join(rows)


def train_table(results: dict) -> str:
    rows = ["| target | drafter layers | slice | chips | GiB / chip | TFLOP / chip | "
            "GB / chip | step ms (roofline) | MFU estimate | compile s (1 + 2 layers) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for key, e in results.items():
        if not key.startswith("train/"):
            continue
        chip = topology.CHIPS[e["slice"].split(":")[0]]
        f = e["full"]
        t = max(f["flops"] / chip.peak_flops, f["bytes_accessed"] / chip.hbm_bandwidth)
        mfu = e["model_flops"] / (e["chips"] * chip.peak_flops * t)
        rows.append(f"| {e['model']} | {e['drafter_layers']} | {e['slice']} | {e['chips']} | "
                    f"{f['peak_bytes'] / 2**30:.2f} | {f['flops'] / 1e12:.2f} | "
                    f"{f['bytes_accessed'] / 1e9:.1f} | {t * 1e3:.0f} | {mfu:.1%} | "
                    f"{f['compile_seconds']:.0f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one configuration")
    ap.add_argument("--validate", type=int, default=0, metavar="LAYERS",
                    help="also compile Qwen3-8B B 8 budget 64 at this many layers and "
                         "compare with the extrapolation")
    ap.add_argument("--train", action="store_true", help="also the training steps")
    ap.add_argument("--out", default=None)
    ap.add_argument("--report", default=None, metavar="JSON", help="print the tables")
    args = ap.parse_args(argv)
    if args.report:
        results = json.loads(Path(args.report).read_text())
        print(decode_table(results) + "\n\n" + train_table(results))
        return 0
    out = Path(args.out) if args.out else HERE / ("results_quick.json" if args.quick
                                                  else "results.json")
    results = json.loads(out.read_text()) if out.exists() else {}
    run_decode(results, QUICK_GRID if args.quick else DECODE_GRID, out)
    if args.train:
        run_train(results, out)
    if args.validate:
        validate(results, out, args.validate)
    print(decode_table(results) + "\n\n" + train_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
