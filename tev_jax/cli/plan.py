"""``tev-jax plan``: per-device memory and cost of the decode programs, without weights."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tev_jax.cli import flags

# `tev_jax.costs.plan.PRESETS`' names and its ``DECODE_PROGRAMS`` (a test keeps them
# equal), here so that the command line parses without importing jax.
PRESET_NAMES = ("gemma-4-12b", "llama3-8b", "qwen3-0.6b", "qwen3-4b", "qwen3-8b",
                "qwen3-coder-30b-a3b")
PROGRAMS_TO_PLAN = ("generation", "ar_step", "round", "prefill", "draft", "build", "verify",
                    "decide", "commit")


def _mesh_for_plan(args):
    """(mesh or None, chip, devices per chip, where) of the plan flags: over a TPU slice's
    chips with ``--topology``, GPUs with ``--gpu``, else over the local devices."""
    from tev_jax.costs import chips

    if args.topology is None and args.gpu is None:
        mesh = flags.mesh_from(args)
        return mesh, chips.local_chip(), 1, "local devices"
    try:
        mesh, tpu = chips.plan_mesh(args.topology, args.gpu, args.mesh_data,
                                       args.mesh_fsdp, args.mesh_tensor)
    except AssertionError:  # jax's device-mesh layout of a partial slice
        n = args.mesh_data * args.mesh_fsdp * args.mesh_tensor
        raise ValueError(f"the mesh --mesh-data {args.mesh_data} x --mesh-fsdp "
                         f"{args.mesh_fsdp} x --mesh-tensor {args.mesh_tensor} ({n} devices) "
                         f"does not lay out over the slice {args.topology}: use axis sizes "
                         "whose product is the slice's device count") from None
    hosts = f", {tpu.hosts} hosts" if tpu.hosts > 1 else ""
    return mesh, tpu.chip, tpu.devices_per_chip, f"{tpu.name} ({len(tpu.devices)} devices{hosts})"


def plan_command(args) -> int:
    """``tev-jax plan``: per-device memory and cost of the decode programs, without weights
    (local devices, or a TPU slice with ``--topology``)."""
    import jax.numpy as jnp

    from tev_jax import engine
    from tev_jax.costs import plan

    if (args.model is None) == (args.config is None):
        raise ValueError("give exactly one of --model PRESET or --config path/config.json")
    flags.at_least_one(args, "--batch", "--prompt-len", "--max-new-tokens",
                       "--drafter-layers", "--mesh-data", "--mesh-fsdp", "--mesh-tensor")
    if args.layers is not None and args.layers < 1:
        raise ValueError(f"--layers must be >= 1, got {args.layers}")
    if args.tau is not None and not 1 <= args.tau < float("inf"):
        raise ValueError(f"--tau must be a number >= 1 (tokens per round, the bonus token "
                         f"included), got {args.tau}")
    cfg = plan.model_config(args.model or args.config, num_layers=args.layers)
    config = flags.decode_config(args, prompt_len=args.prompt_len, max_cache_len=args.cache_len)
    mesh, chip, per_chip, where = _mesh_for_plan(args)
    if args.tau is not None and chip is None:
        raise ValueError("--tau needs a roofline to estimate tokens/s: give --topology "
                         "(the local devices have no published peak figures)")
    dtype = jnp.dtype(args.dtype)
    if args.serve:
        return _serving_plan(args, cfg, config, dtype, mesh, chip, per_chip, where)
    programs = tuple(p.strip() for p in args.programs.split(","))
    # the settings' shapes are checked (cache length, mesh, batch) before anything compiles
    target, drafter = plan.abstract_models(cfg, config, dtype=dtype,
                                           drafter_layers=args.drafter_layers)
    engine.decode_spec(target, drafter, config, args.batch, mesh=mesh)
    print(f"compiling {len(programs)} program(s) ({', '.join(programs)}) of "
          f"{args.model or args.config} for {where} (minutes for a large model) ...",
          file=sys.stderr, flush=True)
    start = time.perf_counter()

    def compiled(name: str, done: int, total: int) -> None:
        print(f"  [{done}/{total}] {name} compiled ({time.perf_counter() - start:.0f} s so "
              "far)", file=sys.stderr, flush=True)

    result = plan.plan_decode_programs(
        cfg, config, args.batch, dtype=dtype, drafter_layers=args.drafter_layers, mesh=mesh,
        programs=programs, chip=chip, devices_per_chip=per_chip, ops=args.ops,
        progress=compiled)
    floor = plan.decode_floor(target, drafter, config, args.batch)
    hbm = plan.hbm_shortfall(result, floor, config)
    axes = {"data": args.mesh_data, "fsdp": args.mesh_fsdp, "tensor": args.mesh_tensor}
    what = {"model": args.model or args.config, "layers": cfg.num_layers,
            "batch": args.batch, "prompt_len": args.prompt_len,
            "cache_len": args.cache_len, "max_new_tokens": args.max_new_tokens,
            "builder": args.builder, "budget": args.budget, "verifier": args.verifier,
            "prefill_chunk": args.prefill_chunk, "temperature": args.temperature,
            "dtype": args.dtype, "drafter_layers": args.drafter_layers, "mesh": axes,
            "topology": args.topology, "gpu": args.gpu, "fits": hbm is None}
    record = what | result.as_dict(args.tau)
    if args.json == "-":
        print(json.dumps(record))
        return 0
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    mesh_s = " x ".join(f"{k} {v}" for k, v in axes.items() if v > 1) or "one device"
    chip_s = "" if chip is None else (f"; roofline: {chip.name}, {chip.peak_flops / 1e12:.0f} "
                                      f"TFLOP/s, {chip.hbm_bandwidth / 1e9:.0f} GB/s per chip")
    print(f"{what['model']} ({cfg.num_layers} layers, {args.dtype}), batch {args.batch}, "
          f"prompt {args.prompt_len}, cache {args.cache_len or 'auto'}, "
          f"{args.builder} budget {args.budget}, T={args.temperature:g}; {mesh_s} on "
          f"{where}{chip_s}")
    print("per device:\n" + result.format(args.tau))
    if hbm is not None:
        print(hbm)
    elif chip is not None and "generation" in result.programs:
        print(f"fits: the generation's peak {result.programs['generation'].peak_bytes / 2**30:.2f}"
              f" GiB per device is within {chip.name}'s HBM "
              f"({chip.hbm_bytes / per_chip / 2**30:.2f} GiB per device)")
    return 0


def _serving_plan(args, cfg, config, dtype, mesh, chip, per_chip, where) -> int:
    """``tev-jax plan --serve``: a round and an AR step at every slot count that ``tev-jax
    serve --max-batch B`` runs (`tev_jax.costs.plan.plan_serving`), one line each."""
    from tev_jax.costs import plan
    from tev_jax.server.scheduler import budget_of
    from tev_jax.slots import serving_configs

    configs = serving_configs(config, args.batch, mesh)
    print(f"compiling the round and the AR step at {len(configs)} slot count(s) "
          f"({', '.join(map(str, configs))}) of {args.model or args.config} for {where} ...",
          file=sys.stderr, flush=True)
    plans = plan.plan_serving(cfg, configs, dtype=dtype,
                              drafter_layers=args.drafter_layers, mesh=mesh, chip=chip,
                              devices_per_chip=per_chip)
    ms = lambda t: "-" if t is None else f"{t * 1e3:.3f}"
    rows = []
    print(f"serving {args.model or args.config} ({cfg.num_layers} layers, {args.dtype}), "
          f"--max-batch {args.batch}, prompt {args.prompt_len}, max tokens "
          f"{args.max_new_tokens}, each row's own sampling; per device on {where}"
          + ("" if chip is None else f" (roofline: {chip.name})"))
    print(f"{'slots':>5}{'budget':>8}{'round peak GiB':>16}{'round ms':>10}{'AR peak GiB':>13}"
          f"{'AR ms':>8}")
    for slots, p in plans.items():
        r, ar = p.programs["round"], p.programs["ar_step"]
        rows.append({"slots": slots, "budget": budget_of(configs[slots]),
                     "round_peak_bytes": r.peak_bytes, "round_seconds": p.seconds("round"),
                     "ar_peak_bytes": ar.peak_bytes, "ar_seconds": p.seconds("ar_step")})
        print(f"{slots:>5}{rows[-1]['budget']:>8}{r.peak_bytes / 2**30:>16.3f}"
              f"{ms(rows[-1]['round_seconds']):>10}{ar.peak_bytes / 2**30:>13.3f}"
              f"{ms(rows[-1]['ar_seconds']):>8}")
    if next(iter(plans.values())).seconds_are == "floor":
        print("ms: the roofline, max(FLOPs / peak, bytes / HBM bandwidth), a floor that no "
              "program reaches")
    elif chip is not None:
        print("ms: estimates calibrated on the GPU's measured table (tev_jax.costs.gpu_time)")
    if args.json:
        text = json.dumps({"model": args.model or args.config, "max_batch": args.batch,
                           "where": where, "slot_counts": rows}, indent=1)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "plan", help="per-device memory and cost of the decode programs (no weights needed)",
        description="Compiles the decode programs (the whole generation, an AR step, a "
                    "round, a prefill chunk, each stage) for a model config on abstract "
                    "parameters and prints the compiler's per-device argument / temporary / "
                    "output bytes, FLOPs, bytes accessed and, on a TPU (--topology) or "
                    "GPUs (--gpu), the "
                    "roofline time. For a mesh on CPU set XLA_FLAGS="
                    "--xla_force_host_platform_device_count=8. XLA:CPU copies bfloat16 "
                    "weights to float32, so bfloat16 temporary memory on CPU overstates.")
    p.add_argument("--model", default=None, help=f"a preset: {', '.join(PRESET_NAMES)}")
    p.add_argument("--config", default=None, help="a Hugging Face config.json (or its directory)")
    p.add_argument("--layers", type=int, default=None,
                   help="plan with this many target layers (e.g. 2 for per-layer figures)")
    p.add_argument("--batch", type=int, default=1, help="B, rows decoded together (default 1)")
    p.add_argument("--prompt-len", type=int, default=1024, help="prompt buffer P")
    p.add_argument("--cache-len", type=int, default=None,
                   help="cache slots L (default: P + max-new-tokens + tree slots)")
    flags.add_decode_flags(p)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="parameter and cache dtype (bfloat16 is honest with --topology only)")
    p.add_argument("--drafter-layers", type=int, default=1, help="DFlash drafter depth")
    flags.add_mesh_flags(p)
    p.add_argument("--topology", default=None, metavar="NAME",
                   help="plan for a TPU slice (e.g. v5e:2x4, v5p:2x2x2, v5e:4x4; needs the "
                        "tpu extra) instead of the local devices; the mesh flags lay it out")
    p.add_argument("--gpu", default=None, metavar="NAME",
                   help="plan for NVIDIA GPUs (h100x8, h200x8, b200x8, a100x8, h100x16; needs "
                        "the gpu extra) instead of the local devices; the mesh flags lay it out")
    p.add_argument("--programs", default=",".join(PROGRAMS_TO_PLAN),
                   help="comma-separated programs to compile (default: all of "
                        "%(default)s)")
    p.add_argument("--serve", action="store_true",
                   help="the serving plan of tev-jax serve --max-batch BATCH: a round and "
                        "an AR step at every slot count it runs, each row with its own "
                        "sampling (per-device peak memory and roofline time)")
    p.add_argument("--tau", type=float, default=None,
                   help="an expected tau: estimate tokens/s and the speed-up over AR")
    p.add_argument("--ops", type=int, default=0, metavar="N",
                   help="also compile the fused rounds loop of the AR step and of the round "
                        "and show their N largest ops (per round and once per call, with "
                        "the source line and stage that made them)")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="also write the plan as JSON to FILE ('-': only JSON, on stdout)")
    p.set_defaults(func=plan_command)
