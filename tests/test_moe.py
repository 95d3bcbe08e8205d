"""The mixture-of-experts target (Qwen3-MoE, tev_jax.models.moe): routing and experts
against transformers and against each other, a mixed dense / sparse stack, speculative
decoding at T = 0 and T = 1, sharding over experts, per-expert checkpoints.

Parity, cache modes, the tree verify pass, commit and export of an all-MoE model run in
tests/test_target.py with the other families.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_fixtures import greedy_reference
from flax import nnx
from jax.sharding import PartitionSpec as P
from test_decode_mesh import DCFG, MESHES, PROMPTS, needs8

from tev_jax import decode, engine
from tev_jax import sharding as shd
from tev_jax.costs import chips, op_costs, plan
from tev_jax.kernels import expert_kernel
from tev_jax.kernels.expert_kernel import (expert_sum, grouped_expert_mlp, ragged_expert_mlp,
                                           reference_expert_mlp, resident_expert_sum,
                                           tile_rows, visits)
from tev_jax.models import ModelConfig, init_target, load_target, moe, save_target
from tev_jax.models.config import MoeSpec
from tev_jax.models.drafter import Drafter
from tev_jax.models.layers import jitted_initializer
from tev_jax.models.moe import expected_steps, expected_touched, expert_mlp, route
from tev_jax.sampling import Sampling

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V = 300


def _moe_config(**kw) -> ModelConfig:
    base = dict(model_type="qwen3_moe", vocab_size=512, hidden_size=64,
                intermediate_size=128, num_layers=2, num_heads=16, num_kv_heads=8,
                head_dim=8, qk_norm=True, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=32, norm_topk_prob=True)
    return ModelConfig(**{**base, **kw})


# --------------------------------------------------------------- the expert MLP


@pytest.mark.parametrize("method", ["grouped", "ragged", "touched"])
def test_expert_methods_equal_the_dense_oracle_and_split_over_experts(method):
    """Every method gives the all-experts oracle; experts split in blocks (what a device
    holds under expert parallelism) sum to the whole."""
    rng = np.random.default_rng(0)
    m, d, f, e, k = 11, 16, 8, 8, 3
    x = jnp.asarray(rng.normal(size=(m, d)), jnp.float32)
    router = jnp.asarray(rng.normal(size=(d, e)), jnp.float32)
    w, idx = route(x, router, MoeSpec(e, k, f, norm_topk_prob=False))
    gate, up = (jnp.asarray(rng.normal(size=(e, d, f)) / 4, jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.normal(size=(e, f, d)) / 4, jnp.float32)

    # the oracle by hand: each token's k experts, one at a time
    want = np.zeros((m, d), np.float32)
    for t in range(m):
        for j in range(k):
            ex = int(idx[t, j])
            h = jax.nn.silu(x[t] @ gate[ex]) * (x[t] @ up[ex])
            want[t] += float(w[t, j]) * np.asarray(h @ down[ex])
    dense = expert_mlp(x, idx, w, gate, up, down, method="dense")
    np.testing.assert_allclose(np.asarray(dense), want, atol=1e-5)
    got = jax.jit(lambda *a: expert_mlp(*a, method=method))(x, idx, w, gate, up, down)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    # steps of 2 pairs (as if 64 experts shared the pairs): experts take several steps
    got = expert_mlp(x, idx, w, gate, up, down, method=method, total_experts=64)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    # the same experts as entry 1 of a stack (what the layer scan hands over), read in place
    stacked = [jnp.stack([a * 0.5, a, a * 2.0]) for a in (gate, up, down)]
    got = expert_mlp(x, idx, w, *stacked, method=method, stack=jnp.int32(1))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    parts = sum(expert_mlp(x, idx, w, gate[lo:lo + 2], up[lo:lo + 2], down[lo:lo + 2],
                           method=method, first_expert=lo) for lo in range(0, e, 2))
    np.testing.assert_allclose(np.asarray(parts), want, atol=1e-5)
    # one block alone is not the whole (the split is not vacuous)
    assert np.abs(np.asarray(parts - expert_mlp(
        x, idx, w, gate[:2], up[:2], down[:2], method=method))).max() > 1e-2


@pytest.mark.parametrize("sizes", [[0, 37, 5, 0, 20, 18], [3, 0, 0, 0, 0, 0], [0] * 6,
                                   [100, 0, 0, 0, 0, 0]])
def test_grouped_kernel_visits_every_tile_of_every_group(sizes):
    """The Pallas kernel (interpreted), ragged_dot and the reference against each row's
    expert MLP by hand: empty groups,
    a group across several tiles of 16 rows, tiles shared by groups, row weights, entry 1
    of a stack of 3; the visit list names each (tile, expert) pair whose
    rows meet exactly once, in tile order."""
    rng = np.random.default_rng(1)
    p, d, f, e = 100, 16, 8, 6
    xs = jnp.asarray(rng.normal(size=(p, d)), jnp.float32)
    gate, up = (jnp.asarray(rng.normal(size=(3, e, d, f)) / 4, jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.normal(size=(3, e, f, d)) / 4, jnp.float32)
    sizes_E = jnp.asarray(sizes, jnp.int32)
    w = rng.uniform(0.5, 2.0, size=p).astype(np.float32)
    got = np.asarray(grouped_expert_mlp(xs, sizes_E, gate, up, down, jnp.int32(1),
                                        jnp.asarray(w), total_experts=e, interpret=True))
    owner = np.repeat(np.arange(e), sizes)
    want = np.zeros((len(owner), d), np.float32)
    for r, ex in enumerate(owner):
        h = jax.nn.silu(xs[r] @ gate[1, ex]) * (xs[r] @ up[1, ex])
        want[r] = w[r] * np.asarray(h @ down[1, ex])
    np.testing.assert_allclose(got[:len(owner)], want, atol=1e-5)
    # the kernel module's other versions: ragged_dot, and the plain-jnp reference
    for other in (ragged_expert_mlp, reference_expert_mlp):
        o = np.asarray(other(xs, sizes_E, gate, up, down, jnp.int32(1), jnp.asarray(w)))
        np.testing.assert_allclose(o[:len(owner)], want, atol=1e-5)
        assert not o[len(owner):].any()

    tm = tile_rows(p, e)
    count = -(-p // tm) + e - 1
    expert, tile, _, _, real = (np.asarray(a) for a in visits(sizes_E, tm, count))
    pairs = sorted({(r // tm, int(ex)) for r, ex in enumerate(owner)})
    n = int(real[0])
    assert n == len(pairs) <= count
    assert list(zip(tile[:n].tolist(), expert[:n].tolist())) == pairs
    if n:   # the rest repeat the last visit: no new block to fetch
        assert (tile[n:] == tile[n - 1]).all() and (expert[n:] == expert[n - 1]).all()


@pytest.mark.parametrize("sizes", [[0, 37, 5, 0, 20, 18], [3, 0, 0, 0, 0, 0], [0] * 6,
                                   [100, 0, 0, 0, 0, 0], [30, 0, 0, 0, 0, 0]])
def test_the_tokens_in_vmem_kernel_sums_each_tokens_pairs(sizes, monkeypatch):
    """`resident_expert_sum` (interpreted): each token's output is the weighted sum of
    its own pairs' expert MLPs, by hand; tokens with several pairs (here up to 4, some
    in one tile), pairs past ``sum(sizes)`` (other devices' experts: 30 of 100 held)
    adding nothing, entry 1 of a stack of 3. `expert_sum` gives the same through the
    kernel, through the gathered rows (`fits_resident` false) and through ragged_dot."""
    rng = np.random.default_rng(2)
    m, k, d, f, e = 25, 4, 16, 8, 6
    x = jnp.asarray(rng.normal(size=(m, d)), jnp.float32)
    token = jnp.asarray(rng.integers(0, m, m * k), jnp.int32)
    gate, up = (jnp.asarray(rng.normal(size=(3, e, d, f)) / 4, jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.normal(size=(3, e, f, d)) / 4, jnp.float32)
    w = rng.uniform(0.5, 2.0, size=m * k).astype(np.float32)
    sizes_E = jnp.asarray(sizes, jnp.int32)
    want = np.zeros((m, d), np.float32)
    for r, ex in enumerate(np.repeat(np.arange(e), sizes)):
        t = int(token[r])
        h = jax.nn.silu(x[t] @ gate[1, ex]) * (x[t] @ up[1, ex])
        want[t] += w[r] * np.asarray(h @ down[1, ex])
    got = resident_expert_sum(x, token, sizes_E, gate, up, down, jnp.int32(1), jnp.asarray(w),
                              total_experts=e, interpret=True)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    args = (x, token, sizes_E, gate, up, down, 1, jnp.asarray(w))
    for method in ("grouped", "ragged", "reference"):
        np.testing.assert_allclose(np.asarray(expert_sum(*args, method=method)), want,
                                   atol=1e-5)
    monkeypatch.setattr(expert_kernel, "RESIDENT_BYTES", 0)
    np.testing.assert_allclose(np.asarray(expert_sum(*args)), want, atol=1e-5)


def test_an_expert_read_in_place_equals_its_slice():
    """The GPU form of the 'touched' loop's products (`stacked_matmul` over the expert
    array seen as a stack of matrices, interpreted here) equals the sliced product, for
    a stacked [S, E, K, N] array and a single layer's [E, K, N]."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(5, 24)), jnp.float32)
    a = jnp.asarray(rng.normal(size=(3, 4, 24, 40)), jnp.float32)
    for lead, arr in (((jnp.int32(2),), a), ((), a[1])):
        for ex in (0, 3):
            got = moe._expert_dot(x, arr, lead, jnp.int32(ex), in_place=True, interpret=True)
            want = moe._expert_dot(x, arr, lead, jnp.int32(ex), in_place=False)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5,
                                       atol=1e-5)
    other = moe._expert_dot(x, a, (jnp.int32(1),), jnp.int32(3), in_place=True,
                            interpret=True)
    assert not np.allclose(np.asarray(other), np.asarray(
        moe._expert_dot(x, a, (jnp.int32(2),), jnp.int32(3), in_place=False)))


