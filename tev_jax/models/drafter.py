"""The DFlash block-diffusion drafter (docs/design.md §6).

A drafter is a few Qwen3 decoder layers without an embedding or an LM head of its own:
it borrows both from the target. One forward proposes a whole block::

    context   c_j = hidden_norm(fc(concat of target hidden states after the tapped
                    layers, at position j))                       j < root position
    block     [root, MASK, ..., MASK] (H + 1 tokens) at positions p .. p+H, embedded
              with the target's embedding
    layers    queries from the block; keys/values from [context ; block]; keys of
              both q/k-normed and roped at their absolute positions; non-causal
    logits    target's head (norm(block hidden)) at block positions 1..H -> [B, H, V],
              without the target's soft-cap; with the drafter's own if it has one

The context keys/values of every layer depend only on the context features, so they
are computed once per context position and cached (`DrafterCache`): each decode round
appends the features of the newly committed tokens, and the block attends to the cached
prefix. Slot ``j`` of the cache holds position ``j``; row ``b`` is meaningful for
``j < lengths[b]`` and the root of the next block sits at position ``lengths[b]``.

Everything below the module is a pure function of ``(drafter, target, arrays)``, so it
works under ``jax.jit`` / ``nnx.split`` + ``merge``, batched over rows with different
context lengths. Training uses `anchor_logits`: many blocks of one sequence in a single
forward with one attention mask (static shapes).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from tev_jax.models.attention import Mask, attention
from tev_jax.models.config import ModelConfig
from tev_jax.models.kv_cache import CACHE_AXES, set_slots
from tev_jax.models.layers import (
    Linear, RMSNorm, apply_rope, rope_inv_freq, scan_layers, stacked_layers,
)
from tev_jax.sharding import constrain

# Keys of DFlash-2 / variant drafters that change the architecture or the logits.
_UNSUPPORTED_DFLASH_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank",
                            "selector_top_k")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The original DFlash tap spacing when a config does not list its layers.

    One tap per drafter layer, spread evenly from target layer 1 to
    ``num_target_layers - 3`` and rounded with Python's ``round`` (half to even); a
    one-layer drafter taps the single middle layer ``num_target_layers // 2``.
    """
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    first, last = 1, num_target_layers - 3
    return tuple(round(first + i * (last - first) / (num_draft_layers - 1))
                 for i in range(num_draft_layers))


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """A DFlash drafter (frozen and hashable: it decides shapes).

    Attributes:
      model: the Qwen3 fields of the drafter's own layers (``num_layers`` = drafter
        depth; ``vocab_size`` and ``hidden_size`` must match the target).
      block_size: H + 1 (root + H mask positions).
      num_target_layers: depth of the target the drafter was made for.
      mask_token_id: token id of the MASK placeholder (a target token id).
      target_layer_ids: target layers whose outputs form the context features, in
        feature order (layer id ``i`` = output of target decoder layer ``i``).
      logit_softcap: the draft logits' soft-cap c (``c * tanh(x / c)``; z-lab's DFlash
        key ``final_logit_softcapping``), or None: the target's head without its cap,
        as the DFlash authors' Gemma drafter takes its logits (the block input is the
        target's embedding, scaled as the target scales it). Draft logits only shape
        the trees: the verifiers stay exact either way.
      input_embedding_scale: the block's token embeddings (the target's, with the
        target's own scale) are multiplied by it (z-lab's key of that name; 1: none).
      output_multiplier: the draft logits are multiplied by it before the soft-cap
        (z-lab's key of that name; 1: none).
    """

    model: ModelConfig
    block_size: int
    num_target_layers: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    logit_softcap: float | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0

    def __post_init__(self):
        if not self.model.qk_norm:
            raise ValueError("a DFlash drafter has Qwen3 layers (q/k norm); got "
                             f"model_type {self.model.model_type!r}")
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise ValueError(f"block_size must be an int >= 2, got {self.block_size!r}")
        if not isinstance(self.num_target_layers, int) or self.num_target_layers < 1:
            raise ValueError(
                f"num_target_layers must be a positive int, got {self.num_target_layers!r}")
        if not 0 <= self.mask_token_id < self.model.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary "
                             f"[0, {self.model.vocab_size})")
        ids = self.target_layer_ids
        if not isinstance(ids, tuple) or not ids:
            raise ValueError(f"target_layer_ids must be a non-empty tuple, got {ids!r}")
        for i in ids:
            if not isinstance(i, int) or not 0 <= i < self.num_target_layers:
                raise ValueError(f"target layer id {i!r} is outside [0, "
                                 f"{self.num_target_layers}) (num_target_layers)")
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise ValueError(f"final_logit_softcapping must be > 0, got {self.logit_softcap!r}")
        for name in ("input_embedding_scale", "output_multiplier"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")

    @property
    def horizon(self) -> int:
        """H = block_size - 1, the number of drafted positions."""
        return self.block_size - 1

    @property
    def hidden_size(self) -> int:
        return self.model.hidden_size

    @property
    def num_layers(self) -> int:
        return self.model.num_layers

    @property
    def feature_size(self) -> int:
        """Width of the context features: ``len(target_layer_ids) * D``."""
        return len(self.target_layer_ids) * self.model.hidden_size

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "DrafterConfig":
        """Reads a DFlash ``config.json`` dict (a Qwen3 config plus the DFlash fields).

        ``block_size``, ``mask_token_id`` and ``target_layer_ids`` are looked up in
        ``dflash_config`` first and at the top level second, like the original code.

        Raises:
          ValueError: a missing field, a DFlash-2 / non-default-logit variant, or an
            unsupported Qwen3 feature (named in the message).
        """
        dflash = hf.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise ValueError(f"dflash_config must be an object, got {dflash!r}")

        def get(key, default=None):
            return dflash.get(key, hf.get(key, default))

        for key in _UNSUPPORTED_DFLASH_KEYS:
            if get(key) is not None:
                raise ValueError(f"unsupported DFlash variant: field {key!r} (DFlash-2 "
                                 "convolutions / candidate selector) is not implemented")
        if hf.get("is_causal"):
            raise ValueError("unsupported DFlash field is_causal=True; supported: "
                             "non-causal block attention")
        model = ModelConfig.from_hf(hf)
        if hf.get("num_target_layers") is None:
            raise ValueError("config.json is missing required field 'num_target_layers'")
        num_target_layers = int(hf["num_target_layers"])
        mask = get("mask_token_id")
        if mask is None:
            raise ValueError("config.json is missing 'dflash_config.mask_token_id'")
        ids = get("target_layer_ids")
        ids = (default_target_layer_ids(num_target_layers, model.num_layers) if ids is None
               else tuple(int(i) for i in ids))
        cap = get("final_logit_softcapping")
        scale, mult = get("input_embedding_scale"), get("output_multiplier")
        return cls(model=model, block_size=int(get("block_size", 16)),
                   num_target_layers=num_target_layers, mask_token_id=int(mask),
                   target_layer_ids=ids, logit_softcap=None if not cap else float(cap),
                   input_embedding_scale=1.0 if scale is None else scale,
                   output_multiplier=1.0 if mult is None else mult)

    def to_hf(self, *, dtype: str = "float32") -> dict[str, Any]:
        """A ``config.json`` dict that the original ``dflash`` package reads."""
        hf = self.model.to_hf(dtype=dtype)
        hf["architectures"] = ["DFlashDraftModel"]
        hf["block_size"] = self.block_size
        hf["num_target_layers"] = self.num_target_layers
        hf["dflash_config"] = {"mask_token_id": self.mask_token_id,
                               "target_layer_ids": list(self.target_layer_ids)}
        if self.logit_softcap is not None:
            hf["dflash_config"]["final_logit_softcapping"] = self.logit_softcap
        for name in ("input_embedding_scale", "output_multiplier"):
            if getattr(self, name) != 1:
                hf["dflash_config"][name] = getattr(self, name)
        return hf

    def check_target(self, target_config: ModelConfig) -> None:
        """Raises ValueError unless the drafter fits a target of this config."""
        m, t = self.model, target_config
        if m.hidden_size != t.hidden_size:
            raise ValueError(f"drafter hidden_size {m.hidden_size} does not match the "
                             f"target's {t.hidden_size}")
        if m.vocab_size != t.vocab_size:
            raise ValueError(f"drafter vocab_size {m.vocab_size} does not match the "
                             f"target's {t.vocab_size}")
        if self.num_target_layers != t.num_layers:
            raise ValueError(f"drafter was made for a {self.num_target_layers}-layer "
                             f"target (num_target_layers) but the target has "
                             f"{t.num_layers} layers")
        bad = [i for i in self.target_layer_ids if not 0 <= i < t.num_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} do not exist in a target with "
                             f"{t.num_layers} layers")


