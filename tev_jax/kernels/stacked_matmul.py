"""``x · w[g]`` for one entry of a stacked weight, read in place (docs/design.md §14): the
GPU kernel, the other platforms' product, the pure-jnp reference, the cost and the GPU
block sizes.

A layer scan hands each step its slice of the stacked weights [layers, ...]. The TPU
compiler reads that slice inside the matrix product; the GPU compiler cannot fuse a
dynamic slice into its GEMMs, so it first copies every layer's matrices out of the
stack (a device-to-device copy per matrix and step): each weight byte is read twice and
written once, about three times the floor of a decoding step. A target's `Linear` whose
kernel the scan passes whole (`scan_layers`' ``in_place``) calls the one entry,
`stacked_dot`: on GPU a Pallas Triton GEMM whose operands are the whole stack and the
index ``g`` (`stacked_matmul`: a split-K grid, so that a few token rows still fill the
multiprocessors, the splits' float32 partial sums added afterwards); elsewhere, TPU
included, the slice and ``lax.dot_general`` (`reference_dot`), which is also the
reference the kernel is tested against. The GPU kernel's block sizes are a table per
GPU (`GPU_BLOCKS`, read at trace time by `gpu_blocks`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jax.sharding import PartitionSpec

from tev_jax import sharding as shd
from tev_jax.kernels import gpu_table, scopes
from tev_jax.runtime import platforms


@dataclasses.dataclass(frozen=True)
class GpuBlocks:
    """The GPU kernel's block sizes on one GPU.

    Attributes:
      block_k: contraction rows per step.
      block_m: token rows per program (at most; at least 16, Triton's smallest dot).
      block_n: output columns per program.
      programs: programs to aim for (two per multiprocessor); K splits are added up to it.
      num_warps, num_stages: Triton's.
    """

    block_k: int = 64
    block_m: int = 64
    block_n: int = 64
    programs: int = 264
    num_warps: int = 4
    num_stages: int = 3


# Today's values are H100's (132 multiprocessors) on every GPU; a measurement on each GPU
# refines them.
GPU_BLOCKS = {name: GpuBlocks() for name in gpu_table.GPUS}


def gpu_blocks(kind: str | None = None) -> GpuBlocks:
    """The `GPU_BLOCKS` entry of a GPU (`tev_jax.kernels.gpu_table.lookup`)."""
    return gpu_table.lookup(GPU_BLOCKS, kind)


def cost(m: int, k: int, n: int, w_itemsize: int, x_itemsize: int, splits: int = 1,
         out_itemsize: int | None = None) -> dict[str, int]:
    """FLOPs and bytes of one ``[M, K] · [K, N]`` product with one stack entry: the
    entry and the rows read once, the ``splits`` partial outputs written (in
    ``out_itemsize``, default the weight's)."""
    out = w_itemsize if out_itemsize is None else out_itemsize
    return dict(flops=2 * m * k * n,
                bytes_accessed=k * n * w_itemsize + m * k * x_itemsize + splits * m * n * out)


def _kernel(g_ref, x_ref, w_ref, o_ref, *, m: int, k: int, n: int, bm: int, bn: int,
            bk: int, per_split: int):
    i, j, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    g = g_ref[0]
    rows = i * bm + jnp.arange(bm, dtype=jnp.int32)
    cols = j * bn + jnp.arange(bn, dtype=jnp.int32)
    lo = split * per_split
    hi = jnp.minimum(lo + per_split, -(-k // bk))

    def step(s, acc):
        ks = s * bk + jnp.arange(bk, dtype=jnp.int32)
        x = pltriton.load(x_ref.at[pl.ds(i * bm, bm), pl.ds(s * bk, bk)],
                          mask=(rows < m)[:, None] & (ks < k)[None, :], other=0)
        w = pltriton.load(w_ref.at[g, pl.ds(s * bk, bk), pl.ds(j * bn, bn)],
                          mask=(ks < k)[:, None] & (cols < n)[None, :], other=0)
        return acc + pltriton.dot(x.astype(w.dtype), w).astype(jnp.float32)

    acc = jax.lax.fori_loop(lo, hi, step, jnp.zeros((bm, bn), jnp.float32))
    pltriton.store(o_ref.at[pl.ds(i * bm, bm), pl.ds(j * bn, bn)], acc.astype(o_ref.dtype),
                   mask=(rows < m)[:, None] & (cols < n)[None, :])


def stacked_matmul(x_MK: jax.Array, w_GKN: jax.Array, g, *, interpret: bool = False,
                   blocks: GpuBlocks | None = None) -> jax.Array:
    """The GPU kernel: ``x · w[g]`` [M, N] in w's dtype (float32 accumulation), reading
    entry ``g`` (traced int) of the stack ``w`` in place: one Pallas Triton kernel.

    ``interpret``: Pallas' interpreter (tests without a GPU); ``blocks``: the block
    sizes (default `gpu_blocks`).
    """
    blocks = blocks or gpu_blocks()
    m, k = x_MK.shape
    _, k2, n = w_GKN.shape
    if k != k2:
        raise ValueError(f"x [{m}, {k}] does not contract with a stack of [{k2}, {n}]")
    bm = max(16, min(blocks.block_m, gpu_table.pow2(m)))          # Triton dots: >= 16
    bn, bk = blocks.block_n, blocks.block_k
    tiles = -(-m // bm) * -(-n // bn)
    ks = -(-k // bk)
    # splits while programs are few, and while their float32 partial sums (splits x M x
    # N x 4 bytes, written and read back) stay below a quarter of the weight's bytes
    most = max(1, min(ks, k // (8 * m)))
    per_split = -(-ks // min(most, max(1, blocks.programs // tiles)))
    splits = -(-ks // per_split)
    g_1 = jnp.reshape(g, (1,)).astype(jnp.int32)
    whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
    kernel = lambda *refs: _kernel(*refs, m=m, k=k, n=n, bm=bm, bn=bn, bk=bk,
                                   per_split=per_split)
    # one split stores the product in w's dtype, several their float32 partial sums
    out = w_GKN.dtype if splits == 1 else jnp.float32
    scope = scopes.kernel_scope(**cost(m, k, n, w_GKN.dtype.itemsize,
                                         x_MK.dtype.itemsize, splits,
                                         jnp.dtype(out).itemsize))
    with jax.named_scope(scope):
        partial = pl.pallas_call(
            kernel, grid=(-(-m // bm), -(-n // bn), splits),
            in_specs=[whole(g_1), whole(x_MK), whole(w_GKN)],
            out_specs=pl.BlockSpec((None, m, n), lambda i, j, s: (s, 0, 0)),
            out_shape=jax.ShapeDtypeStruct((splits, m, n), out),
            compiler_params=pltriton.CompilerParams(num_warps=blocks.num_warps,
                                                    num_stages=blocks.num_stages),
            interpret=interpret,
        )(g_1, x_MK, w_GKN)
    return partial[0] if splits == 1 else partial.sum(axis=0).astype(w_GKN.dtype)


def _local_dot(x, w_stack, g, n_in: int, interpret: bool = False):
    """`stacked_matmul` over x's last ``n_in`` axes and the stack's entry's first."""
    lead, cin = x.shape[:x.ndim - n_in], x.shape[x.ndim - n_in:]
    cout = w_stack.shape[1 + n_in:]
    y = stacked_matmul(x.reshape(-1, math.prod(cin)),
                       w_stack.reshape(w_stack.shape[0], math.prod(cin), math.prod(cout)),
                       g, interpret=interpret)
    return y.reshape(lead + cout)


def reference_dot(x: jax.Array, w_stack: jax.Array, g, n_in: int) -> jax.Array:
    """``x · w_stack[g]`` in plain jnp: the entry sliced out, then ``lax.dot_general``
    (contracting x's last ``n_in`` axes with the entry's first ``n_in``). The product on
    every platform but GPU (the TPU compiler reads the slice in place), and the kernel's
    reference."""
    w = jax.lax.dynamic_index_in_dim(w_stack, g, keepdims=False)
    return jax.lax.dot_general(
        x.astype(w.dtype), w, ((tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))),
                               ((), ())))


def gpu_dot(x, w_stack, g, n_in: int, w_axes, *, interpret: bool = False):
    """The GPU path of `stacked_dot`: the kernel on each device's shard of the active
    mesh (the stack by its logical ``w_axes``, the rows by their batch split; a
    contraction split over devices is summed over them). Where a mesh axis would split
    both the rows and the weight, the sliced product instead."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return _local_dot(x, w_stack, g, n_in, interpret)
    spec_w = shd.logical_to_spec(w_axes, w_stack.shape, mesh)
    spec_w = tuple(spec_w) + (None,) * (w_stack.ndim - len(spec_w))
    spec_b = shd.logical_to_spec(("batch",), x.shape[:1], mesh)
    axes = lambda spec: {a for s in spec if s is not None
                         for a in ((s,) if isinstance(s, str) else s)}
    if spec_w[0] is not None or axes(spec_b) & axes(spec_w):
        return reference_dot(x, w_stack, g, n_in)
    lead = x.ndim - n_in
    batch = tuple(spec_b)[0] if len(spec_b) else None
    spec_x = PartitionSpec(batch, *(None,) * (lead - 1), *spec_w[1:1 + n_in])
    spec_y = PartitionSpec(batch, *(None,) * (lead - 1), *spec_w[1 + n_in:])
    summed = tuple(sorted(axes(spec_w[1:1 + n_in])))

    def local(x, w_stack, g):
        y = _local_dot(x, w_stack, g, n_in, interpret)
        return jax.lax.psum(y, summed) if summed else y

    return jax.shard_map(local, mesh=mesh, in_specs=(spec_x, PartitionSpec(*spec_w),
                                                     PartitionSpec()),
                         out_specs=spec_y, check_vma=False)(x, w_stack, g)


def stacked_dot(x: jax.Array, w_stack: jax.Array, g, n_in: int, w_axes) -> jax.Array:
    """``x · w_stack[g]``, contracting x's last ``n_in`` axes with the entry's first
    ``n_in``; ``w_axes``: the stack's logical axes (its sharding). Lowered for a GPU,
    the entry is read in place (`gpu_dot`); for other platforms it is sliced, then
    multiplied. The gradient is the sliced product's (the kernel has none of its own).
    Without jax's CUDA plugin no GPU lowering is possible: the sliced product alone."""
    if not platforms.gpu_kernels_traced():
        return reference_dot(x, w_stack, g, n_in)
    return _per_platform(x, w_stack, g, n_in, w_axes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _per_platform(x, w_stack, g, n_in, w_axes):
    return jax.lax.platform_dependent(
        x, w_stack, g,
        cuda=lambda x, w, g: gpu_dot(x, w, g, n_in, w_axes),
        default=lambda x, w, g: reference_dot(x, w, g, n_in))


def _per_platform_fwd(x, w_stack, g, n_in, w_axes):
    return _per_platform(x, w_stack, g, n_in, w_axes), (x, w_stack, g)


def _per_platform_bwd(n_in, w_axes, res, dy):
    x, w_stack, g = res
    _, vjp = jax.vjp(lambda x, w: reference_dot(x, w, g, n_in), x, w_stack)
    return (*vjp(dy), None)


_per_platform.defvjp(_per_platform_fwd, _per_platform_bwd)