def test_auto_method_by_pass_size():
    """'auto': the touched-experts loop below one pair per expert; otherwise the grouped
    kernel on TPU and, elsewhere, the loop up to 512 tokens, ragged_dot above."""
    assert moe.choose_method("auto", 64, 128, 8) == "touched"
    assert moe.choose_method("auto", 256, 128, 32) == ("grouped", "touched")
    assert moe.choose_method("auto", 8 * 2080, 128, 2080) == ("grouped", "ragged")
    assert moe.choose_method("dense", 8 * 2080, 128, 2080) == "dense"
    with pytest.raises(ValueError, match="MoE method must be one of"):
        moe.choose_method("long", 1, 8)


def test_routing_renormalises_and_breaks_ties_to_the_lower_expert():
    x = jnp.ones((1, 2))
    router = jnp.array([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    w, idx = route(x, router, MoeSpec(4, 2, 4, norm_topk_prob=True))
    assert idx.tolist() == [[1, 2]]
    np.testing.assert_allclose(np.asarray(w), [[0.5, 0.5]], atol=1e-7)
    w, _ = route(x, router, MoeSpec(4, 2, 4, norm_topk_prob=False))
    assert float(w.sum()) < 0.99


def test_expected_touched_experts_matches_uniform_routing():
    """The plan's count of the 'touched' loop: k for one token, every expert held for
    many, and the mean of uniform top-k draws (2000 draws; within 1: it is rounded up)."""
    assert expected_touched(128, 128, 8, 1) == 8
    assert expected_touched(32, 128, 8, 4096) == 32
    rng = np.random.default_rng(0)
    held, total, k, tokens = 32, 128, 8, 8
    draws = [len({e for _ in range(tokens) for e in rng.choice(total, k, replace=False)
                  if e < held}) for _ in range(2000)]
    assert abs(np.mean(draws) - expected_touched(held, total, k, tokens)) < 1.0
    # the loop's steps: ceil(pairs / rows) per held expert, here 40 tokens, rows 4
    rows, tokens = 4, 40
    picks = [np.stack([rng.choice(total, k, replace=False) for _ in range(tokens)])
             for _ in range(500)]
    steps = [sum(-(-int((p == e).sum()) // rows) for e in range(held)) for p in picks]
    assert abs(np.mean(steps) - expected_steps(held, total, k, tokens, rows)) < 1.0
    assert expected_steps(held, total, k, tokens, rows) > expected_touched(held, total, k,
                                                                          tokens)


# ------------------------------------------------ a mixed stack against transformers


@pytest.fixture(scope="module")
def mixed_hf(tmp_path_factory):
    """A 4-layer HF Qwen3-MoE: layer 0 dense (mlp_only_layers), then sparse every 2nd
    layer (decoder_sparse_step 2: layers 1 and 3), no renormalisation; routers scaled
    up so that no top-k is decided by a near-tie."""
    torch.manual_seed(1)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256, initializer_range=0.1, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False,
        decoder_sparse_step=2, mlp_only_layers=[0], tie_word_embeddings=False)
    hf = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):
                p.mul_(10.0)
    path = tmp_path_factory.mktemp("mixed")
    hf.save_pretrained(path, max_shard_size="100KB")   # a sharded index too
    return hf, path


def test_mixed_stack_routes_and_matches_transformers(mixed_hf):
    hf, path = mixed_hf
    assert (path / "model.safetensors.index.json").is_file()
    ours = load_target(path)
    c = ours.config
    assert [s.moe is not None for s in c.layer_specs] == [False, True, False, True]
    assert c.period == 2 and not c.norm_topk_prob
    tokens = np.random.RandomState(0).randint(0, V, (4, 20))

    # the router inputs and HF's choices of every sparse layer
    seen = {}
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda mod, inp, out, i=i: seen.__setitem__(i, (inp[0].numpy(), out[2].numpy())))
        for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    for h in hooks:
        h.remove()
    assert sorted(seen) == [1, 3]
    for i, (x, hf_idx) in seen.items():
        router = ours.layers.sublayers[1].mlp.gate.kernel[i // 2]
        w, idx = route(jnp.asarray(x), router, c.layer_specs[i].moe)
        np.testing.assert_array_equal(np.asarray(idx), hf_idx)
        # no near-ties: the k-th and (k+1)-th router logits are apart
        logits = np.sort(x @ np.asarray(router), axis=-1)
        assert (logits[:, -2] - logits[:, -3]).min() > 1e-3
    logits, _ = ours(jnp.asarray(tokens))
    assert np.abs(ref).max() > 1.0
    np.testing.assert_allclose(np.asarray(logits), ref, atol=1e-4, rtol=0)
    # every method of the whole model ('auto' took 'touched' for these 80 tokens)
    for method in ("ragged", "dense"):
        forced = _with_method(ours, method)
        np.testing.assert_allclose(np.asarray(forced(jnp.asarray(tokens))[0]), ref,
                                   atol=1e-4, rtol=0)

    # our export: one tensor per expert, read back by transformers and by us
    save_target(ours, path.parent / "ours", max_shard_bytes=60_000)
    back = transformers.AutoModelForCausalLM.from_pretrained(path.parent / "ours").eval()
    with torch.no_grad():
        np.testing.assert_allclose(back(torch.tensor(tokens)).logits.numpy(), ref, atol=1e-5)
    again = load_target(path.parent / "ours")
    assert again.config == c
    np.testing.assert_array_equal(np.asarray(again(jnp.asarray(tokens))[0]),
                                  np.asarray(logits))


def _with_method(target, method: str):
    """A copy of ``target`` whose mixtures compute by ``method``."""
    copy = nnx.merge(*nnx.split(target))
    layers = copy.layers
    for layer in (layers.sublayers if hasattr(layers, "sublayers") else [layers]):
        if hasattr(layer.mlp, "method"):
            layer.mlp.method = method
    return copy


def test_config_reads_and_refuses():
    hf = _moe_config().to_hf()
    assert hf["architectures"] == ["Qwen3MoeForCausalLM"] and hf["num_experts"] == 8
    assert ModelConfig.from_hf(hf) == _moe_config()
    c = _moe_config(num_layers=6, decoder_sparse_step=3, mlp_only_layers=(2,))
    assert [s.moe is not None for s in c.layer_specs] == [False, False, False, False,
                                                          False, True]
    assert c.period == 6
    assert _moe_config().period == 1 and ModelConfig.from_hf(c.to_hf()) == c
    dense = _moe_config(num_experts=0)
    assert dense.num_active_params == dense.num_params
    assert _moe_config().num_active_params < _moe_config().num_params
    for bad, match in [(dict(num_experts_per_tok=9), "exceeds num_experts"),
                       (dict(moe_intermediate_size=0), "moe_intermediate_size"),
                       (dict(mlp_only_layers=(5,)), "mlp_only_layers")]:
        with pytest.raises(ValueError, match=match):
            _moe_config(**bad)
    with pytest.raises(ValueError, match="shared experts"):
        ModelConfig.from_hf({**hf, "shared_expert_intermediate_size": 64})
    with pytest.raises(ValueError, match="num_experts"):
        ModelConfig.from_hf({k: v for k, v in hf.items() if k != "num_experts"})


# ---------------------------------------------------------------- decoding


@pytest.fixture(scope="module")
def models():
    """A tiny all-MoE target with the real one's divisibility on 8 devices (8 experts,
    16 / 8 heads) and lm_head scaled (no greedy near-ties); a random DFlash drafter."""
    target = init_target(_moe_config(), key=0)
    target.lm_head[...] = target.lm_head[...] * 20.0
    graphdef, init = jitted_initializer(Drafter, DCFG, jnp.dtype(jnp.float32), None,
                                        shd.current_rules())
    return target, nnx.merge(graphdef, init(jax.random.key(1)))


def _config(**kw):
    return decode.DecodeConfig(**{"max_new_tokens": 10, "budget": 8, "verifier": "tev", **kw})


def test_speculative_tokens_equal_ar_greedy(models):
    target, drafter = models
    want = greedy_reference(target, PROMPTS, 10)
    assert len({tuple(w) for w in want}) > 4      # rows differ: the test is not vacuous
    assert engine.generate(target, drafter, PROMPTS, _config()).rows() == want
    assert engine.generate_ar(target, PROMPTS, _config()).rows() == want


@pytest.fixture(scope="module")
def single_device(models):
    """temperature -> the single-device generation (key 3)."""
    target, drafter = models
    return {t: engine.generate(target, drafter, PROMPTS,
                               _config(sampling=Sampling(t)), key=3) for t in (0.0, 1.0)}


@needs8
@pytest.mark.parametrize("mesh_name,temperature", [
    ("tensor8", 0.0),
    # the slow tier (the fast tier's time, 2026-12-06): the width split, the grouped method
    pytest.param("tensor8_expert_width", 0.0, marks=pytest.mark.slow),
    pytest.param("tensor8_grouped", 1.0, marks=pytest.mark.slow),
    # the slow tier (issue 47, item 16; 2x2x2 since issue 58, item 11): the other meshes
    *(pytest.param(m, 0.0, marks=pytest.mark.slow)
      for m in ("2x2x2", "data2_tensor4", "data8", "fsdp8"))])
def test_every_mesh_gives_single_device_tokens(models, single_device, mesh_name,
                                               temperature):
    """Experts split over tensor 8 (one per device) or 2 (with fsdp 2 splitting their
    width's embed side and data 2 the batch), the tensor-parallel alternative (experts
    whole, the expert width split over tensor 8), and the grouped kernel (interpreted)
    forced on tensor 8 ('auto' takes the touched-experts loop at these sizes): the
    single-device tokens (at T = 1 the same key gives the same draws)."""
    target, drafter = models
    rules = shd.current_rules()
    if mesh_name == "tensor8_expert_width":
        rules = tuple((n, None) if n == "experts" else (n, a) for n, a in rules)
    if mesh_name == "tensor8_grouped":
        target = _with_method(target, "grouped")
    mesh = shd.make_mesh(**MESHES[mesh_name if mesh_name in MESHES else mesh_name.split("_")[0]])
    with shd.axis_rules(rules):
        placed = shd.state_shardings(nnx.state(target), mesh, strict=True)
        gate = placed["layers"]["mlp"]["experts"]["gate_proj"].get_value()
        out = engine.generate(target, drafter, PROMPTS, _config(
            sampling=Sampling(temperature)), key=3, mesh=mesh)
    # [layers, experts, embed, moe_mlp]: experts split, or (the alternative) the width
    want = (P(None, None, None, "tensor") if mesh_name == "tensor8_expert_width" else
            P(None, "tensor", "fsdp") if mesh_name == "2x2x2" else
            P(None, "tensor") if mesh_name.startswith("tensor8") else None)
    assert want is None or gate.spec == want
    ref = single_device[temperature]
    assert out.rows() == ref.rows()
    np.testing.assert_array_equal(out.stats.block_lengths, ref.stats.block_lengths)


def test_training_flops_count_the_experts_a_token_uses():
    """`train.plan.step_model_flops` of a mixture: k experts per token. With E = 8 it is
    E = 2 = k's count plus only the wider router (2 D (E - k) per token and layer)."""
    from tev_jax.costs.plan import abstract_drafter
    from train.plan import step_model_flops

    cfg = _moe_config()
    kw = dict(batch=2, seq_len=64, anchors=4, budget=8)
    drafter = abstract_drafter(cfg)
    tokens = 2 * 64 + 2 * 4 * 9
    wide = step_model_flops(cfg, drafter, **kw)
    narrow = step_model_flops(_moe_config(num_experts=2), drafter, **kw)
    assert wide - narrow == 2 * 64 * (8 - 2) * cfg.num_layers * tokens
    dense_all = step_model_flops(_moe_config(num_experts=0, intermediate_size=8 * 32),
                                 drafter, **kw)
    assert wide < dense_all       # not every expert counted


@pytest.mark.slow
def test_rounds_report_the_experts_they_touch(models):
    """`DecodeStats.experts_touched` [R, layers]: an AR step of one row runs exactly its
    k experts in every sparse layer and none in a dense one; a tree round of 8 rows runs
    between k and all E; a dense target reports nothing."""
    target, drafter = models
    mixed = init_target(_moe_config(num_layers=4, decoder_sparse_step=2), key=2)
    ar = engine.generate_ar(mixed, PROMPTS[:1], _config())
    touched = ar.stats.experts_touched
    assert touched.shape == (ar.stats.rounds, 4)
    np.testing.assert_array_equal(touched, np.tile([0, 2, 0, 2], (ar.stats.rounds, 1)))
    spec = engine.generate(target, drafter, PROMPTS, _config()).stats.experts_touched
    assert spec.shape[1] == 2 and (spec >= 2).all() and (spec <= 8).all()
    assert spec.max() > 2              # many tokens: more than one token's experts
    dense = init_target(ModelConfig("qwen3", 64, 32, 64, 1, 4, 2, 8, qk_norm=True))
    assert engine.generate_ar(dense, [[1, 2]], _config()).stats.experts_touched is None


def test_plan_floor_counts_the_experts_a_round_touches():
    """`plan.round_floor` (in every decode plan): an AR step of B rows reads the experts B
    tokens touch, a round those of B x N; its weights exclude the experts, and a dense
    target's floor has none."""
    from tev_jax.costs import plan

    cfg = _moe_config()
    config = decode.DecodeConfig(budget=8, verifier="tev", prompt_len=16, max_new_tokens=8)
    got = plan.plan_decode_programs(cfg, config, 2, programs=("ar_step",)).floors
    ar = got["ar_step"]
    assert ar["experts_held"] == 8 and ar["experts_touched"] == expected_touched(8, 8, 2, 2)
    expert_bytes = cfg.num_layers * 8 * 3 * 64 * 32 * 4            # float32, all experts
    assert ar["experts"] == expert_bytes * ar["experts_touched"] // 8
    target, drafter = plan.abstract_models(cfg, config)
    round_ = plan.round_floor(engine.Engine.create(target, drafter, config, 2))
    assert round_["experts_touched"] == expected_touched(8, 8, 2, 2 * 9) > ar["experts_touched"]
    dense = plan.round_floor(engine.Engine.create(
        *plan.abstract_models(_moe_config(num_experts=0), config), config, 2))
    assert dense["experts"] == dense["experts_touched"] == 0
    # the dense MLP is weights where the mixture had its router
    assert dense["weights"] - round_["weights"] == cfg.num_layers * (3 * 64 * 128 - 64 * 8) * 4
    assert dense["kv"] == round_["kv"]


# ------------------------------------------------------------ compiled for TPU

def _v5e_ops(cfg, config, batch: int, program: str):
    """The per-op table of an engine program of the bf16 pair, compiled for v5e:2x4
    (data 2 x tensor 4)."""
    mesh, _ = chips.slice_mesh("v5e:2x4", data=2, tensor=4)
    target, drafter = plan.abstract_models(cfg, config, dtype=jnp.bfloat16)
    compiled = engine.Engine.create(target, drafter, config, batch, mesh=mesh).lower(
        program).compile()
    return op_costs.op_costs(compiled.as_text())


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install -e '.[tpu]')")
@pytest.mark.slow
def test_long_passes_read_the_stacked_experts_in_place_on_tpu(monkeypatch):
    """A bf16 prefill of 2 x 1024 tokens (a long pass: the grouped kernel) of a 4-layer
    mixture compiled for v5e:2x4 (data 2 x tensor 4: 4 of 16 experts per chip): one
    kernel call per layer and prefill chunk, and per chip at least a copy of every
    layer's experts fewer HBM bytes than the same program through ``ragged_dot`` (the
    control), which copies each layer's experts out of the stacked weights first."""
    cfg = _moe_config(vocab_size=4096, hidden_size=256, intermediate_size=256, num_layers=4,
                      num_heads=16, num_kv_heads=4, head_dim=64, num_experts=16,
                      moe_intermediate_size=128)
    config = decode.DecodeConfig(max_new_tokens=32, budget=16, prompt_len=1024)
    prefill_ops = lambda: _v5e_ops(cfg, config, 2, "prefill")   # noqa: E731
    ops = prefill_ops()
    kernel = [o for o in ops if o.opcode == "custom-call" and "expert_kernel" in o.source]
    assert len(kernel) == 1 and kernel[0].count % cfg.num_layers == 0   # per layer (and chunk)
    monkeypatch.setattr(moe, "choose_method", lambda *a, **k: "ragged")
    jax.clear_caches()   # trace again
    control = prefill_ops()
    assert not any(o.opcode == "custom-call" and "expert_kernel" in o.source for o in control)
    layer_experts = 3 * 4 * 256 * 128 * 2           # gate, up, down of 4 experts, bf16
    hbm = lambda ops: op_costs.totals(ops)["hbm_bytes"]
    assert hbm(ops) <= hbm(control) - cfg.num_layers * layer_experts


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install -e '.[tpu]')")
@pytest.mark.slow
def test_a_round_gathers_its_pairs_in_the_kernel_on_tpu(monkeypatch):
    """A budget-16 round at B 8 (136 tokens, 1 088 pairs) of a 2-layer bf16 mixture,
    compiled for v5e:2x4 (tensor 4): the kernel takes the tokens, and the program has no
    gather or scatter of the [1 088, D] pair rows; the control (`fits_resident` false:
    XLA gathers every pair's row, a device's own experts' quarter of them computed)
    moves at least those rows once more per layer."""
    cfg = _moe_config(vocab_size=4096, hidden_size=256, num_heads=16, num_kv_heads=4,
                      head_dim=64, num_experts=16, num_experts_per_tok=8,
                      moe_intermediate_size=128)
    config = decode.DecodeConfig(max_new_tokens=32, budget=16, prompt_len=256)
    round_ops = lambda: _v5e_ops(cfg, config, 16, "run_rounds")   # noqa: E731
    pairs = f"bf16[{8 * 17 * 8},{cfg.hidden_size}]"
    ops = round_ops()
    assert any("resident_expert_sum" in o.source for o in ops)
    assert not any(pairs in o.shape for o in ops), [o.shape for o in ops if pairs in o.shape]
    monkeypatch.setattr(expert_kernel, "RESIDENT_BYTES", 0)
    jax.clear_caches()
    control = round_ops()
    assert any(pairs in o.shape for o in control)
    hbm = lambda ops: op_costs.totals(ops)["hbm_bytes"]
    rows = 8 * 17 * 8 * cfg.hidden_size * 2
    assert hbm(ops) <= hbm(control) - cfg.num_layers * rows


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install -e '.[tpu]')")
def test_the_grouped_kernel_lowers_under_fsdp_alone_on_tpu():
    """Issue 46's KeyError in jax's ``cached_primitive_lowerings`` (on the ``closed_call``
    over the stacked experts): with fsdp alone the experts split over ``embed`` only,
    and the grouped Pallas kernel, called outside a ``shard_map``, cannot be partitioned
    ('Mosaic kernels cannot be automatically partitioned'; jax reports it as that
    KeyError). A long pass (the kernel's) of a 2-layer mixture lowers for v5e:2x4 with
    fsdp 8 and calls the kernel inside a shard_map (a manual computation)."""
    cfg = _moe_config()
    config = decode.DecodeConfig(max_new_tokens=8, budget=4, prompt_len=64)
    mesh, _ = chips.slice_mesh("v5e:2x4", fsdp=8)
    target, drafter = plan.abstract_models(cfg, config, dtype=jnp.bfloat16)
    text = engine.Engine.create(target, drafter, config, 8, mesh=mesh).lower(
        "prefill").as_text()
    assert "tpu_custom_call" in text and "manual_computation" in text


