"""`tev_jax.kernels.stacked_matmul`: the GPU product with one entry of a stacked weight,
read in place (Pallas Triton, run here in Pallas' interpreter), equals the sliced product:
alone (tiles that do not divide the rows or columns, one and several K splits), on each
device's shard of an 8-device mesh (the contraction split: summed over the devices), and
in its gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tev_jax import sharding as shd
from tev_jax.kernels import stacked_matmul as sm
from tev_jax.runtime import platforms


def _normal(rng, *shape):
    return jnp.asarray(rng.normal(size=shape), jnp.float32)


@pytest.mark.parametrize("m, k, n", [(5, 96, 40), (70, 200, 300), (20, 64, 50)])
def test_kernel_reads_entry_g_of_the_stack(m, k, n):
    """(5, 96, 40) and (70, 200, 300) split K over programs, (20, 64, 50) has one split
    and stores the product in the weight's dtype; rows and columns past a tile are
    masked. Negative control: another entry's product differs."""
    rng = np.random.default_rng(m)
    x, w = _normal(rng, m, k), _normal(rng, 3, k, n)
    got = np.asarray(sm.stacked_matmul(x, w, jnp.int32(2), interpret=True))
    want = np.asarray(x, np.float64) @ np.asarray(w[2], np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
    assert not np.allclose(got, np.asarray(x @ w[1]), atol=1e-1)


@pytest.mark.parametrize("in_axes, out_axes", [
    (("embed",), ("heads", "head_dim")),       # column-parallel (q_proj): heads split
    (("heads", "head_dim"), ("embed",)),       # row-parallel (o_proj): summed over tensor
])
def test_gpu_dot_on_a_mesh_equals_the_sliced_product(in_axes, out_axes):
    """Rows split over data 2, heads over tensor 4 (the rows' [B, T, ...] layout as the
    layers have it)."""
    rng = np.random.default_rng(1)
    sizes = {"embed": 32, "heads": 8, "head_dim": 16}
    ins, outs = tuple(sizes[a] for a in in_axes), tuple(sizes[a] for a in out_axes)
    x, w = _normal(rng, 4, 3, *ins), _normal(rng, 3, *ins, *outs)
    axes = ("layers",) + in_axes + out_axes
    mesh = shd.make_mesh(data=2, fsdp=1, tensor=4)
    dot = lambda x, w, g: sm.gpu_dot(x, w, g, len(ins), axes, interpret=True)
    with jax.set_mesh(mesh):
        got = jax.jit(dot)(x, w, jnp.int32(1))
        assert "pallas_call" in str(jax.make_jaxpr(dot)(x, w, jnp.int32(1)))  # not sliced
    want = jnp.tensordot(x, w[1], len(ins))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_gradient_is_the_sliced_products(monkeypatch):
    """Through the per-platform product that a GPU-capable process traces (its GPU
    branch not lowered on CPU) and its custom gradient."""
    monkeypatch.setattr(platforms, "gpu_kernels_traced", lambda: True)
    rng = np.random.default_rng(2)
    x, w = _normal(rng, 2, 3, 8), _normal(rng, 4, 8, 6)
    loss = lambda dot: lambda x, w: (dot(x, w) ** 2).sum()
    got = jax.grad(loss(lambda x, w: sm.stacked_dot(x, w, jnp.int32(3), 1, ("layers", "embed",
                                                                             "mlp"))),
                   (0, 1))(x, w)
    want = jax.grad(loss(lambda x, w: x @ w[3]), (0, 1))(x, w)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
