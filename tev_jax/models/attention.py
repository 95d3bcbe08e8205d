"""The attention function (docs/design.md §12): GQA, blocked over keys, online softmax.

Every attention in the library goes through `attention`: queries against one or more
key/value *segments* with one joint softmax across them (the target attends to
[cache ; new tokens], the drafter to [context ; block]). Which keys of a segment a
query sees is a `Mask`, given as a rule rather than as a dense [T, S] boolean: a key
range ``start <= s < end`` per query and, for the small cases that need one, a dense
boolean ANDed with it:

==============================  ===========================================
rule                            mask
==============================  ===========================================
a cache filled up to ``len_b``  ``Mask.prefix(len_B)``
causal, keys ``< len_b`` only   ``Mask.causal(T, len_B)``
blocks of ``n`` queries          ``Mask.blocks(T, n)`` (DFlash training)
tree ancestors                  ``Mask(dense=anc_BNN)``
everything                      ``Mask()``
a sliding window of W           `windowed` (from positions)
==============================  ===========================================

A plain boolean array broadcastable to [B, T, S] is accepted too (a dense mask).

The keys are visited in blocks of ``key_block`` and the queries in blocks of
``query_block``, so only [B, K, Tq, G, Sk] scores exist at a time: a running max,
denominator and output per query row (flash attention) in float32. A key block that no
query of a query block can see (past the filled part of a cache, above a causal
diagonal) is skipped: the loop over key blocks has a dynamic trip count. The gradient
is a custom VJP that recomputes the block scores from the saved log-normalisers, so
`jax.grad` works and its memory is linear in T and S too.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec

from tev_jax import sharding as shd
from tev_jax.kernels import cache_attention
from tev_jax.kernels.cache_attention import merge_states
from tev_jax.kernels.scopes import bound_scope
from tev_jax.models.kv_cache import CACHE_AXES
from tev_jax.runtime import platforms

KEY_BLOCK = 512
QUERY_BLOCK = 512


@struct.dataclass
class Mask:
    """Which keys of one segment each query sees: ``start <= s < end`` and ``dense``.

    Key indices ``s`` count from the segment's first key. Every field is optional
    (None = no constraint).

    Attributes:
      start: int, broadcastable to [B, T]: first visible key per query.
      end: int, broadcastable to [B, T]: keys ``s < end`` are visible.
      dense: bool, broadcastable to [B, T, S] (True = may attend). Meant for small
        segments (a tree of N nodes); the key range covers the large ones.
    """

    start: jax.Array | None = None
    end: jax.Array | None = None
    dense: jax.Array | None = None

    @staticmethod
    def prefix(lengths_B: jax.Array) -> "Mask":
        """Row b sees keys ``s < lengths[b]`` (a cache filled up to its length)."""
        return Mask(end=jnp.asarray(lengths_B, jnp.int32)[:, None])

    @staticmethod
    def causal(num_queries: int, lengths_B: jax.Array | None = None) -> "Mask":
        """Query t sees keys ``s <= t`` (and ``s < lengths[b]``): keys = the queries' own."""
        end = jnp.arange(1, num_queries + 1, dtype=jnp.int32)[None, :]
        if lengths_B is not None:
            end = jnp.minimum(end, jnp.asarray(lengths_B, jnp.int32)[:, None])
        return Mask(end=end)

    @staticmethod
    def blocks(num_queries: int, size: int) -> "Mask":
        """Query t sees the keys of its own block ``t // size`` (block-diagonal)."""
        first = jnp.arange(num_queries, dtype=jnp.int32) // size * size
        return Mask(start=first[None, :], end=first[None, :] + size)


