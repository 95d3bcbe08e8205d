"""ExitTrain's gain against drafter strength, in a domain where drafters get strong.

Issue 25: the recipe sweep (``../exit_recipe``) found ExitTrain equal to token-only
fine-tuning with a weak drafter (τ 1.4-2.1), where a third of the target mass leaves the
tree at the root. Here the target is predictable and the drafter trains long:

1. ``prompts``: the GSM-style training questions of ``data/gsm_train.jsonl``
   in the chat template (the evaluation questions, ``gsm_eval``, are other problems).
2. ``rollouts``: the bundled target's answers, 160 new tokens: greedy (T = 0, the
   default) or sampled (``--rollout-temperature 1``).
3. ``base``: a DFlash drafter from scratch, token objective, with a drafter snapshot every
   ``--snapshot-every`` updates (``tev-train run --drafter-every``): drafters of
   increasing strength along one run.
4. ``finetune``: from each snapshot of ``--snapshots``, the same updates, data and
   optimiser with three objectives: token-only (``token``), the authors' recipe in full
   (``paper``: CE + 0.1 · reach-weighted NLL / nodes, floor 1e-4, their 64-token scoring
   window) and our weight normaliser at λ 0.03 (the bundled ExitTrain drafter's
   objective), 0.3 and 1; the best λ per snapshot is chosen on the validation prompts.
   ``t0-paper`` and ``t0-weight-exit-l0.3`` weigh the trees with the exit law at T = 0
   (the fine-tunes' default is T = 1). Every fine-tune uses the authors' partial blocks
   (``--partial-anchors``), so the token loss has the same convention in all of them.
5. ``eval``: the coverage study's exact expected block length 1 + C on each drafter's own
   DDTree (``../coverage``; TEV and predraw are both exact, so its harmonic mean τ̂ is
   the tokens per round of ExitTrain + TEV and of DFlash + DDTree) at T = 0 and 1,
   budgets 32 and 64, on the ``gsm`` evaluation prompts: ``--prompts`` evenly spaced
   test prompts (reported) and the validation prompts between them. Ratios are paired on
   the same contexts (prompts as clusters, ± one standard error).

Every stage is skipped when its output exists (a killed run resumes from its checkpoint).

    python experiments/exit_strength/run.py --target tev_jax/data/models/target
    python experiments/exit_strength/run.py --target tev_jax/data/models/target \
        --rollout-temperature 1 --runs runs/strength_t1 \
        --out experiments/exit_strength/results_t1.json
"""

from __future__ import annotations

import json
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


cov = pc.load_study("coverage")
recipe = pc.load_study("exit_recipe")

ROLLOUTS = dict(max_prompt_len="192", max_new_tokens="160", batch_size="64", seed="0")
BASE_RUN = dict(loss="token", drafter_layers="1", batch_size="8", num_anchors="16",
                block_size="16", lr="1e-3", warmup_steps="100", end_lr_ratio="0.05",
                checkpoint_every="500")
# The fine-tunes: the recipe sweep's shared flags with the authors' partial blocks.
FINETUNE = dict(recipe.BASE, partial_anchors="true")
VARIANTS = {
    "token": recipe.VARIANTS["token"],
    "paper": dict(recipe.VARIANTS["paper"], exit_prefix_window="64"),
    **{f"weight-exit-l{lam}": recipe.VARIANTS[f"weight-exit-l{lam}"]
       for lam in ("0.03", "0.3", "1")},
}
# The same objectives with the trees' exit law at T = 0 (the greedy decoding they are
# measured at) instead of the fine-tunes' T = 1.
VARIANTS.update({f"t0-{name}": dict(VARIANTS[name], temperature="0")
                 for name in ("paper", "weight-exit-l0.3")})
WEIGHT = [name for name in VARIANTS if name.startswith("weight-")]   # the λ choice


def run_train(argv: list[str], log: Path) -> None:
    pc.run_train(argv, log, "exit_strength")


def write_prompts(data_dir: Path, out: Path) -> None:
    """The gsm_train questions as a prompts file (one user turn each)."""
    lines = []
    for line in (data_dir / "gsm_train.jsonl").read_text().splitlines():
        record = json.loads(line)
        lines.append(json.dumps({"id": record["id"], "messages": [
            {"role": "user", "content": record["question"]}]}))
    out.write_text("\n".join(lines) + "\n")


def snapshot_path(runs: Path, update: int, steps: int) -> Path:
    """The base run's drafter after ``update`` updates."""
    base = runs / "base"
    return base / "drafter" if update == steps else base / "drafters" / f"update-{update}"


