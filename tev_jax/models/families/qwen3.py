"""The Qwen3-style families: Qwen3, Llama-3 and Qwen3-MoE (docs/design.md §6, §14).

One pre-norm decoder block (`tev_jax.models.layers.DecoderLayer`: GQA attention with
RoPE, a gated MLP) serves all three; they differ in data:

- ``qwen3``: per-head q/k RMSNorm, ``head_dim`` 128 unless given;
- ``llama``: no q/k norm, ``head_dim = D / heads`` unless given, llama3 RoPE scaling;
- ``qwen3_moe``: Qwen3 whose MLPs are dropless mixtures of experts
  (`tev_jax.models.moe.MoE`) on the layers HF's ``decoder_sparse_step`` /
  ``mlp_only_layers`` rule picks, each expert stored as its own tensors
  (``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``).

Both transformers spellings of RoPE are read: 4.x ``rope_theta`` + ``rope_scaling``
and 5.x ``rope_parameters``.
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from tev_jax.models import registry
from tev_jax.models.checkpoint_io import EXPERT_FIELD
from tev_jax.models.config import SUPPORTED_ROPE_TYPES, LayerSpec, ModelConfig, RopeScaling
from tev_jax.models.layers import DecoderLayer
from tev_jax.models.moe import MoE

MODEL_TYPES = ("qwen3", "llama", "qwen3_moe")
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}


def decoder_layer(config: ModelConfig, spec: LayerSpec, *, dtype, rngs: nnx.Rngs,
                  sub: int = 0) -> DecoderLayer:
    """The Qwen3-style block of ``spec``: a dense gated MLP, or a `MoE`."""
    mlp = (None if spec.moe is None else
           MoE(config.hidden_size, spec.moe, dtype=dtype, rngs=rngs))
    return DecoderLayer(config, spec, dtype=dtype, rngs=rngs, sub=sub, mlp=mlp)


def layer_tensor(prefix: str, rest: tuple) -> tuple[str, int] | None:
    """A mixture's experts (``('mlp', 'experts', proj)``): one tensor per expert."""
    if rest[:2] == ("mlp", "experts"):
        return prefix + f"mlp.experts.{EXPERT_FIELD}.{rest[2]}.weight", 1
    return None


def parse_rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, rope_scaling) from either the 4.x or the 5.x spelling."""
    params = hf.get("rope_scaling")
    if params is None:
        params = hf.get("rope_parameters")
    params = dict(params or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError(
            "unsupported per-layer-type rope_parameters; supported: one rope config"
        )
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r}; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("unsupported feature partial_rotary_factor != 1")
    if rope_type == "default":
        return float(theta), None

    def field(key):
        if params.get(key) is None:
            raise ValueError(f"rope_scaling of type {rope_type!r} is missing {key!r}")
        return params[key]

    if rope_type == "linear":
        return float(theta), RopeScaling("linear", float(field("factor")))
    return float(theta), RopeScaling(
        "llama3",
        float(field("factor")),
        float(field("low_freq_factor")),
        float(field("high_freq_factor")),
        int(field("original_max_position_embeddings")),
    )


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """A `ModelConfig` from a Qwen3 / Llama / Qwen3-MoE ``config.json`` dict.

    Raises:
      ValueError: unsupported rope type, sliding window, MLP bias, activation, shared
        experts, or a missing required field (named in the message).
    """
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: "
                         f"{', '.join(MODEL_TYPES)}")

    def req(key):
        if key not in hf or hf[key] is None:
            raise ValueError(f"config.json is missing required field {key!r}")
        return hf[key]

    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}; supported: silu")
    if hf.get("mlp_bias", False):
        raise ValueError("unsupported feature mlp_bias=True; supported: mlp_bias=False")
    if hf.get("use_sliding_window", False):
        raise ValueError(
            "unsupported feature use_sliding_window=True; supported: full attention"
        )
    layer_types = hf.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        raise ValueError(
            f"unsupported layer_types {sorted(set(layer_types))}; "
            "supported: full_attention"
        )
    if hf.get("pretraining_tp", 1) not in (1, None):
        raise ValueError("unsupported feature pretraining_tp > 1")

    hidden = int(req("hidden_size"))
    heads = int(req("num_attention_heads"))
    kv_heads = hf.get("num_key_value_heads")
    kv_heads = heads if kv_heads is None else int(kv_heads)
    head_dim = hf.get("head_dim")
    if head_dim is None:
        # transformers' defaults: Qwen3Config.head_dim = 128; Llama: D / heads.
        head_dim = 128 if model_type == "qwen3" else hidden // heads

    rope_theta, rope_scaling = parse_rope(hf)
    eos = hf.get("eos_token_id")
    eos = () if eos is None else (tuple(int(e) for e in eos)
                                  if isinstance(eos, (list, tuple)) else (int(eos),))
    bos = hf.get("bos_token_id")
    moe = {}
    if model_type == "qwen3_moe":
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        if experts is None:
            raise ValueError("config.json is missing required field 'num_experts'")
        if hf.get("shared_expert_intermediate_size"):
            raise ValueError("unsupported feature shared experts; supported: none")
        moe = dict(
            num_experts=int(experts),
            num_experts_per_tok=int(req("num_experts_per_tok")),
            moe_intermediate_size=int(req("moe_intermediate_size")),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
        )
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(req("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(req("intermediate_size")),
        num_layers=int(req("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(head_dim),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        attention_bias=bool(hf.get("attention_bias", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos,
        **moe,
    )


def config_to_hf(config: ModelConfig, *, dtype: str = "float32") -> dict[str, Any]:
    """A ``config.json`` dict that transformers 4.x and 5.x both read."""
    c = config
    rope_params: dict[str, Any] = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling is not None:
        rope_params = {**c.rope_scaling.to_hf(), "rope_theta": c.rope_theta}
    d: dict[str, Any] = {
        "architectures": [ARCHITECTURES[c.model_type]],
        "model_type": c.model_type,
        **c.dims_hf(),
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": c.attention_bias,
        "attention_dropout": 0.0,
        "max_position_embeddings": c.max_position_embeddings,
        "rope_theta": c.rope_theta,
        "rope_scaling": None if c.rope_scaling is None else c.rope_scaling.to_hf(),
        "rope_parameters": rope_params,
        "torch_dtype": dtype,
        "dtype": dtype,
        "use_cache": True,
    }
    if c.model_type == "llama":
        d["mlp_bias"] = False
    else:
        d["use_sliding_window"] = False
    if c.model_type == "qwen3_moe":
        d.update(num_experts=c.num_experts,
                 num_experts_per_tok=c.num_experts_per_tok,
                 moe_intermediate_size=c.moe_intermediate_size,
                 norm_topk_prob=c.norm_topk_prob,
                 decoder_sparse_step=c.decoder_sparse_step,
                 mlp_only_layers=list(c.mlp_only_layers))
    return d | c.special_tokens_hf()


FAMILY = registry.register(registry.Family(
    name="qwen3", model_types=MODEL_TYPES, read_config=config_from_hf,
    write_config=config_to_hf, decoder_layer=decoder_layer, layer_tensor=layer_tensor))