def windowed(mask, window: int | None, positions_BT: jax.Array, *,
             key_positions_BS: jax.Array | None = None, first_key_position=0) -> Mask:
    """``mask`` and a sliding window: a query at position p sees keys at positions
    ``> p - window`` (transformers' ``kv_idx > q_idx - sliding_window``).

    The keys' positions are ``key_positions`` where the mask is dense (a tree: node i
    of a tree rooted after L tokens sits at L + depth[i]); otherwise key s sits at
    ``first_key_position + s`` (a cache, slot = position: 0; a chunk of consecutive new
    tokens: the first one's position), and the window is a key range, so the key blocks
    before it are never read (`attention`).

    Args:
      mask: a `Mask` or bool array broadcastable to [B, T, S].
      window: W, or None (the mask unchanged).
      positions_BT: int [B, T] the queries' positions.
      key_positions_BS: int [B, S], needed with a dense mask.
      first_key_position: int, broadcastable to [B, 1].
    """
    mask = _as_mask(mask)
    if window is None:
        return mask
    pos = jnp.asarray(positions_BT, jnp.int32)
    if mask.dense is not None:
        if key_positions_BS is None:
            raise ValueError("a windowed dense mask needs the keys' positions")
        kpos = jnp.asarray(key_positions_BS, jnp.int32)
        near = (pos[:, :, None] - kpos[:, None, :]) < window
        return mask.replace(dense=jnp.asarray(mask.dense, bool) & near)
    first = pos - jnp.asarray(first_key_position, jnp.int32) - window + 1
    start = first if mask.start is None else jnp.maximum(mask.start, first)
    return mask.replace(start=start)


class _Static(NamedTuple):
    """The shapes that decide the loops (hashable: a custom_vjp static argument)."""

    query_block: int
    num_query_blocks: int
    key_blocks: tuple[int, ...]      # per segment
    num_key_blocks: tuple[int, ...]
    scale: float
    row_ends: tuple[tuple[bool, bool], ...]  # per segment: the TPU / GPU cache kernel takes it


