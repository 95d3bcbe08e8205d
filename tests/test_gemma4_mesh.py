"""Gemma 4 on the 8-device mesh that splits its heads (its own file so that pytest-xdist's
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
    """T = 1, key 3: tensor 8 gives the single-device tokens (the sliding layers' heads
    split, the global layer's single key/value head cannot: it is replicated). The data,
    fsdp and mixed meshes split nothing of Gemma 4's own (its layer kinds and heads);
    tests/test_decode_mesh.py and tests/test_moe.py run them for the dense and MoE
    models."""
    target, drafter = decode_models
    cfg = _decode_config(sampling=Sampling(1.0))
    ref = engine.generate(target, drafter, PROMPTS, cfg, key=3)
    out = engine.generate(target, drafter, PROMPTS, cfg, key=3,
                          mesh=shd.make_mesh(**MESHES["tensor8"]))
    assert out.rows() == ref.rows()
    np.testing.assert_array_equal(out.stats.block_lengths, ref.stats.block_lengths)
