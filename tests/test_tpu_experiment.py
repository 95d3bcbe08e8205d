"""The arithmetic of experiments/tpu/run.py: depth extrapolation, interpolation in the
tree slots and in B, and the tables built from the committed results."""

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


def _program(flops, bytes_accessed, temp=10.0, seconds=1.0):
    return {"flops": flops, "bytes_accessed": bytes_accessed, "argument_bytes": 2 * flops,
            "output_bytes": 3.0, "alias_bytes": 1.0, "code_bytes": 4.0, "temp_bytes": temp,
            "compile_seconds": seconds}


def test_extrapolation_is_linear_in_layers_and_keeps_the_larger_temporaries(run):
    one, two = _program(10.0, 100.0, temp=7.0), _program(13.0, 120.0, temp=5.0)
    full = run.extrapolate(one, two, 36)
    assert full["flops"] == 10.0 + 35 * 3.0
    assert full["bytes_accessed"] == 100.0 + 35 * 20.0
    assert full["temp_bytes"] == 7.0
    assert full["peak_bytes"] == (full["argument_bytes"] + full["output_bytes"] + 7.0
                                  - full["alias_bytes"] + full["code_bytes"])


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
    assert "4 layers" in run.validation_table(results)
