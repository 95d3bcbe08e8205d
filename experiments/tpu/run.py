"""TPU plans of real model sizes, compiled on this CPU machine with libtpu (ahead of time).

Decoding: Qwen3-4B, Qwen3-8B and Llama-3-8B, bfloat16, 1-layer DFlash drafter (block 16),
on v5e-8 and v6e-8 slices (tensor 8; data 2 x tensor 4), batch B, DDTree budget b with
TEV, prompt buffer 1024, cache 2048: per chip the round program's memory, the roofline
time of one speculative round and of one AR step (max(FLOPs / peak, bytes / bandwidth),
`tev_jax.costs.chips.CHIPS`), the break-even τ (round / AR step) and the estimated speed-up
at the τ DDTree reports. Training: one ExitTrain update for 4B / 8B targets with 1- and
5-layer drafters on v5p-8 (fsdp 8), v5e-16 (fsdp 16, 4 hosts) and v5p-64 (fsdp 64, 16
hosts): per-chip memory, step roofline time, MFU estimate, compile time.

Every program is compiled at full depth (the layers are one scan, so a 36-layer program
compiles about as fast as a 1-layer one). A decode program is the fused rounds loop
(`Engine.lower("run_rounds")`); per chip its memory, and one round's HBM bytes and FLOPs
from the per-op table (`tev_jax.costs.op_costs`) against its floor of bytes
(`tev_jax.costs.plan.round_floor`: the weights and both caches it must read). Every budget is
compiled for Qwen3-8B on tensor 8; elsewhere budgets 16 / 64 / 256, with 32 and 128
interpolated in the tree slots (and, where B 32 is not compiled, B 32 between B 8 and
64); `interpolation_checks` measures both on the full grids. Results are cached in the
output JSON (reruns skip what is there); ``--claim DIR`` lets several workers share the
grid; ``--report`` prints the README tables. Until session 35 the grid was extrapolated
from 1- and 2-layer compiles; those figures are kept in ``results_extrapolated.json``
and ``--report`` sets them beside today's (`extrapolation_table`).

    JAX_PLATFORMS=cpu python experiments/tpu/run.py [--quick] [--train]
    python experiments/tpu/run.py --report experiments/tpu/results.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tev_jax.runtime.platforms import quiet_start

if __name__ == "__main__":
    quiet_start()  # before jax is imported: no libtpu or CUDA plugin lines on a CPU

import jax.numpy as jnp  # noqa: E402

from tev_jax.costs import chips as topology
from tev_jax.costs import op_costs, plan
from tev_jax.decode import DecodeConfig  # noqa: E402
from tev_jax.engine import Engine  # noqa: E402

HERE = Path(__file__).resolve().parent
FIELDS = ("flops", "bytes_accessed", "argument_bytes", "output_bytes", "alias_bytes",
          "code_bytes")
MESHES = {"tensor8": dict(tensor=8, fsdp=1), "data2_tensor4": dict(data=2, tensor=4, fsdp=1)}
SLICES = {"v5e": "v5e:2x4", "v6e": "v6e:2x4"}
PROMPT_LEN, CACHE_LEN, MAX_NEW = 1024, 2048, 256

BATCHES, BUDGETS = (1, 8, 32, 64), (16, 32, 64, 128, 256)
BRACKET = (16, 64, 256)  # compiled everywhere; 32 and 128 interpolated where not compiled
MODELS = ("qwen3-8b", "qwen3-4b", "llama3-8b")
# (model, chip, mesh) -> (batches, compiled budgets), in the order they are compiled (a
# round costs two TPU compiles, about a minute on this 2-core machine): Qwen3-8B tensor 8
# on both chips every budget; the other models and data 2 x tensor 4 the bracketing
# budgets (`decode_table` interpolates 32 and 128 in the tree slots between them).
DECODE_GRID = {("qwen3-8b", chip, "tensor8"): (BATCHES, BUDGETS) for chip in SLICES}
DECODE_GRID |= {(model, chip, "tensor8"): (BATCHES, BRACKET)
                for model in MODELS[1:] for chip in SLICES}
DECODE_GRID |= {(model, chip, "data2_tensor4"): ((8, 64, 32), BRACKET)
                for model in MODELS for chip in SLICES}
# (target, drafter layers, slice, fsdp = chips): one sequence of 2048 tokens per chip,
# 32 anchors, budget 32; bf16 frozen target, float32 drafter.
TRAIN_GRID = tuple((model, drafter_layers, slice_name, chips)
                   for slice_name, chips in (("v5p:2x2x2", 8), ("v5e:4x4", 16),
                                             ("v5p:4x4x4", 64))
                   for model in ("qwen3-4b", "qwen3-8b") for drafter_layers in (1, 5))
SEQ_LEN, ANCHORS, TRAIN_BUDGET = 2048, 32, 32
QUICK_GRID = {("qwen3-8b", "v5e", "tensor8"): ((8,), (64,))}


def round_record(engine: Engine, compiled, chip) -> dict:
    """Per chip, of a compiled rounds loop (``engine.lower("run_rounds")``): its memory,
    one round's HBM bytes and FLOPs (`op_costs`), its floor of bytes
    (`plan.round_floor`) and both rooflines. Shared with moe.py and gemma4.py."""
    mem = compiled.memory_analysis()
    t = op_costs.totals(op_costs.op_costs(compiled.as_text()))
    floor = plan.round_floor(engine)
    floor_total = plan.sum_floor(floor)
    return {
        "peak_bytes": (mem.argument_size_in_bytes + mem.output_size_in_bytes
                       + mem.temp_size_in_bytes - mem.alias_size_in_bytes),
        "temp_bytes": mem.temp_size_in_bytes,
        "round_hbm_bytes": t["loop_hbm_bytes"], "round_flops": t["loop_flops"],
        "floor": floor, "hbm_over_floor": t["loop_hbm_bytes"] / floor_total,
        "roofline_seconds": max(t["loop_flops"] / chip.peak_flops,
                                t["loop_hbm_bytes"] / chip.hbm_bandwidth),
        "floor_seconds": floor_total / chip.hbm_bandwidth,
    }


def decode_program(model: str, chip: str, mesh_name: str, batch: int,
                   budget: int | None, cache_len: int | None = CACHE_LEN) -> dict:
    """Compiles the rounds loop of a DDTree + TEV round at ``budget`` (None: the AR step)
    at full depth (``cache_len`` None: the cache the program needs, P + M + N); -> its
    `round_record` as the entry's ``full`` figures (``flops`` and ``bytes_accessed`` of
    one round: FLOPs and HBM bytes) and the compiler's own (`plan.ProgramReport`: its
    bytes accessed count on-chip reads too). Shared with tune.py."""
    mesh, tpu = topology.slice_mesh(SLICES[chip], **MESHES[mesh_name])
    config = DecodeConfig(max_new_tokens=MAX_NEW, budget=budget or 1, verifier="tev",
                          prompt_len=PROMPT_LEN, max_cache_len=cache_len,
                          builder="ddtree" if budget else "none")
    target, drafter = plan.abstract_models(plan.preset(model), config, dtype=jnp.bfloat16)
    engine = Engine.create(target, drafter if budget else None, config, batch, mesh=mesh)
    t0 = time.perf_counter()
    compiled = engine.lower("run_rounds").compile()
    seconds = time.perf_counter() - t0
    record = round_record(engine, compiled, tpu.chip)
    compiler = plan.ProgramReport.of(compiled, seconds)
    return record | {"flops": record["round_flops"],
                     "bytes_accessed": record["round_hbm_bytes"],
                     "compiler_flops": compiler.flops,
                     "compiler_bytes_accessed": compiler.bytes_accessed,
                     "compile_seconds": seconds}


def decode_items(grid: dict) -> list[tuple[str, callable]]:
    """(results key, thunk) per program of the grid: the AR step and each budget."""
    items = []
    for (model, chip, mesh_name), (batches, budgets) in grid.items():
        for batch in batches:
            if mesh_name.startswith("data2") and batch % 2:
                continue  # the batch must split over data 2
            for budget in (None, *budgets):
                key = f"decode/{model}/{chip}/{mesh_name}/B{batch}/" + (
                    f"b{budget}" if budget else "ar")

                def thunk(model=model, chip=chip, mesh_name=mesh_name, batch=batch,
                          budget=budget):
                    entry = {"model": model, "chip": chip, "mesh": mesh_name,
                             "batch": batch, "budget": budget,
                             "layers": plan.PRESETS[model].num_layers}
                    try:
                        return entry | {"full": decode_program(model, chip, mesh_name,
                                                               batch, budget)}
                    except Exception as e:  # the compiler's own words (out of HBM)
                        return entry | {"error": str(e).strip().splitlines()[0][:300]}
                items.append((key, thunk))
    return items


def train_step(model: str, drafter_layers: int, slice_name: str, chips: int) -> dict:
    """One ExitTrain update at full depth: its `plan.ProgramReport` as a dict."""
    from train.plan import plan_step

    step = plan_step(plan.preset(model), drafter_layers=drafter_layers,
                     batch=chips, seq_len=SEQ_LEN, anchors=ANCHORS, budget=TRAIN_BUDGET,
                     mesh_shape=(1, chips, 1), target_dtype="bfloat16", topology=slice_name)
    r = step.report
    return dataclasses.asdict(r) | {"peak_bytes": r.peak_bytes}


def train_items() -> list[tuple[str, callable]]:
    from tev_jax.costs.plan import abstract_drafter
    from train.plan import step_model_flops

    items = []
    for model, drafter_layers, slice_name, chips in TRAIN_GRID:
        def thunk(model=model, drafter_layers=drafter_layers, slice_name=slice_name,
                  chips=chips):
            cfg = plan.PRESETS[model]
            drafter = abstract_drafter(cfg, "float32", num_layers=drafter_layers)
            return {"model": model, "drafter_layers": drafter_layers, "slice": slice_name,
                    "chips": chips, "batch": chips, "layers": cfg.num_layers,
                    "full": train_step(model, drafter_layers, slice_name, chips),
                    "model_flops": step_model_flops(cfg, drafter, batch=chips,
                                                    seq_len=SEQ_LEN, anchors=ANCHORS,
                                                    budget=TRAIN_BUDGET)}
        items.append((f"train/{model}/d{drafter_layers}/{slice_name}", thunk))
    return items


def work_order() -> list[tuple[str, callable]]:
    """Every program, the ones the tables lean on first: the decode programs by layout
    (tensor 8 first), batch size (B 32, which can be interpolated, last) and chip (v5e
    first), then the training steps."""
    decode = decode_items(DECODE_GRID)
    rank = lambda key: ("data2" in key, "/B32/" in key, "/v6e/" in key)
    return ([decode[i] for i in sorted(range(len(decode)),
                                         key=lambda i: (rank(decode[i][0]), i))]
            + train_items())


def claim(folder: Path, key: str) -> bool:
    """True for the one worker that claims ``key`` first (an exclusive create)."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(folder / key.replace("/", "_").replace(":", "-"),
                         os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


