"""Drafters that are good or bad by construction, for tests and benchmarks.

They implement `tev_jax.drafters.DrafterProtocol`. They are not real drafters: they exist so
that the engine can be tested and timed with long accepted blocks before a trained DFlash
drafter exists (a randomly initialised DFlash drafter gives the short ones).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class OracleDrafter(nnx.Module):
    """Drafts with the target itself: row d is the target's logits after the greedy chain.

    Its context is its own copy of the target's KV cache (it reads committed tokens,
    not hidden states). Drafting runs H single-token target steps from the root, feeding
    each step's argmax to the next, so at T = 0 the chain of row argmaxes is exactly the
    target's greedy continuation and every block is accepted in full (τ = H + 1). The
    cost is H target decode steps per round: use it for acceptance, not for speed.

    Attributes:
      block_size: H + 1.
      scale: draft logits are the target's logits times ``scale`` (> 1 sharpens the
        rows, so a DDTree spends its budget near the greedy chain).
    """

    def __init__(self, block_size: int, *, scale: float = 1.0):
        if block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {block_size}")
        self.block_size = int(block_size)
        self.scale = float(scale)
        self.target_layer_ids = ()

    def init_context(self, target, batch, max_len):
        return target.init_cache(batch, max_len)

    def extend_context(self, target, ctx, tokens_BP, feats_BPF, start_B, count_B):
        p = tokens_BP.shape[1]
        j = jnp.arange(p, dtype=jnp.int32)
        positions_BP = start_B[:, None] + j[None, :]
        mask_BPP = ((j[None, :, None] >= j[None, None, :])
                    & (j[None, None, :] < count_B[:, None, None]))
        # Entries past ``count`` land on scratch slots >= start + count.
        _, _, ctx = target.extend_hidden(ctx, tokens_BP, positions_BP, start_B, mask_BPP)
        return ctx

    def draft(self, target, ctx, root_B, start_B):
        def step(carry, d):
            cache, tok_B = carry
            logits_BV, _, cache = target.decode(cache, tok_B, start_B + d)
            return (cache, jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)), logits_BV

        (ctx, _), logits_HBV = jax.lax.scan(step, (ctx, root_B.astype(jnp.int32)),
                                            jnp.arange(self.block_size - 1, dtype=jnp.int32))
        return self.scale * jnp.swapaxes(logits_HBV, 0, 1), ctx
