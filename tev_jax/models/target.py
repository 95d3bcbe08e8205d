"""The target model: one NNX decoder for the Qwen3, Llama-3 and Qwen3-MoE families
(docs/design.md §6, §14): each layer what `ModelConfig.layer_specs` says (its MLP dense or a
mixture of experts, `tev_jax.models.moe`).

All cached modes go through one general forward, `Target.extend`: T new tokens per row
at given absolute positions are written at cache slots ``start[b] .. start[b]+T-1``;
each new token attends to the committed prefix (slots ``< start[b]``) plus the new
tokens that ``block_mask`` allows. The wrappers only build positions and masks:

===============  =========================  ===================================
mode             positions                  block mask [T, T]
===============  =========================  ===================================
`prefill`        start + 0..T-1             causal, padding keys hidden
`decode`         start                      [[True]]
`verify_tree`    start + depth              tree ancestor mask (self included)
===============  =========================  ===================================

After a verify pass, `tev_jax.models.kv_cache.commit` moves the accepted path's
keys/values to contiguous slots.

The layers' parameters are stacked (``[layers, ...]``) and every pass runs them as one
scan through one entry, `Target.layer_stack`, which takes the attention as a function
``attend(i, q, k, v, carry)``: the modes above write layer i's new keys/values to the
cache they carry and attend to it and the new tokens; ExitTrain's scoring passes
(`tev_jax.exit_train`) to a sequence prefix and tree ancestors. A new model family is
written once, and a program's size does not grow with depth.

Hidden-state taps: ``taps`` is a tuple of layer indices; layer id ``i`` is exactly HF's
``hidden_states[i + 1]`` (DFlash's convention): the output of decoder layer ``i``, except
that for the last layer HF (and so we) return it after the final norm. They are
returned concatenated along the feature axis, ``[B, T, len(taps) * D]`` in tap order,
which is the DFlash drafter's context-feature input.

Use the model functionally in hot loops: split once, jit a function of
``(graphdef, state, ...)`` and merge inside::

    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, donate_argnames="cache")
    def decode_step(graphdef, state, cache, tokens_B, start_B):
        model = nnx.merge(graphdef, state)
        return model.decode(cache, tokens_B, start_B)

    logits_BV, _, cache = decode_step(graphdef, state, cache, tokens_B, start_B)
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tev_jax.models import kv_cache as kvc
from tev_jax.models.attention import Mask, attention, windowed
from tev_jax.models.config import ModelConfig
from tev_jax.models.kv_cache import KVCache, LayerRef
from tev_jax.models.layers import (
    collect_expert_usage, jitted_initializer, linear_kernels, make_param, norm,
    rope_inv_freq, scan_layers, stack_index, stacked_layers,
)
from tev_jax.sharding import constrain
from tev_jax.vocab import embed_rows


_USAGE: contextvars.ContextVar = contextvars.ContextVar("tev_expert_usage", default=None)


@contextlib.contextmanager
def expert_usage():
    """Records the expert usage of the `Target.layer_stack` traced inside the block:
    yields a dict whose 'usage' becomes int32 [layers, E] (pairs per expert and layer;
    zero rows for dense layers), or None for a model without a mixture."""
    out = {"usage": None}
    token = _USAGE.set(out)
    try:
        yield out
    finally:
        _USAGE.reset(token)


class Target(nnx.Module):
    """A Qwen3 / Llama-3 / Qwen3-MoE decoder with a static KV cache.

    Attributes:
      config: the frozen `ModelConfig`.
      dtype: parameter and activation dtype (float32 or bfloat16); logits are float32.
    """

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.dtype = jnp.dtype(dtype)
        self.embed_tokens = make_param(rngs, (c.vocab_size, c.hidden_size), dtype,
                                   ("vocab", "embed"), "normal")
        self.layers = stacked_layers(c, dtype=dtype, rngs=rngs)
        self.norm = norm(c, c.hidden_size, dtype=dtype, rngs=rngs)
        self.lm_head = (None if c.tie_word_embeddings else
                        make_param(rngs, (c.hidden_size, c.vocab_size), dtype,
                               ("embed", "vocab"), "normal"))

    # ------------------------------------------------------------- embedding / head

    def embed(self, tokens: jax.Array) -> jax.Array:
        """Token embeddings ``[..., D]`` in the model dtype.

        Ids outside ``[0, V)`` (e.g. -1 padding) are clamped rather than turned into NaN:
        a NaN key in an unused cache slot would poison later rows through ``0 * NaN``.
        """
        tokens = jnp.clip(tokens, 0, self.config.vocab_size - 1)
        x = embed_rows(self.embed_tokens[...], tokens)  # no gather of a sharded table
        if self.config.embed_scale is not None:
            # as transformers: the float32 scale cast to the weights' dtype first
            x = x * jnp.asarray(self.config.embed_scale, jnp.float32).astype(x.dtype)
        if x.ndim == 3:
            x = constrain(x, ("batch", "seq", "act_embed"))
        return x

    def unembed(self, hidden: jax.Array, softcap: bool = True) -> jax.Array:
        """float32 logits ``[..., V]`` of (already final-normed) hidden states.

        Uses ``lm_head`` or, with tied embeddings, the embedding matrix, then the
        config's final soft-cap ``c * tanh(x / c)`` (the target's distribution; drop it
        with ``softcap=False``, e.g. for a drafter trained on the raw head).
        """
        h = hidden.astype(self.dtype)
        if self.lm_head is None:
            logits = jnp.einsum("...d,vd->...v", h, self.embed_tokens[...],
                                preferred_element_type=jnp.float32)
        else:
            logits = jnp.einsum("...d,dv->...v", h, self.lm_head[...],
                                preferred_element_type=jnp.float32)
        if logits.ndim == 3:
            logits = constrain(logits, ("batch", "seq", "act_vocab"))
        logits = logits.astype(jnp.float32)
        cap = self.config.final_logit_softcap
        if softcap and cap is not None:
            logits = cap * jnp.tanh(logits / cap)
        return logits

    # ------------------------------------------------------------------ the stack

    def layer_stack(self, tokens_BT: jax.Array, positions_BT: jax.Array, attend,
                    carry=None, taps: Sequence[int] = (), depth: int | None = None):
        """The decoder layers with the attention given as a function: every pass's forward.

        Decoding (`prefill`, `decode`, `verify_tree`, through `extend`) and ExitTrain's
        scoring passes (`tev_jax.exit_train`) run the same layers, as one scan over the
        stacked layers (`tev_jax.models.layers.scan_layers`); only ``attend`` differs
        (which keys each new token sees, and what it writes: a cache is threaded
        through the layers as ``carry``).

        Args:
          tokens_BT: int [B, T] new tokens.
          positions_BT: int [B, T] their absolute (RoPE) positions.
          attend: ``attend(layer, q [B,T,H,hd], k [B,T,K,hd], v, carry) -> (out
            [B,T,H,hd], carry)``: the attention of one layer (a
            `tev_jax.models.kv_cache.LayerRef`: its traced index, its static spec and
            window) of the new tokens' roped queries over keys/values of its choosing
            (the new tokens' own ``k, v`` and, e.g., that layer of a cache it carries
            and writes, `tev_jax.models.kv_cache.layer_kv`).
          carry: the pytree ``attend`` threads through the layers (e.g. a `KVCache`).
          taps: layer indices whose outputs to return (see the module docstring).
          depth: run only the layers below ``depth`` (static; default all). The
            returned hidden state is then not the model's; taps must lie below it.
        Returns:
          (final-normed hidden [B, T, D], taps [B, T, len(taps) * D] or None, carry).
        Raises:
          ValueError: a tap outside ``[0, depth)``.
        """
        taps = tuple(int(t) for t in taps)
        num_layers = self.config.num_layers if depth is None else depth
        for t in taps:
            if not 0 <= t < num_layers:
                raise ValueError(f"tap layer {t} out of range [0, {num_layers})")
        x = self.embed(tokens_BT)
        # Tapped outputs go to their slot of a buffer, every other layer's to a spare
        # last slot: one in-place write per layer, no branch.
        kept = sorted(set(taps))
        slot_of = np.full(num_layers, len(kept), np.int32)
        slot_of[kept] = np.arange(len(kept))
        tapped = None if not taps else jnp.zeros((len(kept) + 1,) + x.shape, x.dtype)
        recorder = _USAGE.get()
        experts = max((s.moe.num_experts for s in self.config.layer_specs if s.moe), default=0)
        usage = (None if recorder is None or not experts else
                 jnp.zeros((self.config.num_layers, experts), jnp.int32))

        def body(layer, i, state):
            x, tapped, usage, carry = state
            # routing is collected only when a recorder asks for it
            collect = (collect_expert_usage() if usage is not None
                       else contextlib.nullcontext([]))
            ref = LayerRef(i, stack_index(), layer.sub, layer.spec)
            inv_freq = rope_inv_freq(self.config, layer.spec.attention)
            with collect as sink:
                x, carry = layer(x, positions_BT, inv_freq,
                                 lambda q, k, v: attend(ref, q, k, v, carry))
            if tapped is not None:
                slot = jnp.asarray(slot_of)[i]
                tapped = jax.lax.dynamic_update_index_in_dim(tapped, x, slot, 0)
            if usage is not None and sink:
                usage = jax.lax.dynamic_update_index_in_dim(usage, sink[0], i, 0)
            return x, tapped, usage, carry

        x, tapped, usage, carry = scan_layers(self.layers, body, (x, tapped, usage, carry),
                                              depth=depth, in_place=linear_kernels)
        if recorder is not None:
            recorder["usage"] = usage
        h = self.norm(x)
        # HF's hidden_states[-1] is the final-normed output
        outs = [h if t == self.config.num_layers - 1 else tapped[slot_of[t]] for t in taps]
        feats = jnp.concatenate(outs, axis=-1) if taps else None
        return h, feats, carry

    def _stack(self, tokens_BT, positions_BT, block_mask, prefix_mask=None,
               cache: KVCache | None = None, start_B=None, taps: Sequence[int] = ()):
        """`layer_stack` attending to the new tokens (``block_mask``, a `Mask` or bool
        array over their keys) and, with a ``cache``, to its slots (``prefix_mask``),
        each layer writing its new keys/values to the cache at slots ``start ..``."""
        scale = self.config.attention_scale

        def own(layer):
            # the new tokens' keys: consecutive positions unless the mask is dense
            return windowed(block_mask, layer.window, positions_BT,
                            key_positions_BS=positions_BT,
                            first_key_position=positions_BT[:, :1])

        if cache is None:
            def attend(layer, q, k, v, carry):
                return attention(q, ((k, v, own(layer)),), scale=scale), carry
        else:
            def attend(layer, q, k, v, cache):
                # Written before the read (the new slots are outside prefix_mask), so
                # the cache is updated in place.
                cache = kvc.write_layer(cache, layer, k, v, start_B)
                segment = _cache_segment(cache, layer, prefix_mask, positions_BT)
                return attention(q, (segment, (k, v, own(layer))), scale=scale), cache
        return self.layer_stack(tokens_BT, positions_BT, attend, cache, taps)

    def __call__(self, tokens_BT: jax.Array, positions_BT: jax.Array | None = None,
                 mask_BTT: jax.Array | None = None, taps: Sequence[int] = ()):
        """Cache-free forward over whole sequences.

        Args:
          tokens_BT: int [B, T].
          positions_BT: int [B, T]; default ``0..T-1``.
          mask_BTT: bool [B, T, T] attention mask (or a `Mask`); default causal.
          taps: layer indices whose outputs to return.
        Returns:
          (logits float32 [B, T, V], taps [B, T, len(taps)*D] or None)
        """
        b, t = tokens_BT.shape
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if mask_BTT is None:
            mask_BTT = Mask.causal(t)
        h, feats, _ = self._stack(tokens_BT, positions_BT, mask_BTT, taps=taps)
        return self.unembed(h), feats

    # ------------------------------------------------------------ cached forwards

    def extend_hidden(self, cache: KVCache, tokens_BT: jax.Array, positions_BT: jax.Array,
                      start_B: jax.Array, block_mask_BTT: Mask | jax.Array,
                      taps: Sequence[int] = ()):
        """`extend` without the vocabulary projection.

        Returns:
          (final-normed hidden [B, T, D], taps [B, T, len(taps)*D] or None, new cache)
        """
        return self._extend_hidden(cache, tokens_BT, positions_BT, start_B, start_B,
                                   block_mask_BTT, taps)

    def _extend_hidden(self, cache, tokens_BT, positions_BT, start_B, seen_B, block_mask,
                       taps):
        """`extend_hidden` writing at slots ``start ..`` and seeing cache slots ``< seen``."""
        return self._stack(tokens_BT, positions_BT, block_mask, Mask.prefix(seen_B), cache,
                           start_B, taps)

    def extend(self, cache: KVCache, tokens_BT: jax.Array, positions_BT: jax.Array,
               start_B: jax.Array, block_mask_BTT: jax.Array, taps: Sequence[int] = ()):
        """The general cached forward every mode uses.

        Args:
          cache: `KVCache` with L slots.
          tokens_BT: int [B, T] new tokens.
          positions_BT: int [B, T] their absolute (RoPE) positions.
          start_B: int [B] committed length per row; new keys/values go to slots
            ``start .. start+T-1`` and each new token sees slots ``< start``.
          block_mask_BTT: bool [B, T, T] (or [T, T]), or a `Mask` over the new keys:
            new token t may attend to new token s. Include the diagonal.
          taps: layer indices whose outputs to return.
        Returns:
          (logits float32 [B, T, V], taps [B, T, len(taps)*D] or None, new cache)

        Sliding-window layers (Gemma 4) take their windows from the positions; they
        need a row's T positions to lie within T - 1 of each other (consecutive tokens,
        or a tree at start + depth: every mode above) and, with a `Mask` block mask
        without a dense part, consecutive.
        """
        h, feats, cache = self.extend_hidden(cache, tokens_BT, positions_BT, start_B,
                                             block_mask_BTT, taps)
        return self.unembed(h), feats, cache

    def prefill(self, cache: KVCache, tokens_BT: jax.Array, lengths_B: jax.Array,
                start_B: jax.Array | None = None, taps: Sequence[int] = (),
                chunk: int | None = None):
        """Consumes right-padded prompts.

        Args:
          tokens_BT: int [B, T], row b's real tokens are ``tokens[b, :lengths[b]]``.
          lengths_B: int [B].
          start_B: int [B] committed length before the prompt (default 0).
          taps: layer indices whose outputs to return.
          chunk: run the prompt through the stack ``chunk`` tokens at a time (static;
            None = all T at once). Each chunk writes its keys/values to the cache and
            attends to the cache written so far, so activation memory scales with
            ``chunk`` instead of T; a T not divisible by it is padded. The outputs do
            not depend on it (up to float rounding).
        Returns:
          (logits float32 [B, V] after each row's last real token,
           taps [B, T, len(taps)*D] or None, new cache). The row's committed length is
          now ``start + lengths``.
        Raises:
          ValueError: a chunk that is not a positive int.
        """
        h_last, feats, cache = self.prefill_hidden(cache, tokens_BT, lengths_B, start_B,
                                                   taps, chunk)
        return self.unembed(h_last), feats, cache

    def prefill_hidden(self, cache: KVCache, tokens_BT: jax.Array, lengths_B: jax.Array,
                       start_B: jax.Array | None = None, taps: Sequence[int] = (),
                       chunk: int | None = None):
        """`prefill` without the vocabulary projection.

        Returns:
          (final-normed hidden [B, D] at each row's last real token, taps
           [B, T, len(taps)*D] or None, new cache)
        """
        b, t = tokens_BT.shape
        if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"prefill chunk must be a positive int or None, got {chunk!r}")
        c = t if chunk is None else min(chunk, t)
        n = -(-t // c)
        start = (jnp.zeros((b,), jnp.int32) if start_B is None
                 else start_B.astype(jnp.int32))
        lengths = lengths_B.astype(jnp.int32)
        tokens = jnp.pad(tokens_BT, ((0, 0), (0, n * c - t)))
        last = jnp.clip(lengths - 1, 0, t - 1)

        def one_chunk(i, carry):
            cache, h_last, feats = carry
            off = i * c
            ar = jnp.arange(c, dtype=jnp.int32)
            # Prompt token j sees prompt tokens <= j and < length, as in one pass.
            block = Mask.causal(c, jnp.clip(lengths - off, 0, c))
            h, f, cache = self._extend_hidden(
                cache, jax.lax.dynamic_slice_in_dim(tokens, off, c, axis=1),
                start[:, None] + off + ar[None, :], start + off,
                start + jnp.minimum(off, lengths), block, taps)
            here = (last >= off) & (last < off + c)
            h_row = jnp.take_along_axis(h, jnp.clip(last - off, 0, c - 1)[:, None, None],
                                        axis=1)[:, 0]
            h_last = jnp.where(here[:, None], h_row, h_last)
            if f is not None:
                feats = jax.lax.dynamic_update_slice_in_dim(feats, f, off, axis=1)
            return cache, h_last, feats

        d = self.config.hidden_size
        feats = (None if not taps else
                 jnp.zeros((b, n * c, len(taps) * d), self.dtype))
        carry = (cache, jnp.zeros((b, d), self.dtype), feats)
        if n == 1:
            carry = one_chunk(0, carry)
        else:
            carry = jax.lax.fori_loop(0, n, one_chunk, carry)
        cache, h_last, feats = carry
        return h_last, (None if feats is None else feats[:, :t]), cache

    def decode(self, cache: KVCache, tokens_B: jax.Array, start_B: jax.Array,
               taps: Sequence[int] = ()):
        """One token per row at position ``start``.

        Returns:
          (logits float32 [B, V], taps [B, len(taps)*D] or None, new cache); the
          committed length becomes ``start + 1``.
        """
        b = tokens_B.shape[0]
        mask = jnp.ones((b, 1, 1), bool)
        logits, feats, cache = self.extend(cache, tokens_B[:, None], start_B[:, None],
                                           start_B, mask, taps)
        return logits[:, 0], (None if feats is None else feats[:, 0]), cache

    def verify_tree(self, cache: KVCache, tokens_BN: jax.Array, depths_BN: jax.Array,
                    anc_BNN: jax.Array, start_B: jax.Array, taps: Sequence[int] = (),
                    experts_touched: bool = False):
        """The tree verify pass.

        Args:
          tokens_BN: int [B, N] tree tokens (slot 0 = the root).
          depths_BN: int [B, N]; node i sits at position ``start + depths[i]``.
          anc_BNN: bool [B, N, N]; ``anc[i, j]`` = j is i or an ancestor of i.
          start_B: int [B]; the tree is written at slots ``start .. start+N-1``.
          experts_touched: also return how many distinct experts each layer's mixture
            ran for the pass's B x N tokens (what a round reads of it).
        Returns:
          (logits float32 [B, N, V], taps [B, N, len(taps)*D] or None, new cache), and
          with ``experts_touched`` int32 [layers] (0 for dense layers; None for a model
          without a mixture) after them.
        """
        positions = start_B.astype(jnp.int32)[:, None] + depths_BN.astype(jnp.int32)
        if not experts_touched:
            return self.extend(cache, tokens_BN, positions, start_B, anc_BNN, taps)
        with expert_usage() as rec:
            out = self.extend(cache, tokens_BN, positions, start_B, anc_BNN, taps)
        usage = rec["usage"]
        return out + (None if usage is None else jnp.sum(usage > 0, axis=-1, dtype=jnp.int32),)

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """A zero cache in this model's dtype."""
        return kvc.init_cache(self.config, batch, max_len, self.dtype)


