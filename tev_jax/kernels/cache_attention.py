"""A few queries against one layer of the stacked KV cache: the cache part of the AR
step's and the tree verify pass's attention (docs/design.md §12, §14), as one Pallas kernel
per platform, beside its pure-jnp reference, its cost and its GPU block sizes.

The one entry is `cache_attention_state` (``platform`` 'tpu', 'cuda' or 'reference'),
with `fits` saying where a platform's kernel takes a pass; `merge_states` joins its
online-softmax state with the other segments' (`tev_jax.models.attention`), so the
result is the same joint softmax.

**TPU** (`tpu_state`, Pallas Mosaic). XLA's blocked attention writes each key block's
float32 scores [B, K, T, G, Sk] to HBM and reads them back for the softmax and the
values: for a round of N = 65 queries and 8 query heads per key/value head that is
about four times the bytes of the keys and values it attends to. This kernel keeps the
scores, the running max, the denominator and the output of one batch row in VMEM while
it walks the row's key blocks, reading each cached key and value once and only the
blocks below the row's length (block indices from scalars prefetched into SMEM: a block
past the length is neither fetched nor computed). The layer is read in place from the
stacked cache [layers, B, S, K, hd]; one kernel step is one key block of one row (and of
one key/value head where a device holds one).

**GPU** (`gpu_state`, Pallas Triton). The blocked XLA attention pays three times for
every cached key: the layer loop slices each key block out of the stacked cache into a
new buffer (the compiler cannot fuse a dynamic slice into its matrix product), the
product reads that copy, and the float32 scores of each block go to HBM and back. This
kernel reads the layer in place (the layer and the rows' lengths are operands, not
slices) and keeps the scores and the running state in registers. One program is one
tile of query rows of one (row, key/value head) over one split of the key blocks
(flash-decoding: a few rows alone would fill too few of the GPU's multiprocessors); the
splits' states are joined afterwards. The row tiles of a split are adjacent in launch
order, so they read the same key blocks at about the same time. Its block sizes are a
table per GPU (`GPU_BLOCKS`, read at trace time by `gpu_blocks`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from tev_jax.kernels import gpu_table, scopes

PLATFORMS = ("tpu", "cuda", "reference")
TPU_KEY_BLOCK = 512
TPU_VMEM_BUDGET = 12 * 2**20   # of the 16 MiB scoped VMEM a kernel gets by default (v5e)


@dataclasses.dataclass(frozen=True)
class GpuBlocks:
    """The GPU kernel's block sizes on one GPU.

    Attributes:
      key_block: keys per step of a program.
      row_tile: query rows per program (at most).
      shared_budget: bytes of shared memory the tiles may take: the query tile and the
        double-buffered key and value blocks, (rows + 4 x key block) x hd x 2.
      programs: programs to aim for (two per multiprocessor); splits of the key blocks
        are added up to it.
      num_warps, num_stages: Triton's.
    """

    key_block: int = 64
    row_tile: int = 64
    shared_budget: int = 160 * 2**10
    programs: int = 264
    num_warps: int = 4
    num_stages: int = 2


# Today's values are H100's (227 KiB of shared memory per block, 132 multiprocessors) on
# every GPU; a measurement on each GPU refines them.
GPU_BLOCKS = {name: GpuBlocks() for name in gpu_table.GPUS}


def gpu_blocks(kind: str | None = None) -> GpuBlocks:
    """The `GPU_BLOCKS` entry of a GPU (`tev_jax.kernels.gpu_table.lookup`)."""
    return gpu_table.lookup(GPU_BLOCKS, kind)


def cost(b: int, kh: int, qg: int, s: int, hd: int, itemsize: int,
         q_itemsize: int | None = None) -> dict[str, int]:
    """The floor of one call: FLOPs (scores and values), exponentials, and bytes (keys
    and values once, the queries, the float32 state out) of Q = ``qg`` query rows per
    key/value head over S = ``s`` keys (the cache's ``itemsize``; the queries' default
    to it); the ``pl.CostEstimate`` fields."""
    q_bytes = b * kh * qg * hd * (itemsize if q_itemsize is None else q_itemsize)
    return dict(flops=4 * b * kh * qg * s * hd, transcendentals=b * kh * qg * s,
                bytes_accessed=2 * b * s * kh * hd * itemsize + q_bytes
                + b * kh * qg * (hd + 2) * 4)


def fits(platform: str, rows: int, head_dim: int, length: int, itemsize: int = 2) -> bool:
    """Whether ``platform``'s kernel takes a pass of ``rows`` query rows per key/value
    head (`tpu_fits`, `gpu_fits`; the reference takes any)."""
    if platform == "tpu":
        return tpu_fits(rows, head_dim, length, itemsize)
    if platform == "cuda":
        return gpu_fits(head_dim, itemsize)
    return True


def cache_attention_state(q_BKQd: jax.Array, k_LBSKd: jax.Array, v_LBSKd: jax.Array,
                          layer, end_B: jax.Array, *, scale: float, platform: str,
                          key_block: int | None = None, interpret: bool = False):
    """The online-softmax state of queries against cache layer ``layer``, keys ``s <
    end[b]`` of row b, by ``platform``'s kernel (`PLATFORMS`).

    Args:
      q_BKQd: [B, K, Q, hd] queries grouped by key/value head (Q = queries x heads per
        key/value head), already roped.
      k_LBSKd, v_LBSKd: the stacked cache [layers, B, S, K, hd].
      layer: the layer read (traced).
      end_B: int32 [B] visible keys per row.
      scale: score scale.
      platform: 'tpu' (`tpu_state`), 'cuda' (`gpu_state`) or 'reference'
        (`reference_state`).
      key_block: keys per kernel step (default the platform's).
      interpret: run the kernel in Pallas' interpreter (tests off the platform).
    Returns:
      (running max [B, K, Q], denominator [B, K, Q], unnormalised output [B, K, Q, hd]),
      float32; a row that sees no key has max -inf and zeros.
    """
    if platform == "reference":
        return reference_state(q_BKQd, k_LBSKd, v_LBSKd, layer, end_B, scale=scale)
    blocks = {} if key_block is None else {"key_block": key_block}
    if platform == "tpu":
        return tpu_state(q_BKQd, k_LBSKd, v_LBSKd, layer, end_B, scale=scale,
                         interpret=interpret, **blocks)
    if platform == "cuda":
        return gpu_state(q_BKQd, k_LBSKd, v_LBSKd, layer, end_B, scale=scale,
                         interpret=interpret, **blocks)
    raise ValueError(f"cache attention platform must be one of {PLATFORMS}, got "
                     f"{platform!r}")


def reference_state(q_BKQd: jax.Array, k_LBSKd: jax.Array, v_LBSKd: jax.Array, layer,
                    end_B: jax.Array, *, scale: float):
    """`cache_attention_state` in plain jnp (the kernels' reference): the layer sliced
    out, every score computed, the keys past each row's end masked."""
    k = jax.lax.dynamic_index_in_dim(k_LBSKd, layer, keepdims=False)   # [B, S, K, hd]
    v = jax.lax.dynamic_index_in_dim(v_LBSKd, layer, keepdims=False)
    s = jnp.einsum("bkqd,bskd->bkqs", q_BKQd.astype(jnp.float32), k.astype(jnp.float32)
                   ) * scale
    seen = jnp.arange(k.shape[1])[None, :] < jnp.asarray(end_B)[:, None]   # [B, S]
    s = jnp.where(seen[:, None, None, :], s, -jnp.inf)
    m = s.max(axis=-1)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)[..., None])
    return m, p.sum(axis=-1), jnp.einsum("bkqs,bskd->bkqd", p, v.astype(jnp.float32))


