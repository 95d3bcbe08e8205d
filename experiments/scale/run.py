"""Decoding at scale on 8 simulated CPU devices: per-device memory and mesh speed.

(a) memory: the fused speculative generation (DDTree budget 64 + TEV, T = 1, prompt
    buffer 2944 prefilled in chunks of 512, cache 4096, 256 new tokens, 1-layer DFlash
    drafter with block 16) compiled on abstract
    Qwen3-4B / Qwen3-8B shapes with 2 target layers, for batch 1 / 8 / 32, float32 and
    bfloat16, on one device and on the meshes tensor 8, data 2 x tensor 4, data 8,
    fsdp 8 and data 2 x fsdp 2 x tensor 2. XLA's per-device figures
    (`tev_jax.costs.plan.plan_decode`) plus the full-depth extrapolation: arguments and
    outputs grow by one layer's parameter and KV-cache shard per device and layer (from
    the shardings of the logical rules); temporary memory by a measured multiple of one
    layer's KV-cache shard (Qwen3-4B, float32, batch 8, one device, 2 vs 4 layers).
(b) speed (informational): tokens/s of the bundled demo models, 8 prompts, greedy,
    single device vs each mesh (CPU devices share the same cores, so meshes do not
    speed anything up here; the point is that they run).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python -m experiments.scale.run [--quick] [--only memory|speed] [--report]

``--models`` / ``--dtypes`` / ``--batches`` / ``--meshes`` run a part of the grid. Writes experiments/scale/results.json
(or results_quick.json), keeping what an earlier run measured and this one did not, and
prints the tables.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
import traceback
from pathlib import Path

from tev_jax.runtime.platforms import quiet_start

if __name__ == "__main__":
    quiet_start()  # before jax is imported: no libtpu or CUDA plugin lines on a CPU

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tev_jax import decode, sharding
from tev_jax.costs import plan, timing
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
    layer = nnx.state(target.layers)   # one layer, stacked: [1, ...]
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
            gen = timing.timed_generate(target, drafter, prompts, config, repeats=repeats,
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


def per_layer_temp_factor(res) -> float | None:
    """Extra scratch per target layer in units of one layer's KV cache (depth check)."""
    check = res.get("depth_check_temp_bytes")
    row = next((r for r in res.get("memory", []) if (r["model"], r["dtype"], r["mesh"],
                r["batch"]) == ("qwen3-4b", "float32", "1 device", 8) and "error" not in r),
               None)
    if not check or row is None:
        return None
    t2, t4 = check[str(PLAN_LAYERS)], check[str(2 * PLAN_LAYERS)]
    return (t4 - t2) / PLAN_LAYERS / row["layer_cache_bytes"]


def memory_table(rows, factor: float | None) -> str:
    """The per-device table; full depth = 2 layers + the extra layers' parameters, KV
    cache and (``factor`` x KV cache) scratch."""
    lines = ["| model | dtype | mesh | B | temp (2 layers) | args (full) | out (full) | "
             "temp (full, est.) | peak (full, est.) |", "|---" * 9 + "|"]
    for r in rows:
        cells = [r["model"], r["dtype"], r["mesh"], r["batch"]]
        if "error" in r:
            why = ("batch not divisible by data x fsdp" if "(batch)" in r["error"]
                   else r["error"][:60])
            cells += [f"n/a: {why}"] + [""] * 4
        else:
            extra = plan.PRESETS[r["model"]].num_layers - PLAN_LAYERS
            temp = r["temp_bytes"] + extra * (factor or 0.0) * r["layer_cache_bytes"]
            peak = r["full_argument_bytes"] + r["full_output_bytes"] + temp
            cells += [_gib(r["temp_bytes"]), _gib(r["full_argument_bytes"]),
                      _gib(r["full_output_bytes"]), _gib(temp), _gib(peak)]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def speed_table(rows) -> str:
    lines = ["| mesh | tokens/s | x 1 device | tau | same tokens |", "|---|---|---|---|---|"]
    base = next((r["tokens_per_s"] for r in rows if "tokens_per_s" in r), None)
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['mesh']} | n/a: {r['error'][:90]} | | | |")
        else:
            lines.append(f"| {r['mesh']} | {r['tokens_per_s']:.1f} | "
                         f"{r['tokens_per_s'] / base:.2f} | {r['tau']:.2f} | "
                         f"{r['same_tokens_as_1_device']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="Qwen3-4B, float32, batch 8, three meshes; short speed run")
    ap.add_argument("--only", choices=("memory", "speed"), default=None)
    ap.add_argument("--models", nargs="+", default=["qwen3-4b", "qwen3-8b"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--meshes", nargs="+", default=list(MESHES), choices=list(MESHES))
    ap.add_argument("--report", action="store_true", help="print the tables of results.json")
    args = ap.parse_args(argv)
    if args.report:
        res = json.loads((HERE / "results.json").read_text())
        factor = per_layer_temp_factor(res)
        print(f"extra scratch per layer = {factor} x one layer's KV cache\n")
        print(memory_table(res.get("memory", []), factor) + "\n\n"
              + speed_table(res.get("speed", [])))
        return 0
    if len(jax.devices()) < 8:
        raise SystemExit("needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
    config = decode.DecodeConfig(max_new_tokens=256, budget=64, verifier="tev",
                                 sampling=Sampling(temperature=1.0), prompt_len=2944,
                                 max_cache_len=4096, prefill_chunk=512)
    if args.quick:
        grid = dict(models=["qwen3-4b"], dtypes=["float32"], batches=[8],
                    meshes=["1 device", "tensor 8", "2 x 2 x 2"])
    else:
        grid = dict(models=args.models, dtypes=args.dtypes, batches=args.batches,
                    meshes=args.meshes)
    out = dict(jax=jax.__version__, platform=platform.platform(),
               devices=len(jax.devices()), config=str(config), plan_layers=PLAN_LAYERS)
    t0 = time.perf_counter()
    if args.only in (None, "memory"):
        print("memory (per device):", flush=True)
        out["memory"] = memory_rows(config=config, **grid)
        if not args.quick and "qwen3-4b" in args.models and "float32" in args.dtypes:
            out["depth_check_temp_bytes"] = depth_check(config)
        print(memory_table(out["memory"], per_layer_temp_factor(out)))
    if args.only in (None, "speed"):
        print("speed (bundled models, 8 prompts, greedy):", flush=True)
        out["speed"] = speed_rows(grid["meshes"], 32 if args.quick else 128,
                                  1 if args.quick else 3)
    out["seconds"] = time.perf_counter() - t0
    path = HERE / ("results_quick.json" if args.quick else "results.json")
    old = json.loads(path.read_text()) if path.exists() else {}
    if "memory" in out and "memory" in old:  # keep rows of models / dtypes not rerun
        key = lambda r: (r["model"], r["dtype"], r["mesh"], r["batch"])
        ran = {key(r) for r in out["memory"]}
        out["memory"] = [r for r in old["memory"] if key(r) not in ran] + out["memory"]
    path.write_text(json.dumps(old | out, indent=1, default=str))
    print(f"wrote {path} ({out['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
