"""DFlash drafter: config, context cache, batching, training forward, checkpoints.

Parity with the reference PyTorch implementation is in test_drafter_parity.py; here
the drafter is checked against itself under other schedules (rounds vs one append,
batch vs rows, anchors vs single blocks) and against its checkpoint contract.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from drafter_fixtures import as_i32, random_features, tiny_drafter, tiny_target
from tev_jax.models import drafter as dr
from tev_jax.models.checkpoint_io import read_headers
from tev_jax.models.drafter_io import (
    drafter_param_names, init_drafter, load_drafter, read_drafter_config, save_drafter,
)

TOL = 1e-5


@pytest.fixture(scope="module")
def pair():
    target = tiny_target()
    return target, tiny_drafter(target, num_layers=2, block_size=5)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _step(gd, gt, ds, ts, cache, feats, num_new, roots):
    return dr.draft_step(nnx.merge(gd, ds), nnx.merge(gt, ts), cache, feats, num_new, roots)


def _jitted(drafter, target):
    """draft_step jitted over (graphdef, state), as a decode loop would run it."""
    gd, ds = nnx.split(drafter)
    gt, ts = nnx.split(target)
    return lambda *a: _step(gd, gt, ds, ts, *a)


# --------------------------------------------------------------------------- config


def test_config_from_dflash_json_and_back(pair):
    _, drafter = pair
    cfg = drafter.config
    assert dr.DrafterConfig.from_hf(cfg.to_hf()) == cfg
    hash(cfg)
    # The transformers-4.x spelling of a public DFlash config, without tap list.
    hf = {"model_type": "qwen3", "vocab_size": 96, "hidden_size": 32,
          "intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 8, "rope_theta": 1e6, "rope_scaling": None,
          "rms_norm_eps": 1e-6, "block_size": 8, "num_target_layers": 36,
          "dflash_config": {"mask_token_id": 7}, "layer_types": ["full_attention"] * 3}
    c = dr.DrafterConfig.from_hf(hf)
    assert (c.block_size, c.horizon, c.mask_token_id) == (8, 7, 7)
    assert c.target_layer_ids == (1, 17, 33)
    assert c.feature_size == 3 * 32 and c.model.rope_theta == 1e6
    hf["dflash_config"] = {"mask_token_id": 7, "block_size": 4, "target_layer_ids": [2, 5]}
    c = dr.DrafterConfig.from_hf(hf)
    assert (c.block_size, c.target_layer_ids) == (4, (2, 5))


@pytest.mark.parametrize("change,match", [
    ({"dflash_config": {}}, "mask_token_id"),
    ({"num_target_layers": None}, "num_target_layers"),
    ({"dflash_config": {"mask_token_id": 1, "target_layer_ids": [0, 6]}}, "outside"),
    ({"dflash_config": {"mask_token_id": 1, "conv_kernel_size": 4}}, "DFlash-2"),
    ({"dflash_config": {"mask_token_id": 1, "output_multiplier": 0.0}}, "output_multiplier"),
    ({"dflash_config": {"mask_token_id": 1, "input_embedding_scale": float("nan")}},
     "input_embedding_scale"),
    ({"block_size": 1}, "block_size"),
    ({"model_type": "llama"}, "q/k norm"),
])
def test_config_refusals(pair, change, match):
    hf = pair[1].config.to_hf()
    hf.update(change)
    with pytest.raises(ValueError, match=match):
        dr.DrafterConfig.from_hf(hf)


# -------------------------------------------------------------------------- forward


def test_cache_rounds_equal_recompute(pair):
    """Appending padded rounds == one append of the whole context (logits and keys)."""
    target, drafter = pair
    rng = np.random.default_rng(0)
    f = drafter.config.feature_size
    step = _jitted(drafter, target)
    b, t = 2, 10
    feats = random_features(rng, b, t, f)
    new = np.array([[4, 0, 5, 1], [1, 5, 3, 0]])           # per row and round; sums 10, 9
    cache = dr.init_drafter_cache(drafter.config, b, 16)
    done = np.zeros(b, int)
    for r in range(new.shape[1]):
        chunk = rng.standard_normal((b, t, f)).astype(np.float32)  # padding = noise
        for i in range(b):
            chunk[i, :new[i, r]] = feats[i, done[i]:done[i] + new[i, r]]
        logits, cache = step(cache, jnp.asarray(chunk), as_i32(new[:, r]), as_i32([3, 4]))
        done += new[:, r]
    np.testing.assert_array_equal(np.asarray(cache.lengths), done)

    fresh = dr.init_drafter_cache(drafter.config, b, 16)
    logits_once, fresh = step(fresh, jnp.asarray(feats), as_i32(done), as_i32([3, 4]))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(logits_once), atol=TOL, rtol=0)
    for i in range(b):
        n = done[i]
        np.testing.assert_allclose(np.asarray(cache.k[:, i, :n]), np.asarray(fresh.k[:, i, :n]),
                                   atol=TOL, rtol=0)
        np.testing.assert_allclose(np.asarray(cache.v[:, i, :n]), np.asarray(fresh.v[:, i, :n]),
                                   atol=TOL, rtol=0)


def test_batch_equals_one_by_one(pair):
    target, drafter = pair
    rng = np.random.default_rng(1)
    step = _jitted(drafter, target)
    lengths, roots = [10, 3], [10, 20]
    feats = random_features(rng, 2, 10, drafter.config.feature_size)
    logits, cache = step(dr.init_drafter_cache(drafter.config, 2, 16), jnp.asarray(feats),
                         as_i32(lengths), as_i32(roots))
    one = dr.init_drafter_cache(drafter.config, 1, 16)
    for i in range(2):
        row, row_cache = step(one, jnp.asarray(feats[i:i + 1]), as_i32(lengths[i:i + 1]),
                              as_i32(roots[i:i + 1]))
        np.testing.assert_allclose(np.asarray(logits[i]), np.asarray(row[0]), atol=TOL, rtol=0)
        n = lengths[i]
        np.testing.assert_allclose(np.asarray(cache.k[:, i, :n]),
                                   np.asarray(row_cache.k[:, 0, :n]), atol=TOL, rtol=0)
    # The context matters: another context (same root) changes the draft.
    other, _ = step(one, jnp.asarray(feats[1:2]), as_i32(lengths[:1]), as_i32(roots[:1]))
    assert np.abs(np.asarray(logits[0] - other[0])).max() > 1e-2


def test_anchor_forward_equals_single_blocks(pair):
    """Training forward (A anchors, one mask) == a cached single block per anchor."""
    target, drafter = pair
    rng = np.random.default_rng(2)
    step = _jitted(drafter, target)
    b, seq = 2, 10
    feats = random_features(rng, b, seq, drafter.config.feature_size)
    tokens = rng.integers(0, 90, (b, seq))
    anchors = np.array([[0, 4, 9], [7, 7, 2]])
    anchor_fn = jax.jit(lambda f, t, a: dr.anchor_logits(drafter, target, f, t, a))
    logits = anchor_fn(jnp.asarray(feats), as_i32(tokens), as_i32(anchors))
    assert logits.shape == (b, 3, drafter.config.horizon, target.config.vocab_size)
    cache = dr.init_drafter_cache(drafter.config, 1, 16)
    for i in range(b):
        for a, p in enumerate(anchors[i]):
            ctx = feats[i:i + 1].copy()
            ctx[:, p:] = 0.0
            want, _ = step(cache, jnp.asarray(ctx), as_i32([p]), as_i32([tokens[i, p]]))
            np.testing.assert_allclose(np.asarray(logits[i, a]), np.asarray(want[0]),
                                       atol=TOL, rtol=0)


# ---------------------------------------------------------------------- checkpoints


def test_save_load_round_trip(pair, tmp_path):
    target, drafter = pair
    path = tmp_path / "drafter"
    save_drafter(drafter, path)
    save_drafter(drafter, path)  # overwriting an existing checkpoint is atomic
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]
    tensors = load_file(str(path / "model.safetensors"))
    assert {k: v.shape for k, v in tensors.items()} == drafter_param_names(drafter.config)
    assert not any("embed" in k or "lm_head" in k for k in tensors)
    assert tensors["fc.weight"].shape == (32, 2 * 32)
    assert read_drafter_config(path) == drafter.config
    loaded = load_drafter(path, target)
    assert loaded.config == drafter.config
    a = nnx.to_flat_state(nnx.state(drafter, nnx.Param))
    b = dict(nnx.to_flat_state(nnx.state(loaded, nnx.Param)))
    for p, v in a:
        np.testing.assert_array_equal(np.asarray(v.get_value()), np.asarray(b[p].get_value()))


def test_bfloat16_round_trip(pair, tmp_path):
    """A bf16 drafter is written as BF16 and reads back exactly, in bf16 or float32."""
    target, _ = pair
    d16 = init_drafter(target, num_layers=1, block_size=4, mask_token_id=5, key=2,
                       dtype=jnp.bfloat16)
    save_drafter(d16, tmp_path / "d16")
    assert {i.dtype for i in read_headers(tmp_path / "d16").values()} == {"BF16"}
    assert json.loads((tmp_path / "d16" / "config.json").read_text())["torch_dtype"] == \
        "bfloat16"
    back16 = load_drafter(tmp_path / "d16", target, dtype=jnp.bfloat16)
    back32 = load_drafter(tmp_path / "d16", target)  # the float32 target's dtype
    want = nnx.to_flat_state(nnx.state(d16, nnx.Param))
    got16 = dict(nnx.to_flat_state(nnx.state(back16, nnx.Param)))
    got32 = dict(nnx.to_flat_state(nnx.state(back32, nnx.Param)))
    for p, v in want:
        w = np.asarray(v.get_value().astype(jnp.float32))
        assert got16[p].get_value().dtype == jnp.bfloat16
        assert got32[p].get_value().dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(got16[p].get_value().astype(jnp.float32)), w)
        np.testing.assert_array_equal(np.asarray(got32[p].get_value()), w)


def test_init_drafter_scaling_and_taps(pair):
    target, _ = pair
    d = init_drafter(target, num_layers=1, block_size=4, mask_token_id=5, key=3)
    assert d.config.target_layer_ids == (3,)            # one layer: the middle target layer
    assert d.config.num_target_layers == target.config.num_layers
    assert d.config.model.hidden_size == target.config.hidden_size
    q = np.asarray(d.layers.self_attn.q_proj.kernel[0])
    assert 0.015 < q.std() < 0.025 and abs(q.mean()) < 0.005
    np.testing.assert_array_equal(np.asarray(d.hidden_norm.weight[...]), 1.0)
    d2 = init_drafter(target, num_layers=1, block_size=4, mask_token_id=5, key=4)
    assert not np.allclose(np.asarray(d2.fc.kernel[...]), np.asarray(d.fc.kernel[...]))


def _edit_config(path, **changes):
    hf = json.loads((path / "config.json").read_text())
    hf.update(changes)
    (path / "config.json").write_text(json.dumps(hf))


def _edit_tensors(path, fn):
    tensors = load_file(str(path / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("case,match", [
    ("hidden", "hidden_size"),
    ("vocab", "vocab_size"),
    ("depth", "6-layer target"),
    ("taps", "target layer id"),
    ("missing", "missing tensor.*layers.1.mlp.up_proj.weight"),
    ("extra", "unexpected tensor.*embed_tokens"),
    ("shape", "tensor fc.weight: shape"),
])
def test_refuses_mismatched_checkpoint(pair, tmp_path, case, match):
    target, drafter = pair
    path = tmp_path / "d"
    save_drafter(drafter, path)
    if case == "hidden":
        target = tiny_target(hidden=48)
    elif case == "vocab":
        target = tiny_target(vocab=128)
    elif case == "depth":
        target = tiny_target(layers=4)
    elif case == "taps":
        _edit_config(path, dflash_config={"mask_token_id": 3, "target_layer_ids": [1, 7]})
    elif case == "missing":
        _edit_tensors(path, lambda t: t.pop("layers.1.mlp.up_proj.weight"))
    elif case == "extra":
        _edit_tensors(path, lambda t: t.update(
            {"embed_tokens.weight": np.zeros((96, 32), np.float32)}))
    elif case == "shape":
        _edit_tensors(path, lambda t: t.update({"fc.weight": np.zeros((32, 96), np.float32)}))
    with pytest.raises(ValueError, match=match):
        load_drafter(path, target)


def test_load_onto_mesh(pair, tmp_path):
    """Loading onto a mesh places each parameter by its logical axes, values unchanged."""
    from jax.sharding import PartitionSpec

    from tev_jax import sharding as shd

    if not shd.device_count_ok(8):
        pytest.skip("needs 8 devices (tests/conftest.py forces 8 CPU devices)")
    target, drafter = pair
    save_drafter(drafter, tmp_path / "d")
    mesh = shd.make_mesh(data=1, fsdp=2, tensor=4)
    loaded = load_drafter(tmp_path / "d", target, mesh=mesh)
    fc = loaded.fc.kernel[...]                      # [2D, D] = ('mlp', 'embed')
    assert fc.sharding.spec == PartitionSpec("tensor", "fsdp")
    up = loaded.layers.mlp.up_proj.kernel[...]   # [layers, D, 48] = ('layers', 'embed', 'mlp')
    assert up.sharding.spec == PartitionSpec(None, "fsdp", "tensor")
    np.testing.assert_array_equal(np.asarray(fc), np.asarray(drafter.fc.kernel[...]))
    cache = jax.device_put(dr.init_drafter_cache(drafter.config, 4, 16),
                           dr.drafter_cache_shardings(drafter.config, 4, 16, mesh))
    # batch over fsdp (data has size 1); 2 kv heads do not divide tensor=4: replicated
    assert cache.k.sharding.spec == PartitionSpec(None, "fsdp")
    assert cache.lengths.sharding.spec == PartitionSpec("fsdp")
    np.testing.assert_array_equal(np.asarray(up),
                                  np.asarray(drafter.layers.mlp.up_proj.kernel[...]))
