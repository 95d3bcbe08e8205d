"""Grouped SwiGLU experts over rows sorted by expert (docs/design.md §14): the TPU kernel that
reads the experts of one stacked layer in place, the XLA version for other platforms,
the pure-jnp reference and the cost estimate. The one entry is `expert_sum`.

The rows (token, expert pairs) come sorted by expert, in groups of ``sizes[e]`` rows.

**TPU** (`grouped_expert_mlp`, Pallas Mosaic). The kernel cuts the rows into tiles of
``tm`` rows (`tile_rows`) and visits, in order, every (tile, expert) pair whose rows
meet (`visits`): a visit loads the expert's gate, up and down matrices, whole, from
entry ``stack`` of the stacked weights (its block index is computed from scalars
prefetched into SMEM, so no layer slice is copied out of the stack first), computes
``down(silu(gate x) * up x)`` for the tile's rows that belong to the expert and adds it
to the tile's float32 accumulator. Visits in order of expert are in order of tile, so a
tile's accumulator stays in VMEM across its visits and an expert's weights, unchanged
across its consecutive visits, are fetched from HBM once. The visits beyond the real
ones (the grid is sized for the worst case) repeat the last block indices and compute
nothing: no transfer, no arithmetic. Off TPU it runs in Pallas' interpreter
(``interpret=True``: the tests).

**TPU, tokens in VMEM** (`resident_expert_sum`: what `expert_sum` runs when a pass's
tokens fit, `fits_resident`). The same visits, but the kernel takes the tokens [M, D]
and each pair's token id instead of the pairs' rows: the tokens are read into VMEM once,
a tile's rows are gathered there, and each tile's weighted outputs are added to its
tokens' float32 sums, which are written once at the end. XLA's gather wrote every pair's
row (M·k rows, though a device computes only its own experts' pairs) and its scatter
read them back: at B 32, budget 32 on v5p-8, 74 MB per layer beside the experts' 302.

**Elsewhere** (`ragged_expert_mlp`: GPU, CPU). Three grouped matmuls
(``jax.lax.ragged_dot``). Under the layer scan XLA copies each layer's experts out of
the stack before them (twice the experts' bytes per layer; experiments/tpu/README.md):
the TPU kernel reads each touched expert once per pass. There is no GPU kernel yet, so
no GPU block table either (issue 44 item 7).

**Reference** (`reference_expert_mlp`): every row through its expert, one at a time in
plain jnp.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

METHODS = ("grouped", "ragged", "reference")
MIN_ROWS, MAX_ROWS = 16, 256
VMEM_MARGIN = 8 * 2**20
RESIDENT_BYTES = 32 * 2**20
"""VMEM that `resident_expert_sum` may give the tokens and their sums
(`RESIDENT_ENTRY_BYTES` per token entry); v5p has 64 MiB per core, and the experts'
double-buffered weights take 19 of them for Qwen3-Coder-30B-A3B."""
RESIDENT_ENTRY_BYTES = 12
"""VMEM per token entry in `resident_expert_sum`: bfloat16 in and out, a float32 copy
and the float32 sums."""


def cost(visited: int, tm: int, d: int, f: int, touched: int, w_itemsize: int,
         rows_bytes: int) -> dict[str, int]:
    """The TPU kernel's ``pl.CostEstimate``: ``visited`` (tile, expert) visits of ``tm``
    rows (three [D, F] products each, an exponential per hidden unit), each of the
    ``touched`` experts' weights read once, the rows read and written once
    (``rows_bytes``)."""
    return dict(flops=6 * visited * tm * d * f, transcendentals=visited * tm * f,
                bytes_accessed=touched * 3 * d * f * w_itemsize + 2 * rows_bytes)


def fits_resident(tokens: int, d: int) -> bool:
    """Whether `resident_expert_sum` can hold ``tokens`` [tokens, d] and their sums in
    VMEM (`RESIDENT_BYTES`)."""
    return RESIDENT_ENTRY_BYTES * tokens * d <= RESIDENT_BYTES


def tile_rows(pairs: int, total_experts: int) -> int:
    """Rows per tile: an expert's mean share of the ``pairs``, rounded down to a power of
    two between 16 (bfloat16's sublane tile) and 256. Tiles about one group long keep
    the visits (at most tiles + experts − 1) near twice the tiles, and the rows computed
    near twice the pairs."""
    mean = max(1, pairs // total_experts)
    return min(MAX_ROWS, max(MIN_ROWS, 1 << (mean.bit_length() - 1)))


def visits(sizes_E: jax.Array, tm: int, count: int):
    """The (tile, expert) visits of groups ``sizes_E`` cut into tiles of ``tm`` rows.

    Returns:
      (expert int32 [count], tile int32 [count], group starts int32 [E], group ends
      int32 [E], real visits int32 [1]); entries past the real ones repeat the last.
    """
    e = sizes_E.shape[0]
    ends = jnp.cumsum(sizes_E).astype(jnp.int32)
    starts = ends - sizes_E
    first_tile = starts // tm
    tiles_E = jnp.where(sizes_E > 0, (jnp.maximum(ends, 1) - 1) // tm - first_tile + 1, 0)
    upto_E = jnp.cumsum(tiles_E)
    real = upto_E[-1]
    v = jnp.clip(jnp.arange(count), 0, jnp.maximum(real - 1, 0))
    expert = jnp.minimum(jnp.searchsorted(upto_E, v, side="right"), e - 1).astype(jnp.int32)
    tile = (first_tile[expert] + v - (upto_E[expert] - tiles_E[expert])).astype(jnp.int32)
    return expert, tile, starts, ends, real.astype(jnp.int32)[None]


def _kernel(stack_ref, expert_ref, tile_ref, start_ref, end_ref, real_ref,
            x_ref, gate_ref, up_ref, down_ref, w_ref, out_ref, acc_ref):
    v = pl.program_id(0)
    tile, expert = tile_ref[v], expert_ref[v]

    @pl.when((v == 0) | (tile != tile_ref[jnp.maximum(v - 1, 0)]))
    def _new_tile():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(v < real_ref[0])
    def _visit():
        tm = x_ref.shape[0]
        row = tile * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
        mine = (row >= start_ref[expert]) & (row < end_ref[expert])
        x = x_ref[...]
        h = jax.nn.silu(jnp.dot(x, gate_ref[...], preferred_element_type=jnp.float32)) * (
            jnp.dot(x, up_ref[...], preferred_element_type=jnp.float32))
        h = jnp.where(mine, h, 0.0).astype(down_ref.dtype)
        acc_ref[...] += jnp.dot(h, down_ref[...], preferred_element_type=jnp.float32)

    out_ref[...] = (acc_ref[...] * w_ref[...]).astype(out_ref.dtype)


def grouped_expert_mlp(xs_PD: jax.Array, sizes_E: jax.Array, gate_SEDF: jax.Array,
                       up_SEDF: jax.Array, down_SEFD: jax.Array, stack=0,
                       weights_P: jax.Array | None = None, *,
                       total_experts: int | None = None,
                       expected_experts: int | None = None,
                       interpret: bool = False) -> jax.Array:
    """The TPU kernel: ``out[p] = w[p] · down_e(silu(gate_e(xs[p])) * up_e(xs[p]))`` for
    the row p of each group e, with the experts of entry ``stack`` of the stacked weights.

    Args:
      xs_PD: [P, D] rows sorted by expert: group e is rows ``sum(sizes[:e]) ..``;
        rows past ``sum(sizes)`` are not computed.
      sizes_E: int32 [E] rows per expert (their sum at most P).
      gate_SEDF, up_SEDF: [S, E, D, F]; down_SEFD: [S, E, F, D].
      stack: index (traced) of the stack entry used.
      weights_P: [P] row weights w (default 1), applied in the kernel's last step.
      total_experts: experts over all devices (sizes the tiles; default E).
      expected_experts: experts a pass touches on average, for the cost estimate XLA and
        `tev_jax.costs.op_costs` read (default E).
      interpret: run in Pallas' interpreter (any backend; tests).
    Returns:
      [P, D] in xs's dtype; rows past ``sum(sizes)`` are undefined (tiles no group
      reaches are never written: drop them).
    """
    p, d = xs_PD.shape
    f = gate_SEDF.shape[-1]
    tm, visit, w = _tiling(sizes_E, p, gate_SEDF.shape[1], total_experts, weights_P)
    xs = jnp.pad(xs_PD, ((0, w.shape[0] - p), (0, 0)))
    row_bytes = tm * d * (2 * xs.dtype.itemsize + 4) + 3 * tm * f * 4
    call = pl.pallas_call(
        _kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6, grid=(visit[0].shape[0],),
            in_specs=[pl.BlockSpec((tm, d), _row_block), *_expert_specs(tm, d, f)],
            out_specs=pl.BlockSpec((tm, d), _row_block),
            scratch_shapes=[pltpu.VMEM((tm, d), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct(xs.shape, xs.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",),
            vmem_limit_bytes=2 * (_expert_bytes(gate_SEDF) + row_bytes) + VMEM_MARGIN),
        cost_estimate=_estimate(p, tm, gate_SEDF, total_experts, expected_experts,
                                xs.size * xs.dtype.itemsize),
        interpret=interpret)
    return call(jnp.reshape(stack, (1,)).astype(jnp.int32), *visit, xs, gate_SEDF, up_SEDF,
                down_SEFD, w)[:p]


def _tiling(sizes_E, pairs: int, experts: int, total_experts, weights_P):
    """A kernel call's rows per tile, its visits (`visits`, the grid sized for the worst
    case) and the row weights padded to whole tiles ([tiles · tm, 1] float32)."""
    tm = tile_rows(pairs, total_experts or experts)
    tiles = -(-pairs // tm)
    visit = visits(sizes_E.astype(jnp.int32), tm, tiles + experts - 1)
    w = (jnp.ones((pairs,), jnp.float32) if weights_P is None
         else weights_P.astype(jnp.float32))
    return tm, visit, jnp.pad(w, (0, tiles * tm - pairs))[:, None]


def _row_block(v, g, expert, tile, *_):     # a visit's row tile
    return tile[v], 0


def _expert_block(v, g, expert, *_):        # a visit's expert, in stack entry g
    return g[0], expert[v], 0, 0


def _expert_specs(tm: int, d: int, f: int) -> list:
    """The blocks of a visit's expert (gate, up, down) and of its rows' weights."""
    return [pl.BlockSpec((None, None, d, f), _expert_block),
            pl.BlockSpec((None, None, d, f), _expert_block),
            pl.BlockSpec((None, None, f, d), _expert_block),
            pl.BlockSpec((tm, 1), _row_block)]


def _expert_bytes(gate_SEDF) -> int:
    """One expert's gate, up and down matrices."""
    return 3 * gate_SEDF.shape[-2] * gate_SEDF.shape[-1] * gate_SEDF.dtype.itemsize


