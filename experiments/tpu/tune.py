"""The best DDTree budget per batch size for Qwen3-8B on v5e-8 and v6e-8 (issue 24).

τ(b): DDTree's published curve for Qwen3-8B on MATH-500 at T = 0 (the only per-budget
curve the DDTree authors publish: the node-budget figure of their project page,
`math500-budget-tradeoff.pdf`, read from its vector paths; its b = 512 point, 10.73, is
the MATH-500 / Qwen3-8B / T = 0 entry of their Table 1). Round costs t(b, B): the TPU
compiler's roofline (max(FLOPs / peak, bytes / bandwidth), `tev_jax.costs.chips.CHIPS`) of
one speculative round (1-layer DFlash drafter, block 16, DDTree, TEV) and of one AR step,
bfloat16, prompt buffer 1024, 256 new tokens, the cache each program gets (P + M + N),
tensor-parallel over the 8 chips, compiled at full depth as in `run.py` (one round's HBM
bytes from the per-op table; until session 35 extrapolated from 1- and 2-layer
compiles, by the compiler's bytes accessed). The grid is compiled at B 1 and 64 and budgets 16, 64, 256, 1024 (and AR), and the rest is
interpolated linearly: in the tree slots N = b + 1 between compiled budgets, and in B
between compiled batch sizes (rows are independent: FLOPs and per-row bytes grow
linearly with B and N, the weights do not); a few extra compiles check both steps.
Where B 64 does not compile, B 16 and 32 are compiled. A program whose full-depth peak
exceeds the chip's HBM (or that the compiler refuses) is not a choice. Per
B the budget that maximises B · τ(b) / t(b, B), AR included
(`tev_jax.costs.round_costs.best_budgets`).

    JAX_PLATFORMS=cpu python experiments/tpu/tune.py            # compiles what is missing
    python experiments/tpu/tune.py --report                     # the tables -> tune.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import DDTREE_MATH500 as DDTREE_TAU  # noqa: E402
from run import decode_program  # noqa: E402

from tev_jax.costs import chips as topology  # noqa: E402
from tev_jax.costs.round_costs import best_budgets  # noqa: E402

MODEL = "qwen3-8b"
SLICES = {"v5e": "v5e:2x4", "v6e": "v6e:2x4"}
BATCHES = (1, 2, 4, 8, 16, 32, 64)
COMPILED = {"v5e": (1, 64), "v6e": (1, 64)}  # batch sizes; the rest interpolated
BUDGETS = (0, 16, 64, 256, 1024)  # compiled budgets (0: AR); the rest interpolated
CHECKS = [("v5e", 8, 0), ("v5e", 8, 64)]  # compiled, to check the interpolation in B
FILL_IN = (16, 32)  # compiled where B 64 does not compile
LINEAR = ("flops", "bytes_accessed", "peak_bytes")
# DDTree, Qwen3-8B, MATH-500, T = 0: τ per node budget is run.DDTREE_MATH500; its speed-up:
DDTREE_SPEEDUP = {16: 6.09, 32: 6.60, 64: 6.97, 128: 7.33, 256: 7.43, 512: 7.52, 1024: 6.82}
DFLASH_TAU = 7.79  # the same figure's DFlash line (a 16-token chain)


def run(results: dict, out: Path, chips) -> None:
    todo = [(chip, batch, budget) for chip in chips for batch in COMPILED[chip]
            for budget in BUDGETS]
    todo += [c for c in CHECKS if c[0] in chips]
    todo += [(chip, batch, budget) for chip in chips for budget in BUDGETS
             for batch in FILL_IN]
    for chip, batch, budget in todo:
        key = f"{MODEL}/{chip}/B{batch}/b{budget}"
        if key in results:
            continue
        if batch in FILL_IN and "full" in results.get(
                f"{MODEL}/{chip}/B64/b{budget}", {}):
            continue  # interpolated between B 8 or 1 and B 64
        t0 = time.perf_counter()
        entry = {"chip": chip, "batch": batch, "budget": budget}
        try:
            entry["full"] = decode_program(MODEL, chip, "tensor8", batch, budget or None,
                                           cache_len=None)
        except Exception as e:  # the compiler's own words, e.g. RESOURCE_EXHAUSTED
            entry["error"] = str(e).strip().splitlines()[0][:300]
        results[key] = entry
        out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"{key}: {time.perf_counter() - t0:.0f} s"
              + (f" ({entry['error'][:60]})" if "error" in entry else ""), flush=True)


def _between(x: float, lo: float, hi: float, a: dict, b: dict) -> dict:
    w = (x - lo) / (hi - lo)
    return {k: a[k] + w * (b[k] - a[k]) for k in LINEAR}


def full_depth(results: dict, chip: str, batch: int, budget: int) -> tuple[dict | None, str]:
    """The full-depth figures of one program: compiled, else interpolated linearly in the
    tree slots N = b + 1 between the nearest compiled budgets, else linearly in B between
    the nearest compiled batch sizes; (None, why) where neither is possible."""
    at = lambda bs, b: results.get(f"{MODEL}/{chip}/B{bs}/b{b}")
    entry = at(batch, budget)
    if entry is not None:
        return entry.get("full"), "compiled" if "full" in entry else "does not compile"
    if budget not in BUDGETS:
        lo = max(b for b in BUDGETS if b < budget)
        hi = min(b for b in BUDGETS if b > budget)
        (a, _), (b, _) = (full_depth(results, chip, batch, x) for x in (lo, hi))
        if a is None or b is None:
            return None, "not compiled"
        return _between(budget + 1, lo + 1, hi + 1, a, b), f"interpolated in b ({lo}, {hi})"
    have = sorted(bs for bs in BATCHES if (at(bs, budget) or {}).get("full") is not None)
    lo = [bs for bs in have if bs < batch]
    hi = [bs for bs in have if bs > batch]
    if not lo or not hi:
        return None, "not compiled"
    a, b = at(lo[-1], budget)["full"], at(hi[0], budget)["full"]
    return _between(batch, lo[-1], hi[0], a, b), f"interpolated in B ({lo[-1]}, {hi[0]})"


def seconds(f: dict | None, chip: str) -> float | None:
    """Roofline seconds of full-depth figures that fit the chip's HBM, else None."""
    c = topology.CHIPS[chip]
    if f is None or f["peak_bytes"] > c.hbm_bytes:
        return None
    return max(f["flops"] / c.peak_flops, f["bytes_accessed"] / c.hbm_bandwidth)


