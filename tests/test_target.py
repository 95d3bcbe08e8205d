"""Target model: parity with transformers, cache modes, tree verify, commit, export.

Every family runs every test: Qwen3, Llama-3 and Qwen3-MoE (a mixture of 8 experts,
top-2, in every layer; its AR steps take the gathered-experts path, the longer passes
the grouped matmul; tests/test_moe.py has the rest of the mixture's tests).
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tev_jax.models import (
    ModelConfig, commit, init_target, load_target, save_target, score,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V, D = 300, 64
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def _hf_model(family: str, seed: int = 0):
    """A tiny random HF model; norms and biases perturbed so they matter."""
    torch.manual_seed(seed)
    common = dict(vocab_size=V, hidden_size=D, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=256, initializer_range=0.1)
    if family == "qwen3":
        cfg = transformers.Qwen3Config(**common, tie_word_embeddings=False, rope_theta=10000.0)
        model = transformers.Qwen3ForCausalLM(cfg)
    elif family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, tie_word_embeddings=False,
                                          num_experts=8, num_experts_per_tok=2,
                                          moe_intermediate_size=32, norm_topk_prob=True)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=True, attention_bias=True,
                                       rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE))
        model = transformers.LlamaForCausalLM(cfg)
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.2 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):  # the router: no near-ties in the top-k
                p.mul_(10.0)
    return model


@pytest.fixture(scope="module", params=["qwen3", "llama", "qwen3_moe"])
def hf_ckpt(request, tmp_path_factory):
    """(HF torch model, checkpoint dir, our loaded model) for each family."""
    model = _hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, path, load_target(path)


def _hf_logits(model, tokens):
    with torch.no_grad():
        out = model(torch.tensor(np.asarray(tokens)), output_hidden_states=True)
    return out.logits.numpy(), [h.numpy() for h in out.hidden_states]


def _tokens(shape, seed=0):
    return np.random.RandomState(seed).randint(0, V, shape).astype(np.int32)


# Every jitted call below uses a few canonical shapes and always requests both taps, so
# each (family, dtype) compiles each mode once for the whole module (the suite must stay
# fast on two cores).
TAPS = (0, 1)
ROWS, WIDTH = 16, 24        # cache-free forward: [16, 24], inputs padded up to it
MAX_LEN = 32                # cache slots


@functools.partial(jax.jit, static_argnames=("graphdef", "method"))
def _jitted(graphdef, state, *args, method):
    return getattr(nnx.merge(graphdef, state), method)(*args, taps=TAPS)


def call(model, method, *args):
    """``model.method(*args, taps=TAPS)`` under jit (split / merge, as in hot loops)."""
    graphdef, state = nnx.split(model)
    args = [jax.tree.map(jnp.asarray, a) for a in args]
    return _jitted(graphdef, state, *args, method=method)


def fwd(model, tokens):
    """Cache-free causal forward under jit: (logits [B, T, V], taps [B, T, 2D]).

    Inputs are padded to [ROWS, WIDTH]; right padding cannot change causal outputs.
    """
    tokens = np.asarray(tokens)
    b, t = tokens.shape
    padded = np.zeros((ROWS, WIDTH), np.int32)
    padded[:b, :t] = tokens
    logits, taps = call(model, "__call__", padded)
    return np.asarray(logits[:b, :t]), np.asarray(taps[:b, :t])


# ------------------------------------------------------------------------- parity


def test_logits_and_hidden_states_match_transformers(hf_ckpt):
    hf, _, ours = hf_ckpt
    tokens = _tokens((ROWS, WIDTH))
    ref_logits, ref_hidden = _hf_logits(hf, tokens)
    logits, taps = fwd(ours, tokens)
    assert logits.dtype == np.float32
    assert np.abs(ref_logits).max() > 1.0  # the comparison is not vacuous
    np.testing.assert_allclose(np.asarray(logits), ref_logits, atol=1e-4, rtol=0)
    # layer i's tap is HF hidden_states[i + 1] (the last one after the final norm)
    np.testing.assert_allclose(np.asarray(taps[..., :D]), ref_hidden[1], atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(taps[..., D:]), ref_hidden[2], atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(score(ours, tokens[:1, :8])), ref_logits[:1, :8],
                               atol=1e-4, rtol=0)


def test_prefill_then_decode_equals_full_forward(hf_ckpt):
    _, _, model = hf_ckpt
    lengths = np.array([7, 11], np.int32)
    tokens = _tokens((2, 20), seed=1)
    full, full_taps = fwd(model, tokens)

    cache = model.init_cache(2, MAX_LEN)
    padded = np.where(np.arange(12)[None] < lengths[:, None], tokens[:, :12], 0)
    logits, feats, cache = call(model, "prefill", cache, padded, lengths)
    for b in range(2):
        np.testing.assert_allclose(np.asarray(logits[b]), full[b, lengths[b] - 1], atol=1e-4)
        np.testing.assert_allclose(np.asarray(feats[b, :lengths[b]]),
                                   full_taps[b, :lengths[b]], atol=1e-4)
    start = lengths.copy()
    for _ in range(6):
        tok = tokens[np.arange(2), start]
        logits, f, cache = call(model, "decode", cache, tok, start)
        for b in range(2):
            np.testing.assert_allclose(np.asarray(logits[b]), full[b, start[b]], atol=1e-4)
            np.testing.assert_allclose(np.asarray(f[b]), full_taps[b, start[b]], atol=1e-4)
        start = start + 1


# A small tree (slot order is topological):
#
#          0 (root)
#        /   \
#       1     2
#      / \    |
#     3   4   5
#     |
#     6
PARENTS = np.array([-1, 0, 0, 1, 1, 2, 3])


def _tree_arrays(parents):
    """depths [N] and ancestor mask [N, N] (j is i or an ancestor of i), by hand."""
    n = len(parents)
    depths = np.zeros(n, np.int32)
    anc = np.eye(n, dtype=bool)
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
        anc[i] = anc[parents[i]]
        anc[i, i] = True
    return depths, anc


def _path(parents, i):
    out = [i]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out[::-1]


def _last_logits(model, seqs):
    """Full-forward logits and taps after the last token of each variable-length seq."""
    padded = np.zeros((len(seqs), WIDTH), np.int32)
    for r, x in enumerate(seqs):
        padded[r, :len(x)] = x
    logits, feats = fwd(model, padded)
    last = np.array([len(x) - 1 for x in seqs])
    rows = np.arange(len(seqs))
    return logits[rows, last], feats[rows, last]


def _prefilled(model, prompts, lengths):
    """A cache after prefilling right-padded prompts (always as a [2, 12] block)."""
    block = np.zeros((2, 12), np.int32)
    block[:, :prompts.shape[1]] = prompts
    cache = model.init_cache(2, MAX_LEN)
    return call(model, "prefill", cache, block, lengths)[2]


def test_tree_verify_matches_full_forward_of_each_path(hf_ckpt):
    _, _, model = hf_ckpt
    depths, anc = _tree_arrays(PARENTS)
    n = len(PARENTS)
    lengths = np.array([5, 9], np.int32)
    prompts = _tokens((2, 9), seed=2)
    tree_tokens = _tokens((2, n), seed=3)
    cache = _prefilled(model, prompts, lengths)

    depths_b, anc_b = np.stack([depths, depths]), np.stack([anc, anc])
    logits, taps, cache2 = call(model, "verify_tree", cache, tree_tokens, depths_b, anc_b,
                                lengths)

    seqs = [np.concatenate([prompts[b, :lengths[b]], tree_tokens[b, _path(PARENTS, i)]])
            for b in range(2) for i in range(n)]
    ref, ref_taps = _last_logits(model, seqs)
    np.testing.assert_allclose(np.asarray(logits).reshape(2 * n, -1), ref, atol=1e-4)
    np.testing.assert_allclose(np.asarray(taps).reshape(2 * n, -1), ref_taps, atol=1e-4)
    # the tree's keys/values land at slots start .. start+n-1; the prefix is untouched
    np.testing.assert_array_equal(np.asarray(cache2.k[:, 0, :5]), np.asarray(cache.k[:, 0, :5]))
    assert not np.allclose(np.asarray(cache2.k[:, 0, 5:5 + n]), np.asarray(cache.k[:, 0, 5:5 + n]))


def test_commit_then_decode_equals_decoding_the_path(hf_ckpt):
    _, _, model = hf_ckpt
    depths, anc = _tree_arrays(PARENTS)
    lengths = np.array([6, 4], np.int32)
    prompts = _tokens((2, 6), seed=4)
    tree_tokens = _tokens((2, len(PARENTS)), seed=5)
    cache = _prefilled(model, prompts, lengths)
    _, _, cache = call(model, "verify_tree", cache, tree_tokens, np.stack([depths, depths]),
                       np.stack([anc, anc]), lengths)
    # row 0 accepts root -> 1 -> 3 -> 6, row 1 accepts root -> 2
    paths = np.array([[0, 1, 3, 6], [0, 2, -1, -1]], np.int32)
    plen = np.array([4, 2], np.int32)
    cache = jax.jit(commit)(cache, jnp.asarray(lengths), jnp.asarray(paths), jnp.asarray(plen))
    nxt = np.array([17, 23], np.int32)
    logits, _, cache = call(model, "decode", cache, nxt, lengths + plen)

    seqs = [np.concatenate([prompts[b, :lengths[b]], tree_tokens[b, paths[b, :plen[b]]],
                            nxt[b:b + 1]]) for b in range(2)]
    ref, _ = _last_logits(model, seqs)
    np.testing.assert_allclose(np.asarray(logits), ref, atol=1e-4)

    # the committed cache equals decoding the accepted tokens one by one
    ref_cache = _prefilled(model, prompts, lengths)
    s = lengths.copy()
    for j in range(4):
        tok = np.array([tree_tokens[0, paths[0, j]], tree_tokens[1, paths[1, min(j, 1)]]])
        _, _, ref_cache = call(model, "decode", ref_cache, tok, s)
        s = s + 1
    for b in range(2):
        k = int(lengths[b] + plen[b])
        np.testing.assert_allclose(np.asarray(cache.k[:, b, :k]),
                                   np.asarray(ref_cache.k[:, b, :k]), atol=1e-5)
        np.testing.assert_allclose(np.asarray(cache.v[:, b, :k]),
                                   np.asarray(ref_cache.v[:, b, :k]), atol=1e-5)


# ------------------------------------------------------------------ export, dtypes


def test_export_reads_back_in_transformers(hf_ckpt, tmp_path):
    """Our export of the loaded model (qwen3 untied; llama tied, biased, llama3 rope;
    qwen3_moe one tensor per expert)."""
    hf, _, model = hf_ckpt
    save_target(model, tmp_path / "out")
    back_hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    back_hf.eval()
    assert type(back_hf) is type(hf)
    tokens = _tokens((ROWS, WIDTH), seed=6)
    ref, _ = _hf_logits(hf, tokens)
    again, _ = _hf_logits(back_hf, tokens)
    np.testing.assert_allclose(again, ref, atol=1e-5, rtol=0)
    np.testing.assert_allclose(fwd(model, tokens)[0], again, atol=1e-4, rtol=0)
    back = load_target(tmp_path / "out")
    assert back.config == model.config
    np.testing.assert_array_equal(fwd(back, tokens)[0], fwd(model, tokens)[0])


def test_init_target_exports_too(tmp_path):
    cfg = ModelConfig("qwen3", V, D, 96, 1, 4, 2, 16, tie_word_embeddings=True, qk_norm=True)
    save_target(init_target(cfg, key=1), tmp_path / "fresh")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fresh")
    assert hf.config.tie_word_embeddings and hf.config.num_hidden_layers == 1
    assert load_target(tmp_path / "fresh").config == cfg


def test_sharded_checkpoint_files_and_index(tmp_path):
    hf = _hf_model("qwen3", seed=3)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="60KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    model = load_target(tmp_path / "hf")
    tokens = _tokens((1, 16))
    ref, _ = _hf_logits(hf, tokens)
    ours = fwd(model, tokens)[0]
    np.testing.assert_allclose(ours, ref, atol=1e-4)
    save_target(model, tmp_path / "ours", max_shard_bytes=50_000)
    assert len(list((tmp_path / "ours").glob("*.safetensors"))) > 1
    again = load_target(tmp_path / "ours")
    np.testing.assert_array_equal(fwd(again, tokens)[0], ours)


def test_failed_save_leaves_nothing(tmp_path, monkeypatch):
    import safetensors.numpy

    model = init_target(ModelConfig("llama", V, D, 96, 1, 4, 2, 16), key=0)
    save_target(model, tmp_path / "keep")
    before = sorted(p.name for p in tmp_path.iterdir())

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.numpy, "save_file", boom)
    with pytest.raises(OSError):
        save_target(model, tmp_path / "new")
    with pytest.raises(OSError):
        save_target(model, tmp_path / "keep")
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    load_target(tmp_path / "keep")


@pytest.fixture(scope="module")
def qwen3_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_bf16")
    _hf_model("qwen3").save_pretrained(path)
    return path


def test_bfloat16_smoke(qwen3_ckpt, tmp_path):
    path = qwen3_ckpt
    model32 = load_target(path)
    model = load_target(path, dtype=jnp.bfloat16)
    assert model.embed_tokens[...].dtype == jnp.bfloat16
    tokens = _tokens((2, 16), seed=7)
    logits = fwd(model, tokens)[0]
    assert logits.dtype == np.float32 and np.isfinite(logits).all()
    ref = fwd(model32, tokens)[0]
    assert np.abs(logits - ref).max() < 0.05 * np.abs(ref).max() + 0.05
    cache = model.init_cache(2, MAX_LEN)
    assert cache.k.dtype == jnp.bfloat16
    lg, _, cache = call(model, "prefill", cache, tokens[:, :12], np.array([12, 10]))
    lg2, _, _ = call(model, "decode", cache, np.array([1, 2]), np.array([12, 10]))
    assert lg.dtype == lg2.dtype == jnp.float32 and np.isfinite(np.asarray(lg2)).all()
    save_target(model, tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    again = load_target(tmp_path / "bf16", dtype=jnp.bfloat16)
    np.testing.assert_array_equal(fwd(again, tokens)[0], logits)


@pytest.mark.parametrize("at_once", [False, True])
def test_cache_slot_updates_match_a_numpy_twin(at_once):
    """`set_slots` / `move_slots` against a numpy twin, out-of-range slots included: one
    layer at a time (TPU, CPU) and every layer at once (GPU's form)."""
    from tev_jax.models import kv_cache

    rng = np.random.default_rng(0)
    layers, b, length, t = 3, 2, 10, 4
    x = rng.normal(size=(layers, b, length, 2)).astype(np.float32)
    new = rng.normal(size=(layers, b, t, 2)).astype(np.float32)
    slots = np.array([[0, 3, 9, 12], [5, 6, 7, 10]])          # 12 and 10 are dropped
    src = np.array([[4, 1, 11, 0], [9, 8, 2, 2]])             # 11 reads zeros
    dst = np.array([[2, 3, 4, 5], [0, 1, 2, 30]])
    want_set, want_move = x.copy(), x.copy()
    for r in range(b):
        for j in range(t):
            if slots[r, j] < length:
                want_set[:, r, slots[r, j]] = new[:, r, j]
            if dst[r, j] < length:
                want_move[:, r, dst[r, j]] = x[:, r, src[r, j]] if src[r, j] < length else 0
    got_set = jax.jit(lambda *a: kv_cache.set_slots(*a, at_once=at_once))(x, slots, new)
    got_move = jax.jit(lambda *a: kv_cache.move_slots(*a, at_once=at_once))(x, src, dst)
    np.testing.assert_array_equal(got_set, want_set)
    np.testing.assert_array_equal(got_move, want_move)


def _decode_text(num_layers: int) -> str:
    """The StableHLO of a tiny target's jitted decode step at ``num_layers``."""
    cfg = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=8)
    model = init_target(cfg, key=0)
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda state, cache, tok, start: nnx.merge(graphdef, state).decode(
        cache, tok, start, taps=(0, num_layers - 1)))
    return step.lower(state, model.init_cache(2, 16), jnp.zeros(2, jnp.int32),
                      jnp.zeros(2, jnp.int32)).as_text()


