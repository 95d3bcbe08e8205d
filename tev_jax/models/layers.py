"""Transformer building blocks shared by the target and the DFlash drafter.

Everything follows the Hugging Face Qwen3 / Llama conventions exactly (so checkpoints
load without reordering): RMSNorm computed in float32 and cast back before the weight,
SwiGLU MLP, rotate-half RoPE, GQA attention with scale ``head_dim ** -0.5``.

Parameter layouts (kernels are stored input-major; `checkpoint_io` transposes the
PyTorch ``[out, in]`` weights once at load time):

===========  =====================  ==========================
parameter    shape                  logical axes
===========  =====================  ==========================
q_proj       [D, H, hd]             (embed, heads, head_dim)
k/v_proj     [D, K, hd]             (embed, kv_heads, head_dim)
o_proj       [H, hd, D]             (heads, head_dim, embed)
gate/up      [D, F]                 (embed, mlp)
down         [F, D]                 (mlp, embed)
norms        [D] or [hd]            (norm,)
===========  =====================  ==========================

A model's decoder layers are one module with stacked parameters (`stacked_layers`: a
leading ``layers`` axis on each of the above, e.g. q_proj [layers, D, H, hd]) run as one
``lax.scan`` (`scan_layers`), as maxtext's ``scan_layers``: the compiled program holds
one layer body whatever the depth; `scan_unroll` unrolls it. Layers that differ
(`ModelConfig.layer_specs`, e.g. dense and mixture-of-experts MLPs) are stacked by their
repeating period p (`ModelConfig.period`): one scan step runs a `LayerPeriod` of p
layers, so the program holds p layer bodies.

The attention pieces are separately callable so that the drafter can take queries from
its block and keys/values from ``[context ; block]``::

    q = attn.project_q(x_block)                      # [B, T, H, hd], q-normed
    k, v = attn.project_kv(x_ctx_and_block)          # [B, S, K, hd], k-normed
    q = apply_rope(q, pos_block, inv_freq); k = apply_rope(k, pos_kv, inv_freq)
    y = attn.out(attention(q, ((k, v, mask),)))      # [B, T, D], models/attention.py
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tev_jax.kernels.stacked_matmul import stacked_dot
from tev_jax.models import registry
from tev_jax.models.config import AttentionSpec, LayerSpec, ModelConfig
from tev_jax.models.layer_layout import is_per_layer
from tev_jax.sharding import constrain, variable_axes

_INIT_STD = 0.02


def make_param(rngs: nnx.Rngs | None, shape, dtype, axes, init: str, *,
               whole: bool = False) -> nnx.Param:
    """A parameter with logical axes and its initializer kind recorded as metadata.

    ``init`` is 'normal' (std 0.02), 'ones' or 'zeros'. `fast_init` uses the recorded
    kind to initialise a whole model in one jitted program. ``whole``: in a stacked
    layer, `scan_layers` hands the layer body the whole stack of this parameter (every
    layer) instead of layer i's slice, and the module indexes it with `stack_index`
    where it reads it: a slice fed to a loop or a kernel would be copied out of the
    stack first (a mixture's experts: the copy was twice the bytes the experts read).
    """
    if init == "normal":
        value = _INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)
    elif init == "ones":
        value = jnp.ones(shape, jnp.float32)
    else:
        value = jnp.zeros(shape, jnp.float32)
    return nnx.Param(value.astype(dtype), out_sharding=tuple(axes), eager_sharding=False,
                     initializer=init, whole_stack=whole)


def fast_init(abs_state: nnx.State, key: jax.Array) -> nnx.State:
    """Values for an abstract state (from ``nnx.eval_shape``): one draw per parameter.

    Equivalent in distribution to constructing the modules with ``rngs``, and cheap to
    compile: the layers' parameters are stacked, so a model has a dozen draws whatever
    its depth. Jit it, with ``out_shardings`` for a sharded model: each draw is then
    made in its final sharding (no device holds a whole parameter).
    """
    out = []
    for j, (path, v) in enumerate(nnx.to_flat_state(abs_state)):
        aval = v.get_value()
        kind = v.get_metadata().get("initializer")
        if kind == "normal":
            value = _INIT_STD * jax.random.normal(jax.random.fold_in(key, j), aval.shape,
                                                  jnp.float32)
        elif kind == "ones":
            value = jnp.ones(aval.shape, jnp.float32)
        else:
            value = jnp.zeros(aval.shape, jnp.float32)
        out.append((path, v.replace(value.astype(aval.dtype))))
    return nnx.from_flat_state(out)


@functools.lru_cache(maxsize=32)
def jitted_initializer(module_cls, config, dtype, mesh, rules):
    """(graphdef, jitted key -> state) for ``module_cls(config, dtype=, rngs=)``.

    Cached so repeated inits of one configuration compile once; the state is born with
    its shardings when ``mesh`` is given.
    """
    from tev_jax import sharding as shd

    abstract = nnx.eval_shape(lambda: module_cls(config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, abs_state = nnx.split(abstract)
    out_shardings = None if mesh is None else shd.state_shardings(abs_state, mesh, rules)
    return graphdef, jax.jit(lambda k: fast_init(abs_state, k), out_shardings=out_shardings)


class Linear(nnx.Module):
    """``y = x · kernel (+ bias)``, contracting the last ``len(in_shape)`` axes of x.

    The kernel has shape ``in_shape + out_shape`` (e.g. q_proj: (D,) + (H, hd)). In a
    layer scan that passes the Linear kernels whole (`scan_layers`' ``in_place``), it is
    the stack of every layer's, and the product reads entry `stack_index` of it
    (`stacked_dot`).
    """

    def __init__(self, in_shape: Sequence[int], out_shape: Sequence[int],
                 in_axes: Sequence[str], out_axes: Sequence[str], *, use_bias: bool,
                 dtype, rngs: nnx.Rngs):
        in_shape, out_shape = tuple(in_shape), tuple(out_shape)
        self.n_in, self.n_out = len(in_shape), len(out_shape)
        self.kernel = make_param(rngs, in_shape + out_shape, dtype,
                             tuple(in_axes) + tuple(out_axes), "normal")
        self.bias = (make_param(rngs, out_shape, dtype, out_axes, "zeros")
                     if use_bias else None)

    def _is_stack(self, k: jax.Array) -> bool:
        return k.ndim > self.n_in + self.n_out

    def weight(self) -> jax.Array:
        """This layer's kernel (entry `stack_index` of a whole stack)."""
        k = self.kernel[...]
        return k[stack_index()] if self._is_stack(k) else k

    def __call__(self, x: jax.Array) -> jax.Array:
        k = self.kernel[...]
        if self._is_stack(k):
            y = stacked_dot(x, k, stack_index(), self.n_in, variable_axes(self.kernel))
        else:
            y = jax.lax.dot_general(
                x.astype(k.dtype), k,
                ((tuple(range(x.ndim - self.n_in, x.ndim)), tuple(range(self.n_in))),
                 ((), ())))
        if self.bias is not None:
            y = y + self.bias[...]
        return y


class RMSNorm(nnx.Module):
    """HF RMSNorm ``x * rsqrt(mean(x^2) + eps) * w``, normalised in float32.

    ``style`` 'cast' (Qwen3 / Llama) casts the normalised x back to the input dtype
    before the scale; 'float32' (Gemma 4) scales in float32, then casts. ``with_scale``
    False: no weight (Gemma 4's v-norm).
    """

    def __init__(self, dim: int, *, eps: float, dtype, rngs: nnx.Rngs | None = None,
                 style: str = "cast", with_scale: bool = True):
        self.eps = float(eps)
        self.style = style
        self.weight = (make_param(rngs, (dim,), dtype, ("norm",), "ones") if with_scale
                       else None)

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        var = jnp.mean(xf * xf, axis=-1, keepdims=True)
        y = xf * jax.lax.rsqrt(var + self.eps)
        if self.weight is None:
            return y.astype(x.dtype)
        if self.style == "float32":
            return (y * self.weight[...].astype(jnp.float32)).astype(x.dtype)
        return self.weight[...] * y.astype(x.dtype)


def norm(config: ModelConfig, dim: int, *, dtype, rngs: nnx.Rngs | None) -> RMSNorm:
    """An `RMSNorm` of the config's style and epsilon."""
    return RMSNorm(dim, eps=config.rms_norm_eps, dtype=dtype, rngs=rngs,
                   style=config.norm_style)


class MLP(nnx.Module):
    """Gated MLP ``down(act(gate(x)) * up(x))``: SwiGLU (``act`` 'silu') or GeGLU
    ('gelu_tanh', the tanh approximation: transformers' gelu_pytorch_tanh)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype, rngs: nnx.Rngs,
                 act: str = "silu"):
        d, f = hidden_size, intermediate_size
        self.act = act
        self.gate_proj = Linear((d,), (f,), ("embed",), ("mlp",), use_bias=False,
                                dtype=dtype, rngs=rngs)
        self.up_proj = Linear((d,), (f,), ("embed",), ("mlp",), use_bias=False,
                              dtype=dtype, rngs=rngs)
        self.down_proj = Linear((f,), (d,), ("mlp",), ("embed",), use_bias=False,
                                dtype=dtype, rngs=rngs)

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        g = self.gate_proj(x_BTD)
        g = jax.nn.silu(g) if self.act == "silu" else jax.nn.gelu(g, approximate=True)
        h = g * self.up_proj(x_BTD)
        h = constrain(h, ("batch", "seq", "act_mlp"))
        return self.down_proj(h)


# ----------------------------------------------------------------------------- RoPE


def rope_inv_freq(config: ModelConfig, attention: AttentionSpec | None = None
                  ) -> np.ndarray:
    """Inverse frequencies float32 [hd/2] of a layer's attention (default: the config's),
    with linear or llama3 scaling (as in HF).

    A ``rotary_fraction`` f < 1 is transformers' 'proportional' RoPE: the first
    ``int(f * hd / 2)`` frequencies ``theta ** (-2j / hd)`` (exponents over the whole
    head), the rest 0 (those dims pass unrotated; rotate-half pairs dim i with i + hd/2).
    """
    a = config.attention_spec if attention is None else attention
    hd = a.head_dim
    if a.rotary_fraction < 1.0:
        angles = int(a.rotary_fraction * hd // 2)
        exponent = np.arange(0, 2 * angles, 2, dtype=np.int64).astype(np.float32) / np.float32(hd)
        inv = (np.float32(1.0) / (np.float32(a.rope_theta) ** exponent)).astype(np.float32)
        return np.concatenate([inv, np.zeros(hd // 2 - angles, np.float32)])
    exponent = np.arange(0, hd, 2, dtype=np.int64).astype(np.float32) / np.float32(hd)
    inv = (np.float32(1.0) / (np.float32(a.rope_theta) ** exponent)).astype(np.float32)
    rs = config.rope_scaling
    if rs is None:
        return inv
    if rs.rope_type == "linear":
        return (inv / np.float32(rs.factor)).astype(np.float32)
    # llama3 (transformers' _compute_llama3_parameters)
    factor, lo, hi = rs.factor, rs.low_freq_factor, rs.high_freq_factor
    old = rs.original_max_position_embeddings
    low_wavelen, high_wavelen = old / lo, old / hi
    wavelen = (2 * math.pi / inv).astype(np.float32)
    inv_l = np.where(wavelen > low_wavelen, inv / np.float32(factor), inv).astype(np.float32)
    smooth = ((old / wavelen - lo) / (hi - lo)).astype(np.float32)
    smoothed = ((1 - smooth) * inv_l / np.float32(factor) + smooth * inv_l).astype(np.float32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, inv_l).astype(np.float32)


def apply_rope(x_BTHd: jax.Array, positions_BT: jax.Array, inv_freq) -> jax.Array:
    """Rotate-half RoPE at absolute integer positions; computed in float32.

    Args:
      x_BTHd: [B, T, heads, hd].
      positions_BT: int [B, T].
      inv_freq: float32 [hd/2] (`rope_inv_freq`).
    Returns:
      [B, T, heads, hd] in x's dtype.
    """
    inv = jnp.asarray(inv_freq, jnp.float32)
    ang = positions_BT.astype(jnp.float32)[..., None] * inv            # [B, T, hd/2]
    ang = jnp.concatenate([ang, ang], axis=-1)[:, :, None, :]         # [B, T, 1, hd]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    xf = x_BTHd.astype(jnp.float32)
    half = xf.shape[-1] // 2
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rot * sin).astype(x_BTHd.dtype)


class Attention(nnx.Module):
    """q/k/v/o projections with optional per-head q/k RMSNorm and optional biases, of
    one layer's `AttentionSpec` (head dim, kv heads; k = v: no v_proj, values are the
    key projection) and an optional weightless v-norm (``config.v_norm``)."""

    def __init__(self, config: ModelConfig, spec: AttentionSpec | None = None, *, dtype,
                 rngs: nnx.Rngs):
        c = config
        a = c.attention_spec if spec is None else spec
        d, h, kh, hd = c.hidden_size, c.num_heads, a.num_kv_heads, a.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kh, hd
        bias = c.attention_bias
        self.q_proj = Linear((d,), (h, hd), ("embed",), ("heads", "head_dim"),
                             use_bias=bias, dtype=dtype, rngs=rngs)
        # a single key/value head (Gemma 4's global layers) is replicated, never split
        kv_axis = "kv_heads" if kh > 1 else None
        self.k_proj = Linear((d,), (kh, hd), ("embed",), (kv_axis, "head_dim"),
                             use_bias=bias, dtype=dtype, rngs=rngs)
        self.v_proj = (None if a.k_eq_v else
                       Linear((d,), (kh, hd), ("embed",), (kv_axis, "head_dim"),
                              use_bias=bias, dtype=dtype, rngs=rngs))
        self.o_proj = Linear((h, hd), (d,), ("heads", "head_dim"), ("embed",),
                             use_bias=bias, dtype=dtype, rngs=rngs)
        if c.qk_norm:
            self.q_norm = norm(c, hd, dtype=dtype, rngs=rngs)
            self.k_norm = norm(c, hd, dtype=dtype, rngs=rngs)
        else:
            self.q_norm = None
            self.k_norm = None
        self.v_norm = (RMSNorm(hd, eps=c.rms_norm_eps, dtype=dtype, with_scale=False)
                       if c.v_norm else None)

    def project_q(self, x_BTD: jax.Array) -> jax.Array:
        """Queries [B, T, H, hd], q-normed (if the family has it), not roped."""
        q = self.q_proj(x_BTD)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return constrain(q, ("batch", "seq", "act_heads", "head_dim"))

    def project_kv(self, x_BSD: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys and values [B, S, K, hd]; keys k-normed, not roped."""
        k = self.k_proj(x_BSD)
        v = k if self.v_proj is None else self.v_proj(x_BSD)
        if self.k_norm is not None:
            k = self.k_norm(k)
        if self.v_norm is not None:
            v = self.v_norm(v)
        names = ("batch", "seq", "act_kv_heads", "head_dim")
        return constrain(k, names), constrain(v, names)

    def qkv(self, x_BTD: jax.Array, positions_BT: jax.Array, inv_freq
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Roped q [B,T,H,hd] and k [B,T,K,hd], and v [B,T,K,hd] from one input."""
        q = apply_rope(self.project_q(x_BTD), positions_BT, inv_freq)
        k, v = self.project_kv(x_BTD)
        return q, apply_rope(k, positions_BT, inv_freq), v

    def out(self, a_BTHd: jax.Array) -> jax.Array:
        """Output projection [B, T, H, hd] -> [B, T, D]."""
        return self.o_proj(a_BTHd)


class DecoderLayer(nnx.Module):
    """Pre-norm decoder layer (HF names: input_layernorm, self_attn, mlp, ...).

    Its attention and MLP are the `LayerSpec`'s: an `Attention` of its `AttentionSpec`;
    a gated `MLP`, or the ``mlp`` its family builds for a mixture of experts (e.g.
    `tev_jax.models.moe.MoE`, called like `MLP`). ``spec`` (with the attention filled
    in) and ``sub`` (its place in a `LayerPeriod`, 0 outside one) are kept as static
    attributes: a pass reads the layer's window and cache from them.

    Raises:
      ValueError: a spec with a mixture of experts and no ``mlp``.
    """

    def __init__(self, config: ModelConfig, spec: LayerSpec = LayerSpec(), *, dtype,
                 rngs: nnx.Rngs, sub: int = 0, mlp: nnx.Module | None = None):
        c = config
        if spec.attention is None:
            spec = dataclasses.replace(spec, attention=c.attention_spec)
        self.spec, self.sub = spec, sub
        self.input_layernorm = norm(c, c.hidden_size, dtype=dtype, rngs=rngs)
        self.self_attn = Attention(c, spec.attention, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = norm(c, c.hidden_size, dtype=dtype, rngs=rngs)
        if mlp is not None:
            self.mlp = mlp
        elif spec.moe is None:
            self.mlp = MLP(c.hidden_size, c.intermediate_size, dtype=dtype, rngs=rngs,
                           act=c.hidden_act)
        else:
            raise ValueError(f"a layer with a mixture of experts ({spec.moe}) needs its "
                             f"family's expert MLP (model_type {c.model_type!r})")

    def __call__(self, x_BTD: jax.Array, positions_BT: jax.Array, inv_freq, attend):
        """One layer over T new tokens with the attention given as a function.

        Args:
          x_BTD: residual stream.
          positions_BT: absolute positions of the new tokens.
          inv_freq: `rope_inv_freq(config)`.
          attend: ``attend(q [B,T,H,hd], k [B,T,K,hd], v) -> (out [B,T,H,hd], aux)``:
            the attention of the new tokens' roped queries over keys/values of its
            choosing (usually their own ``k, v`` and a cache, through `attention`);
            ``aux`` is anything it wants to hand back (e.g. the cache it wrote to).
        Returns:
          (new residual [B,T,D], aux).
        """
        h = self.input_layernorm(x_BTD)
        q, k, v = self.self_attn.qkv(h, positions_BT, inv_freq)
        a, aux = attend(q, k, v)
        x = x_BTD + self.self_attn.out(a)
        x = constrain(x, ("batch", "seq", "act_embed"))
        x = x + self.mlp(self.post_attention_layernorm(x))
        x = constrain(x, ("batch", "seq", "act_embed"))
        return x, aux


class LayerPeriod(nnx.Module):
    """p consecutive decoder layers of different specs: one step of a stack's scan.

    Attributes:
      sublayers: the p `DecoderLayer`s, layer ``g·p + j`` of the model at step g being
        ``sublayers[j]``.
    """

    def __init__(self, config: ModelConfig, specs: Sequence[LayerSpec], *, dtype,
                 rngs: nnx.Rngs):
        self.sublayers = nnx.List([decoder_layer(config, s, dtype=dtype, rngs=rngs, sub=j)
                                   for j, s in enumerate(specs)])


def decoder_layer(config: ModelConfig, spec: LayerSpec, *, dtype, rngs: nnx.Rngs,
                  sub: int = 0) -> DecoderLayer:
    """The config's decoder layer of ``spec``, as its family builds it
    (`tev_jax.models.registry.Family.decoder_layer`): a `DecoderLayer` or a subclass
    (Gemma 4's sandwich-norm layer)."""
    return registry.family(config.model_type).decoder_layer(config, spec, dtype=dtype,
                                                            rngs=rngs, sub=sub)


def stacked_layers(config: ModelConfig, *, dtype, rngs: nnx.Rngs
                   ) -> DecoderLayer | LayerPeriod:
    """``config.num_layers`` decoder layers as one module with stacked parameters.

    Every parameter gets a leading layer axis (logical name ``layers``, unsharded):
    ``q_proj.kernel`` is [layers, D, H, hd]. `scan_layers` runs them as one
    ``lax.scan``, so a program's size and compile time do not grow with depth.
    Layers of one spec stack as a `DecoderLayer`; a model whose specs repeat with a
    period p > 1 stacks ``num_layers / p`` `LayerPeriod`s (paths ``sublayers/j/...``).
    """
    p = config.period
    specs = config.layer_specs[:p]
    n = config.num_layers // p

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=n,
              transform_metadata={nnx.PARTITION_NAME: "layers"})
    def create(rngs):
        if p == 1:
            return decoder_layer(config, specs[0], dtype=dtype, rngs=rngs)
        return LayerPeriod(config, specs, dtype=dtype, rngs=rngs)

    return create(rngs)


_UNROLL: contextvars.ContextVar[int | bool] = contextvars.ContextVar("tev_scan_unroll",
                                                                   default=1)


@contextlib.contextmanager
def scan_unroll(unroll: int | bool):
    """Layers per loop iteration of the layer scans traced inside the block.

    ``lax.scan``'s ``unroll``: 1 (the default) compiles one layer body whatever the
    depth; True unrolls every layer (a program per layer, as without a scan: longer
    compiles, and XLA may overlap work across layers). Read while tracing::

        with scan_unroll(True):
            exe = engine.lower("generate").compile()
    """
    if not (unroll is True or (isinstance(unroll, int) and not isinstance(unroll, bool)
                               and unroll >= 1)):
        raise ValueError(f"scan unroll must be a positive int or True, got {unroll!r}")
    token = _UNROLL.set(unroll)
    try:
        yield
    finally:
        _UNROLL.reset(token)


_EXPERT_USAGE: contextvars.ContextVar = contextvars.ContextVar("tev_expert_usage_sink",
                                                             default=None)


@contextlib.contextmanager
def collect_expert_usage():
    """Collects, while tracing the block, each mixture-of-experts MLP's pairs per expert
    (int32 [E]: how many of its (token, expert) pairs chose each expert) in the list it
    yields. An expert MLP appends to `expert_usage_sink` when one is open."""
    sink: list = []
    token = _EXPERT_USAGE.set(sink)
    try:
        yield sink
    finally:
        _EXPERT_USAGE.reset(token)


def expert_usage_sink() -> list | None:
    """The list of the innermost open `collect_expert_usage` block, or None."""
    return _EXPERT_USAGE.get()


_STACK_INDEX: contextvars.ContextVar = contextvars.ContextVar("tev_stack_index",
                                                           default=None)


def stack_index():
    """The scan step (traced int32) of the `scan_layers` body being traced: the index
    into a ``whole`` parameter's stack (`make_param`). 0 outside a scan (a module not
    stacked has a stack of one)."""
    g = _STACK_INDEX.get()
    return jnp.int32(0) if g is None else g


def _whole(path, v) -> bool:
    return bool(v.get_metadata().get("whole_stack", False))


def linear_kernels(path, v) -> bool:
    """The `Linear` kernels of a stack: ``scan_layers(..., in_place=linear_kernels)``."""
    return bool(path) and path[-1] == "kernel"


LAYER_SCOPE = "layer_stack"
"""The name scope of `scan_layers`' ops (in a compiled program's op names, whichever the
layout: `tev_jax.costs.program_report` counts the launches under it as the layer stack's)."""


def scan_layers(layers: nnx.Module, body, carry, *, depth: int | None = None, remat=None,
                in_place=None):
    """``carry = body(layer_i, i, carry)`` for i = 0 .. depth-1, as one ``lax.scan``.

    Args:
      layers: a `stacked_layers` module.
      body: ``body(layer, i, carry) -> carry``; ``layer`` is layer i (a `DecoderLayer`),
        ``i`` its index (traced int32).
      carry: any pytree.
      depth: run only the first ``depth`` layers (static; default all); a stack of
        `LayerPeriod` modules runs whole periods, up to the first period boundary >= depth.
      remat: None, or a ``jax.checkpoint_policies`` policy: each scan step is then
        rematerialised in the backward pass, saving what the policy allows.
      in_place: None, or an ``nnx`` filter ``(path, variable) -> bool`` of further
        parameters handed to the body whole (like ``whole`` ones, `make_param`), e.g.
        `linear_kernels`: their modules read layer i in place (on GPU a slice is copied
        out of the stack first). The gradient of a whole stack is a stack per step.
    Returns:
      The final carry. The loop unrolls as `scan_unroll` says (default: not at all).
      Layers laid out one array per layer (`tev_jax.models.layer_layout`) run as a
      Python loop instead, each layer's GEMMs reading its own weights.
    """
    graphdef, whole, state = nnx.split(
        layers, _whole if in_place is None else nnx.Any(_whole, in_place), ...)
    leaves = jax.tree.leaves((whole, state), is_leaf=is_per_layer)
    stacked = leaves[0].shape[0]
    p = len(layers.sublayers) if isinstance(layers, LayerPeriod) else 1
    n = stacked if depth is None else -(-depth // p)

    def step(carry, xs, whole=whole):
        g, layer_state = xs
        layer = nnx.merge(graphdef, whole, layer_state)
        token = _STACK_INDEX.set(g)
        try:
            if p == 1:
                return body(layer, g, carry), None
            for j, sub in enumerate(layer.sublayers):
                carry = body(sub, g * p + j, carry)
            return carry, None
        finally:
            _STACK_INDEX.reset(token)

    if any(map(is_per_layer, leaves)):
        # One array per layer (`layer_layout.per_layer`): a loop over the layers, each
        # handed its own arrays; whole-stack parameters stay whole.
        for g in range(n):
            def layer_step(carry, g=g):
                own = lambda tree: jax.tree.map(  # noqa: E731
                    lambda w: w.arrays[g] if is_per_layer(w) else w, tree,
                    is_leaf=is_per_layer)
                return step(carry, (jnp.int32(g), own(state)), own(whole))[0]

            if remat is not None:
                layer_step = jax.checkpoint(layer_step, policy=remat)
            with jax.named_scope(LAYER_SCOPE):
                carry = layer_step(carry)
        return carry
    if n < stacked:
        state = jax.tree.map(lambda w: w[:n], state)
    if remat is not None:
        step = jax.checkpoint(step, policy=remat)
    with jax.named_scope(LAYER_SCOPE):
        carry, _ = jax.lax.scan(step, carry, (jnp.arange(n, dtype=jnp.int32), state),
                                unroll=_UNROLL.get())
    return carry
