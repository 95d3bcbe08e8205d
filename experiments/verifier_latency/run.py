"""Verifier-stage latency: TEV vs predraw vs sequential residual vs greedy vs the floor.

Times the jitted verifier stage alone (target logits given; the target forward pass is
excluded) on DDTree-shaped trees, for N in {33, 65, 129} slots, V in {32 000, 151 936},
T in {0.6, 1.0} and batch 1 and 8. The floor is one log-normaliser over the [N, V]
logits, which every exact verifier at T > 0 pays. Methods run round-robin inside each
configuration and every figure is a median over repeats, so the ratios come from the
same run under the same machine load.

    python experiments/verifier_latency/run.py            # full grid -> results.json
    python experiments/verifier_latency/run.py --quick    # N = 65 only -> results_quick.json
    python experiments/verifier_latency/run.py --table    # results.json as a markdown table
"""

from __future__ import annotations

import argparse
import functools
import heapq
import json
import os
import platform
import re
import time
from pathlib import Path

from tev_jax.runtime.platforms import quiet_start

if __name__ == "__main__":
    quiet_start()  # before jax is imported: no libtpu or CUDA plugin lines on a CPU

import jax
import jax.numpy as jnp
import numpy as np

from tev_jax import verify, vocab
from tev_jax.sampling import Sampling
from tev_jax.tree import make_tree
from tev_jax.vocab import log_normalizer, target_scores

HERE = Path(__file__).resolve().parent
HORIZON = 15  # DFlash block size 16
SLOW = ("predraw_gumbel", "predraw_cumsum_draws")
LSE = ("lse_two_stage", "lse_rowwise", "lse_naive")


def ddtree_like(budget: int, vocab: int, rng: np.random.Generator):
    """A best-first tree of ``budget`` nodes over synthetic per-depth draft log-probs.

    Like DDTree: candidates are (depth, rank-per-depth) sequences scored by the sum of
    their draft log-probs, popped from a heap, so the tree is prefix-closed and its
    slots are in best-first (topological) order.
    """
    k = min(budget, 32)
    toks = np.stack([rng.choice(vocab, k, replace=False) for _ in range(HORIZON)])
    logq = np.sort(np.log(rng.dirichlet(np.full(k, 0.3), HORIZON) + 1e-12), axis=-1)[:, ::-1]
    tokens, parents = [int(rng.integers(vocab))], [-1]
    heap = [(-logq[0, 0], 0, 0, 0)]  # (-score, parent slot, depth index, rank)
    while heap and len(tokens) <= budget:
        neg, parent, d, r = heapq.heappop(heap)
        slot = len(tokens)
        tokens.append(int(toks[d, r]))
        parents.append(parent)
        if r + 1 < k:
            heapq.heappush(heap, (neg + logq[d, r] - logq[d, r + 1], parent, d, r + 1))
        if d + 1 < HORIZON:
            heapq.heappush(heap, (neg - logq[d + 1, 0], slot, d + 1, 0))
    return tokens, parents


def make_inputs(n: int, vocab: int, batch: int, seed: int):
    rng = np.random.default_rng(seed)
    trees, logits = [], []
    for _ in range(batch):
        tokens, parents = ddtree_like(n - 1, vocab, rng)
        trees.append(make_tree(tokens, parents, n))
        x = rng.standard_normal((n, vocab), np.float32) * 2.0
        x[np.asarray(parents[1:]), np.asarray(tokens[1:])] += 6.0  # target agrees often
        logits.append(x)
    return trees, logits


def lse_rowwise(logits_NV, temperature):
    """One log-normaliser per row as a single fused row reduction (row max, then the sum
    of exp with the 1/T scaling fused in)."""
    x = logits_NV.astype(jnp.float32)
    m = jnp.max(x, axis=-1, keepdims=True)
    return jnp.log(jnp.sum(jnp.exp((x - m) * (1.0 / temperature)), axis=-1))


def lse_two_stage(logits_NV, sampling):
    """The library's log-normaliser: row max, per-128-block sums of exp, their sum."""
    return log_normalizer(target_scores(logits_NV, sampling))


