"""Key/value heads taken several times (tev_jax.models.kv_heads): the same model, and a
tensor axis wider than the heads (Qwen3-Coder-30B-A3B's 4 over the 8 chips of a v5e-8)
decoding the single-device tokens."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_decode_mesh import DCFG, PROMPTS, needs8

from tev_jax import decode, engine
from tev_jax import sharding as shd
from tev_jax.costs import plan
from tev_jax.models import ModelConfig, init_target
from tev_jax.models.drafter import Drafter
from tev_jax.models.kv_heads import copies_for, for_mesh, repeat_kv_heads
from tev_jax.models.layers import jitted_initializer
from tev_jax.sampling import Sampling

# Qwen3-Coder-30B-A3B's shape of attention, small: 16 query heads over 4 key/value heads
CFG = ModelConfig("qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=16, num_kv_heads=4, head_dim=8, qk_norm=True,
                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  norm_topk_prob=True)
DRAFTER = dataclasses.replace(DCFG, model=dataclasses.replace(DCFG.model, num_kv_heads=4))


@pytest.fixture(scope="module")
def models():
    target = init_target(CFG, key=0)
    target.lm_head[...] = target.lm_head[...] * 20.0   # no greedy near-ties
    graphdef, init = jitted_initializer(Drafter, DRAFTER, jnp.dtype(jnp.float32), None,
                                        shd.current_rules())
    return target, nnx.merge(graphdef, init(jax.random.key(1)))


@pytest.mark.parametrize("heads,kv,ways,want", [
    (32, 4, 8, 2), (32, 8, 8, 1), (32, 4, 1, 1), (16, 8, 16, 2), (8, 2, 8, 4),
    (24, 4, 6, 3), (32, 4, 6, 1), (6, 2, 4, 1)])
def test_copies_for_the_fewest_that_split(heads, kv, ways, want):
    assert copies_for(heads, kv, ways) == want


def test_repeated_heads_are_the_same_model(models):
    target, drafter = models
    tokens = jnp.asarray([[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]])
    doubled = repeat_kv_heads(target, 2)
    assert doubled.config.num_kv_heads == 8
    k = nnx.state(doubled)["layers"]["self_attn"]["k_proj"]["kernel"].get_value()
    k0 = nnx.state(target)["layers"]["self_attn"]["k_proj"]["kernel"].get_value()
    assert k.shape == k0.shape[:2] + (8,) + k0.shape[3:]
    for copy in (0, 1):                                 # head j of 8 is head j // 2 of 4
        np.testing.assert_array_equal(k[:, :, copy::2], k0)
    np.testing.assert_allclose(doubled(tokens)[0], target(tokens)[0], atol=1e-5, rtol=0)
    assert repeat_kv_heads(drafter, 4).config.model.num_kv_heads == 16
    with pytest.raises(ValueError, match="do not divide the 16 query heads"):
        repeat_kv_heads(target, 3)
    with pytest.raises(ValueError, match="positive int"):
        repeat_kv_heads(target, 0)


@pytest.mark.slow
@needs8
def test_tensor_wider_than_the_heads_gives_single_device_tokens(models):
    """Tensor 8 over 4 key/value heads: the strict placement refuses the checkpoint's
    heads (negative control); the engine takes each head twice and decodes the
    single-device tokens at T = 1 (same key, same draws)."""
    target, drafter = models
    mesh = shd.make_mesh(tensor=8, fsdp=1)
    with pytest.raises(ValueError, match="kv_heads|do not divide"):
        shd.state_shardings(nnx.state(target), mesh, strict=True)
    config = decode.DecodeConfig(max_new_tokens=10, budget=8, verifier="tev",
                                 sampling=Sampling(1.0))
    ref = engine.generate(target, drafter, PROMPTS, config, key=3)
    out = engine.generate(target, drafter, PROMPTS, config, key=3, mesh=mesh)
    assert out.rows() == ref.rows()
    np.testing.assert_array_equal(out.stats.block_lengths, ref.stats.block_lengths)
    assert for_mesh(target, mesh).config.num_kv_heads == 8
    assert for_mesh(target, shd.make_mesh(data=2, tensor=4, fsdp=1)) is target


@needs8
def test_abstract_models_plan_on_a_mesh_wider_than_the_heads():
    cfg = dataclasses.replace(plan.preset("qwen3-coder-30b-a3b", num_layers=1),
                              vocab_size=4096, num_experts=16)
    config = decode.DecodeConfig(max_new_tokens=8, budget=4, verifier="tev", prompt_len=16)
    target, drafter = plan.abstract_models(cfg, config, dtype=jnp.bfloat16)
    e = engine.Engine.create(target, drafter, config, 2, mesh=shd.make_mesh(tensor=8, fsdp=1))
    k = e.params[0]["layers"]["self_attn"]["k_proj"]["kernel"].get_value()
    assert k.shape[2] == 8 and k.sharding.shard_shape(k.shape)[2] == 1