# ---------------------------------------------------------------------------- TPU


def tpu_fits(rows: int, head_dim: int, length: int, itemsize: int = 2,
             key_block: int = TPU_KEY_BLOCK) -> bool:
    """Whether one kernel step of ``rows`` query rows per key/value head (queries x
    query heads per key/value head) fits `TPU_VMEM_BUDGET`: double-buffered queries, key
    and value blocks and float32 outputs (the running max and denominator padded to 128
    lanes), and the float32 scores and probabilities of a key block. A prefill chunk of
    512 queries does not: it takes the blocked XLA attention."""
    kb = min(key_block, length)
    buffers = 2 * (rows * head_dim * itemsize + 2 * kb * head_dim * itemsize
                   + rows * (2 * 128 + head_dim) * 4)
    return buffers + 2 * rows * kb * 4 <= TPU_VMEM_BUDGET


def _tpu_kernel(layer_ref, end_ref, q_ref, k_ref, v_ref, m_ref, l_ref, o_ref, *, kb: int,
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


def tpu_state(q_BKQd: jax.Array, k_LBSKd: jax.Array, v_LBSKd: jax.Array, layer,
              end_B: jax.Array, *, scale: float, key_block: int = TPU_KEY_BLOCK,
              interpret: bool = False):
    """The TPU kernel (Pallas Mosaic): the online-softmax state of queries against cache
    layer ``layer``, keys ``s < end[b]`` of row b.

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
    kernel = lambda *refs: _tpu_kernel(*refs, kb=kb, length=s, scale=scale, heads=heads)
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
        cost_estimate=pl.CostEstimate(**cost(b, kh, qg, s, hd, itemsize,
                                             q_BKQd.dtype.itemsize)),
        interpret=interpret,
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), end, q_BKQd, k, v)
    return m[..., 0], l[..., 0], o


# ---------------------------------------------------------------------------- GPU


def gpu_fits(head_dim: int, itemsize: int = 2, blocks: GpuBlocks | None = None) -> bool:
    """Whether the GPU kernel takes a head dimension: Triton tiles are powers of two of
    at least 16, and the smallest tiles must fit the GPU's shared-memory budget
    (`GpuBlocks`; keys past the cache's length are masked, so any length is taken)."""
    budget = (blocks or gpu_blocks()).shared_budget
    return (head_dim >= 16 and head_dim == gpu_table.pow2(head_dim)
            and (16 + 4 * 16) * head_dim * itemsize <= budget)


def _gpu_kernel(layer_ref, end_ref, q_ref, k_ref, v_ref, m_ref, l_ref, o_ref, *,
                heads: int, kb: int, length: int, per_split: int, scale: float):
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


def gpu_state(q_BKQd: jax.Array, k_LBSKd: jax.Array, v_LBSKd: jax.Array, layer,
              end_B: jax.Array, *, scale: float, key_block: int | None = None,
              interpret: bool = False, blocks: GpuBlocks | None = None):
    """The GPU kernel (Pallas Triton), with `tpu_state`'s contract.

    Args:
      q_BKQd: [B, K, Q, hd] queries grouped by key/value head, already roped.
      k_LBSKd, v_LBSKd: the stacked cache [layers, B, S, K, hd] (hd a power of two, at
        least 16).
      layer: the layer read (traced).
      end_B: int32 [B] visible keys per row.
      scale: score scale.
      key_block: keys per step (rounded up to a power of two, at least 16; a shorter
        cache takes one block; default the GPU's `GpuBlocks`).
      interpret: run in Pallas' interpreter (tests without a GPU).
      blocks: the block sizes (default `gpu_blocks`, the local GPU's or H100's).
    Returns:
      (running max [B, K, Q], denominator [B, K, Q], unnormalised output [B, K, Q, hd]),
      float32; a row that sees no key has max -inf and zeros.
    """
    blocks = blocks or gpu_blocks()
    key_block = blocks.key_block if key_block is None else key_block
    b, kh, qg, hd = q_BKQd.shape
    s = k_LBSKd.shape[2]
    if not gpu_fits(hd, k_LBSKd.dtype.itemsize, blocks):
        raise ValueError(f"the GPU cache kernel needs a power-of-two head dimension of at "
                         f"least 16 whose tiles fit shared memory, not {hd}")
    kb = max(16, min(gpu_table.pow2(key_block), gpu_table.pow2(s)))
    rows = max(16, min(blocks.row_tile, gpu_table.pow2(qg)))          # Triton dots: >= 16
    itemsize = k_LBSKd.dtype.itemsize
    while (rows + 4 * kb) * hd * itemsize > blocks.shared_budget and max(rows, kb) > 16:
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
    per_split = -(-nk // min(most, max(1, blocks.programs // (b * kh * tiles))))
    splits = -(-nk // per_split)
    q = jnp.pad(q_BKQd, ((0, 0), (0, 0), (0, tiles * rows - qg), (0, 0)))
    q = q.reshape(b * kh, tiles * rows, hd)
    whole = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)
    kernel = lambda *refs: _gpu_kernel(*refs, heads=kh, kb=kb, length=s, per_split=per_split,
                                   scale=scale)
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    layer_1 = jnp.reshape(layer, (1,)).astype(jnp.int32)
    end = end_B.astype(jnp.int32)
    floor = cost(b, kh, qg, s, hd, itemsize)
    cost_scope = scopes.kernel_scope(
        flops=floor["flops"],
        bytes_accessed=kv_bytes + q.size * q.dtype.itemsize + splits * split_bytes)
    with jax.named_scope(cost_scope):
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
            compiler_params=pltriton.CompilerParams(num_warps=blocks.num_warps,
                                                    num_stages=blocks.num_stages),
            interpret=interpret,
        )(layer_1, end, q, k_LBSKd, v_LBSKd)
    # join the splits' states: one max, each split's share rescaled to it
    m_all = m.reshape(splits, b, kh, tiles * rows)[..., :qg]
    l_all = l.reshape(splits, b, kh, tiles * rows)[..., :qg]
    o_all = o.reshape(splits, b, kh, tiles * rows, hd)[..., :qg, :]
    m = m_all.max(axis=0)
    w = jnp.exp(m_all - jnp.where(m > -jnp.inf, m, 0.0))
    return m, (w * l_all).sum(axis=0), (w[..., None] * o_all).sum(axis=0)


def merge_states(a, b):
    """One online-softmax state (running max, denominator, unnormalised output; any
    leading shape, output with a trailing head dimension) from two over disjoint keys:
    the state over both."""
    (m1, l1, o1), (m2, l2, o2) = a, b
    m = jnp.maximum(m1, m2)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    a1, a2 = jnp.exp(m1 - m_safe), jnp.exp(m2 - m_safe)
    return m, a1 * l1 + a2 * l2, a1[..., None] * o1 + a2[..., None] * o2
