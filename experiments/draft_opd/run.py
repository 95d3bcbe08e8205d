"""Which drafter training raises acceptance: continued token-only, ExitTrain, Draft-OPD.

Issue 45. From one token-trained DFlash drafter in the ``../exit_strength`` regime (the
bundled target on greedy GSM rollouts, a 1-layer drafter trained from scratch with the
token objective), the same number of optimiser updates with the same learning-rate
schedule, batch (sequences x anchors) and seed with each objective:

- ``token``: continued token-only fine-tuning (``--objective token``);
- ``exittrain``: the authors' ExitTrain recipe (``../exit_strength``'s ``paper``:
  reach weights, floor 1e-4, λ 0.1 over nodes, their 64-token scoring window);
- ``opd``: Draft-OPD (``--objective opd``): the drafter decodes training prompts with
  the target (DDTree budget 32, T 0, the authors' rollout temperature) and trains on
  its own rounds, refreshed every ``--opd-steps`` updates;
- ``opd-exittrain`` (optional, ``--arms``): OPD for the first half of the updates, then
  ExitTrain for the second half, from the OPD half's drafter (the schedule restarts:
  the two halves each have the matched schedule of half the updates).

Every arm runs for each ``--seeds`` (the fine-tune's batch order; OPD's rollout
prompts and keys follow the seed too) and keeps a drafter snapshot every
``--snapshot-every`` updates. Evaluation is ``../exit_strength``'s: the coverage study's
exact expected block length 1 + C of each drafter's own DDTree (TEV and predraw are
exact, so τ̂, the harmonic mean of 1 + C over contexts, is the tokens per round of
DDTree (token-only decoding) and of TEV alike) on held-out ``gsm`` evaluation prompts
(``gsm_eval``: other problems than the training questions), at T 0 and 1, budgets 32
and 64. Per seed, each arm's τ̂ is divided by token-only's on the same contexts; the
table gives the mean over seeds ± the paired standard error (over seeds) and the
context-clustered SE of the per-seed ratio (mean over seeds); the figure shows τ̂
(B 64, T 0) against updates.

Every stage is skipped when its output exists (a killed run resumes: the rollouts by
shard, the trainings from their checkpoints, the evaluation from its cache file).

    python experiments/draft_opd/run.py --target tev_jax/data/models/target
"""

from __future__ import annotations

import dataclasses
import json
import os
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


strength = pc.load_study("exit_strength")
cov = strength.cov

# The fine-tunes' shared flags: exit_strength's (batch 4 x 8 anchors, lr 1e-4, warmup 20,
# cosine to 0.1, the authors' partial blocks); steps and seed are set per run.
SHARED = {k: v for k, v in strength.FINETUNE.items() if k not in ("steps", "seed")}
ARMS = {
    "token": dict(objective="token"),
    "exittrain": dict(strength.VARIANTS["paper"], objective="exittrain"),
    "opd": dict(objective="opd", opd_rollout_batch="8", opd_temperature="0",
                opd_builder="ddtree", opd_verifier="tev"),
}
ARMS["opd-exittrain"] = ARMS["exittrain"]      # its second half (the first is 'opd')
# A diagnostic outside the matched comparison: OPD at the authors' learning rate.
ARMS["opd-lr1e-5"] = dict(ARMS["opd"], lr="1e-5")
REFERENCE = "token"


def run_train(argv: list[str], log: Path) -> None:
    pc.run_train(argv, log, "draft_opd")


def arm_flags(arm: str, args, steps: int, seed: int) -> dict:
    flags = dict(SHARED, **ARMS[arm], steps=steps, seed=seed,
                 drafter_every=args.snapshot_every, checkpoint_every=args.snapshot_every)
    flags["warmup_steps"] = min(int(SHARED["warmup_steps"]), steps)   # pilot runs
    if ARMS[arm]["objective"] == "opd":
        flags.update(opd_steps=args.opd_steps, opd_prompts=args.opd_prompts,
                     opd_max_new_tokens=args.opd_max_new_tokens)
    return flags


def run_dir(runs: Path, arm: str, seed: int) -> Path:
    return runs / "arms" / f"{arm}-s{seed}"