def _cache_segment(cache: KVCache, layer: LayerRef, prefix: Mask, positions_BT):
    """The attention segment of a layer's cache for T new tokens at ``positions``.

    A global layer reads its whole cache (the key blocks past ``prefix`` are skipped at
    run time). A sliding layer of window W reads a static slice of S = W + T - 1 slots
    per row, from ``lo = min(positions) - W + 1``: the new tokens' positions lie within
    T - 1 of each other (consecutive, or a tree at start + depth) and the cache slots
    they may see, ``< start``, within the slice, so its bytes are bounded by the window
    whatever the context.
    """
    ck, cv, row = kvc.layer_kv(cache, layer)
    w, (b, t) = layer.window, positions_BT.shape
    size = None if w is None else w + t - 1
    if size is None or size >= ck.shape[2]:
        return ck, cv, windowed(prefix, w, positions_BT), row
    lo_B = jnp.clip(jnp.min(positions_BT, axis=1) - w + 1, 0, ck.shape[2] - size)

    def rows(x):
        take = lambda x_b, lo: jax.lax.dynamic_slice(  # noqa: E731
            x_b, (row, lo, 0, 0), (1, size) + x_b.shape[2:])[0]
        return jax.vmap(take, in_axes=(1, 0))(x, lo_B)                 # [B, S, K, hd]

    lo = lo_B[:, None]
    shifted = prefix.replace(end=None if prefix.end is None else prefix.end - lo,
                             start=None if prefix.start is None else prefix.start - lo)
    return rows(ck), rows(cv), windowed(shifted, w, positions_BT, first_key_position=lo)


def init_target(config: ModelConfig, *, key: jax.Array | int = 0, dtype=jnp.float32,
                mesh=None) -> Target:
    """A randomly initialised target (normal(0.02) weights, unit norms, zero biases).

    Prefer this to ``Target(config, rngs=...)``, which is correct too but compiles one
    random draw per parameter.

    The parameters are created by one jitted init (``jax.eval_shape`` for the structure,
    ``jit(init, out_shardings=...)`` for the values), so with a ``mesh`` every array is
    born sharded by its logical axes and no unsharded copy exists.
    """
    if isinstance(key, int):
        key = jax.random.key(key)
    from tev_jax import sharding as shd

    graphdef, init = jitted_initializer(Target, config, jnp.dtype(dtype), mesh,
                                        shd.current_rules())
    return nnx.merge(graphdef, init(key))


def score(model: Target, tokens_BL: jax.Array) -> jax.Array:
    """float32 logits [B, L, V] of a plain causal pass over whole sequences (no cache)."""
    logits, _ = model(jnp.asarray(tokens_BL, jnp.int32))
    return logits
