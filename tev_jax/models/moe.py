"""A dropless mixture of SwiGLU experts: the MLP of Qwen3-MoE layers (docs/design.md §14).

Routing follows transformers' ``Qwen3MoeSparseMoeBlock``: router logits in the model
dtype, a float32 softmax over the E experts, the top k (ties to the lower index, as
``lax.top_k``), optionally renormalised to sum to 1, cast back; each token's output is
``sum_j w_j · down_e(silu(gate_e(x)) * up_e(x))`` over its k experts ``e = idx_j``.

Every token reaches every expert it selects (no capacity factor, nothing dropped), so
the target's distribution is exactly the model's and the verifiers stay exact. Four
ways compute the same sum, picked by `expert_mlp`'s ``method``:

- ``'grouped'``: the M·k (token, expert) pairs sorted by expert through one Pallas TPU
  kernel that reads each touched expert of the layer once, in place in the stacked
  weights (`tev_jax.kernels.expert_kernel`; interpreted off TPU);
- ``'ragged'``: the same sorted pairs through three grouped matmuls
  (``jax.lax.ragged_dot``; under the layer scan XLA copies the layer's experts out of
  the stack before them);
- ``'touched'``: a loop over the experts the pairs touch, each step one expert and up
  to C of its pairs (tokens gathered, outputs added back); reads only those experts'
  weights, about once each and in place;
- ``'dense'``: every expert on every token, weighted by the (mostly zero) routing: the
  test oracle.

``'auto'`` (`choose_method`) takes 'touched' when M·k < E (fewer pairs than experts, as
in a small AR step); otherwise 'grouped' when lowered for TPU and, elsewhere, 'touched'
up to `TOUCHED_MAX_TOKENS` tokens and 'ragged' above (``jax.lax.platform_dependent``
decides when the program is lowered).

Sharding: the stacked expert weights carry the logical axes ``experts`` and
``moe_mlp`` (`tev_jax.sharding`). Under a mesh that splits either, each device computes
the pairs that fall on its own experts (and its slice of the expert width) for all of
its tokens, and the partial outputs are summed over those mesh axes (a ``shard_map``
with tokens replicated over them, the expert-parallel pattern of tpu-inference's
grouped matmul); expert weights split over ``embed`` (fsdp) are gathered first.

Parameters (HF names in `tev_jax.models.checkpoint_io`)::

    gate.kernel          [D, E]      router        (embed, None)
    experts.gate_proj    [E, D, F]                 (experts, embed, moe_mlp)
    experts.up_proj      [E, D, F]                 (experts, embed, moe_mlp)
    experts.down_proj    [E, F, D]                 (experts, moe_mlp, embed)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from tev_jax import sharding as shd
from tev_jax.kernels.expert_kernel import expert_sum
from tev_jax.kernels.scopes import bound_scope
from tev_jax.kernels.stacked_matmul import stacked_matmul
from tev_jax.models.config import MoeSpec
from tev_jax.models.layers import Linear, expert_usage_sink, make_param, stack_index
from tev_jax.runtime import platforms

METHODS = ("auto", "grouped", "ragged", "touched", "dense")
EXPERT_AXES = ("experts", "embed", "moe_mlp")
DOWN_AXES = ("experts", "moe_mlp", "embed")


def route(x_MD: jax.Array, router_DE: jax.Array, spec: MoeSpec):
    """The top-k routing of M tokens.

    Returns:
      (weights [M, k] in x's dtype, expert ids int32 [M, k]), HF's order (descending
      probability, ties to the lower id).
    """
    logits = jnp.dot(x_MD.astype(router_DE.dtype), router_DE)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    w, idx = jax.lax.top_k(probs, spec.top_k)
    if spec.norm_topk_prob:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return w.astype(x_MD.dtype), idx.astype(jnp.int32)


# Off TPU, up to this many tokens per pass 'auto' loops over the touched experts
# ('touched'); above it the sorted pairs go through ragged_dot ('ragged').
TOUCHED_MAX_TOKENS = 512


def choose_method(method: str, pairs: int, num_experts: int,
                  tokens: int = 0) -> str | tuple[str, str]:
    """The method for ``pairs`` = M·k (token, expert) pairs of M = ``tokens`` tokens
    over E experts: ``method`` itself unless 'auto'; 'touched' when the pairs are fewer
    than the experts; else (the method on TPU, the method elsewhere): ('grouped',
    'touched' up to `TOUCHED_MAX_TOKENS` tokens, else 'ragged'), which `expert_mlp`
    resolves when the program is lowered."""
    if method not in METHODS:
        raise ValueError(f"MoE method must be one of {METHODS}, got {method!r}")
    if method != "auto":
        return method
    if pairs < num_experts:
        return "touched"
    return "grouped", ("touched" if tokens <= TOUCHED_MAX_TOKENS else "ragged")


def expert_mlp(x_MD, idx_MK, w_MK, gate_EDF, up_EDF, down_EFD, *,
               method: str | tuple[str, str], first_expert=0, stack=None,
               total_experts: int | None = None):
    """``y[m] = sum_j w[m, j] · expert_{idx[m, j]}(x[m])`` over the experts held here.

    Args:
      x_MD: [M, D] tokens.
      idx_MK, w_MK: routing (`route`): expert ids in the full [0, E_all) range, weights.
      gate_EDF, up_EDF, down_EFD: E experts' weights, experts ``first_expert ..
        first_expert + E - 1`` (all of them, or one device's block).
      method: 'grouped', 'ragged', 'touched' or 'dense' (module docstring), or a pair
        (the method on TPU, the method elsewhere) taken when the program is lowered.
      first_expert: id of the first expert held (traced under a shard_map).
      stack: None, or an index (traced) into a leading stack axis of the three weights
        ([S, E, D, F]): entry ``stack`` is used, read in place by 'touched' and
        'grouped' (a slice handed to a loop or a custom call would be copied out first).
      total_experts: E over all devices (default: the E held); sizes the plan's count
        of the 'touched' loop and the kernel's cost estimate (`expected_touched`).
    Returns:
      [M, D] in x's dtype: the pairs on other experts contribute nothing.
    """
    if isinstance(method, tuple):
        on_tpu, elsewhere = method
        call = lambda name: lambda: expert_mlp(
            x_MD, idx_MK, w_MK, gate_EDF, up_EDF, down_EFD, method=name,
            first_expert=first_expert, stack=stack, total_experts=total_experts)
        return jax.lax.platform_dependent(tpu=call(on_tpu), default=call(elsewhere))
    m, k = idx_MK.shape
    e = gate_EDF.shape[-3]
    local = idx_MK - first_expert
    here = (local >= 0) & (local < e)
    w = jnp.where(here, w_MK, 0).astype(x_MD.dtype)
    x = x_MD.astype(gate_EDF.dtype)
    if method == "touched":
        return _touched_experts(x, jnp.where(here, local, e), w, gate_EDF, up_EDF,
                                down_EFD, stack, total_experts).astype(x_MD.dtype)
    if method in ("grouped", "ragged"):
        return _sorted_pairs(x, jnp.where(here, local, e), w, gate_EDF, up_EDF, down_EFD,
                             stack, method, total_experts).astype(x_MD.dtype)
    if method != "dense":
        raise ValueError(f"MoE method must be one of {METHODS[1:]}, got {method!r}")
    if stack is not None:
        gate_EDF, up_EDF, down_EFD = (jax.lax.dynamic_index_in_dim(a, stack, keepdims=False)
                                      for a in (gate_EDF, up_EDF, down_EFD))
    h = jax.nn.silu(jnp.einsum("md,edf->mef", x, gate_EDF)) * jnp.einsum(
        "md,edf->mef", x, up_EDF)
    o = jnp.einsum("mef,efd->med", h, down_EFD)
    combine = jnp.zeros((m, e), w.dtype).at[
        jnp.arange(m)[:, None], jnp.where(here, local, e)].add(w, mode="drop")
    return jnp.einsum("med,me->md", o, combine.astype(o.dtype)).astype(x_MD.dtype)


def _sorted_pairs(x_MD, key_MK, w_MK, gate_EDF, up_EDF, down_EFD, stack, method: str,
                  total: int | None):
    """'grouped' / 'ragged': the M·k pairs sorted by expert (pairs on other
    devices' experts, ``key`` = E, last and not computed), each through its expert's MLP,
    weighted and added back to its token."""
    m, k = key_MK.shape
    e = gate_EDF.shape[-3]
    key = key_MK.reshape(-1)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=e).astype(jnp.int32)
    stacks = [a if stack is not None else a[None] for a in (gate_EDF, up_EDF, down_EFD)]
    return expert_sum(x_MD, order // k, sizes, *stacks, 0 if stack is None else stack,
                      w_MK.reshape(-1)[order], method=method, total_experts=total,
                      expected_experts=expected_touched(e, total or e, k, m))


def expected_touched(held: int, total: int, k: int, tokens: int) -> int:
    """Experts of the ``held`` ones that ``tokens`` tokens, each picking k of ``total``
    uniformly, touch on average (rounded up): ``held · (1 − (1 − k/total)^tokens)``.

    Real routing is not uniform (and a round's count is in
    `tev_jax.generation.DecodeStats.experts_touched`); this is what a plan, which has no
    routing, counts the 'touched' loop's trips at.
    """
    return max(1, math.ceil(held * (1.0 - (1.0 - k / total) ** tokens) - 1e-9))


def expected_steps(held: int, total: int, k: int, tokens: int, rows: int) -> int:
    """Steps of the 'touched' loop on average (rounded up) at uniform routing: each held
    expert's pairs are Binomial(tokens, k/total) and take ``ceil(pairs / rows)`` steps,
    so ``held · sum_j Pr(pairs > j·rows)``. What the plan's op table charges the loop."""
    p = k / total
    if p >= 1:
        return held * -(-tokens // rows)
    logs = [math.lgamma(tokens + 1) - math.lgamma(i + 1) - math.lgamma(tokens - i + 1)
            + i * math.log(p) + (tokens - i) * math.log1p(-p) for i in range(tokens + 1)]
    pmf = [math.exp(v) for v in logs]
    steps = sum(sum(pmf[j * rows + 1:]) for j in range(-(-tokens // rows) + 1))
    return max(1, math.ceil(held * steps - 1e-9))


def chunk_rows(tokens: int, k: int, total: int) -> int:
    """Rows of one step of the 'touched' loop: twice an expert's mean share of the
    pairs (``2·M·k/E``) and at least 8, as a power of two, at most M·k: most experts'
    pairs fit one step, so each touched expert's weights are read about once."""
    want = max(8, math.ceil(2 * tokens * k / total))
    return min(1 << (want - 1).bit_length(), tokens * k)


def _touched_experts(x_MD, key_MK, w_MK, gate_EDF, up_EDF, down_EFD, stack=None,
                     total: int | None = None):
    """The 'touched' method: a loop over the experts the pairs touch (``key`` < E, the
    held ones), each step one expert and up to C of its pairs (`chunk_rows`): their
    tokens gathered, the expert's weights read in place (one dynamic slice of the
    stack), the outputs added back. An expert with more than C pairs takes several
    steps. Reads each touched expert's weights about once and no other's; the plan's
    op table charges the loop its expected steps (`tev_jax.kernels.scopes.bound_scope`)."""
    m, k = key_MK.shape
    e = gate_EDF.shape[-3]
    total = total or e
    c = chunk_rows(m, k, total)
    lead = () if stack is None else (stack,)
    key_P = key_MK.reshape(-1)
    order_P = jnp.argsort(key_P, stable=True)          # pairs by expert, others last
    token_P = order_P // k
    w_P = w_MK.reshape(-1)[order_P]
    sizes_E = jnp.bincount(key_P, length=e).astype(jnp.int32)
    first_E = jnp.cumsum(sizes_E) - sizes_E            # each expert's first sorted pair
    steps_E = -(-sizes_E // c)
    ends_E = jnp.cumsum(steps_E)                       # steps up to and with expert e

    def one(t, y_MD):
        ex = jnp.searchsorted(ends_E, t, side="right")
        j = t - (ends_E[ex] - steps_E[ex])              # this expert's j-th step
        r_C = first_E[ex] + j * c + jnp.arange(c)
        keep_C = r_C < first_E[ex] + sizes_E[ex]
        r_C = jnp.minimum(r_C, key_P.shape[0] - 1)
        tok_C = token_P[r_C]
        x_CD = x_MD[tok_C]
        h = jax.nn.silu(_expert_dot(x_CD, gate_EDF, lead, ex)) * _expert_dot(
            x_CD, up_EDF, lead, ex)
        o = _expert_dot(h, down_EFD, lead, ex) * jnp.where(
            keep_C, w_P[r_C], 0).astype(h.dtype)[:, None]
        return y_MD.at[tok_C].add(o.astype(y_MD.dtype))

    y = jnp.zeros((m, down_EFD.shape[-1]), jnp.promote_types(x_MD.dtype, down_EFD.dtype))
    with jax.named_scope(bound_scope(expected_steps(e, total, k, m, c))):
        return jax.lax.fori_loop(0, ends_E[-1], one, y)


def _expert_dot(x_CK, a_EKN, lead: tuple, ex, *, in_place: bool | None = None,
                interpret: bool = False) -> jax.Array:
    """``x · a[*lead, ex]``: one expert's matrix of a (possibly stacked) expert array.

    Lowered for a GPU (``in_place`` None), or with ``in_place``, the expert is read in
    place by `stacked_matmul` over the array seen as a stack of [K, N] matrices (the
    dynamic slice it replaces is copied out before its GEMM: Qwen3-Coder's AR step read
    2.2x its floor of bytes on GPU); elsewhere sliced. ``interpret``: Pallas'
    interpreter (tests without a GPU).
    """
    def sliced(x, a, ex):
        w = jax.lax.dynamic_slice(a, lead + (ex, 0, 0), (1,) * len(lead) + (1,) + a.shape[-2:])
        return x @ w.reshape(a.shape[-2:])

    def stacked(x, a, ex):
        index = (lead[0] * a.shape[-3] if lead else 0) + ex
        return stacked_matmul(x.astype(a.dtype), a.reshape(-1, *a.shape[-2:]), index,
                              interpret=interpret)

    if in_place is not None:
        return (stacked if in_place else sliced)(x_CK, a_EKN, ex)
    if not platforms.gpu_kernels_traced():
        return sliced(x_CK, a_EKN, ex)
    return jax.lax.platform_dependent(x_CK, a_EKN, ex, cuda=stacked, default=sliced)


class Experts(nnx.Module):
    """E SwiGLU experts' stacked weights (see the module docstring)."""

    def __init__(self, hidden_size: int, spec: MoeSpec, *, dtype, rngs: nnx.Rngs):
        d, e, f = hidden_size, spec.num_experts, spec.expert_size
        self.gate_proj = make_param(rngs, (e, d, f), dtype, EXPERT_AXES, "normal", whole=True)
        self.up_proj = make_param(rngs, (e, d, f), dtype, EXPERT_AXES, "normal", whole=True)
        self.down_proj = make_param(rngs, (e, f, d), dtype, DOWN_AXES, "normal", whole=True)

    def stacks(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(gate [S, E, D, F], up, down [S, E, F, D]): the weights with a leading stack
        axis (S = 1 unless stacked layers hand over the whole stack: `make_param`)."""
        ws = (self.gate_proj[...], self.up_proj[...], self.down_proj[...])
        return tuple(w if w.ndim == 4 else w[None] for w in ws)


class MoE(nnx.Module):
    """The sparse MLP block: router + `Experts`, called like `layers.MLP`.

    Attributes:
      spec: the `MoeSpec`.
      method: how `expert_mlp` computes (default 'auto').
    """

    def __init__(self, hidden_size: int, spec: MoeSpec, *, dtype, rngs: nnx.Rngs,
                 method: str = "auto"):
        choose_method(method, 1, spec.num_experts)
        self.spec = spec
        self.method = method
        self.gate = Linear((hidden_size,), (spec.num_experts,), ("embed",), (None,),
                           use_bias=False, dtype=dtype, rngs=rngs)
        self.experts = Experts(hidden_size, spec, dtype=dtype, rngs=rngs)

    def route(self, x_BTD: jax.Array):
        """(weights [B·T, k], expert ids int32 [B·T, k]) of the tokens, row-major."""
        return route(x_BTD.reshape(-1, x_BTD.shape[-1]), self.gate.weight(), self.spec)

    def __call__(self, x_BTD: jax.Array, method: str | None = None) -> jax.Array:
        b, t, d = x_BTD.shape
        w, idx = self.route(x_BTD)
        sink = expert_usage_sink()
        if sink is not None:
            sink.append(jnp.zeros((self.spec.num_experts,), jnp.int32).at[idx].add(1))
        method = choose_method(self.method if method is None else method,
                               b * t * self.spec.top_k, self.spec.num_experts, b * t)
        y = sharded_experts(x_BTD, idx.reshape(b, t, -1), w.reshape(b, t, -1),
                            self.experts.stacks(), stack_index(), method)
        return shd.constrain(y, ("batch", "seq", "act_embed"))


def uses_kernel(method: str | tuple[str, str]) -> bool:
    """Whether ``method`` (`choose_method`'s answer) may run the grouped Pallas kernel,
    which XLA cannot partition: it must run inside a ``shard_map``."""
    return "grouped" in ((method,) if isinstance(method, str) else method)


def sharded_experts(x_BTD, idx_BTK, w_BTK, stacks, g, method) -> jax.Array:
    """`expert_mlp` of stack entry ``g`` of the expert weights (`Experts.stacks`), on
    the active mesh's layout of them (module docstring).

    Without a mesh, or with neither ``experts`` nor ``moe_mlp`` split, one plain call,
    except where the grouped kernel may run on a mesh of several devices: a Mosaic
    kernel cannot be partitioned by XLA (lowering fails with "Mosaic kernels cannot be
    automatically partitioned", which jax 0.10 reports as a KeyError in its lowering
    cache on the enclosing ``closed_call``), so it runs in a ``shard_map`` too: each
    device its own tokens, the weights gathered over ``embed`` (fsdp) one layer at a
    time: layer ``g`` is sliced out of each device's shard of the stack, then gathered.
    """
    b, t, d = x_BTD.shape

    def local(x, idx, w, g, gate, up, down, first):
        y = expert_mlp(x.reshape(-1, d), idx.reshape(-1, idx.shape[-1]),
                       w.reshape(-1, w.shape[-1]), gate, up, down, method=method,
                       first_expert=first, stack=g, total_experts=stacks[0].shape[1])
        return y.reshape(x.shape)

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return local(x_BTD, idx_BTK, w_BTK, g, *stacks, 0)
    gate = stacks[0]
    # The expert weights' layout: experts / moe_mlp split (expert / width parallel),
    # embed (fsdp) gathered inside the shard_map, one layer at a time.
    spec_up = shd.logical_to_spec((None, "experts", "embed", "moe_mlp"), gate.shape, mesh)
    spec_down = shd.logical_to_spec((None, "experts", "moe_mlp", "embed"), stacks[2].shape,
                                    mesh)
    expert_axes = _axes(spec_up, 1)
    split = expert_axes + _axes(spec_up, 3)
    if not split and not (uses_kernel(method) and mesh.size > 1):
        return local(x_BTD, idx_BTK, w_BTK, g, *stacks, 0)
    gather_up, gather_down = _axes(spec_up, 2), _axes(spec_down, 3)
    # Tokens keep their batch split on the axes the experts do not use.
    batch = tuple(a for a in _axes(shd.logical_to_spec(("batch",), (b,), mesh), 0)
                  if a not in split)
    spec_x = PartitionSpec(batch or None)
    e_local = gate.shape[1] // _size(mesh, expert_axes)

    def layer(w, g, axes, dim):
        # Layer g of this device's shard, then gathered over embed: one layer's experts,
        # not the stack (slicing outside the shard_map, XLA gathered the whole stack
        # first: 58 GB of temporaries per chip in the full-depth training step).
        w = jax.lax.dynamic_slice_in_dim(w, g, 1, axis=0)
        return jax.lax.all_gather(w, axes, axis=dim, tiled=True)

    def body(x, idx, w, g, gate, up, down):
        if gather_up or gather_down:
            gate, up = (layer(a, g, gather_up, 2) if gather_up else
                        jax.lax.dynamic_slice_in_dim(a, g, 1, axis=0) for a in (gate, up))
            down = (layer(down, g, gather_down, 3) if gather_down else
                    jax.lax.dynamic_slice_in_dim(down, g, 1, axis=0))
            g = jnp.int32(0)
        first = (jax.lax.axis_index(expert_axes) * e_local if expert_axes else 0)
        y = local(x, idx, w, g, gate, up, down, first)
        return jax.lax.psum(y, split) if split else y

    return jax.shard_map(body, mesh=mesh,
                         in_specs=(spec_x, spec_x, spec_x, PartitionSpec(), spec_up, spec_up,
                                   spec_down),
                         out_specs=spec_x, check_vma=False)(
        x_BTD, idx_BTK, w_BTK, g, *stacks)


def _axes(spec: PartitionSpec, dim: int) -> tuple[str, ...]:
    entry = spec[dim] if dim < len(spec) else None
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def _size(mesh, axes) -> int:
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    n = 1
    for a in axes:
        n *= sizes[a]
    return n
