"""Reductions and draws over the vocabulary, and their placement on a mesh.

Every pass over [..., V] logits in the library goes through here: the target's
log-weights (`Scores`), the one fused pass that gives per-block masses
(`block_masses`), its uses (`log_normalizer`, `inverse_cdf`, `sample_token`), the
two-stage `argmax`, the exact top-k of a vocabulary sharded over a mesh (`vocab_top_k`)
and the XLA:CPU scheduling barrier they share (`cpu_barrier`). The blocks of 128
entries keep XLA:CPU's reductions fast (docs/design.md §5, experiments/verifier_latency).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec

from tev_jax.sampling import Sampling, SamplingRows, log_probs, row_cut
from tev_jax.sharding import logical_to_spec, mesh_axis_size


@struct.dataclass
class Scores:
    """Target log-weights ``z = x * scale`` with ``p = softmax(z)`` per row.

    ``z`` is never materialised for a plain temperature: each consumer applies the
    scale to what it reads from ``x``. Every exact verifier reads the [N, V] logits
    through ``block_masses`` only (plus gathers of a few 128-token blocks), so XLA
    emits one fused kernel for the pass over the logits: row max, exp, block sums. A
    row max or a shared ``z`` array needed elsewhere would cost a second pass over the
    logits (or a written [N, V] buffer) on XLA:CPU.

    At T = 0 ``p`` is one-hot at each row's argmax, held as ``top``: the consumers read
    it instead of ``x``, so nothing of size [N, V] is written (a materialised one-hot was
    12 % of a Qwen3-8B round's HBM bytes, experiments/round_bytes).

    Attributes:
      x: [..., V] logits (raw, or already transformed for top-k / top-p).
      scale: static 1 / T (1 when ``x`` is already transformed).
      top: int32 [...], the argmax of each row at T = 0 (then ``x`` is not read), else
        None.
    """

    x: jax.Array
    scale: float = struct.field(pytree_node=False)
    top: jax.Array | None = None

    def take(self, rows, cols) -> jax.Array:
        """``x[rows, cols]`` (broadcast together); at T = 0 the one-hot's log: 0 at each
        row's top token, -inf elsewhere."""
        if self.top is None:
            return self.x[rows, cols]
        return jnp.where(cols == self.top[rows], 0.0, -jnp.inf)


def target_scores(logits_NV: jax.Array, sampling: Sampling) -> Scores:
    """The target's log-weights for ``sampling``: unmaterialised for a plain temperature,
    the argmax per row at T = 0, the materialised ``sampling.log_probs`` with top-k or
    top-p."""
    logits = logits_NV.astype(jnp.float32)
    if sampling.greedy:
        top = argmax(logits.reshape(-1, logits.shape[-1])).reshape(logits.shape[:-1])
        return Scores(logits, 1.0, top)
    if sampling.top_k is not None or sampling.top_p is not None:
        return Scores(log_probs(logits, sampling), 1.0)
    return Scores(logits, 1.0 / sampling.temperature)


def row_scores(logits_BXV: jax.Array, rows: SamplingRows) -> Scores:
    """The target's log-weights with each row's own setting (`tev_jax.sampling.PER_ROW`):
    ``Scores(z, 1)`` with, for row b, ``softmax(z[b])`` the distribution of
    ``target_scores(logits[b], rows.setting(b))``: one-hot at the argmax where the
    temperature is 0, else the logits over the temperature, cut by `row_cut` where some
    row of the batch asks for a top-k or a top-p (a ``lax.cond``: a batch without one
    sorts nothing). Unlike the static settings it writes ``z`` ([B, ..., V] float32): a
    pass over the logits and a buffer of their size per call.

    Args:
      logits_BXV: [B, ..., V] target logits, rows first.
      rows: `SamplingRows` with fields [B].
    """
    x = logits_BXV.astype(jnp.float32)
    lead, vocab = x.shape[:-1], x.shape[-1]
    per_row = lambda a: a.reshape((-1,) + (1,) * len(lead))
    t = per_row(rows.temperature)
    top = argmax(x.reshape(-1, vocab)).reshape(lead)
    hot = jnp.where(jnp.arange(vocab) == top[..., None], 0.0, -jnp.inf)
    z = jnp.where(t > 0, x / jnp.where(t > 0, t, 1.0), hot)
    cut_B = (rows.temperature > 0) & (((rows.top_k > 0) & (rows.top_k < vocab))
                                      | (rows.top_p < 1))
    z = jax.lax.cond(jnp.any(cut_B),
                     lambda z: jnp.where(per_row(cut_B), row_cut(z, rows.top_k, rows.top_p), z),
                     lambda z: z, z)
    return Scores(z, 1.0)


BLOCK = 128  # vocabulary block of the two-stage reductions (see block_masses)


def _blocks(x: jax.Array, block: int):
    """[..., V] -> ([..., V // block, block] full blocks, [..., V % block] tail)."""
    *lead, vocab = x.shape
    n_full = vocab // block
    return x[..., : n_full * block].reshape(*lead, n_full, block), x[..., n_full * block :]


def block_masses(scores: Scores, block: int = BLOCK) -> jax.Array:
    """Masses ``sum exp((x - max x) * scale)`` of consecutive vocabulary blocks.

    float32 [..., ceil(V / block)], in units of each row's largest weight (the row
    max stays inside the kernel). Every row needs a finite maximum. This is the one
    pass over the logits: XLA:CPU fuses the row max, the exp and the block sums into
    one kernel. The optimization barrier (XLA:CPU only, `cpu_barrier`) stops XLA from merging the block sums with a
    following row sum into one long-row reduction, which XLA:CPU ran 3.4x slower on
    [8, 65, 151 936]; blocks of 256 or more were ~4x slower than 128 (see
    experiments/verifier_latency).
    """
    x, scale = scores.x, jnp.float32(scores.scale)
    block = min(block, x.shape[-1])
    if scores.top is not None:   # T = 0: all the mass in the top token's block
        num_blocks = -(-x.shape[-1] // block)
        return (jnp.arange(num_blocks) == (scores.top // block)[..., None]).astype(jnp.float32)
    m = jnp.max(x, axis=-1)
    sub = _aligned_block(x, block)
    full, tail = _blocks(x, sub)
    mass = jnp.sum(jnp.exp((full - m[..., None, None]) * scale), axis=-1)
    if tail.shape[-1]:
        tail_mass = jnp.sum(jnp.exp((tail - m[..., None]) * scale), axis=-1, keepdims=True)
        mass = jnp.concatenate([mass, tail_mass], axis=-1)
    if sub != block:  # sub-block masses (one per shard's slice) -> block masses
        full, tail = _blocks(mass, block // sub)
        mass = jnp.sum(full, axis=-1)
        if tail.shape[-1]:
            mass = jnp.concatenate([mass, jnp.sum(tail, axis=-1, keepdims=True)], axis=-1)
    return cpu_barrier(mass)


def _aligned_block(x: jax.Array, block: int) -> int:
    """``block``, or the largest divisor of it that tiles each shard's slice of a
    vocabulary sharded on the active mesh.

    Blocks that straddle shards (151 936 / 8 is not a multiple of 128) make the SPMD
    partitioner gather the whole [..., V] float32 weights onto every device (the Qwen3-8B
    round's temporaries on 8 GPUs: 0.43 GB, of which 0.32 GB is that gather); masses of
    shard-aligned sub-blocks are summed locally and only they (``block / sub`` times
    fewer entries) move.
    """
    shards = mesh_axis_size(("act_vocab",))
    if shards == 1 or _vocab_spec(x, ()) is None or (x.shape[-1] // shards) % block == 0:
        return block
    return math.gcd(block, x.shape[-1] // shards)


def log_normalizer(scores: Scores) -> jax.Array:
    """``log sum_y exp((x_y - max x) * scale)`` per row; float32 [...].

    The log-normaliser relative to the row maximum (the benchmark's floor).
    """
    return jnp.log(jnp.sum(block_masses(scores), axis=-1))


def gather_blocks(scores: Scores, rows_R: jax.Array, block_R: jax.Array, block: int):
    """Vocabulary block ``block_R[r]`` (``block`` wide) of row ``rows_R[r]`` of
    ``scores.x`` (`Scores.take`); [R, block], -inf past the end of the vocabulary. One
    gather of R x block entries."""
    vocab = scores.x.shape[-1]
    idx_RK = block_R[:, None] * block + jnp.arange(block)[None, :]
    x_RK = scores.take(rows_R[:, None], jnp.minimum(idx_RK, vocab - 1))
    return jnp.where(idx_RK < vocab, x_RK, -jnp.inf)


def uniform(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Uniforms on the grid ``k / 2^24``, k = 0 .. 2^24 - 1 (exact in float32, < 1)."""
    bits = jax.random.bits(key, shape, jnp.uint32)
    return (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def first_above(cum_RK: jax.Array, t_R: jax.Array, mass_RK: jax.Array) -> jax.Array:
    """Index of the first entry with ``cum > t`` in each row, never one with zero mass.

    If rounding puts ``t`` at or past the row total, the last entry with mass is taken.
    Zero-mass entries never raise ``cum``, so they are never the first above ``t``.
    """
    k = jnp.sum(cum_RK <= t_R[:, None], axis=-1)
    size = mass_RK.shape[-1]
    last = size - 1 - jnp.argmax((mass_RK > 0)[:, ::-1], axis=-1)
    return jnp.minimum(k, last).astype(jnp.int32)


def inverse_cdf(u_R: jax.Array, scores: Scores, block: int = BLOCK) -> jax.Array:
    """Token ``y ~ softmax(z)`` per row by a blocked inverse-CDF search; int32 [R].

    ``block_masses`` (the one pass over the logits) gives per-block masses; the block
    holding ``u * total`` is found by a cumulative sum over blocks, then the token
    inside it by a cumulative sum over that block's gathered entries, searched at the
    same fraction of the block's mass (so the row max is never needed outside the
    kernel). The logits are read once plus ``R * block`` gathered entries; Gumbel-max
    needs R x V random numbers, a plain inverse CDF an [R, V] cumulative sum.

    Args:
      u_R: [R] uniforms in [0, 1).
      scores: the rows' log-weights ``z = x * scale``; every row needs a finite max.
      block: vocabulary block size.
    """
    if scores.top is not None:   # T = 0: the one-hot's only token
        return scores.top.astype(jnp.int32)
    x_RV, scale = scores.x, jnp.float32(scores.scale)
    block = min(block, x_RV.shape[-1])
    mass_RB = block_masses(scores, block)
    cum_RB = jnp.cumsum(mass_RB, axis=-1)
    t_R = u_R * cum_RB[:, -1]
    blk_R = first_above(cum_RB, t_R, mass_RB)
    take = lambda a_RB, i_R: jnp.take_along_axis(a_RB, i_R[:, None], axis=-1)[:, 0]
    before_R = jnp.where(blk_R > 0, take(cum_RB, jnp.maximum(blk_R - 1, 0)), 0.0)
    frac_R = (t_R - before_R) / take(mass_RB, blk_R)
    seg_RK = gather_blocks(scores, jnp.arange(x_RV.shape[0]), blk_R, block)
    seg_mass_RK = jnp.exp((seg_RK - jnp.max(seg_RK, axis=-1, keepdims=True)) * scale)
    seg_cum_RK = jnp.cumsum(seg_mass_RK, axis=-1)
    pos_R = first_above(seg_cum_RK, frac_R * seg_cum_RK[:, -1], seg_mass_RK)
    return blk_R * block + pos_R


def argmax(x_RV: jax.Array, block: int = BLOCK) -> jax.Array:
    """``jnp.argmax(x, -1)`` (lowest index on ties) in two stages; int32 [R].

    Block maxima first, then the first block holding the row maximum, then the first
    maximum inside it. XLA:CPU's one-stage argmax (a variadic reduction) is ~7x slower
    on [65, 151 936] logits. With the vocabulary sharded on the active mesh it is the
    exact top-1 of `vocab_top_k` (per shard, then over the shards' winners): blocks
    that straddle shards (151 936 / 8 is not a multiple of 128) would gather the logits.
    """
    if _vocab_spec(x_RV, ()) is not None:
        return vocab_top_k(x_RV, 1)[1][..., 0]
    rows, vocab = x_RV.shape
    block = min(block, vocab)
    n_full, rem = divmod(vocab, block)
    x_RV = x_RV.astype(jnp.float32)
    best_RB = jnp.max(x_RV[:, : n_full * block].reshape(rows, n_full, block), axis=-1)
    if rem:
        tail = jnp.max(x_RV[:, n_full * block :], axis=-1, keepdims=True)
        best_RB = jnp.concatenate([best_RB, tail], axis=-1)
    blk_R = jnp.argmax(cpu_barrier(best_RB), axis=-1)
    idx_RK = blk_R[:, None] * block + jnp.arange(block)[None, :]
    x_RK = jnp.take_along_axis(x_RV, jnp.minimum(idx_RK, vocab - 1), axis=-1)
    x_RK = jnp.where(idx_RK < vocab, x_RK, -jnp.inf)
    return (blk_R * block + jnp.argmax(x_RK, axis=-1)).astype(jnp.int32)


def _vocab_spec(x: jax.Array, lead_names: Sequence[str | None]) -> PartitionSpec | None:
    """The spec of ``x`` [..., V] when its vocabulary axis is sharded, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    names = tuple(lead_names) + (None,) * (x.ndim - 1 - len(lead_names)) + ("act_vocab",)
    spec = logical_to_spec(names, x.shape, mesh)
    spec = tuple(spec) + (None,) * (x.ndim - len(spec))
    return PartitionSpec(*spec) if spec[-1] is not None else None


def _spec_axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def cpu_barrier(x, *, vocab_sharded: bool = False):
    """``lax.optimization_barrier(x)`` on the CPU backend, else ``x``.

    The kernels use it to stop XLA:CPU from fusing a reduction into a slower form
    (docs/design.md §5, experiments/verifier_latency). It is skipped on other backends,
    where it only constrains scheduling, and whenever the operand's vocabulary axis is
    sharded (``vocab_sharded``, or a tensor axis on the active mesh), where XLA's SPMD
    partitioner aborts on it.
    """
    if jax.default_backend() != "cpu" or vocab_sharded or mesh_axis_size(("act_vocab",)) > 1:
        return x
    return jax.lax.optimization_barrier(x)


TOP_K_WIDTH = 2048
"""Widest row one top-k sorts on GPU (see `top_k`)."""


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``lax.top_k(x, k)``; on GPU in blocks of `TOP_K_WIDTH` entries when k > 16, on
    TPU a max and an argmax at k = 1.

    The GPU compiler turns a top-k with k > 16 into a sort of the whole row, which for
    long rows (a vocabulary shard: [120, 18 992] in a Qwen3-8B round on 8 GPUs) it
    hands to CUB's radix sort, and without a GPU at hand it cannot size that sort's
    scratch and falls back to a slower sort. The top-k of each block, then the top-k
    of the blocks' winners, is the same result (ties: smaller index first, as blocks
    and their winners are in index order) from sorts of at most `TOP_K_WIDTH` entries.
    Other backends keep their own top-k (XLA:CPU's is ~6x faster than the blocked one).
    """
    if k == 1:
        return jax.lax.platform_dependent(x, tpu=_top_1,
                                          default=lambda x: tuple(jax.lax.top_k(x, 1)))
    if x.shape[-1] <= TOP_K_WIDTH or k <= 16 or 2 * k > TOP_K_WIDTH:
        return jax.lax.top_k(x, k)
    return jax.lax.platform_dependent(x, cuda=lambda x: _blocked_top_k(x, k),
                                      default=lambda x: tuple(jax.lax.top_k(x, k)))


def _top_1(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`top_k` at k = 1 as a max and an argmax (first index on ties): TPU's compiler sorts
    the row for ``lax.top_k`` even then (a round's greedy check on Qwen3-Coder-30B-A3B
    at B 32: 0.8 GB per round for [32, 33, 37 984] logits)."""
    return (jnp.max(x, axis=-1, keepdims=True),
            jnp.argmax(x, axis=-1, keepdims=True).astype(jnp.int32))


def _blocked_top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    *lead, vocab = x.shape
    if vocab <= TOP_K_WIDTH:
        return tuple(jax.lax.top_k(x, k))
    n = -(-vocab // TOP_K_WIDTH)
    pad = [(0, 0)] * len(lead) + [(0, n * TOP_K_WIDTH - vocab)]
    x_nW = jnp.pad(x, pad, constant_values=-jnp.inf).reshape(*lead, n, TOP_K_WIDTH)
    values, idx = jax.lax.top_k(x_nW, k)
    idx = idx + (jnp.arange(n, dtype=idx.dtype) * TOP_K_WIDTH)[:, None]
    values, pick = _blocked_top_k(values.reshape(*lead, n * k), k)
    return values, jnp.take_along_axis(idx.reshape(*lead, n * k), pick, axis=-1)


def vocab_top_k(x: jax.Array, k: int, lead_names: Sequence[str | None] = ()
                ) -> tuple[jax.Array, jax.Array]:
    """``lax.top_k(x, k)`` over the last (vocabulary) axis, exact under any mesh.

    When the active mesh shards the vocabulary (logical ``act_vocab``), each shard takes
    the top-k of its own slice (`jax.shard_map`), and the merge takes the top-k of the
    shards' winners: only ``shards * k`` candidates per row move between devices. Ties
    keep the smaller index first, as ``lax.top_k`` does: shard winners are listed in
    shard (= index) order.

    Args:
      x: [..., V].
      k: static, 1 <= k <= V (above V / shards the row is gathered: it is small).
      lead_names: logical names of the leading axes (e.g. ``("batch", None)``), so that
        their sharding is kept inside the per-shard computation.
    Returns:
      (values [..., k], int32 indices [..., k]).
    """
    spec = _vocab_spec(x, lead_names)
    if spec is None:
        values, idx = top_k(x, k)
        values, idx = cpu_barrier((values, idx))
        return values, idx.astype(jnp.int32)
    vocab_axes = _spec_axes(spec[-1])
    width = x.shape[-1] // mesh_axis_size(("act_vocab",))
    if k > width:  # a tiny vocabulary over many shards: the whole row is small anyway
        values, idx = jax.lax.top_k(x, k)
        return values, idx.astype(jnp.int32)

    def local(x_loc):
        values, idx = top_k(x_loc, k)
        shard = jnp.zeros((), jnp.int32)
        for ax in vocab_axes:  # row-major shard index over the vocabulary's mesh axes
            shard = shard * jax.lax.axis_size(ax) + jax.lax.axis_index(ax)
        return values, idx.astype(jnp.int32) + shard * width

    manual = {a for entry in spec for a in _spec_axes(entry)}
    values, idx = jax.shard_map(local, in_specs=spec, out_specs=(spec, spec),
                                axis_names=manual)(x)
    values, pick = jax.lax.top_k(values, k)
    return values, jnp.take_along_axis(idx, pick, axis=-1)


def embed_rows(table_VD: jax.Array, ids: jax.Array) -> jax.Array:
    """``table_VD[ids]`` ([*ids.shape, D]), exact, without gathering a table whose
    vocabulary axis is sharded on the active mesh.

    A plain ``jnp.take`` on a vocabulary-sharded embedding table lets the SPMD partitioner
    choose how to gather, and the GPU compiler all-gathers the whole table for some batch
    sizes (Qwen3-8B on 8 GPUs, an AR step at B 1 or 64: 1.56 GB moved and 1.16 GiB of
    temporaries per step). Here each shard looks up the ids in its own rows (zeros for the
    others) and the shards' rows are summed (one all-reduce of [..., D]): every id has one
    owner and ``x + 0 = x``, so the rows are exact. The table's other axis (``embed``,
    fsdp) is gathered inside, as an fsdp layer does with its weights.

    Args:
      table_VD: [V, D], sharded by the logical axes ('vocab', 'embed').
      ids: int [B, ...] in [0, V), the leading axis a batch ('batch').
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return jnp.take(table_VD, ids, axis=0)
    table_spec = logical_to_spec(("vocab", "embed"), table_VD.shape, mesh)
    table_spec = tuple(table_spec) + (None,) * (2 - len(table_spec))
    if table_spec[0] is None:
        return jnp.take(table_VD, ids, axis=0)
    ids_spec = logical_to_spec(("batch",) + (None,) * (ids.ndim - 1), ids.shape, mesh)
    ids_spec = tuple(ids_spec) + (None,) * (ids.ndim - len(ids_spec))
    vocab_axes, embed_axes = _spec_axes(table_spec[0]), _spec_axes(table_spec[1])
    rows = table_VD.shape[0] // mesh_axis_size(("vocab",))

    def local(table_loc, ids_loc):
        for ax in embed_axes:
            table_loc = jax.lax.all_gather(table_loc, ax, axis=1, tiled=True)
        shard = jnp.zeros((), jnp.int32)
        for ax in vocab_axes:  # row-major shard index over the vocabulary's mesh axes
            shard = shard * jax.lax.axis_size(ax) + jax.lax.axis_index(ax)
        idx = ids_loc - shard * rows
        mine = (idx >= 0) & (idx < rows)
        x = jnp.take(table_loc, jnp.where(mine, idx, 0), axis=0)
        x = jnp.where(mine[..., None], x.astype(jnp.float32), 0.0)
        # summed in float32 (exact: one row and zeros; XLA:CPU aborts on a bf16 psum here)
        return jax.lax.psum(x, vocab_axes).astype(table_VD.dtype)

    manual = {a for entry in (*table_spec, *ids_spec) for a in _spec_axes(entry)}
    specs = (PartitionSpec(*table_spec), PartitionSpec(*ids_spec))
    return jax.shard_map(local, in_specs=specs, out_specs=PartitionSpec(*ids_spec, None),
                         axis_names=manual)(table_VD, ids)


def sample_token(keys_B: jax.Array, logits_BV: jax.Array,
                 sampling: Sampling | SamplingRows) -> jax.Array:
    """One token per row from ``softmax(transform(logits))``, row b's from its own key
    ``keys_B[b]``; int32 [B]. Argmax at T = 0. ``sampling``: one setting for every row,
    or each row's (`tev_jax.sampling.SamplingRows`, `row_scores`).

    Uses the verifiers' samplers: their two-stage argmax, and one uniform per row with
    the blocked inverse-CDF search (cheaper on CPU than Gumbel-max, which draws V random
    numbers per row).
    """
    if isinstance(sampling, SamplingRows):
        scores = row_scores(logits_BV, sampling)   # greedy rows: one-hot, so the argmax
        return inverse_cdf(jax.vmap(lambda k: uniform(k, ()))(keys_B), scores)
    if sampling.greedy:
        return argmax(logits_BV)
    scores = target_scores(logits_BV, sampling)
    return inverse_cdf(jax.vmap(lambda k: uniform(k, ()))(keys_B), scores)


__all__ = ["BLOCK", "Scores", "argmax", "block_masses", "cpu_barrier", "embed_rows",
           "first_above", "gather_blocks", "inverse_cdf", "log_normalizer", "row_scores",
           "sample_token", "target_scores", "top_k", "uniform", "vocab_top_k"]
