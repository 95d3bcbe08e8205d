"""ExitTrain objectives against slow references: node weights vs the float64 exit law of
`reference.py`, the gathered exit loss vs a materialised [nodes x V] log-softmax (values
and gradients), and the sequence and tree scoring passes vs plain target forwards."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tev_jax.exit_train import ExitTrainConfig
from tev_jax.exit_weights import (
    WEIGHTINGS,
    exit_loss,
    node_weights,
    token_loss,
    tree_exit_weights,
)
from tev_jax.models import ModelConfig, init_target
from tev_jax.sampling import Sampling
from tev_jax.testing import reference as ref
from tev_jax.testing import strategies as tst
from tev_jax.tree import make_tree
from tev_jax.tree_scoring import (
    parent_mask,
    score_parent_nodes,
    score_tree_nodes,
    score_window_hidden,
    target_context,
)


def random_tree(rng, n_slots, vocab, horizon, root=None):
    """A random valid tree (siblings distinct, depth <= horizon), padded to n_slots."""
    n = int(rng.integers(1, n_slots + 1))
    root = int(rng.integers(vocab)) if root is None else int(root)
    tokens, parents = tst.grow_tree(n, root, vocab, horizon, lambda o: int(rng.choice(o)))
    return make_tree(tokens, parents, n_slots)


def stack(trees, shape):
    return jax.tree.map(lambda *xs: jnp.stack(xs).reshape(shape + xs[0].shape), *trees)


# ------------------------------------------------------------------ node weights


@pytest.mark.parametrize("sampling", [Sampling(1.0), Sampling(0.7, top_k=3), Sampling(0.0)])
def test_node_weights_match_reference(sampling):
    rng = np.random.default_rng(7)
    n, v, h = 9, 5, 4
    trees = [random_tree(rng, n, v, h) for _ in range(6)]
    logits = (rng.standard_normal((6, n, v)) * 2).astype(np.float32)
    batched = stack(trees, (2, 3))

    @jax.jit
    def all_weights(t, z):
        w, law = tree_exit_weights(t, z, sampling, "exit")
        return {k: node_weights(t, law, k) for k in WEIGHTINGS}, w, law.coverage

    got, w_exit, cov = all_weights(batched, jnp.asarray(logits).reshape(2, 3, n, v))
    np.testing.assert_array_equal(got["exit"], w_exit)
    cov = np.asarray(cov).reshape(6)
    for i, tree in enumerate(trees):
        tokens, parents, m = ref.host_tree(tree)
        logp = ref.log_probs(logits[i], sampling.temperature, sampling.top_k, sampling.top_p)
        reach, rho, w, coverage = ref.exit_law_loops(tokens, parents, logp)
        if sampling == Sampling(1.0):      # the enumeration reference (slow; one sampling)
            w_enum = ref.brute_force_joint(tokens, parents, logp).sum(-1)
            np.testing.assert_allclose(w_enum, w, atol=1e-9)
            np.testing.assert_allclose(ref.brute_force_reach(tokens, parents, logp), reach,
                                       atol=1e-9)
        depth = np.asarray(ref.depths_of(parents, m), np.float64)
        for weighting, want in (("exit", w), ("exit_depth", w * depth), ("prefix", reach)):
            weights = np.asarray(got[weighting]).reshape(6, n)
            want = want.copy()
            want[0] = 0.0
            np.testing.assert_allclose(weights[i, :m], want, atol=2e-6, err_msg=weighting)
            np.testing.assert_array_equal(weights[i, m:], 0.0)
        np.testing.assert_allclose(cov[i], coverage, atol=2e-6)


# ------------------------------------------------------------------------ losses


def naive_exit_loss(logits_XHV, trees, weights_XN):
    """Materialises each node's draft row and its [nodes, V] log-softmax."""
    h, v = logits_XHV.shape[-2:]
    n = trees.tokens.shape[-1]
    logits = logits_XHV.reshape(-1, h, v)
    r = logits.shape[0]
    rows = jnp.clip(trees.depths.reshape(r, n) - 1, 0, h - 1)
    node_logits_RNV = jnp.take_along_axis(logits, rows[:, :, None], axis=1)
    logq_RNV = jax.nn.log_softmax(node_logits_RNV, axis=-1)
    logq = jnp.take_along_axis(logq_RNV, trees.tokens.reshape(r, n, 1), axis=-1)[..., 0]
    w = weights_XN.reshape(r, n)
    return -jnp.sum(w * logq) / jnp.sum(w)


