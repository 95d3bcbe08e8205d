"""Batch generation throughput: one prompt at a time vs static batches vs continuous batching.

On the bundled models (ExitTrain drafter, DDTree budget 64 + TEV, and plain AR
decoding of the same target), T = 0, at most ``--max-new-tokens`` (128) new tokens with
the stop tokens <|end|> / <|eos|>: ``--num-prompts`` (256) prompts drawn evenly from the
four bundled evaluation sets (mixed lengths: 24 to 576 tokens):

(a) one prompt at a time: `engine.generate` per prompt (batch 1);
(b) static batches: `engine.generate` on consecutive chunks of B prompts, each chunk
    running until its longest row is done;
(c) continuous batching: `continuous.generate_continuous` with B slots.

Every method pads a prompt (or a chunk's prompts) to the same width buckets
(`slots.width_buckets` of the longest prompt) and uses one cache length, so the
comparison is of the batching alone.

Every program is compiled before the clock starts (a first call per shape; for (c) every
(rows, width) refill bucket and the rounds program), so tokens/s are steady-state
decoding. Both wall and CPU seconds (all threads of the process) are recorded: on a
machine shared with other jobs the CPU seconds, the work done, vary much less. Greedy
outputs are compared token for token across all methods (AR included: the verifier is
exact). Results -> results.json (``--out``, rewritten after every run); figures in
README.md.

    python -m experiments.batch_generate.run                       # the full run
    python -m experiments.batch_generate.run --num-prompts 32 --batch-sizes 8 \\
        --single-prompts 0 --out results_quick.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from pathlib import Path

from tev_jax.runtime.platforms import quiet_start

if __name__ == "__main__":
    quiet_start()  # before jax is imported: no libtpu or CUDA plugin lines on a CPU

import jax
import numpy as np

from tev_jax import decode, engine, slots
from tev_jax.batch import continuous
from tev_jax.data.prompts import PROMPT_SETS, prompt_set
from tev_jax.data.tokenizer import STOP_IDS
from tev_jax.engine import Engine
from tev_jax.models import load_bundled
from tev_jax.prompts import Request

HERE = Path(__file__).resolve().parent


def mixed_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts, an equal share from each evaluation set, in a shuffled order."""
    rng = np.random.default_rng(seed)
    per_set = -(-n // len(PROMPT_SETS))
    picked = []
    for name in PROMPT_SETS:
        texts = prompt_set(name)
        picked += [texts[i] for i in rng.choice(len(texts), per_set, replace=False)]
    order = rng.permutation(len(picked))[:n]
    return [tokenizer.encode(picked[i]).ids for i in order]


class Clock:
    """Wall and CPU seconds (all threads of this process) since creation."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def read(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


def static_batches(target, drafter, prompts, config, b):
    """`engine.generate` on chunks of ``b`` prompts, each padded to its width bucket."""
    chunks = [prompts[i: i + b] for i in range(0, len(prompts), b)]
    widths = slots.width_buckets(config.prompt_len)
    configs = [dataclasses.replace(
        config, prompt_len=next(w for w in widths if w >= max(map(len, c)))) for c in chunks]
    for size, cfg in {(len(c), cfg) for c, cfg in zip(chunks, configs)}:  # compile
        engine.generate(target, drafter, [[1]] * size, cfg)
    clock = Clock()
    rows, rounds, blocks, row_rounds = [], 0, 0.0, 0
    for chunk, cfg in zip(chunks, configs):
        g = engine.generate(target, drafter, chunk, cfg)
        rows += g.rows()
        rounds += int(g.stats.rounds_per_row.sum())
        blocks += float(g.stats.block_lengths.sum())
        row_rounds += b * g.stats.rounds
    # occupancy: the share of row-rounds spent on unfinished rows (1 / occupancy bounds
    # what refilling finished rows can gain)
    return rows, clock.read(), blocks / max(rounds, 1), rounds / max(row_rounds, 1)


def warm_up_continuous(target, drafter, config, b, widths):
    """Compiles every refill bucket and the rounds program of ``b`` slots."""
    eng = Engine.create(target, drafter, config, b)
    axes = eng.slot_axes()
    st = eng.empty_slots(jax.random.key(0))
    for k in slots.row_buckets(b):
        for t in widths:
            st = eng.refill(st, np.ones((k, t), np.int32), np.ones((k,), np.int32),
                            np.arange(k, dtype=np.int32), jax.random.key(1), axes=axes)
    jax.block_until_ready(eng.run_rounds(st, b, 1))


def continuous_batches(target, drafter, prompts, config, b):
    widths = slots.width_buckets(config.prompt_len)
    warm_up_continuous(target, drafter, config, b, widths)
    requests = [Request(i, p) for i, p in enumerate(prompts)]
    clock = Clock()
    results = {r.id: r for r in continuous.generate_continuous(
        target, drafter, requests, config, batch_size=b, widths=widths)}
    seconds = clock.read()
    ran = [r for r in results.values() if r.rounds]
    tau = sum(r.tau * r.rounds for r in ran) / max(sum(r.rounds for r in ran), 1)
    return [results[i].token_ids for i in range(len(prompts))], seconds, tau, None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", default="8,32")
    parser.add_argument("--methods", default="ar,spec", help="ar, spec (DDTree + TEV)")
    parser.add_argument("--single-prompts", type=int, default=32,
                        help="(a), one prompt at a time (the slowest), on the first this "
                             "many prompts only (0: skip)")
    parser.add_argument("--out", default="results.json")
    args = parser.parse_args(argv)

    target, drafter, tokenizer = load_bundled()
    prompts = mixed_prompts(tokenizer, args.num_prompts)
    prompt_len = -(-max(map(len, prompts)) // 8) * 8
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    base = decode.DecodeConfig(max_new_tokens=args.max_new_tokens, budget=64, verifier="tev",
                               stop_token_ids=STOP_IDS, prompt_len=prompt_len)
    methods = {"ar": dataclasses.replace(base, builder="none"), "spec": base}
    for name, config in methods.items():  # one cache length per method, every batching
        max_len = Engine.create(target, drafter, config, 1).spec.max_len
        methods[name] = dataclasses.replace(config, max_cache_len=max_len)
    lengths = [len(p) for p in prompts]
    out = {"rows": [], "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
           "prompt_len": prompt_len, "prompt_lengths": [min(lengths), int(np.median(lengths)),
                                                        max(lengths)],
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                       "jax": jax.__version__}}
    rows, reference = out["rows"], None
    for name in args.methods.split(","):
        config = methods[name]
        d = drafter if name == "spec" else None
        runs = []
        for b in sizes:
            runs += [("static", b, static_batches, (b,)), ("continuous", b, continuous_batches, (b,))]
        if args.single_prompts:
            runs.append(("one at a time", 1, static_batches, (1,)))
        for how, b, fn, extra in runs:
            subset = prompts[: args.single_prompts] if how == "one at a time" else prompts
            outputs, (wall, cpu), tau, occupancy = fn(target, d, subset, config, *extra)
            tokens = sum(map(len, outputs))
            if reference is None:
                reference = outputs
                out["output_lengths"] = [len(o) for o in reference]
            same = sum(o == r for o, r in zip(outputs, reference))
            row = {"method": name, "batching": how, "batch": b, "prompts": len(subset),
                   "tokens": tokens, "seconds": round(wall, 2),
                   "tokens_per_s": round(tokens / wall, 2), "cpu_seconds": round(cpu, 2),
                   "tokens_per_cpu_s": round(tokens / cpu, 2), "tau": round(tau, 3),
                   "identical_outputs": same,
                   "occupancy": None if occupancy is None else round(occupancy, 3),
                   "load_avg": round(os.getloadavg()[0], 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            (HERE / args.out).write_text(json.dumps(out, indent=1) + "\n")
    for name in args.methods.split(","):
        for b in sizes:
            get = {r["batching"]: r for r in rows if r["method"] == name and r["batch"] == b}
            wall, cpu = (get["continuous"][k] / get["static"][k]
                         for k in ("tokens_per_s", "tokens_per_cpu_s"))
            print(f"{name} B={b}: continuous / static = {wall:.2f}x tokens/s, "
                  f"{cpu:.2f}x tokens per CPU second")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