def test_program_size_does_not_grow_with_depth():
    """The layers are one scan: 2 and 6 layers give programs of the same size (one layer
    body); unrolled (`scan_unroll(True)`, the negative control) the deeper one is larger."""
    from tev_jax.models.layers import scan_unroll

    lines = lambda text: len(text.splitlines())
    assert lines(_decode_text(6)) == lines(_decode_text(2))
    with scan_unroll(True):
        assert lines(_decode_text(6)) > lines(_decode_text(2))


def test_unrolled_layers_give_the_same_outputs(hf_ckpt):
    """`scan_unroll`: any unroll gives the scan's logits, taps and cache; bad values are
    refused."""
    from tev_jax.models.layers import scan_unroll

    _, _, model = hf_ckpt
    tokens = _tokens((2, 12), seed=4)
    graphdef, state = nnx.split(model)

    def run(state, tokens):
        m = nnx.merge(graphdef, state)
        logits, feats, cache = m.prefill(m.init_cache(2, MAX_LEN), tokens,
                                         jnp.array([12, 9]), taps=TAPS)
        return logits, feats, cache.k

    want = jax.jit(run)(state, tokens)
    for unroll in (2, True):
        with scan_unroll(unroll):
            got = jax.jit(run)(state, tokens)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5)
    for bad in (0, -1, 1.5, False):
        with pytest.raises(ValueError, match="scan unroll"):
            with scan_unroll(bad):
                pass
