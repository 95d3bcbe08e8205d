"""Gemma 4 on the suite's 8-device meshes that split its heads (its own file so that pytest-xdist's
per-file scheduling runs it beside tests/test_gemma4.py, not after it)."""

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
def test_mesh_gives_single_device_tokens(decode_models):  # noqa: F811
    """T = 1, key 3: tensor 8 and data 2 x fsdp 2 x tensor 2 give the single-device
    tokens (the global layer's single key/value head cannot split: it is replicated).
    The data-only and fsdp-only meshes split nothing of Gemma 4's own (its layer kinds
    and heads); tests/test_decode_mesh.py runs them for the dense model."""
    target, drafter = decode_models
    cfg = _decode_config(sampling=Sampling(1.0))
    ref = engine.generate(target, drafter, PROMPTS, cfg, key=3)
    for name in ("tensor8", "2x2x2"):
        axes = MESHES[name]
        out = engine.generate(target, drafter, PROMPTS, cfg, key=3, mesh=shd.make_mesh(**axes))
        assert out.rows() == ref.rows(), name
        np.testing.assert_array_equal(out.stats.block_lengths, ref.stats.block_lengths)
