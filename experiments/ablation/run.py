"""Ablation (paper Table 2): the fine-tuning objective, at equal compute, B = 64 with TEV.

Drafters (same architecture; the four fine-tunes share the initialisation ``dflash``, the
data and the number of steps): ``ft_token`` (token loss only), ``ft_prefix`` (exit term
weighted by reach P), ``ft_exit`` (weighted by the exit law w: ExitTrain),
``ft_exit_depth`` (w x depth), and ``dflash`` itself for reference. τ per evaluation set
and on average at T = 0 and T = 1; each set's prompts decode as one batch (τ only, no
timing). Each record also holds ``tau_exit_law``: the mean over rounds of the verified
tree's exit-law expectation 1 + coverage (the same quantity as τ, with less variance).

    python experiments/ablation/run.py             # runs/ (python -m train.demo.build), else the bundled models -> results.json + README
    python experiments/ablation/run.py --quick     # 2 prompts per set, 32 tokens
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from tev_jax.runtime.platforms import quiet_start  # noqa: E402

if __name__ == "__main__":
    quiet_start()  # before jax is imported: no libtpu or CUDA plugin lines on a CPU

import paper_common as pc  # noqa: E402

DRAFTERS = ("ft_token", "ft_prefix", "ft_exit", "ft_exit_depth", "dflash")


def tables(records, setup, drafters) -> str:
    parts = ["Drafters: " + "; ".join(f"`{d}` = {pc.DRAFTER_LABELS[d]}" for d in drafters),
             ""]
    ratios = [("ft_exit", d) for d in ("ft_token", "ft_prefix", "dflash") if d in drafters
              and "ft_exit" in drafters]
    for temp in setup.temperatures:
        parts.append(f"**T = {temp:g}**: τ (mean accepted tokens + 1 per verify round), "
                     "TEV, B = " + str(records[0]["budget"]) + "\n")
        parts.append(pc.per_set_table(records, drafters, temp, ("tau",), setup.sets,
                                      key="drafter", ratio_rows=ratios, delta_rows=ratios))
        rows = []
        for d in drafters:
            sel = [r for r in records if r["drafter"] == d and r["temperature"] == temp]
            rows.append([d, pc.set_average(sel, "tau", setup.sets),
                         max(r["tau_se"] for r in sel),
                         pc.set_average(sel, "tau_exit_law", setup.sets)])
        parts.append("")
        parts.append(pc.markdown(["drafter", "avg τ", "largest per-set SE of τ (over prompts)",
                                  "avg 1+C (exit law)"], rows))
        parts.append("")
    return "\n".join(parts)


def main():
    ap = pc.study_parser(__doc__)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--drafter-names", nargs="+", default=list(DRAFTERS),
                    choices=list(pc.DRAFTER_NAMES))
    args = ap.parse_args()
    started = time.time()
    pc.enable_compile_cache(args)
    setup = pc.setup_from_args(args)
    drafters = tuple(args.drafter_names)
    models = pc.models_from_args(args, drafters)
    prompts = pc.eval_prompts(models.tokenizer, setup)
    methods = [pc.Method(d, d, "tev", args.budget) for d in drafters]
    records = pc.tau_runs(models, methods, prompts, setup)
    table = pc.setup_line(setup, models, timed=False) + "\n\n" + tables(records, setup, drafters)
    pc.write_outputs(HERE, args, setup, models, dict(budget=args.budget, records=records),
                     table, started)


if __name__ == "__main__":
    main()
