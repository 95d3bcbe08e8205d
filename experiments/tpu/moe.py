"""Qwen3-Coder-30B-A3B (a mixture of 128 experts, top 8) compiled for TPU at full depth.

Per program (the fused rounds loop of an AR step, and of a DDTree + TEV round at budget
b, 1-layer DFlash drafter, bf16, prompt buffer 1024, cache 2048), per chip: memory, the
compile time, the HBM bytes and FLOPs of one round from the per-op table
(`tev_jax.costs.op_costs`; the touched-experts loop charged at `moe.expected_touched` trips,
the attention's key blocks at their count), and the round's floor of bytes
(`tev_jax.costs.plan.round_floor`): the weights it reads (every parameter but the experts and
the untied embedding table), the experts the round's tokens touch under uniform routing
(`tev_jax.models.moe.expected_touched`: B tokens for an AR step, B x N for a round) and
both key/value caches, whole (the attention reads every block), per chip.

    JAX_PLATFORMS=cpu python experiments/tpu/moe.py [--layers 48] [--batches 1 8 32]
    python experiments/tpu/moe.py --report
    python experiments/tpu/moe.py --tune     # the budget tune picks, per B (tune.md)

Results go to ``moe_results.json`` next to this file; reruns skip what is there.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax.numpy as jnp  # noqa: E402
from run import round_record  # noqa: E402

from tev_jax.costs import chips as topology
from tev_jax.costs import plan
from tev_jax.costs.round_costs import best_budgets
from tev_jax.decode import DecodeConfig  # noqa: E402
from tev_jax.engine import Engine  # noqa: E402

HERE = Path(__file__).resolve().parent
MODEL = "qwen3-coder-30b-a3b"
# slice, mesh. The model has 4 key/value heads: tensor 4 on v5p-8 (4 chips); on the 8
# chips of v5e-8 / v6e-8 (16 GB / 32 GB each: the 61 GB of weights need all 8) the
# engine takes each head twice for tensor 8 (`tev_jax.models.kv_heads`: the same model,
# twice the cache).
SLICES = {"v5p": ("v5p:2x2x1", dict(tensor=4, fsdp=1)),
          "v5e": ("v5e:2x4", dict(tensor=8, fsdp=1)),
          "v6e": ("v6e:2x4", dict(tensor=8, fsdp=1))}


def measure(layers: int, chip_name: str, batch: int, budget: int | None) -> dict:
    slice_name, axes = SLICES[chip_name]
    mesh, tpu = topology.slice_mesh(slice_name, **axes)
    cfg = plan.preset(MODEL, num_layers=layers)
    config = DecodeConfig(builder="none" if budget is None else "ddtree",
                          budget=budget or 16, verifier="tev", prompt_len=1024,
                          max_cache_len=2048, max_new_tokens=256)
    target, drafter = plan.abstract_models(cfg, config, dtype=jnp.bfloat16)
    engine = Engine.create(target, None if budget is None else drafter, config, batch,
                           mesh=mesh)
    t0 = time.perf_counter()
    compiled = engine.lower("run_rounds").compile()
    return {"layers": layers, "chip": chip_name, "batch": batch, "budget": budget,
            "compile_seconds": time.perf_counter() - t0,
            **round_record(engine, compiled, tpu.chip)}


def key(layers, chip, batch, budget) -> str:
    return f"{layers}/{chip}/B{batch}/{'ar' if budget is None else f'b{budget}'}"


def report(results: dict) -> str:
    lines = ["| layers | chip | B | program | GiB / chip | compile s | round GB (HBM) | "
             "floor GB (experts touched) | HBM / floor | roofline ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(results.values(), key=lambda r: (r["layers"], r["chip"], r["batch"],
                                                     r["budget"] or 0)):
        f = r["floor"]
        total = plan.sum_floor(f)
        lines.append(
            f"| {r['layers']} | {r['chip']} | {r['batch']} | "
            f"{'AR' if r['budget'] is None else 'b ' + str(r['budget'])} | "
            f"{r['peak_bytes'] / 2**30:.2f} | {r['compile_seconds']:.0f} | "
            f"{r['round_hbm_bytes'] / 1e9:.2f} | {total / 1e9:.2f} ({f['experts_touched']}) | "
            f"{r['hbm_over_floor']:.2f} | {r['roofline_seconds'] * 1e3:.2f} |")
    return "\n".join(lines)


# τ(b): no per-budget curve is published for this target; DDTree's Qwen3-8B MATH-500
# curve at T = 0 (run.DDTREE_MATH500, tune.md) stands in for it, at the compiled budgets.
PROXY_TAU = {16: 8.61, 32: 9.27, 64: 9.75}


def tuning(results: dict, layers: int = 48, chip: str = "v5p") -> str:
    """The budget `tev_jax.costs.round_costs.best_budgets` picks per batch size from the compiled
    rounds' rooflines and `PROXY_TAU`, with every budget's estimated speed-up over AR."""
    rows = [r for r in results.values() if r["layers"] == layers and r["chip"] == chip]
    ar = {r["batch"]: r["roofline_seconds"] for r in rows if r["budget"] is None}
    cost = {bs: {r["budget"]: r["roofline_seconds"] for r in rows
                 if r["batch"] == bs and r["budget"] in PROXY_TAU} for bs in ar}
    best = best_budgets(PROXY_TAU, cost, ar)
    budgets = sorted(PROXY_TAU)
    lines = ["| B | AR ms | " + " | ".join(f"b {b}: x AR (ms)" for b in budgets)
             + " | tune picks |", "|---|---|" + "---|" * len(budgets) + "---|"]
    for bs in sorted(ar):
        cells = [f"{PROXY_TAU[b] * ar[bs] / cost[bs][b]:.2f} ({cost[bs][b] * 1e3:.2f})"
                 if b in cost[bs] else "-" for b in budgets]
        pick = best[bs]
        lines.append(f"| {bs} | {ar[bs] * 1e3:.2f} | " + " | ".join(cells) + " | "
                     + (f"b {pick['budget']} ({pick['speedup']:.2f}x)" if pick["budget"]
                        else "AR") + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[48])
    ap.add_argument("--chips", nargs="+", default=["v5p"], choices=list(SLICES))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--budgets", type=int, nargs="+", default=[0, 16, 32, 64],
                    help="0 = the AR step")
    ap.add_argument("--out", default=str(HERE / "moe_results.json"))
    ap.add_argument("--report", action="store_true", help="print the table and stop")
    ap.add_argument("--tune", action="store_true",
                    help="print the budget tune picks per batch size and stop")
    args = ap.parse_args(argv)
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.is_file() else {}
    if args.tune:
        chips = sorted({r["chip"] for r in results.values() if r["layers"] == 48})
        print("\n\n".join(f"{chip}:\n{tuning(results, chip=chip)}" for chip in chips))
        return 0
    if not args.report:
        for layers in args.layers:
            for chip in args.chips:
                for batch in args.batches:
                    for b in args.budgets:
                        k = key(layers, chip, batch, b or None)
                        if k in results:
                            continue
                        results[k] = measure(layers, chip, batch, b or None)
                        print(k, f"{results[k]['compile_seconds']:.0f} s", flush=True)
                        out.write_text(json.dumps(results, indent=1) + "\n")
    print(report(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
