"""Figures of the paper reproduction: τ vs tree budget, and where a draft tree loses target mass.

(a) ``tau_vs_budget.png``: average τ (and SR) over the evaluation sets against the tree
    budget B for DDTree (``dflash`` + predraw) and ExitTrain + TEV (``ft_exit`` + TEV),
    read from the budget study's results (experiments/budget/results.json), one panel per
    temperature; thin lines are the individual sets.
(b) ``exit_tree.png``: one real decode round (an evaluation prompt + the target's greedy
    continuation up to a cut; the last token is the root) drawn twice: the DDTree of
    budget ``--tree-budget`` from the DFlash drafter and from the ExitTrain drafter at the
    same context. Each node shows its token; its colour is the exit weight
    w = P x rho (the target mass that reaches the node and leaves the tree there: the
    mass the tree loses at that node, or, at a depth-H leaf, reaches the horizon), its
    size and the width of its incoming edge grow with the reach P, computed from the
    target's real logits at temperature ``--temperature`` (`tev_jax.exit_law`).

    python experiments/figures/run.py                 # runs/ models (else the bundled ones) + budget results -> PNGs
    python experiments/figures/run.py --random-models --budget-results experiments/budget/results_random.json
"""

from __future__ import annotations

import argparse
import json
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
from tev_jax.data import prompt_set  # noqa: E402
from tev_jax.sampling import Sampling  # noqa: E402

METHODS = ("DDTree", "ExitTrain + TEV")
COLORS = {"DDTree": "tab:blue", "ExitTrain + TEV": "tab:red"}


def plot_budget(results: dict, path: Path) -> dict:
    import matplotlib.pyplot as plt

    records, budgets = results["records"], results["budgets"]
    sets, temps = results["setup"]["sets"], results["setup"]["temperatures"]
    fig, axes = plt.subplots(2, len(temps), figsize=(5 * len(temps), 7), squeeze=False)
    data = {}
    for j, temp in enumerate(temps):
        for i, field in enumerate(("tau", "sr")):
            ax = axes[i, j]
            for m in METHODS:
                avg = [pc.set_average(records, field, sets, method=m, budget=b,
                                      temperature=temp) for b in budgets]
                data[f"{m} T={temp} {field}"] = avg
                ax.plot(budgets, avg, "o-", color=COLORS[m], lw=2, label=f"{m} (avg)")
                for s in sets:
                    vals = [pc.one(records, method=m, budget=b, temperature=temp, set=s)[field]
                            for b in budgets]
                    ax.plot(budgets, vals, "-", color=COLORS[m], lw=0.7, alpha=0.35)
            ax.set_xscale("log", base=2)
            ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.set_xlabel("tree budget B (nodes)")
            ax.set_ylabel("τ (accepted + 1 per round)" if field == "tau"
                          else "speed-up over AR")
            ax.set_title(f"T = {temp:g}: {'τ' if field == 'tau' else 'SR'} vs budget")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle("Budget robustness (drafters trained at B = 64); thin lines: single sets")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return data


def layout(parents: np.ndarray, n: int) -> np.ndarray:
    """y position of every node: leaves in depth-first order, parents centred."""
    kids = {i: [] for i in range(n)}
    for i in range(1, n):
        kids[int(parents[i])].append(i)
    y = np.zeros(n)
    nxt = [0]

    def walk(i):
        if not kids[i]:
            y[i] = nxt[0]
            nxt[0] += 1
        else:
            for c in kids[i]:
                walk(c)
            y[i] = np.mean([y[c] for c in kids[i]])

    walk(0)
    return y


def show_token(tokenizer, tok: int) -> str:
    text = tokenizer.decode([tok], skip_special_tokens=False)
    text = text.replace("\n", "⏎").replace(" ", "·")
    return text if len(text) <= 10 else text[:9] + "…"


def draw_tree(ax, tree: dict, tokenizer, title: str, wmax: float):
    import matplotlib.pyplot as plt

    n = len(tree["tokens"])
    parents, depths = np.asarray(tree["parents"]), np.asarray(tree["depths"])
    reach, w = np.asarray(tree["reach"]), np.asarray(tree["w"])
    y = -layout(parents, n)
    cmap = plt.get_cmap("magma_r")
    for i in range(1, n):
        p = parents[i]
        ax.plot([depths[p], depths[i]], [y[p], y[i]], "-", color="0.55",
                lw=0.4 + 6 * reach[i], zorder=1)
    ax.scatter(depths, y, s=40 + 500 * reach, c=w, cmap=cmap, vmin=0, vmax=wmax,
               edgecolors="k", linewidths=0.5, zorder=2)
    for i in range(n):
        note = f"  P={reach[i]:.2f} w={w[i]:.2f}" if (w[i] >= 0.02 or reach[i] >= 0.1) else ""
        radius = np.sqrt(40 + 500 * reach[i]) / 2  # points
        label = show_token(tokenizer, int(tree["tokens"][i])) + note
        if i == 0:  # the root's label goes to its left: to its right are its children
            ax.annotate(f"root {label.strip()}  ", (depths[i], y[i]),
                        xytext=(-radius - 3, 0), textcoords="offset points", fontsize=7,
                        va="center", ha="right", zorder=3)
            continue
        ax.annotate(label, (depths[i], y[i]), xytext=(radius + 3, 0),
                    textcoords="offset points", fontsize=7, va="center", zorder=3)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("depth")
    ax.set_yticks([])
    ax.set_xticks(range(int(max(depths)) + 1))  # depths are whole numbers
    ax.set_xlim(-1.6, max(depths) + 2.5)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)


