"""CPU decode speed of the bundled models: per-layer cache writes (main) against one
scatter over all layers (the layout before `tev_jax.models.kv_cache.set_slots`), in one
process.

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
from tev_jax.decode import DecodeConfig
from tev_jax.engine import Engine
from tev_jax.models import drafter as dflash
from tev_jax.models import kv_cache
from tev_jax.models.bundled import load_bundled
from tev_jax.sampling import Sampling


def all_layers_set(x_LBS, slots_BT, new_LBT):
    rows_B1 = jnp.arange(x_LBS.shape[1])[:, None]
    return x_LBS.at[:, rows_B1, slots_BT].set(new_LBT.astype(x_LBS.dtype), mode="drop")


def all_layers_get(x_LBS, slots_BT):
    rows_B1 = jnp.arange(x_LBS.shape[1])[:, None]
    return x_LBS.at[:, rows_B1, slots_BT].get(mode="fill", fill_value=0)


def compiled(engine: Engine, prompts, key, variant: str):
    """The fused generation compiled with ``variant``'s cache writes."""
    per_layer = (kv_cache.set_slots, kv_cache.get_slots)
    if variant == "all_layers":
        kv_cache.set_slots, kv_cache.get_slots = all_layers_set, all_layers_get
        dflash.set_slots = all_layers_set
    try:
        jax.clear_caches()
        exe = engine.lower("generate").compile()
    finally:
        kv_cache.set_slots, kv_cache.get_slots = per_layer
        dflash.set_slots = per_layer[0]
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
    engine = Engine.create(target, drafter, config, len(ids),
                           prompt_len=max(len(x) for x in ids))
    prompts = engine.prompts(ids)
    key = jax.random.key(0)
    runs = {v: compiled(engine, prompts, key, v) for v in ("per_layer", "all_layers")}
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
