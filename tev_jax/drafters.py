"""Drafters as the decode engine sees them: the `DrafterProtocol` and the DFlash adapter.

A drafter proposes, once per round, one row of logits for each of the H positions after
the pending root token. The engine needs four things of it (`DrafterProtocol`): its
block size, the target layers it reads, and three pure methods over a static-shape
context (init, extend with committed positions, draft). A DFlash
`tev_jax.models.drafter.Drafter` is adapted by `DFlashDrafter`; anything else that has
the protocol's attributes plugs in as it is (`as_drafter`), e.g. the test doubles of
`tev_jax.testing`.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
from flax import nnx

from tev_jax.models import drafter as dflash
from tev_jax.models import kv_cache as kvc


class DrafterProtocol(Protocol):
    """What the engine needs from a drafter.

    The drafter is an ``nnx.Module`` used inside jit (split together with the target,
    which every method receives, so a drafter may borrow the target's embedding and
    head without holding them). Its context is a pytree of static-shape buffers (e.g. a
    KV cache over context positions) covering the committed positions ``< start`` of
    every row. A DFlash `tev_jax.models.drafter.Drafter` is adapted by `as_drafter`.

    Attributes:
      block_size: H + 1, the block ``[root, MASK x H]``; the drafter proposes H rows.
      target_layer_ids: target layers whose hidden states (concatenated, F features per
        position) are the drafter's context features; ``()`` if it reads tokens only.
    """

    block_size: int
    target_layer_ids: tuple[int, ...]

    def init_context(self, target, batch: int, max_len: int) -> Any:
        """An empty context for ``batch`` rows and ``max_len`` positions."""

    def extend_context(self, target, ctx: Any, tokens_BP: jax.Array, feats_BPF: jax.Array,
                       start_B: jax.Array, count_B: jax.Array) -> Any:
        """Appends committed positions ``start .. start+count-1`` of every row.

        Args:
          target: the `Target`.
          ctx: the context, covering positions ``< start``.
          tokens_BP: int32 [B, P] committed tokens; entries ``>= count`` are padding.
          feats_BPF: [B, P, F] the target's tapped hidden states at those tokens.
          start_B: int32 [B] position of the first new entry.
          count_B: int32 [B] number of real entries per row (0 leaves the row as is).
        """

    def draft(self, target, ctx: Any, root_B: jax.Array, start_B: jax.Array
              ) -> tuple[jax.Array, Any]:
        """Draft logits for the block ``[root, MASK x H]`` at positions ``start..start+H``.

        Returns:
          (float32 logits [B, H, V], row d-1 for the token at depth d; the context, which
          may hold scratch past ``start`` but must still cover positions ``< start``).
        """


class DFlashDrafter(nnx.Module):
    """The `DrafterProtocol` over a DFlash `tev_jax.models.drafter.Drafter`."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.block_size = int(drafter.config.block_size)
        self.target_layer_ids = tuple(int(i) for i in drafter.config.target_layer_ids)

    def init_context(self, target, batch, max_len):
        return dflash.init_drafter_cache(self.drafter.config, batch, max_len, self.drafter.dtype)

    def extend_context(self, target, ctx, tokens_BP, feats_BPF, start_B, count_B):
        # The DFlash cache tracks its own lengths, which equal ``start`` here.
        return dflash.append_context(self.drafter, ctx, feats_BPF, count_B)

    def draft(self, target, ctx, root_B, start_B):
        return dflash.draft_logits(self.drafter, target, ctx, root_B), ctx

    def context_axes(self, ctx):
        """Logical axes of the context cache (optional in the protocol: for meshes)."""
        return dflash.DrafterCache(k=kvc.CACHE_AXES, v=kvc.CACHE_AXES, lengths=("batch",))


def as_drafter(drafter) -> DrafterProtocol | None:
    """Wraps a DFlash drafter module in `DFlashDrafter`; returns protocol drafters as is."""
    if drafter is None:
        return None
    if isinstance(drafter, dflash.Drafter):
        return DFlashDrafter(drafter)
    missing = [m for m in ("block_size", "target_layer_ids", "init_context",
                           "extend_context", "draft") if not hasattr(drafter, m)]
    if missing:
        raise ValueError(f"drafter {type(drafter).__name__} lacks {missing} of "
                         "tev_jax.drafters.DrafterProtocol")
    return drafter


__all__ = ["DFlashDrafter", "DrafterProtocol", "as_drafter"]