def train_arms(args, runs: Path, rollouts: Path, base: Path) -> None:
    """Every (arm, seed) fine-tune of the base drafter, one at a time."""
    for seed in args.seeds:
        for arm in args.arms:
            out = run_dir(runs, arm, seed)
            if (out / "drafter" / "config.json").exists():
                continue
            out.parent.mkdir(parents=True, exist_ok=True)
            start, steps = base, args.steps
            if arm == "opd-exittrain":     # OPD's first half, then ExitTrain
                half = run_dir(runs, "opd-half", seed)
                if not (half / "drafter" / "config.json").exists():
                    run_train(["run", "--no-progress", *pc.flags(dict(
                        arm_flags("opd", args, args.steps // 2, seed),
                        target_path=args.target, data_dir=rollouts, drafter_path=base,
                        out_dir=half))], half.with_suffix(".log"))
                start, steps = half / "drafter", args.steps - args.steps // 2
            run_train(["run", "--no-progress", *pc.flags(dict(
                arm_flags(arm, args, steps, seed), target_path=args.target,
                data_dir=rollouts, drafter_path=start, out_dir=out))], out.with_suffix(".log"))


def prepare(args, runs: Path) -> tuple[Path, Path]:
    """Prompts, rollouts and the base drafter (each skipped when done)."""
    runs.mkdir(parents=True, exist_ok=True)
    if not (runs / "prompts.jsonl").exists():
        strength.write_prompts(Path(args.data_dir), runs / "prompts.jsonl")
    rollouts = runs / "rollouts_t0"
    if not (rollouts / "manifest.json").exists():
        run_train(["rollouts", "--target", args.target, "--prompts-file",
                   str(runs / "prompts.jsonl"), "--out", str(rollouts),
                   *pc.flags(strength.ROLLOUTS), "--limit", str(args.train_prompts),
                   "--temperature", "0"], rollouts.with_suffix(".log"))
    base = runs / "base"
    if not (base / "drafter" / "config.json").exists():
        run_train(["run", "--no-progress", *pc.flags(dict(
            strength.BASE_RUN, target_path=args.target, data_dir=rollouts, out_dir=base,
            steps=args.base_steps,
            warmup_steps=min(int(strength.BASE_RUN["warmup_steps"]), args.base_steps)))],
            runs / "base.log")
    return rollouts, base / "drafter"


def drafter_names(args) -> dict[str, Path]:
    """name -> drafter folder of everything measured: the base, each run's final
    drafter and its snapshots (name ``<arm>-s<seed>@<update>``)."""
    runs = Path(args.runs)
    names = {"base": runs / "base" / "drafter"}
    for seed in args.seeds:
        for arm in args.arms:
            out = run_dir(runs, arm, seed)
            names[f"{arm}-s{seed}"] = out / "drafter"
            parts = [(out, 0, args.steps)]
            if arm == "opd-exittrain":      # its OPD half, then its ExitTrain half
                half = args.steps // 2
                parts = [(run_dir(runs, "opd-half", seed), 0, half), (out, half, args.steps)]
                names[f"{arm}-s{seed}@{half}"] = parts[0][0] / "drafter"
            for folder, start, end in parts:
                for u in range(args.snapshot_every, end - start, args.snapshot_every):
                    names[f"{arm}-s{seed}@{u + start}"] = folder / "drafters" / f"update-{u}"
    return names


class Folder:
    """`paper_common.load_models`'s drafter root: ``<root>/<name>/drafter`` links."""

    def __init__(self, root: Path, names: dict[str, Path]):
        self.root = root
        for name, path in names.items():
            link = root / name.replace("@", "_at_") / "drafter"
            if not link.exists():
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(path.resolve())

    def key(self, name: str) -> str:
        return name.replace("@", "_at_")


def evaluate(args, setup, names: dict[str, Path], cells) -> list[dict]:
    """Coverage records per drafter, (budget, T) cell and set, cached in
    ``<runs>/eval.json`` (a killed evaluation keeps what it measured)."""
    runs = Path(args.runs)
    cache_path = runs / "eval.json"
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    folder = Folder(runs / "eval_drafters", names)
    keys = [folder.key(n) for n in names]
    models = pc.load_models(args.target, folder.root, keys)
    prompts = pc.eval_prompts(models.tokenizer, setup)
    cuts = [c for c in args.cuts if c + 1 <= setup.max_new_tokens]
    for budget, temp in cells:
        tag = f"B{budget}-T{temp:g}"
        todo = [k for k in keys if f"{tag}/{k}" not in cache
                and (temp == 0.0 and budget == 64 or "_at_" not in k)]
        if not todo:
            continue
        one = dataclasses.replace(setup, temperatures=(temp,))
        for rec in cov.coverage(models, prompts, one, cuts, budget, todo):
            cache[f"{tag}/{rec['drafter']}"] = rec
            tmp = cache_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(cache))
            os.replace(tmp, cache_path)
    return models, [cache[k] for k in cache]


