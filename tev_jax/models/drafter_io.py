"""DFlash drafter checkpoints: `load_drafter`, `save_drafter`, `init_drafter`.

The public DFlash layout (what ``DFlashDraftModel.save_pretrained`` writes)::

    config.json          Qwen3 fields + block_size, num_target_layers,
                         dflash_config.{mask_token_id, target_layer_ids}
    model.safetensors    (or shards + model.safetensors.index.json)

Tensor names (PyTorch ``[out, in]`` weights, no embedding or lm_head)::

    fc.weight                       [D, len(taps) * D]
    hidden_norm.weight, norm.weight [D]
    layers.{i}.self_attn.{q,k,v,o}_proj.weight (+ .bias with attention_bias)
    layers.{i}.self_attn.{q,k}_norm.weight
    layers.{i}.mlp.{gate,up,down}_proj.weight
    layers.{i}.{input,post_attention}_layernorm.weight
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from tev_jax import sharding as shd
from tev_jax.models.checkpoint_io import (
    LAYER_FIELD, check_tensors, expected_shapes, hf_dtype_name, layer_param_name, load_params,
    read_headers, read_hf_config, save_params,
)
from tev_jax.models.config import ModelConfig
from tev_jax.models.drafter import Drafter, DrafterConfig, default_target_layer_ids
from tev_jax.models.layers import jitted_initializer


def _dflash_name(path: tuple) -> tuple[str, int]:
    """(DFlash tensor name, n_in) of a `Drafter` parameter path (see `NameOf`)."""
    if path == ("fc", "kernel"):
        return "fc.weight", 1
    if path in (("norm", "weight"), ("hidden_norm", "weight")):
        return f"{path[0]}.weight", 0
    if path[0] == "layers":
        return layer_param_name(f"layers.{LAYER_FIELD}.", path[1:])
    raise ValueError(f"no DFlash name for parameter {'/'.join(map(str, path))}")


def drafter_param_names(config: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """DFlash tensor name -> expected PyTorch shape for a drafter config."""
    return expected_shapes(nnx.eval_shape(lambda: Drafter(config, rngs=nnx.Rngs(0))),
                           _dflash_name)


def read_drafter_config(path: str | os.PathLike) -> DrafterConfig:
    """`DrafterConfig` from ``path/config.json`` (ValueError if absent or malformed)."""
    return DrafterConfig.from_hf(read_hf_config(path))


def load_drafter(path: str | os.PathLike, target, *, dtype=None, mesh: Mesh | None = None,
                 rules: shd.Rules | None = None) -> Drafter:
    """Loads a DFlash drafter checkpoint directory for ``target``.

    Args:
      path: directory with config.json and safetensors weights (any float dtype,
        bfloat16 included).
      target: the `Target` it will draft for (its config is checked).
      dtype: parameter dtype (default: the target's).
      mesh: if given, parameters are placed by their logical axes (`tev_jax.sharding`).
      rules: logical -> mesh axis rules.
    Returns:
      The `Drafter`.
    Raises:
      ValueError: malformed config, a drafter that does not fit the target (hidden
        size, vocabulary, tapped layers), corrupt files, or missing / extra /
        misshapen tensors.
    """
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: not a directory")
    config = read_drafter_config(path)
    config.check_target(target.config)
    where = read_headers(path)
    dtype = target.dtype if dtype is None else jnp.dtype(dtype)
    abstract = nnx.eval_shape(lambda: Drafter(config, dtype=dtype, rngs=nnx.Rngs(0)))
    check_tensors(expected_shapes(abstract, _dflash_name), where, what="drafter checkpoint")
    return load_params(path, abstract, _dflash_name, where, mesh=mesh, rules=rules)


def save_drafter(drafter: Drafter, path: str | os.PathLike, *, dtype=None) -> None:
    """Writes ``drafter`` in the DFlash layout (config.json + model.safetensors).

    The directory is assembled in a temporary sibling and renamed into place, so a
    failed save never leaves a half-written ``path``.

    Args:
      drafter: the `Drafter`.
      path: output directory.
      dtype: the stored dtype (e.g. ``jnp.bfloat16``); default: the drafter's own.
    """
    stored = drafter.dtype if dtype is None else dtype
    hf = drafter.config.to_hf(dtype=hf_dtype_name(stored))
    save_params(drafter, path, hf, _dflash_name, dtype=dtype)


def drafter_config_for(target_config: ModelConfig, *, num_layers: int, block_size: int,
                       mask_token_id: int, target_layer_ids=None,
                       intermediate_size: int | None = None) -> DrafterConfig:
    """A drafter config shaped like the target's layers (as DFlash drafters are).

    Args:
      target_config: the target's `ModelConfig`.
      num_layers: drafter depth.
      block_size: H + 1.
      mask_token_id: MASK token id (a target token id).
      target_layer_ids: tapped target layers (default `default_target_layer_ids`).
      intermediate_size: MLP width (default the target's).
    """
    t = target_config
    model = ModelConfig(
        model_type="qwen3", vocab_size=t.vocab_size, hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size if intermediate_size is None
        else int(intermediate_size),
        num_layers=int(num_layers), num_heads=t.num_heads, num_kv_heads=t.num_kv_heads,
        head_dim=t.head_dim, rope_theta=t.rope_theta, rope_scaling=t.rope_scaling,
        rms_norm_eps=t.rms_norm_eps, tie_word_embeddings=False, qk_norm=True,
        attention_bias=False, max_position_embeddings=t.max_position_embeddings,
    )
    ids = (default_target_layer_ids(t.num_layers, int(num_layers)) if target_layer_ids is None
           else tuple(int(i) for i in target_layer_ids))
    config = DrafterConfig(model=model, block_size=int(block_size),
                           num_target_layers=t.num_layers, mask_token_id=int(mask_token_id),
                           target_layer_ids=ids)
    config.check_target(t)
    return config


def init_drafter(target, *, num_layers: int, block_size: int, mask_token_id: int,
                 key: jax.Array | int = 0, target_layer_ids=None,
                 intermediate_size: int | None = None, dtype=None,
                 mesh: Mesh | None = None, rules: shd.Rules | None = None) -> Drafter:
    """A randomly initialised drafter for ``target`` (training from scratch).

    Weights follow the Qwen3 initialisation (kernels normal(0, 0.02), unit norms); the
    layers copy the target's width, heads, head_dim, RoPE and epsilon. The values come
    from one jitted program (`tev_jax.models.layers.fast_init`), born sharded on ``mesh``.

    Args:
      target: the `Target`.
      num_layers, block_size, mask_token_id, target_layer_ids, intermediate_size: see
        `drafter_config_for`.
      key: PRNG key or int seed.
      dtype: parameter dtype (default: the target's).
      mesh, rules: if given, parameters are placed by their logical axes.
    """
    config = drafter_config_for(target.config, num_layers=num_layers, block_size=block_size,
                                mask_token_id=mask_token_id, target_layer_ids=target_layer_ids,
                                intermediate_size=intermediate_size)
    if isinstance(key, int):
        key = jax.random.key(key)
    dtype = target.dtype if dtype is None else jnp.dtype(dtype)
    graphdef, init = jitted_initializer(Drafter, config, dtype, mesh, rules)
    return nnx.merge(graphdef, init(key))


__all__ = ["drafter_config_for", "drafter_param_names", "init_drafter", "load_drafter",
           "read_drafter_config", "save_drafter"]