def plain_inverse_cdf_draws(key, logits_NV, temperature):
    """The textbook predraw's draws: softmax, an [N, V] cumulative sum, a search per row.
    Only the N draws are timed (no walk), so this is a lower bound for that predraw."""
    p = jax.nn.softmax(logits_NV.astype(jnp.float32) / temperature, axis=-1)
    cum = jnp.cumsum(p, axis=-1)
    u = jax.random.uniform(key, logits_NV.shape[:-1])
    return jnp.sum(cum <= (u * cum[..., -1])[..., None], axis=-1)


def methods(sampling: Sampling):
    t = sampling.temperature
    return {
        "lse_two_stage": lambda k, tr, x: lse_two_stage(x, sampling),
        "lse_rowwise": lambda k, tr, x: lse_rowwise(x, t),
        "lse_naive": lambda k, tr, x: jax.nn.logsumexp(x / t, axis=-1),
        "tev": functools.partial(verify.tev, sampling=sampling, horizon=HORIZON),
        "predraw": functools.partial(verify.predraw, sampling=sampling, horizon=HORIZON),
        "predraw_gumbel": functools.partial(
            verify.predraw, sampling=sampling, horizon=HORIZON, method="gumbel"
        ),
        "predraw_cumsum_draws": lambda k, tr, x: plain_inverse_cdf_draws(k, x, t),
        "sequential_residual": functools.partial(
            verify.sequential_residual, sampling=sampling, horizon=HORIZON
        ),
        "greedy": lambda k, tr, x: verify.greedy(tr, x, horizon=HORIZON),
    }


def nv_buffers(compiled_text: str, n: int, vocab: int) -> int:
    """How many [.., N, V]-shaped f32 buffers the compiled program writes (fusion or op
    outputs, parameters excluded): 0 means the logits are only read."""
    pat = re.compile(rf"^\s*(ROOT\s+)?%\S+ = f32\[(\d+,)?{n},{vocab}\]")
    count = 0
    in_entry = False
    for line in compiled_text.splitlines():
        if line.startswith("ENTRY"):
            in_entry = True
        elif in_entry and line.startswith("}"):
            in_entry = False
        if in_entry and pat.match(line) and "parameter(" not in line:
            count += 1
    return count


def bench_config(n, vocab, temperature, batch, repeats, min_time, seed=0, skip=()):
    sampling = Sampling(temperature)
    trees, logits = make_inputs(n, vocab, batch, seed)
    keys = jax.random.split(jax.random.key(seed), batch)
    if batch == 1:
        args = (keys[0], trees[0], jnp.asarray(logits[0]))
    else:
        args = (keys, jax.tree.map(lambda *a: jnp.stack(a), *trees), jnp.asarray(np.stack(logits)))
    fns, compile_s, buffers = {}, {}, {}
    for name, fn in methods(sampling).items():
        if name in skip:
            continue
        f = jax.jit(fn if batch == 1 else jax.vmap(fn))
        t0 = time.perf_counter()
        compiled = f.lower(*args).compile()
        jax.block_until_ready(compiled(*args))
        compile_s[name] = time.perf_counter() - t0
        buffers[name] = nv_buffers(compiled.as_text(), n, vocab)
        fns[name] = compiled
    times = {name: [] for name in fns}
    order_rng = np.random.default_rng(seed)
    start = time.perf_counter()
    rounds = 0
    while rounds < repeats or (time.perf_counter() - start < min_time and rounds < 4 * repeats):
        # Round-robin in a fresh random order each round: every method sees the same
        # machine load, and none always runs right after one that allocates [B, N, V]
        # buffers (lse_naive at T != 1, the naive predraws), which slows the next call.
        for name in order_rng.permutation(list(fns)):
            f = fns[name]
            if rounds >= 3 and name in SLOW and sum(times[name]) > 5.0:
                continue  # the naive predraws are slow; 3+ repeats are enough for them
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[name].append(time.perf_counter() - t0)
        rounds += 1
    med = {name: float(np.median(ts)) * 1e3 for name, ts in times.items()}
    best = {name: float(np.min(ts)) * 1e3 for name, ts in times.items()}
    # The floor is the fastest way we have to take one log-normaliser per row.
    med["floor"] = min(med[k] for k in LSE if k in med)
    best["floor"] = min(best[k] for k in LSE if k in best)
    return {
        "N": n, "V": vocab, "T": temperature, "batch": batch,
        "median_ms": med,
        "min_ms": best,
        "ratio_to_floor_of_mins": {name: best[name] / best["floor"] for name in best},
        "repeats": {name: len(ts) for name, ts in times.items()},
        "ratio_to_floor": {name: med[name] / med["floor"] for name in med},
        "tev_over_predraw": med["tev"] / med["predraw"],
        "tev_over_predraw_gumbel": med["tev"] / med["predraw_gumbel"]
        if "predraw_gumbel" in med else None,
        "nv_buffers_written": buffers,
        "compile_s": compile_s,
    }


