"""Gemma 4 (tev_jax.models.families.gemma4) against transformers' Gemma4UnifiedForCausalLM.

Tiny random configs: window 8, sliding head dim 16 with 2 key/value heads, global head
dim 32 with one k = v head and proportional RoPE, soft-cap 30; every norm weight and
layer scalar is randomised (a ``1 + w`` or a dropped scalar cannot hide), embeddings
are large enough that the soft-cap bends the logits. Prompts are longer than the
window, in the native (sliding) and the full (every layer global) attention.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tev_jax.models import ModelConfig, load_target, save_target
from tev_jax.models.config import AttentionSpec
from tev_jax.tree import ancestor_mask

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

W = 8
ATOL = 1e-4
NATIVE, FULL = "native", "full"


def hf_text_config(layers=6, vocab=96, window=W, softcap=30.0, **kw):
    return transformers.Gemma4UnifiedTextConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=window,
        final_logit_softcapping=softcap, max_position_embeddings=256, **kw)


def randomise(model, seed=0):
    """Norm weights and layer scalars in [0.5, 1.5]; embeddings std 1.5."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            if "embed_tokens" in name:
                p.copy_(1.5 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
    return model


@functools.lru_cache(maxsize=None)
def hf_pair(layers=6, seed=0):
    """(HF ForCausalLM, its checkpoint directory) of a tiny random Gemma 4."""
    import tempfile

    torch.manual_seed(seed)
    cfg = hf_text_config(layers)
    cfg._attn_implementation = "eager"
    model = randomise(transformers.Gemma4UnifiedForCausalLM(cfg).eval(), seed)
    path = tempfile.mkdtemp(prefix="gemma4-")
    model.save_pretrained(path)
    return model, path


@functools.lru_cache(maxsize=None)
def ours(layers=6, window=NATIVE):
    target = load_target(hf_pair(layers)[1])
    if window == FULL:
        target = with_window(target, FULL)
    return target


def with_window(target, window):
    """The target with ``attention_window`` set (a config of the same parameters)."""
    from tev_jax.models.target import Target

    config = dataclasses.replace(target.config, attention_window=window)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Target(config, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, nnx.state(target))


def hf_logits(model, tokens, window=NATIVE):
    """HF float32 logits [B, T, V]; ``full``: sliding layers see the whole prefix."""
    old = model.config.sliding_window
    if window == FULL:
        model.config.sliding_window = 10 ** 6
    try:
        with torch.no_grad():
            out = model(torch.as_tensor(np.asarray(tokens), dtype=torch.long))
    finally:
        model.config.sliding_window = old
    return out.logits.float().numpy()


def prompts(b, t, vocab=96, seed=1):
    return np.random.default_rng(seed).integers(0, vocab, (b, t)).astype(np.int32)


# ------------------------------------------------------------------ config / layout


def test_config_is_read_as_transformers_builds_it():
    c = ours().config
    assert c.model_type == "gemma4_unified_text" and c.period == 6
    specs = c.layer_specs
    assert [s.attention.window for s in specs] == [W] * 5 + [None]
    assert specs[5].attention == AttentionSpec(32, 1, None, True, 1e6, 0.25)
    assert specs[0].attention == AttentionSpec(16, 2, W, False, 1e4, 1.0)
    assert c.final_logit_softcap == 30.0 and c.embed_scale == 32 ** 0.5
    full = dataclasses.replace(c, attention_window=FULL)
    assert all(s.attention.window is None for s in full.layer_specs)
    # parameter count = transformers' (tied head counted once)
    assert c.num_params == sum(p.numel() for p in hf_pair()[0].parameters()) + 6


def test_bad_configs_name_the_problem(tmp_path):
    base = hf_text_config().to_dict()
    with pytest.raises(ValueError, match="unknown layer type"):
        ModelConfig.from_hf({**base, "layer_types": ["sliding_attention"] * 5 + ["chunked"]})
    with pytest.raises(ValueError, match="text_config"):
        ModelConfig.from_hf({"model_type": "gemma4_unified"})
    with pytest.raises(ValueError, match="num_kv_shared_layers"):
        ModelConfig.from_hf({**base, "num_kv_shared_layers": 2})
    with pytest.raises(ValueError, match="attention_window"):
        dataclasses.replace(ours().config, attention_window="wide")
    with pytest.raises(ValueError, match="rope type"):
        ModelConfig.from_hf({**base, "rope_parameters": {
            "sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6}}})


# ------------------------------------------------------------------------- parity


@pytest.mark.parametrize("window", [NATIVE, FULL])
def test_logits_match_transformers_past_the_window(window):
    """Whole-sequence float32 logits of a 20-token prompt (window 8), 6 and 12 layers."""
    tokens = prompts(2, 20)
    for layers in (6, 12):
        want = hf_logits(hf_pair(layers)[0], tokens, window)
        got = np.asarray(jax.jit(lambda t, m=ours(layers, window): m(t)[0])(tokens))
        assert np.abs(got - want).max() < ATOL
        assert np.abs(want).max() > 15   # the soft-cap bends these logits
    # the window matters: native and full differ past it, agree before it
    nat, full = (hf_logits(hf_pair(6)[0], tokens, w) for w in (NATIVE, FULL))
    assert np.abs(nat[:, :W] - full[:, :W]).max() < ATOL
    assert np.abs(nat[:, W:] - full[:, W:]).max() > 1e-2


@pytest.mark.parametrize("window", [NATIVE, FULL])
def test_prefill_and_ar_steps_across_the_window_edge(window):
    """Chunked prefill of 5 tokens, then 12 single-token steps (positions 5..16)."""
    model = ours(6, window)
    tokens = prompts(2, 17, seed=2)
    want = hf_logits(hf_pair(6)[0], tokens, window)
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, tokens):
        m = nnx.merge(graphdef, state)
        cache = m.init_cache(2, 32)
        logits, _, cache = m.prefill(cache, tokens[:, :5], jnp.full((2,), 5), chunk=3)

        def step(cache, t):
            logits, _, cache = m.decode(cache, tokens[:, t], jnp.full((2,), t))
            return cache, logits

        _, steps = jax.lax.scan(step, cache, jnp.arange(5, 17))
        return jnp.concatenate([logits[:, None], steps.swapaxes(0, 1)], 1)

    got = np.asarray(run(state, jnp.asarray(tokens)))
    assert np.abs(got - want[:, 4:]).max() < ATOL


@pytest.mark.parametrize("window", [NATIVE, FULL])
def test_tree_verify_equals_a_forward_of_each_path(window):
    """A 7-node tree after 11 committed tokens (> W): node logits = the last logits of a
    transformers forward of prefix + the node's root path."""
    model = ours(6, window)
    prefix = prompts(1, 11, seed=3)[0]
    parents = [-1, 0, 0, 1, 1, 3, 5]
    depths = [0, 1, 1, 2, 2, 3, 4]
    tokens = np.random.default_rng(4).integers(0, 96, 7).astype(np.int32)
    from tev_jax.tree import DraftTree

    tree = DraftTree(tokens=jnp.asarray(tokens), parents=jnp.asarray(parents, jnp.int32),
                     depths=jnp.asarray(depths, jnp.int32), valid=jnp.ones(7, bool))
    anc = ancestor_mask(tree)
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state):
        m = nnx.merge(graphdef, state)
        cache = m.init_cache(1, 32)
        _, _, cache = m.prefill(cache, jnp.asarray(prefix)[None], jnp.array([11]))
        logits, _, _ = m.verify_tree(cache, tree.tokens[None], tree.depths[None],
                                     anc[None], jnp.array([11]))
        return logits[0]

    got = np.asarray(run(state))
    hf = hf_pair(6)[0]
    for i in range(7):
        path, j = [], i
        while j >= 0:
            path.append(int(tokens[j]))
            j = parents[j]
        seq = np.concatenate([prefix, path[::-1]])[None]
        want = hf_logits(hf, seq, window)[0, -1]
        assert np.abs(got[i] - want).max() < ATOL, i


# -------------------------------------------------------------------- checkpoints


def test_unified_checkpoint_and_round_trip(tmp_path):
    """The text part of a Gemma4UnifiedForConditionalGeneration (vision / audio
    embedders skipped) loads to the same logits; our text-only save loads back in
    transformers."""
    hf, _ = hf_pair(6)
    text = hf_text_config()
    vision = transformers.Gemma4UnifiedVisionConfig(
        patch_size=2, pooling_kernel_size=1, mm_embed_dim=8, mm_posemb_size=4,
        output_proj_dims=32)
    cfg = transformers.Gemma4UnifiedConfig(text_config=text.to_dict(),
                                           vision_config=vision.to_dict())
    full = transformers.Gemma4UnifiedForConditionalGeneration(cfg).eval()
    full.model.language_model.load_state_dict(hf.model.state_dict())
    full.save_pretrained(tmp_path / "unified")
    names = json.loads((tmp_path / "unified" / "config.json").read_text())
    assert names["model_type"] == "gemma4_unified"
    tokens = prompts(1, 12, seed=5)
    want = hf_logits(hf, tokens)
    got = np.asarray(load_target(tmp_path / "unified")(jnp.asarray(tokens))[0])
    assert np.abs(got - want).max() < ATOL

    save_target(ours(), tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours",
                                                             attn_implementation="eager")
    assert type(back).__name__ == "Gemma4UnifiedForCausalLM"
    assert not any("v_proj" in n for n, _ in back.named_parameters()
                   if ".5." in n)  # the k = v layer has none
    assert np.abs(hf_logits(back, tokens) - want).max() < ATOL


# ------------------------------------------------------------ speculative decoding


def gemma_config(**kw) -> ModelConfig:
    """A Gemma 4 config built directly (sharding-friendly widths: 16 heads, 8 kv heads
    in sliding layers, one k = v head of twice the width in the global one)."""
    base = dict(model_type="gemma4_unified_text", vocab_size=512, hidden_size=64,
                intermediate_size=128, num_layers=6, num_heads=16, num_kv_heads=8,
                head_dim=8, qk_norm=True, tie_word_embeddings=True,
                layer_types=("sliding_attention",) * 5 + ("full_attention",),
                sliding_window=W,
                global_attention=AttentionSpec(16, 1, None, True, 1e6, 0.25),
                norm_style="float32", sandwich_norms=True, v_norm=True,
                attention_scale=1.0, hidden_act="gelu_tanh", embed_scale=8.0,
                final_logit_softcap=30.0)
    return ModelConfig(**{**base, **kw})


def gemma_target(config, seed=0, embed_std=1.0):
    from tev_jax.models import init_target

    target = init_target(config, key=seed)
    target.embed_tokens[...] = target.embed_tokens[...] * (embed_std / 0.02)
    return target


@pytest.fixture(scope="module")
def decode_models():
    from test_decode_mesh import DCFG

    from tev_jax import sharding as shd
    from tev_jax.models.drafter import Drafter
    from tev_jax.models.layers import jitted_initializer

    dcfg = dataclasses.replace(DCFG, num_target_layers=6, target_layer_ids=(1, 5))
    graphdef, init = jitted_initializer(Drafter, dcfg, jnp.dtype(jnp.float32), None,
                                        shd.current_rules())
    return gemma_target(gemma_config()), nnx.merge(graphdef, init(jax.random.key(1)))


def _decode_config(**kw):
    from tev_jax import decode

    return decode.DecodeConfig(**{"max_new_tokens": 10, "budget": 8, "verifier": "tev",
                                  **kw})


@pytest.mark.slow  # the fast tier's time (README: under 10 minutes here), 2026-12-06
def test_speculative_tokens_equal_ar_greedy_past_the_window(decode_models):
    """T = 0: prompts of 1..7 tokens + 10 new ones cross the window of 8."""
    from decode_fixtures import greedy_reference
    from test_decode_mesh import PROMPTS

    from tev_jax import engine

    target, drafter = decode_models
    want = greedy_reference(target, PROMPTS, 10)
    assert len({tuple(w) for w in want}) > 4
    assert engine.generate(target, drafter, PROMPTS, _decode_config()).rows() == want
    assert engine.generate_ar(target, PROMPTS, _decode_config()).rows() == want


@pytest.mark.slow
def test_first_three_tokens_follow_the_soft_capped_target():
    """T = 1 exactness with the soft-cap, as tests/test_decode_stats.py: V = 8, a
    sliding layer of window 2 and a global one, prompt of 3 (the window edge is
    crossed), soft-cap 3 on logits up to ~10 (the cap changes the law: total variation
    > 0.05 from the uncapped one). Seed 11: 50 000 TEV generations, chi-square over the
    512 three-token sequences at significance 1e-3 (cells below 5 expected pooled); the
    negative control (TEV with the bonus from the exit's full distribution; seed 12,
    50 000) is rejected at the same level."""
    import test_decode_stats as st
    from decode_fixtures import TableDrafter, jit_score, oracle_table

    from tev_jax.sampling import log_probs

    config = gemma_config(vocab_size=st.V, hidden_size=16, intermediate_size=32,
                          num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                          layer_types=("sliding_attention", "full_attention"),
                          sliding_window=2, embed_scale=4.0, final_logit_softcap=3.0,
                          global_attention=AttentionSpec(16, 1, None, True, 1e6, 0.5))
    target = gemma_target(config, seed=4, embed_std=1.0)
    p = len(st.PROMPT)
    pairs = np.stack(np.meshgrid(np.arange(st.V), np.arange(st.V), indexing="ij"),
                     -1).reshape(-1, 2)
    seqs = np.concatenate([np.tile(st.PROMPT, (st.V * st.V, 1)), pairs], axis=1)

    def law_of(logits):
        lp = np.asarray(log_probs(jnp.asarray(logits), st.SAMPLING),
                        np.float64).reshape(st.V, st.V, p + 2, st.V)
        law = np.exp(lp[0, 0, p - 1][:, None, None] + lp[:, 0, p][:, :, None]
                     + lp[:, :, p + 1])
        return law / law.sum()

    law = law_of(jit_score(target)(seqs))
    raw = np.asarray(target.unembed(jax.jit(lambda t: target.layer_stack(
        t, jnp.broadcast_to(jnp.arange(t.shape[1]), t.shape),
        lambda layer, q, k, v, c: (_plain_attention(target, layer, q, k, v), c))[0])(
        jnp.asarray(seqs)), softcap=False))
    assert 0.5 * np.abs(law_of(raw) - law).sum() > 0.05     # the cap matters
    assert np.sort(law.reshape(-1))[-1] < 0.5 and (law > 1e-3).sum() > 20
    drafter = TableDrafter(oracle_table(target, st.PROMPT, st.H))
    for name, verifier, seeds in (("tev", "tev", st.SEEDS[:1]),
                                  ("control", st.tev_full_bonus, st.SEEDS[1:])):
        counts = np.zeros(st.V ** 3, np.int64)
        for seed in seeds:
            gen = st._generate(target, drafter, verifier, seed)
            t = gen.tokens
            np.add.at(counts, t[:, 0] * st.V * st.V + t[:, 1] * st.V + t[:, 2], 1)
        pvalue = st._chi2_pvalue(counts.reshape(st.V, st.V, st.V), law)
        assert (pvalue > st.ALPHA) if name == "tev" else (pvalue < st.ALPHA), name


def _plain_attention(target, layer, q, k, v):
    """Causal windowed self-attention (the uncapped reference's layers)."""
    from tev_jax.models.attention import Mask, attention, windowed

    b, t = q.shape[:2]
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return attention(q, ((k, v, windowed(Mask.causal(t), layer.window, pos)),),
                     scale=target.config.attention_scale)


def test_plan_floor_counts_each_sliding_layer_window():
    """`plan.round_floor` of an AR step (N = 1) with a cache of L = 1024: a sliding
    layer's key/value bytes count W + N of the L slots, a global layer's all of them;
    with ``attention_window='full'`` every layer counts L."""
    from tev_jax.costs import plan
    from tev_jax.decode import DecodeConfig
    from tev_jax.engine import Engine

    config = DecodeConfig(builder="none", prompt_len=960, max_cache_len=1024,
                          max_new_tokens=32)
    kv = {}
    for window in (NATIVE, FULL):
        target = plan.abstract_target(dataclasses.replace(gemma_config(),
                                                          attention_window=window))
        kv[window] = plan.round_floor(Engine.create(target, None, config, 2))["kv"]
    # float32, B = 2, one layer per period sub-layer; k and v
    sliding = 2 * 1024 * 8 * 8 * 4          # one sliding array: [1, B, L, 8, 8]
    glob = 2 * 1024 * 1 * 16 * 4            # the global array: [1, B, L, 1, 16]
    assert kv[FULL] == 2 * (5 * sliding + glob)
    assert kv[NATIVE] == 2 * (5 * sliding * (W + 1) // 1024 + glob)


def test_drafter_logits_are_the_raw_head_or_the_drafter_cap(decode_models):
    """A DFlash drafter for Gemma takes the target's head without the target's cap
    (the authors' drafter); z-lab's ``final_logit_softcapping`` gives it its own and
    ``output_multiplier`` scales the logits before it, in decoding (`draft_unembed`)
    and in training's blocked head (`draft_head`, its gradient included)."""
    import types

    from tev_jax.models import lm_head
    from tev_jax.models.drafter import DrafterConfig, draft_head, draft_unembed

    target, drafter = decode_models
    h = jnp.asarray(np.random.default_rng(6).normal(size=(3, 64)), jnp.float32)
    raw = np.asarray(target.unembed(h, softcap=False))
    assert np.abs(raw - np.asarray(target.unembed(h))).max() > 1.0   # the cap bites
    np.testing.assert_allclose(np.asarray(draft_unembed(drafter, target, h)), raw)
    hf = drafter.config.to_hf()
    hf["dflash_config"]["final_logit_softcapping"] = 5.0
    cfg = DrafterConfig.from_hf(hf)
    assert cfg.logit_softcap == 5.0 and DrafterConfig.from_hf(cfg.to_hf()) == cfg
    capped = types.SimpleNamespace(config=cfg)
    want = 5.0 * np.tanh(raw / 5.0)
    np.testing.assert_allclose(np.asarray(draft_unembed(capped, target, h)), want, rtol=1e-5)
    lse = lm_head.logsumexp(h, draft_head(capped, target), block=128)
    np.testing.assert_allclose(np.asarray(lse), np.log(np.exp(want).sum(-1)), rtol=1e-5)
    # z-lab's output_multiplier scales the logits before the cap, in both heads
    hf["dflash_config"]["output_multiplier"] = 0.5
    cfg = DrafterConfig.from_hf(hf)
    assert cfg.output_multiplier == 0.5 and DrafterConfig.from_hf(cfg.to_hf()) == cfg
    scaled = types.SimpleNamespace(config=cfg)
    want = 5.0 * np.tanh(0.5 * raw / 5.0)
    np.testing.assert_allclose(np.asarray(draft_unembed(scaled, target, h)), want, rtol=1e-5)
    lse = lambda h: lm_head.logsumexp(h, draft_head(scaled, target), block=128)  # noqa: E731
    np.testing.assert_allclose(np.asarray(lse(h)), np.log(np.exp(want).sum(-1)), rtol=1e-5)
    direct = lambda h: jax.nn.logsumexp(draft_unembed(scaled, target, h), -1)  # noqa: E731
    np.testing.assert_allclose(np.asarray(jax.grad(lambda h: lse(h).sum())(h)),
                               np.asarray(jax.grad(lambda h: direct(h).sum())(h)), atol=1e-5)


def test_drafter_input_embedding_scale_scales_the_block_embeddings(decode_models):
    """z-lab's ``input_embedding_scale``: the block's target embeddings (with the
    target's own sqrt(D) scale) times s, in decoding (`draft_hidden`) and training
    (`anchor_hidden`): equal to a target whose embedding table is s times larger."""
    from tev_jax.models import drafter as dr

    target, drafter = decode_models
    scaled = nnx.clone(drafter)
    scaled.config = dataclasses.replace(drafter.config, input_embedding_scale=2.5)
    bigger = nnx.clone(target)
    bigger.embed_tokens[...] = target.embed_tokens[...] * 2.5
    rng = np.random.default_rng(7)
    feats = jnp.asarray(rng.normal(size=(2, 6, drafter.config.feature_size)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 500, (2, 6)), jnp.int32)
    anchors = jnp.asarray([[0, 2], [1, 3]], jnp.int32)
    got = dr.anchor_hidden(scaled, target, feats, tokens, anchors)
    want = dr.anchor_hidden(drafter, bigger, feats, tokens, anchors)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    plain = dr.anchor_hidden(drafter, target, feats, tokens, anchors)
    assert np.abs(np.asarray(got) - np.asarray(plain)).max() > 1e-3


def test_blocked_head_is_soft_capped_with_its_gradient():
    """The blocked LM head (training's exit law) equals the capped dense logits: the
    logsumexp, its gradient in the hidden states, the logit of a token, the top-k."""
    from tev_jax.models import lm_head

    rng = np.random.default_rng(7)
    w = jnp.asarray(rng.normal(size=(300, 16)) * 3, jnp.float32)
    h = jnp.asarray(rng.normal(size=(4, 16)), jnp.float32)
    head = lm_head.Head(w, True, 30.0)
    dense = lambda h: 30.0 * jnp.tanh(h @ w.T / 30.0)  # noqa: E731
    assert float(jnp.abs(dense(h) - h @ w.T).max()) > 1.0
    lse = lambda h: lm_head.logsumexp(h, head, 0.5, block=128).sum()  # noqa: E731
    ref = lambda h: jax.nn.logsumexp(0.5 * dense(h), axis=-1).sum()  # noqa: E731
    np.testing.assert_allclose(float(lse(h)), float(ref(h)), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(jax.grad(lse)(h)), np.asarray(jax.grad(ref)(h)),
                               rtol=1e-4, atol=1e-6)
    tok = jnp.array([0, 5, 299, 17])
    np.testing.assert_allclose(np.asarray(lm_head.logits_at(h, head, tok)),
                               np.asarray(dense(h)[jnp.arange(4), tok]), rtol=1e-5)
    vals, ids, _ = lm_head.top_k(h, head, 3, block=128)
    np.testing.assert_allclose(np.asarray(vals), np.sort(np.asarray(dense(h)), -1)[:, ::-1][:, :3],
                               rtol=1e-5)


@pytest.mark.slow  # the fast tier's time (README: under 10 minutes here), 2026-12-06
def test_exittrain_scoring_passes_see_the_window():
    """ExitTrain's scoring passes (`tev_jax.tree_scoring`) of a 20-token sequence with
    anchors past the window: every tree node's logits (the one-pass scoring and the
    pooled pass over parents) equal transformers' forward of the sequence before its
    anchor and its root path, in the native and the full window."""
    from tev_jax.tree import DraftTree
    from tev_jax.tree_scoring import score_parent_nodes, score_tree_nodes, target_context

    parents = np.array([-1, 0, 0, 1, 3], np.int32)
    depths = np.array([0, 1, 1, 2, 3], np.int32)
    seq = prompts(1, 20, seed=8)
    anchors = np.array([[9, 15]], np.int32)
    extra = np.random.default_rng(9).integers(0, 96, (1, 2, 5)).astype(np.int32)
    extra[:, :, 0] = seq[0, anchors[0]]                  # slot 0 holds tokens[anchor]
    trees = DraftTree(tokens=jnp.asarray(extra), parents=jnp.broadcast_to(parents, (1, 2, 5)),
                      depths=jnp.broadcast_to(depths, (1, 2, 5)),
                      valid=jnp.ones((1, 2, 5), bool))
    for window in (NATIVE, FULL):
        model = ours(6, window)
        graphdef, state = nnx.split(model)

        @jax.jit
        def run(state):
            m = nnx.merge(graphdef, state)
            _, cache = target_context(m, jnp.asarray(seq), ())
            return (score_tree_nodes(m, cache, trees, jnp.asarray(anchors)),
                    score_parent_nodes(m, cache, trees, jnp.asarray(anchors), 6))

        every, parent = (np.asarray(x) for x in run(state))
        for a, anchor in enumerate(anchors[0]):
            for v in range(5):
                path, j = [], v
                while j >= 0:
                    path.append(int(extra[0, a, j]))
                    j = parents[j]
                want = hf_logits(hf_pair(6)[0], np.concatenate([seq[0, :anchor],
                                                                 path[::-1]])[None], window)
                assert np.abs(every[0, a, v] - want[0, -1]).max() < ATOL, (window, a, v)
                if v in (0, 1, 3):                        # the nodes with children
                    assert np.abs(parent[0, a, v] - want[0, -1]).max() < ATOL


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install -e '.[tpu]')")
@pytest.mark.slow
def test_bf16_ar_step_compiles_for_tpu_with_windowed_sliding_layers():
    """The AR step of a 6-layer Gemma 4 (5 sliding + 1 global), bf16, cache 2048, window 8,
    compiled for v5e:2x4 (tensor 8): the sliding layers' attention reads its window (no
    attention or cache op reads a whole sliding cache array), the global layer's cache is
    read by the TPU cache kernel, and the step's HBM bytes are within 1.25x of its floor
    (which counts each sliding layer's window), which HBM and on-chip memory cover."""
    from tev_jax.costs import chips, op_costs, plan
    from tev_jax.decode import DecodeConfig
    from tev_jax.engine import Engine

    cfg = gemma_config(vocab_size=4096, hidden_size=256, intermediate_size=512, head_dim=64,
                       global_attention=AttentionSpec(128, 1, None, True, 1e6, 0.25))
    config = DecodeConfig(builder="none", prompt_len=1024, max_cache_len=2048,
                          max_new_tokens=256)
    mesh, _ = chips.slice_mesh("v5e:2x4", tensor=8)
    engine = Engine.create(plan.abstract_target(cfg, jnp.bfloat16), None, config, 8,
                           mesh=mesh)
    ops = plan.loop_ops(engine)
    kernel = [o for o in ops if o.opcode == "custom-call" and "cache_attention" in o.source]
    assert kernel and all(o.in_loop for o in kernel)
    sliding_cache = 8 * 2048 * 1 * 64 * 2          # one sliding array per chip: 1 of 8 heads
    assert not [o for o in ops if o.in_loop and o not in kernel
                and ("attention" in o.source or "kv_cache" in o.source)
                and o.bytes / o.count >= sliding_cache], "a sliding layer reads its whole cache"
    floor = plan.sum_floor(plan.round_floor(engine))
    t = op_costs.totals(ops)   # (weights this small stay on chip across steps: on_chip_once)
    assert t["loop_hbm_bytes"] <= 1.25 * floor <= 1.25 * (t["loop_hbm_bytes"] + t["on_chip_once"])
