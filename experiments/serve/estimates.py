"""`plan`-style estimates of ``tev-jax serve`` for Qwen3-8B at concurrency 1 .. 32, from
deviceless compiles (no chip used): the AR step and a DDTree round of the server's slot
program at each live-row count, compiled by `tev_jax.costs.plan.plan_decode_programs` for a
TPU v5e-8 (tensor 8, libtpu) and one H200 (the gpu extra's compiler), bfloat16, prompt
1024, cache 2048, with each row's own sampling (``--sampling per_row``, what the server
compiles since issue 59: one transformed [B, N, V] buffer more per round) or one static
greedy setting (``--sampling static``, the server before it).

Per concurrency c (= live rows, the slot program of c rows): round and AR-step time
(`DecodePlan.seconds`: calibrated where `tev_jax.costs.gpu_time` has a measured table, else the
roofline floor), output tokens/s = c τ / t_round at DDTree's published Qwen3-8B τ for the
budget (`experiments/tpu/run.py`'s ``ddtree_tau``, MATH-500 curve), AR c / t_AR, and the
ratio. Host time (scheduling, HTTP, one dispatch per round) is not in them.

    JAX_PLATFORMS=cpu python experiments/serve/estimates.py            # -> estimates.json
    JAX_PLATFORMS=cpu python experiments/serve/estimates.py --machines v5e-8 --batches 1,8
    JAX_PLATFORMS=cpu python experiments/serve/estimates.py --sampling static
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

MACHINES = {"v5e-8": ("v5e:2x4", None, 8), "h200x1": (None, "h200x1", 1)}


def _ddtree_tau(budget: int) -> float:
    spec = importlib.util.spec_from_file_location("tpu_run", ROOT / "experiments/tpu/run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ddtree_tau("qwen3-8b", budget)[0]


def plan_one(machine: str, batch: int, budget: int, sampling: str) -> dict:
    import jax.numpy as jnp

    from tev_jax.costs import chips, plan
    from tev_jax.decode import DecodeConfig
    from tev_jax.sampling import PER_ROW, Sampling

    topology, gpu, tensor = MACHINES[machine]
    mesh, where = chips.plan_mesh(topology, gpu, 1, 1, tensor)
    cfg = plan.model_config("qwen3-8b")
    config = DecodeConfig(max_new_tokens=256, budget=budget, prompt_len=1024,
                          max_cache_len=2048,
                          sampling=PER_ROW if sampling == "per_row" else Sampling(0.0))
    t0 = time.perf_counter()
    result = plan.plan_decode_programs(cfg, config, batch, dtype=jnp.bfloat16, mesh=mesh,
                                       programs=("ar_step", "round"), chip=where.chip,
                                       devices_per_chip=where.devices_per_chip)
    return {"machine": machine, "batch": batch, "budget": budget, "sampling": sampling,
            "round_s": result.seconds("round"), "ar_s": result.seconds("ar_step"),
            "seconds_are": result.seconds_are,
            "peak_gib": max(r.peak_bytes for r in result.programs.values()) / 2**30,
            "compile_s": time.perf_counter() - t0}


def table(rows: list[dict], tau: float) -> str:
    lines = [f"| machine | sampling | c | AR step ms | round ms (b {rows[0]['budget']}) | "
             f"AR tokens/s | tree tokens/s at τ {tau:.2f} | ratio | GiB / device | times are |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        ar, tree = r["batch"] / r["ar_s"], r["batch"] * tau / r["round_s"]
        lines.append(f"| {r['machine']} | {r.get('sampling', 'static')} | {r['batch']} | "
                     f"{r['ar_s'] * 1e3:.2f} | "
                     f"{r['round_s'] * 1e3:.2f} | {ar:,.0f} | {tree:,.0f} | {tree / ar:.2f}x | "
                     f"{r['peak_gib']:.2f} | {r['seconds_are']} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--machines", default=",".join(MACHINES))
    p.add_argument("--batches", default="1,2,4,8,16,32")
    p.add_argument("--budget", type=int, default=32)
    p.add_argument("--sampling", choices=("per_row", "static"), default="per_row",
                   help="the server's per-row settings (default) or one static greedy one")
    p.add_argument("--out", default=str(HERE / "estimates.json"))
    args = p.parse_args()
    out = Path(args.out)
    done = json.loads(out.read_text()) if out.is_file() else {"rows": []}
    have = {(r["machine"], r["batch"], r["budget"], r.get("sampling", "static"))
            for r in done["rows"]}
    for machine in args.machines.split(","):
        for batch in map(int, args.batches.split(",")):
            if (machine, batch, args.budget, args.sampling) in have:
                continue
            try:
                row = plan_one(machine, batch, args.budget, args.sampling)
            except (ImportError, RuntimeError, ValueError) as e:
                print(f"{machine} B {batch}: not compiled ({type(e).__name__}: {e})",
                      file=sys.stderr)
                continue
            print(json.dumps(row), file=sys.stderr, flush=True)
            done["rows"].append(row)
            out.write_text(json.dumps(done, indent=1) + "\n")  # resumable
    tau = _ddtree_tau(args.budget)
    done["tau"] = tau
    out.write_text(json.dumps(done, indent=1) + "\n")
    rows = sorted((r for r in done["rows"] if r["budget"] == args.budget),
                  key=lambda r: (r["machine"], r.get("sampling", "static"), r["batch"]))
    print(table(rows, tau))
    return 0


if __name__ == "__main__":
    sys.exit(main())
