"""Times the AR step and a DDTree-32 + TEV round on the GPUs of this machine, beside the
roofline the plan gives for the same programs (run it where GPUs are at hand).

Random bfloat16 weights of a preset (Qwen3-8B by default) and a 1-layer DFlash drafter,
tensor-parallel over every local GPU, prompt buffer 1024 (random prompts of 1000
tokens), cache 2048, T = 0: the prefill, then ``--repeats`` rounds timed one by one
(`Engine.round`, each waited for) after one untimed warm-up; the median. A round's work
does not depend on the weights or on what it accepts (static shapes). The roofline is
`tev_jax.costs.plan.ProgramReport.roofline_seconds` of the same engine's compiled round on the
local GPU's figures (`tev_jax.costs.chips.GPUS`, found by ``device_kind``).

    pip install -e . "jax[cuda12]==0.10.2"
    python experiments/gpu/time_gpu.py --batch 1,8,32 --out experiments/gpu/timings.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tev_jax import sharding as shd
from tev_jax.costs import plan
from tev_jax.costs.chips import chip_of
from tev_jax.decode import DecodeConfig
from tev_jax.engine import Engine
from tev_jax.models import init_target
from tev_jax.models.drafter import Drafter
from tev_jax.models.layers import jitted_initializer

PROMPT_LEN, CACHE_LEN, PROMPT_TOKENS = 1024, 2048, 1000


def models(name: str, mesh):
    cfg = plan.preset(name)
    target = init_target(cfg, key=0, dtype=jnp.bfloat16, mesh=mesh)
    dcfg = plan.drafter_config(cfg)
    graphdef, init = jitted_initializer(Drafter, dcfg, jnp.bfloat16, mesh, shd.DEFAULT_RULES)
    return target, nnx.merge(graphdef, init(jax.random.key(1)))


def time_rounds(engine: Engine, repeats: int, seed: int = 0) -> list[float]:
    rng = np.random.default_rng(seed)
    vocab = engine.vocab_size
    prompts = engine.prompts([rng.integers(0, vocab, PROMPT_TOKENS).tolist()
                              for _ in range(engine.spec.batch_size)])
    st = engine.prefill(prompts, jax.random.key(seed))
    st = jax.block_until_ready(engine.round(st))      # compile and warm up
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        st = jax.block_until_ready(engine.round(st))
        seconds.append(time.perf_counter() - t0)
    return seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-8b", choices=sorted(plan.PRESETS))
    ap.add_argument("--batch", default="1,8,32", help="comma-separated batch sizes")
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None, metavar="JSON")
    args = ap.parse_args(argv)
    devices = jax.devices()
    if devices[0].platform != "gpu":
        raise SystemExit(f"needs GPUs; this machine has {devices[0].platform} devices")
    chip = chip_of(devices[0].device_kind)
    mesh = shd.make_mesh(tensor=len(devices), fsdp=1) if len(devices) > 1 else None
    target, drafter = models(args.model, mesh)
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        for budget in (None, args.budget):
            n = budget + 1 if budget else 1
            config = DecodeConfig(builder="ddtree" if budget else "none", budget=budget or 1,
                                  verifier="tev", prompt_len=PROMPT_LEN,
                                  max_cache_len=CACHE_LEN,
                                  max_new_tokens=CACHE_LEN - PROMPT_LEN - n)
            engine = Engine.create(target, drafter if budget else None, config, batch,
                                   mesh=mesh)
            report = plan.ProgramReport.of(engine.lower("round").compile())
            seconds = time_rounds(engine, args.repeats)
            rows.append({"model": args.model, "gpus": len(devices),
                         "device_kind": devices[0].device_kind, "batch": batch,
                         "budget": budget, "median_seconds": statistics.median(seconds),
                         "seconds": seconds,
                         "roofline_seconds": report.roofline_seconds(chip),
                         "flops": report.flops, "bytes_accessed": report.bytes_accessed})
            r = rows[-1]
            roof = r["roofline_seconds"]
            print(f"{args.model} B {batch} {'AR' if budget is None else f'b {budget}'}: "
                  f"{r['median_seconds'] * 1e3:.2f} ms measured, "
                  f"{'-' if roof is None else f'{roof * 1e3:.2f}'} ms roofline", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
