"""Fixed-tree equivalence (paper App. D.2): drafter {dflash, ft_exit} x verifier {predraw, TEV}.

Both verifiers are exact, so with the same drafter they must give the same τ up to
sampling noise (the paper: at most 0.03 apart); TEV should be the cheaper verify stage.
Three measurements, B = 64:

1. **End to end** (decode, each set's prompts as one batch): τ ± its standard error for
   the four crossings at T = 0 and T = 1, and the difference predraw - TEV per set with
   its standard error (rounds treated as independent). At T = 0 both verifiers follow
   the target's argmax, so their outputs, and τ, are identical.
2. **On fixed trees**: real decode rounds captured at contexts = prompt + the target's
   greedy continuation cut at a few points (`paper_common.capture_trees`). Every tree is
   verified ``--draws`` times by each verifier with independent keys; the mean block
   length of each is compared with the exit law's exact expectation 1 + C of the same
   trees (standard errors from the draws).
3. **Verify-stage latency** on those trees (batch 1, as decode calls it; median over
   repeats, compile excluded): the verifier alone and the verifier + KV-cache commit.

    python experiments/fixed_tree/run.py             # runs/ (python -m train.demo.build), else the bundled models -> results.json + README
    python experiments/fixed_tree/run.py --quick
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tev_jax.runtime.platforms import quiet_start

if __name__ == "__main__":
    quiet_start()  # before jax is imported: no libtpu or CUDA plugin lines on a CPU

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import paper_common as pc  # noqa: E402
from tev_jax.sampling import Sampling  # noqa: E402

DRAFTERS = ("dflash", "ft_exit")
VERIFIERS = ("predraw", "tev")


def end_to_end(records, setup):
    rows = []
    for temp in setup.temperatures:
        for d in DRAFTERS:
            sel = {v: [r for r in records if r["drafter"] == d and r["verifier"] == v
                       and r["temperature"] == temp] for v in VERIFIERS}
            diffs, ses = [], []
            for s in setup.sets:
                a, b = (pc.one(sel[v], set=s) for v in VERIFIERS)
                diffs.append(a["tau"] - b["tau"])
                ses.append(pc.paired_diff_se(a, b))
            k = int(np.argmax(np.abs(diffs)))
            rows.append([f"{temp:g}", d] + [
                f"{pc.set_average(sel[v], 'tau', setup.sets):.3f}" for v in VERIFIERS] + [
                f"{np.mean(diffs):+.3f} ± {np.sqrt(np.sum(np.square(ses))) / len(ses):.3f}",
                f"{diffs[k]:+.3f} ± {ses[k]:.3f} ({pc.SET_LABELS[setup.sets[k]]})"])
    return pc.markdown(["T", "drafter", "avg τ predraw", "avg τ TEV",
                        "Δ avg (predraw - TEV) ± SE", "largest per-set Δ ± SE"], rows)


def fixed_trees(models, contexts, setup, budget, draws, repeats):
    horizon = next(iter(models.drafters.values())).config.block_size - 1
    cache_len = -(-(max(map(len, contexts)) + budget + 1) // 8) * 8
    mc, latency = [], []
    for d in DRAFTERS:
        cap = pc.capture_trees(models, d, contexts, budget)
        for temp in setup.temperatures:
            sampling = Sampling(temperature=temp)
            law = pc.exit_laws(cap, sampling)
            row = dict(drafter=d, temperature=temp, trees=len(contexts), draws=draws,
                       exit_law=float(np.mean(law.expected_length)))
            lengths = {}
            for i, v in enumerate(VERIFIERS):
                lengths[v] = pc.fixed_tree_lengths(cap, sampling, v, horizon, draws,
                                                   seed=setup.seed + i)
                # residual against the tree's own 1 + C: the between-tree spread cancels
                res = lengths[v] - np.asarray(law.expected_length)[:, None]
                row[v] = float(lengths[v].mean())
                row[v + "_minus_law"] = float(res.mean())
                row[v + "_se"] = float(res.std(ddof=1) / np.sqrt(res.size))
            diff = (lengths["predraw"] - lengths["tev"]).astype(np.float64)
            row["diff"] = float(diff.mean())
            row["diff_se"] = float(diff.std(ddof=1) / np.sqrt(diff.size))
            mc.append(row)
            print(f"fixed trees {d} T={temp}: 1+C {row['exit_law']:.4f}  predraw "
                  f"{row['predraw']:.4f}  TEV {row['tev']:.4f}  predraw - TEV "
                  f"{row['diff']:+.4f} ± {row['diff_se']:.4f}", flush=True)
            calls = pc.verifier_stage_calls(cap, sampling, VERIFIERS, horizon, cache_len,
                                            models.target)
            secs = pc.time_round_robin(calls, repeats, seed=setup.seed)
            lat = dict(drafter=d, temperature=temp, budget=budget,
                       median_ms={k: float(np.median(v)) * 1e3 for k, v in secs.items()})
            latency.append(lat)
            print(f"latency {d} T={temp}: " + "  ".join(
                f"{k} {v:.3f} ms" for k, v in lat["median_ms"].items()), flush=True)
    return mc, latency


def tables(records, mc, latency, setup, budget) -> str:
    parts = [f"**1. End to end** (B = {budget}; τ = mean accepted tokens + 1 per verify "
             "round, pooled over each set's rounds; SE of the difference over prompts, "
             "paired by prompt; at T = 0 both verifiers emit the same tokens, so Δ = 0)\n",
             end_to_end(records, setup), ""]
    parts.append(f"**2. On fixed trees** ({mc[0]['trees']} real trees per drafter, "
                 f"{mc[0]['draws']} verifications of each per verifier, independent keys; "
                 "1 + C = the exit law's exact expectation of the block length, averaged over "
                 "the trees; '- (1+C)' = mean of (block length - that tree's 1 + C); "
                 "± = standard error over the draws)\n")
    parts.append(pc.markdown(
        ["T", "drafter", "1 + C", "predraw", "TEV", "predraw - (1+C)", "TEV - (1+C)",
         "predraw - TEV"],
        [[f"{r['temperature']:g}", r["drafter"], f"{r['exit_law']:.4f}", f"{r['predraw']:.4f}",
          f"{r['tev']:.4f}", f"{r['predraw_minus_law']:+.4f} ± {r['predraw_se']:.4f}",
          f"{r['tev_minus_law']:+.4f} ± {r['tev_se']:.4f}",
          f"{r['diff']:+.4f} ± {r['diff_se']:.4f}"] for r in mc]))
    parts.append("")
    parts.append("**3. Verify-stage latency** on the same trees (batch 1, median ms; "
                 "'+ commit' includes the KV-cache commit of the accepted path)\n")
    rows = []
    for lat in latency:
        m = lat["median_ms"]
        rows.append([f"{lat['temperature']:g}", lat["drafter"], m["predraw"], m["tev"],
                     f"{m['tev'] / m['predraw']:.3f}", m["predraw+commit"], m["tev+commit"],
                     f"{m['tev+commit'] / m['predraw+commit']:.3f}"])
    parts.append(pc.markdown(["T", "drafter", "predraw ms", "TEV ms", "TEV / predraw",
                              "predraw + commit ms", "TEV + commit ms", "TEV / predraw"],
                             rows))
    return "\n".join(parts)


def main():
    ap = pc.study_parser(__doc__)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--draws", type=int, default=2000,
                    help="verifications of each captured tree per verifier")
    ap.add_argument("--cuts", type=int, nargs="+", default=[0, 16],
                    help="contexts: prompt + this many generated tokens (+ the root)")
    ap.add_argument("--latency-repeats", type=int, default=300)
    args = ap.parse_args()
    started = time.time()
    pc.enable_compile_cache(args)
    setup = pc.setup_from_args(args)
    models = pc.models_from_args(args, DRAFTERS)
    prompts = pc.eval_prompts(models.tokenizer, setup)
    methods = [pc.Method(f"{d} + {v}", d, v, args.budget) for d in DRAFTERS for v in VERIFIERS]
    records = pc.tau_runs(models, methods, prompts, setup)
    draws = 200 if args.quick else args.draws
    repeats = 30 if args.quick else args.latency_repeats
    contexts = pc.continuation_contexts(models, prompts, setup, args.cuts)
    mc, latency = fixed_trees(models, contexts, setup, args.budget, draws, repeats)
    table = (pc.setup_line(setup, models, timed=False) + "\n\n"
             + tables(records, mc, latency, setup, args.budget))
    pc.write_outputs(HERE, args, setup, models,
                     dict(budget=args.budget, records=records, fixed_tree=mc,
                          latency=latency), table, started)


if __name__ == "__main__":
    main()
