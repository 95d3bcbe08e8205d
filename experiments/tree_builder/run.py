"""Jitted DDTree builder vs the heap builder (issue 3).

Two figures per budget, measured in one run, side by side and interleaved:
  (a) tree construction after the per-row top-K: jitted ``build_tree_from_topk`` vs the
      heap (``tev_jax/testing/heap_ddtree.py``, numpy + heapq) over the same top-K arrays;
  (b) the whole builder from raw logits: jitted ``build_tree`` (top-K included) vs the
      jitted top-K, a device->host copy and the heap, as DDTree does it.
Every measured case checks that both sides build the same trees, slot for slot.

    python experiments/tree_builder/run.py            # H=15, V=151936, budgets 32..1024
    python experiments/tree_builder/run.py --quick    # small and fast
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from tev_jax.runtime.platforms import quiet_start

if __name__ == "__main__":
    quiet_start()  # before jax is imported: no libtpu or CUDA plugin lines on a CPU

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's tev_jax
from tev_jax import ddtree  # noqa: E402
from tev_jax.testing.heap_ddtree import heap_build  # noqa: E402

FIELDS = ("tokens", "parents", "depths", "valid", "logq", "score")


@dataclasses.dataclass(frozen=True)
class Config:
    horizon: int = 15
    vocab: int = 151936
    budgets: tuple[int, ...] = (32, 64, 128, 256, 512, 1024)
    batches: tuple[int, ...] = (1, 8)
    repeats: int = 15
    seed: int = 0
    out: str = str(Path(__file__).with_name("results.json"))


def draft_logits(rng, batch: int, horizon: int, vocab: int) -> np.ndarray:
    """Gaussian logits (std 3) with one boosted token per row (top-1 mass ~0.3-0.9)."""
    x = rng.standard_normal((batch, horizon, vocab), dtype=np.float32) * 3.0
    boost = rng.uniform(18.0, 24.0, size=(batch, horizon)).astype(np.float32)
    idx = rng.integers(vocab, size=(batch, horizon))
    np.put_along_axis(x, idx[..., None], (np.take_along_axis(x, idx[..., None], -1)
                                          + boost[..., None]), -1)
    return x


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def timed_both(fn):
    """(wall seconds, process CPU seconds): CPU time is steadier on a shared machine."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def ready(x):
    return jax.block_until_ready(x)


def as_numpy(built) -> list[dict[str, np.ndarray]]:
    tree, info = built
    arrays = [np.asarray(a) for a in (tree.tokens, tree.parents, tree.depths, tree.valid,
                                      info.logq, info.score)]
    return [{f: a[b] for f, a in zip(FIELDS, arrays)} for b in range(arrays[0].shape[0])]


def same_trees(jitted: list[dict], heap: list[dict]) -> bool:
    return all(np.array_equal(j[f], h[f]) for j, h in zip(jitted, heap) for f in FIELDS)


def heap_trees(tokens_BHK, logq_BHK, roots, budget):
    return [heap_build(tokens_BHK[b], logq_BHK[b], int(roots[b]), budget)
            for b in range(len(roots))]


