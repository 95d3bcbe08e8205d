"""A few queries against one layer of the stacked KV cache, as one Pallas TPU kernel
(DESIGN.md §12): the cache part of the AR step's and the tree verify pass's attention.

XLA's blocked attention (`tev_jax.models.attention`) writes each key block's float32
scores [B, K, T, G, Sk] to HBM and reads them back for the softmax and the values: for a
round of N = 65 queries and 8 query heads per key/value head that is about four times
the bytes of the keys and values it attends to. This kernel keeps the scores, the
running max, the denominator and the output of one batch row in VMEM while it walks the
row's key blocks, reading each cached key and value once and only the blocks below the
row's length (block indices from scalars prefetched into SMEM: a block past the length
is neither fetched nor computed). It returns the online-softmax state (running max,
denominator, unnormalised output) for `tev_jax.models.attention` to join with the other
segments (the new tokens' own keys), so the result is the same joint softmax.

The layer is read in place from the stacked cache [layers, B, S, K, hd]; one kernel
step is one key block of one row (and of one key/value head where a device holds one).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

KEY_BLOCK = 512
VMEM_BUDGET = 12 * 2**20   # of the 16 MiB scoped VMEM a kernel gets by default (v5e)


def fits(rows: int, head_dim: int, length: int, itemsize: int = 2,
         key_block: int = KEY_BLOCK) -> bool:
    """Whether one kernel step of ``rows`` query rows per key/value head (queries x
    query heads per key/value head) fits `VMEM_BUDGET`: double-buffered queries, key and
    value blocks and float32 outputs (the running max and denominator padded to 128
    lanes), and the float32 scores and probabilities of a key block. A prefill chunk of
    512 queries does not: it takes the blocked XLA attention."""
    kb = min(key_block, length)
    buffers = 2 * (rows * head_dim * itemsize + 2 * kb * head_dim * itemsize
                   + rows * (2 * 128 + head_dim) * 4)
    return buffers + 2 * rows * kb * 4 <= VMEM_BUDGET


def _kernel(layer_ref, end_ref, q_ref, k_ref, v_ref, m_ref, l_ref, o_ref, *, kb: int,
            length: int, scale: float, heads: int):
    """One key block of one row: of one key/value head (``heads`` 0: blocks [kb, hd]) or
    of all ``heads`` (blocks [kb, K, hd], the heads in turn). A last block that runs past
    the cache's ``length`` holds undefined rows there: their scores are masked and their
    values zeroed (0 x NaN would not be 0)."""
    b, j = pl.program_id(0), pl.program_id(2 if heads == 0 else 1)

    @pl.when(j == 0)
    def _start():
        m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
        l_ref[...] = jnp.zeros_like(l_ref)
        o_ref[...] = jnp.zeros_like(o_ref)

    @pl.when(j * kb < end_ref[b])
    def _block():
        for h in range(max(heads, 1)):
            at = () if heads == 0 else (h,)                      # q, m, l, o rows
            kv = (...,) if heads == 0 else (slice(None), h)      # k, v rows
            q = q_ref[at]                                        # [QG, hd]
            s = jax.lax.dot_general(q, k_ref[kv].astype(q.dtype), (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32) * scale
            key = j * kb + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
            s = jnp.where(key < end_ref[b], s, -jnp.inf)
            m_old = m_ref[at]                                    # [QG, 1]
            m_new = jnp.maximum(m_old, s.max(axis=-1, keepdims=True))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # all unseen: no NaN
            p = jnp.exp(s - m_safe)
            alpha = jnp.exp(m_old - m_safe)
            v = v_ref[kv]
            if length % kb:
                row = j * kb + jax.lax.broadcasted_iota(jnp.int32, v.shape, 0)
                v = jnp.where(row < length, v, 0)
            m_ref[at] = m_new
            l_ref[at] = alpha * l_ref[at] + p.sum(axis=-1, keepdims=True)
            o_ref[at] = alpha * o_ref[at] + jnp.dot(p.astype(v.dtype), v,
                                                    preferred_element_type=jnp.float32)


def cache_attention_state(q_BKQd: jax.Array, k_LBSKd: jax.Array, v_LBSKd: jax.Array,
                          layer, end_B: jax.Array, *, scale: float,
                          key_block: int = KEY_BLOCK, interpret: bool = False):
    """The online-softmax state of queries against cache layer ``layer``, keys ``s <
    end[b]`` of row b.

    Args:
      q_BKQd: [B, K, Q, hd] queries grouped by key/value head (Q = queries x heads per
        key/value head), already roped.
      k_LBSKd, v_LBSKd: the stacked cache [layers, B, S, K, hd].
      layer: the layer read (traced).
      end_B: int32 [B] visible keys per row.
      scale: score scale.
      key_block: keys per step (at most; a shorter cache is one block).
      interpret: run in Pallas' interpreter (tests off TPU).
    Returns:
      (running max [B, K, Q], denominator [B, K, Q], unnormalised output [B, K, Q, hd]),
      float32; a row that sees no key has max -inf and zeros.
    """
    b, kh, qg, hd = q_BKQd.shape
    s = k_LBSKd.shape[2]
    kb = min(key_block, s)
    nk = -(-s // kb)
    end = jnp.clip(end_B.astype(jnp.int32), 0, s)

    last = lambda i, end: jax.lax.div(jnp.maximum(end[i] - 1, 0), kb)  # later: not fetched
    if kh == 1:
        # [layers, B, 1, S, hd]: XLA stores a one-head cache with its length second-minor,
        # so this view is a relabelling, not a copy; one grid step per key block
        k, v = jnp.swapaxes(k_LBSKd, 2, 3), jnp.swapaxes(v_LBSKd, 2, 3)
        grid, heads, semantics = (b, 1, nk), 0, ("parallel", "parallel", "arbitrary")
        kv_block = lambda i, h, j, layer, end: (layer[0], i, h, jnp.minimum(j, last(i, end)), 0)
        kv_spec = (None, None, None, kb, hd)
        state = lambda i, h, j, *_: (i, h, 0, 0)
        blocks = lambda *shape: (None, None) + shape
    else:
        # the cache as it is (rows of K heads); each step takes the heads in turn
        k, v = k_LBSKd, v_LBSKd
        grid, heads, semantics = (b, nk), kh, ("parallel", "arbitrary")
        kv_block = lambda i, j, layer, end: (layer[0], i, jnp.minimum(j, last(i, end)), 0, 0)
        kv_spec = (None, None, kb, kh, hd)
        state = lambda i, j, *_: (i, 0, 0, 0)
        blocks = lambda *shape: (None, kh) + shape
    kernel = lambda *refs: _kernel(*refs, kb=kb, length=s, scale=scale, heads=heads)
    itemsize = k_LBSKd.dtype.itemsize
    m, l, o = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=grid,
            in_specs=[pl.BlockSpec(blocks(qg, hd), state),
                      pl.BlockSpec(kv_spec, kv_block), pl.BlockSpec(kv_spec, kv_block)],
            out_specs=[pl.BlockSpec(blocks(qg, 1), state), pl.BlockSpec(blocks(qg, 1), state),
                       pl.BlockSpec(blocks(qg, hd), state)]),
        out_shape=[jax.ShapeDtypeStruct((b, kh, qg, 1), jnp.float32),
                   jax.ShapeDtypeStruct((b, kh, qg, 1), jnp.float32),
                   jax.ShapeDtypeStruct((b, kh, qg, hd), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
        cost_estimate=pl.CostEstimate(
            flops=4 * b * kh * qg * s * hd, transcendentals=b * kh * qg * s,
            bytes_accessed=2 * b * s * kh * hd * itemsize + q_BKQd.size * q_BKQd.dtype.itemsize
            + b * kh * qg * (hd + 2) * 4),
        interpret=interpret,
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), end, q_BKQd, k, v)
    return m[..., 0], l[..., 0], o


def merge_states(a, b):
    """One online-softmax state (running max, denominator, unnormalised output; any
    leading shape, output with a trailing head dimension) from two over disjoint keys:
    the state over both."""
    (m1, l1, o1), (m2, l2, o2) = a, b
    m = jnp.maximum(m1, m2)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    a1, a2 = jnp.exp(m1 - m_safe), jnp.exp(m2 - m_safe)
    return m, a1 * l1 + a2 * l2, a1[..., None] * o1 + a2[..., None] * o2
