"""ExitTrain recipe sweep: the authors' recipe and its neighbours, from one DFlash drafter.

Every variant fine-tunes the same token-trained DFlash drafter (``runs/drafters/dflash``)
on the same rollouts, in the same data order, with the same updates and optimiser
(`BASE`), changing only the exit objective: normaliser (total weight or tree-node
count), node weighting (exit, exit_depth, prefix, reach), λ, and the edge floor α; the
token-only continuation (``token``) gets the same updates. Then the coverage study's
machinery (``experiments/coverage``: the exact expected block length 1 + C of each
drafter's DDTree, τ̂ its harmonic mean, paired standard errors with prompts as clusters)
measures every drafter at T = 0 and T = 1, budgets 32 and 64, on validation prompts
(used to choose) and on test prompts (reported; the evaluation selection of the other
studies). The two prompt splits are disjoint, and no evaluation prompt is trained on.

    python experiments/exit_recipe/run.py --target tev_jax/data/models/target
                                                  # SUBSET -> runs/exit_recipe, results.json
    python experiments/exit_recipe/run.py --variants grid ...  # the full grid (33 fine-tunes)
    python experiments/exit_recipe/run.py --variants paper token --jobs 2 ...
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tev_jax.runtime.platforms import quiet_start

if __name__ == "__main__":
    quiet_start()  # before jax is imported: no libtpu or CUDA plugin lines on a CPU

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))

import paper_common as pc  # noqa: E402

_spec = importlib.util.spec_from_file_location("coverage_study",
                                               HERE.parent / "coverage" / "run.py")
cov = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cov)

# `python -m train run` flags shared by every fine-tune: equal updates, data and optimiser
# (the authors' lr, budget 32 trees; batch and anchors of the demo fine-tunes).
BASE = dict(batch_size="4", num_anchors="8", budget="32", steps="400", lr="1e-4",
            warmup_steps="20", end_lr_ratio="0.1", temperature="1.0", tree_metrics="true",
            checkpoint_every="100", seed="0")
NORMALIZERS = ("weight", "nodes")
WEIGHTINGS = ("exit", "exit_depth", "prefix", "reach")
LAMBDAS = ("0.03", "0.1", "0.3", "1")
PAPER_FLOOR = "1e-4"


def variant(normalizer: str, weighting: str, lam: str, floor: str = "0") -> tuple[str, dict]:
    """(name, flags) of one ExitTrain fine-tune."""
    name = f"{normalizer}-{weighting}-l{lam}" + ("" if floor == "0" else f"-a{floor}")
    return name, dict(loss=weighting, exit_normalizer=normalizer, exit_lambda=lam,
                      exit_floor=floor)


def all_variants() -> dict[str, dict]:
    """Every named fine-tune: token-only and the grid (reach with the authors' floor, the
    other weightings without), whose point of the authors' recipe is named 'paper'."""
    paper = variant("nodes", "reach", "0.1", PAPER_FLOOR)
    out = {"token": dict(loss="token")}
    for norm, weighting, lam in itertools.product(NORMALIZERS, WEIGHTINGS, LAMBDAS):
        name, flags = variant(norm, weighting, lam, PAPER_FLOOR if weighting == "reach" else "0")
        out["paper" if name == paper[0] else name] = flags
    return out


VARIANTS = all_variants()
GRID = list(VARIANTS)
# What this session's CPU allowed (README): the paper's recipe, the nodes normaliser at
# two λ, the old objective at a small λ, and the token-only continuation.
SUBSET = ["token", "paper", "nodes-exit-l1", "nodes-exit-l0.3", "weight-exit-l0.03"]
REFERENCES = ("dflash", "token")


def train_args(flags: dict, base: dict, target: str, data_dir: Path, drafter: Path,
               out_dir: Path) -> list[str]:
    """The `python -m train` arguments of one fine-tune of ``drafter`` (its own ``flags``
    over the shared ``base``)."""
    flags = {"target_path": target, "data_dir": str(data_dir), "drafter_path": str(drafter),
             "out_dir": str(out_dir), **base, **flags}
    return ["run", "--no-progress", *pc.flags(flags)]