def measure(cfg: Config, budget: int, batch: int, logits_BHV, roots_B) -> dict:
    """Compile times, then interleaved repeats of the four timed paths."""
    k = min(budget, cfg.vocab)
    topk = jax.jit(jax.vmap(ddtree.topk_logq, in_axes=(0, None)), static_argnums=1)
    post = jax.jit(jax.vmap(ddtree.build_tree_from_topk, in_axes=(0, 0, 0, None)),
                   static_argnums=3)
    whole = jax.jit(jax.vmap(ddtree.build_tree, in_axes=(0, 0, None)), static_argnums=2)

    compile_s = {}
    compile_s["topk"], (tok_d, logq_d) = timed(lambda: ready(topk(logits_BHV, k)))
    compile_s["post_topk"], _ = timed(lambda: ready(post(tok_d, logq_d, roots_B, budget)))
    compile_s["whole"], _ = timed(lambda: ready(whole(logits_BHV, roots_B, budget)))
    tok_h, logq_h = np.asarray(tok_d), np.asarray(logq_d)
    roots_h = np.asarray(roots_B)

    def run_post():
        return ready(post(tok_d, logq_d, roots_B, budget))

    def run_heap():
        return heap_trees(tok_h, logq_h, roots_h, budget)

    def run_whole():
        return ready(whole(logits_BHV, roots_B, budget))

    def run_reference():  # jitted top-K, copy to host, heap: what DDTree does
        t, lq = ready(topk(logits_BHV, k))
        return heap_trees(np.asarray(t), np.asarray(lq), roots_h, budget)

    same = {"a": same_trees(as_numpy(run_post()), run_heap()),
            "b": same_trees(as_numpy(run_whole()), run_reference())}
    times = {name: [] for name in ("post", "heap", "whole", "reference")}
    cpu = {name: [] for name in times}
    for _ in range(cfg.repeats):
        for name, fn in (("post", run_post), ("heap", run_heap),
                         ("whole", run_whole), ("reference", run_reference)):
            wall, proc = timed_both(fn)
            times[name].append(wall)
            cpu[name].append(proc)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    med_cpu = {name: statistics.median(ts) for name, ts in cpu.items()}
    return {
        "budget": budget, "batch": batch, "same_trees": same,
        "compile_s": compile_s,
        "median_s": med,
        "min_s": {name: min(ts) for name, ts in times.items()},
        "median_cpu_s": med_cpu,
        "per_tree_us": {name: 1e6 * t / batch for name, t in med.items()},
        "ratio_a": med["heap"] / med["post"],
        "ratio_b": med["reference"] / med["whole"],
        "ratio_a_cpu": med_cpu["heap"] / med_cpu["post"],
        "ratio_b_cpu": med_cpu["reference"] / med_cpu["whole"],
        "loadavg": os.getloadavg()[0],
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="V=4096, budgets 32/256, 3 repeats")
    parser.add_argument("--budgets", type=int, nargs="*")
    parser.add_argument("--batches", type=int, nargs="*")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    cfg = Config()
    if args.quick:
        cfg = dataclasses.replace(cfg, vocab=4096, budgets=(32, 256), repeats=3,
                                  out=str(Path(cfg.out).with_name("results_quick.json")))
    for field in ("budgets", "batches"):
        if getattr(args, field):
            cfg = dataclasses.replace(cfg, **{field: tuple(getattr(args, field))})
    if args.repeats:
        cfg = dataclasses.replace(cfg, repeats=args.repeats)
    if args.out:
        cfg = dataclasses.replace(cfg, out=args.out)

    rng = np.random.default_rng(cfg.seed)
    logits = draft_logits(rng, max(cfg.batches), cfg.horizon, cfg.vocab)
    ddtree.check_draft_logits(logits, max(cfg.budgets))
    roots = rng.integers(cfg.vocab, size=max(cfg.batches)).astype(np.int32)
    rows = []
    header = (f"{'budget':>6} {'batch':>5} | {'(a) jit':>9} {'heap':>9} {'ratio':>6} {'cpu':>6} | "
              f"{'(b) jit':>9} {'ref':>9} {'ratio':>6} {'cpu':>6} | compile a/b (s) | load | same")
    print(f"H={cfg.horizon} V={cfg.vocab}; per-tree wall microseconds (median of "
          f"{cfg.repeats}); ratios = reference / jitted, by wall time and by process CPU time")
    print(header)
    for budget in cfg.budgets:
        for batch in cfg.batches:
            logits_d = jnp.asarray(logits[:batch])
            roots_d = jnp.asarray(roots[:batch])
            row = measure(cfg, budget, batch, logits_d, roots_d)
            rows.append(row)
            pt = row["per_tree_us"]
            same = "yes" if all(row["same_trees"].values()) else f"NO {row['same_trees']}"
            print(f"{budget:>6} {batch:>5} | {pt['post']:>9.0f} {pt['heap']:>9.0f} "
                  f"{row['ratio_a']:>5.2f}x {row['ratio_a_cpu']:>5.2f}x | {pt['whole']:>9.0f} "
                  f"{pt['reference']:>9.0f} {row['ratio_b']:>5.2f}x {row['ratio_b_cpu']:>5.2f}x | "
                  f"{row['compile_s']['post_topk']:>6.2f} {row['compile_s']['whole']:>6.2f} | "
                  f"{row['loadavg']:>4.1f} | {same}", flush=True)
    result = {
        "config": dataclasses.asdict(cfg),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "jax": jax.__version__, "backend": jax.default_backend(),
                    "loadavg_end": os.getloadavg()},
        "rows": rows,
    }
    Path(cfg.out).write_text(json.dumps(result, indent=1))
    if not all(all(r["same_trees"].values()) for r in rows):
        raise SystemExit("the jitted and heap builders disagreed on some tree")


if __name__ == "__main__":
    main()
