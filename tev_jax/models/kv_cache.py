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


def write(cache: KVCache, k_new: jax.Array, v_new: jax.Array, start_B: jax.Array) -> KVCache:
    """Writes T new entries per row at slots ``start[b] .. start[b]+T-1``.

    Args:
      k_new, v_new: [layers, B, T, kv_heads, head_dim].
      start_B: int [B]. Slots past the end of the cache are dropped.
    """
    b, t = k_new.shape[1], k_new.shape[2]
    rows = jnp.arange(b)[:, None]
    slots = start_B.astype(jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    k = cache.k.at[:, rows, slots].set(k_new.astype(cache.k.dtype), mode="drop")
    v = cache.v.at[:, rows, slots].set(v_new.astype(cache.v.dtype), mode="drop")
    return KVCache(k=k, v=v)


def commit(cache: KVCache, start_B: jax.Array, path_BP: jax.Array,
           length_B: jax.Array) -> KVCache:
    """Moves an accepted tree path's keys/values to contiguous slots.

    For every row b and ``j < length[b]``: slot ``start + j`` <- slot
    ``start + path[j]`` (path holds tree slot indices, ``path[0] = 0`` the root; padding
    is -1). Slots ``start + j`` for ``j >= length`` are left unchanged. Static shapes:
    one gather and one scatter over P slots per row.

    Args:
      cache: the cache after the verify pass wrote the tree at ``start..start+N-1``.
      start_B: int [B], committed length before the tree.
      path_BP: int [B, P], accepted slots in depth order, -1 padded.
      length_B: int [B], number of valid entries of ``path``.
    Returns:
      The updated cache.
    """
    b, p = path_BP.shape
    j = jnp.arange(p, dtype=jnp.int32)[None, :]
    start = start_B.astype(jnp.int32)[:, None]
    keep = j < length_B.astype(jnp.int32)[:, None]
    src = start + jnp.where(keep, path_BP.astype(jnp.int32), j)     # [B, P]
    dst = start + j
    rows = jnp.arange(b)[:, None]
    k_sel = cache.k.at[:, rows, src].get(mode="fill", fill_value=0)  # [layers, B, P, K, hd]
    v_sel = cache.v.at[:, rows, src].get(mode="fill", fill_value=0)
    k = cache.k.at[:, rows, dst].set(k_sel, mode="drop")
    v = cache.v.at[:, rows, dst].set(v_sel, mode="drop")
    return KVCache(k=k, v=v)