def finetune_all(variants: dict[str, dict], base: dict, target: str, data_dir: Path,
                 drafter: Path, out_root: Path, jobs: int) -> None:
    """Fine-tunes ``drafter`` once per variant (name -> flags) into ``out_root/<name>``,
    ``jobs`` at a time (a finished one is skipped, an interrupted one resumes from its
    checkpoint); logs in ``out_root/<name>.log``."""
    todo = [n for n in variants if not (out_root / n / "drafter" / "config.json").exists()]
    running: list[tuple[str, subprocess.Popen]] = []
    out_root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    while todo or running:
        while todo and len(running) < jobs:
            name = todo.pop(0)
            cmd = [sys.executable, "-m", "train",
                   *train_args(variants[name], base, target, data_dir, drafter, out_root / name)]
            print(f"[exit_recipe] {name}: {' '.join(cmd[2:])}", flush=True)
            log = open(out_root / f"{name}.log", "w")
            running.append((name, subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log,
                                                   stderr=subprocess.STDOUT)))
        time.sleep(5)
        for name, proc in list(running):
            if proc.poll() is not None:
                running.remove((name, proc))
                if proc.returncode:
                    raise SystemExit(f"fine-tune {name} failed (see {out_root}/{name}.log)")
                print(f"[exit_recipe] {name}: done", flush=True)


