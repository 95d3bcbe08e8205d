"""The target's static key/value cache and the pure `commit` gather (DESIGN.md §7).

The cache holds, for every layer, roped keys and values at fixed slots::

    k, v : [layers, B, L, kv_heads, head_dim]   (model dtype)

It does not store lengths: the decode state carries ``start_B`` (number of committed
tokens per row). Slot ``s`` of row ``b`` is meaningful only for ``s < start[b]``;
everything at or beyond ``start[b]`` is scratch that the next forward overwrites.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from tev_jax.models.config import ModelConfig

CACHE_AXES = ("layers", "batch", "cache_len", "act_kv_heads", "head_dim")


@struct.dataclass
class KVCache:
    """Per-layer keys and values.

    Attributes:
      k: [layers, B, L, kv_heads, head_dim], roped keys.
      v: [layers, B, L, kv_heads, head_dim], values.
    """

    k: jax.Array
    v: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[1]


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """A zero cache for ``batch`` rows of ``max_len`` slots."""
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def cache_shardings(config: ModelConfig, batch: int, max_len: int, mesh):
    """NamedShardings (a KVCache of them) for a cache on ``mesh``."""
    from tev_jax.sharding import logical_sharding

    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    s = logical_sharding(CACHE_AXES, shape, mesh)
    return KVCache(k=s, v=s)


def _each_layer(x_LBS: jax.Array, update) -> jax.Array:
    """``x = update(x, l)`` for every layer l, as one in-place ``fori_loop``.

    One layer at a time: on TPU one scatter over all layers made the compiler lay the
    cache out with the layers interleaved and copy the whole cache into the attention's
    per-layer layout twice per round (Qwen3-8B, v5e:2x4: 0.6 GB of a 2.6 GB AR step,
    `tev_jax.op_costs`); on XLA:CPU the loop is as fast as one op over all layers
    (`experiments/round_bytes/cpu_speed.py`).
    """
    return jax.lax.fori_loop(0, x_LBS.shape[0], lambda i, x: update(x, i), x_LBS)


def set_layer_slots(x_LBS: jax.Array, layer, slots_BT: jax.Array, new_BT: jax.Array
                    ) -> jax.Array:
    """``x[layer, b, slots[b, t]] = new[b, t]`` (``layer`` may be traced); slots past the
    end are dropped."""
    rows_B1 = jnp.arange(x_LBS.shape[1])[:, None]
    return x_LBS.at[layer, rows_B1, slots_BT].set(new_BT.astype(x_LBS.dtype), mode="drop")


def set_slots(x_LBS: jax.Array, slots_BT: jax.Array, new_LBT: jax.Array) -> jax.Array:
    """``x[l, b, slots[b, t]] = new[l, b, t]`` for every layer l (one at a time); slots
    past the end dropped.

    Args:
      x_LBS: [layers, B, L, ...] buffer.
      slots_BT: int [B, T] slots per row.
      new_LBT: [layers, B, T, ...] entries.
    """
    return _each_layer(x_LBS, lambda x, i: set_layer_slots(x, i, slots_BT, new_LBT[i]))


def move_slots(x_LBS: jax.Array, src_BT: jax.Array, dst_BT: jax.Array) -> jax.Array:
    """``x[l, b, dst[b, t]] = x[l, b, src[b, t]]`` for every layer (reads past the end give
    zeros, writes past the end are dropped).

    Layer by layer, each layer's gather reads the buffer its predecessor's scatter wrote,
    so the update stays in place (gathering every layer before scattering any made XLA
    copy the cache).
    """
    rows_B1 = jnp.arange(x_LBS.shape[1])[:, None]

    def move(x, i):
        moved = x.at[i, rows_B1, src_BT].get(mode="fill", fill_value=0)
        return x.at[i, rows_B1, dst_BT].set(moved, mode="drop")

    return _each_layer(x_LBS, move)


def write_layer(cache: KVCache, layer, k_BTKd: jax.Array, v_BTKd: jax.Array,
                start_B: jax.Array) -> KVCache:
    """Writes layer ``layer``'s T new entries per row at slots ``start[b] ..``.

    Args:
      layer: the layer index (may be traced: the body of a layer scan).
      k_BTKd, v_BTKd: [B, T, kv_heads, head_dim].
      start_B: int [B]. Slots past the end of the cache are dropped.
    """
    t = k_BTKd.shape[1]
    slots_BT = start_B.astype(jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    return KVCache(k=set_layer_slots(cache.k, layer, slots_BT, k_BTKd),
                   v=set_layer_slots(cache.v, layer, slots_BT, v_BTKd))


def commit(cache: KVCache, start_B: jax.Array, path_BP: jax.Array,
           length_B: jax.Array) -> KVCache:
    """Moves an accepted tree path's keys/values to contiguous slots.

    For every row b and ``j < length[b]``: slot ``start + j`` <- slot
    ``start + path[j]`` (path holds tree slot indices, ``path[0] = 0`` the root; padding
    is -1). Slots ``start + j`` for ``j >= length`` are left unchanged. Static shapes:
    a gather and a scatter over P slots per row and layer (`move_slots`).

    Args:
      cache: the cache after the verify pass wrote the tree at ``start..start+N-1``.
      start_B: int [B], committed length before the tree.
      path_BP: int [B, P], accepted slots in depth order, -1 padded.
      length_B: int [B], number of valid entries of ``path``.
    Returns:
      The updated cache.
    """
    p = path_BP.shape[1]
    j = jnp.arange(p, dtype=jnp.int32)[None, :]
    start = start_B.astype(jnp.int32)[:, None]
    keep = j < length_B.astype(jnp.int32)[:, None]
    src = start + jnp.where(keep, path_BP.astype(jnp.int32), j)     # [B, P]
    dst = start + j
    return KVCache(k=move_slots(cache.k, src, dst), v=move_slots(cache.v, src, dst))
