"""Decoding at scale on 8 simulated CPU devices: per-device memory and mesh speed.

(a) memory: the fused speculative generation (DDTree budget 64 + TEV, T = 1, prompt
    buffer 2944, cache 4096, 1-layer DFlash drafter with block 16) compiled on abstract
    Qwen3-4B / Qwen3-8B shapes with 2 target layers, for batch 1 / 8 / 32, float32 and
    bfloat16, on one device and on the meshes tensor 8, data 2 x tensor 4, data 8,
    fsdp 8 and data 2 x fsdp 2 x tensor 2. XLA's per-device figures
    (`tev_jax.plan.plan_decode`) plus the full-depth extrapolation: layers reuse
    scratch, so temporary memory stays that of 2 layers (checked once with 4 layers),
    while arguments and outputs grow by one layer's parameters and KV cache shard per
    device and layer (from the shardings of the logical rules).
(b) speed (informational): tokens/s of the bundled demo models, 8 prompts, greedy,
    single device vs each mesh (CPU devices share the same cores, so meshes do not
    speed anything up here; the point is that they run).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python -m experiments.scale.run [--quick] [--only memory|speed]

Writes experiments/scale/results.json (or results_quick.json; with --only, the other part
of an existing file is kept) and prints the tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tev_jax import decode, plan, sharding
from tev_jax.models.kv_cache import cache_shardings
from tev_jax.sampling import Sampling

HERE = Path(__file__).resolve().parent
MESHES = {"1 device": None, "tensor 8": dict(tensor=8), "data 2 x tensor 4": dict(data=2, tensor=4),
          "data 8": dict(data=8, fsdp=1), "fsdp 8": dict(fsdp=8),
          "2 x 2 x 2": dict(data=2, fsdp=2, tensor=2)}
PLAN_LAYERS = 2
GiB = plan.GiB


def _mesh(name):
    spec = MESHES[name]
    return None if spec is None else sharding.make_mesh(**spec)


def layer_bytes(cfg, dtype, batch: int, cache_len: int, mesh) -> tuple[int, int]:
    """(parameter bytes, KV-cache bytes) of one target layer on one device."""
    one = plan.with_layers(cfg, 1)
    target = plan.abstract_target(one, dtype)
    layer = nnx.state(target.layers[0])
    leaves = jax.tree.leaves(layer)
    if mesh is None:
        params = sum(x.size * x.dtype.itemsize for x in leaves)
        cache = 2 * math.prod((batch, cache_len, cfg.num_kv_heads, cfg.head_dim))
        return params, cache * jnp.dtype(dtype).itemsize
    shards = jax.tree.leaves(sharding.state_shardings(layer, mesh))
    params = sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
                 for x, s in zip(leaves, shards))
    shape = (1, batch, cache_len, cfg.num_kv_heads, cfg.head_dim)
    per = math.prod(cache_shardings(one, batch, cache_len, mesh).k.shard_shape(shape))
    return params, 2 * per * jnp.dtype(dtype).itemsize


def memory_rows(models, dtypes, batches, meshes, config) -> list[dict]:
    rows = []
    for model in models:
        cfg = plan.preset(model, num_layers=PLAN_LAYERS)
        depth = plan.PRESETS[model].num_layers
        for dtype in dtypes:
            for mesh_name in meshes:
                mesh = _mesh(mesh_name)
                for batch in batches:
                    row = dict(model=model, dtype=dtype, mesh=mesh_name, batch=batch)
                    try:
                        r = plan.plan_decode(cfg, config, batch, dtype=jnp.dtype(dtype),
                                             mesh=mesh)
                    except ValueError as e:
                        row["error"] = str(e).splitlines()[0]
                        print(f"  {model} {dtype} {mesh_name} B{batch}: {row['error']}")
                        rows.append(row)
                        continue
                    p_layer, c_layer = layer_bytes(cfg, jnp.dtype(dtype), batch,
                                                   config.max_cache_len, mesh)
                    extra = depth - PLAN_LAYERS
                    row |= r.as_dict() | dict(
                        full_argument_bytes=r.argument_bytes + extra * p_layer,
                        full_output_bytes=r.output_bytes + extra * c_layer,
                        layer_param_bytes=p_layer, layer_cache_bytes=c_layer)
                    rows.append(row)
                    print(f"  {model} {dtype} {mesh_name} B{batch}: temp "
                          f"{r.temp_bytes / GiB:.2f} GiB, args {r.argument_bytes / GiB:.2f}, "
                          f"out {r.output_bytes / GiB:.2f} ({r.compile_seconds:.0f} s)",
                          flush=True)
    return rows


def depth_check(config) -> dict:
    """Temporary bytes with 2 and 4 layers (one device, Qwen3-4B, float32, batch 8)."""
    out = {}
    for layers in (PLAN_LAYERS, 2 * PLAN_LAYERS):
        cfg = plan.preset("qwen3-4b", num_layers=layers)
        out[layers] = plan.plan_decode(cfg, config, 8).temp_bytes
    return out


def speed_rows(meshes, new_tokens: int, repeats: int) -> list[dict]:
    from tev_jax.data.prompts import prompt_set
    from tev_jax.models.bundled import load_bundled

    target, drafter, tok = load_bundled()
    prompts = [tok.encode(t).ids[:96] for t in prompt_set("mt_bench")[:8]]
    config = decode.DecodeConfig(max_new_tokens=new_tokens, budget=32, verifier="tev",
                                 prompt_len=96)
    rows, base = [], None
    for mesh_name in meshes:
        row = dict(mesh=mesh_name)
        try:
            gen = decode.timed_generate(target, drafter, prompts, config, repeats=repeats,
                                        mesh=_mesh(mesh_name))
        except Exception as e:  # informational: record and go on
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            traceback.print_exc()
        else:
            tokens = int(gen.lengths.sum())
            row |= dict(tokens=tokens, seconds=gen.stats.seconds,
                        tokens_per_s=tokens / gen.stats.seconds, tau=gen.stats.tau)
            if base is None:
                base = gen.tokens
            row["same_tokens_as_1_device"] = bool(np.array_equal(gen.tokens, base))
        print(f"  {mesh_name}: {row}", flush=True)
        rows.append(row)
    return rows


def _gib(b):
    return f"{b / GiB:.2f}"


def memory_table(rows) -> str:
    head = ("| model | dtype | mesh | B | temp (GiB) | args, 2 layers | out, 2 layers | "
            "args, full depth | out, full depth |\n|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['dtype']} | {r['mesh']} | {r['batch']} | "
                         f"n/a: {r['error'][:60]} | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['dtype']} | {r['mesh']} | {r['batch']} | "
                     f"{_gib(r['temp_bytes'])} | {_gib(r['argument_bytes'])} | "
                     f"{_gib(r['output_bytes'])} | {_gib(r['full_argument_bytes'])} | "
                     f"{_gib(r['full_output_bytes'])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="Qwen3-4B, float32, batch 8, three meshes; short speed run")
    ap.add_argument("--only", choices=("memory", "speed"), default=None)
    args = ap.parse_args(argv)
    if len(jax.devices()) < 8:
        raise SystemExit("needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
    config = decode.DecodeConfig(max_new_tokens=256, budget=64, verifier="tev",
                                 sampling=Sampling(temperature=1.0), prompt_len=2944,
                                 max_cache_len=4096)
    if args.quick:
        grid = dict(models=["qwen3-4b"], dtypes=["float32"], batches=[8],
                    meshes=["1 device", "tensor 8", "2 x 2 x 2"])
    else:
        grid = dict(models=["qwen3-4b", "qwen3-8b"], dtypes=["float32", "bfloat16"],
                    batches=[1, 8, 32], meshes=list(MESHES))
    out = dict(jax=jax.__version__, platform=platform.platform(),
               devices=len(jax.devices()), config=str(config), plan_layers=PLAN_LAYERS)
    t0 = time.perf_counter()
    if args.only in (None, "memory"):
        print("memory (per device):", flush=True)
        out["memory"] = memory_rows(config=config, **grid)
        if not args.quick:
            out["depth_check_temp_bytes"] = depth_check(config)
        print(memory_table(out["memory"]))
    if args.only in (None, "speed"):
        print("speed (bundled models, 8 prompts, greedy):", flush=True)
        out["speed"] = speed_rows(grid["meshes"], 32 if args.quick else 128,
                                  1 if args.quick else 3)
    out["seconds"] = time.perf_counter() - t0
    path = HERE / ("results_quick.json" if args.quick else "results.json")
    old = json.loads(path.read_text()) if args.only and path.exists() else {}
    path.write_text(json.dumps(old | out, indent=1, default=str))
    print(f"wrote {path} ({out['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