def attention(q_BTHd: jax.Array, segments: Sequence[tuple],
              *, key_block: int = KEY_BLOCK, query_block: int = QUERY_BLOCK,
              scale: float | None = None) -> jax.Array:
    """GQA softmax attention over key/value segments with one joint softmax.

    Equal to softmax attention over the concatenation of the segments along S, with
    float32 scores and accumulation; nothing of size [T, S] is materialised.

    Args:
      q_BTHd: queries [B, T, H, hd] (already roped).
      segments: tuples ``(k [B, S_i, K, hd], v [B, S_i, K, hd], mask)`` with ``mask`` a
        `Mask` or a bool array broadcastable to [B, T, S_i]; H % K == 0. A segment
        ``(k, v, mask, layer)`` reads layer ``layer`` (an int, may be traced) of
        stacked ``k, v [layers, B, S_i, K, hd]`` (a KV cache) block by block, without
        copying that layer out first.
      key_block: most keys per block (static); a segment of S keys is cut into
        ``ceil(S / key_block)`` blocks of equal size.
      query_block: most queries per block (static), likewise; T is padded up to a
        multiple of the block size.
      scale: score scale; default ``hd ** -0.5``.
    Returns:
      [B, T, H, hd] in q's dtype. A query that sees no key gives zeros (never NaN).
    Raises:
      ValueError: shapes that do not fit (named in the message), block sizes < 1.
    """
    b, t, h, hd = q_BTHd.shape
    if key_block < 1 or query_block < 1:
        raise ValueError(f"key_block and query_block must be >= 1, got {key_block}, "
                         f"{query_block}")
    if not segments:
        raise ValueError("attention needs at least one key/value segment")
    kh = segments[0][0].shape[-2]
    if h % kh:
        raise ValueError(f"{h} query heads are not a multiple of {kh} key/value heads")
    nq = -(-t // query_block)
    qb = -(-t // nq)  # balanced: the padding is less than one query per block
    pad = nq * qb - t
    kvs, masks, layers, kbs, nks, row_ends = [], [], [], [], [], []
    for k, v, mask, *layer in segments:
        mask = _as_mask(mask)
        stacked = bool(layer)
        if not layer:
            k, v, layer = k[None], v[None], [0]
        s = k.shape[2]
        if k.ndim != 5 or k.shape[1:] != (b, s, kh, hd) or v.shape != k.shape:
            raise ValueError(f"segment keys {k.shape} / values {v.shape} do not match "
                             f"queries {q_BTHd.shape} with {kh} key/value heads")
        if s == 0:
            continue
        # a stacked cache seen up to each row's length: on TPU / GPU, one kernel
        row_end = (stacked and nq == 1 and mask.start is None and mask.dense is None
                   and mask.end is not None and jnp.shape(mask.end)[-1:] == (1,))
        row_ends.append((row_end and cache_attention.fits("tpu", t * (h // kh), hd, s,
                                                           k.dtype.itemsize),
                         row_end and platforms.gpu_kernels_traced()
                         and cache_attention.fits("cuda", t * (h // kh), hd, s,
                                                  k.dtype.itemsize)))
        kvs.append((k, v))
        layers.append(jnp.asarray(layer[0], jnp.int32))
        masks.append(_padded(mask, b, t, s, pad))
        nks.append(-(-s // key_block))
        kbs.append(-(-s // nks[-1]))
    if not kvs:
        return jnp.zeros_like(q_BTHd)
    static = _Static(qb, nq, tuple(kbs), tuple(nks),
                     float(hd ** -0.5 if scale is None else scale), tuple(row_ends))
    q = jnp.pad(q_BTHd, ((0, 0), (0, pad), (0, 0), (0, 0))) if pad else q_BTHd
    out = _flash(static, q, tuple(kvs), tuple(masks), tuple(layers))
    return out[:, :t]


def _as_mask(mask) -> Mask:
    return mask if isinstance(mask, Mask) else Mask(dense=mask)


def _padded(mask: Mask, b: int, t: int, s: int, pad: int):
    """(start [B, Tp] | None, end [B, Tp] | None, dense [B, Tp, S] | None); padded
    queries see nothing."""
    def rows(x, fill):
        if x is None:
            return None
        x = jnp.broadcast_to(x, (b, t) + x.shape[2:] if x.ndim > 2 else (b, t))
        return jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2),
                       constant_values=fill) if pad else x

    start = None if mask.start is None else rows(jnp.asarray(mask.start, jnp.int32), 0)
    end = None if mask.end is None else rows(jnp.asarray(mask.end, jnp.int32), 0)
    if pad and end is None:  # padded queries must see nothing
        end = rows(jnp.full((1, t), s, jnp.int32), 0)
    dense = None
    if mask.dense is not None:
        d = jnp.asarray(mask.dense, bool)
        d = d.reshape((1,) * (3 - d.ndim) + d.shape)
        dense = rows(jnp.broadcast_to(d, (b, t, s)), False)
    return start, end, dense


# ----------------------------------------------------------------- block pieces


def _query_rows(x, i, qb):
    """Rows ``i*qb ..`` of axis 1 (a query block); None passes through."""
    return None if x is None else jax.lax.dynamic_slice_in_dim(x, i * qb, qb, axis=1)


def _key_range(mask_q, s: int, kb: int, nk: int):
    """(first, last + 1) key block that some query of the block may see."""
    start, end, _ = mask_q
    lo = 0 if start is None else jnp.clip(jnp.min(start), 0, s) // kb
    hi = nk if end is None else -(-jnp.clip(jnp.max(end), 0, s) // kb)
    return lo, hi


def _key_block(x_LBSKd, layer, j, kb: int):
    """Key block j [B, kb, K, hd] of one layer of ``x``; the last block is shifted back to
    fit inside S (no padding copy of the keys), its repeated keys masked by `_visible`."""
    _, b, s, kh, hd = x_LBSKd.shape
    first = jnp.minimum(j * kb, s - kb)
    blk = jax.lax.dynamic_slice(x_LBSKd, (layer, 0, first, 0, 0), (1, b, kb, kh, hd))
    return blk[0], first


def _visible(mask_q, j, first, kb: int):
    """bool [B, Tq, Sk]: key ``first + i`` of block j visible to each query."""
    start, end, dense = mask_q
    idx = first + jnp.arange(kb, dtype=jnp.int32)
    vis = (idx >= j * kb)[None, None, :]
    if start is not None:
        vis = vis & (idx[None, None, :] >= start[:, :, None])
    if end is not None:
        vis = vis & (idx[None, None, :] < end[:, :, None])
    if dense is not None:
        vis = vis & jax.lax.dynamic_slice_in_dim(dense, first, kb, axis=2)
    return vis


def _scores(q_BQKGd, k_BSKd, vis_BQS, scale):
    """Scaled float32 scores [B, K, Q, G, S], -inf where not visible.

    The keys are the product's left operand, so the GPU compiler reads them in the
    cache's own layout (head dim minor); as the right operand it keeps a transposed copy
    of the whole key cache and converts it both ways every step."""
    s_BKSQG = jax.lax.dot_general(
        k_BSKd.astype(q_BQKGd.dtype), q_BQKGd, (((3,), (4,)), ((0, 2), (0, 2))),
        preferred_element_type=jnp.float32)
    s = s_BKSQG.transpose(0, 1, 3, 4, 2) * scale
    return jnp.where(vis_BQS[:, None, :, None, :], s, -jnp.inf)


def _block(q_blk, k, v, layer, mask_q, j, kb: int, scale):
    """(masked scores, k block, v block, first key index) of key block j."""
    k_blk, first = _key_block(k, layer, j, kb)
    v_blk, _ = _key_block(v, layer, j, kb)
    return _scores(q_blk, k_blk, _visible(mask_q, j, first, kb), scale), k_blk, v_blk, first


def _over_key_blocks(lo, hi, nk: int, body, carry):
    """``body(j, carry)`` for key blocks lo..hi-1 (one block: always, it is masked)."""
    if nk == 1:
        return body(0, carry)
    with jax.named_scope(bound_scope(nk)):  # the plan's op table counts it nk times
        return jax.lax.fori_loop(lo, hi, body, carry)


def _over_query_blocks(static: _Static, body, carry):
    if static.num_query_blocks == 1:
        return body(0, carry)
    return jax.lax.fori_loop(0, static.num_query_blocks, body, carry)


def _cache_kernel(kernel, carry, q_BQKGd, k, v, layer, end_B, scale, blocked):
    """``carry`` (`_forward`'s max, denominator, output) joined with the state of
    ``kernel`` (`tev_jax.kernels.cache_attention.cache_attention_state` of one
    platform) over the segment, on each device's
    rows and key/value heads of the active mesh (``blocked(carry)``, the XLA loop, where
    the mesh splits the cache's length)."""
    def state(q_BQKGd, k, v, layer, end_B):
        b, q, kh, g, hd = q_BQKGd.shape
        m, l, o = kernel(
            q_BQKGd.transpose(0, 2, 1, 3, 4).reshape(b, kh, q * g, hd), k, v, layer, end_B,
            scale=scale)
        return m.reshape(b, kh, q, g), l.reshape(b, kh, q, g), o.reshape(b, kh, q, g, hd)

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return merge_states(carry, state(q_BQKGd, k, v, layer, end_B))
    cache = shd.logical_to_spec(CACHE_AXES, k.shape, mesh)
    if len(cache) > 2 and cache[2] is not None:
        return blocked(carry)
    rows, heads = (cache[i] if i < len(cache) else None for i in (1, 3))
    kv = PartitionSpec(None, rows, None, heads)
    out = PartitionSpec(rows, heads)
    return merge_states(carry, jax.shard_map(
        state, mesh=mesh,
        in_specs=(PartitionSpec(rows, None, heads), kv, kv, PartitionSpec(), PartitionSpec(rows)),
        out_specs=(out, out, out), check_vma=False)(q_BQKGd, k, v, layer, end_B))


def _grouped(x_BTHd, kh):
    b, t, h, hd = x_BTHd.shape
    return x_BTHd.reshape(b, t, kh, h // kh, hd)


# ------------------------------------------------------------ forward, backward


def _forward(static: _Static, q, kvs, masks, layers):
    """(out [B, Tp, H, hd] in q's dtype, log-normaliser float32 [B, K, Tp, G])."""
    b, tp, h, hd = q.shape
    kh = kvs[0][0].shape[3]
    g, qb = h // kh, static.query_block
    qg = _grouped(q, kh)

    def query_block(i, bufs):
        out, lse = bufs
        q_blk = _query_rows(qg, i, qb)
        m = jnp.full((b, kh, qb, g), -jnp.inf, jnp.float32)
        carry = (m, jnp.zeros_like(m), jnp.zeros((b, kh, qb, g, hd), jnp.float32))
        for (k, v), mask, layer, kb, nk, (on_tpu, on_gpu) in zip(
                kvs, masks, layers, static.key_blocks, static.num_key_blocks, static.row_ends):
            mask_q = tuple(_query_rows(x, i, qb) for x in mask)

            def body(j, carry, k=k, v=v, mask_q=mask_q, layer=layer, kb=kb):
                m, l, o = carry
                s, _, v_blk, _ = _block(q_blk, k, v, layer, mask_q, j, kb, static.scale)
                m_new = jnp.maximum(m, s.max(-1))
                m_ref = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # all unseen: no NaN
                p = jnp.exp(s - m_ref[..., None])
                alpha = jnp.exp(m - m_ref)
                pv = jnp.einsum("bkqgs,bskd->bkqgd", p.astype(v.dtype), v_blk,
                                preferred_element_type=jnp.float32)
                return m_new, alpha * l + p.sum(-1), alpha[..., None] * o + pv

            def blocked(carry, body=body, mask_q=mask_q, k=k, kb=kb, nk=nk):
                return _over_key_blocks(*_key_range(mask_q, k.shape[2], kb, nk), nk, body,
                                        carry)

            if on_tpu or on_gpu:   # lowered per platform: a kernel's state, joined
                kernels = {
                    platform: lambda *a, platform=platform, blocked=blocked: _cache_kernel(
                        functools.partial(cache_attention.cache_attention_state,
                                          platform=platform), *a, static.scale, blocked)
                    for platform, on in (("tpu", on_tpu), ("cuda", on_gpu)) if on}
                carry = jax.lax.platform_dependent(
                    carry, q_blk, k, v, layer, mask_q[1][:, 0], **kernels,
                    default=lambda c, *_, blocked=blocked: blocked(c))
            else:
                carry = blocked(carry)
        m, l, o = carry
        seen = l > 0
        o = o / jnp.where(seen, l, 1.0)[..., None]
        o_blk = o.transpose(0, 2, 1, 3, 4).reshape(b, qb, h, hd).astype(q.dtype)
        lse_blk = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
        if static.num_query_blocks == 1:
            return o_blk, lse_blk
        return (jax.lax.dynamic_update_slice_in_dim(out, o_blk, i * qb, axis=1),
                jax.lax.dynamic_update_slice_in_dim(lse, lse_blk, i * qb, axis=2))

    bufs = (jnp.zeros(q.shape, q.dtype), jnp.zeros((b, kh, tp, g), jnp.float32))
    return _over_query_blocks(static, query_block, bufs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(static: _Static, q, kvs, masks, layers):
    return _forward(static, q, kvs, masks, layers)[0]


def _flash_fwd(static, q, kvs, masks, layers):
    out, lse = _forward(static, q, kvs, masks, layers)
    return out, (q, kvs, masks, layers, out, lse)


def _flash_bwd(static, residuals, dout):
    """Flash backward: per block ``p = exp(s - lse)``, ``ds = p * (dp - rowsum(dO * O))``."""
    q, kvs, masks, layers, out, lse = residuals
    b, tp, h, hd = q.shape
    kh = kvs[0][0].shape[3]
    g, qb = h // kh, static.query_block
    qg, dog = _grouped(q, kh), _grouped(dout, kh)
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), -1)
    delta = delta.reshape(b, tp, kh, g).transpose(0, 2, 1, 3)                 # [B, K, Tp, G]

    def query_block(i, carry):
        dq, dkvs = carry
        q_blk, do_blk = _query_rows(qg, i, qb), _query_rows(dog, i, qb)
        lse_blk = jax.lax.dynamic_slice_in_dim(lse, i * qb, qb, axis=2)[..., None]
        delta_blk = jax.lax.dynamic_slice_in_dim(delta, i * qb, qb, axis=2)[..., None]
        dq_blk = jnp.zeros(q_blk.shape, jnp.float32)
        new_dkvs = []
        for (k, v), (dk, dv), mask, layer, kb, nk in zip(kvs, dkvs, masks, layers,
                                                         static.key_blocks,
                                                         static.num_key_blocks):
            mask_q = tuple(_query_rows(x, i, qb) for x in mask)

            def body(j, c, k=k, v=v, mask_q=mask_q, layer=layer, kb=kb):
                dq_blk, dk, dv = c
                s, k_blk, v_blk, first = _block(q_blk, k, v, layer, mask_q, j, kb,
                                                static.scale)
                p = jnp.exp(s - lse_blk)
                dv_blk = jnp.einsum("bkqgs,bqkgd->bskd", p.astype(do_blk.dtype), do_blk,
                                    preferred_element_type=jnp.float32)
                dp = jnp.einsum("bqkgd,bskd->bkqgs", do_blk, v_blk.astype(do_blk.dtype),
                                preferred_element_type=jnp.float32)
                ds = p * (dp - delta_blk) * static.scale
                dq_blk = dq_blk + jnp.einsum("bkqgs,bskd->bqkgd", ds.astype(k.dtype), k_blk,
                                             preferred_element_type=jnp.float32)
                dk_blk = jnp.einsum("bkqgs,bqkgd->bskd", ds.astype(q_blk.dtype), q_blk,
                                    preferred_element_type=jnp.float32)
                return dq_blk, _add_rows(dk, dk_blk, first), _add_rows(dv, dv_blk, first)

            dq_blk, dk, dv = _over_key_blocks(*_key_range(mask_q, k.shape[2], kb, nk), nk,
                                              body, (dq_blk, dk, dv))
            new_dkvs.append((dk, dv))
        dq_blk = dq_blk.reshape(b, qb, h, hd)
        if static.num_query_blocks == 1:
            return dq_blk, tuple(new_dkvs)
        return jax.lax.dynamic_update_slice_in_dim(dq, dq_blk, i * qb, axis=1), tuple(new_dkvs)

    zeros = tuple((jnp.zeros(k.shape[1:], jnp.float32),) * 2 for k, _ in kvs)
    dq, dkvs = _over_query_blocks(static, query_block,
                                  (jnp.zeros(q.shape, jnp.float32), zeros))
    # Cotangents of the stacked inputs: only the layer that was read.
    put = lambda x, d, layer: jnp.zeros_like(x).at[layer].set(d.astype(x.dtype))
    dkvs = tuple((put(k, dk, layer), put(v, dv, layer))
                 for (dk, dv), (k, v), layer in zip(dkvs, kvs, layers))
    return dq.astype(q.dtype), dkvs, None, None


def _add_rows(acc_BSKd, x_BSKd, first):
    """``acc[:, first:first + Sk] += x`` (a key block's gradient)."""
    n = x_BSKd.shape[1]
    cur = jax.lax.dynamic_slice_in_dim(acc_BSKd, first, n, axis=1)
    return jax.lax.dynamic_update_slice_in_dim(acc_BSKd, cur + x_BSKd, first, axis=1)


_flash.defvjp(_flash_fwd, _flash_bwd)