def test_exit_loss_matches_naive_values_and_gradients():
    rng = np.random.default_rng(0)
    b, a, h, v, n = 2, 3, 4, 11, 9
    trees = stack([random_tree(rng, n, v, h) for _ in range(b * a)], (b, a))
    logits = jnp.asarray(rng.standard_normal((b, a, h, v)) * 3, jnp.float32)
    edge = np.asarray(trees.valid & (trees.depths > 0))
    weights = jnp.asarray(np.where(edge, rng.random((b, a, n)), 0.0), jnp.float32)

    fast = lambda x: exit_loss(x, trees, weights).mean
    slow = lambda x: naive_exit_loss(x, trees, weights)
    np.testing.assert_allclose(jax.jit(fast)(logits), slow(logits), rtol=1e-5)
    g_fast = jax.jit(jax.grad(fast))(logits)
    g_slow = jax.grad(slow)(logits)
    np.testing.assert_allclose(g_fast, g_slow, atol=1e-6)

    # Rows (anchor, depth) that hold no weighted node get exactly zero gradient.
    depths = np.asarray(trees.depths)
    for i in range(b):
        for j in range(a):
            for d in range(1, h + 1):
                if not (np.asarray(weights)[i, j][depths[i, j] == d] > 0).any():
                    assert not np.asarray(g_fast)[i, j, d - 1].any()


def test_exit_loss_with_no_weight_is_zero_without_nan():
    rng = np.random.default_rng(1)
    trees = stack([random_tree(rng, 5, 7, 3) for _ in range(2)], (2,))
    logits = jnp.asarray(rng.standard_normal((2, 3, 7)), jnp.float32)
    zero = jnp.zeros((2, 5), jnp.float32)
    val, grad = jax.jit(jax.value_and_grad(lambda x: exit_loss(x, trees, zero).mean))(logits)
    assert float(val) == 0.0 and not np.asarray(grad).any()


def test_token_loss_matches_cross_entropy():
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.standard_normal((3, 4, 9)) * 2, jnp.float32)
    labels = jnp.asarray(rng.integers(0, 9, (3, 4)), jnp.int32)
    mask = jnp.asarray(rng.random((3, 4)) < 0.7)
    got = token_loss(logits, labels, mask, decay_gamma=2.0)
    logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float64) if jax.config.x64_enabled
                                         else logits))
    wt = np.asarray(mask, np.float64) * np.exp(-np.arange(4) / 2.0)
    nll = -np.take_along_axis(logp, np.asarray(labels)[..., None], -1)[..., 0]
    np.testing.assert_allclose(got.mean, (wt * nll).sum() / wt.sum(), rtol=1e-5)


# ------------------------------------------------------------------ scoring pass


TINY = ModelConfig(model_type="qwen3", vocab_size=48, hidden_size=32, intermediate_size=64,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True)