@needs8
def test_fsdp_gathers_one_layer_of_experts_per_step():
    """Under fsdp the experts are split over embed and gathered inside the experts'
    shard_map: one layer [1, E, D, F] per scan step, never the whole stack [layers, E,
    D, F] (which XLA did when the layer was sliced outside the shard_map: 58 GB of
    temporaries per chip in the full-depth Qwen3-Coder training step). A 4-layer prefill
    compiled on 8 CPU devices, fsdp 8."""
    cfg = _moe_config(num_layers=4)
    config = decode.DecodeConfig(max_new_tokens=8, budget=4, prompt_len=64)
    target, drafter = plan.abstract_models(cfg, config)
    mesh = shd.make_mesh(fsdp=8)
    text = engine.Engine.create(target, drafter, config, 8, mesh=mesh).lower(
        "prefill").compile().as_text()
    e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    gathers = {o.shape for o in op_costs.op_costs(text) if o.opcode == "all-gather"}
    one, whole = f"f32[1,{e},{d},{f}]", f"f32[{cfg.num_layers},{e},{d},{f}]"
    assert one in gathers and f"f32[1,{e},{f},{d}]" in gathers, gathers
    assert not any(whole in g or f"f32[{cfg.num_layers},{e},{f},{d}]" in g for g in gathers)
