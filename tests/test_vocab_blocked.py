"""Vocabulary-blocked LM-head reductions (`tev_jax.models.lm_head`) against the dense
[rows, V] computations they replace: logsumexp values and gradients, top-k (ties
included), the token and exit losses on `HeadRows`, and the exit law's edge
log-probabilities from hidden states. Float32; the vocabulary is not a multiple of the
block, so the overlapping last block is exercised."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_exit_train import random_tree, stack

from tev_jax.exit_law import edge_log_probs
from tev_jax.exit_weights import exit_loss, node_weights, token_loss, tree_exit_weights
from tev_jax.models import lm_head
from tev_jax.models.lm_head import Head
from tev_jax.sampling import Sampling
from tev_jax.tree_scoring import edge_log_probs_blocked, exit_laws_from_edges
from tev_jax.vocab import target_scores

V, D, BLOCK = 1000, 16, 96          # 11 blocks, the last one overlapping the tenth


def _head(rng, vocab_major: bool, vocab: int = V) -> Head:
    w = rng.standard_normal((vocab, D) if vocab_major else (D, vocab)).astype(np.float32)
    return Head(jnp.asarray(w), vocab_major)


def _dense(h, head: Head):
    spec = "...d,vd->...v" if head.vocab_major else "...d,dv->...v"
    return jnp.einsum(spec, h, head.w)


@pytest.mark.parametrize("vocab_major", [True, False], ids=["tied", "lm_head"])
@pytest.mark.parametrize("scale", [1.0, 0.6])
def test_logsumexp_values_and_gradients_match_dense(vocab_major, scale):
    rng = np.random.default_rng(0)
    head = _head(rng, vocab_major)
    h = jnp.asarray(rng.standard_normal((3, 5, D)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((3, 5)), jnp.float32)   # a generic cotangent
    dense = lambda h: jnp.sum(g * jax.nn.logsumexp(scale * _dense(h, head), axis=-1))
    blocked = lambda h: jnp.sum(g * lm_head.logsumexp(h, head, scale, BLOCK))
    (v1, g1), (v2, g2) = (jax.jit(jax.value_and_grad(f))(h) for f in (dense, blocked))
    np.testing.assert_allclose(v2, v1, rtol=1e-5)
    np.testing.assert_allclose(g2, g1, atol=1e-5)
    # One block spanning the vocabulary is the plain logsumexp.
    np.testing.assert_allclose(lm_head.logsumexp(h, head, scale, V),
                               jax.nn.logsumexp(scale * _dense(h, head), axis=-1), rtol=1e-6)


def test_top_k_matches_lax_top_k_with_ties():
    rng = np.random.default_rng(1)
    head = _head(rng, True)
    # Duplicate head rows across blocks (ids 5, 500, 990) give equal logits: lax.top_k
    # lists them by id, and so must the merge of per-block winners.
    w = np.array(head.w)
    w[[500, 990]] = w[5]
    w[7] = 0.0                                                     # a logit of exactly 0
    head = Head(jnp.asarray(w * 3), True)
    h = jnp.asarray(rng.standard_normal((4, D)), jnp.float32)
    h = h.at[0].set(head.w[5] / 3)                                 # row 0: ties at its top
    vals, ids, lse = jax.jit(lambda h: lm_head.top_k(h, head, 12, BLOCK))(h)
    want_vals, want_ids = jax.lax.top_k(_dense(h, head), 12)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(vals, want_vals, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, jax.nn.logsumexp(_dense(h, head), axis=-1), rtol=1e-6)
    assert list(np.asarray(ids[0, :3])) == [5, 500, 990]
    with pytest.raises(ValueError, match="top_k needs"):
        lm_head.top_k(h, head, BLOCK + 1, BLOCK)


def _trees(rng, shape, n, vocab, horizon):
    count = int(np.prod(shape))
    return stack([random_tree(rng, n, vocab, horizon) for _ in range(count)], shape)


@pytest.mark.parametrize("vocab_major", [True, False], ids=["tied", "lm_head"])
def test_losses_on_head_rows_match_dense_logits(vocab_major):
    """token_loss and exit_loss on `HeadRows` = on the materialised logits: values and
    gradients with respect to the hidden states."""
    rng = np.random.default_rng(2)
    b, a, h, n = 2, 3, 4, 9
    head = _head(rng, vocab_major)
    hidden = jnp.asarray(rng.standard_normal((b, a, h, D)) * 0.5, jnp.float32)
    labels = jnp.asarray(rng.integers(0, V, (b, a, h)), jnp.int32)
    mask = jnp.asarray(rng.random((b, a, h)) < 0.8)
    trees = _trees(rng, (b, a), n, V, h)
    weights = jnp.where(trees.valid & (trees.depths > 0),
                        jnp.asarray(rng.random((b, a, n)), jnp.float32), 0.0)

    def losses(rows):
        return (token_loss(rows, labels, mask, decay_gamma=2.0).mean
                + 0.3 * exit_loss(rows, trees, weights).mean)

    dense = lambda x: losses(_dense(x, head))
    blocked = lambda x: losses(lm_head.head_rows(x, head, BLOCK))
    (v1, g1), (v2, g2) = (jax.jit(jax.value_and_grad(f))(hidden) for f in (dense, blocked))
    np.testing.assert_allclose(v2, v1, rtol=1e-5)
    np.testing.assert_allclose(g2, g1, atol=1e-5)
    # Each part on its own, so one cannot hide an error in the other.
    for part in (lambda r: token_loss(r, labels, mask).total,
                 lambda r: exit_loss(r, trees, weights).total):
        np.testing.assert_allclose(part(lm_head.head_rows(hidden, head, BLOCK)),
                                   part(_dense(hidden, head)), rtol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_blocked_edge_log_probs_match_the_dense_exit_law(temperature):
    rng = np.random.default_rng(3)
    x, n, h = 6, 12, 4
    head = _head(rng, False)
    hidden = jnp.asarray(rng.standard_normal((2, 3, n, D)) * 0.7, jnp.float32)
    trees = _trees(rng, (2, 3), n, V, h)
    sampling = Sampling(temperature)
    logits = _dense(hidden, head)

    @jax.jit
    def both(trees, hidden, logits):
        dense = jax.vmap(lambda t, z: edge_log_probs(t, target_scores(z, sampling)))(
            jax.tree.map(lambda a: a.reshape((x, n)), trees), logits.reshape(x, n, V))
        blocked = edge_log_probs_blocked(trees, hidden, head, sampling, BLOCK)
        w_dense, law = tree_exit_weights(trees, logits, sampling, "exit")
        w_blocked = node_weights(trees, exit_laws_from_edges(trees, blocked), "exit")
        return dense.reshape(2, 3, n), blocked, w_dense, w_blocked, law.coverage

    dense, blocked, w_dense, w_blocked, _ = both(trees, hidden, logits)
    edge = np.asarray(trees.valid) & (np.arange(n) > 0)
    np.testing.assert_allclose(np.where(edge, blocked, 0), np.where(edge, dense, 0), atol=1e-5)
    np.testing.assert_array_equal(np.isneginf(blocked), np.isneginf(dense))
    np.testing.assert_array_equal(np.asarray(blocked)[..., 0], 0.0)
    np.testing.assert_allclose(w_blocked, w_dense, atol=1e-5)
    with pytest.raises(ValueError, match="plain temperature"):
        edge_log_probs_blocked(trees, hidden, head, Sampling(1.0, top_k=5))