def _estimate(pairs: int, tm: int, gate_SEDF, total_experts, expected_experts,
              rows_bytes: int) -> pl.CostEstimate:
    """`cost` of a call over ``pairs`` pairs, this device's share of them visited."""
    _, e, d, f = gate_SEDF.shape
    touched = expected_experts or e
    visited = -(-pairs * e // ((total_experts or e) * tm)) + touched
    return pl.CostEstimate(**cost(visited, tm, d, f, touched, gate_SEDF.dtype.itemsize,
                                  rows_bytes))


def _resident_kernel(stack_ref, expert_ref, tile_ref, start_ref, end_ref, real_ref, token_ref,
                     x_ref, gate_ref, up_ref, down_ref, w_ref, out_ref,
                     x32_ref, rows_ref, acc_ref, sum_ref):
    v, last = pl.program_id(0), pl.num_programs(0) - 1
    tile, expert, real = tile_ref[v], expert_ref[v], real_ref[0]
    tm = rows_ref.shape[0]

    @pl.when(v == 0)
    def _start():
        # float32: Mosaic loads a single row at a dynamic offset only from 32-bit arrays
        x32_ref[...] = x_ref[...].astype(jnp.float32)
        sum_ref[...] = jnp.zeros_like(sum_ref)

    @pl.when((v == 0) | (tile != tile_ref[jnp.maximum(v - 1, 0)]))
    def _new_tile():
        acc_ref[...] = jnp.zeros_like(acc_ref)

        def gather(r, carry):
            rows_ref[pl.ds(r, 1), :] = x32_ref[pl.ds(token_ref[tile * tm + r], 1), :]
            return carry

        jax.lax.fori_loop(0, tm, gather, 0)

    @pl.when(v < real)
    def _visit():
        row = tile * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
        mine = (row >= start_ref[expert]) & (row < end_ref[expert])
        x = rows_ref[...].astype(gate_ref.dtype)
        h = jax.nn.silu(jnp.dot(x, gate_ref[...], preferred_element_type=jnp.float32)) * (
            jnp.dot(x, up_ref[...], preferred_element_type=jnp.float32))
        h = jnp.where(mine, h, 0.0).astype(down_ref.dtype)
        acc_ref[...] += jnp.dot(h, down_ref[...], preferred_element_type=jnp.float32)

    next_tile = tile_ref[jnp.minimum(v + 1, last)]

    @pl.when((v < real) & ((v == real - 1) | (next_tile != tile)))
    def _add_to_tokens():   # the tile's last visit: its rows, weighted, to their tokens
        acc_ref[...] *= w_ref[...]

        def scatter(r, carry):
            t = token_ref[tile * tm + r]
            sum_ref[pl.ds(t, 1), :] += acc_ref[pl.ds(r, 1), :]
            return carry

        jax.lax.fori_loop(0, tm, scatter, 0)

    @pl.when(v == last)
    def _end():
        out_ref[...] = sum_ref[...].astype(out_ref.dtype)


def resident_expert_sum(x_MD: jax.Array, token_P: jax.Array, sizes_E: jax.Array,
                        gate_SEDF: jax.Array, up_SEDF: jax.Array, down_SEFD: jax.Array,
                        stack=0, weights_P: jax.Array | None = None, *,
                        total_experts: int | None = None,
                        expected_experts: int | None = None,
                        interpret: bool = False) -> jax.Array:
    """The TPU kernel with the tokens in VMEM (module docstring): ``out[t] = sum over the
    pairs p of token t (``token[p] = t``) in the groups of w[p] · mlp_e(x[t])``.

    Args:
      x_MD: [M, D] the tokens (`fits_resident`).
      token_P: int32 [P] each pair's token, pairs sorted by expert as in
        `grouped_expert_mlp`; pairs past ``sum(sizes)`` add nothing.
      Others as `grouped_expert_mlp`.
    Returns:
      [M, D] in x's dtype.
    """
    m, d = x_MD.shape
    p, f = token_P.shape[0], gate_SEDF.shape[-1]
    tm, visit, w = _tiling(sizes_E, p, gate_SEDF.shape[1], total_experts, weights_P)
    token = jnp.pad(token_P.astype(jnp.int32), (0, w.shape[0] - p))
    # the tokens and their sums: one block for the whole call, fetched / written once
    whole = pl.BlockSpec((m, d), lambda v, *_: (0, 0), pipeline_mode=pl.Buffered(1))
    vmem = (2 * _expert_bytes(gate_SEDF) + RESIDENT_ENTRY_BYTES * m * d + 8 * tm * d
            + 3 * tm * f * 4 + VMEM_MARGIN)
    call = pl.pallas_call(
        _resident_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=7, grid=(visit[0].shape[0],),
            in_specs=[whole, *_expert_specs(tm, d, f)],
            out_specs=whole,
            scratch_shapes=[pltpu.VMEM((m, d), jnp.float32),
                            pltpu.VMEM((tm, d), jnp.float32),
                            pltpu.VMEM((tm, d), jnp.float32),
                            pltpu.VMEM((m, d), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct((m, d), x_MD.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                             vmem_limit_bytes=vmem),
        cost_estimate=_estimate(p, tm, gate_SEDF, total_experts, expected_experts,
                                x_MD.size * x_MD.dtype.itemsize + w.size * 4),
        interpret=interpret)
    return call(jnp.reshape(stack, (1,)).astype(jnp.int32), *visit, token, x_MD, gate_SEDF,
                up_SEDF, down_SEFD, w)


def ragged_expert_mlp(xs_PD: jax.Array, sizes_E: jax.Array, gate_SEDF: jax.Array,
                      up_SEDF: jax.Array, down_SEFD: jax.Array, stack=0,
                      weights_P: jax.Array | None = None) -> jax.Array:
    """`grouped_expert_mlp` through ``jax.lax.ragged_dot`` (XLA, any platform; the stack
    entry is sliced out first). Rows past ``sum(sizes)`` are zeros."""
    gate, up, down = (jax.lax.dynamic_index_in_dim(a, stack, keepdims=False)
                      for a in (gate_SEDF, up_SEDF, down_SEFD))
    h = jax.nn.silu(jax.lax.ragged_dot(xs_PD, gate, sizes_E)) * jax.lax.ragged_dot(
        xs_PD, up, sizes_E)
    o = jax.lax.ragged_dot(h, down, sizes_E)
    return o if weights_P is None else o * weights_P[:, None].astype(o.dtype)


def reference_expert_mlp(xs_PD: jax.Array, sizes_E: jax.Array, gate_SEDF: jax.Array,
                         up_SEDF: jax.Array, down_SEFD: jax.Array, stack=0,
                         weights_P: jax.Array | None = None) -> jax.Array:
    """`grouped_expert_mlp` in plain jnp, row by row: each row's expert gathered, its MLP
    computed in float32. Rows past ``sum(sizes)`` are zeros."""
    p = xs_PD.shape[0]
    gate, up, down = (jax.lax.dynamic_index_in_dim(a, stack, keepdims=False)
                      .astype(jnp.float32) for a in (gate_SEDF, up_SEDF, down_SEFD))
    ends = jnp.cumsum(sizes_E)
    row = jnp.arange(p)
    expert = jnp.minimum(jnp.searchsorted(ends, row, side="right"), sizes_E.shape[0] - 1)
    x = xs_PD.astype(jnp.float32)
    h = jax.nn.silu(jnp.einsum("pd,pdf->pf", x, gate[expert])) * jnp.einsum(
        "pd,pdf->pf", x, up[expert])
    o = jnp.einsum("pf,pfd->pd", h, down[expert])
    w = jnp.ones((p,), jnp.float32) if weights_P is None else weights_P.astype(jnp.float32)
    return jnp.where((row < ends[-1])[:, None], o * w[:, None], 0.0).astype(xs_PD.dtype)


def expert_sum(x_MD: jax.Array, token_P: jax.Array, sizes_E: jax.Array,
               gate_SEDF: jax.Array, up_SEDF: jax.Array, down_SEFD: jax.Array, stack=0,
               weights_P: jax.Array | None = None, *, method: str = "grouped",
               total_experts: int | None = None,
               expected_experts: int | None = None) -> jax.Array:
    """The experts' weighted outputs summed per token ([M, D], `resident_expert_sum`'s
    contract) for pairs sorted by expert: ``method`` 'grouped' (the TPU kernels when the
    program is lowered for TPU, interpreted elsewhere: `resident_expert_sum` when the
    tokens fit VMEM, else the pairs' rows gathered for `grouped_expert_mlp` and added
    back), 'ragged' (`ragged_expert_mlp`) or 'reference'.
    """
    if method not in METHODS:
        raise ValueError(f"grouped experts method must be one of {METHODS}, got {method!r}")
    m, d = x_MD.shape
    args = (sizes_E, gate_SEDF, up_SEDF, down_SEFD, jnp.asarray(stack, jnp.int32), weights_P)

    def on_tpu(kernel, *operands):   # the Mosaic kernel on TPU, interpreted elsewhere
        def call(interpret):
            return lambda *a: kernel(*a, total_experts=total_experts,
                                     expected_experts=expected_experts, interpret=interpret)
        return jax.lax.platform_dependent(*operands, tpu=call(False), default=call(True))

    if method == "grouped" and fits_resident(m, d):
        return on_tpu(resident_expert_sum, x_MD, token_P, *args)
    if method == "grouped":
        o = on_tpu(grouped_expert_mlp, x_MD[token_P], *args)
    else:
        mlp = ragged_expert_mlp if method == "ragged" else reference_expert_mlp
        o = mlp(x_MD[token_P], *args)
    # rows past the pairs held here (other devices' experts) are dropped
    token = jnp.where(jnp.arange(token_P.shape[0]) < jnp.sum(sizes_E), token_P, m)
    return jnp.zeros((m, d), o.dtype).at[token].add(o, mode="drop")
