"""Gemma 4 (``gemma4_unified``, its text part ``gemma4_unified_text``) as data (docs/design.md §14).

Where Gemma 4 differs from Qwen3 is in `ModelConfig` fields and per-layer
`AttentionSpec`s, read from ``config.json`` here (`config_from_hf`, `config_to_hf`):

- layers ``(i + 1) % 6 == 0`` (and the last) are global, the others slide with window W
  (a query at position p sees keys at positions ``> p - W``); the layer stack scans
  the period of 5 sliding + 1 global layers;
- sliding layers: the config's head_dim / key-value heads, RoPE θ 1e4; global layers
  (``per_layer_config``, or ``global_head_dim`` / ``num_global_key_value_heads``):
  wider heads, with ``attention_k_eq_v`` one key-value head and no ``v_proj`` (values
  are the key projection), 'proportional' RoPE (θ 1e6, a quarter of the frequencies);
- q-, k- and a weightless v-norm, attention scale 1, RMSNorm scaled by ``w`` in
  float32, GeGLU (gelu-tanh), embeddings times √D (cast to the model dtype), tied LM
  head with the final logit soft-cap ``c · tanh(x / c)``;
- four norms per layer and a learned ``layer_scalar`` (`SandwichLayer`).

Checkpoints (`tev_jax.models.checkpoint_io`): the text-only layout (``model.*``) and
the unified one, whose text weights sit under ``model.language_model.*``
(`UNIFIED_TEXT_PREFIX`) beside the vision / audio embedders (skipped); we write the
text-only layout.

The family registers itself (`tev_jax.models.registry`) for ``gemma4_unified_text``
and reads ``gemma4_unified`` config.json files too.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from tev_jax.models import registry
from tev_jax.models.config import LAYER_TYPES, AttentionSpec, LayerSpec, ModelConfig
from tev_jax.models.layers import DecoderLayer, make_param, norm
from tev_jax.sharding import constrain

MODEL_TYPE = "gemma4_unified_text"
UNIFIED_MODEL_TYPE = "gemma4_unified"
UNIFIED_TEXT_PREFIX = "model.language_model."

# transformers' Gemma4UnifiedTextConfig defaults: save_pretrained omits fields equal to
# them, so a config.json may lack any of these.
TEXT_DEFAULTS = {
    "vocab_size": 262_144, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 30, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 262_144, "rms_norm_eps": 1e-6, "eos_token_id": 1,
    "bos_token_id": 2, "tie_word_embeddings": True, "attention_bias": False,
    "sliding_window": 1024, "final_logit_softcapping": None,
    "use_bidirectional_attention": "vision", "attention_k_eq_v": False,
    "num_kv_shared_layers": 0, "use_double_wide_mlp": False, "global_head_dim": 512,
}
DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                       "rope_theta": 1_000_000.0},
}
SLIDING_PATTERN = 6


class SandwichLayer(DecoderLayer):
    """Gemma 4's decoder layer: norms around the attention and the MLP, then a scalar.

    ``x += post_attention_norm(attn(input_norm(x)))``;
    ``x += post_feedforward_norm(mlp(pre_feedforward_norm(x)))``; ``x *= layer_scalar``
    (HF names: input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,
    post_feedforward_layernorm, layer_scalar).
    """

    def __init__(self, config: ModelConfig, spec: LayerSpec = LayerSpec(), *, dtype,
                 rngs: nnx.Rngs, sub: int = 0, mlp: nnx.Module | None = None):
        super().__init__(config, spec, dtype=dtype, rngs=rngs, sub=sub, mlp=mlp)
        d = config.hidden_size
        self.pre_feedforward_layernorm = norm(config, d, dtype=dtype, rngs=rngs)
        self.post_feedforward_layernorm = norm(config, d, dtype=dtype, rngs=rngs)
        self.layer_scalar = make_param(rngs, (1,), dtype, ("norm",), "ones")

    def __call__(self, x_BTD: jax.Array, positions_BT: jax.Array, inv_freq, attend):
        """As `DecoderLayer.__call__`."""
        h = self.input_layernorm(x_BTD)
        q, k, v = self.self_attn.qkv(h, positions_BT, inv_freq)
        a, aux = attend(q, k, v)
        x = x_BTD + self.post_attention_layernorm(self.self_attn.out(a))
        x = constrain(x, ("batch", "seq", "act_embed"))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x * self.layer_scalar[...]
        return constrain(x, ("batch", "seq", "act_embed")), aux


# ------------------------------------------------------------------------ config.json


def _rope(params: dict, kind: str) -> tuple[float, float]:
    """(θ, rotary fraction) of one layer type's RoPE parameters."""
    p = params.get(kind)
    if not isinstance(p, dict):
        raise ValueError(f"rope_parameters is missing the {kind!r} entry")
    rope_type = p.get("rope_type", "default")
    if rope_type not in ("default", "proportional"):
        raise ValueError(f"unsupported rope type {rope_type!r} for {kind} layers; "
                         "supported: default, proportional")
    if p.get("factor", 1.0) != 1.0:
        raise ValueError(f"unsupported rope factor {p['factor']} for {kind} layers")
    if "rope_theta" not in p:
        raise ValueError(f"rope_parameters[{kind!r}] is missing 'rope_theta'")
    fraction = p.get("partial_rotary_factor", 1.0) if rope_type == "proportional" else 1.0
    return float(p["rope_theta"]), float(1.0 if fraction is None else fraction)