class Drafter(nnx.Module):
    """DFlash drafter parameters (HF names: ``fc``, ``hidden_norm``, ``layers``, ``norm``).

    Attributes:
      config: the frozen `DrafterConfig`.
      dtype: parameter and activation dtype.
    """

    def __init__(self, config: DrafterConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        m = config.model
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.fc = Linear((config.feature_size,), (m.hidden_size,), ("mlp",), ("embed",),
                         use_bias=False, dtype=dtype, rngs=rngs)
        self.hidden_norm = RMSNorm(m.hidden_size, eps=m.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.layers = stacked_layers(m, dtype=dtype, rngs=rngs)
        self.norm = RMSNorm(m.hidden_size, eps=m.rms_norm_eps, dtype=dtype, rngs=rngs)


# ----------------------------------------------------------------- context keys


@struct.dataclass
class DrafterCache:
    """Per-layer keys/values of the projected context, one slot per position.

    Attributes:
      k: [layers, B, L, kv_heads, head_dim], k-normed and roped context keys.
      v: [layers, B, L, kv_heads, head_dim], context values.
      lengths: int32 [B], context positions held per row (slots ``< lengths``).
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[1]


def init_drafter_cache(config: DrafterConfig, batch: int, max_len: int,
                       dtype=jnp.float32) -> DrafterCache:
    """An empty cache of ``max_len`` context slots for ``batch`` rows."""
    m = config.model
    shape = (m.num_layers, batch, max_len, m.num_kv_heads, m.head_dim)
    return DrafterCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                        lengths=jnp.zeros((batch,), jnp.int32))


def drafter_cache_shardings(config: DrafterConfig, batch: int, max_len: int, mesh):
    """NamedShardings (a `DrafterCache` of them) for a drafter cache on ``mesh``."""
    from tev_jax.sharding import logical_sharding

    m = config.model
    shape = (m.num_layers, batch, max_len, m.num_kv_heads, m.head_dim)
    kv = logical_sharding(CACHE_AXES, shape, mesh)
    return DrafterCache(k=kv, v=kv, lengths=logical_sharding(("batch",), (batch,), mesh))


def context_kv(drafter: Drafter, features_BTF: jax.Array, positions_BT: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
    """Every layer's keys and values of context features.

    Args:
      features_BTF: [B, T, len(taps) * D] target hidden states after the tapped layers.
      positions_BT: int [B, T] their absolute positions.
    Returns:
      (k, v), each [layers, B, T, kv_heads, head_dim]; keys k-normed and roped.
    """
    ctx = drafter.hidden_norm(drafter.fc(features_BTF.astype(drafter.dtype)))
    ctx = constrain(ctx, ("batch", "seq", "act_embed"))
    inv_freq = rope_inv_freq(drafter.config.model)
    graphdef, state = nnx.split(drafter.layers)

    def kv(layer_state):
        k, v = nnx.merge(graphdef, layer_state).self_attn.project_kv(ctx)
        return apply_rope(k, positions_BT, inv_freq), v

    return jax.vmap(kv)(state)


def append_context(drafter: Drafter, cache: DrafterCache, features_BTF: jax.Array,
                   num_new_B: jax.Array) -> DrafterCache:
    """Appends each row's newly committed context features to the cache.

    Row ``b`` appends ``features[b, :num_new[b]]`` at positions (and slots)
    ``lengths[b] ..``; the rest of ``features[b]`` is padding. Slots past ``L`` are
    dropped, so ``L`` must cover the longest context.

    Args:
      cache: `DrafterCache` with L slots.
      features_BTF: [B, T, len(taps) * D], T static (e.g. H + 1 for an accepted path).
      num_new_B: int [B], 0 <= num_new <= T.
    Returns:
      The cache with ``lengths + num_new`` positions per row.
    """
    t = features_BTF.shape[1]
    lengths = cache.lengths.astype(jnp.int32)
    offs = jnp.arange(t, dtype=jnp.int32)[None, :]
    positions = lengths[:, None] + offs
    k_new, v_new = context_kv(drafter, features_BTF, positions)
    num_new = num_new_B.astype(jnp.int32)
    # Padding entries go to an out-of-range slot and are dropped by the scatter.
    slots = jnp.where(offs < num_new[:, None], positions, cache.max_len)
    return DrafterCache(k=set_slots(cache.k, slots, k_new), v=set_slots(cache.v, slots, v_new),
                        lengths=lengths + num_new)


# ------------------------------------------------------------------ block forward


def _layers(drafter: Drafter, x_BQD, positions_BQ, block_mask, ctx_k, ctx_v, ctx_mask,
            remat=None):
    """All drafter layers (one scan) over Q block positions; returns the final-normed
    hidden.

    ``remat``: None, or a ``jax.checkpoint_policies`` policy: each layer is then
    rematerialised in the backward pass, saving what the policy allows.
    """
    inv_freq = rope_inv_freq(drafter.config.model)

    def body(layer, i, x):
        attend = lambda q, k, v: (attention(q, ((ctx_k, ctx_v, ctx_mask, i),
                                                (k, v, block_mask))), None)
        return layer(x, positions_BQ, inv_freq, attend)[0]

    x = scan_layers(drafter.layers, body, x_BQD.astype(drafter.dtype), remat=remat)
    return drafter.norm(x)


def _block_embeddings(drafter: Drafter, target, tokens):
    """The target's embeddings of the block tokens, times the drafter's
    ``input_embedding_scale``."""
    x = target.embed(tokens)
    scale = drafter.config.input_embedding_scale
    return x if scale == 1 else (x * scale).astype(x.dtype)


def draft_unembed(drafter: Drafter, target, hidden: jax.Array) -> jax.Array:
    """float32 draft logits [..., V]: the target's head on the drafter's final-normed
    hidden states, times the drafter's ``output_multiplier``, with the drafter's
    soft-cap (`DrafterConfig.logit_softcap`), not the target's."""
    logits = target.unembed(hidden, softcap=False) * drafter.config.output_multiplier
    cap = drafter.config.logit_softcap
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def draft_head(drafter: Drafter, target):
    """The `tev_jax.models.lm_head.Head` of the draft rows (the drafter's multiplier and
    soft-cap)."""
    from tev_jax.models import lm_head

    return lm_head.head_of(target).replace(softcap=drafter.config.logit_softcap,
                                           multiplier=drafter.config.output_multiplier)


def block_tokens(config: DrafterConfig, roots_B: jax.Array) -> jax.Array:
    """int32 [B, H + 1]: each root followed by H mask tokens."""
    b = roots_B.shape[0]
    masks = jnp.full((b, config.horizon), config.mask_token_id, jnp.int32)
    return jnp.concatenate([roots_B.astype(jnp.int32)[:, None], masks], axis=1)


def draft_hidden(drafter: Drafter, target, cache: DrafterCache, roots_B: jax.Array
                 ) -> jax.Array:
    """Final-normed drafter hidden states at block positions 1..H.

    The root of row ``b`` sits at position ``cache.lengths[b]`` and the block sees the
    cached context slots ``< lengths[b]``.

    Args:
      target: a model with ``embed(tokens)`` (the `Target`).
      cache: the context cache (already holding this round's new features).
      roots_B: int [B] root tokens (the last committed token not yet in the context).
    Returns:
      [B, H, D] in the drafter's dtype.
    """
    tokens = block_tokens(drafter.config, roots_B)
    b, q = tokens.shape
    lengths = cache.lengths.astype(jnp.int32)
    positions = lengths[:, None] + jnp.arange(q, dtype=jnp.int32)[None, :]
    h = _layers(drafter, _block_embeddings(drafter, target, tokens), positions, Mask(),
                cache.k, cache.v, Mask.prefix(lengths))
    return h[:, 1:]


def draft_logits(drafter: Drafter, target, cache: DrafterCache, roots_B: jax.Array
                 ) -> jax.Array:
    """float32 draft logits [B, H, V] of one block (see `draft_hidden`)."""
    return draft_unembed(drafter, target, draft_hidden(drafter, target, cache, roots_B))


def draft_step(drafter: Drafter, target, cache: DrafterCache, features_BTF: jax.Array,
               num_new_B: jax.Array, roots_B: jax.Array) -> tuple[jax.Array, DrafterCache]:
    """One drafting round: append the new context, then propose a block.

    Args:
      features_BTF: [B, T, len(taps) * D] features of the newly committed tokens.
      num_new_B: int [B] how many of them are real per row.
      roots_B: int [B] the next root tokens.
    Returns:
      (draft logits float32 [B, H, V], updated cache)
    """
    cache = append_context(drafter, cache, features_BTF, num_new_B)
    return draft_logits(drafter, target, cache, roots_B), cache


# ------------------------------------------------------------- training forward


def anchor_hidden(drafter: Drafter, target, features_BLF: jax.Array, tokens_BL: jax.Array,
                  anchors_BA: jax.Array, remat=None) -> jax.Array:
    """Drafter hidden states of A blocks per sequence in one forward (training).

    Block ``a`` of row ``b`` has root ``tokens[b, anchors[b, a]]`` at that position and
    sees the context features of positions ``< anchors[b, a]`` and its own block only.
    All blocks are the queries of one attention over [context ; all blocks] (static
    shapes): block a sees context keys ``< anchors[b, a]`` and the keys of block a.

    Args:
      features_BLF: [B, L, len(taps) * D] target features of every position.
      tokens_BL: int [B, L] the sequence's tokens.
      anchors_BA: int [B, A] anchor positions in [0, L).
      remat: None or a ``jax.checkpoint_policies`` policy (per-layer remat).
    Returns:
      [B, A, H, D] final-normed hidden states of block positions 1..H.
    """
    cfg = drafter.config
    b, seq_len = tokens_BL.shape
    a = anchors_BA.shape[1]
    q = cfg.block_size
    anchors = anchors_BA.astype(jnp.int32)
    positions_L = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (b, seq_len))
    ctx_k, ctx_v = context_kv(drafter, features_BLF, positions_L)
    roots = jnp.take_along_axis(tokens_BL.astype(jnp.int32), anchors, axis=1)   # [B, A]
    tokens = block_tokens(cfg, roots.reshape(-1)).reshape(b, a * q)
    offs = jnp.arange(q, dtype=jnp.int32)
    positions = (anchors[:, :, None] + offs).reshape(b, a * q)
    ctx_mask = Mask(end=jnp.repeat(anchors, q, axis=1))                  # [B, AQ]
    h = _layers(drafter, _block_embeddings(drafter, target, tokens), positions,
                Mask.blocks(a * q, q), ctx_k, ctx_v, ctx_mask, remat)
    return h.reshape(b, a, q, -1)[:, :, 1:]


def anchor_logits(drafter: Drafter, target, features_BLF: jax.Array, tokens_BL: jax.Array,
                  anchors_BA: jax.Array) -> jax.Array:
    """float32 draft logits [B, A, H, V] of A anchors per sequence (`anchor_hidden`)."""
    return draft_unembed(drafter, target,
                         anchor_hidden(drafter, target, features_BLF, tokens_BL, anchors_BA))


__all__ = [
    "Drafter", "DrafterCache", "DrafterConfig", "anchor_hidden", "anchor_logits",
    "append_context", "block_tokens", "context_kv", "default_target_layer_ids",
    "draft_head", "draft_hidden", "draft_logits", "draft_step", "draft_unembed",
    "drafter_cache_shardings", "init_drafter_cache",
]
