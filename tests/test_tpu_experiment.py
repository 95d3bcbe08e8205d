"""The arithmetic of experiments/tpu/run.py: interpolation in the tree slots and in B,
today's full-depth compiles against the old extrapolation, and the tables built from the
committed results."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run():
    spec = importlib.util.spec_from_file_location("tpu_run", ROOT / "experiments/tpu/run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_extrapolation_table_gives_median_ratios_per_layout_and_kind(run):
    full = lambda f, b, p: {"compiler_flops": f, "compiler_bytes_accessed": b,
                            "peak_bytes": p}
    entry = lambda budget, f: {"mesh": "tensor8", "budget": budget, "full": f}
    today = {f"decode/m/B{i}/b16": entry(16, full(2.0 * i, 1.0, 3.0)) for i in (1, 2, 3)}
    today["decode/m/B1/ar"] = entry(None, full(1.0, 1.0, 1.0))
    today["decode/m/B9/b16"] = entry(16, full(1.0, 1.0, 1.0))    # nothing to compare
    old = {k: {"full": {"flops": 2.0, "bytes_accessed": 4.0, "peak_bytes": 3.0}}
           for k in today if "B9" not in k}
    rows = run.extrapolation_table(today, old).splitlines()[2:]
    assert rows == ["| tensor8 | AR | 1 | 0.50x | 0.25x | 0.33x |",
                    "| tensor8 | round | 3 | 2.00x | 0.25x | 1.00x |"]


def test_interpolation_in_tree_slots_and_in_batch(run):
    # figures linear in N = b + 1 and in B are recovered exactly
    cost = lambda batch, budget: {"full": {"flops": 5.0 * batch * (budget + 1),
                                           "bytes_accessed": 1e3 + batch * (budget + 1),
                                           "peak_bytes": 2.0 * batch}}
    entries = {b: cost(8, b) for b in run.BRACKET} | {None: cost(8, 0)}
    for budget in (32, 128):
        assert run.interpolated(entries, budget)["full"] == pytest.approx(
            cost(8, budget)["full"])
    assert run.interpolated(entries, 512) is None  # not bracketed
    groups = {("m", "v5e", "tensor8", bs): {b: cost(bs, b or 0) for b in (None, 16, 64)}
              for bs in (8, 64)}
    filled = run.with_batch_interpolation(groups)
    assert filled["m", "v5e", "tensor8", 32][64]["full"] == pytest.approx(cost(32, 64)["full"])
    assert filled["m", "v5e", "tensor8", 32][64]["mark"] == "≈"
    groups["m", "v5e", "tensor8", 32] = {64: cost(32, 64)}  # compiled B 32 is kept,
    filled = run.with_batch_interpolation(groups)            # its gaps filled
    assert filled["m", "v5e", "tensor8", 32][64] == cost(32, 64)
    assert filled["m", "v5e", "tensor8", 32][None]["mark"] == "≈"


def test_tables_of_the_committed_results(run):
    results = json.loads((ROOT / "experiments/tpu/results.json").read_text())
    table = run.decode_table(results)
    row = next(line for line in table.splitlines()
               if line.startswith("| qwen3-8b | v5e | tensor8 | 8 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    base = "decode/qwen3-8b/v5e/tensor8/B8/"
    t_ar = run._seconds(results[base + "ar"], "v5e")
    t64 = run._seconds(results[base + "b64"], "v5e")
    assert cells[4] == f"{t_ar * 1e3:.1f}"
    assert cells[7] == f"{t64 * 1e3:.1f} ({t64 / t_ar:.2f})"
    # the chosen budget maximises τ(b) × AR time / round time over the budgets that fit
    best = max(run.BUDGETS, key=lambda b: run.ddtree_tau("qwen3-8b", b)[0] * t_ar
               / run._seconds(results[base + f"b{b}"], "v5e"))
    assert cells[11] == str(best)
    assert "| qwen3-8b | 1 | v5p:2x2x2 | 8 |" in run.train_table(results)
    extrapolated = json.loads((ROOT / "experiments/tpu/results_extrapolated.json").read_text())
    assert "| tensor8 | round | " in run.extrapolation_table(results, extrapolated)