def _global_shape(text: dict, layer_types: list[str], kv_heads: int) -> tuple[int, int]:
    """(head_dim, kv heads) of the global layers: ``per_layer_config`` or the
    ``global_head_dim`` / ``num_global_key_value_heads`` fields (transformers' rule)."""
    per_layer = text.get("per_layer_config")
    if per_layer is None:
        head_dim = int(text.get("global_head_dim", TEXT_DEFAULTS["global_head_dim"]))
        glob_kv = text.get("num_global_key_value_heads")
        return head_dim, (int(glob_kv) if glob_kv is not None and text["attention_k_eq_v"]
                          else kv_heads)
    if not isinstance(per_layer, dict):
        raise ValueError(f"per_layer_config must be an object, got {per_layer!r}")
    shapes = set()
    for key, over in per_layer.items():
        i = int(key)
        if not 0 <= i < len(layer_types):
            raise ValueError(f"per_layer_config names layer {i}, outside "
                             f"[0, {len(layer_types)})")
        extra = sorted(set(over) - {"head_dim", "num_key_value_heads"})
        if extra:
            raise ValueError(f"unsupported per_layer_config field(s) {extra} (layer {i})")
        if layer_types[i] != "full_attention":
            raise ValueError(f"per_layer_config overrides sliding layer {i}; supported: "
                             "overrides of full_attention layers")
        shapes.add((int(over.get("head_dim", text["head_dim"])),
                    int(over.get("num_key_value_heads", kv_heads))))
    missing = [i for i, t in enumerate(layer_types)
               if t == "full_attention" and i not in {int(k) for k in per_layer}]
    if len(shapes) > 1 or (shapes and missing):
        raise ValueError("unsupported: full_attention layers of different head shapes "
                         f"({sorted(shapes)}{' and the default' if missing else ''})")
    return shapes.pop() if shapes else (int(text["head_dim"]), kv_heads)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """A `ModelConfig` from a Gemma 4 ``config.json`` (unified, or text only).

    Missing fields take transformers' defaults (`TEXT_DEFAULTS`), as transformers does.

    Raises:
      ValueError: no ``text_config`` in a unified config, an unknown layer type,
        unsupported features (KV sharing, bidirectional text attention, attention
        biases, another activation or RoPE type), malformed ``per_layer_config``.
    """
    if hf.get("model_type") == UNIFIED_MODEL_TYPE:
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise ValueError("gemma4_unified config.json is missing required field "
                             "'text_config'")
        text = {**text, "tie_word_embeddings": hf.get("tie_word_embeddings", True)}
    else:
        text = hf
    text = {**TEXT_DEFAULTS, **{k: v for k, v in text.items() if v is not None
                                or k == "final_logit_softcapping"}}
    if text.get("model_type", "gemma4_unified_text") != "gemma4_unified_text":
        raise ValueError(f"text_config model_type {text['model_type']!r}; expected "
                         "'gemma4_unified_text'")
    if text["num_kv_shared_layers"]:
        raise ValueError("unsupported feature num_kv_shared_layers > 0 (KV sharing)")
    if text["use_bidirectional_attention"] == "all":
        raise ValueError("unsupported feature use_bidirectional_attention='all'")
    if text["attention_bias"]:
        raise ValueError("unsupported feature attention_bias=True")
    if text["hidden_activation"] not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"unsupported hidden_activation {text['hidden_activation']!r}; "
                         "supported: gelu_pytorch_tanh")
    n = int(text["num_hidden_layers"])
    layer_types = text.get("layer_types")
    if layer_types is None:
        layer_types = ["sliding_attention" if (i + 1) % SLIDING_PATTERN else "full_attention"
                       for i in range(n)]
    layer_types = list(layer_types)
    if len(layer_types) != n:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {n} layers")
    bad = sorted(set(layer_types) - set(LAYER_TYPES))
    if bad:
        raise ValueError(f"unknown layer type(s) {bad}; supported: {', '.join(LAYER_TYPES)}")
    layer_types[-1] = "full_attention"  # transformers forces the last layer global
    rope = text.get("rope_parameters") or DEFAULT_ROPE
    sliding_theta, sliding_fraction = _rope(rope, "sliding_attention") \
        if "sliding_attention" in layer_types else (10_000.0, 1.0)
    if sliding_fraction != 1.0:
        raise ValueError("unsupported: partial RoPE in sliding layers")
    global_theta, global_fraction = _rope(rope, "full_attention")
    kv_heads = int(text["num_key_value_heads"])
    head_dim, global_kv = _global_shape(text, layer_types, kv_heads)
    eos = text["eos_token_id"]
    eos = tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    hidden = int(text["hidden_size"])
    softcap = text["final_logit_softcapping"]
    return ModelConfig(
        model_type="gemma4_unified_text",
        vocab_size=int(text["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(text["intermediate_size"]),
        num_layers=n,
        num_heads=int(text["num_attention_heads"]),
        num_kv_heads=kv_heads,
        head_dim=int(text["head_dim"]),
        rope_theta=sliding_theta,
        rms_norm_eps=float(text["rms_norm_eps"]),
        tie_word_embeddings=bool(text["tie_word_embeddings"]),
        qk_norm=True,
        max_position_embeddings=int(text["max_position_embeddings"]),
        bos_token_id=int(text["bos_token_id"]),
        eos_token_ids=eos,
        layer_types=tuple(layer_types),
        sliding_window=int(text["sliding_window"]),
        global_attention=AttentionSpec(head_dim, global_kv, None,
                                       bool(text["attention_k_eq_v"]), global_theta,
                                       global_fraction),
        norm_style="float32",
        sandwich_norms=True,
        v_norm=True,
        attention_scale=1.0,
        hidden_act="gelu_tanh",
        embed_scale=hidden ** 0.5,
        final_logit_softcap=None if softcap is None else float(softcap),
    )


def config_to_hf(config: ModelConfig, *, dtype: str = "float32") -> dict[str, Any]:
    """The text-only ``config.json`` (``Gemma4UnifiedForCausalLM``) of a Gemma 4 config."""
    c = config
    g = c.global_attention or c.attention_spec
    full = {"rope_type": "default", "rope_theta": g.rope_theta}
    if g.rotary_fraction != 1.0:
        full = {"rope_type": "proportional", "partial_rotary_factor": g.rotary_fraction,
                "rope_theta": g.rope_theta}
    layer_types = list(c.layer_types) or ["full_attention"] * c.num_layers
    d: dict[str, Any] = {
        "architectures": ["Gemma4UnifiedForCausalLM"],
        "model_type": "gemma4_unified_text",
        **c.dims_hf(),
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": c.rope_theta},
            "full_attention": full},
        "sliding_window": c.sliding_window if c.sliding_window is not None else 1024,
        "layer_types": layer_types,
        "final_logit_softcapping": c.final_logit_softcap,
        "attention_k_eq_v": g.k_eq_v,
        "num_kv_shared_layers": 0,
        "use_double_wide_mlp": False,
        "per_layer_config": {str(i): {"head_dim": g.head_dim,
                                      "num_key_value_heads": g.num_kv_heads}
                             for i, t in enumerate(layer_types) if t == "full_attention"},
        "torch_dtype": dtype,
        "dtype": dtype,
        "use_cache": True,
    }
    return d | c.special_tokens_hf()


# ------------------------------------------------------------------------ registry


def decoder_layer(config: ModelConfig, spec: LayerSpec, *, dtype, rngs: nnx.Rngs,
                  sub: int = 0) -> DecoderLayer:
    """A `SandwichLayer` (a plain `DecoderLayer` if the config turns
    ``sandwich_norms`` off)."""
    cls = SandwichLayer if config.sandwich_norms else DecoderLayer
    return cls(config, spec, dtype=dtype, rngs=rngs, sub=sub)


def checkpoint_prefix(hf: dict[str, Any]) -> str | None:
    """A unified checkpoint's text weights are under `UNIFIED_TEXT_PREFIX`."""
    return UNIFIED_TEXT_PREFIX if hf.get("model_type") == UNIFIED_MODEL_TYPE else None


def foreign_tensors(hf: dict[str, Any], names) -> list[str]:
    """The vision / audio tensors of a unified checkpoint."""
    if hf.get("model_type") != UNIFIED_MODEL_TYPE:
        return []
    return [n for n in names if not n.startswith(UNIFIED_TEXT_PREFIX)]


FAMILY = registry.register(registry.Family(
    name="gemma4", model_types=(MODEL_TYPE,), read_config=config_from_hf,
    write_config=config_to_hf, decoder_layer=decoder_layer,
    hf_model_types=(UNIFIED_MODEL_TYPE,), checkpoint_prefix=checkpoint_prefix,
    foreign_tensors=foreign_tensors))
