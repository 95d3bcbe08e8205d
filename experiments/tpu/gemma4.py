"""Gemma-4-12B-IT (5 sliding + 1 global layers, window 1024) compiled for TPU at full depth.

Per program (the fused rounds loop of an AR step, and of a DDTree + TEV round at budget
b, 1-layer DFlash drafter, bf16, cache of ``ctx`` slots, prompt buffer ``ctx - 384``),
per chip: memory, compile time, the HBM bytes and FLOPs of one round from the per-op
table (`tev_jax.costs.op_costs`) and the round's floor of bytes (`tev_jax.costs.plan.round_floor`):
the weights, both key/value caches, but a sliding layer only its last ``W + N`` slots.
Contexts 2k and 16k show the window: a global layer's bytes grow with the context, a
sliding layer's stop at W.

    JAX_PLATFORMS=cpu python experiments/tpu/gemma4.py [--layers 48 6] [--contexts 2048 16384]
    python experiments/tpu/gemma4.py --report

Results go to ``gemma4_results.json`` next to this file; reruns skip what is there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax.numpy as jnp  # noqa: E402

from tev_jax.costs import chips, plan
from tev_jax.decode import DecodeConfig  # noqa: E402
from tev_jax.engine import Engine  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import round_record  # noqa: E402

HERE = Path(__file__).resolve().parent
MODEL = "gemma-4-12b"
# 16 query heads, 8 key/value heads in sliding layers: tensor 8 on 8 chips; the global
# layers' single k = v head is replicated.
SLICES = {"v5e": ("v5e:2x4", dict(tensor=8, fsdp=1)),
          "v6e": ("v6e:2x4", dict(tensor=8, fsdp=1))}


def measure(layers: int, chip_name: str, batch: int, budget: int | None, ctx: int,
            window: str = "native") -> dict:
    import dataclasses

    slice_name, axes = SLICES[chip_name]
    mesh, tpu = chips.slice_mesh(slice_name, **axes)
    cfg = dataclasses.replace(plan.preset(MODEL, num_layers=layers), attention_window=window)
    config = DecodeConfig(builder="none" if budget is None else "ddtree",
                          budget=budget or 16, verifier="tev", prompt_len=ctx - 384,
                          max_cache_len=ctx, max_new_tokens=256)
    target, drafter = plan.abstract_models(cfg, config, dtype=jnp.bfloat16)
    engine = Engine.create(target, None if budget is None else drafter, config, batch,
                           mesh=mesh)
    t0 = time.perf_counter()
    try:
        compiled = engine.lower("run_rounds").compile()
    except Exception as e:  # the compiler's RESOURCE_EXHAUSTED: a row that does not fit
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return {"layers": layers, "chip": chip_name, "batch": batch, "budget": budget,
                "ctx": ctx, "window": window, "does_not_fit": str(e).split("\n")[0][:200]}
    return {"layers": layers, "chip": chip_name, "batch": batch, "budget": budget, "ctx": ctx,
            "window": window, "compile_seconds": time.perf_counter() - t0,
            **round_record(engine, compiled, tpu.chip)}


def key(layers, chip, batch, budget, ctx, window="native") -> str:
    return (f"{layers}/{chip}/B{batch}/{'ar' if budget is None else f'b{budget}'}/{ctx}"
            + ("" if window == "native" else f"/{window}"))


def report(results: dict) -> str:
    lines = ["| layers | chip | ctx | window | B | program | GiB / chip | compile s | "
             "round GB (HBM) | floor GB (KV) | HBM / floor | roofline ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(results.values(), key=lambda r: (r["layers"], r["chip"], r["ctx"],
                                                     r["window"], r["batch"],
                                                     r["budget"] or 0)):
        if "does_not_fit" in r:
            lines.append(f"| {r['layers']} | {r['chip']} | {r['ctx']} | {r['window']} | "
                         f"{r['batch']} | {'AR' if r['budget'] is None else 'b ' + str(r['budget'])}"
                         " | does not fit | | | | | |")
            continue
        f = r["floor"]
        lines.append(
            f"| {r['layers']} | {r['chip']} | {r['ctx']} | {r['window']} | {r['batch']} | "
            f"{'AR' if r['budget'] is None else 'b ' + str(r['budget'])} | "
            f"{r['peak_bytes'] / 2**30:.2f} | {r['compile_seconds']:.0f} | "
            f"{r['round_hbm_bytes'] / 1e9:.2f} | {plan.sum_floor(f) / 1e9:.2f} "
            f"({f['kv'] / 1e9:.2f}) | {r['hbm_over_floor']:.2f} | "
            f"{r['roofline_seconds'] * 1e3:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[48])
    ap.add_argument("--chips", nargs="+", default=list(SLICES))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--budgets", type=int, nargs="+", default=[0, 16, 32, 64],
                    help="0 = the AR step")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 16384])
    ap.add_argument("--windows", nargs="+", default=["native"])
    ap.add_argument("--out", default=str(HERE / "gemma4_results.json"))
    ap.add_argument("--report", action="store_true", help="print the table and stop")
    args = ap.parse_args(argv)
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.is_file() else {}
    if not args.report:
        for layers in args.layers:
            for chip in args.chips:
                for ctx in args.contexts:
                    for window in args.windows:
                        for batch in args.batches:
                            for b in args.budgets:
                                k = key(layers, chip, batch, b or None, ctx, window)
                                if k in results:
                                    continue
                                results[k] = measure(layers, chip, batch, b or None, ctx,
                                                     window)
                                print(k, f"{results[k].get('compile_seconds', 0):.0f} s",
                                      flush=True)
                                out.write_text(json.dumps(results, indent=1) + "\n")
    print(report(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
