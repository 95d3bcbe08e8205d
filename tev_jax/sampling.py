"""The target's sampling transform: temperature, top-k, top-p.

Every exact verifier is exact with respect to the *transformed* target distribution
``p = softmax(transform(logits))``; this module is the one definition of that transform.

A setting is either one `Sampling` for every row, static in the compiled programs (the
fast path: at T = 0 and for a plain temperature nothing of size [N, V] is written), or,
with ``DecodeConfig(sampling=PER_ROW)``, each row's own, held as arrays in the decode
state (`SamplingRows`): one program then serves every setting, and the engine applies
each row's transform to its logits before the verifier (`tev_jax.vocab.row_scores`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How target logits become a distribution (static and hashable).

    Attributes:
      temperature: T >= 0; T = 0 is greedy (one-hot at the argmax, lowest index on ties).
      top_k: keep the k largest logits (ties at the k-th value are all kept), or None.
      top_p: keep the smallest set of most likely tokens whose mass reaches top_p
        (applied after top_k), or None.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got "
                             f"{self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] or None, got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


PER_ROW = "per_row"
"""``DecodeConfig(sampling=PER_ROW)``: each row's setting comes with its prompt
(`SamplingRows`) and lives in the decode state."""


@struct.dataclass
class SamplingRows:
    """Each row's own setting, as arrays [B] (what the decode state holds with
    `PER_ROW`): its `Sampling`, and whether it ends at a stop token.

    Attributes:
      temperature: float32 [B]; 0 is greedy.
      top_k: int32 [B]; 0 keeps every token.
      top_p: float32 [B]; 1 keeps every token.
      stops: bool [B]; False: the row goes on past the config's stop tokens, to its
        ``max_new_tokens`` (vLLM's ``ignore_eos``, which benchmark clients send).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    stops: jax.Array

    @classmethod
    def of(cls, settings: Sequence[Sampling], stops: Sequence[bool] | None = None
           ) -> SamplingRows:
        """The rows of these settings (host arrays); ``stops`` default: every row ends
        at a stop token."""
        settings = list(settings)
        if not all(isinstance(s, Sampling) for s in settings):
            raise ValueError(f"each row's setting must be a Sampling, got {settings!r}")
        stops = [True] * len(settings) if stops is None else list(stops)
        if len(stops) != len(settings):
            raise ValueError(f"{len(stops)} stop flags for {len(settings)} settings")
        return cls(np.asarray([s.temperature for s in settings], np.float32),
                   np.asarray([s.top_k or 0 for s in settings], np.int32),
                   np.asarray([1.0 if s.top_p is None else s.top_p for s in settings],
                              np.float32),
                   np.asarray(stops, bool))


def log_probs(logits_NV: jax.Array, sampling: Sampling) -> jax.Array:
    """Target log-distribution after the transform; float32 [..., V].

    Removed tokens get -inf. At T = 0 the result is 0 at the argmax and -inf elsewhere.
    (`row_cut` is the same cut with each row's own top-k and top-p.)
    """
    logits = logits_NV.astype(jnp.float32)
    if sampling.greedy:
        hot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=bool)
        return jnp.where(hot, 0.0, -jnp.inf)
    logits = logits / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][..., -1:]
        logits = jnp.where(logits >= kth, logits, -jnp.inf)
    if sampling.top_p is not None and sampling.top_p < 1:
        sorted_desc = -jnp.sort(-logits, axis=-1)
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        # The smallest logit still needed to reach top_p: keep every token at least as likely.
        keep_sorted = mass_before < sampling.top_p
        threshold = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits >= threshold, logits, -jnp.inf)
    return jax.nn.log_softmax(logits, axis=-1)


CUT_PREFIX = 256
"""`row_cut` first looks for each row's cut among its this many largest logits (a top-k,
about 10x cheaper than a sort of the vocabulary on XLA:CPU: 14 against 124 ms on
[136, 4096], 9 against 784 ms on [16, 151 936]); a batch where some row's top-k is
larger or its nucleus reaches past them finds the cuts by bisection instead."""


