"""Memory planning on abstract models (DESIGN.md §12).

Real model shapes live here as `ModelConfig` presets, so that a decode or training
program can be lowered and compiled for a Qwen3-4B or Llama-3-8B target on a machine
that could never hold its weights (``nnx.eval_shape`` builds the model without them).

The presets copy the architecture fields of the public ``config.json`` files (widths,
heads, vocabulary, RoPE); nothing else about those models is used.
"""

from __future__ import annotations

import dataclasses

from tev_jax.models.config import ModelConfig, RopeScaling

PRESETS: dict[str, ModelConfig] = {
    "qwen3-0.6b": ModelConfig(
        model_type="qwen3", vocab_size=151_936, hidden_size=1024, intermediate_size=3072,
        num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, qk_norm=True,
        max_position_embeddings=40_960),
    "qwen3-4b": ModelConfig(
        model_type="qwen3", vocab_size=151_936, hidden_size=2560, intermediate_size=9728,
        num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, qk_norm=True,
        max_position_embeddings=40_960),
    "qwen3-8b": ModelConfig(
        model_type="qwen3", vocab_size=151_936, hidden_size=4096, intermediate_size=12_288,
        num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, qk_norm=True,
        max_position_embeddings=40_960),
    "llama3-8b": ModelConfig(
        model_type="llama", vocab_size=128_256, hidden_size=4096, intermediate_size=14_336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500_000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192), rms_norm_eps=1e-5,
        tie_word_embeddings=False, qk_norm=False, max_position_embeddings=131_072),
}


def preset(name: str, *, num_layers: int | None = None) -> ModelConfig:
    """A preset's `ModelConfig`, optionally with fewer layers (for per-layer planning).

    Raises:
      ValueError: an unknown name (the message lists the presets).
    """
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    cfg = PRESETS[name]
    if num_layers is not None:
        cfg = dataclasses.replace(cfg, num_layers=int(num_layers))
    return cfg
