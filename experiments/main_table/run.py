"""Main table (paper Table 1): τ and speed-up over AR of DDTree vs ExitTrain + TEV, B = 64.

Per evaluation set (dialogue, code, math, competition math) and on average, at T = 0 and
T = 1: plain autoregressive decoding of the target (AR), DDTree (the DFlash drafter
``dflash`` + predraw-and-follow) and ExitTrain + TEV (the exit-weighted fine-tune
``ft_exit`` + Tree Exit Verification), all with DDTree's best-first builder at budget
B = 64, batch 1, timed in one process (definitions of τ and SR: experiments/paper_common.py).

    python experiments/main_table/run.py             # runs/ (python -m train.demo.build), else the bundled models -> results.json + README
    python experiments/main_table/run.py --quick     # 2 prompts per set, 32 tokens -> results_quick.json
    python experiments/main_table/run.py --random-models --quick   # smoke run without models
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


def tables(records, setup, budget) -> str:
    methods = [pc.AR, pc.ddtree_method(budget), pc.exittrain_method(budget)]
    labels = [m.label for m in methods]
    parts = []
    for temp in setup.temperatures:
        parts.append(f"**T = {temp:g}** (τ: mean accepted tokens + 1 per verify round; "
                     "SR: tokens/s over AR)\n")
        parts.append(pc.per_set_table(records, labels, temp, ("tau", "sr"), setup.sets,
                                      ratio_rows=[(labels[2], labels[1])],
                                      delta_rows=[(labels[2], labels[1])]))
        parts.append("")
    return "\n".join(parts)


def main():
    ap = pc.study_parser(__doc__)
    ap.add_argument("--budget", type=int, default=64)
    args = ap.parse_args()
    started = time.time()
    pc.enable_compile_cache(args)
    setup = pc.setup_from_args(args)
    models = pc.models_from_args(args, ("dflash", "ft_exit"))
    prompts = pc.eval_prompts(models.tokenizer, setup)
    methods = [pc.AR, pc.ddtree_method(args.budget), pc.exittrain_method(args.budget)]
    records = pc.timed_runs(models, methods, prompts, setup)
    table = pc.setup_line(setup, models) + "\n\n" + tables(records, setup, args.budget)
    pc.write_outputs(HERE, args, setup, models, dict(budget=args.budget, records=records),
                     table, started)


if __name__ == "__main__":
    main()
