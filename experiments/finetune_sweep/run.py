"""Fine-tune sweep: which weighting, λ and learning rate make ExitTrain beat DDTree here.

Every variant fine-tunes the shipped DFlash drafter (``runs/drafters/dflash``) on the
same rollouts, in the same data order and with the same number of updates as the demo
fine-tunes (`train.demo.build`), changing only what its row says; then the coverage
study (``experiments/coverage``) measures each one's exact expected block length 1 + C
on the evaluation sets against ``dflash``. A finished variant is not retrained.

    python experiments/finetune_sweep/run.py                  # all variants -> runs/sweep
    python experiments/finetune_sweep/run.py --only exit_lr1e-3 token_lr1e-3
    python experiments/finetune_sweep/run.py --set budget=256 --only exit --out runs/sweep256
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))

from tev_jax.runtime.platforms import quiet_start  # noqa: E402

if __name__ == "__main__":
    quiet_start()  # before jax is imported: no libtpu or CUDA plugin lines on a CPU

from train.demo import build as demo_models  # noqa: E402
from train.__main__ import main as train_main  # noqa: E402

# name -> flags of `python -m train run` that differ from the demo fine-tunes
VARIANTS: dict[str, dict[str, str]] = {
    "exit": dict(loss="exit"),  # = the demo's ft_exit (with --set: at other settings)
    "token_lr1e-3": dict(loss="token", lr="1e-3"),
    "exit_lr1e-3": dict(loss="exit", lr="1e-3"),
    "prefix_lr1e-3": dict(loss="prefix", lr="1e-3"),
    "exit_lambda4": dict(loss="exit", exit_lambda="4"),
    "exit_lambda0.25": dict(loss="exit", exit_lambda="0.25"),
    "exit_T0": dict(loss="exit", temperature="0"),
}


# the reference drafters of the demo (runs/drafters): the DFlash starting point and the
# token-only fine-tune (its objective does not depend on the budget or λ)
REFERENCES = ("dflash", "ft_token")


def finetune(name: str, flags: dict[str, str], plan: demo_models.DemoPlan, runs: Path,
             out_root: Path) -> None:
    out = out_root / name
    if (out / "drafter" / "config.json").exists():
        print(f"[sweep] {name}: done")
        return
    args = demo_models.drafter_args(plan, runs, "ft_token")
    for k, v in {"out_dir": str(out), **flags}.items():  # replace the flag's value
        flag = "--" + k.replace("_", "-")
        if flag in args:
            args[args.index(flag) + 1] = v
        else:
            args += [flag, v]
    print(f"[sweep] {name}: python -m train {' '.join(args)}", flush=True)
    if train_main(args):
        raise SystemExit(f"fine-tune {name} failed")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=str(REPO / "runs"))
    ap.add_argument("--out", default=None, help="variants folder (default RUNS/sweep)")
    ap.add_argument("--only", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="DemoPlan override shared by every variant (e.g. finetune_steps=800)")
    args = ap.parse_args()
    runs = Path(args.runs)
    out_root = Path(args.out) if args.out else runs / "sweep"
    plan = demo_models.plan_with(args.set)
    for name in args.only:
        finetune(name, VARIANTS[name], plan, runs, out_root)
    for name in REFERENCES:  # evaluated next to the variants, trained once
        link = out_root / name
        if not link.exists():
            link.symlink_to((runs / "drafters" / name).resolve())
    tag = "_".join(a.replace("=", "") for a in args.set)
    subprocess.run([sys.executable, str(REPO / "experiments" / "coverage" / "run.py"),
                    "--target", str(runs / "target" / "hf"), "--drafters", str(out_root),
                    "--budget", str(plan.budget), "--names", *REFERENCES, *args.only,
                    "--out", str(HERE / f"results{'_' + tag if tag else ''}.json")],
                   check=True)


if __name__ == "__main__":
    main()
