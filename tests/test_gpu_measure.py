"""experiments/gpu/measure.py, the one command that measures tev-jax on a GPU, runs end
to end in its smoke mode on CPU (a tiny model, tiny shapes, the Pallas kernels
interpreted): every part fills its JSON, the bundled pair's AR and DDTree + TEV tokens
are equal at T = 0, the block-size sweep keeps the fastest of its variants, and the
calibration table it writes loads as `tev_jax.costs.gpu_time` reads the committed ones.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tev_jax.costs import gpu_time

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~65 s of compiles on 2 cores: the fast tier stays under 10 minutes
def test_the_measuring_script_smoke_run(tmp_path):
    out = tmp_path / "m"
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, str(ROOT / "experiments" / "gpu" / "measure.py"),
                          "--smoke", "--out", str(out)],
                         check=True, cwd=ROOT, capture_output=True, text=True, env=env)
    result = json.loads((out / "measure.json").read_text())
    assert result["smoke"] and result["gpu"] == "h200"
    names = [k["name"] for k in result["kernels"]]
    for kind in ("stacked_matmul", "XLA slice + dot", "XLA dot, unstacked",
                 "cache_attention_gpu", "XLA attention", "XLA elementwise",
                 "one-element kernels"):
        assert any(n.startswith(kind) or kind in n for n in names), kind
    assert all(k["seconds"] > 0 for k in result["kernels"])
    programs = result["programs"]
    assert {(p["batch"], p["budget"]) for p in programs} == {(1, None), (1, 4), (2, None),
                                                               (2, 4)}
    for p in programs:
        assert p["seconds"] > 0 and p["hbm_bytes"] > 0 and p["floor_bytes"] > 0
        assert p["launches"]["total"] >= p["launches"]["other_than_layers"] > 0
        assert p["estimate_seconds"] > 0 and math.isfinite(p["fitted_seconds"])
    rounds = {p["batch"]: p for p in programs if p["budget"]}
    ar = {p["batch"]: p for p in programs if p["budget"] is None}
    assert all(rounds[b]["launches"]["total"] > ar[b]["launches"]["total"] for b in ar)
    g = result["generate"]
    assert g["rows_differing"] == 0
    assert g["AR"]["tokens_per_second"] > 0 and g["DDTree-32 + TEV"]["tokens_per_second"] > 0
    blocks = result["blocks"]
    assert set(blocks["best"]) == {"stacked_matmul", "cache_attention"}
    assert all(len(v) >= 2 and all(r["seconds"] > 0 for r in v)
               for v in blocks["tried"].values())
    assert json.loads((out / "blocks" / "h200.json").read_text()) == blocks["best"]
    table = gpu_time.load("h200", tables=out / "gpus")
    assert table is not None and set(table.rates) == set(gpu_time.CLASSES)
    assert result["calibration"]["worst_ratio"] >= 1.0
    assert "| B | program | measured ms |" in run.stdout
    assert "rows differing at T = 0: 0" in run.stdout