def extrapolation_table(results: dict, extrapolated: dict) -> str:
    """Today's full-depth compiles against the figures extrapolated from 1- and 2-layer
    compiles of the programs of session 28 (``results_extrapolated.json``): per layout and
    program kind, the median ratio of the compiler's FLOPs and bytes accessed, and of the
    per-chip memory (full depth / extrapolated)."""
    groups: dict = {}
    for key, e in results.items():
        old = extrapolated.get(key, {}).get("full")
        if not key.startswith("decode/") or "full" not in e or old is None:
            continue
        f = e["full"]
        groups.setdefault((e["mesh"], "AR" if e["budget"] is None else "round"), []).append(
            (f["compiler_flops"] / old["flops"],
             f["compiler_bytes_accessed"] / old["bytes_accessed"],
             f["peak_bytes"] / old["peak_bytes"]))
    rows = ["| mesh | program | programs | FLOPs | bytes accessed | GiB / chip |",
            "|---|---|---|---|---|---|"]
    for (mesh, kind), ratios in sorted(groups.items()):
        med = [sorted(col)[len(col) // 2] for col in zip(*ratios)]
        rows.append(f"| {mesh} | {kind} | {len(ratios)} | "
                    + " | ".join(f"{m:.2f}x" for m in med) + " |")
    return "\n".join(rows) if len(rows) > 2 else ""


# --------------------------------------------------------------------------- report

# DDTree's published acceptance lengths τ at T = 0 (arXiv 2604.12989, "Accelerating
# Speculative Decoding with Block Diffusion Draft Trees"; liranringel/ddtree, branch site):
# - per node budget, Qwen3-8B on MATH-500: the project page's node-budget figure
#   (public/assets/project/math500-budget-tradeoff.pdf, read from its vector paths);
# - at the best budget per dataset and model: Table 1 (src/data/results.tex).
DDTREE_MATH500 = {16: 8.61, 32: 9.27, 64: 9.75, 128: 10.20, 256: 10.43, 512: 10.73,
                  1024: 10.97}
DDTREE_TABLE1 = {"qwen3-4b": {"MATH-500": 10.71, "GSM8K": 9.33, "MT-Bench": 6.70},
                 "qwen3-8b": {"MATH-500": 10.73, "GSM8K": 9.54, "MT-Bench": 6.58}}


def ddtree_tau(model: str, budget: int) -> tuple[float, dict[str, float]]:
    """τ(b) from the MATH-500 curve, scaled to ``model``'s MATH-500 entry of Table 1, and
    Table 1's best-budget τ per dataset. DDTree reports nothing for Llama-3-8B: Qwen3-8B's
    figures stand in for it."""
    table = DDTREE_TABLE1.get(model, DDTREE_TABLE1["qwen3-8b"])
    curve = DDTREE_MATH500[budget] * table["MATH-500"] / DDTREE_TABLE1["qwen3-8b"]["MATH-500"]
    return curve, table


def _seconds(entry: dict, chip: str) -> float:
    c = topology.CHIPS[chip]
    f = entry["full"]
    return max(f["flops"] / c.peak_flops, f["bytes_accessed"] / c.hbm_bandwidth)


def _decode_groups(results: dict) -> dict:
    """(model, chip, mesh, B) -> {budget or None for AR: entry}, compiled entries only."""
    groups: dict = {}
    for key, e in results.items():
        if key.startswith("decode/") and "full" in e:
            groups.setdefault((e["model"], e["chip"], e["mesh"], e["batch"]), {})[
                e["budget"]] = e
    return groups


def decode_programs_table(results: dict) -> str:
    """Every compiled round: memory, roofline times, break-even τ, speed-ups."""
    rows = ["| model | chip | mesh | B | budget | GiB / chip | HBM / floor (round, AR) | "
            "round ms | AR ms | break-even τ | τ(b) MATH-500 | speed-up at τ(b) | "
            "at MT-Bench / GSM8K τ |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (model, chip, mesh, batch), entries in sorted(_decode_groups(results).items()):
        if None not in entries:
            continue
        t_ar = _seconds(entries[None], chip)
        for budget in sorted(b for b in entries if b is not None):
            e = entries[budget]
            t = _seconds(e, chip)
            curve, table = ddtree_tau(model, budget)
            rows.append(f"| {model} | {chip} | {mesh} | {batch} | {budget} | "
                        f"{e['full']['peak_bytes'] / 2**30:.2f} | "
                        f"{e['full']['hbm_over_floor']:.2f}, "
                        f"{entries[None]['full']['hbm_over_floor']:.2f} | {t * 1e3:.2f} | "
                        f"{t_ar * 1e3:.2f} | {t / t_ar:.2f} | {curve:.2f} | "
                        f"{curve * t_ar / t:.2f} | {table['MT-Bench'] * t_ar / t:.2f} / "
                        f"{table['GSM8K'] * t_ar / t:.2f} |")
    return "\n".join(rows)


LINEAR = ("flops", "bytes_accessed", "peak_bytes")


def _between(x: float, lo: float, hi: float, a: dict, b: dict, mark: str) -> dict:
    w = (x - lo) / (hi - lo)
    return {"full": {k: a["full"][k] + w * (b["full"][k] - a["full"][k]) for k in LINEAR},
            "mark": mark}


def interpolated(entries: dict, budget: int) -> dict | None:
    """Full-depth figures of ``budget`` interpolated linearly in the tree slots N = b + 1
    between the nearest compiled budgets of ``entries`` (None if it is not bracketed)."""
    lo = [b for b in entries if b is not None and b < budget]
    hi = [b for b in entries if b is not None and b > budget]
    if not lo or not hi:
        return None
    lo, hi = max(lo), min(hi)
    return _between(budget, lo, hi, entries[lo], entries[hi], "~")


def with_batch_interpolation(groups: dict) -> dict:
    """``groups`` plus, where a program of B 32 was not compiled (or set aside) but B 8's
    and 64's were, that program interpolated linearly in B (marked ≈)."""
    out = dict(groups)
    for (model, chip, mesh, batch), low in groups.items():
        high = groups.get((model, chip, mesh, 64))
        if batch != 8 or high is None:
            continue
        have = groups.get((model, chip, mesh, 32), {})
        out[model, chip, mesh, 32] = {b: _between(32, 8, 64, low[b], high[b], "≈")
                                      for b in low if b in high} | have
    return out


def decode_table(results: dict) -> str:
    """One row per (model, chip, mesh, B): each budget's round time and break-even τ
    (~: interpolated between compiled budgets, ≈: between compiled batch sizes), the
    largest per-chip memory, and the budget that maximises the speed-up on the MATH-500
    curve."""
    head = ["| model | chip | mesh | B | AR ms | "
            + " | ".join(f"b {b}" for b in BUDGETS)
            + " | GiB / chip (max) | best b (τ MATH-500) | est. speed-up | at MT-Bench / GSM8K τ |",
            "|---|---|---|---|---|" + "---|" * len(BUDGETS) + "---|---|---|---|"]
    rows = []
    groups = with_batch_interpolation(_decode_groups(results))
    for (model, chip, mesh, batch), entries in sorted(groups.items()):
        if None not in entries:
            continue
        t_ar = _seconds(entries[None], chip)
        cells, best = [], None
        for budget in BUDGETS:
            entry = entries.get(budget) or interpolated(entries, budget)
            if entry is None:
                cells.append("–")
                continue
            t, mark = _seconds(entry, chip), entry.get("mark", "")
            if entry["full"]["peak_bytes"] > topology.CHIPS[chip].hbm_bytes:
                cells.append(f"{mark}{t * 1e3:.1f} (> HBM)")
                continue
            cells.append(f"{mark}{t * 1e3:.1f} ({t / t_ar:.2f})")
            speedup = ddtree_tau(model, budget)[0] * t_ar / t
            if best is None or speedup > best[1]:
                best = (budget, speedup, t)
        gib = max(e["full"]["peak_bytes"] for e in entries.values()) / 2**30
        table = ddtree_tau(model, BUDGETS[0])[1]
        rows.append(f"| {model} | {chip} | {mesh} | {batch} | "
                    f"{entries[None].get('mark', '')}{t_ar * 1e3:.1f} | "
                    + " | ".join(cells) + f" | {gib:.2f} | "
                    + (f"{best[0]} | {best[1]:.2f} | {table['MT-Bench'] * t_ar / best[2]:.2f}"
                       f" / {table['GSM8K'] * t_ar / best[2]:.2f} |" if best else "– | – | – |"))
    return "\n".join(head + rows)


def interpolation_checks(results: dict) -> str:
    """Budgets 32 and 128 interpolated from the bracketing ones where every budget is
    compiled, and B 32 from B 8 and 64 where those three are, against their own compiles
    (roofline time, interpolated / compiled)."""
    rows = ["| model | chip | mesh | B | b 32 from b 16, 64 | b 128 from b 64, 256 | "
            "B 32 from B 8, 64 (AR / b 16 / 64 / 256) |", "|---|---|---|---|---|---|---|"]
    groups = _decode_groups(results)
    for (model, chip, mesh, batch), entries in sorted(groups.items()):
        low, high = groups.get((model, chip, mesh, 8)), groups.get((model, chip, mesh, 64))
        every_budget = set(BUDGETS) <= set(entries)
        if not every_budget and not (batch == 32 and low and high):
            continue
        cells = []
        for budget in (32, 128):
            if not every_budget:
                cells.append("–")
                continue
            bracket = {b: entries[b] for b in BRACKET}
            guess = _seconds(interpolated(bracket, budget), chip)
            cells.append(f"{guess / _seconds(entries[budget], chip):.3f}")
        if batch == 32 and low and high:
            cells.append(" / ".join(
                f"{_seconds(_between(32, 8, 64, low[b], high[b], ''), chip) / _seconds(entries[b], chip):.3f}"
                if b in low and b in high and b in entries else "–" for b in (None, *BRACKET)))
        else:
            cells.append("")
        rows.append(f"| {model} | {chip} | {mesh} | {batch} | " + " | ".join(cells) + " |")
    return "\n".join(rows) if len(rows) > 2 else ""


def train_table(results: dict) -> str:
    rows = ["| target | drafter layers | slice | chips | GiB / chip | TFLOP / chip | "
            "GB / chip | step ms (roofline) | MFU estimate | compile s |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    train = [e for key, e in results.items() if key.startswith("train/")]
    for e in sorted(train, key=lambda e: (e["chips"], e["model"], e["drafter_layers"])):
        chip = topology.CHIPS[e["slice"].split(":")[0]]
        f = e["full"]
        t = max(f["flops"] / chip.peak_flops, f["bytes_accessed"] / chip.hbm_bandwidth)
        mfu = e["model_flops"] / (e["chips"] * chip.peak_flops * t)
        rows.append(f"| {e['model']} | {e['drafter_layers']} | {e['slice']} | {e['chips']} | "
                    f"{f['peak_bytes'] / 2**30:.2f} | {f['flops'] / 1e12:.2f} | "
                    f"{f['bytes_accessed'] / 1e9:.1f} | {t * 1e3:.0f} | {mfu:.1%} | "
                    f"{f['compile_seconds']:.0f} |")
    return "\n".join(rows)


def tables(results: dict) -> str:
    old = HERE / "results_extrapolated.json"
    extrapolated = json.loads(old.read_text()) if old.is_file() else {}
    return "\n\n".join(t for t in (decode_table(results), interpolation_checks(results),
                                     train_table(results),
                                     extrapolation_table(results, extrapolated)) if t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one configuration")
    ap.add_argument("--train", action="store_true", help="also the training steps")
    ap.add_argument("--claim", default=None, metavar="DIR",
                    help="parallel workers: each takes the next program no other worker "
                         "has claimed in DIR and writes only its own --out (join them "
                         "with --merge); the cache is results.json")
    ap.add_argument("--out", default=None)
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="merge these result files into --out and stop")
    ap.add_argument("--report", default=None, metavar="JSON",
                    help="print the tables; the per-program table goes to decode.md")
    args = ap.parse_args(argv)
    if args.report:
        results = json.loads(Path(args.report).read_text())
        (HERE / "decode.md").write_text(
            "# Every compiled decode program (generated by `run.py --report`)\n\n"
            + decode_programs_table(results) + "\n")
        print(tables(results))
        return 0
    out = Path(args.out) if args.out else HERE / ("results_quick.json" if args.quick
                                                  else "results.json")
    results = json.loads(out.read_text()) if out.exists() else {}
    if args.merge:
        for name in args.merge:
            results.update(json.loads(Path(name).read_text()))
        out.write_text(json.dumps(results, indent=1) + "\n")
        return 0
    shared = HERE / "results.json"
    cache = results if args.claim is None or not shared.is_file() else (
        json.loads(shared.read_text()) | results)
    items = (decode_items(QUICK_GRID) if args.quick else work_order())
    if not args.train:
        items = [(k, f) for k, f in items if not k.startswith("train/")]
    for key, thunk in items:
        if key in cache or (args.claim and not claim(Path(args.claim), key)):
            continue
        t0 = time.perf_counter()
        results[key] = thunk()
        out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"{key}: {time.perf_counter() - t0:.0f} s", flush=True)
    print(tables(cache | results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
