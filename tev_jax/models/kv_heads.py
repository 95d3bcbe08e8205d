"""Each key/value head taken r times, so a tensor axis wider than a model's key/value
heads splits them.

Grouped-query attention gives query head h of H the key/value head h // (H / K). With
every head of K taken r times in a row (heads 0, 0, 1, 1, ... for r = 2), query head h
reads head h // (H / rK) of rK, a copy of head h // (H / K): the same model, exactly,
with r times the key/value cache. Qwen3-Coder-30B-A3B has 4 key/value heads and its
61 GB of bf16 weights need all 8 chips of a v5e-8: tensor 8 splits the 8 copies, one
per chip, where 4 heads over 8 chips would not divide (the decode engine's strict
placement refuses that).

`Engine.create` calls `for_mesh` on its models, so a user who decodes on such a mesh
needs nothing else; `repeat_kv_heads` is the transform itself, on concrete or abstract
(`nnx.eval_shape`) models.

    target = load_target(path, dtype=jnp.bfloat16)         # 4 key/value heads
    target = repeat_kv_heads(target, 2)                      # 8: tensor 8 divides them
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from tev_jax import sharding as shd
from tev_jax.models.config import ModelConfig


def copies_for(num_heads: int, num_kv_heads: int, ways: int) -> int:
    """The fewest copies r of each of K key/value heads such that ``ways`` divides rK
    (and rK still divides the H query heads); 1 where K already splits, or where no r
    does (the mesh then cannot divide the heads: the engine says so)."""
    if num_kv_heads % ways == 0:
        return 1
    r = ways // math.gcd(num_kv_heads, ways)
    return r if num_heads % (num_kv_heads * r) == 0 else 1


def _model_config(model) -> ModelConfig | None:
    """The `ModelConfig` holding the attention of a target (``.config``) or a DFlash
    drafter (``.config.model``); None for any other model (e.g. a custom drafter)."""
    config = getattr(model, "config", None)
    config = config if isinstance(config, ModelConfig) else getattr(config, "model", None)
    return config if isinstance(config, ModelConfig) else None


def _with_copies(config: ModelConfig, copies: int) -> ModelConfig:
    """``config`` with every split (K > 1) attention's key/value heads times ``copies``."""
    glob = config.global_attention
    if glob is not None and glob.num_kv_heads > 1:
        glob = dataclasses.replace(glob, num_kv_heads=glob.num_kv_heads * copies)
    return dataclasses.replace(config, num_kv_heads=config.num_kv_heads * copies,
                               global_attention=glob)


def repeat_kv_heads(model: nnx.Module, copies: int) -> nnx.Module:
    """A new model whose every key/value head is taken ``copies`` times in a row.

    Args:
      model: a `tev_jax.models.Target` or a DFlash `tev_jax.models.Drafter`, concrete
        or abstract. Every parameter with a ``kv_heads`` logical axis (the k / v
        projections and their biases) is repeated along it; the rest is shared.
      copies: r >= 1.
    Returns:
      The model with r K key/value heads (the same function of its inputs).
    Raises:
      ValueError: ``copies`` < 1, or r K not dividing the query heads.
    """
    if not isinstance(copies, int) or copies < 1:
        raise ValueError(f"copies must be a positive int, got {copies!r}")
    config = _model_config(model)
    if config is None:
        raise ValueError(f"{type(model).__name__} is neither a target nor a DFlash drafter")
    if copies == 1:
        return model
    if config.num_heads % (config.num_kv_heads * copies):
        raise ValueError(f"{config.num_kv_heads} key/value heads taken {copies} times "
                         f"({config.num_kv_heads * copies}) do not divide the "
                         f"{config.num_heads} query heads")
    new = _with_copies(config, copies)
    whole = new if model.config is config else dataclasses.replace(model.config, model=new)
    abstract = nnx.eval_shape(lambda: type(model)(whole, dtype=model.dtype,
                                                  rngs=nnx.Rngs(0)))
    graphdef, shapes = nnx.split(abstract)
    old = dict(nnx.to_flat_state(nnx.state(model)))
    leaves = []
    for path, var in nnx.to_flat_state(shapes):
        value = old[path].get_value()
        axes = shd.variable_axes(var) or ()
        if "kv_heads" in axes and value.shape != var.get_value().shape:
            axis = axes.index("kv_heads")
            value = (jax.ShapeDtypeStruct(var.get_value().shape, value.dtype)
                     if isinstance(value, jax.ShapeDtypeStruct)
                     else jnp.repeat(value, copies, axis=axis))
        leaves.append((path, var.replace(value)))
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def for_mesh(model: nnx.Module, mesh) -> nnx.Module:
    """``model`` with its key/value heads taken as often as ``mesh``'s axes for
    ``kv_heads`` need to split them (`copies_for`); the model itself where they split,
    or where it is neither a target nor a DFlash drafter."""
    config = _model_config(model)
    if config is None:
        return model
    ways = shd.mesh_axis_size(("kv_heads",), mesh)
    return repeat_kv_heads(model, copies_for(config.num_heads, config.num_kv_heads, ways))


__all__ = ["copies_for", "for_mesh", "repeat_kv_heads"]
