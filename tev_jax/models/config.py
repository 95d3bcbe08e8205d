"""The target's architecture as a frozen, hashable dataclass (docs/design.md §6, §14).

`ModelConfig` is static: it decides shapes, so it is passed to jitted code as a static
argument. It is built from a Hugging Face ``config.json`` dict with `ModelConfig.from_hf`
(both the transformers 4.x spelling ``rope_theta`` + ``rope_scaling`` and the 5.x
spelling ``rope_parameters`` are accepted) and written back with `ModelConfig.to_hf`.

A family is data, not a branch: `ModelConfig.layer_specs` gives each decoder layer's
`LayerSpec` (its attention, `AttentionSpec`: window, head dim, key/value heads, k = v,
RoPE; its MLP: dense or a mixture of experts, `MoeSpec`), and `ModelConfig.period` the
shortest repeating run of specs, which is what the scanned layer stack scans over
(`tev_jax.models.layers.stacked_layers`). Model-wide choices (norm style, activation,
embedding scale, logit soft-cap, sandwich norms with a layer scalar) are fields of
`ModelConfig`.

Which ``model_type`` values exist, and how each family reads and writes its
``config.json``, is the families' business (`tev_jax.models.registry`; the families
themselves are in `tev_jax.models.families`): this module imports none of them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tev_jax.models import registry

ATTENTION_WINDOWS = ("native", "full")
LAYER_TYPES = ("full_attention", "sliding_attention")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class MoeSpec:
    """A dropless mixture of SwiGLU experts (`tev_jax.models.moe`).

    Attributes:
      num_experts: E.
      top_k: experts per token (k).
      expert_size: each expert's intermediate width.
      norm_topk_prob: renormalise the k routing probabilities to sum to 1.
    """

    num_experts: int
    top_k: int
    expert_size: int
    norm_topk_prob: bool


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """One layer's attention.

    Attributes:
      head_dim: per-head width hd.
      num_kv_heads: key/value heads K.
      window: None (global) or W: a query at position p sees keys at positions
        ``> p - W`` (itself and the W - 1 before it; transformers' sliding window).
      k_eq_v: no value projection; values are the (un-normed, un-roped) key projection.
      rope_theta: RoPE base.
      rotary_fraction: the fraction of the hd/2 frequencies that rotate ('proportional'
        RoPE: the others have frequency 0, with exponents over the whole hd).
    """

    head_dim: int
    num_kv_heads: int
    window: int | None = None
    k_eq_v: bool = False
    rope_theta: float = 10000.0
    rotary_fraction: float = 1.0


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """What one decoder layer is: its attention (an `AttentionSpec`; None = the
    config's default, `ModelConfig.attention_spec`) and its MLP, dense (``moe`` None)
    or a `MoeSpec`."""

    moe: MoeSpec | None = None
    attention: AttentionSpec | None = None


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (hashable).

    Attributes:
      rope_type: 'linear' (positions divided by ``factor``) or 'llama3'.
      factor: the scaling factor.
      low_freq_factor, high_freq_factor, original_max_position_embeddings: llama3 only.
    """

    rope_type: str
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None

    def to_hf(self) -> dict[str, Any]:
        d: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type == "llama3":
            d["low_freq_factor"] = self.low_freq_factor
            d["high_freq_factor"] = self.high_freq_factor
            d["original_max_position_embeddings"] = self.original_max_position_embeddings
        return d


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer of a registered family (`tev_jax.models.registry`).

    Attributes:
      model_type: the family's name for it: 'qwen3' (per-head q/k RMSNorm), 'llama' (no
        q/k norm), 'qwen3_moe', 'gemma4_unified_text' (`tev_jax.models.families`).
      vocab_size: V, rows of the embedding (may exceed the tokenizer's vocabulary).
      hidden_size: D.
      intermediate_size: width of the SwiGLU MLP.
      num_layers: decoder layers.
      num_heads, num_kv_heads: query heads and key/value heads (GQA).
      head_dim: per-head width, independent of D.
      rope_theta: RoPE base.
      rope_scaling: None or a `RopeScaling`.
      rms_norm_eps: RMSNorm epsilon.
      tie_word_embeddings: lm_head shares the embedding matrix.
      qk_norm: per-head RMSNorm on queries and keys (Qwen3).
      attention_bias: biases on the q/k/v/o projections.
      max_position_embeddings: informational (written back to config.json).
      bos_token_id, eos_token_ids: special tokens from config.json (informational).
      num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob: the
        mixture of experts of 'qwen3_moe' (0 experts: every MLP dense).
      decoder_sparse_step, mlp_only_layers: which layers have the mixture (HF's rule:
        layer i unless i is in ``mlp_only_layers`` or (i + 1) % step != 0); the others
        a dense MLP of ``intermediate_size``.
      layer_types: per layer 'full_attention' or 'sliding_attention' (empty: all full).
      sliding_window: W of the sliding layers.
      global_attention: the `AttentionSpec` of 'full_attention' layers when it is not
        the default one (Gemma 4: wider heads, one k = v head, partial RoPE).
      attention_window: 'native' (sliding layers slide) or 'full' (every layer global,
        as the DFlash authors ran Gemma); a runtime choice, not written to config.json.
      norm_style: 'cast' (normalise in float32, cast, then scale: Qwen3 / Llama) or
        'float32' (scale in float32, then cast: Gemma 4); the scale is ``w`` either way.
      sandwich_norms: Gemma 4's four norms per layer (input, post-attention on the
        attention output, pre- and post-feed-forward) and a learned ``layer_scalar``
        multiplying the layer's output (`tev_jax.models.families.gemma4`).
      v_norm: a weightless RMSNorm on the values.
      attention_scale: score scale (None: hd ** -0.5).
      hidden_act: the gated MLP's activation, 'silu' (SwiGLU) or 'gelu_tanh' (GeGLU).
      embed_scale: embeddings multiplied by it (cast to the model dtype; None: 1).
      final_logit_softcap: logits become ``c * tanh(logits / c)`` (None: none).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    global_attention: AttentionSpec | None = None
    attention_window: str = "native"
    norm_style: str = "cast"
    sandwich_norms: bool = False
    v_norm: bool = False
    attention_scale: float | None = None
    hidden_act: str = "silu"
    embed_scale: float | None = None
    final_logit_softcap: float | None = None

    def __post_init__(self):
        registry.family(self.model_type)  # ValueError naming the supported ones
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None and self.rope_scaling.rope_type not in (
            "linear", "llama3"
        ):
            raise ValueError(
                f"unsupported rope_scaling type {self.rope_scaling.rope_type!r}; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.num_experts:
            for name in ("num_experts_per_tok", "moe_intermediate_size",
                         "decoder_sparse_step"):
                v = getattr(self, name)
                if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                    raise ValueError(f"{name} must be a positive int with num_experts "
                                     f"> 0, got {v!r}")
            if self.num_experts_per_tok > self.num_experts:
                raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) "
                                 f"exceeds num_experts ({self.num_experts})")
            bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
            if bad:
                raise ValueError(f"mlp_only_layers {bad} outside [0, {self.num_layers})")
        elif self.num_experts < 0:
            raise ValueError(f"num_experts must be >= 0, got {self.num_experts}")
        self._check_attention()

    def _check_attention(self):
        if self.attention_window not in ATTENTION_WINDOWS:
            raise ValueError(f"attention_window must be one of {ATTENTION_WINDOWS}, got "
                             f"{self.attention_window!r}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_layers} layers")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"unknown layer type(s) {bad}; supported: {', '.join(LAYER_TYPES)}")
        if "sliding_attention" in self.layer_types and not (
                isinstance(self.sliding_window, int) and self.sliding_window >= 1):
            raise ValueError("sliding_attention layers need a sliding_window >= 1, got "
                             f"{self.sliding_window!r}")
        if self.norm_style not in ("cast", "float32"):
            raise ValueError(f"norm_style must be 'cast' or 'float32', got {self.norm_style!r}")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"hidden_act must be 'silu' or 'gelu_tanh', got "
                             f"{self.hidden_act!r}")
        if self.final_logit_softcap is not None and not self.final_logit_softcap > 0:
            raise ValueError(f"final_logit_softcap must be > 0 or None, got "
                             f"{self.final_logit_softcap!r}")
        for a in {s.attention for s in self.layer_specs}:
            if a.head_dim <= 0 or a.head_dim % 2 or a.num_kv_heads <= 0 \
                    or self.num_heads % a.num_kv_heads:
                raise ValueError(f"attention {a}: head_dim must be even and positive and "
                                 f"num_kv_heads divide num_heads ({self.num_heads})")
            if not 0.0 < a.rotary_fraction <= 1.0:
                raise ValueError(f"rotary_fraction must be in (0, 1], got {a.rotary_fraction}")

    @property
    def attention_spec(self) -> AttentionSpec:
        """The default (global) attention: the config's head_dim, kv heads and θ."""
        return AttentionSpec(self.head_dim, self.num_kv_heads, None, False,
                             float(self.rope_theta), 1.0)

    def layer_attention(self, i: int) -> AttentionSpec:
        """Layer i's `AttentionSpec` (with ``attention_window='full'`` never a window)."""
        kind = self.layer_types[i] if self.layer_types else "full_attention"
        if kind == "full_attention":
            return self.global_attention or self.attention_spec
        window = None if self.attention_window == "full" else self.sliding_window
        return dataclasses.replace(self.attention_spec, window=window)

    @property
    def layer_specs(self) -> tuple[LayerSpec, ...]:
        """Each decoder layer's `LayerSpec`, in order."""
        moe = (None if not self.num_experts else
               MoeSpec(self.num_experts, self.num_experts_per_tok,
                       self.moe_intermediate_size, self.norm_topk_prob))
        return tuple(LayerSpec(moe if moe is not None and i not in self.mlp_only_layers
                               and (i + 1) % self.decoder_sparse_step == 0 else None,
                               self.layer_attention(i))
                     for i in range(self.num_layers))

    @property
    def uniform_attention_shapes(self) -> bool:
        """Whether every layer's keys/values have one shape (one stacked cache array)."""
        return len({(s.attention.num_kv_heads, s.attention.head_dim)
                    for s in self.layer_specs}) == 1

    @property
    def period(self) -> int:
        """The shortest p dividing num_layers with spec(i) == spec(i mod p) for all i:
        the layers the scanned stack holds per step (1 for a uniform stack)."""
        specs = self.layer_specs
        n = len(specs)
        return next(p for p in range(1, n + 1)
                    if n % p == 0 and all(specs[i] == specs[i % p] for i in range(n)))

    def _param_counts(self, active: bool) -> int:
        d, f = self.hidden_size, self.intermediate_size
        total = 0
        for spec in self.layer_specs:
            a = spec.attention
            hd, kv = a.head_dim, a.num_kv_heads
            projections = 2 * self.num_heads + (1 if a.k_eq_v else 2) * kv
            attn = d * hd * projections
            if self.attention_bias:
                attn += hd * (self.num_heads + (1 if a.k_eq_v else 2) * kv) + d
            norms = ((4 * d + 1) if self.sandwich_norms else 2 * d) + (
                2 * hd if self.qk_norm else 0)
            if spec.moe is None:
                mlp = 3 * d * f
            else:
                e = spec.moe.top_k if active else spec.moe.num_experts
                mlp = d * spec.moe.num_experts + 3 * e * d * spec.moe.expert_size
            total += attn + mlp + norms
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return total + emb + d

    @property
    def num_params(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        return self._param_counts(active=False)

    @property
    def num_active_params(self) -> int:
        """Parameters one token reads: a mixture counts only its k experts (and the
        router); equals `num_params` for a dense model."""
        return self._param_counts(active=True)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Builds a config from a Hugging Face ``config.json`` dict, through the family
        registered for its ``model_type``.

        Raises:
          ValueError: unsupported model_type, or what the family does not support (a
            rope type, a sliding window, an activation, ...) or a missing required
            field (named in the message).
        """
        return registry.family_of_hf(hf).read_config(hf)

    def to_hf(self, *, dtype: str = "float32") -> dict[str, Any]:
        """A ``config.json`` dict that transformers reads (its family's writer; Gemma 4:
        the text-only ``gemma4_unified_text`` config, transformers 5.x)."""
        return registry.family(self.model_type).write_config(self, dtype=dtype)

    def dims_hf(self) -> dict[str, Any]:
        """The shape fields every family's ``config.json`` shares (vocabulary, widths,
        layers, heads)."""
        return {"vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
                "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim}

    def special_tokens_hf(self) -> dict[str, Any]:
        """The ``bos_token_id`` / ``eos_token_id`` fields of a ``config.json`` (those set)."""
        d: dict[str, Any] = {}
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            d["eos_token_id"] = (self.eos_token_ids[0] if len(self.eos_token_ids) == 1
                                 else list(self.eos_token_ids))
        return d

