"""CPU decode speed of the bundled models under each way of running the layers, in one
process: the layer scan (the default, one compiled layer body), the scan fully unrolled
(`tev_jax.models.layers.scan_unroll`, a body per layer as before the scan), and the KV
cache commit as one op over all layers instead of one layer at a time (the default,
`tev_jax.models.kv_cache.move_slots`).

Every variant of the fused generation is compiled ahead of time, then they are timed
round-robin (so load drift hits them alike); prints each one's median time, its compile
time and its ratio to the default (median of times, and median of per-repeat ratios).

    python experiments/round_bytes/cpu_speed.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import jax
import jax.numpy as jnp

from tev_jax.data.prompts import prompt_set
from tev_jax.decode import LEN_ALIGN, DecodeConfig
from tev_jax.engine import Engine
from tev_jax.models import kv_cache
from tev_jax.models.bundled import load_bundled
from tev_jax.models.layers import scan_unroll
from tev_jax.sampling import Sampling


def all_layers_at_once(x_LBS, src_BT, dst_BT):
    """`kv_cache.move_slots` as one gather and one scatter over every layer."""
    rows_B1 = jnp.arange(x_LBS.shape[1])[:, None]
    moved = x_LBS.at[:, rows_B1, src_BT].get(mode="fill", fill_value=0)
    return x_LBS.at[:, rows_B1, dst_BT].set(moved, mode="drop")


@contextlib.contextmanager
def commit_all_layers_at_once():
    default = kv_cache.move_slots
    kv_cache.move_slots = all_layers_at_once
    try:
        yield
    finally:
        kv_cache.move_slots = default


VARIANTS = {"scan": contextlib.nullcontext, "unrolled": lambda: scan_unroll(True),
            "all_layer_commit": commit_all_layers_at_once}


def compiled(engine: Engine, prompts, key, variant: str):
    """The fused generation compiled under one variant."""
    with VARIANTS[variant]():
        jax.clear_caches()
        t0 = time.perf_counter()
        exe = engine.lower("generate").compile()
        seconds = time.perf_counter() - t0
    print(f"{variant}: compiled in {seconds:.1f} s")
    args = (engine.params, prompts.tokens_BT, prompts.lengths_B, key)
    return lambda: jax.block_until_ready(exe(*args))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args(argv)
    target, drafter, tok = load_bundled()
    ids = [tok.encode(p).ids for p in prompt_set("humaneval")[: args.batch]]
    config = DecodeConfig(budget=32, verifier="tev", max_new_tokens=96,
                          sampling=Sampling(temperature=args.temperature))
    width = -(-max(len(x) for x in ids) // LEN_ALIGN) * LEN_ALIGN  # the prompt buffer
    engine = Engine.create(target, drafter, config, len(ids), prompt_len=width)
    prompts = engine.prompts(ids)
    key = jax.random.key(0)
    runs = {v: compiled(engine, prompts, key, v) for v in VARIANTS}
    outs = {v: run() for v, run in runs.items()}
    for v in runs:
        print(f"{v}: same tokens as scan: "
              f"{bool(jnp.array_equal(outs[v].out_BM, outs['scan'].out_BM))}")
    times = {v: [] for v in runs}
    for _ in range(args.repeats):
        for v, run in runs.items():
            t0 = time.perf_counter()
            run()
            times[v].append(time.perf_counter() - t0)
    med = {v: statistics.median(t) for v, t in times.items()}
    for v in runs:
        paired = statistics.median(a / b for a, b in zip(times[v], times["scan"]))
        print(f"{v:<17} median {med[v] * 1e3:8.1f} ms over {args.repeats} runs; "
              f"time / scan's {med[v] / med['scan']:.3f} (per-repeat median {paired:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