def prepare(args, runs: Path) -> None:
    """Stages 1-4 (each skipped when done)."""
    runs.mkdir(parents=True, exist_ok=True)
    if not (runs / "prompts.jsonl").exists():
        write_prompts(Path(args.data_dir), runs / "prompts.jsonl")
    rollouts = runs / f"rollouts_t{args.rollout_temperature:g}"
    if not (rollouts / "manifest.json").exists():
        run_train(["rollouts", "--target", args.target, "--prompts-file",
                   str(runs / "prompts.jsonl"), "--out", str(rollouts), *pc.flags(ROLLOUTS),
                   "--temperature", f"{args.rollout_temperature:g}"],
                  rollouts.with_suffix(".log"))
    if not (runs / "base" / "drafter" / "config.json").exists():
        run_train(["run", "--no-progress", *pc.flags(dict(
            BASE_RUN, target_path=args.target, data_dir=rollouts,
            out_dir=runs / "base", steps=args.base_steps,
            drafter_every=args.snapshot_every))], runs / "base.log")
    for update in args.snapshots:
        home = runs / "ft" / f"u{update}"
        home.mkdir(parents=True, exist_ok=True)
        link = home / "dflash"
        if not link.exists():
            link.mkdir()
            (link / "drafter").symlink_to(snapshot_path(runs, update, args.base_steps).resolve())
        recipe.finetune_all({n: VARIANTS[n] for n in args.variants},
                            dict(FINETUNE, steps=str(args.finetune_steps)), args.target,
                            rollouts, link / "drafter", home, args.jobs)


def summary(records, setup, snapshots, variants, budgets) -> dict:
    """{split: {budget: {T: {snapshot: {name: dict(tau, vs_dflash, se_dflash, vs_token,
    se_token, root_exit)}}}}}."""
    out = {}
    for split in ("val", "test"):
        for budget in budgets:
            for temp in setup.temperatures:
                cell = {}
                for update in snapshots:
                    recs = lambda n: [pc.one(records, split=split, budget=budget,
                                             temperature=temp, drafter=f"u{update}/{n}",
                                             set=s) for s in setup.sets]
                    cell[str(update)] = {name: recipe.drafter_row(recs, name)
                                         for name in ("dflash", *variants)}
                out.setdefault(split, {}).setdefault(str(budget), {})[str(temp)] = cell
    return out


def tables(summ: dict, setup, snapshots, variants, budgets) -> str:
    parts = []
    for split, title in (("test", "Test prompts (reported)"),
                         ("val", "Validation prompts")):
        header = ["base updates", "drafter"] + [
            f"B={b} T={t:g} {what}" for b in budgets for t in setup.temperatures
            for what in ("τ̂", "/ dflash", "/ token", "root exit")]
        rows = []
        for update in snapshots:
            for name in ("dflash", *variants):
                row = [str(update), name]
                for b in budgets:
                    for t in setup.temperatures:
                        c = summ[split][str(b)][str(t)][str(update)][name]
                        row += [f"{c['tau']:.3f}",
                                f"{c['vs_dflash']:.3f} ± {c['se_dflash']:.3f}",
                                f"{c['vs_token']:.3f} ± {c['se_token']:.3f}",
                                f"{c['root_exit']:.3f}"]
                rows.append(row)
        parts += [f"**{title}**\n", pc.markdown(header, rows), ""]
    return "\n".join(parts)


def best_weight(summ: dict, update: int) -> str:
    """Our weight normaliser's λ with the best mean τ̂ ratio to token-only on the
    validation prompts (over budgets and temperatures) at one snapshot."""
    cells = [by_t[str(update)] for by_b in summ["val"].values() for by_t in by_b.values()]
    names = [n for n in WEIGHT if n in cells[0]]
    return max(names, key=lambda n: np.mean([c[n]["vs_token"] for c in cells]))


