"""The target's sampling transform: temperature, top-k, top-p.

Every exact verifier is exact with respect to the *transformed* target distribution
``p = softmax(transform(logits))``; this module is the one definition of that transform.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


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


def log_probs(logits_NV: jax.Array, sampling: Sampling) -> jax.Array:
    """Target log-distribution after the transform; float32 [..., V].

    Removed tokens get -inf. At T = 0 the result is 0 at the argmax and -inf elsewhere.
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


def check_finite(logits, what: str = "target logits") -> None:
    """Host check: raises ValueError if any logit is NaN or +inf (-inf is a masked token)."""
    import numpy as np

    arr = np.asarray(logits)
    if np.isnan(arr).any() or np.isposinf(arr).any():
        bad = np.argwhere(np.isnan(arr) | np.isposinf(arr))[0]
        raise ValueError(f"{what} contain NaN or +inf (first at index {tuple(int(i) for i in bad)})")
    if (arr == -np.inf).all(axis=-1).any():
        raise ValueError(f"{what} have a row where every token is -inf")
