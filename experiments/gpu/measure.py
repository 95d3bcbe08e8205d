"""Measures tev-jax on the GPU of this machine, unattended, in a few minutes (issue 44).

One command, under either CUDA plugin (cuda12 or cuda13), one GPU:

    python experiments/gpu/measure.py --out gpu_out            # kernels on (the default)
    python experiments/gpu/measure.py --out gpu_out_off --kernels off
    python experiments/gpu/measure.py --smoke --out /tmp/m     # CPU, tiny shapes (tests)

It writes ``measure.json`` and the GPU's calibration table ``gpus/<gpu>.json`` (the
format of `tev_jax.costs.gpu_time`; copy it to ``tev_jax/data/gpus/`` to commit it) into
``--out``, and prints a table of:

1. **programs**: the AR step and DDTree + TEV rounds at budgets 16 / 32 / 64, B 1 / 8 /
   32, of a preset with random bf16 weights at full depth (Qwen3-8B, 1-layer drafter,
   prompt 1024 / cache 2048, T = 0): each compiled once ahead of time (its
   `tev_jax.costs.plan.ProgramReport`: HBM bytes, launches, roofline, calibrated estimate;
   `tev_jax.costs.plan.round_floor`: its floor of bytes) and timed as dispatched rounds
   (median), with the achieved HBM bandwidth (bytes / time) and the floor's time (floor
   bytes / the data sheet's bandwidth);
2. **kernels alone**, each as R calls in one jitted loop (no dispatch between calls):
   our stacked GEMM against XLA's dot on the sliced and on an unstacked weight, our
   cache attention against XLA's, an elementwise pass (XLA's own fusions) and a chain
   of one-element kernels (the cost of a launch);
3. **the bundled pair's fused generate** (float32, highest matmul precision): tokens/s
   of AR and of DDTree-32 + TEV, and whether their T = 0 tokens are equal;
4. **the calibration**: the kernels' rates as a first guess, fitted to the programs'
   times (`tev_jax.costs.gpu_time.fit`), and how far each estimate lands from its time;
5. **block sizes**: a few variants of each Pallas kernel's `GpuBlocks` timed alone, the
   fastest written to ``blocks/<gpu>.json`` (for the ``GPU_BLOCKS`` tables of
   `tev_jax.kernels.stacked_matmul` and `tev_jax.kernels.cache_attention`).

``--kernels off`` traces no Pallas kernel (the XLA fallbacks). ``--smoke`` runs the same
code on CPU with a tiny model and tiny shapes (the Pallas kernels interpreted), in about
a minute: what ``tests/test_gpu_measure.py`` runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tev_jax.costs import chips, gpu_time, launches, op_costs, plan
from tev_jax.runtime import platforms

PROMPT_LEN, CACHE_LEN = 1024, 2048
SMOKE = dict(prompt_len=16, cache_len=64, batches=(1, 2), budgets=(4,), repeats=3, loop=3,
             new_tokens=8)
FULL = dict(prompt_len=PROMPT_LEN, cache_len=CACHE_LEN, batches=(1, 8, 32),
            budgets=(16, 32, 64), repeats=10, loop=50, new_tokens=96)


def smoke_config():
    """A tiny Qwen3-style target (what the smoke run decodes on CPU)."""
    from tev_jax.models.config import ModelConfig

    return ModelConfig(model_type="qwen3", vocab_size=512, hidden_size=64,
                       intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=16, qk_norm=True, max_position_embeddings=256)


def random_models(cfg, dtype):
    """A target and a 1-layer DFlash drafter of ``cfg``'s widths, random weights."""
    from flax import nnx

    from tev_jax import sharding as shd
    from tev_jax.models import init_target
    from tev_jax.models.drafter import Drafter
    from tev_jax.models.layers import jitted_initializer

    target = init_target(cfg, key=0, dtype=dtype)
    graphdef, init = jitted_initializer(Drafter, plan.drafter_config(cfg), dtype, None,
                                        shd.DEFAULT_RULES)
    return target, nnx.merge(graphdef, init(jax.random.key(1)))


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` (each waited for) after one untimed call."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ------------------------------------------------------------------------ programs


def measure_programs(cfg, drafter_cfg_models, s, gpu_name, chip) -> list[dict]:
    from tev_jax.decode import DecodeConfig
    from tev_jax.engine import Engine

    target, drafter = drafter_cfg_models
    rows = []
    rng = np.random.default_rng(0)
    for batch in s["batches"]:
        for budget in (None, *s["budgets"]):
            n = budget + 1 if budget else 1
            config = DecodeConfig(builder="ddtree" if budget else "none", budget=budget or 1,
                                  verifier="tev", prompt_len=s["prompt_len"],
                                  max_cache_len=s["cache_len"],
                                  max_new_tokens=s["cache_len"] - s["prompt_len"] - n)
            engine = Engine.create(target, drafter if budget else None, config, batch)
            t0 = time.perf_counter()
            compiled = engine.lower("round").compile()
            compile_s = time.perf_counter() - t0
            report = plan.ProgramReport.of(compiled, compile_s, gpu=gpu_name)
            floor = plan.sum_floor(plan.round_floor(engine))
            prompts = engine.prompts([rng.integers(0, engine.vocab_size,
                                                   s["prompt_len"] - 8).tolist()
                                      for _ in range(batch)])
            state = [engine.prefill(prompts, jax.random.key(0))]

            def one_round():
                state[0] = compiled(engine.params, state[0])
                return state[0]

            seconds = median_seconds(one_round, s["repeats"])
            text = compiled.as_text()
            rows.append({
                "batch": batch, "budget": budget, "seconds": seconds,
                "compile_seconds": compile_s, "hbm_bytes": report.bytes_accessed,
                "flops": report.flops, "floor_bytes": floor,
                "floor_seconds": None if chip is None else floor / chip.hbm_bandwidth,
                "roofline_seconds": report.roofline_seconds(chip),
                "estimate_seconds": report.estimate_seconds, "launches": report.launches,
                "achieved_bytes_per_second": report.bytes_accessed / seconds,
                "_ops": op_costs.op_costs(text), "_launches": launches.launches(text)})
            print(f"  B {batch} {'AR' if budget is None else f'b {budget}'}: "
                  f"{seconds * 1e3:.2f} ms, compiled in {compile_s:.1f} s", flush=True)
    return rows


# -------------------------------------------------------------------- kernels alone


def loop_time(fn, args, calls: int, repeats: int = 3) -> float:
    """Seconds per call of ``fn(*args)`` run ``calls`` times in one jitted loop (each
    call's first output feeds a zero into the next, so none is skipped)."""
    def body(i, carry):
        out = jax.tree.leaves(fn(*carry))[0]
        bump = (out.reshape(-1)[0] * 0).astype(carry[0].dtype)
        return (carry[0] + bump,) + tuple(carry[1:])

    f = jax.jit(lambda *a: jax.lax.fori_loop(0, calls, body, a))
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def measure_kernels(s, smoke: bool) -> list[dict]:
    from tev_jax.kernels import cache_attention as ca
    from tev_jax.kernels import stacked_matmul as sm

    interpret = smoke
    dt = jnp.float32 if smoke else jnp.bfloat16
    k_, n_ = (64, 96) if smoke else (4096, 12288)
    rng = np.random.default_rng(0)
    rows = []

    def add(name, cls, fn, args, nbytes, flops):
        t = loop_time(fn, args, s["loop"])
        rows.append({"name": name, "class": cls, "seconds": t, "bytes": nbytes,
                     "flops": flops, "bytes_per_second": nbytes / t,
                     "flops_per_second": flops / t})
        print(f"  {name}: {t * 1e6:.1f} us, {nbytes / t / 1e9:.0f} GB/s, "
              f"{flops / t / 1e12:.1f} TFLOP/s", flush=True)

    for m in ((1, 8) if smoke else (1, 8, 264)):
        x = jnp.asarray(rng.normal(size=(m, k_)), dt)
        w = jnp.asarray(rng.normal(size=(4, k_, n_)) / np.sqrt(k_), dt)
        nb, fl = k_ * n_ * jnp.dtype(dt).itemsize, 2 * m * k_ * n_
        dot = lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(dt)
        add(f"stacked_matmul M {m}", "stacked_matmul",
            lambda x, w: sm.stacked_matmul(x, w, jnp.int32(2), interpret=interpret), (x, w),
            nb, fl)
        add(f"XLA slice + dot M {m}", None, lambda x, w: dot(x, w[2]), (x, w), nb, fl)
        add(f"XLA dot, unstacked M {m}", "gemm", dot, (x, w[2]), nb, fl)
    hd = 16 if smoke else 128
    shapes = ([(1, 2, 4, 32), (2, 2, 8, 32)] if smoke else
              [(1, 8, 4, 16384), (8, 8, 4, 2048), (32, 8, 4, 2048), (8, 8, 132, 2048)])
    for b, kh, qg, length in shapes:
        q = jnp.asarray(rng.normal(size=(b, kh, qg, hd)), dt)
        kv = [jnp.asarray(rng.normal(size=(3, b, length, kh, hd)), dt) for _ in range(2)]
        end = jnp.full((b,), length, jnp.int32)
        nb = 2 * b * length * kh * hd * jnp.dtype(dt).itemsize
        fl = 4 * b * kh * qg * length * hd

        def xla(q, k, v, e):
            sc = jnp.einsum("bkqd,bskd->bkqs", q, k[1], preferred_element_type=jnp.float32)
            p = jax.nn.softmax(sc * hd ** -0.5, axis=-1)
            return jnp.einsum("bkqs,bskd->bkqd", p.astype(dt), v[1],
                              preferred_element_type=jnp.float32)

        name = f"B {b} q {qg} s {length}"
        add(f"cache_attention_gpu {name}", "cache_attention",
            lambda q, k, v, e: ca.gpu_state(q, k, v, jnp.int32(1), e, scale=hd ** -0.5,
                                            interpret=interpret),
            (q, *kv, end), nb, fl)
        add(f"XLA attention {name}", "memory" if qg > 16 else None, xla, (q, *kv, end), nb, fl)
    big = jnp.asarray(rng.normal(size=(1 << (12 if smoke else 26),)), dt)
    add("XLA elementwise x * 1.5 + 1", "memory", lambda x: x * 1.5 + 1, (big,),
        2 * big.size * big.dtype.itemsize, 2 * big.size)
    tiny = jnp.zeros((1,), jnp.float32)
    chain = lambda x: jax.lax.fori_loop(0, 16, lambda i, y: jnp.sin(y) + 1.0, x)
    add("16 one-element kernels", "launch", chain, (tiny,), 0, 0)
    rows[-1]["seconds_per_launch"] = rows[-1]["seconds"] / 16
    return rows


def sweep_blocks(s, smoke: bool) -> dict:
    """The block sizes of each Pallas kernel on this GPU: a few `GpuBlocks` variants per
    kernel timed alone at decode's shapes (stacked GEMM at M 1 and 8; cache attention at
    B 8, 4 query rows), the fastest kept (``GPU_BLOCKS`` of `tev_jax.kernels`' modules
    is where the table goes)."""
    from tev_jax.kernels import cache_attention as ca
    from tev_jax.kernels import stacked_matmul as sm

    interpret = smoke
    dt = jnp.float32 if smoke else jnp.bfloat16
    rng = np.random.default_rng(1)
    k_, n_ = (64, 96) if smoke else (4096, 12288)
    w = jnp.asarray(rng.normal(size=(2, k_, n_)) / np.sqrt(k_), dt)
    xs = [jnp.asarray(rng.normal(size=(m, k_)), dt) for m in (1, 8)]
    base = sm.gpu_blocks(None if smoke else jax.devices()[0].device_kind)
    variants = [base] + ([dataclasses.replace(base, block_n=32)] if smoke else [
        dataclasses.replace(base, **kw) for kw in (
            dict(block_n=128), dict(block_k=128), dict(num_warps=8),
            dict(num_stages=4), dict(block_n=128, num_warps=8), dict(programs=528))])
    out = {"stacked_matmul": []}
    for v in variants:
        t = sum(loop_time(lambda x, w, v=v: sm.stacked_matmul(x, w, jnp.int32(1),
                                                                interpret=interpret, blocks=v),
                          (x, w), s["loop"]) for x in xs)
        out["stacked_matmul"].append({"blocks": dataclasses.asdict(v), "seconds": t})
    hd, (b, kh, qg, length) = (16, (2, 2, 4, 32)) if smoke else (128, (8, 8, 4, 2048))
    q = jnp.asarray(rng.normal(size=(b, kh, qg, hd)), dt)
    kv = [jnp.asarray(rng.normal(size=(2, b, length, kh, hd)), dt) for _ in range(2)]
    end = jnp.full((b,), length, jnp.int32)
    cbase = ca.gpu_blocks(None if smoke else jax.devices()[0].device_kind)
    cvariants = [cbase] + ([dataclasses.replace(cbase, key_block=16)] if smoke else [
        dataclasses.replace(cbase, **kw) for kw in (
            dict(key_block=128), dict(key_block=32), dict(num_warps=8),
            dict(num_stages=3), dict(programs=528))])
    out["cache_attention"] = []
    for v in cvariants:
        t = loop_time(lambda q, k, v_, e, v=v: ca.gpu_state(
            q, k, v_, jnp.int32(1), e, scale=hd ** -0.5, interpret=interpret, blocks=v),
            (q, *kv, end), s["loop"])
        out["cache_attention"].append({"blocks": dataclasses.asdict(v), "seconds": t})
    best = {k: min(v, key=lambda r: r["seconds"]) for k, v in out.items()}
    for k, r in best.items():
        print(f"  {k}: best {r['blocks']} ({r['seconds'] * 1e6:.1f} us; default "
              f"{out[k][0]['seconds'] * 1e6:.1f} us)", flush=True)
    return {"tried": out, "best": {k: r["blocks"] for k, r in best.items()}}


def first_guess(kernels: list[dict], gpu_name: str) -> gpu_time.Calibration:
    """Rates per class from the kernels alone: the median bytes/s of each class's
    entries, their best FLOP/s; the launch cost from the one-element chain."""
    rates = {}
    for cls in gpu_time.CLASSES:
        rows = [r for r in kernels if r["class"] == cls]
        bw = statistics.median(r["bytes_per_second"] for r in rows)
        fl = max(r["flops_per_second"] for r in rows)
        rates[cls] = gpu_time.Rate(bw, max(fl, 1.0),
                                   "; ".join(f"{r['name']}: {r['bytes_per_second'] / 1e9:.0f}"
                                             f" GB/s" for r in rows))
    launch = next(r for r in kernels if r["class"] == "launch")["seconds_per_launch"]
    noop = jax.jit(lambda x: x + 1)
    call = median_seconds(lambda: noop(jnp.zeros((1,))), 20)
    return gpu_time.Calibration(gpu_name, rates, launch_seconds=launch, call_seconds=call,
                                source="kernels alone (experiments/gpu/measure.py)")


# ----------------------------------------------------------------- the bundled pair


def measure_generate(s) -> dict:
    import tev_jax as tj
    from tev_jax.decode import DecodeConfig
    from tev_jax.models.bundled import load_bundled
    from tev_jax.sampling import Sampling

    target, drafter, _ = load_bundled(drafter="exittrain")
    rng = np.random.default_rng(11)
    prompts = [rng.integers(10, 2000, size=n).tolist() for n in (5, 17, 40, 64)]
    out, tokens = {}, {}
    with jax.default_matmul_precision("highest"):
        for name, builder in (("AR", "none"), ("DDTree-32 + TEV", "ddtree")):
            config = DecodeConfig(max_new_tokens=s["new_tokens"], builder=builder, budget=32,
                                  verifier="tev", sampling=Sampling(0.0), stop_token_ids=())
            run = lambda: tj.generate(target, None if builder == "none" else drafter,
                                      prompts, config, 1)
            t0 = time.perf_counter()
            first = run()
            first_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            again = run()
            np.asarray(again.tokens)
            secs = time.perf_counter() - t0
            tokens[name] = np.asarray(first.tokens)[:, :s["new_tokens"]]
            out[name] = {"first_call_seconds": first_s, "seconds": secs,
                         "tokens_per_second": len(prompts) * s["new_tokens"] / secs,
                         "rounds": int(np.asarray(again.stats.rounds))}
            print(f"  {name}: {out[name]['tokens_per_second']:.0f} tokens/s "
                  f"({out[name]['rounds']} rounds)", flush=True)
    out["rows_differing"] = int((tokens["AR"] != tokens["DDTree-32 + TEV"]).any(axis=1).sum())
    out["speedup"] = (out["DDTree-32 + TEV"]["tokens_per_second"]
                      / out["AR"]["tokens_per_second"])
    return out


# --------------------------------------------------------------------------- report


def table(result: dict) -> str:
    ms = lambda t: "-" if t is None else f"{t * 1e3:.2f}"
    lines = ["| B | program | measured ms | achieved GB/s | floor ms | roofline ms | "
             "estimate ms (fitted) | launches (outside layers) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["programs"]:
        n = r["launches"] or {}
        lines.append(f"| {r['batch']} | {'AR' if r['budget'] is None else 'b ' + str(r['budget'])}"
                     f" | {ms(r['seconds'])} | {r['achieved_bytes_per_second'] / 1e9:.0f} | "
                     f"{ms(r['floor_seconds'])} | {ms(r['roofline_seconds'])} | "
                     f"{ms(r.get('fitted_seconds'))} | {n.get('total', '-')} "
                     f"({n.get('other_than_layers', '-')}) |")
    lines += ["", "| kernel alone | µs | GB/s | TFLOP/s |", "|---|---|---|---|"]
    lines += [f"| {k['name']} | {k['seconds'] * 1e6:.1f} | {k['bytes_per_second'] / 1e9:.0f} | "
              f"{k['flops_per_second'] / 1e12:.1f} |" for k in result["kernels"]]
    g = result.get("generate")
    if g:
        lines += ["", f"bundled pair, fused generate: AR {g['AR']['tokens_per_second']:.0f} "
                      f"tokens/s, DDTree-32 + TEV {g['DDTree-32 + TEV']['tokens_per_second']:.0f}"
                      f" ({g['speedup']:.2f}x); rows differing at T = 0: {g['rows_differing']}"]
    c = result.get("calibration")
    if c:
        lines.append(f"calibration {c['gpu']}: fitted within {c['worst_ratio']:.2f}x of every "
                     f"program (kernels-alone rates: {c['first_guess_worst_ratio']:.2f}x)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-8b", choices=sorted(plan.PRESETS))
    ap.add_argument("--kernels", choices=("on", "off"), default="on",
                    help="off: trace no Pallas kernel (the XLA fallbacks)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes (tests)")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: "
                    "programs,kernels,blocks,generate")
    ap.add_argument("--out", default="gpu_measure", help="output directory")
    args = ap.parse_args(argv)
    s = SMOKE if args.smoke else FULL
    device = jax.devices()[0]
    if not args.smoke and device.platform != "gpu":
        raise SystemExit(f"needs a GPU (this machine has {device.platform} devices); "
                         "--smoke runs the tiny version on CPU")
    if args.kernels == "off":
        platforms.gpu_kernels_traced = lambda: False   # every caller asks the module
    chip = next((g for g in chips.GPUS.values() if g.chip.device_kind == device.device_kind),
                None)
    gpu_name = chip.name if chip is not None else ("h200" if args.smoke else None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    result = {"device_kind": device.device_kind, "gpu": gpu_name, "smoke": args.smoke,
              "kernels": [], "programs": [], "jax": jax.__version__,
              "cuda_plugins": platforms.cuda_plugins(),
              "kernels_traced": platforms.gpu_kernels_traced(), "model": args.model}
    t_start = time.perf_counter()
    if "kernels" not in skip:
        print("kernels alone:", flush=True)
        result["kernels"] = measure_kernels(s, args.smoke)
    if "blocks" not in skip:
        print("block sizes:", flush=True)
        result["blocks"] = sweep_blocks(s, args.smoke)
        if gpu_name is not None:
            (out / "blocks").mkdir(exist_ok=True)
            (out / "blocks" / f"{gpu_name}.json").write_text(
                json.dumps(result["blocks"]["best"], indent=1) + "\n")
    if "programs" not in skip:
        cfg = smoke_config() if args.smoke else plan.preset(args.model)
        print(f"programs of {args.model if not args.smoke else 'a tiny model'}:", flush=True)
        models = random_models(cfg, jnp.float32 if args.smoke else jnp.bfloat16)
        result["programs"] = measure_programs(cfg, models, s, gpu_name,
                                              None if chip is None else chip.chip)
    if "generate" not in skip:
        print("the bundled pair:", flush=True)
        result["generate"] = measure_generate(s)
    if result["kernels"] and result["programs"] and gpu_name is not None:
        guess = first_guess(result["kernels"], gpu_name)
        spec = chips.GPUS[gpu_name].chip
        programs = [(r["_ops"], r["_launches"], r["seconds"], True) for r in result["programs"]]
        _, first_worst = gpu_time.fit(guess, programs, peak_flops=spec.peak_flops,
                                      hbm_bandwidth=spec.hbm_bandwidth, rounds=0)
        fitted, worst = gpu_time.fit(guess, programs, peak_flops=spec.peak_flops,
                                     hbm_bandwidth=spec.hbm_bandwidth)
        fitted = dataclasses.replace(fitted, source=(
            f"{device.device_kind}, jax {jax.__version__}, plugins "
            f"{platforms.cuda_plugins()}, kernels {args.kernels}: kernels alone, fitted to "
            f"{len(programs)} programs of {args.model} (experiments/gpu/measure.py)"))
        (out / "gpus").mkdir(exist_ok=True)
        fitted.write(out / "gpus" / f"{gpu_name}.json")
        for r, (ops, items, _, _) in zip(result["programs"], programs):
            r["fitted_seconds"] = (gpu_time.estimate(ops, items, fitted)["seconds"]
                                   + fitted.call_seconds)
        result["calibration"] = fitted.as_dict() | {"worst_ratio": worst,
                                                    "first_guess_worst_ratio": first_worst}
    for r in result["programs"]:
        r.pop("_ops"), r.pop("_launches")
    result["seconds"] = time.perf_counter() - t_start
    (out / "measure.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(table(result))
    print(f"({result['seconds']:.0f} s; {out / 'measure.json'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
