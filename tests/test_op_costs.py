"""The per-op table of compiled programs (`tev_jax.costs.op_costs`, ``tev-jax plan --ops``).

Programs whose costs are known by hand (a matrix product in a loop of known trip count,
an in-place update in a loop of unknown trip count) are compiled on CPU and their
tables compared with the hand count, the compiler's totals and the source lines that
made them; a TPU type with on-chip layouts checks the HBM split. The decode loops' tables
(stages named, compiled for a TPU slice) are checked in ``tests/test_tpu_plan.py``.
"""

from __future__ import annotations

import inspect
import re

import jax
import jax.numpy as jnp
import pytest

from tev_jax.costs import op_costs
from tev_jax.costs.op_costs import array_bytes, totals
from tev_jax.costs.op_costs import op_costs as costs_of
from tev_jax.kernels import scopes


def _line_of(fn, text: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def _matmul_loop(w_KN, x_MK):
    def body(i, x_MK):
        return jnp.tanh(x_MK @ w_KN)  # the matmul
    return jax.lax.fori_loop(0, 5, body, x_MK)


def test_a_known_trip_count_multiplies_the_body_and_the_source_line_is_named():
    m, k = 8, 64
    compiled = jax.jit(_matmul_loop).lower(jnp.ones((k, k)), jnp.ones((m, k))).compile()
    ops = costs_of(compiled.as_text())
    dot = max(ops, key=lambda o: o.flops)
    assert dot.count == 5 and not dot.in_loop
    assert dot.flops == 5 * 2 * m * k * k
    # reads x and w, writes the product: 4 bytes each
    assert dot.bytes == 5 * 4 * (m * k + k * k + m * k)
    assert dot.source.endswith(f":{_line_of(_matmul_loop, '# the matmul')} "
                               "(_matmul_loop.<locals>.body)")
    # the compiler counts a loop body once; our sum is its body times five
    body_flops = compiled.cost_analysis()["flops"]
    assert totals(ops)["flops"] == pytest.approx(5 * body_flops, rel=0.01)


def test_a_counted_loop_without_the_compilers_trip_count_is_multiplied_too():
    """The TPU compiler leaves ``known_trip_count`` off some scans (the layer scan of a
    round): ``i = 0; i < 5; i += 1`` is recognised from the loop itself. Negative
    control: the same loop with the bound compared the other way is not counted."""
    m, k = 8, 64
    text = jax.jit(_matmul_loop).lower(jnp.ones((k, k)), jnp.ones((m, k))).compile().as_text()
    stripped = re.sub(r'"known_trip_count":\{"n":"\d+"\},?', "", text)
    assert '"known_trip_count"' not in stripped
    dot = max(costs_of(stripped), key=lambda o: o.flops)
    assert dot.count == 5 and not dot.in_loop
    wrong = re.sub(r"direction=LT", "direction=GT", stripped)
    dot = max(costs_of(wrong), key=lambda o: o.flops)
    assert dot.count == 1 and dot.in_loop


def _fill(buf_RC, row_C):
    def body(carry):
        buf_RC, i = carry
        return buf_RC.at[i].set(row_C), i + 1
    return jax.lax.while_loop(lambda c: c[0][0, 0] < 100, body, (buf_RC, 0))[0]


def _rewrite(buf_RC, row_C):
    def body(carry):
        buf_RC, i = carry
        return buf_RC * 0.5 + row_C, i + 1
    return jax.lax.while_loop(lambda c: c[0][0, 0] < 100, body, (buf_RC, 0))[0]


def test_an_in_place_update_counts_the_update_and_a_rewrite_the_buffer():
    rows, cols = 1000, 256
    args = jnp.ones((rows, cols)), jnp.ones((cols,))
    fill = costs_of(jax.jit(_fill, donate_argnums=0).lower(*args).compile().as_text())
    assert all(o.in_loop for o in fill if o.scope.startswith("jit(_fill)/while/body"))
    assert totals(fill)["loop_bytes"] < 4 * 4 * cols  # a few rows, not the buffer
    # the negative control: a loop that rewrites the whole buffer every iteration
    rewrite = costs_of(jax.jit(_rewrite, donate_argnums=0).lower(*args).compile().as_text())
    assert totals(rewrite)["loop_bytes"] >= 2 * 4 * rows * cols


def _nested(x_N):
    def inner(x_N):
        return jax.lax.while_loop(lambda x: x[0] < 10, lambda x: jnp.sin(x) + 1, x_N)
    return jax.lax.while_loop(lambda x: x[1] < 50, lambda x: inner(x) * 2, x_N)


def test_a_loop_inside_the_loop_is_marked_inner():
    ops = costs_of(jax.jit(_nested).lower(jnp.zeros((128,))).compile().as_text())
    inner = [o for o in ops if "while/body/while/body" in o.scope]
    outer = [o for o in ops if o.scope == "jit(_nested)/while/body/mul"]
    assert inner and outer
    assert all(o.in_loop and o.inner for o in inner)
    assert all(o.in_loop and not o.inner for o in outer)


def test_on_chip_arrays_are_left_out_of_hbm_bytes():
    hbm = "bf16[4096,1536]{1,0:T(8,128)(2,1)}"
    vmem = "bf16[1024,1536]{1,0:T(8,128)(2,1)S(1)}"
    assert array_bytes(hbm) == array_bytes(hbm, hbm_only=True) == 2 * 4096 * 1536
    assert array_bytes(vmem) == 2 * 1024 * 1536 and array_bytes(vmem, hbm_only=True) == 0
    assert array_bytes(f"({hbm}, /*index=1*/{vmem}, s32[]{{:T(128)}})", hbm_only=True) == (
        2 * 4096 * 1536 + 4)
    line = (f"  %slice-start.1 = (({hbm}), {vmem}, s32[]{{:S(2)}}) slice-start(%p), "
            "slice={[0:1024], [0:1536]}")
    instr = op_costs.parse_instr(line)
    assert (instr.name, instr.opcode, instr.operands) == ("slice-start.1", "slice-start", ("p",))
    # a prefetch reads its slice from HBM and writes it on chip
    assert op_costs._plain_bytes(instr, {"p": hbm}, hbm=True) == 2 * 1024 * 1536
    assert op_costs._plain_bytes(instr, {"p": hbm}, hbm=False) == 2 * 2 * 1024 * 1536


def test_not_hlo_is_refused():
    with pytest.raises(ValueError, match="no ENTRY computation"):
        costs_of("hello")


def test_the_round_floor_is_one_shard_of_the_weights_and_caches():
    import experiment_scripts

    from tev_jax import sharding as shd
    from tev_jax.costs import plan
    from tev_jax.decode import DecodeConfig
    from tev_jax.engine import Engine
    from tev_jax.models import ModelConfig

    rb = experiment_scripts.load("round_bytes")
    cfg = ModelConfig("qwen3", vocab_size=4096, hidden_size=256, intermediate_size=768,
                      num_layers=2, num_heads=16, num_kv_heads=8, head_dim=64, qk_norm=True,
                      tie_word_embeddings=False)
    config = DecodeConfig(builder="none", max_new_tokens=32, prompt_len=64)
    target, _ = plan.abstract_models(cfg, config, dtype=jnp.bfloat16)
    floors = {}
    for n in (1, 8):
        mesh = None if n == 1 else shd.make_mesh(tensor=8)
        floors[n] = rb.floor_bytes(Engine.create(target, None, config, 8, mesh=mesh), tied=False)
    embed = 2 * cfg.vocab_size * cfg.hidden_size
    layers = sum(2 * x.size for x in jax.tree.leaves(nnx_state(target)) if x.ndim > 1) - 2 * embed
    assert floors[1]["weights"] >= layers + embed  # the head, not the embedding table
    assert floors[1]["weights"] < layers + 2 * embed
    # weight matrices and caches split over 8 chips (norms replicated)
    assert floors[8]["weights"] == pytest.approx(floors[1]["weights"] / 8, rel=0.02)
    assert floors[8]["kv"] == floors[1]["kv"] // 8 > 0


def nnx_state(model):
    from flax import nnx

    return nnx.state(model)


def _bounded(x_N, hi):
    def outer(c):
        x, i = c
        with jax.named_scope(scopes.bound_scope(6)):
            x = jax.lax.fori_loop(0, hi, lambda j, x: jnp.sin(x) * 2.0, x)
        return x, i + 1
    return jax.lax.while_loop(lambda c: c[1] < hi, outer, (x_N, 0))


def test_a_loop_of_named_bound_counts_its_bound_times():
    """A ``fori_loop`` with a traced bound inside the decode-like loop, wrapped in
    `bound_scope(6)`: its ops count 6 times per round and are marked ``bounded``; without
    the scope (negative control) they are the unbounded inner loop, counted once."""
    text = jax.jit(_bounded).lower(jnp.zeros((128,)), 3).compile().as_text()
    body = [o for o in costs_of(text) if "trips_upto_6/while/body" in o.scope]
    assert body and all(o.count == 6 and o.bounded and o.in_loop and not o.inner for o in body)
    stripped = [o for o in costs_of(text.replace("trips_upto_6/", ""))
                if "while/body/while/body" in o.scope]
    assert stripped and all(o.count == 1 and o.inner and not o.bounded for o in stripped)


def test_a_cublas_gemm_counts_its_flops():
    """A GPU GEMM as a cuBLAS custom call: 2 x output elements x the contracted size (from
    the call's dimension numbers); the workspace output adds no FLOPs."""
    text = """HloModule m

ENTRY %main (p0: bf16[64,512], p1: bf16[512,256]) -> (bf16[64,256], s8[4194304]) {
  %p0 = bf16[64,512]{1,0} parameter(0)
  %p1 = bf16[512,256]{1,0} parameter(1)
  ROOT %gemm = (bf16[64,256]{1,0}, s8[4194304]{0}) custom-call(%p0, %p1), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
}
"""
    (gemm,) = costs_of(text)
    assert gemm.flops == 2 * 64 * 256 * 512
    assert gemm.bytes == 2 * (64 * 512 + 512 * 256 + 64 * 256) + 4194304


def test_the_ar_step_flops_match_a_hand_count_at_a_full_cache():
    """One AR step (XLA:CPU, abstract weights), B 8, cache 8192: the table's FLOPs are
    within 2 % of 2 x matmul parameters x B plus the attention over the whole cache (the
    key-block loop counted at its bound). Negative control: with the bound's scope
    removed the loop counts once and the sum falls more than 5 % short."""
    from tev_jax.costs import plan
    from tev_jax.decode import DecodeConfig
    from tev_jax.engine import Engine
    from tev_jax.models import ModelConfig

    cfg = ModelConfig("qwen3", vocab_size=32_768, hidden_size=1024, intermediate_size=3072,
                      num_layers=1, num_heads=8, num_kv_heads=8, head_dim=128, qk_norm=True,
                      tie_word_embeddings=False)
    b, cache = 8, 8192
    config = DecodeConfig(builder="none", max_new_tokens=64, prompt_len=512,
                          max_cache_len=cache)
    target, _ = plan.abstract_models(cfg, config)
    text = Engine.create(target, None, config, b).lower("round").compile().as_text()
    q = cfg.num_heads * cfg.head_dim
    layer = cfg.hidden_size * 4 * q + 3 * cfg.hidden_size * cfg.intermediate_size
    hand = 2 * b * (layer + cfg.vocab_size * cfg.hidden_size) + 4 * b * q * cache
    assert totals(costs_of(text))["flops"] == pytest.approx(hand, rel=0.02)
    assert re.search(r"trips_upto_\d+/", text)
    once = totals(costs_of(re.sub(r"trips_upto_\d+/", "", text)))["flops"]
    assert once < 0.95 * hand
