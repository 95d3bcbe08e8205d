"""DFlash drafter parity with the reference implementation (PyPI ``dflash`` 0.1.0).

The reference is the published ``dflash.model.DFlashDraftModel`` (PyTorch, CPU),
installed with ``pip install --no-deps dflash==0.1.0`` next to torch and transformers.
It loads our checkpoints with ``from_pretrained``, so these tests pin both the forward
and the checkpoint layout. Inputs follow its ``dflash_generate``: context features of
the new positions, the block ``[root, MASK x H]`` embedded with the target's embedding,
``position_ids`` spanning context and block, and a DynamicCache cropped to the context
after every round.
"""

from __future__ import annotations

import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from dflash.model import DFlashDraftModel, _crop_to, build_target_layer_ids
from flax import nnx
from safetensors.numpy import load_file
from transformers import DynamicCache

from drafter_fixtures import as_i32, random_features, tiny_drafter, tiny_target
from tev_jax.models import drafter as dr
from tev_jax.models.drafter_io import load_drafter, read_drafter_config, save_drafter

TOL = 1e-4
T, L = 12, 16  # static feature rows per call and cache slots, shared to compile once


@functools.partial(jax.jit, static_argnums=(0, 1))
def _step(gd, gt, ds, ts, cache, feats, num_new, roots):
    """draft_step, plus the hidden states behind the logits."""
    drafter, target = nnx.merge(gd, ds), nnx.merge(gt, ts)
    logits, cache = dr.draft_step(drafter, target, cache, feats, num_new, roots)
    return logits, dr.draft_hidden(drafter, target, cache, roots), cache


def _stepper(drafter, target):
    gd, ds = nnx.split(drafter)
    gt, ts = nnx.split(target)
    return lambda *a: _step(gd, gt, ds, ts, *a)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target, our drafter, reference torch drafter loaded from our checkpoint)."""
    target = tiny_target()
    drafter = tiny_drafter(target, num_layers=2, block_size=5)
    path = tmp_path_factory.mktemp("dflash") / "drafter"
    save_drafter(drafter, path)
    ref = DFlashDraftModel.from_pretrained(str(path), dtype=torch.float32).eval()
    return target, drafter, ref, path


def _ref_block(ref, target, feats_TF, root, positions_start, cache=None):
    """Reference hidden [H, D] and logits [H, V] of one block for one row."""
    emb = np.asarray(target.embed_tokens[...])
    head = np.asarray(target.lm_head[...])
    block = [root] + [ref.mask_token_id] * (ref.block_size - 1)
    t = feats_TF.shape[0]
    start = positions_start + t
    with torch.no_grad():
        h = ref(target_hidden=torch.tensor(feats_TF[None]),
                noise_embedding=torch.tensor(emb[np.array(block)][None]),
                position_ids=torch.arange(positions_start, start + ref.block_size)[None],
                past_key_values=cache, use_cache=cache is not None)
    if cache is not None:
        _crop_to(cache, start)
    hidden = h[0, 1:].numpy()
    return hidden, hidden @ head


@pytest.mark.parametrize("n_target,n_draft", [(36, 5), (28, 1), (6, 2), (8, 3), (12, 4),
                                              (10, 5), (5, 2)])
def test_default_tap_spacing_matches_reference(n_target, n_draft):
    assert dr.default_target_layer_ids(n_target, n_draft) == tuple(
        build_target_layer_ids(n_target, n_draft))


def test_reference_reads_our_config(pair):
    _, drafter, ref, path = pair
    cfg = drafter.config
    assert list(ref.target_layer_ids) == list(cfg.target_layer_ids)
    assert ref.block_size == cfg.block_size
    assert ref.mask_token_id == cfg.mask_token_id
    assert read_drafter_config(path) == cfg


def test_block_parity_batched(pair):
    """Rows with different context lengths in one batch, each against the reference."""
    target, drafter, ref, _ = pair
    rng = np.random.default_rng(0)
    lengths = [7, 1, 12]
    roots = [5, 17, 40]
    feats = random_features(rng, 3, T, drafter.config.feature_size)
    cache = dr.init_drafter_cache(drafter.config, 3, L)
    logits, hidden, cache = _stepper(drafter, target)(
        cache, jnp.asarray(feats), as_i32(lengths), as_i32(roots))
    for b, (n, r) in enumerate(zip(lengths, roots)):
        ref_h, ref_logits = _ref_block(ref, target, feats[b, :n], r, 0)
        np.testing.assert_allclose(np.asarray(hidden[b]), ref_h, atol=TOL, rtol=0)
        np.testing.assert_allclose(np.asarray(logits[b]), ref_logits, atol=TOL, rtol=0)
    assert np.abs(ref_logits).max() > 0.5  # logits are O(1), so atol is meaningful


def test_cache_rounds_parity(pair):
    """Several decode rounds: our appended cache vs the reference's cropped DynamicCache."""
    target, drafter, ref, _ = pair
    rng = np.random.default_rng(1)
    rounds = [(6, 3), (2, 11), (5, 60), (1, 2)]  # (new context positions, root token)
    cache = dr.init_drafter_cache(drafter.config, 1, L)
    step = _stepper(drafter, target)
    ref_cache = DynamicCache()
    start = 0
    for n, root in rounds:
        feats = random_features(rng, 1, T, drafter.config.feature_size)
        logits, _, cache = step(cache, jnp.asarray(feats), as_i32([n]), as_i32([root]))
        _, ref_logits = _ref_block(ref, target, feats[0, :n], root, start, ref_cache)
        start += n
        np.testing.assert_allclose(np.asarray(logits[0]), ref_logits, atol=TOL, rtol=0)
    assert int(cache.lengths[0]) == start


def test_anchor_forward_parity(pair):
    """Training forward (many anchors, one mask) vs one reference block per anchor."""
    target, drafter, ref, _ = pair
    rng = np.random.default_rng(2)
    seq = 14
    feats = random_features(rng, 1, seq, drafter.config.feature_size)
    tokens = rng.integers(0, target.config.vocab_size - 1, (1, seq))
    anchors = [3, 9, 1, 13]
    anchor_fn = jax.jit(lambda f, t, a: dr.anchor_logits(drafter, target, f, t, a))
    logits = anchor_fn(jnp.asarray(feats), as_i32(tokens), as_i32([anchors]))
    for a, p in enumerate(anchors):
        _, ref_logits = _ref_block(ref, target, feats[0, :p], int(tokens[0, p]), 0)
        np.testing.assert_allclose(np.asarray(logits[0, a]), ref_logits, atol=TOL, rtol=0)


def test_loads_reference_bf16_checkpoint(pair, tmp_path):
    """A checkpoint written by the reference itself, in bfloat16 like the published ones."""
    target, drafter, ref, _ = pair
    path = tmp_path / "ref_bf16"
    ref_bf16 = copy.deepcopy(ref).to(torch.bfloat16)
    ref_bf16.save_pretrained(str(path))
    loaded = load_drafter(path, target)
    assert loaded.config == drafter.config
    save_drafter(loaded, tmp_path / "ours")
    ours = load_file(str(tmp_path / "ours" / "model.safetensors"))
    want = {k: v.float().numpy() for k, v in ref_bf16.state_dict().items()}
    assert sorted(ours) == sorted(want)
    for k, v in want.items():
        np.testing.assert_array_equal(ours[k], v, err_msg=k)
