"""The worked extensions of examples/ run on the bundled models and show what they claim.

Each test runs the example's ``main`` with small settings (fewer tokens, draws or
steps than the command-line defaults); an example also runs as a script from any folder.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from examples import custom_verifier, custom_weighting, fixed_tree_builder
from tev_jax import decode, engine, extensions


def test_fixed_tree_builder_decodes_the_greedy_text():
    out = fixed_tree_builder.main(max_new_tokens=24)
    assert out["same"] and len(out["tokens"]) == 24
    assert out["tau"] > 1.0  # the tree was used: some rounds accepted draft tokens


def test_fixed_tree_shape_errors_are_named():
    logits = jnp.zeros((2, 16))
    builder = lambda **kw: (lambda x, r: fixed_tree_builder.fixed_tree_builder(x, r, **kw))
    assert extensions.builder_num_slots(builder(), 3, 16) == len(fixed_tree_builder.PARENTS)
    with pytest.raises(ValueError, match="depth <= H = 2"):
        fixed_tree_builder.fixed_tree_builder(logits, jnp.int32(0))
    with pytest.raises(ValueError, match="two children of node 0 have rank 0"):
        builder(parents=(-1, 0, 0), ranks=(0, 0, 0))(logits, jnp.int32(0))


@pytest.mark.slow
def test_custom_verifiers_one_lossless_one_not():
    reports = custom_verifier.main(budget=6, num_draws=20_000)
    exact, lossy = reports["exit_first"], reports["typical_acceptance"]
    assert exact.passed, exact
    assert not lossy.passed, lossy
    assert lossy.impossible_hits > 10 * lossy.max_impossible_hits  # bonus on a child token


def test_custom_verifier_is_an_engine_verifier():
    """The lossless example verifier also decodes the greedy text inside the engine."""
    target, drafter, tokenizer = custom_verifier.load_bundled()
    ids = [tokenizer.encode("Question: 2 + 3?").ids]
    config = decode.DecodeConfig(max_new_tokens=12, budget=8,
                                 verifier=custom_verifier.exit_first)
    assert (engine.generate(target, drafter, ids, config).rows()
            == engine.generate_ar(target, ids, config).rows())


def test_custom_weighting_trains():
    history = custom_weighting.main(steps=2, budget=8, num_anchors=2, seq_len=48)
    assert len(history) == 2
    for m in history:
        assert np.isfinite(m["loss"]) and m["exit_loss"] > 0 and m["exit_weight"] > 0
    # Step 2's metrics are of the parameters after step 1's update: it learned.
    assert history[1]["exit_loss"] < history[0]["exit_loss"]


def test_examples_run_from_any_folder(tmp_path):
    """Issue 47, item 14: an example runs as a script from another folder (its --help
    here: the imports are what failed)."""
    script = Path(__file__).resolve().parents[1] / "examples" / "fixed_tree_builder.py"
    run = subprocess.run([sys.executable, str(script), "--help"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "--max-new-tokens" in run.stdout, run.stderr[-500:]