def tau(rec) -> float:
    return cov.set_mean(rec, True)


def summary(records, args, cells) -> dict:
    """{cell: {arm: dict(tau, tau_se, vs_token, se_paired, se_context, seeds)}} over the
    seeds whose runs finished."""
    get = {(r["budget"], r["temperature"], r["drafter"]): r for r in records}
    out = {}
    for budget, temp in cells:
        cell = {}
        base = get.get((budget, temp, "base"))
        if base is not None:
            cell["base"] = dict(tau=tau(base), seeds=[])
        for arm in args.arms:
            seeds = [s for s in args.seeds if (budget, temp, f"{arm}-s{s}") in get
                     and (budget, temp, f"{REFERENCE}-s{s}") in get]
            if not seeds:
                continue
            taus = [tau(get[(budget, temp, f"{arm}-s{s}")]) for s in seeds]
            ratios, ctx_se = [], []
            for s in seeds:
                r, se = cov.avg_ratio([get[(budget, temp, f"{arm}-s{s}")]],
                                      [get[(budget, temp, f"{REFERENCE}-s{s}")]], True)
                ratios.append(r)
                ctx_se.append(se)
            n = len(seeds)
            se_paired = float(np.std(ratios, ddof=1) / np.sqrt(n)) if n > 1 else float("nan")
            cell[arm] = dict(tau=float(np.mean(taus)),
                             tau_se=float(np.std(taus, ddof=1) / np.sqrt(n)) if n > 1
                             else float("nan"),
                             vs_token=float(np.mean(ratios)), se_paired=se_paired,
                             se_context=float(np.mean(ctx_se)), seeds=seeds)
        out[f"B{budget}-T{temp:g}"] = cell
    return out


def winners(summ: dict, arms) -> list[str]:
    """Arms at least 3 % above token-only by 2 paired SE in every cell (issue 45)."""
    out = []
    for arm in arms:
        if arm == REFERENCE:
            continue
        ok = True
        for cell in summ.values():
            c = cell.get(arm)
            if c is None or not (c["vs_token"] >= 1.03
                                 and c["vs_token"] - 2 * c["se_paired"] > 1.0):
                ok = False
        if ok:
            out.append(arm)
    return out


def table(summ: dict, arms, cells) -> str:
    header = ["arm", "seeds"] + [f"budget {b}, T {t:g}: {what}" for b, t in cells
                                 for what in ("τ̂", "/ token (paired SE)")]
    rows = []
    for arm in ["base", *arms]:
        first = summ[f"B{cells[0][0]}-T{cells[0][1]:g}"].get(arm)
        if first is None:
            continue
        row = [arm, ",".join(map(str, first["seeds"])) or "-"]
        for b, t in cells:
            c = summ[f"B{b}-T{t:g}"].get(arm)
            if c is None:
                row += ["-", "-"]
            elif arm == "base":
                row += [f"{c['tau']:.3f}", "-"]
            else:
                row += [f"{c['tau']:.3f}", f"{c['vs_token']:.3f} ± {c['se_paired']:.3f}"]
        rows.append(row)
    return pc.markdown(header, rows)


