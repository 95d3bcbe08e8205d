"""Exact expected block length 1 + C of each drafter's DDTree on the evaluation sets.

The end-to-end τ of the main table and the ablation is a sample mean over a few hundred
rounds of eight generations per set, so two drafters 5 % apart are hard to tell from
noise. This study removes the sampling: at many contexts (each evaluation prompt + the
target's own continuation at T, cut at ``--cuts`` points) it builds each drafter's tree as
a decode round would (`paper_common.capture_trees`) and computes the canonical exit
law's expected output-block length 1 + C of that tree, exactly, at T = 0 and T = 1.
Every exact verifier (TEV, predraw, sequential residual) has this expectation on the
tree, so 1 + C is the τ a decode round at that context would have on average.

A decode round starts at a position with probability about 1 / τ there (easy stretches
are crossed in few long rounds), so the tokens per round of a decode are about the
harmonic mean of 1 + C over positions: τ̂. Reported per drafter: τ̂ per set and on
average (sets weighted equally), the plain mean of 1 + C, and both as ratios to a
reference drafter (default ``dflash``) on the same contexts, with standard errors
(delta method, prompts as clusters: the cuts of one prompt are correlated).

    python experiments/coverage/run.py                       # runs/drafters -> results.json + README
    python experiments/coverage/run.py --names dflash ft_exit --drafters runs/sweep --out /tmp/c.json
    python experiments/coverage/run.py --random-models --quick
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


def by_depth(tree, law) -> dict[str, list[float]]:
    """Mean over the trees of the node count and the exit mass at each depth 0..H."""
    depth = np.where(tree.valid, tree.depths, -1)
    levels = np.arange(depth.max() + 1)[:, None, None]
    at = depth[None] == levels  # [H + 1, C, N]
    return dict(nodes_by_depth=at.sum(-1).mean(-1).tolist(),
                exit_by_depth=(at * np.asarray(law.w)[None]).sum(-1).mean(-1).tolist())


def coverage(models, prompts, setup, cuts, budget, names):
    """Records: one per (drafter, T, set) with the per-context 1 + C and its prompt ids.

    The contexts for temperature T continue each prompt with the target's own sample at
    T (its greedy continuation at T = 0), as the decoded texts would.
    """
    records = []
    for temp in setup.temperatures:
        sampling = Sampling(temperature=temp)
        conts = pc.target_continuations(models, prompts, setup, temp)
        for set_name, ps in prompts.items():
            pairs = [(i, list(p) + cont[: k + 1]) for i, (p, cont) in
                     enumerate(zip(ps, conts[set_name])) for k in cuts if k + 1 <= len(cont)]
            owner, contexts = [i for i, _ in pairs], [c for _, c in pairs]
            for name in names:
                cap = pc.capture_trees(models, name, contexts, budget)
                law = pc.exit_laws(cap, sampling)
                values = np.asarray(law.expected_length, np.float64)
                records.append(dict(drafter=name, temperature=temp, set=set_name,
                                    budget=budget, contexts=len(contexts),
                                    mean=float(values.mean()), values=values.tolist(),
                                    prompt=owner, **by_depth(cap.tree, law)))
                print(f"T={temp:g} {set_name:9s} {name:16s} 1+C {values.mean():.4f} "
                      f"({len(contexts)} contexts)", flush=True)
    return records


def per_prompt(rec, harmonic: bool) -> np.ndarray:
    """Per-prompt sums of 1 + C (of 1 / (1 + C) for the harmonic mean)."""
    values = np.asarray(rec["values"])
    return np.bincount(rec["prompt"], weights=1.0 / values if harmonic else values)


def set_mean(rec, harmonic: bool) -> float:
    values = np.asarray(rec["values"])
    return float(1.0 / np.mean(1.0 / values) if harmonic else values.mean())


def avg_ratio(recs, refs, harmonic: bool) -> tuple[float, float]:
    """(average over sets of the drafter's mean) / (that of the reference), and its
    standard error: per set a paired ratio with prompts as clusters (delta method),
    combined over the sets as independent."""
    num = [per_prompt(r, harmonic) for r in recs]
    den = [per_prompt(q, harmonic) for q in refs]
    if harmonic:  # a ratio of harmonic means is the inverse ratio of the inverse sums
        num, den = den, num
    ref_means = np.asarray([set_mean(q, harmonic) for q in refs])
    ratio = np.mean([set_mean(r, harmonic) for r in recs]) / ref_means.mean()
    set_se = np.asarray([pc.ratio_se(n, d) for n, d in zip(num, den)])
    return float(ratio), float(np.sqrt(np.sum((ref_means * set_se) ** 2)) / ref_means.sum())


def tables(records, setup, names, reference) -> str:
    parts = []
    for temp in setup.temperatures:
        header = (["drafter"] + [f"{pc.SET_LABELS[s]} τ̂" for s in setup.sets]
                  + ["avg τ̂", f"τ̂ / {reference} ± SE", "avg 1+C", f"1+C / {reference} ± SE"])
        rows = []
        for name in names:
            recs = [pc.one(records, drafter=name, temperature=temp, set=s) for s in setup.sets]
            refs = [pc.one(records, drafter=reference, temperature=temp, set=s)
                    for s in setup.sets]
            row = [pc.DRAFTER_LABELS.get(name, name)]
            row += [f"{set_mean(r, True):.3f}" for r in recs]
            for harmonic in (True, False):
                ratio, se = avg_ratio(recs, refs, harmonic)
                row += [f"{np.mean([set_mean(r, harmonic) for r in recs]):.3f}",
                        f"{ratio:.3f} ± {se:.3f}"]
            rows.append(row)
        contexts = sum(pc.one(records, drafter=reference, temperature=temp, set=s)["contexts"]
                       for s in setup.sets)
        parts += [f"**T = {temp:g}** ({contexts} contexts; τ̂: harmonic mean of the exact "
                  "1 + C over a set's contexts, the expected tokens per decode round; "
                  "1+C: its plain mean)\n", pc.markdown(header, rows), "",
                  f"Where the trees put their nodes and where the target mass leaves them "
                  f"(T = {temp:g}, mean per tree over all contexts):\n",
                  depth_table(records, temp, names), ""]
    return "\n".join(parts)


def depth_table(records, temp, names, deepest: int = 3) -> str:
    """Nodes per depth 1, 2, .., >= deepest and exit mass at the root, 1, .., >= deepest."""
    def pooled(recs, field):
        width = max(deepest + 1, *(len(r[field]) for r in recs))
        total = sum(np.pad(r[field], (0, width - len(r[field]))) * r["contexts"] for r in recs)
        mean = total / sum(r["contexts"] for r in recs)
        return list(mean[:deepest]) + [mean[deepest:].sum()]

    labels = [str(d) for d in range(1, deepest)] + [f"≥{deepest}"]
    header = (["drafter"] + [f"nodes d={x}" for x in labels]
              + ["exit at root"] + [f"exit d={x}" for x in labels])
    rows = []
    for name in names:
        recs = pc.select(records, drafter=name, temperature=temp)
        nodes, exits = pooled(recs, "nodes_by_depth"), pooled(recs, "exit_by_depth")
        rows.append([pc.DRAFTER_LABELS.get(name, name)] + [f"{x:.1f}" for x in nodes[1:]]
                    + [f"{x:.3f}" for x in exits])
    return pc.markdown(header, rows)


def main():
    ap = pc.study_parser(__doc__, prompts=16, max_new_tokens=64)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--names", nargs="+", default=list(pc.DRAFTER_NAMES),
                    help="drafters <drafters>/<name>/drafter to compare")
    ap.add_argument("--reference", default="dflash", help="the ratio column's denominator")
    ap.add_argument("--cuts", type=int, nargs="+", default=[0, 8, 16, 24, 32, 48],
                    help="contexts: prompt + this many generated tokens (+ the root)")
    args = ap.parse_args()
    if args.reference not in args.names:
        ap.error(f"--reference {args.reference!r} must be one of --names")
    if max(args.cuts) + 1 > args.max_new_tokens:
        ap.error("every cut must be < --max-new-tokens")
    started = time.time()
    pc.enable_compile_cache(args)
    setup = pc.setup_from_args(args)
    cuts = [c for c in args.cuts if c + 1 <= setup.max_new_tokens]
    models = pc.models_from_args(args, args.names)
    prompts = pc.eval_prompts(models.tokenizer, setup)
    records = coverage(models, prompts, setup, cuts, args.budget, args.names)
    table = (pc.setup_line(setup, models, timed=False) + f"; cuts {cuts}, B = {args.budget}"
             + "\n\n" + tables(records, setup, args.names, args.reference))
    pc.write_outputs(HERE, args, setup, models,
                     dict(budget=args.budget, cuts=cuts, names=args.names,
                          reference=args.reference, records=records), table, started)


if __name__ == "__main__":
    main()
