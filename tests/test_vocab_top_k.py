"""`tev_jax.vocab.top_k` at k = 1 on TPU: a max and an argmax, equal to ``lax.top_k``
(ties: the first index), and compiled for TPU without the sort that TPU's compiler
makes of ``lax.top_k`` (a round's greedy check: [32, 33, 37 984] logits per chip of
Qwen3-Coder-30B-A3B on v5p-8 sorted, 0.8 GB per round)."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import topologies

from tev_jax import vocab


def test_the_tpu_top_1_equals_lax_top_k_with_ties():
    """The TPU branch, run here: values and indices of ``lax.top_k(x, 1)``, with ties at
    the maximum (the first wins), a row of -inf and a row whose maximum is last."""
    x = jax.random.normal(jax.random.key(0), (4, 6, 1000))
    x = x.at[0, :, 17].set(9.0).at[0, :, 400].set(9.0)
    x = x.at[1].set(-jnp.inf).at[2, :, 999].set(9.0)
    want = jax.lax.top_k(x, 1)
    got = vocab._top_1(x)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert np.asarray(got[1])[0, 0, 0] == 17 and np.asarray(got[1])[2, 0, 0] == 999


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install -e '.[tpu]')")
@pytest.mark.slow  # the fast tier's time (README: under 10 minutes here), 2026-12-06
def test_the_top_1_compiles_for_tpu_without_a_sort():
    """[32, 33, 37 984] float32 compiled for one v5p chip: `vocab.top_k` (k 1) has no
    sort; the control, ``lax.top_k``, sorts the rows."""
    dev = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices[0]
    x = jax.ShapeDtypeStruct((32, 33, 37_984), jnp.float32,
                             sharding=jax.sharding.SingleDeviceSharding(dev))

    def sorts(fn):
        text = jax.jit(fn).trace(x).lower(lowering_platforms=("tpu",)).compile().as_text()
        return [line for line in text.splitlines() if " sort(" in line]

    assert sorts(lambda a: vocab.top_k(a, 1)) == []
    assert sorts(lambda a: jax.lax.top_k(a, 1))