def curves(records, args) -> dict:
    """{arm: [(update, mean τ̂ over seeds, SE)]} at B 64, T 0 (the base at update 0)."""
    get = {r["drafter"]: r for r in records if r["budget"] == 64 and r["temperature"] == 0.0}
    out = {}
    for arm in args.arms:
        points = [(0, [tau(get["base"])] * len(args.seeds))] if "base" in get else []
        for u in range(args.snapshot_every, args.steps + 1, args.snapshot_every):
            names = [f"{arm}-s{s}@{u}" if u < args.steps else f"{arm}-s{s}"
                     for s in args.seeds]
            names = [n.replace("@", "_at_") for n in names]
            vals = [tau(get[n]) for n in names if n in get]
            if vals:
                points.append((u, vals))
        out[arm] = [(u, float(np.mean(v)),
                     float(np.std(v, ddof=1) / np.sqrt(len(v))) if len(v) > 1 else 0.0)
                    for u, v in points]
    return out


def figure(curve: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for arm, points in curve.items():
        if points:
            u, m, se = zip(*points)
            ax.errorbar(u, m, yerr=se, fmt="-o", ms=3, capsize=2, label=arm)
    ax.set(xlabel="fine-tune updates", ylabel="τ̂ (budget 64, T = 0, held-out prompts)",
           title="τ̂ against updates (mean ± SE over seeds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main():
    ap = pc.study_parser(__doc__, prompts=16, max_new_tokens=64)
    ap.set_defaults(sets=["gsm"])
    ap.add_argument("--runs", default=str(REPO / "runs" / "draft_opd"))
    ap.add_argument("--data-dir", default=str(REPO / "data"))
    ap.add_argument("--train-prompts", type=int, default=2992,
                    help="gsm_train questions rolled out (the first N; all: 2992)")
    ap.add_argument("--base-steps", type=int, default=5000,
                    help="updates of the token-trained base drafter")
    ap.add_argument("--steps", type=int, default=300, help="updates of every arm")
    ap.add_argument("--snapshot-every", type=int, default=50)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--arms", nargs="+", default=["token", "exittrain", "opd"],
                    choices=list(ARMS))
    ap.add_argument("--opd-steps", type=int, default=10,
                    help="updates per OPD rollout phase")
    ap.add_argument("--opd-prompts", type=int, default=16,
                    help="training prompts rolled out per OPD phase")
    ap.add_argument("--opd-max-new-tokens", type=int, default=160,
                    help="OPD rollout response cap (the rollouts': 160)")
    ap.add_argument("--budgets", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--cuts", type=int, nargs="+", default=[0, 12, 24, 40])
    ap.add_argument("--train-only", action="store_true", help="stop before the evaluation")
    args = ap.parse_args()
    if REFERENCE not in args.arms:
        ap.error("--arms must include token (every ratio is to token-only)")
    if args.steps % args.snapshot_every:
        ap.error("--steps must be a multiple of --snapshot-every")
    started = time.time()
    runs = Path(args.runs)
    rollouts, base = prepare(args, runs)
    train_arms(args, runs, rollouts, base)
    if args.train_only:
        return
    pc.enable_compile_cache(args)
    setup = pc.setup_from_args(args)
    cells = [(b, t) for b in args.budgets for t in setup.temperatures]
    names = {n: p for n, p in drafter_names(args).items() if (p / "config.json").exists()}
    models, records = evaluate(args, setup, names, cells)
    summ = summary(records, args, cells)
    curve = curves(records, args)
    won = winners(summ, args.arms)
    text = (pc.setup_line(setup, models, timed=False)
            + f"; cuts {args.cuts}; training prompts {args.train_prompts} (greedy "
            f"rollouts, 160 new tokens); base: {args.base_steps} token updates; arms: "
            f"{args.steps} updates each, seeds {args.seeds}, snapshots every "
            f"{args.snapshot_every}; OPD: {args.opd_prompts} prompts per phase, a phase "
            f"every {args.opd_steps} updates, responses ≤ {args.opd_max_new_tokens} "
            f"tokens; shared flags {json.dumps(SHARED)}\n\n" + table(summ, args.arms, cells)
            + "\n\nArms ≥ 3 % above token-only by 2 paired SE in every cell: "
            + (", ".join(won) if won else "none") + "\n")
    out = pc.write_outputs(HERE, args, setup, models,
                           dict(arms=ARMS, shared=SHARED, summary=summ, curves=curve,
                                winners=won, records=records), text, started)
    if not args.quick:
        figure(curve, out.with_name(out.stem.replace("results", "tau_vs_updates") + ".png"))


if __name__ == "__main__":
    main()
