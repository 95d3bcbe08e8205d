"""The budget from the exit law on the bundled models (issue 24): predicted τ(b) against
what `generate` measures, and ``--budget auto`` against every fixed budget and AR.

1. Prompts: the four bundled evaluation sets (never used to train the drafters), an
   evenly spaced selection per set, at most 128 tokens (BOS + the last 127).
2. Predicted τ(b) (`tev_jax.costs.tune`): each prompt continued by the target itself at T
   (greedy at T = 0; at T = 1 ``--cont-seeds`` independent samples, pooled), one round at
   budget 128 at every position a round can start from, τ(b) for b <= 128 from the exit
   law, weighted as decoding visits the positions; also the harmonic mean over contexts.
3. Measured τ(b): `tev_jax.engine.generate` at each budget on the same prompts (static
   batches of 16; at T = 1 ``--gen-seeds`` seeds), pooled as `DecodeStats.tau` pools
   (block tokens / rounds).
4. Speed: `tev_jax.costs.round_costs.round_costs` at B 1 and 8 gives the tuning (T = 0); then the fused
   generation of AR, of every fixed budget and of ``budget='auto'`` (resolved by
   `generate` from the tuning) is timed at B 1 (one prompt at a time) and B 8 (batches of
   8), all methods interleaved in a fresh random order every repeat; tokens/s = new
   tokens / summed median seconds. Ratios come from this one run.

    python experiments/tune/run.py              # -> results.json, figures, README block
    python experiments/tune/run.py --quick      # 2 prompts per set, fewer seeds
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from tev_jax.runtime.platforms import quiet_start

if __name__ == "__main__":
    quiet_start()  # before jax is imported: no libtpu or CUDA plugin lines on a CPU

import jax
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import paper_common as pc  # noqa: E402

from tev_jax import engine  # noqa: E402
from tev_jax.budget import resolve_budget  # noqa: E402
from tev_jax.costs import timing, tune  # noqa: E402
from tev_jax.decode import DecodeConfig  # noqa: E402
from tev_jax.models import load_bundled  # noqa: E402
from tev_jax.sampling import Sampling  # noqa: E402
from tev_jax.text_io import stop_token_ids  # noqa: E402

BUDGETS = (16, 32, 64, 128)
GEN_BATCH = 16


def pooled_curve(target, drafter, prompts, config, seeds, budget):
    """τ curve from ``len(seeds)`` continuation samples per prompt, pooled (each sample
    of a prompt is its own cluster)."""
    reaches = []
    for seed in seeds:
        conts = tune.continuations(target, prompts, max_new_tokens=config.max_new_tokens,
                                   sampling=config.sampling,
                                   stop_token_ids=config.stop_token_ids, key=seed)
        reaches.append(tune.tree_reach(target, drafter, prompts, conts, budget=budget,
                                       sampling=config.sampling))
    offset = np.cumsum([0] + [len(r.lengths) for r in reaches[:-1]])
    tr = tune.TreeReach(
        reach=np.concatenate([r.reach for r in reaches]),
        depth=np.concatenate([r.depth for r in reaches]),
        prompt=np.concatenate([r.prompt + o for r, o in zip(reaches, offset)]),
        position=np.concatenate([r.position for r in reaches]),
        lengths=np.concatenate([r.lengths for r in reaches]), horizon=reaches[0].horizon)
    return tune.tau_curve(tr)


def measured_tau(target, drafter, prompts, config, seeds) -> tuple[float, float, list]:
    """Pooled τ of `engine.generate` over the prompts (static batches) and seeds; its
    standard error over (prompt, seed) clusters; the per-seed values."""
    blocks, rounds, per_seed = [], [], []
    for seed in seeds:
        b_s = r_s = 0
        for i in range(0, len(prompts), GEN_BATCH):
            gen = engine.generate(target, drafter, prompts[i:i + GEN_BATCH], config,
                                  key=seed * 1000 + i)
            blocks += gen.stats.block_lengths.sum(0).tolist()
            rounds += gen.stats.rounds_per_row.tolist()
            b_s += int(gen.stats.block_lengths.sum())
            r_s += int(gen.stats.rounds_per_row.sum())
        per_seed.append(b_s / r_s)
    return sum(blocks) / sum(rounds), pc.ratio_se(blocks, rounds), per_seed


def speed(target, drafter, prompts, config, tuning_path, batch_sizes, repeats, seed):
    """tokens/s of AR, every fixed budget and auto per batch size, interleaved."""
    methods = {"AR": dataclasses.replace(config, builder="none")}
    methods |= {f"b{b}": dataclasses.replace(config, budget=b) for b in BUDGETS}
    methods["auto"] = dataclasses.replace(config, budget="auto", tuning=str(tuning_path))
    out = {}
    for bs in batch_sizes:
        groups = [prompts[i:i + bs] for i in range(0, len(prompts), bs)]
        groups = [g for g in groups if len(g) == bs]
        calls = {}
        for name, cfg in methods.items():
            for j, g in enumerate(groups):
                calls[name, j] = timing.compiled_generate(target, drafter, g, cfg, key=seed)
        resolved = resolve_budget(methods["auto"], bs, target, drafter)
        seconds = {k: [] for k in calls}
        tokens = {}
        rng = np.random.default_rng(seed)
        keys = list(calls)
        for _ in range(repeats):
            for i in rng.permutation(len(keys)):
                gen = calls[keys[i]]()
                seconds[keys[i]].append(gen.stats.seconds)
                tokens[keys[i]] = int(gen.lengths.sum())
        out[bs] = {}
        for name in methods:
            tok = sum(tokens[name, j] for j in range(len(groups)))
            sec = sum(float(np.median(seconds[name, j])) for j in range(len(groups)))
            fastest = sum(float(np.min(seconds[name, j])) for j in range(len(groups)))
            out[bs][name] = {"tokens": tok, "seconds": sec, "tokens_per_second": tok / sec,
                             "min_seconds": fastest,
                             "repeats": [seconds[name, j] for j in range(len(groups))]}
        out[bs]["auto"]["resolved"] = ("AR" if resolved.builder == "none"
                                       else f"b{resolved.budget}")
        fixed = max((out[bs][f"b{b}"]["tokens_per_second"] for b in BUDGETS))
        best = max(fixed, out[bs]["AR"]["tokens_per_second"])
        auto = out[bs]["auto"]["tokens_per_second"]
        out[bs]["ratios"] = {"auto_over_best_fixed": auto / fixed,
                             "auto_over_best_choice": auto / best,
                             "auto_over_ar": auto / out[bs]["AR"]["tokens_per_second"],
                             "auto_over_ar_min": (out[bs]["AR"]["min_seconds"]
                                                  / out[bs]["auto"]["min_seconds"]),
                             "auto_over_ar_paired": paired_ratio(seconds, len(groups))}
        out[bs]["auto"]["same_program_as_ar"] = resolved == methods["AR"]
        print(f"B={bs}: " + ", ".join(f"{k} {v['tokens_per_second']:.1f}"
                                      for k, v in out[bs].items() if "tokens_per_second" in v)
              + f" tokens/s; auto = {out[bs]['auto']['resolved']}; {out[bs]['ratios']}",
              flush=True)
    return out


def paired_ratio(seconds: dict, groups: int) -> dict:
    """AR time / auto time within each interleaved repeat (both summed over the groups):
    the geometric mean and its 95 % confidence interval (t on the log ratios)."""
    import scipy.stats

    ar = np.sum([seconds["AR", j] for j in range(groups)], axis=0)
    auto = np.sum([seconds["auto", j] for j in range(groups)], axis=0)
    logs = np.log(ar / auto)
    half = scipy.stats.t.ppf(0.975, len(logs) - 1) * logs.std(ddof=1) / np.sqrt(len(logs))
    return {"mean": float(np.exp(logs.mean())), "ci95": [float(np.exp(logs.mean() - half)),
                                                         float(np.exp(logs.mean() + half))]}


def figure(curves, measured, tuning, speeds, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tau, ax_rate) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (temp, curve) in enumerate(curves.items()):
        b = np.arange(1, len(curve["tau"]))
        tau, se = np.asarray(curve["tau"][1:]), np.asarray(curve["se"][1:])
        ax_tau.plot(b, tau, color=f"C{i}", label=f"T = {temp:g}: exit law, as decoding visits")
        ax_tau.fill_between(b, tau - 2 * se, tau + 2 * se, color=f"C{i}", alpha=0.15)
        ax_tau.plot(b, curve["harmonic"][1:], color=f"C{i}", ls=":", lw=1,
                    label=f"T = {temp:g}: harmonic mean over contexts")
        m = measured[temp]
        ax_tau.errorbar(BUDGETS, [m[b]["tau"] for b in BUDGETS],
                        yerr=[2 * m[b]["se"] for b in BUDGETS], fmt="o", color=f"C{i}",
                        mec="k", label=f"T = {temp:g}: generate measures")
    ax_tau.set(xscale="log", xlabel="budget b", ylabel="τ(b), tokens per round")
    ax_tau.set_xticks((1, 4, *BUDGETS), [str(b) for b in (1, 4, *BUDGETS)])
    ax_tau.set_xticks([], minor=True)
    ax_tau.legend(fontsize=7, loc="upper left")
    for i, bs in enumerate(sorted(tuning.cost_seconds)):
        row = tuning.cost_seconds[bs]
        pred = [bs * tuning.tau[b] / row[b] for b in BUDGETS]
        ax_rate.plot(BUDGETS, pred, "--", color=f"C{i + 2}", lw=1,
                     label=f"B = {bs}: tuning's estimate")
        ax_rate.axhline(bs / tuning.ar_seconds[bs], color=f"C{i + 2}", ls="-.", lw=1,
                        label=f"B = {bs}: AR, tuning's estimate")
        if bs in speeds:
            got = [speeds[bs][f"b{b}"]["tokens_per_second"] for b in BUDGETS]
            ax_rate.plot(BUDGETS, got, "o-", color=f"C{i + 2}", label=f"B = {bs}: measured")
            ax_rate.axhline(speeds[bs]["AR"]["tokens_per_second"], color=f"C{i + 2}",
                            ls=":", label=f"B = {bs}: AR measured (auto: "
                                        f"{speeds[bs]['auto']['resolved']})")
    ax_rate.set(xscale="log", yscale="log", xlabel="budget b",
                ylabel="tokens/s of the batch (T = 0)")
    ax_rate.set_xticks(BUDGETS, [str(b) for b in BUDGETS])
    ax_rate.set_xticks([], minor=True)
    ax_rate.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def paired_cell(row) -> str:
    paired = row["ratios"].get("auto_over_ar_paired")
    if paired is None:
        return "–"
    same = " (one program)" if row["auto"].get("same_program_as_ar") else ""
    return f"{paired['mean']:.3f} [{paired['ci95'][0]:.3f}, {paired['ci95'][1]:.3f}]{same}"


def tables(curves, measured, tuning, speeds) -> str:
    rows = []
    for temp, curve in curves.items():
        for b in BUDGETS:
            m = measured[temp][b]
            rows.append([f"{temp:g}", b, f"{curve['tau'][b]:.3f} ± {curve['se'][b]:.3f}",
                         f"{curve['harmonic'][b]:.3f}", f"{m['tau']:.3f} ± {m['se']:.3f}",
                         f"{curve['tau'][b] / m['tau']:.3f}",
                         f"{curve['harmonic'][b] / m['tau']:.3f}"])
    head = ["T", "budget", "predicted τ ± SE", "harmonic mean", "generate τ ± SE",
            "predicted / measured", "harmonic / measured"]
    parts = ["**τ(b): predicted from one exit-law pass at budget 128 vs measured by "
             "`generate`**\n", pc.markdown(head, rows), "",
             "**The tuning (T = 0; one-round programs on this CPU, medians)**\n",
             "```", tuning.format(), "```", "",
             "**tokens/s of the fused generation, AR / each fixed budget / auto "
             "(interleaved, one run)**\n"]
    head = ["B", "AR", *(f"b {b}" for b in BUDGETS), "auto (resolved)",
            "auto / best fixed budget", "auto / AR", "auto / AR (fastest repeats)",
            "auto / AR per repeat (95 % CI)"]
    rows = []
    for bs, row in speeds.items():
        rows.append([bs, f"{row['AR']['tokens_per_second']:.1f}",
                     *(f"{row[f'b{b}']['tokens_per_second']:.1f}" for b in BUDGETS),
                     f"{row['auto']['tokens_per_second']:.1f} ({row['auto']['resolved']})",
                     f"{row['ratios']['auto_over_best_fixed']:.3f}",
                     f"{row['ratios']['auto_over_ar']:.3f}",
                     f"{row['ratios']['auto_over_ar_min']:.3f}",
                     paired_cell(row)])
    parts += [pc.markdown(head, rows)]
    return "\n".join(parts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16, help="prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--cont-seeds", type=int, default=2, help="T = 1 continuation samples")
    ap.add_argument("--gen-seeds", type=int, default=4, help="T = 1 generate seeds")
    ap.add_argument("--speed-prompts", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cost-repeats", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-tau", action="store_true",
                    help="reuse the predicted and measured τ of an earlier run "
                         "(results.json); rerun the tuning and the speed stage")
    ap.add_argument("--report", action="store_true",
                    help="only redraw the figures and the README block from results.json")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.cont_seeds, args.gen_seeds = 2, 1, 1
        args.speed_prompts, args.repeats, args.cost_repeats = 8, 2, 3
    started = time.time()
    setup = pc.Setup(prompts_per_set=args.prompts, max_new_tokens=args.max_new_tokens,
                     prompt_len=128, seed=args.seed)
    suffix = "_quick" if args.quick else ""
    if args.report:
        old = json.loads((HERE / f"results{suffix}.json").read_text())
        outputs(args, setup, {float(k): v for k, v in old["curves"].items()},
                {float(k): {int(b): m for b, m in v.items()}
                 for k, v in old["measured"].items()},
                tune.Tuning.from_dict(old["tuning"]),
                {int(k): v for k, v in old["speed"].items()},
                4 * args.prompts, args.speed_prompts, started)
        return
    target, drafter, tokenizer = load_bundled()
    prompts = [p for ps in pc.eval_prompts(tokenizer, setup).values() for p in ps]
    base = DecodeConfig(max_new_tokens=args.max_new_tokens, verifier="tev",
                        stop_token_ids=stop_token_ids(target, tokenizer), prompt_len=128)
    tuning_path = HERE / f"tune{suffix}.json"
    curves, measured = {}, {}
    if args.skip_tau:
        old = json.loads((HERE / f"results{suffix}.json").read_text())
        curves = {float(k): v for k, v in old["curves"].items()}
        measured = {float(k): {int(b): m for b, m in v.items()}
                    for k, v in old["measured"].items()}
    for temp in () if args.skip_tau else (0.0, 1.0):
        config = dataclasses.replace(base, sampling=Sampling(temperature=temp))
        seeds = [args.seed] if temp == 0 else list(range(args.seed, args.seed + args.cont_seeds))
        t0 = time.time()
        c = pooled_curve(target, drafter, prompts, config, seeds, max(BUDGETS))
        curves[temp] = {"tau": c.tau.tolist(), "se": c.se.tolist(),
                        "harmonic": c.harmonic.tolist(), "mean": c.mean.tolist(),
                        "contexts": c.contexts, "seconds": time.time() - t0}
        gen_seeds = [args.seed] if temp == 0 else list(range(100, 100 + args.gen_seeds))
        measured[temp] = {}
        for b in BUDGETS:
            tau, se, per_seed = measured_tau(target, drafter, prompts,
                                             dataclasses.replace(config, budget=b), gen_seeds)
            measured[temp][b] = {"tau": tau, "se": se, "per_seed": per_seed}
            print(f"T={temp:g} b={b}: predicted {c.tau[b]:.3f} ± {c.se[b]:.3f} (harmonic "
                  f"{c.harmonic[b]:.3f}), generate {tau:.3f} ± {se:.3f} -> "
                  f"{c.tau[b] / tau:.3f}", flush=True)
    t0 = time.time()
    tuning = tune.tune(target, drafter, prompts, base, budgets=BUDGETS, batch_sizes=(1, 8),
                       repeats=args.cost_repeats, key=args.seed)
    tuning.write(tuning_path)
    print(tuning.format(), f"({time.time() - t0:.0f} s)", flush=True)
    finish(args, setup, target, drafter, prompts, base, curves, measured, tuning,
           tuning_path, started)


def finish(args, setup, target, drafter, prompts, base, curves, measured, tuning,
           tuning_path, started):
    """The speed stage, then the outputs."""
    speed_prompts = prompts[:: max(1, len(prompts) // args.speed_prompts)][: args.speed_prompts]
    speeds = speed(target, drafter, speed_prompts, base, tuning_path, (1, 8), args.repeats,
                   args.seed)
    outputs(args, setup, curves, measured, tuning, speeds, len(prompts), len(speed_prompts),
            started)


def outputs(args, setup, curves, measured, tuning, speeds, n_prompts, n_speed, started):
    """The figures, results.json and the README block."""
    suffix = "_quick" if args.quick else ""
    figure(curves, measured, tuning, speeds, HERE / f"tune{suffix}.png")
    tune.plot(tuning, HERE / f"tuning{suffix}.png")
    table = (f"{args.prompts} prompts per set ({n_prompts}), {args.max_new_tokens} new "
             f"tokens, prompts ≤ 128 tokens, bundled target + ExitTrain drafter, TEV; T = 1: "
             f"{args.cont_seeds} continuation samples per prompt for the prediction, "
             f"{args.gen_seeds} generate seeds; speed: {n_speed} prompts, "
             f"{args.repeats} interleaved repeats; {jax.devices()[0].platform} x"
             f"{os.cpu_count()}, jax {jax.__version__}\n\n"
             + tables(curves, measured, tuning, speeds))
    args.random_models = False
    pc.write_outputs(HERE, args, setup, None,
                     dict(curves={str(k): v for k, v in curves.items()},
                          measured={str(k): {str(b): m for b, m in v.items()}
                                    for k, v in measured.items()},
                          tuning=tuning.as_dict(), speed={str(k): v for k, v in speeds.items()}),
                     table, started)


if __name__ == "__main__":
    main()
