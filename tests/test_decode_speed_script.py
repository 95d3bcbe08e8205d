"""experiments/decode_speed runs end to end on the engine's public API (a tiny version).

The study times the fused program and the un-fused per-stage path of `tev_jax.costs.timing`
on random models; here with one budget, T = 0 and 8 new tokens. Both paths must decode
the same number of tokens in the same number of rounds for every configuration (they
run the same stages with the same key), AR must have τ = 1, the oracle drafter's
chains must be accepted, and every time must be finite.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_decode_speed_quick_run(tmp_path):
    """An end-to-end run of the study script (a subprocess): the slow tier."""
    out = tmp_path / "results.json"
    subprocess.run([sys.executable, str(ROOT / "experiments" / "decode_speed" / "run.py"),
                    "--quick", "--budgets", "16", "--temperatures", "0",
                    "--max-new-tokens", "8", "--prompt-len", "16", "--out", str(out)],
                   check=True, cwd=ROOT, capture_output=True, text=True)
    runs = json.loads(out.read_text())["runs"]
    fused = {r["config"]: r for r in runs if r["path"] == "fused"}
    assert set(fused) == {"AR", "chain+tev", "ddtree16+predraw", "ddtree16+tev"}
    dflash = [r for r in runs if r["path"] == "unfused" and r["drafter"] == "dflash"]
    assert {r["config"] for r in dflash} == set(fused)
    for r in dflash:
        f = fused[r["config"]]
        assert (r["tokens"], r["rounds"]) == (f["tokens"], f["rounds"]), r["config"]
    assert fused["AR"]["tau"] == 1.0
    assert all(math.isfinite(r["seconds"]) and r["seconds"] > 0 for r in runs)
    oracle = {r["config"]: r for r in runs if r["drafter"] == "oracle"}
    assert oracle["chain+tev"]["tau"] > 1.0  # the oracle's chains are accepted