def markdown_table(results: dict) -> str:
    """The README's table: median ms of the floor and every method's ratio to it."""
    cols = ["tev", "predraw", "sequential_residual", "greedy", "predraw_gumbel",
            "predraw_cumsum_draws", "lse_two_stage", "lse_rowwise", "lse_naive"]
    head = "| N | V | T | B | floor ms | " + " | ".join(cols) + " | TEV / predraw |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results["rows"]:
        ratio = r["ratio_to_floor"]
        cells = [f"{ratio[c]:.2f}" if c in ratio else "-" for c in cols]
        lines.append(f"| {r['N']} | {r['V']} | {r['T']} | {r['batch']} | "
                     f"{r['median_ms']['floor']:.1f} | " + " | ".join(cells)
                     + f" | {r['tev_over_predraw']:.2f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N = 65, T = 1, batch 1, few repeats")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--min-time", type=float, default=2.0, help="seconds of timing per config")
    ap.add_argument("--out", default=None,
                    help="results file (default results.json, results_quick.json with --quick)")
    ap.add_argument("--config", help="one configuration N,V,T,B (e.g. 65,151936,0.6,8)")
    ap.add_argument("--skip", default="", help="comma-separated methods to leave out")
    ap.add_argument("--table", action="store_true", help="print --out as a markdown table")
    args = ap.parse_args()
    if args.out is None:
        args.out = str(HERE / ("results_quick.json" if args.quick else "results.json"))
    if args.table:
        print(markdown_table(json.loads(Path(args.out).read_text())))
        return
    if args.config:
        n, v, t, b = args.config.split(",")
        grid = [(int(n), int(v), float(t), int(b))]
        repeats, min_time = args.repeats, args.min_time
    elif args.quick:
        grid = [(65, v, 1.0, 1) for v in (32_000, 151_936)]
        repeats, min_time = 5, 0.5
    else:
        grid = [(n, v, t, b) for b in (1, 8) for v in (32_000, 151_936)
                for n in (33, 65, 129) for t in (0.6, 1.0)]
        repeats, min_time = args.repeats, args.min_time
    load_start = os.getloadavg()
    rows = []
    for n, v, t, b in grid:
        row = bench_config(n, v, t, b, repeats, min_time, skip=tuple(args.skip.split(",")))
        rows.append(row)
        m = row["median_ms"]
        print(f"N={n:4d} V={v:6d} T={t} B={b}: floor {m['floor']:8.2f} ms | "
              + " | ".join(f"{k} {row['ratio_to_floor'][k]:.2f}x" for k in m
                           if k != "floor" and k not in SLOW)
              + " | " + " | ".join(f"{k} {row['ratio_to_floor'][k]:.1f}x" for k in SLOW if k in m)
              + f" | tev/predraw {row['tev_over_predraw']:.2f}", flush=True)
    out = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "load_average_start": load_start,
            "load_average_end": os.getloadavg(),
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()],
        },
        "quick": args.quick,
        "horizon": HORIZON,
        "block": vocab.BLOCK,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