def interpolation_checks(results: dict) -> str:
    """Programs compiled beyond the grid against their interpolation (roofline time)."""
    get = lambda bs, b: (results.get(f"{MODEL}/v5e/B{bs}/b{b}") or {}).get("full")
    rows = []
    for _, batch, budget in CHECKS:  # in B, from B 1 and 64
        real, a, b = get(batch, budget), get(1, budget), get(64, budget)
        if None not in (real, a, b):
            guess = seconds(_between(batch, 1, 64, a, b), "v5e")
            rows.append(f"B {batch}, {'AR' if budget == 0 else f'b {budget}'} from B 1 and "
                        f"64: {guess / seconds(real, 'v5e') - 1:+.1%}")
    for budget, lo, hi in ((32, 16, 64), (128, 64, 256)):  # in b, at B 1
        real, a, b = get(1, budget), get(1, lo), get(1, hi)
        if None not in (real, a, b):
            guess = seconds(_between(budget + 1, lo + 1, hi + 1, a, b), "v5e")
            rows.append(f"B 1, b {budget} from b {lo} and {hi}: "
                        f"{guess / seconds(real, 'v5e') - 1:+.1%}")
    return ("Interpolation checks on v5e (programs compiled anyway, roofline time of the "
            "interpolation vs the compiled program): " + "; ".join(rows)) if rows else ""


def tables(results: dict) -> str:
    parts = []
    for chip in SLICES:
        cost, ar, how = {}, {}, {}
        for batch in BATCHES:
            row = {}
            for budget in (0, *DDTREE_TAU):
                f, how[batch, budget] = full_depth(results, chip, batch, budget)
                t = seconds(f, chip)
                if t is None:
                    continue
                if budget == 0:
                    ar[batch] = t
                else:
                    row[budget] = t
            if batch in ar:
                cost[batch] = row
        if not cost:
            continue
        best = best_budgets(DDTREE_TAU, cost, ar)
        c = topology.CHIPS[chip]
        head = ("| B | AR ms | " + " | ".join(f"b {b}" for b in DDTREE_TAU)
                + " | best | est. speed-up | tokens/s |")
        lines = [f"**{SLICES[chip]}** ({c.peak_flops / 1e12:.0f} TFLOP/s, "
                 f"{c.hbm_bandwidth / 1e9:.0f} GB/s, {c.hbm_bytes / 1e9:.0f} GB per chip): "
                 "estimated speed-up over AR at each budget (round ms); – = does not fit "
                 "the chip's HBM or does not compile; compiled: B "
                 + ", ".join(str(b) for b in BATCHES if how[b, 0] == "compiled")
                 + " at b " + ", ".join(str(b) for b in BUDGETS[1:])
                 + " and AR, the others interpolated\n", head,
                 "|" + "---|" * (head.count("|") - 1)]
        for batch in sorted(cost):
            cells = []
            for b in DDTREE_TAU:
                t = cost[batch].get(b)
                cells.append("–" if t is None else
                             f"{DDTREE_TAU[b] * ar[batch] / t:.2f}× ({t * 1e3:.2f})")
            pick = best[batch]
            what = "AR" if pick["budget"] == 0 else str(pick["budget"])
            lines.append(f"| {batch} | {ar[batch] * 1e3:.2f} | " + " | ".join(cells)
                         + f" | **{what}** | {pick['speedup']:.2f}× | "
                           f"{pick['tokens_per_second']:.0f} |")
        parts.append("\n".join(lines))
    check = interpolation_checks(results)
    return "\n\n".join(parts + ([check] if check else []))


BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "tune_results.json"))
    ap.add_argument("--chips", nargs="+", default=list(SLICES), choices=list(SLICES))
    ap.add_argument("--report", action="store_true", help="print the tables only")
    args = ap.parse_args(argv)
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    if not args.report:
        run(results, out, args.chips)
    text = tables(results)
    print(text)
    doc = HERE / "tune.md"
    if doc.exists() and Path(args.out) == HERE / "tune_results.json":
        head, rest = doc.read_text().split(BEGIN, 1)
        doc.write_text(f"{head}{BEGIN}\n{text}\n{END}{rest.split(END, 1)[1]}")
        print(f"updated {doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
