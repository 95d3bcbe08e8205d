"""The target's static key/value cache and the pure `commit` gather (docs/design.md §7).

The cache holds, for every layer, roped keys and values at fixed slots::

    k, v : [layers, B, L, kv_heads, head_dim]   (model dtype)

A model whose layers' keys differ in shape (Gemma 4: sliding and global layers) holds
one such array per sub-layer j of its period p (`ModelConfig.period`): ``k`` is a tuple
of p arrays ``[layers / p, B, L, K_j, hd_j]``, layer ``g·p + j`` at row g of array j.
A `LayerRef` names a layer both ways; `layer_kv` and `write_layer` take one.

It does not store lengths: the decode state carries ``start_B`` (number of committed
tokens per row). Slot ``s`` of row ``b`` is meaningful only for ``s < start[b]``;
everything at or beyond ``start[b]`` is scratch that the next forward overwrites.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from tev_jax.models.config import LayerSpec, ModelConfig
from tev_jax.runtime import platforms

CACHE_AXES = ("layers", "batch", "cache_len", "act_kv_heads", "head_dim")


@dataclasses.dataclass(frozen=True)
class LayerRef:
    """A decoder layer inside a layer scan (`tev_jax.models.target.Target.layer_stack`).

    Attributes:
      index: the model layer i (traced int32).
      stack: its scan step g (traced int32), i = g·p + sub.
      sub: its place j in the period (static).
      spec: its `LayerSpec` (static; the attention window is ``spec.attention.window``).
    """

    index: Any
    stack: Any
    sub: int
    spec: LayerSpec

    @property
    def window(self) -> int | None:
        return self.spec.attention.window


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
        return jax.tree.leaves(self.k)[0].shape[2]

    @property
    def batch(self) -> int:
        return jax.tree.leaves(self.k)[0].shape[1]


def cache_shapes(config: ModelConfig, batch: int, max_len: int):
    """The shape of ``k`` (and ``v``): one tuple, or a tuple of them per sub-layer of
    the period when the layers' key shapes differ."""
    if config.uniform_attention_shapes:
        a = config.layer_specs[0].attention
        return (config.num_layers, batch, max_len, a.num_kv_heads, a.head_dim)
    p = config.period
    return tuple((config.num_layers // p, batch, max_len, s.attention.num_kv_heads,
                  s.attention.head_dim) for s in config.layer_specs[:p])


def _shape_map(fn, shapes):
    if isinstance(shapes[0], int):
        return fn(shapes)
    return tuple(fn(s) for s in shapes)


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """A zero cache for ``batch`` rows of ``max_len`` slots."""
    shapes = cache_shapes(config, batch, max_len)
    return KVCache(k=_shape_map(lambda s: jnp.zeros(s, dtype), shapes),
                   v=_shape_map(lambda s: jnp.zeros(s, dtype), shapes))


def cache_shardings(config: ModelConfig, batch: int, max_len: int, mesh):
    """NamedShardings (a KVCache of them) for a cache on ``mesh``."""
    from tev_jax.sharding import logical_sharding

    s = _shape_map(lambda shape: logical_sharding(CACHE_AXES, shape, mesh),
                   cache_shapes(config, batch, max_len))
    return KVCache(k=s, v=s)


def cache_axes(cache: KVCache) -> KVCache:
    """`CACHE_AXES` for every array of a cache (a `KVCache` of name tuples)."""
    names = (CACHE_AXES if not isinstance(cache.k, tuple)
             else tuple(CACHE_AXES for _ in cache.k))
    return KVCache(k=names, v=names)


def layer_kv(cache: KVCache, layer) -> tuple[jax.Array, jax.Array, Any]:
    """(stacked k, stacked v, row) holding a layer (a `LayerRef`, or an int index of a
    single-array cache): what an `tev_jax.models.attention.attention` cache segment
    ``(k, v, mask, row)`` reads."""
    if isinstance(cache.k, tuple):
        return cache.k[layer.sub], cache.v[layer.sub], layer.stack
    return cache.k, cache.v, getattr(layer, "index", layer)


def set_layer(cache: KVCache, layer, k_BLKd: jax.Array, v_BLKd: jax.Array) -> KVCache:
    """The cache with a layer's (`layer_kv`) whole keys / values replaced."""
    def put(x, new):
        if isinstance(x, tuple):
            return tuple(a.at[layer.stack].set(new) if j == layer.sub else a
                         for j, a in enumerate(x))
        return x.at[getattr(layer, "index", layer)].set(new)

    return KVCache(k=put(cache.k, k_BLKd), v=put(cache.v, v_BLKd))


