"""Tiny random target/drafter pairs shared by the drafter tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tev_jax.models import ModelConfig, Target
from tev_jax.models.drafter import Drafter
from tev_jax.models.drafter_io import drafter_config_for

V, D = 96, 32
TARGET_LAYERS = 6


def _numpy_build(make, rng: np.random.Generator, kernel_std: float, norm_std: float):
    """``make()``'s module with host-drawn weights (compiling a random init is slow on CPU)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(make))

    def draw(a):
        if len(a.shape) == 1:
            w = 1.0 + norm_std * rng.standard_normal(a.shape)
        else:
            w = kernel_std * rng.standard_normal(a.shape)
        return jnp.asarray(w, a.dtype)

    return nnx.merge(graphdef, jax.tree.map(draw, abstract))


def tiny_target(*, hidden=D, vocab=V, layers=TARGET_LAYERS, seed=0):
    """A random 6-layer Qwen3 target (kernels std 0.3 so that logits are O(1))."""
    cfg = ModelConfig(model_type="qwen3", vocab_size=vocab, hidden_size=hidden,
                      intermediate_size=48, num_layers=layers, num_heads=4, num_kv_heads=2,
                      head_dim=8, rope_theta=10000.0, qk_norm=True)
    return _numpy_build(lambda: Target(cfg, rngs=nnx.Rngs(0)), np.random.default_rng(seed),
                        kernel_std=0.3, norm_std=0.2)


def tiny_drafter(target, *, num_layers=2, block_size=5, seed=1, target_layer_ids=None):
    """A random drafter for ``target``; norms away from 1 so that they matter."""
    config = drafter_config_for(target.config, num_layers=num_layers, block_size=block_size,
                                mask_token_id=target.config.vocab_size - 1,
                                target_layer_ids=target_layer_ids)
    return _numpy_build(lambda: Drafter(config, rngs=nnx.Rngs(0)),
                        np.random.default_rng(seed), kernel_std=0.12, norm_std=0.3)



def random_features(rng: np.random.Generator, b: int, t: int, f: int) -> np.ndarray:
    """Stand-in target features [B, T, F] (hidden_norm makes their scale irrelevant)."""
    return rng.standard_normal((b, t, f)).astype(np.float32)


def as_i32(x) -> jnp.ndarray:
    return jnp.asarray(np.asarray(x), jnp.int32)
