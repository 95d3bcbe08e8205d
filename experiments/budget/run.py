"""Budget robustness (paper Table 5): B ∈ {32, 64, 128} with the drafters trained at B = 64.

DDTree (``dflash`` + predraw) and ExitTrain + TEV (``ft_exit`` + TEV, fine-tuned at
budget 64 and not retrained) at each tree budget: τ and speed-up over AR, batch 1, timed
in one process, per evaluation set and averaged over the sets, at T = 0 and T = 1
(definitions in experiments/paper_common.py). Figure: experiments/figures/run.py.

    python experiments/budget/run.py             # runs/ (python -m train.demo.build), else the bundled models -> results.json + README
    python experiments/budget/run.py --quick
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


def tables(records, setup, budgets) -> str:
    base, ours = pc.ddtree_method().label, pc.exittrain_method().label
    rows = []
    for temp in setup.temperatures:
        for b in budgets:
            v = {(m, f): pc.set_average(records, f, setup.sets, method=m, budget=b,
                                        temperature=temp)
                 for m in (base, ours) for f in ("tau", "sr")}
            rows.append([f"{temp:g}", b, v[base, "tau"], v[base, "sr"], v[ours, "tau"],
                         v[ours, "sr"], f"{v[ours, 'tau'] / v[base, 'tau']:.3f}x",
                         f"{v[ours, 'sr'] / v[base, 'sr']:.3f}x"])
    head = ["T", "B", f"{base} τ", f"{base} SR", f"{ours} τ", f"{ours} SR", "τ ratio",
            "SR ratio"]
    return ("Averages over the sets (per-set values in results.json)\n\n"
            + pc.markdown(head, rows))


def main():
    ap = pc.study_parser(__doc__, prompts=6, max_new_tokens=64)
    ap.add_argument("--budgets", type=int, nargs="+", default=[32, 64, 128])
    args = ap.parse_args()
    started = time.time()
    pc.enable_compile_cache(args)
    setup = pc.setup_from_args(args)
    models = pc.models_from_args(args, ("dflash", "ft_exit"))
    prompts = pc.eval_prompts(models.tokenizer, setup)
    methods = [pc.AR] + [m for b in args.budgets
                         for m in (pc.ddtree_method(b), pc.exittrain_method(b))]
    records = pc.timed_runs(models, methods, prompts, setup)
    table = pc.setup_line(setup, models) + "\n\n" + tables(records, setup, args.budgets)
    pc.write_outputs(HERE, args, setup, models, dict(budgets=args.budgets, records=records),
                     table, started)


if __name__ == "__main__":
    main()