def row_cut(z_BXV: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
    """`log_probs`'s top-k then top-p, each row b with its own ``top_k_B[b]`` (0: off)
    and ``top_p_B[b]`` (1: off), on temperature-scaled logits [B, ..., V]; removed
    tokens get -inf, kept ones keep their value (not renormalised). The cut is found
    among each row's `CUT_PREFIX` largest logits where it lies there, else (for the
    whole batch, a ``lax.cond``) by `_searched_cut`: no sort of the vocabulary, whose
    temporaries a program would have to hold whichever branch runs."""
    lead = z_BXV.shape[:-1]
    per_row = lambda a: jnp.broadcast_to(a.reshape((-1,) + (1,) * (len(lead) - 1)), lead)
    k, p = per_row(top_k_B)[..., None], per_row(top_p_B)[..., None]
    if z_BXV.shape[-1] <= CUT_PREFIX:
        return _cut(z_BXV, -jnp.sort(-z_BXV, axis=-1), k, p)[0]
    cut, found = _cut(z_BXV, jax.lax.top_k(z_BXV, CUT_PREFIX)[0], k, p)
    return jax.lax.cond(jnp.all(found), lambda: cut, lambda: _searched_cut(z_BXV, k, p))


def _cut(z, largest, k, p):
    """`row_cut` from each row's ``largest`` logits, sorted, [..., K] (K <= V; all of
    them: a sort). -> (the cut logits, bool [...]: whether the row's cut lies among
    them: its top-k within K, and its nucleus reached inside them)."""
    vocab, prefix = z.shape[-1], largest.shape[-1]
    kth = jnp.take_along_axis(largest, jnp.clip(k - 1, 0, prefix - 1), axis=-1)
    by_k = (k > 0) & (k < vocab)
    kth = jnp.where(by_k, kth, -jnp.inf)
    z = jnp.where(z >= kth, z, -jnp.inf)
    largest = jnp.where(largest >= kth, largest, -jnp.inf)
    probs = jnp.exp(largest - jax.nn.logsumexp(z, axis=-1, keepdims=True))
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_before < p
    threshold = jnp.min(jnp.where(keep, largest, jnp.inf), axis=-1, keepdims=True)
    found = ((~by_k | (k <= prefix))
             & ((p >= 1) | (prefix == vocab) | ~keep[..., -1:]))[..., 0]
    return jnp.where((p < 1) & (z < threshold), -jnp.inf, z), found


def _order_key(z: jax.Array) -> jax.Array:
    """int32 keys of float32 values in the same order (-inf lowest)."""
    bits = jax.lax.bitcast_convert_type(z.astype(jnp.float32), jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _smallest_key(ok, lo, hi):
    """The smallest int32 key t in (lo, hi] with ``ok(t)`` (monotone: false below
    some key, true from it on; ``ok(hi)`` true), per row, by 32 bisection steps."""
    def step(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # (lo + hi) // 2 without overflow
        good = ok(mid)
        return jnp.where(good, lo, mid), jnp.where(good, mid, hi)

    return jax.lax.fori_loop(0, 32, step, (lo, hi))[1]


def _searched_cut(z, k, p):
    """`row_cut` without a sort: the k-th largest logit is the largest key that at least
    k logits reach, and the nucleus keeps the logits whose key is at least the smallest
    t with mass(key > t) < p; each is a bisection over the int32 order keys of the
    logits (32 passes over [B, ..., V], counts and masked sums)."""
    key = _order_key(z)
    lo = jnp.full(z.shape[:-1] + (1,), jnp.iinfo(jnp.int32).min, jnp.int32)
    hi = jnp.max(key, axis=-1, keepdims=True)
    # k-th largest: the smallest t for which fewer than k logits lie above it
    by_k = (k > 0) & (k < z.shape[-1])
    kth = _smallest_key(lambda t: jnp.sum(key > t, axis=-1, keepdims=True) < k, lo, hi)
    z = jnp.where(by_k & (key < kth), -jnp.inf, z)
    key = jnp.where(by_k & (key < kth), jnp.iinfo(jnp.int32).min, key)
    probs = jnp.exp(z - jax.nn.logsumexp(z, axis=-1, keepdims=True))
    above = lambda t: jnp.sum(jnp.where(key > t, probs, 0.0), axis=-1, keepdims=True)
    threshold = _smallest_key(lambda t: above(t) < p, lo, hi)
    return jnp.where((p < 1) & (key < threshold), -jnp.inf, z)


def check_finite(logits, what: str = "target logits") -> None:
    """Host check: raises ValueError if any logit is NaN or +inf (-inf is a masked token)."""
    import numpy as np

    arr = np.asarray(logits)
    if np.isnan(arr).any() or np.isposinf(arr).any():
        bad = np.argwhere(np.isnan(arr) | np.isposinf(arr))[0]
        raise ValueError(f"{what} contain NaN or +inf (first at index {tuple(int(i) for i in bad)})")
    if (arr == -np.inf).all(axis=-1).any():
        raise ValueError(f"{what} have a row where every token is -inf")