def figure(summ: dict, setup, snapshots, budgets, chosen: dict, path: Path) -> None:
    """ExitTrain's gain against the base drafter's τ̂ (test prompts), one panel per
    (B, T): the authors' recipe and our weight normaliser at its chosen λ, over token-only
    fine-tuning with the same updates and over the base drafter."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [(b, t) for b in budgets for t in setup.temperatures]
    fig, axes = plt.subplots(1, len(cells), figsize=(4 * len(cells), 3.6), squeeze=False)
    lines = [("paper", "token", "-o"), ("weight", "token", "-s"), ("paper", "dflash", ":o"),
             ("weight", "dflash", ":s"), ("token", "dflash", "--^")]
    for ax, (b, t) in zip(axes[0], cells):
        cell = summ["test"][str(b)][str(t)]
        order = sorted(snapshots, key=lambda u: cell[str(u)]["dflash"]["tau"])
        x = [cell[str(u)]["dflash"]["tau"] for u in order]
        for name, ref, style in lines:
            rows = [cell[str(u)][chosen[u] if name == "weight" else name] for u in order]
            ax.errorbar(x, [r[f"vs_{ref}"] for r in rows], yerr=[r[f"se_{ref}"] for r in rows],
                        fmt=style, capsize=2, ms=4, label=f"{name} / {ref}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(title=f"budget {b}, T = {t:g}", xlabel="base drafter τ̂ (DFlash + DDTree)",
               ylabel="τ̂ ratio")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main():
    ap = pc.study_parser(__doc__, prompts=32, max_new_tokens=64)
    ap.set_defaults(sets=["gsm"])
    ap.add_argument("--runs", default=str(REPO / "runs" / "strength"))
    ap.add_argument("--data-dir", default=str(REPO / "data"))
    ap.add_argument("--rollout-temperature", type=float, default=0.0,
                    help="the training rollouts' temperature (a separate --runs per value)")
    ap.add_argument("--base-steps", type=int, default=5000)
    ap.add_argument("--snapshot-every", type=int, default=500)
    ap.add_argument("--snapshots", type=int, nargs="+", default=[500, 1500, 5000],
                    help="base-run updates whose drafters are fine-tuned and measured")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--finetune-steps", type=int, default=300)
    ap.add_argument("--jobs", type=int, default=2, help="fine-tunes trained at once")
    ap.add_argument("--budgets", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--cuts", type=int, nargs="+", default=[0, 12, 24, 40])
    ap.add_argument("--replot", action="store_true",
                    help="redraw the figure from the results file (--out) and stop")
    args = ap.parse_args()
    if args.replot:
        out = Path(args.out) if args.out else HERE / "results.json"
        saved = json.loads(out.read_text())
        chosen = {int(u): n for u, n in saved["chosen_weight"].items()}
        figure(saved["summary"], pc.setup_from_args(args), saved["snapshots"], args.budgets,
               chosen, out.with_name(out.stem.replace("results", "gain_vs_strength") + ".png"))
        return
    bad = [u for u in args.snapshots
           if u != args.base_steps and (u % args.snapshot_every or u > args.base_steps)]
    if bad:
        ap.error(f"--snapshots {bad}: not a snapshot of the base run (multiples of "
                 f"--snapshot-every {args.snapshot_every} up to --base-steps {args.base_steps})")
    variants = ["token", *[v for v in args.variants if v != "token"]]
    args.variants = variants
    started = time.time()
    runs = Path(args.runs)
    prepare(args, runs)
    pc.enable_compile_cache(args)
    setup = pc.setup_from_args(args)
    cuts = [c for c in args.cuts if c + 1 <= setup.max_new_tokens]
    names = [f"u{u}/{n}" for u in args.snapshots for n in ("dflash", *variants)]
    models = pc.load_models(args.target, runs / "ft", names)
    splits = {"test": pc.eval_prompts(models.tokenizer, setup),
              "val": recipe.validation_prompts(models.tokenizer, setup)}
    records = recipe.split_records(models, splits, setup, cuts, args.budgets, names,
                                   "exit_strength")
    summ = summary(records, setup, args.snapshots, variants, args.budgets)
    table = (pc.setup_line(setup, models, timed=False)
             + f"; validation: {setup.prompts_per_set // 2} other prompts; cuts {cuts}; "
             f"rollouts at T = {args.rollout_temperature:g}; base run: "
             f"{json.dumps(BASE_RUN)}, snapshots {args.snapshots}; fine-tunes: "
             f"{json.dumps(dict(FINETUNE, steps=str(args.finetune_steps)))}\n\n"
             + tables(summ, setup, args.snapshots, variants, args.budgets))
    chosen = {u: best_weight(summ, u) for u in args.snapshots if WEIGHT[0] in variants}
    if chosen:
        table += ("\nOur weight normaliser's λ chosen on the validation prompts (best mean "
                  "τ̂ / token): " + ", ".join(f"{u} updates: {n}" for u, n in chosen.items())
                  + "\n")
    out = pc.write_outputs(HERE, args, setup, models,
                           dict(base_run=BASE_RUN, finetune=FINETUNE, variants=VARIANTS,
                                rollout_temperature=args.rollout_temperature,
                                snapshots=args.snapshots, cuts=cuts, budgets=args.budgets,
                                chosen_weight=chosen, summary=summ, records=records),
                           table, started)
    if chosen and not args.quick:
        figure(summ, setup, args.snapshots, args.budgets, chosen,
               out.with_name(out.stem.replace("results", "gain_vs_strength") + ".png"))


if __name__ == "__main__":
    main()
