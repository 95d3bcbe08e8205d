"""Target families as a registry (tev_jax.models.registry): a family added from its own
file (here, this test) is read, built, saved and loaded by the unchanged core; model
types are unique; unknown ones are refused naming the registered ones."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tev_jax.models import (
    ModelConfig, init_target, load_target, registry, save_target,
)
from tev_jax.models.checkpoint_io import param_names
from tev_jax.models.families import qwen3
from tev_jax.models.layers import DecoderLayer, make_param

HF = {"model_type": "toy", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
      "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
      "head_dim": 8}


class HalfLayer(DecoderLayer):
    """A toy block: the Qwen3 layer's update times half a per-layer ``gain``
    parameter, which the checkpoint names ``model.layers.{i}.toy_gain``."""

    def __init__(self, config, spec, *, dtype, rngs, sub=0):
        super().__init__(config, spec, dtype=dtype, rngs=rngs, sub=sub)
        self.gain = make_param(rngs, (1,), dtype, ("norm",), "ones")

    def __call__(self, x, positions, inv_freq, attend):
        y, aux = super().__call__(x, positions, inv_freq, attend)
        return x + 0.5 * self.gain[...] * (y - x), aux


def read(hf):
    return dataclasses.replace(qwen3.config_from_hf({**hf, "model_type": "qwen3"}),
                               model_type="toy")


def write(config, *, dtype="float32"):
    return {**qwen3.config_to_hf(dataclasses.replace(config, model_type="qwen3"),
                                 dtype=dtype), "model_type": "toy"}


def toy_tensor(prefix, rest):
    return (prefix + "toy_gain", 0) if rest == ("gain",) else None


@pytest.fixture
def toy(monkeypatch):
    """The toy family, registered for the test only."""
    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))
    return registry.register(registry.Family(
        name="toy", model_types=("toy",), read_config=read, write_config=write,
        decoder_layer=lambda c, s, *, dtype, rngs, sub=0: HalfLayer(
            c, s, dtype=dtype, rngs=rngs, sub=sub),
        layer_tensor=toy_tensor))


def test_a_family_from_its_own_file_round_trips(toy, tmp_path):
    config = ModelConfig.from_hf(HF)
    assert config.model_type == "toy" and config.qk_norm
    assert "model.layers.1.toy_gain" in param_names(config)
    target = init_target(config, key=1)
    assert isinstance(target.layers, HalfLayer)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 5)), jnp.int32)
    logits, _ = target(tokens)
    save_target(target, tmp_path / "toy")
    loaded = load_target(tmp_path / "toy")
    assert loaded.config == config
    np.testing.assert_allclose(loaded(tokens)[0], logits, atol=1e-6)
    # the family's block runs: its gain changes the logits
    loaded.layers.gain[...] = 2 * loaded.layers.gain[...]
    assert not np.allclose(jax.device_get(loaded(tokens)[0]), logits, atol=1e-3)


def test_model_types_are_unique_and_unknown_ones_name_the_registered(toy):
    assert registry.model_types()[:3] == ("qwen3", "llama", "qwen3_moe")
    assert "toy" in registry.model_types() and "gemma4_unified" not in registry.model_types()
    assert registry.family_of_hf({"model_type": "gemma4_unified"}).name == "gemma4"
    with pytest.raises(ValueError, match="'toy' is already registered to family 'toy'"):
        registry.register(dataclasses.replace(toy, name="other"))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'; supported: qwen3, "
                                         "llama, qwen3_moe, gemma4_unified_text, toy"):
        ModelConfig.from_hf({**HF, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="unsupported model_type 'gemma4_unified'"):
        ModelConfig(**{**dataclasses.asdict(ModelConfig.from_hf(HF)),
                       "model_type": "gemma4_unified"})


def test_a_mixture_layer_needs_its_familys_expert_mlp():
    config = ModelConfig.from_hf({**HF, "model_type": "qwen3_moe", "num_experts": 4,
                                  "num_experts_per_tok": 2, "moe_intermediate_size": 8})
    spec = config.layer_specs[0]
    with pytest.raises(ValueError, match="needs its family's expert MLP"):
        DecoderLayer(config, spec, dtype=jnp.float32, rngs=nnx.Rngs(0))
