"""Dense attention: the reference that `tev_jax.models.attention` is tested against.

This is the library's former `attend_segments`: whole [B, K, G, T, S] float32 scores,
one joint softmax over the concatenated segments. Masks given as rules (`Mask`) are
expanded to dense booleans here with numpy, independently of the blocked code.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tev_jax.models.attention import Mask


def dense_mask(mask, b: int, t: int, s: int) -> np.ndarray:
    """bool [B, T, S] of a `Mask` (or of a bool array broadcastable to it)."""
    if not isinstance(mask, Mask):
        return np.broadcast_to(np.asarray(mask, bool), (b, t, s))
    idx = np.arange(s)[None, None, :]
    out = np.ones((b, t, s), bool)
    if mask.start is not None:
        out &= idx >= np.broadcast_to(np.asarray(mask.start), (b, t))[:, :, None]
    if mask.end is not None:
        out &= idx < np.broadcast_to(np.asarray(mask.end), (b, t))[:, :, None]
    if mask.dense is not None:
        out &= np.broadcast_to(np.asarray(mask.dense, bool), (b, t, s))
    return out


def attend_segments(q_BTHd, segments):
    """GQA softmax attention over segments ``(k, v, mask)`` with one joint softmax.

    Args:
      q_BTHd: [B, T, H, hd]; segments: k, v [B, S_i, K, hd] and a `Mask` or a bool
        array broadcastable to [B, T, S_i].
    Returns:
      [B, T, H, hd] in q's dtype; rows with no visible key give zeros.
    """
    b, t, h, hd = q_BTHd.shape
    kh = segments[0][0].shape[2]
    g = h // kh
    q = q_BTHd.reshape(b, t, kh, g, hd)
    scores, masks = [], []
    for k, _, m in segments:
        s = jnp.einsum("btkgd,bskd->bkgts", q, k.astype(q.dtype),
                       preferred_element_type=jnp.float32) * hd ** -0.5
        scores.append(s)
        masks.append(jnp.asarray(dense_mask(m, b, t, k.shape[1]))[:, None, None])
    s = jnp.concatenate(scores, axis=-1)
    m = jnp.concatenate(masks, axis=-1)
    s = jnp.where(m, s, jnp.finfo(jnp.float32).min)
    mx = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    p = jnp.where(m, jnp.exp(s - mx), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    out, off = 0.0, 0
    for k, v, _ in segments:
        n = k.shape[1]
        out = out + jnp.einsum("bkgts,bskd->btkgd", p[..., off:off + n].astype(v.dtype), v,
                               preferred_element_type=jnp.float32)
        off += n
    return out.reshape(b, t, h, hd).astype(q_BTHd.dtype)