def plot_exit_trees(models, args, path: Path) -> dict:
    import matplotlib.pyplot as plt
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    text = prompt_set(args.set)[args.prompt_index]
    prompt = pc.truncate(models.tokenizer.encode(text).ids, args.prompt_len)
    setup = pc.Setup(prompts_per_set=1, max_new_tokens=args.cut + 2,
                     prompt_len=args.prompt_len, stop=False, seed=args.seed)
    (context,) = pc.continuation_contexts(models, {args.set: [prompt]}, setup, [args.cut])
    sampling = Sampling(temperature=args.temperature)
    trees = {}
    for name in ("dflash", "ft_exit"):
        cap = pc.capture_trees(models, name, [context], args.tree_budget)
        law = pc.exit_laws(cap, sampling)
        valid = cap.tree.valid[0]
        n = int(valid.sum())
        trees[name] = dict(tokens=cap.tree.tokens[0, :n].tolist(),
                           parents=cap.tree.parents[0, :n].tolist(),
                           depths=cap.tree.depths[0, :n].tolist(),
                           reach=law.reach[0, :n].tolist(), w=law.w[0, :n].tolist(),
                           coverage=float(law.coverage[0]))
    draw_exit_trees(trees, context, models.tokenizer, args, path)
    return dict(context=context, trees=trees)


def draw_exit_trees(trees: dict, context, tokenizer, args, path: Path) -> None:
    """The two trees of `plot_exit_trees` side by side (also from a results.json:
    ``--replot``)."""
    import matplotlib.pyplot as plt
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    wmax = max(max(t["w"]) for t in trees.values())
    fig, axes = plt.subplots(1, 2, figsize=(15, 0.32 * args.tree_budget + 3))
    for ax, (name, t) in zip(axes, trees.items()):
        label = "DFlash drafter (DDTree)" if name == "dflash" else "ExitTrain drafter"
        draw_tree(ax, t, tokenizer,
                  f"{label}: coverage C = {t['coverage']:.2f}, 1 + C = "
                  f"{1 + t['coverage']:.2f}; lost at the root w = {t['w'][0]:.2f}", wmax)
    sm = ScalarMappable(norm=Normalize(0, wmax), cmap=plt.get_cmap("magma_r"))
    fig.colorbar(sm, ax=axes, fraction=0.02, label="exit weight w = P·ρ")
    tail = tokenizer.decode(context[-24:], skip_special_tokens=False)
    fig.suptitle(f"Where the tree loses target mass ({args.set} prompt {args.prompt_index} "
                 f"+ {args.cut} generated tokens, budget {args.tree_budget}, "
                 f"T = {args.temperature:g}); "
                 f"context ends: …{tail[-70:]!r}", fontsize=10)
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--target", default=str(pc.DEFAULT_TARGET))
    ap.add_argument("--drafters", default=str(pc.DEFAULT_DRAFTERS))
    ap.add_argument("--random-models", action="store_true")
    ap.add_argument("--budget-results", default=str(HERE.parent / "budget" / "results.json"))
    ap.add_argument("--set", default="gsm", choices=list(pc.SETS))
    ap.add_argument("--prompt-index", type=int, default=0)
    ap.add_argument("--cut", type=int, default=8, help="generated tokens before the root")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--tree-budget", type=int, default=24)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=str(HERE))
    ap.add_argument("--no-compile-cache", action="store_true")
    ap.add_argument("--replot", action="store_true",
                    help="redraw exit_tree.png from the trees in results.json (no models)")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    if args.replot:
        from tev_jax.data.tokenizer import load_default_tokenizer

        suffix = "_random" if args.random_models else ""
        saved = json.loads((Path(args.out_dir) / f"results{suffix}.json").read_text())
        draw_exit_trees(saved["exit_tree"]["trees"], saved["exit_tree"]["context"],
                        load_default_tokenizer(), args,
                        Path(args.out_dir) / f"exit_tree{suffix}.png")
        print(f"wrote {Path(args.out_dir) / f'exit_tree{suffix}.png'}")
        return
    started = time.time()
    pc.enable_compile_cache(args)
    out_dir = Path(args.out_dir)
    suffix = "_random" if args.random_models else ""
    result = {}
    budget_path = Path(args.budget_results)
    if budget_path.is_file():
        result["tau_vs_budget"] = plot_budget(json.loads(budget_path.read_text()),
                                              out_dir / f"tau_vs_budget{suffix}.png")
        result["budget_results"] = str(budget_path)
        print(f"wrote {out_dir / f'tau_vs_budget{suffix}.png'}")
    else:
        print(f"no budget results at {budget_path}: run experiments/budget/run.py first; "
              "skipping tau_vs_budget.png")
    models = pc.models_from_args(args, ("dflash", "ft_exit"))
    result["exit_tree"] = plot_exit_trees(models, args, out_dir / f"exit_tree{suffix}.png")
    result["models"] = models.describe()
    result["total_seconds"] = time.time() - started
    name = f"results{suffix}.json"
    (out_dir / name).write_text(json.dumps(result, indent=1))
    print(f"wrote {out_dir / f'exit_tree{suffix}.png'} and {out_dir / name}")


if __name__ == "__main__":
    main()
