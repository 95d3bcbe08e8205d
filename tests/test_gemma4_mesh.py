"""Gemma 4 on the 8-device meshes: the one that splits its heads in the fast tier, all five
in the slow tier (its own file so that pytest-xdist's per-file scheduling runs it beside
tests/test_gemma4.py, not after it)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from test_decode_mesh import MESHES, PROMPTS
from test_gemma4 import _decode_config, decode_models  # noqa: F401  (a fixture)
from tev_jax import engine
from tev_jax import sharding as shd
from tev_jax.sampling import Sampling


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")
@pytest.mark.parametrize("mesh_name", [
    m if m == "tensor8" else pytest.param(m, marks=pytest.mark.slow) for m in MESHES])
def test_mesh_gives_single_device_tokens(decode_models, mesh_name):  # noqa: F811
    """T = 1, key 3: every 8-device mesh gives the single-device tokens. Tensor 8 (the
    fast tier) splits the sliding layers' heads; the global layer's single key/value
    head cannot split: it is replicated. The data, fsdp and mixed meshes split nothing of
    Gemma 4's own (its layer kinds and heads) and run in the slow tier (issue 47, item
    16); tests/test_decode_mesh.py runs them for the dense model in the fast tier."""
    target, drafter = decode_models
    cfg = _decode_config(sampling=Sampling(1.0))
    ref = engine.generate(target, drafter, PROMPTS, cfg, key=3)
    out = engine.generate(target, drafter, PROMPTS, cfg, key=3,
                          mesh=shd.make_mesh(**MESHES[mesh_name]))
    assert out.rows() == ref.rows()
    np.testing.assert_array_equal(out.stats.block_lengths, ref.stats.block_lengths)