def test_context_and_scoring_passes_equal_plain_forwards():
    """The sequence pass (taps, the last one after the final norm) equals the target's
    own forward; every scored tree node equals a plain forward over prefix + path."""
    target = init_target(TINY, key=3)
    rng = np.random.default_rng(3)
    b, length, a, n, h = 2, 14, 3, 7, 3
    taps = (0, TINY.num_layers - 1)
    tokens = rng.integers(0, TINY.vocab_size, (b, length)).astype(np.int32)
    anchors = np.array([[1, 6, 10], [3, 4, 9]], np.int32)
    trees = [random_tree(rng, n, TINY.vocab_size, h, root=tokens[i, anchors[i, j]])
             for i in range(b) for j in range(a)]
    batched = stack(trees, (b, a))

    @jax.jit
    def score(tokens, anchors, trees):
        feats, cache = target_context(target, tokens, taps)
        return feats, score_tree_nodes(target, cache, trees, anchors)

    feats, got = map(np.asarray, score(jnp.asarray(tokens), jnp.asarray(anchors), batched))
    seqs, where = [], []
    for i in range(b):
        for j in range(a):
            tok, par, m = ref.host_tree(trees[i * a + j])
            for node in range(m):
                path = [tok[p] for p in ref.ancestors(par, node)[::-1]]
                seqs.append(np.concatenate([tokens[i, :anchors[i, j]], path]))
                where.append((i, j, node))
    # Each reference is a plain causal forward, padded on the right (causal, so the
    # padding does not change the real positions); the last b rows are the sequences.
    padded = np.zeros((len(seqs) + b, length + h + 1), np.int32)
    for k, seq in enumerate(seqs + list(tokens)):
        padded[k, :len(seq)] = seq
    want, want_feats = jax.jit(lambda x: target(x, taps=taps))(jnp.asarray(padded))
    want, want_feats = np.asarray(want), np.asarray(want_feats)
    np.testing.assert_allclose(feats, want_feats[-b:, :length], atol=1e-5)
    for k, (i, j, node) in enumerate(where):
        np.testing.assert_allclose(got[i, j, node], want[k, len(seqs[k]) - 1], atol=1e-4)
    assert len(where) > b * a
    with pytest.raises(ValueError, match="tap layer"):
        target_context(target, jnp.asarray(tokens), (TINY.num_layers,))
    # Without the cache only the layers up to the last tap run: the same features.
    for only in ((0,), taps):
        shallow, none = jax.jit(lambda x, only=only: target_context(
            target, x, only, with_cache=False))(jnp.asarray(tokens))
        assert none is None
        np.testing.assert_allclose(
            np.asarray(shallow), want_feats[-b:, :length, :TINY.hidden_size * len(only)],
            atol=1e-5)


def test_windowed_scoring_equals_plain_forwards_over_window_and_path():
    """`score_window_hidden` (the authors' ``prefix_window``): every tree node equals a
    plain forward over the W tokens before its anchor (fewer near the start) and its path,
    at their absolute positions; with the whole prefix visible it differs (control)."""
    target = init_target(TINY, key=5)
    rng = np.random.default_rng(5)
    b, length, a, n, h, w = 2, 16, 3, 6, 3, 4
    tokens = rng.integers(0, TINY.vocab_size, (b, length)).astype(np.int32)
    anchors = np.array([[2, 7, 12], [0, 5, 9]], np.int32)       # 2 and 0: short windows
    trees = [random_tree(rng, n, TINY.vocab_size, h, root=tokens[i, anchors[i, j]])
             for i in range(b) for j in range(a)]
    batched = stack(trees, (b, a))
    got = np.asarray(jax.jit(lambda t, x, an: target.unembed(score_window_hidden(
        target, t, x, an, w)))(jnp.asarray(tokens), batched, jnp.asarray(anchors)))
    full = np.asarray(jax.jit(lambda t, x, an: score_tree_nodes(
        target, target_context(target, t, (0,))[1], x, an))(
            jnp.asarray(tokens), batched, jnp.asarray(anchors)))
    seqs, where = [], []
    for i in range(b):
        for j in range(a):
            anchor = int(anchors[i, j])
            first = max(0, anchor - w)
            tok, par, m = ref.host_tree(trees[i * a + j])
            depth = np.asarray(trees[i * a + j].depths)
            for node in range(m):
                path = ref.ancestors(par, node)[::-1]
                seqs.append((np.concatenate([tokens[i, first:anchor], [tok[p] for p in path]]),
                             np.concatenate([np.arange(first, anchor), anchor + depth[path]])))
                where.append((i, j, node))
    # One causal forward over the references, padded on the right (causal: the padding
    # does not change the real positions).
    padded = np.zeros((2, len(seqs), w + h + 1), np.int32)
    for k, (seq, pos) in enumerate(seqs):
        padded[0, k, :len(seq)], padded[1, k, :len(seq)] = seq, pos
    want = np.asarray(jax.jit(lambda x, p: target(x, p)[0])(padded[0], padded[1]))
    differs = 0
    for k, (i, j, node) in enumerate(where):
        np.testing.assert_allclose(got[i, j, node], want[k, len(seqs[k][0]) - 1], atol=1e-4)
        differs += not np.allclose(full[i, j, node], got[i, j, node], atol=1e-3)
    assert len(where) > b * a and differs > 0
    with pytest.raises(ValueError, match="prefix_window"):
        ExitTrainConfig(loss="exit", budget=n - 1, exit_lambda=0.1, sampling=Sampling(1.0),
                        prefix_window=-1)
    with pytest.raises(ValueError, match="cannot be combined"):
        ExitTrainConfig(loss="exit", budget=n - 1, exit_lambda=0.1, sampling=Sampling(1.0),
                        prefix_window=4, score_capacities=(0.5,))


