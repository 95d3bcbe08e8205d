"""Logical-axis sharding: the sharded target computes what the single-device one does."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from tev_jax import sharding as shd
from tev_jax.models import ModelConfig, init_target, load_target, save_target
from tev_jax.models.kv_cache import cache_shardings

needs8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")

CFG = ModelConfig("qwen3", vocab_size=256, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=8, num_kv_heads=4, head_dim=8, qk_norm=True)


def test_logical_to_spec_rules():
    mesh = jax.sharding.AbstractMesh((2, 1, 4), shd.MESH_AXES)
    assert shd.logical_to_spec(("embed", "heads", "head_dim"), (64, 8, 8), mesh) == P(None, "tensor")
    # kv_heads = 2 is not divisible by tensor = 4: replicated rather than an error
    assert shd.logical_to_spec(("embed", "kv_heads", "head_dim"), (64, 2, 8), mesh) == P()
    assert shd.logical_to_spec(("batch", "seq", "act_embed"), (4, 3, 64), mesh) == P("data")
    assert shd.logical_to_spec(("batch",), (3,), mesh) == P()
    fsdp = jax.sharding.AbstractMesh((1, 8, 1), shd.MESH_AXES)
    assert shd.logical_to_spec(("vocab", "embed"), (256, 64), fsdp) == P(None, "fsdp")
    assert shd.logical_to_spec(("batch", "seq"), (8, 5), fsdp) == P("fsdp")
    # a mesh axis is never used twice in one spec
    rules = (("a", "tensor"), ("b", "tensor"))
    assert shd.logical_to_spec(("a", "b"), (4, 4), mesh, rules) == P("tensor")
    with shd.axis_rules((("embed", "tensor"),)):
        assert shd.logical_to_spec(("embed",), (64,), mesh) == P("tensor")


def test_make_mesh_errors():
    with pytest.raises(ValueError, match="devices"):
        shd.make_mesh(data=len(jax.devices()) + 1, fsdp=1)


@functools.partial(jax.jit, static_argnames="graphdef")
def _forward(graphdef, state, tokens):
    return nnx.merge(graphdef, state)(tokens, taps=(0,))


@functools.partial(jax.jit, static_argnames="graphdef", donate_argnames="cache")
def _prefill_decode(graphdef, state, cache, tokens, lengths):
    model = nnx.merge(graphdef, state)
    _, _, cache = model.prefill(cache, tokens, lengths)
    logits, _, cache = model.decode(cache, tokens[:, 0], lengths)
    return logits, cache


@needs8
@pytest.mark.parametrize("axes", [dict(data=2, fsdp=2, tensor=2)])
def test_sharded_forward_equals_single_device(axes):
    mesh = shd.make_mesh(**axes)
    model = init_target(CFG, key=0)
    graphdef, state = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(1), (8, 12), 0, CFG.vocab_size)
    lengths = jnp.array([12, 5, 7, 1, 12, 3, 9, 11])
    ref_logits, ref_taps = _forward(graphdef, state, tokens)
    ref_dec, _ = _prefill_decode(graphdef, state, model.init_cache(8, 16), tokens, lengths)

    sharded = shd.shard_state(state, mesh)
    q = sharded["layers"]["self_attn"]["q_proj"]["kernel"].get_value()
    assert q.sharding.spec == P(None, "fsdp", "tensor")
    assert len(q.addressable_shards) == 8
    cache = jax.device_put(model.init_cache(8, 16), cache_shardings(CFG, 8, 16, mesh))
    assert cache.k.sharding.spec == P(None, ("data", "fsdp"), None, "tensor")
    with jax.set_mesh(mesh):
        logits, taps = _forward(graphdef, sharded, tokens)
        dec, cache = _prefill_decode(graphdef, sharded, cache, tokens, lengths)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=1e-5)
    np.testing.assert_allclose(np.asarray(taps), np.asarray(ref_taps), atol=1e-5)
    np.testing.assert_allclose(np.asarray(dec), np.asarray(ref_dec), atol=1e-5)


@needs8
def test_load_and_init_place_parameters_on_the_mesh(tmp_path):
    mesh = shd.make_mesh(data=2, tensor=4)
    model = init_target(CFG, key=3, mesh=mesh)
    emb = model.embed_tokens.get_value()
    assert emb.sharding.spec == P("tensor")          # vocab over tensor
    assert model.layers.mlp.down_proj.kernel.get_value().sharding.spec == P(None, "tensor")
    single = init_target(CFG, key=3)
    np.testing.assert_array_equal(np.asarray(emb), np.asarray(single.embed_tokens.get_value()))
    save_target(model, tmp_path / "m")
    loaded = load_target(tmp_path / "m", mesh=mesh)
    k = loaded.layers.self_attn.k_proj.kernel.get_value()
    assert k.sharding.spec == P(None, None, "tensor") and len(k.addressable_shards) == 8
    np.testing.assert_array_equal(np.asarray(k),
                                  np.asarray(single.layers.self_attn.k_proj.kernel.get_value()))
