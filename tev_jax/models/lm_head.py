"""The frozen LM head over vocabulary blocks: reductions of ``hidden @ W`` rows that never
hold a whole [rows, V] logits array (docs/design.md §12).

Training reads the target's head on many rows at once: the drafter's B·A·H draft rows
(token cross-entropy, exit loss, the tree builder's top-K) and the scoring pass's B·A·N
tree nodes (the exit law). Each of those needs only a few numbers per row, so the head
matmul runs one block of V_b vocabulary entries at a time inside a ``lax.scan``, with
an online logsumexp (running max and rescaled sum), a running top-K, or a gather of a
few head columns::

    logsumexp(h, head)     log sum_v exp(scale * h . w_v)       [..]   custom_vjp (to h)
    logits_at(h, head, y)  h . w_y                              [..]   plain autodiff
    top_k(h, head, k)      the k largest h . w_v, their ids, lse [.., k]  no gradient

A soft-capped head (Gemma 4: ``c * tanh(h . w / c)``, `Head.softcap`) caps every block's
logits first, so all three see the target's distribution.

Peak scratch is one [rows, V_b] block instead of [rows, V]; with the head sharded over
fsdp only one block of it is gathered at a time. V need not be a multiple of V_b: the
last block starts at ``V - V_b`` and masks the entries an earlier block counted.

`DenseRows` and `HeadRows` give the losses one interface to rows of logits, materialised
(tests, the dense reference) or as hidden states plus the head.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from tev_jax.vocab import cpu_barrier

BLOCK = 8192  # vocabulary entries per block: [rows, 8192] float32 is 32 KiB per row


@struct.dataclass
class Head:
    """The LM head matrix as the target stores it.

    Attributes:
      w: [V, D] (tied embedding, ``vocab_major``) or [D, V] (``lm_head``).
      vocab_major: static, which of the two layouts ``w`` has.
      softcap: static, the final logit soft-cap c (logits ``c * tanh(x / c)``) or None.
      multiplier: static, m: the logits are ``m * h . w`` (before the cap).
    """

    w: jax.Array
    vocab_major: bool = struct.field(pytree_node=False)
    softcap: float | None = struct.field(pytree_node=False, default=None)
    multiplier: float = struct.field(pytree_node=False, default=1.0)

    @property
    def vocab(self) -> int:
        return self.w.shape[0 if self.vocab_major else 1]


def head_of(target) -> Head:
    """The `Head` that `Target.unembed` multiplies by (the embedding when tied)."""
    cap = target.config.final_logit_softcap
    if target.lm_head is None:
        return Head(target.embed_tokens[...], True, cap)
    return Head(target.lm_head[...], False, cap)


def _capped(x, head: Head):
    return x if head.softcap is None else head.softcap * jnp.tanh(x / head.softcap)


def _num_blocks(vocab: int, block: int) -> tuple[int, int]:
    block = min(block, vocab)
    return -(-vocab // block), block


def _block_logits(h_XD: jax.Array, head: Head, i, block: int):
    """float32 logits [..., block] of block ``i`` (entries ``start .. start + block``),
    their ids [block], whether each id is new to this block (not in block i-1), and
    the block of the head."""
    start = jnp.minimum(i * block, head.vocab - block)
    axis = 0 if head.vocab_major else 1
    w = jax.lax.dynamic_slice_in_dim(head.w, start, block, axis=axis)
    spec = "...d,vd->...v" if head.vocab_major else "...d,dv->...v"
    x = jnp.einsum(spec, h_XD.astype(w.dtype), w, preferred_element_type=jnp.float32)
    ids = start + jnp.arange(block)
    x = x.astype(jnp.float32) * head.multiplier
    return _capped(x, head), ids, ids >= i * block, w


def _lse_forward(h_XD, head: Head, scale: float, block: int) -> jax.Array:
    n, block = _num_blocks(head.vocab, block)
    lead = h_XD.shape[:-1]

    def body(carry, i):
        m, s = carry
        x, _, fresh, _ = _block_logits(h_XD, head, i, block)
        z = jnp.where(fresh, x * scale, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(z, axis=-1))
        s = (jnp.where(m > -jnp.inf, s * jnp.exp(m - m_new), 0.0)
             + jnp.sum(jnp.exp(z - m_new[..., None]), axis=-1))
        return (m_new, s), None

    init = (jnp.full(lead, -jnp.inf, jnp.float32), jnp.zeros(lead, jnp.float32))
    (m, s), _ = jax.lax.scan(body, init, jnp.arange(n))
    return m + jnp.log(s)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _lse(h_XD, head: Head, scale: float, block: int) -> jax.Array:
    return _lse_forward(h_XD, head, scale, block)


def _lse_fwd(h_XD, head, scale, block):
    lse = _lse_forward(h_XD, head, scale, block)
    return lse, (h_XD, head, lse)


def _lse_bwd(scale, block, res, g):
    """d lse / d h = scale * sum_v softmax_v w_v, accumulated block by block."""
    h_XD, head, lse = res
    n, block = _num_blocks(head.vocab, block)
    spec = "...v,vd->...d" if head.vocab_major else "...v,dv->...d"

    def body(acc, i):
        x, _, fresh, w = _block_logits(h_XD, head, i, block)
        p = jnp.where(fresh, jnp.exp(x * scale - lse[..., None]), 0.0)
        if head.softcap is not None:  # d(c tanh(u / c)) / du = 1 - tanh^2
            p = p * (1.0 - jnp.square(x / head.softcap))
        return acc + jnp.einsum(spec, p, w.astype(jnp.float32)), None

    acc, _ = jax.lax.scan(body, jnp.zeros(h_XD.shape, jnp.float32), jnp.arange(n))
    dh = (g[..., None] * scale * head.multiplier * acc).astype(h_XD.dtype)
    return dh, jax.tree.map(jnp.zeros_like, head)


_lse.defvjp(_lse_fwd, _lse_bwd)


def logsumexp(h_XD: jax.Array, head: Head, scale: float = 1.0, block: int = BLOCK
              ) -> jax.Array:
    """``logsumexp_v(scale * h . w_v)`` per row without the [.., V] logits; float32 [...].

    Equals ``jax.nn.logsumexp(scale * unembed(h))`` up to float rounding; differentiable
    in ``h`` (the head is frozen: its cotangent is zero).

    Args:
      h_XD: [..., D] final-normed hidden states.
      head: the `Head`.
      scale: static multiplier of the logits (1 / temperature).
      block: vocabulary entries per block (static).
    """
    return _lse(h_XD, head, float(scale), int(block))


def logits_at(h_XD: jax.Array, head: Head, tokens_X: jax.Array) -> jax.Array:
    """The logit of token ``tokens[x]`` in row x, ``h[x] . w_tokens[x]`` (soft-capped
    with the head's cap); float32 [...].

    Gathers one head column per row (rows x D), never a row of logits.
    """
    tokens = tokens_X.astype(jnp.int32)
    if head.vocab_major:
        w_XD = jnp.take(head.w, tokens, axis=0)
    else:
        w_XD = jnp.moveaxis(jnp.take(head.w, tokens, axis=1), 0, -1)
    h = h_XD.astype(head.w.dtype)
    return _capped(jnp.einsum("...d,...d->...", h, w_XD, preferred_element_type=jnp.float32
                              ).astype(jnp.float32), head)


def top_k(h_XD: jax.Array, head: Head, k: int, block: int = BLOCK):
    """The k largest logits of every row, their token ids and the row's logsumexp.

    A local top-k per vocabulary block, then one top-k of the n_blocks * k winners.
    Rows come out sorted by logit descending and equal logits by token id ascending,
    as ``jax.lax.top_k`` over the whole row orders them (``-0.0`` counts as ``+0.0``,
    like `tev_jax.ddtree.topk_logq`). No gradient.

    Args:
      h_XD: [..., D] final-normed hidden states.
      k: static, 1 <= k <= min(block, V).
    Returns:
      (values float32 [..., k], ids int32 [..., k], lse float32 [...])
    """
    n, block = _num_blocks(head.vocab, block)
    if not 1 <= k <= block:
        raise ValueError(f"top_k needs 1 <= k <= {block} (the block), got k={k}")
    h_XD = jax.lax.stop_gradient(h_XD)
    lead = h_XD.shape[:-1]

    def body(carry, i):
        m, s = carry
        x, ids, fresh, _ = _block_logits(h_XD, head, i, block)
        x = jnp.where(fresh, jnp.where(x == 0, jnp.float32(0), x), -jnp.inf)
        # The barrier (CPU only, never on a vocabulary-sharded operand) keeps XLA:CPU
        # from rewriting top_k into a full sort of the block when its outputs are
        # computed on (as in `tev_jax.ddtree.topk_logq`).
        vals, pos = cpu_barrier(jax.lax.top_k(x, k))
        m_new = jnp.maximum(m, vals[..., 0])
        s = (jnp.where(m > -jnp.inf, s * jnp.exp(m - m_new), 0.0)
             + jnp.sum(jnp.exp(x - m_new[..., None]), axis=-1))
        return (m_new, s), (vals, ids[pos])

    init = (jnp.full(lead, -jnp.inf, jnp.float32), jnp.zeros(lead, jnp.float32))
    (m, s), (vals_nXk, ids_nXk) = jax.lax.scan(body, init, jnp.arange(n))
    # Candidates in block order: equal logits stay ordered by token id.
    cand = jnp.moveaxis(vals_nXk, 0, -2).reshape(lead + (n * k,))
    cand_ids = jnp.moveaxis(ids_nXk, 0, -2).reshape(lead + (n * k,))
    vals, pos = jax.lax.top_k(cand, k)
    vals, pos = cpu_barrier((vals, pos))
    return vals, jnp.take_along_axis(cand_ids, pos, axis=-1).astype(jnp.int32), m + jnp.log(s)


# ------------------------------------------------------------------- rows of logits


@struct.dataclass
class DenseRows:
    """Rows of materialised logits [*X, H, V] (the dense reference path)."""

    logits: jax.Array

    @property
    def lse(self) -> jax.Array:
        """float32 [*X, H] log-normaliser of every row."""
        return jax.nn.logsumexp(self.logits.astype(jnp.float32), axis=-1)

    def at(self, row_XM: jax.Array, tokens_XM: jax.Array) -> jax.Array:
        """float32 [*X, M]: the logit of ``tokens[x, m]`` in row ``row[x, m]`` of x."""
        h, v = self.logits.shape[-2:]
        logits_RHV = self.logits.astype(jnp.float32).reshape((-1, h, v))
        r = logits_RHV.shape[0]
        picked = logits_RHV[jnp.arange(r)[:, None], row_XM.reshape(r, -1).astype(jnp.int32),
                            tokens_XM.reshape(r, -1).astype(jnp.int32)]
        return picked.reshape(row_XM.shape)


@struct.dataclass
class HeadRows:
    """Rows of logits [*X, H, V] kept as hidden states and the frozen head.

    Build with `head_rows` (it computes ``lse`` once, differentiably in ``hidden``).

    Attributes:
      hidden: [*X, H, D] final-normed hidden states.
      head: the `Head`.
      lse: float32 [*X, H] the rows' log-normalisers.
    """

    hidden: jax.Array
    head: Head
    lse: jax.Array

    def at(self, row_XM: jax.Array, tokens_XM: jax.Array) -> jax.Array:
        """float32 [*X, M]: the logit of ``tokens[x, m]`` in row ``row[x, m]`` of x."""
        h_XMD = jnp.take_along_axis(self.hidden, row_XM[..., None].astype(jnp.int32), axis=-2)
        return logits_at(h_XMD, self.head, tokens_XM)


def as_rows(draft) -> "HeadRows | DenseRows":
    """Draft rows as given (`HeadRows`, `DenseRows`), a logits array as `DenseRows`."""
    return draft if isinstance(draft, (HeadRows, DenseRows)) else DenseRows(draft)


def head_rows(hidden_XHD: jax.Array, head: Head, block: int = BLOCK) -> HeadRows:
    """`HeadRows` of hidden states, with their blocked log-normalisers."""
    return HeadRows(hidden_XHD, head, logsumexp(hidden_XHD, head, 1.0, block))


__all__ = ["BLOCK", "DenseRows", "Head", "HeadRows", "as_rows", "head_of", "head_rows", "logits_at",
           "logsumexp", "top_k"]