def test_parent_scoring_equals_full_scoring_on_the_rows_the_exit_law_reads():
    """`score_parent_nodes` = `score_tree_nodes` on nodes with children of valid anchors
    (0 elsewhere) in every branch: the smaller pooled pass, the larger one, the full
    pass; the exit weights from any of them are the same."""
    target = init_target(TINY, key=3)
    rng = np.random.default_rng(11)
    b, length, a, n, h = 2, 14, 3, 7, 3
    tokens = rng.integers(0, TINY.vocab_size, (b, length)).astype(np.int32)
    anchors = np.array([[2, 6, 10], [3, 4, 9]], np.int32)
    host = [random_tree(rng, n, TINY.vocab_size, h, root=tokens[i, anchors[i, j]])
            for i in range(b) for j in range(a)]
    trees = stack(host, (b, a))

    def needed_of(valid):                         # nodes that are some valid node's parent
        needed = np.zeros((b, a, n), bool)
        for k, tree in enumerate(host):
            _, parents, m = ref.host_tree(tree)
            if valid.flat[k]:
                needed[k // a, k % a, [parents[v] for v in range(1, m)]] = True
        return needed

    masks = [np.array([[True, False, False], [True, False, False]]),
             np.array([[True, False, True], [True, False, True]]), np.ones((b, a), bool)]
    counts = [int(needed_of(m).sum((1, 2)).max()) for m in masks]
    assert 0 < counts[0] < counts[1] < counts[2] < a * n
    capacities = counts[:2]                       # masks[2] falls back to the full pass

    @jax.jit
    def run(valid):
        _, cache = target_context(target, jnp.asarray(tokens), (0,))
        full = score_tree_nodes(target, cache, trees, anchors)
        parent = score_parent_nodes(target, cache, trees, anchors, capacities, valid)
        weights = [tree_exit_weights(trees, z, Sampling(1.0), "exit")[0] * valid[..., None]
                   for z in (full, parent)]
        return parent_mask(trees), full, parent, weights

    for valid in masks:
        mask, full, parent, (want_w, got_w) = jax.device_get(run(valid))
        needed = needed_of(valid)
        np.testing.assert_array_equal(mask & valid[..., None], needed)
        np.testing.assert_allclose(parent, np.where(needed[..., None], full, 0.0), atol=1e-5)
        np.testing.assert_allclose(got_w, want_w, atol=1e-6)
    for bad in (0, [], [3, a * n + 1]):
        with pytest.raises(ValueError, match="capacities"):
            score_parent_nodes(target, None, trees, anchors, bad)
