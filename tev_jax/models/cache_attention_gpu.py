"""A few queries against one layer of the stacked KV cache, as one Pallas Triton kernel:
the GPU counterpart of `tev_jax.models.cache_attention` (DESIGN.md §12, §14), with its
contract: the online-softmax state of the queries over keys ``s < end[b]`` of layer
``layer``, for `tev_jax.models.attention` to join with the other segments.

On GPU the blocked XLA attention pays three times for every cached key: the layer loop
slices each key block out of the stacked cache into a new buffer (the compiler cannot
fuse a dynamic slice into its matrix product), the product reads that copy, and the
float32 scores of each block go to HBM and back. This kernel reads the layer in place
from the stacked cache [layers, B, S, K, hd] (the layer and the rows' lengths are
operands, not slices) and keeps the scores and the running state in registers.

One program is one tile of query rows of one (row, key/value head) over one split of
the key blocks (flash-decoding: a few rows alone would fill too few of the GPU's
multiprocessors); the splits' states are joined afterwards. The row tiles of a split are
adjacent in launch order, so they read the same key blocks at about the same time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from tev_jax import op_costs

KEY_BLOCK = 64
ROW_TILE = 64
SHARED_BUDGET = 160 * 2**10
"""Bytes of shared memory the tiles may take (227 KiB per block on an H100): the query
tile and the double-buffered key and value blocks, (rows + 4 x key block) x hd x 2."""
PROGRAMS = 264
"""Programs to aim for (two per multiprocessor of an H100); splits are added up to it."""


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def fits(head_dim: int, itemsize: int = 2) -> bool:
    """Whether the kernel takes a head dimension: Triton tiles are powers of two of at
    least 16, and the smallest tiles must fit `SHARED_BUDGET` (keys past the cache's
    length are masked, so any length is taken)."""
    return (head_dim >= 16 and head_dim == _pow2(head_dim)
            and (16 + 4 * 16) * head_dim * itemsize <= SHARED_BUDGET)


def _kernel(layer_ref, end_ref, q_ref, k_ref, v_ref, m_ref, l_ref, o_ref, *, heads: int,
            kb: int, length: int, per_split: int, scale: float):
    bh, split = pl.program_id(1), pl.program_id(2)   # axis 0, the query tile: q_ref's block
    b, h = bh // heads, bh % heads
    layer, end = layer_ref[0], jnp.clip(end_ref[b], 0, length)
    lo = split * per_split
    hi = jnp.minimum(lo + per_split, (end + kb - 1) // kb)
    q = q_ref[0]                                                   # [rows, hd]
    rows, hd = q.shape

    def block(j, state):
        m, l, o = state
        key = j * kb + jnp.arange(kb, dtype=jnp.int32)
        inside = (key < length)[:, None]
        at = (layer, b, pl.ds(j * kb, kb), h, slice(None))
        k = pltriton.load(k_ref.at[at], mask=inside, other=0).astype(q.dtype)  # [kb, hd]
        v = pltriton.load(v_ref.at[at], mask=inside, other=0)
        s = pltriton.dot(q, k, trans_b=True).astype(jnp.float32) * scale   # [rows, kb]
        s = jnp.where((key < end)[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        m_safe = jnp.where(m_new > -jnp.inf, m_new, 0.0)             # all unseen: no NaN
        p = jnp.exp(s - m_safe[:, None])
        alpha = jnp.exp(m - m_safe)
        o = alpha[:, None] * o + pltriton.dot(p.astype(v.dtype), v).astype(jnp.float32)
        return m_new, alpha * l + p.sum(axis=1), o

    m, l, o = jax.lax.fori_loop(lo, hi, block, (
        jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, hd), jnp.float32)))
    m_ref[0, 0] = m
    l_ref[0, 0] = l
    o_ref[0, 0] = o


def cache_attention_state(q_BKQd: jax.Array, k_LBSKd: jax.Array, v_LBSKd: jax.Array,
                          layer, end_B: jax.Array, *, scale: float,
                          key_block: int = KEY_BLOCK, interpret: bool = False):
    """`tev_jax.models.cache_attention.cache_attention_state`, on a GPU.

    Args:
      q_BKQd: [B, K, Q, hd] queries grouped by key/value head, already roped.
      k_LBSKd, v_LBSKd: the stacked cache [layers, B, S, K, hd] (hd a power of two, at
        least 16).
      layer: the layer read (traced).
      end_B: int32 [B] visible keys per row.
      scale: score scale.
      key_block: keys per step (rounded up to a power of two, at least 16; a shorter
        cache takes one block).
      interpret: run in Pallas' interpreter (tests without a GPU).
    Returns:
      (running max [B, K, Q], denominator [B, K, Q], unnormalised output [B, K, Q, hd]),
      float32; a row that sees no key has max -inf and zeros.
    """
    b, kh, qg, hd = q_BKQd.shape
    s = k_LBSKd.shape[2]
    if not fits(hd, k_LBSKd.dtype.itemsize):
        raise ValueError(f"the GPU cache kernel needs a power-of-two head dimension of at "
                         f"least 16 whose tiles fit shared memory, not {hd}")
    kb = max(16, min(_pow2(key_block), _pow2(s)))
    rows = max(16, min(ROW_TILE, _pow2(qg)))                       # Triton dots: >= 16
    itemsize = k_LBSKd.dtype.itemsize
    while (rows + 4 * kb) * hd * itemsize > SHARED_BUDGET and max(rows, kb) > 16:
        if kb >= rows:
            kb //= 2
        else:
            rows //= 2
    tiles = -(-qg // rows)
    nk = -(-s // kb)
    kv_bytes = 2 * b * s * kh * hd * itemsize
    split_bytes = 4 * b * kh * tiles * rows * (hd + 2)            # one split's state
    # splits while programs are few, and while their states (written and read back
    # when joined) stay below a quarter of the keys' and values' bytes
    most = max(1, min(nk, kv_bytes // (4 * split_bytes)))
    per_split = -(-nk // min(most, max(1, PROGRAMS // (b * kh * tiles))))
    splits = -(-nk // per_split)
    q = jnp.pad(q_BKQd, ((0, 0), (0, 0), (0, tiles * rows - qg), (0, 0)))
    q = q.reshape(b * kh, tiles * rows, hd)
    whole = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)
    kernel = lambda *refs: _kernel(*refs, heads=kh, kb=kb, length=s, per_split=per_split,
                                   scale=scale)
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    layer_1 = jnp.reshape(layer, (1,)).astype(jnp.int32)
    end = end_B.astype(jnp.int32)
    cost = op_costs.kernel_scope(
        flops=4 * b * kh * qg * s * hd,
        bytes_accessed=kv_bytes + q.size * q.dtype.itemsize + splits * split_bytes)
    with jax.named_scope(cost):
        m, l, o = pl.pallas_call(
            kernel, grid=(tiles, b * kh, splits),
            in_specs=[whole(layer_1), whole(end),
                      pl.BlockSpec((1, rows, hd), lambda r, i, p: (i, r, 0)),
                      whole(k_LBSKd), whole(v_LBSKd)],
            out_specs=[pl.BlockSpec((1, 1, rows), lambda r, i, p: (p, i, r)),
                       pl.BlockSpec((1, 1, rows), lambda r, i, p: (p, i, r)),
                       pl.BlockSpec((1, 1, rows, hd), lambda r, i, p: (p, i, r, 0))],
            out_shape=[f32(splits, b * kh, tiles * rows), f32(splits, b * kh, tiles * rows),
                       f32(splits, b * kh, tiles * rows, hd)],
            compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
            interpret=interpret,
        )(layer_1, end, q, k_LBSKd, v_LBSKd)
    # join the splits' states: one max, each split's share rescaled to it
    m_all = m.reshape(splits, b, kh, tiles * rows)[..., :qg]
    l_all = l.reshape(splits, b, kh, tiles * rows)[..., :qg]
    o_all = o.reshape(splits, b, kh, tiles * rows, hd)[..., :qg, :]
    m = m_all.max(axis=0)
    w = jnp.exp(m_all - jnp.where(m > -jnp.inf, m, 0.0))
    return m, (w * l_all).sum(axis=0), (w[..., None] * o_all).sum(axis=0)
