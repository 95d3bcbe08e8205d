"""Compile time against depth: the fused generation and an ExitTrain step, for TPU.

Compiles, with libtpu on this CPU machine, each program at a few depths of a real model
(bf16, every other setting fixed) and prints the compile time (wall and this process's
CPU seconds) and the ratio of the full depth to the shallowest:

- decode: the fused generation (`tev_jax.costs.plan.plan_decode`: prefill + the rounds loop)
  of Qwen3-8B with a 1-layer DFlash drafter, DDTree-64 + TEV, B 8, prompt 1024, cache
  2048, on ``v5e:2x4`` (tensor 8);
- train: one ExitTrain update (`train.plan.plan_step`) of a 1-layer drafter on a
  Qwen3-4B target (5 taps), batch 8 x 2048, 32 anchors, budget 32, on ``v5p:2x2x2``
  (fsdp 8), the experiments/tpu training setting.

The layers run as one scan (`tev_jax.models.layers.scan_layers`); ``--unroll`` compiles
them unrolled instead (`scan_unroll(True)`: a program per layer, as before the scan).

    JAX_PLATFORMS=cpu python experiments/compile_time/run.py [--depths 4 36] [--unroll]

Writes ``results.json`` next to this file (``--out``). Run it alone: compile time on
two cores is the measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tev_jax.runtime.platforms import quiet_start

if __name__ == "__main__":
    quiet_start()  # before jax is imported: no libtpu or CUDA plugin lines on a CPU

import jax.numpy as jnp  # noqa: E402

from tev_jax.costs import chips, plan
from tev_jax.decode import DecodeConfig  # noqa: E402
from tev_jax.models.layers import scan_unroll  # noqa: E402

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[1]))  # train/ is a folder of the repository


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(compile_fn) -> dict:
    wall, cpu = time.perf_counter(), cpu_seconds()
    report = compile_fn()
    return {"wall_s": time.perf_counter() - wall, "cpu_s": cpu_seconds() - cpu,
            "compile_s": report.compile_seconds, "peak_gib": report.peak_bytes / 2**30,
            "flops": report.flops, "bytes_accessed": report.bytes_accessed}


def decode(depth: int, topology_name: str) -> dict:
    mesh, _ = chips.slice_mesh(topology_name, tensor=8)
    cfg = plan.preset("qwen3-8b", num_layers=depth)
    config = DecodeConfig(budget=64, verifier="tev", prompt_len=1024, max_cache_len=2048,
                          max_new_tokens=256)
    return timed(lambda: plan.plan_decode(cfg, config, 8, dtype=jnp.bfloat16, mesh=mesh))


def train(depth: int, topology_name: str) -> dict:
    from train.plan import plan_step

    return timed(lambda: plan_step(plan.preset("qwen3-4b", num_layers=depth),
                                   drafter_layers=1, batch=8, seq_len=2048, anchors=32,
                                   budget=32, mesh_shape=(1, 8, 1), target_dtype="bfloat16",
                                   topology=topology_name).report)


PROGRAMS = {"decode": (decode, "v5e:2x4"), "train": (train, "v5p:2x2x2")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[4, 36])
    ap.add_argument("--programs", nargs="+", default=list(PROGRAMS), choices=list(PROGRAMS))
    ap.add_argument("--unroll", action="store_true", help="unroll the layer scans")
    ap.add_argument("--out", default=str(HERE / "results.json"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    record = json.loads(out.read_text()) if out.exists() else {}
    mode = "unrolled" if args.unroll else "scan"
    for name in args.programs:
        fn, slice_name = PROGRAMS[name]
        rows = {}
        for depth in args.depths:
            with scan_unroll(True) if args.unroll else contextlib.nullcontext():
                rows[str(depth)] = r = fn(depth, slice_name)
            print(f"{name} ({mode}) {depth} layers on {slice_name}: compiled in "
                  f"{r['compile_s']:.1f} s ({r['cpu_s']:.1f} s CPU, {r['wall_s']:.1f} s with "
                  f"tracing); peak {r['peak_gib']:.2f} GiB/chip", flush=True)
        lo, hi = rows[str(min(args.depths))], rows[str(max(args.depths))]
        ratio = {k: hi[k] / lo[k] for k in ("compile_s", "cpu_s", "wall_s")}
        print(f"{name} ({mode}): {max(args.depths)} / {min(args.depths)} layers: compile "
              f"{ratio['compile_s']:.2f}x, CPU {ratio['cpu_s']:.2f}x, with tracing "
              f"{ratio['wall_s']:.2f}x")
        record.setdefault(mode, {})[name] = {"topology": slice_name, "depths": rows,
                                             "ratio": ratio}
        out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
