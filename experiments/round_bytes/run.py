"""Bytes and FLOPs of one decode round against their floors, compiled for a TPU slice.

Compiles the fused rounds loop (`Engine.lower("run_rounds")`, as continuous batching and
the fused generation run it) of an AR step and of a DDTree + TEV round for a real model
size at full depth, bf16, with libtpu on this CPU machine, and reads per chip:

- the compiler's totals of the call (``cost_analysis``: a loop body counted once);
- per round, from the per-op table (`tev_jax.costs.op_costs`): bytes in every memory space
  (the compiler's way) and in HBM only, FLOPs;
- the floors: the bytes a round must read (the parameters it uses, i.e. all but an
  untied embedding table, and both KV caches, per chip from their shardings) and the
  compute floor (the target's matrix products over the round's tokens,
  2 x parameters x B x N FLOPs, N the tree slots, 1 for AR, at the chip's peak);
- the roofline of a round, ``max(FLOPs / peak, HBM bytes / bandwidth)``.

    JAX_PLATFORMS=cpu python experiments/round_bytes/run.py [--layers 36] [--ops 12]

Prints a table and writes ``results.json`` next to this file (``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tev_jax.runtime.platforms import quiet_start

if __name__ == "__main__":
    quiet_start()  # before jax is imported: no libtpu or CUDA plugin lines on a CPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tev_jax import sharding as shd
from tev_jax.costs import chips, op_costs, plan
from tev_jax.decode import STAGES, DecodeConfig  # noqa: E402
from tev_jax.engine import Engine  # noqa: E402
from tev_jax.models.kv_cache import CACHE_AXES  # noqa: E402

HERE = Path(__file__).parent


def shard_bytes(tree, skip=()) -> int:
    """Per-device bytes of the abstract leaves of ``tree`` (their shardings' shard shapes),
    leaving out leaves whose path names one of ``skip``."""
    total = 0
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        if any(s in jax.tree_util.keystr(path) for s in skip):
            continue
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return total


def kv_bytes(engine: Engine) -> int:
    """Per-device bytes of the target's and the drafter's key/value caches, laid out by
    their logical axes (`tev_jax.models.kv_cache.CACHE_AXES`) as the decode loop pins them."""
    st = engine.abstract_state()
    buffers = [st.cache.k, st.cache.v]
    if hasattr(st.ctx, "k"):  # a DFlash drafter's context cache (AR keeps none)
        buffers += [st.ctx.k, st.ctx.v]
    mesh = engine.mesh
    return shard_bytes([jax.ShapeDtypeStruct(
        x.shape, x.dtype,
        sharding=None if mesh is None else shd.logical_sharding(CACHE_AXES, x.shape, mesh))
        for x in buffers])


def floor_bytes(engine: Engine, tied: bool) -> dict[str, int]:
    """What one round must read per chip: the weights it uses and the KV caches."""
    weights = shard_bytes(engine.params, skip=() if tied else ("embed_tokens",))
    return {"weights": weights, "kv": kv_bytes(engine)}


def measure(cfg, config: DecodeConfig, batch: int, mesh, chip, top: int) -> dict:
    target, drafter = plan.abstract_models(cfg, config, dtype=jnp.bfloat16)
    engine = Engine.create(target, drafter, config, batch, mesh=mesh)
    t0 = time.perf_counter()
    compiled = engine.lower("run_rounds").compile()
    seconds = time.perf_counter() - t0
    cost = compiled.cost_analysis()
    ops = op_costs.op_costs(compiled.as_text())
    t = op_costs.totals(ops)
    floor = floor_bytes(engine, cfg.tie_word_embeddings)
    floor_total = sum(floor.values())
    untied = () if cfg.tie_word_embeddings else ("embed_tokens",)
    target_params = shard_bytes(engine.params[0], skip=untied) // 2  # bf16
    compute_s = 2 * target_params * batch * engine.spec.num_slots / chip.peak_flops
    flops_s = t["loop_flops"] / chip.peak_flops
    hbm_s = t["loop_hbm_bytes"] / chip.hbm_bandwidth
    return {
        "compile_seconds": seconds,
        "compiler": {"flops": cost.get("flops"), "bytes_accessed": cost.get("bytes accessed")},
        "per_round": {k[5:]: v for k, v in t.items() if k.startswith("loop_")},
        "once_per_call": {k: t[k] - t["loop_" + k] for k in ("bytes", "hbm_bytes", "flops")},
        "floor_bytes": floor,
        "hbm_over_floor": t["loop_hbm_bytes"] / floor_total,
        "roofline_seconds": max(flops_s, hbm_s),
        "compute_floor_seconds": compute_s,
        "floor_seconds": max(compute_s, floor_total / chip.hbm_bandwidth),
        "stages": op_costs.by_stage(ops, STAGES),
        "table": op_costs.format_table(ops, top, STAGES),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--layers", type=int, default=None, help="default: the full depth")
    ap.add_argument("--topology", default="v5e:2x4")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--cache-len", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--ops", type=int, default=12, help="ops listed per table")
    ap.add_argument("--out", default=str(HERE / "results.json"))
    args = ap.parse_args(argv)

    cfg = plan.preset(args.model, num_layers=args.layers)
    mesh, tpu = chips.slice_mesh(args.topology, tensor=len(chips.slice_devices(
        args.topology).devices))
    base = DecodeConfig(budget=args.budget, verifier="tev", prompt_len=1024,
                        max_cache_len=args.cache_len, max_new_tokens=256)
    rows = {}
    for name, config in (("ar_step", dataclasses.replace(base, builder="none")),
                         (f"ddtree{args.budget}_tev", base)):
        r = measure(cfg, config, args.batch, mesh, tpu.chip, args.ops)
        rows[name] = r
        fl = sum(r["floor_bytes"].values())
        pr = r["per_round"]
        print(f"\n{name}: compiled in {r['compile_seconds']:.0f} s; compiler per call "
              f"{r['compiler']['bytes_accessed'] / 1e9:.2f} GB, "
              f"{r['compiler']['flops'] / 1e9:.1f} GFLOP")
        print(f"  per round: {pr['hbm_bytes'] / 1e9:.3f} GB HBM ({pr['bytes'] / 1e9:.3f} GB all "
              f"memories), {pr['flops'] / 1e9:.1f} GFLOP; floor {fl / 1e9:.3f} GB (weights "
              f"{r['floor_bytes']['weights'] / 1e9:.3f}, KV {r['floor_bytes']['kv'] / 1e9:.3f})"
              f" -> HBM / floor {r['hbm_over_floor']:.2f}")
        print(f"  roofline {r['roofline_seconds'] * 1e3:.2f} ms; compute floor "
              f"{r['compute_floor_seconds'] * 1e3:.2f} ms; floor "
              f"{r['floor_seconds'] * 1e3:.2f} ms")
        print(r["table"])
    record = {"model": args.model, "layers": cfg.num_layers, "topology": args.topology,
              "batch": args.batch, "cache_len": args.cache_len, "budget": args.budget,
              "chip": dataclasses.asdict(tpu.chip), "programs": rows}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
