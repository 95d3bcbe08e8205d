"""Per-device memory and compile time of a drafter training step at real model shapes.

Each configuration (target preset, drafter depth, mesh) is compiled on abstract models
(`train.plan.plan_step`: ``nnx.eval_shape``, no weights; 8 simulated CPU devices) with
the target cut to 1 and 2 layers. Argument bytes grow exactly linearly with depth and
are extrapolated to the preset's full depth; temporaries are not linear (XLA's schedule
changes with depth: Qwen3-4B measured 1.87 / 2.04 GiB at 1 / 2 layers, 4.09 GiB at 36,
where the line says 7.8), so ``temp_gib_linear`` is only a rough bound and ``--full``
compiles the full-depth step (slow: ~11 min on a loaded 2-core machine). Compile times
are the measured ones (they vary with the machine's load).

Batch: B 8 sequences x 2048 tokens, 32 anchors, DDTree budget 32, exit loss, a DFlash
drafter reading 5 target layers; float32 on CPU (XLA:CPU makes float32 copies of
bfloat16 weights, so bfloat16 temporaries are overstated there; arguments are exact in
any dtype: ``--dtype bfloat16`` states them).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python -m experiments.scale.train_run [--quick] [--full qwen3-4b] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tev_jax.costs.plan import GiB
from train.plan import plan_step, target_config_from

MESHES = {"fsdp8": (1, 8, 1), "fsdp4_tensor2": (1, 4, 2), "data2_fsdp4": (2, 4, 1)}
PRESETS = ("qwen3-4b", "qwen3-8b")
DRAFTER_LAYERS = (1, 5)
DEPTHS = (1, 2)     # target layers of the two compiles that are extrapolated


def _plan(name, layers, drafter_layers, mesh, dtype, remat):
    return plan_step(target_config_from(name, layers), drafter_layers=drafter_layers,
                     mesh_shape=MESHES[mesh], target_dtype=dtype, param_dtype="float32",
                     compute_dtype=dtype, remat=remat)


def extrapolated(name, drafter_layers, mesh, dtype, remat) -> dict:
    """Compiles at `DEPTHS` target layers and extends the line to the full depth."""
    full = target_config_from(name).num_layers
    plans = [_plan(name, d, drafter_layers, mesh, dtype, remat) for d in DEPTHS]
    lo, hi = (plan.report for plan in plans)
    span = DEPTHS[1] - DEPTHS[0]

    def line(a, b):
        return a + (b - a) * (full - DEPTHS[0]) / span

    return {"target": name, "target_layers": full, "drafter_layers": drafter_layers,
            "mesh": mesh, "dtype": dtype, "remat": remat,
            "argument_gib": round(line(lo.argument_bytes, hi.argument_bytes) / GiB, 2),
            "temp_gib_measured": [round(lo.temp_bytes / GiB, 2), round(hi.temp_bytes / GiB, 2)],
            "temp_gib_linear": round(line(lo.temp_bytes, hi.temp_bytes) / GiB, 2),
            "compile_s_measured": [round(lo.compile_seconds), round(hi.compile_seconds)],
            "per_layer_argument_gib": round((hi.argument_bytes - lo.argument_bytes) / span / GiB,
                                            3),
            "per_layer_temp_gib": round((hi.temp_bytes - lo.temp_bytes) / span / GiB, 3),
            "measured": [plan.to_dict() for plan in plans]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="qwen3-4b, 1 drafter layer, fsdp8")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--remat", default="full")
    p.add_argument("--meshes", default=",".join(MESHES))
    p.add_argument("--presets", default=",".join(PRESETS))
    p.add_argument("--drafter-layers", default=",".join(map(str, DRAFTER_LAYERS)))
    p.add_argument("--full", help="also compile this preset at full depth (1 drafter "
                                  "layer, fsdp8)")
    p.add_argument("--skip-extrapolated", action="store_true",
                   help="only the --full compile")
    p.add_argument("--out", default=str(Path(__file__).with_name("train_results.json")))
    ns = p.parse_args(argv)
    presets = ("qwen3-4b",) if ns.quick else tuple(ns.presets.split(","))
    meshes = ("fsdp8",) if ns.quick else tuple(ns.meshes.split(","))
    layers = (1,) if ns.quick else tuple(int(x) for x in ns.drafter_layers.split(","))
    out = Path(ns.out)
    results = json.loads(out.read_text()) if out.exists() else []
    for name in () if ns.skip_extrapolated else presets:
        for dl in layers:
            for mesh in meshes:
                rec = extrapolated(name, dl, mesh, ns.dtype, ns.remat)
                print(json.dumps({k: v for k, v in rec.items() if k != "measured"}),
                      flush=True)
                results.append(rec)
                out.write_text(json.dumps(results, indent=1))
    if ns.full:
        plan = _plan(ns.full, None, 1, "fsdp8", ns.dtype, ns.remat)
        print(plan.format(), flush=True)
        results.append({"full_depth": plan.to_dict()})
        out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