def _each_layer(x_LBS: jax.Array, update, whole, at_once: bool | None) -> jax.Array:
    """``x = update(x, l)`` for every layer l, as one in-place ``fori_loop``; or
    ``whole(x)``, the same update of every layer at once: on GPU (``at_once`` None), or
    wherever ``at_once`` says.

    One layer at a time: on TPU one scatter over all layers made the compiler lay the
    cache out with the layers interleaved and copy the whole cache into the attention's
    per-layer layout twice per round (Qwen3-8B, v5e:2x4: 0.6 GB of a 2.6 GB AR step,
    `tev_jax.costs.op_costs`); on XLA:CPU the loop is as fast as one op over all layers
    (`experiments/round_bytes/cpu_speed.py`). On GPU the loop launched 3-4 kernels per
    layer (Qwen3-8B, a round's commit: 288 of its 306 launches), the whole update 2-3 in
    all, with the same bytes and the cache updated in place (`tev_jax.costs.launches`).
    """
    loop = lambda x: jax.lax.fori_loop(0, x.shape[0], lambda i, x: update(x, i), x)
    if at_once is not None:
        return whole(x_LBS) if at_once else loop(x_LBS)
    if not platforms.gpu_kernels_traced():
        return loop(x_LBS)
    return jax.lax.platform_dependent(x_LBS, cuda=whole, default=loop)


def set_layer_slots(x_LBS: jax.Array, layer, slots_BT: jax.Array, new_BT: jax.Array
                    ) -> jax.Array:
    """``x[layer, b, slots[b, t]] = new[b, t]`` (``layer`` may be traced); slots past the
    end are dropped."""
    rows_B1 = jnp.arange(x_LBS.shape[1])[:, None]
    return x_LBS.at[layer, rows_B1, slots_BT].set(new_BT.astype(x_LBS.dtype), mode="drop")


def set_slots(x_LBS: jax.Array, slots_BT: jax.Array, new_LBT: jax.Array, *,
              at_once: bool | None = None) -> jax.Array:
    """``x[l, b, slots[b, t]] = new[l, b, t]`` for every layer l (one at a time, all at
    once on GPU or with ``at_once``: `_each_layer`); slots past the end dropped.

    Args:
      x_LBS: [layers, B, L, ...] buffer.
      slots_BT: int [B, T] slots per row.
      new_LBT: [layers, B, T, ...] entries.
      at_once: None: by platform; True / False: every layer at once / one at a time.
    """
    rows_B1 = jnp.arange(x_LBS.shape[1])[:, None]
    whole = lambda x: x.at[:, rows_B1, slots_BT].set(new_LBT.astype(x.dtype), mode="drop")
    return _each_layer(x_LBS, lambda x, i: set_layer_slots(x, i, slots_BT, new_LBT[i]),
                       whole, at_once)


def move_slots(x_LBS: jax.Array, src_BT: jax.Array, dst_BT: jax.Array, *,
               at_once: bool | None = None) -> jax.Array:
    """``x[l, b, dst[b, t]] = x[l, b, src[b, t]]`` for every layer (reads past the end give
    zeros, writes past the end are dropped); ``at_once`` as in `set_slots`.

    Layer by layer, each layer's gather reads the buffer its predecessor's scatter wrote,
    so the update stays in place (gathering every layer before scattering any made XLA
    copy the cache); on GPU every layer at once, which the GPU compiler keeps in place
    (`_each_layer`).
    """
    rows_B1 = jnp.arange(x_LBS.shape[1])[:, None]

    def move(x, i):
        moved = x.at[i, rows_B1, src_BT].get(mode="fill", fill_value=0)
        return x.at[i, rows_B1, dst_BT].set(moved, mode="drop")

    def whole(x):
        moved = x.at[:, rows_B1, src_BT].get(mode="fill", fill_value=0)
        return x.at[:, rows_B1, dst_BT].set(moved, mode="drop")

    return _each_layer(x_LBS, move, whole, at_once)


def write_layer(cache: KVCache, layer, k_BTKd: jax.Array, v_BTKd: jax.Array,
                start_B: jax.Array) -> KVCache:
    """Writes layer ``layer``'s T new entries per row at slots ``start[b] ..``.

    Args:
      layer: a `LayerRef`, or the layer index of a single-array cache (may be traced:
        the body of a layer scan).
      k_BTKd, v_BTKd: [B, T, kv_heads, head_dim].
      start_B: int [B]. Slots past the end of the cache are dropped.
    """
    t = k_BTKd.shape[1]
    slots_BT = start_B.astype(jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    if isinstance(cache.k, tuple):
        def put(x, new):
            return tuple(set_layer_slots(a, layer.stack, slots_BT, new)
                         if j == layer.sub else a for j, a in enumerate(x))
    else:
        def put(x, new):
            return set_layer_slots(x, getattr(layer, "index", layer), slots_BT, new)
    return KVCache(k=put(cache.k, k_BTKd), v=put(cache.v, v_BTKd))


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
    move = lambda x: move_slots(x, src, dst)  # noqa: E731
    return KVCache(k=jax.tree.map(move, cache.k), v=jax.tree.map(move, cache.v))
