"""CPU decode speed of the bundled models with the cache updated one layer at a time
(what accelerators do, `tev_jax.models.kv_cache.layer_by_layer`) against one op over all
layers (what XLA:CPU does, as before the per-layer updates), in one process.

Both variants of the fused generation are compiled ahead of time, then timed
round-robin (so load drift hits them alike); prints the ratio of median times and the
median of the per-repeat ratios.

    python experiments/round_bytes/cpu_speed.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp

from tev_jax.data.prompts import prompt_set
from tev_jax.decode import LEN_ALIGN, DecodeConfig
from tev_jax.engine import Engine
from tev_jax.models import kv_cache
from tev_jax.models.bundled import load_bundled
from tev_jax.sampling import Sampling


def compiled(engine: Engine, prompts, key, per_layer: bool):
    """The fused generation compiled with per-layer cache updates or with one op over all
    layers."""
    default = kv_cache.layer_by_layer
    kv_cache.layer_by_layer = lambda: per_layer
    try:
        jax.clear_caches()
        t0 = time.perf_counter()
        exe = engine.lower("generate").compile()
        print(f"per_layer={per_layer}: compiled in {time.perf_counter() - t0:.1f} s")
    finally:
        kv_cache.layer_by_layer = default
    args = (engine.params, *dataclasses.astuple(prompts), key)
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
    runs = {"per_layer": compiled(engine, prompts, key, True),
            "all_layers": compiled(engine, prompts, key, False)}
    outs = {v: run() for v, run in runs.items()}
    same = bool(jnp.array_equal(outs["per_layer"].out_BM, outs["all_layers"].out_BM))
    times = {v: [] for v in runs}
    for _ in range(args.repeats):
        for v, run in runs.items():
            t0 = time.perf_counter()
            run()
            times[v].append(time.perf_counter() - t0)
    med = {v: statistics.median(t) for v, t in times.items()}
    paired = statistics.median(a / b for a, b in zip(times["all_layers"], times["per_layer"]))
    print(f"same tokens: {same}")
    for v in runs:
        print(f"{v:<11} median {med[v] * 1e3:8.1f} ms over {args.repeats} runs")
    print(f"speed per_layer / all_layers = {med['all_layers'] / med['per_layer']:.3f} "
          f"(median of per-repeat ratios {paired:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