def validation_prompts(tokenizer, setup) -> dict[str, list[list[int]]]:
    """Prompts between the test selection's (`paper_common.eval_prompts`): the midpoint
    of every second gap (half as many prompts), so the splits are disjoint and spread
    over each set."""
    out = {}
    for name in setup.sets:
        texts = pc.prompt_set(name)
        test = pc.select_indices(len(texts), setup.prompts_per_set)
        mids = sorted({(a + b) // 2 for a, b in zip(test[::2], test[1::2])} - set(test))
        out[name] = [pc.truncate(tokenizer.encode(texts[i]).ids, setup.prompt_len)
                     for i in mids]
    return out


def split_records(models, splits: dict, setup, cuts, budgets, names, tag: str) -> list[dict]:
    """The coverage records of every drafter on every prompt split and budget."""
    records = []
    for split, prompts in splits.items():
        for budget in budgets:
            print(f"[{tag}] {split} prompts, budget {budget}", flush=True)
            for rec in cov.coverage(models, prompts, setup, cuts, budget, names):
                records.append(dict(rec, split=split))
    return records


def drafter_row(recs, name: str) -> dict:
    """One drafter's τ̂ (harmonic mean of 1 + C, averaged over sets), root-exit share
    and τ̂ ratios to each of `REFERENCES`; ``recs(name)`` gives a drafter's records, one
    per set."""
    row = dict(tau=float(np.mean([cov.set_mean(r, True) for r in recs(name)])),
               root_exit=float(np.average([r["exit_by_depth"][0] for r in recs(name)],
                                          weights=[r["contexts"] for r in recs(name)])))
    for ref in REFERENCES:
        row[f"vs_{ref}"], row[f"se_{ref}"] = cov.avg_ratio(recs(name), recs(ref), True)
    return row


def summary(records, setup, names, budgets) -> dict:
    """{split: {budget: {T: {name: dict(tau, vs_dflash, se_dflash, vs_token, se_token,
    root_exit)}}}} from the coverage records (τ̂: harmonic mean of 1 + C)."""
    out = {}
    for split, budget, temp in itertools.product(("val", "test"), budgets,
                                                  setup.temperatures):
        recs = lambda n: [pc.one(records, split=split, budget=budget, temperature=temp,
                                 drafter=n, set=s) for s in setup.sets]
        cell = {name: drafter_row(recs, name) for name in names}
        out.setdefault(split, {}).setdefault(str(budget), {})[str(temp)] = cell
    return out


def choose(summ: dict, names: list[str]) -> str:
    """The ExitTrain variant with the best mean τ̂ ratio to dflash on the validation
    prompts over all budgets and temperatures."""
    candidates = [n for n in names if n not in REFERENCES]
    score = {n: np.mean([cell[n]["vs_dflash"] for by_t in summ["val"].values()
                         for cell in by_t.values()]) for n in candidates}
    return max(score, key=score.get)


def tables(summ: dict, names: list[str], chosen: str, setup, budgets) -> str:
    parts = []
    for split, title in (("test", "Test prompts (reported)"),
                         ("val", "Validation prompts (used to choose)")):
        header = ["drafter"] + [f"B={b} T={t:g} {what}" for b in budgets
                                for t in setup.temperatures
                                for what in ("τ̂", "/ dflash", "/ token")]
        rows = []
        for name in names:
            row = [name + (" (chosen)" if name == chosen else "")]
            for b in budgets:
                for t in setup.temperatures:
                    c = summ[split][str(b)][str(t)][name]
                    row += [f"{c['tau']:.3f}", f"{c['vs_dflash']:.3f} ± {c['se_dflash']:.3f}",
                            f"{c['vs_token']:.3f} ± {c['se_token']:.3f}"]
            rows.append(row)
        parts += [f"**{title}**\n", pc.markdown(header, rows), ""]
    root = ["drafter"] + [f"root exit B={b} T={t:g}" for b in budgets for t in setup.temperatures]
    parts += ["**Target mass leaving at the root** (test prompts; mean over contexts)\n",
              pc.markdown(root, [[n] + [f"{summ['test'][str(b)][str(t)][n]['root_exit']:.3f}"
                                        for b in budgets for t in setup.temperatures]
                                 for n in names]), ""]
    return "\n".join(parts)


def main():
    ap = pc.study_parser(__doc__, prompts=16, max_new_tokens=64)
    ap.add_argument("--runs", default=str(REPO / "runs"),
                    help="holds rollouts and drafters/dflash (the target: --target)")
    ap.add_argument("--sweep-dir", default=None,
                    help="fine-tunes folder (default RUNS/exit_recipe)")
    ap.add_argument("--variants", nargs="+", default=SUBSET,
                    help=f"fine-tunes to run ('grid': all {len(GRID)}); names: {sorted(VARIANTS)}")
    ap.add_argument("--jobs", type=int, default=2, help="fine-tunes trained at once")
    ap.add_argument("--finetune-steps", default=BASE["steps"],
                    help="updates of every fine-tune (default %(default)s)")
    ap.add_argument("--budgets", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--cuts", type=int, nargs="+", default=[0, 8, 16, 24, 32, 48])
    ap.add_argument("--skip-train", action="store_true", help="evaluate finished fine-tunes")
    args = ap.parse_args()
    names = GRID if args.variants == ["grid"] else args.variants
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")
    if "token" not in names:
        names = ["token", *names]
    started = time.time()
    base = dict(BASE, steps=str(args.finetune_steps))
    runs = Path(args.runs)
    out_root = Path(args.sweep_dir) if args.sweep_dir else runs / "exit_recipe"
    if not args.skip_train:
        finetune_all({n: VARIANTS[n] for n in names}, base, args.target, runs / "rollouts",
                     runs / "drafters" / "dflash" / "drafter", out_root, args.jobs)
    link = out_root / "dflash"
    if not link.exists():
        link.symlink_to((runs / "drafters" / "dflash").resolve())
    pc.enable_compile_cache(args)
    setup = pc.setup_from_args(args)
    cuts = [c for c in args.cuts if c + 1 <= setup.max_new_tokens]
    every = ["dflash", *names]
    models = pc.load_models(args.target, out_root, every)
    splits = {"test": pc.eval_prompts(models.tokenizer, setup),
              "val": validation_prompts(models.tokenizer, setup)}
    records = split_records(models, splits, setup, cuts, args.budgets, every, "exit_recipe")
    summ = summary(records, setup, every, args.budgets)
    chosen = choose(summ, every)
    table = (pc.setup_line(setup, models, timed=False)
             + f"; validation: {setup.prompts_per_set // 2} other prompts per set; cuts {cuts}; "
             f"fine-tunes: {json.dumps(base)}\n\n"
             + tables(summ, every, chosen, setup, args.budgets))
    pc.write_outputs(HERE, args, setup, models,
                     dict(base=base, variants={n: VARIANTS[n] for n in names}, cuts=cuts,
                          budgets=args.budgets, chosen=chosen, summary=summ,
                          records=records), table, started)


if __name__ == "__main__":
    main()
