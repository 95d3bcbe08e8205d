"""Verifiers against their loop twins in ``reference.py``, draw by draw.

The library's private cores take the same uniforms as the loop references, so the
jitted verifiers are compared decision by decision, not only in distribution
(``test_verify_stats.py`` does that). Uniforms are drawn on the library's 2^-24 grid.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tev_jax import verify
from tev_jax.sampling import Sampling
from tev_jax.testing import reference as ref
from tev_jax.testing import strategies as tst
from tev_jax.tree import make_tree
from tev_jax.vocab import Scores, argmax, inverse_cdf, target_scores, uniform

N, V, H = 8, 5, 3
SAMPLINGS = [Sampling(0.7), Sampling(1.3, top_k=3, top_p=0.8), Sampling(1.0, top_k=2)]
CORES = {
    "tev": (verify._tev, lambda n: 2, ref.tev),
    "predraw": (verify._predraw, lambda n: n, ref.predraw),
    "sequential_residual": (verify._sequential_residual, lambda n: n + 1, ref.sequential_residual),
}


@functools.lru_cache(maxsize=None)
def _core(name, sampling, horizon=H):
    fn = CORES[name][0]
    return jax.jit(lambda u, t, x: fn(u, t, x, sampling, horizon=horizon))


def _grid_uniforms(rng, size):
    return (rng.integers(0, 2**24, size) * 2.0**-24).astype(np.float32)


def _check_verdict(verdict, tree, path, bonus):
    """The verdict encodes the reference's (path, bonus) in the documented layout."""
    length = len(path)
    got_path = np.asarray(verdict.path)
    np.testing.assert_array_equal(got_path[:length], path)
    np.testing.assert_array_equal(got_path[length:], -1)
    assert int(verdict.length) == length
    assert int(verdict.exit_node) == path[-1]
    assert int(verdict.length) == int(np.asarray(tree.depths)[path[-1]]) + 1
    assert int(verdict.bonus) == bonus


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    name=st.sampled_from(sorted(CORES)),
    sampling=st.sampled_from(SAMPLINGS),
)
def test_cores_match_loop_references(data, name, sampling):
    tree = data.draw(tst.trees(max_nodes=N, vocab=V, max_depth=H))
    logits = data.draw(tst.logits(N, V))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    tokens, parents, n = ref.host_tree(tree)
    logp = ref.log_probs(logits[:n], sampling.temperature, sampling.top_k, sampling.top_p)
    _, size, ref_fn = CORES[name]
    for _ in range(8):
        u = _grid_uniforms(rng, size(N))
        ref_u = u if name == "tev" else np.concatenate([u[:n], u[N:]])
        verdict = _core(name, sampling)(u, tree, logits)
        path, bonus = ref_fn(ref_u, tokens, parents, logp)
        _check_verdict(verdict, tree, path, bonus)


def _argmax_friendly_logits(rng, tokens, parents, n):
    """Logits whose argmax follows some tree edges, so greedy walks go deep."""
    x = rng.standard_normal((N, V)).astype(np.float32)
    kids = ref.children(parents, n)
    for i in range(n):
        if kids[i] and rng.random() < 0.75:
            x[i, tokens[int(rng.choice(kids[i]))]] = x[i].max() + 1.0
    return x


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_all_verifiers_at_t0_follow_the_argmax(data):
    tree = data.draw(tst.trees(max_nodes=N, vocab=V, max_depth=H))
    tokens, parents, n = ref.host_tree(tree)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    logits = _argmax_friendly_logits(rng, tokens, parents, n)
    path, bonus = ref.greedy(tokens, parents, logits[:n])
    _check_verdict(_greedy_fn()(tree, logits), tree, path, bonus)
    key = jax.random.key(int(rng.integers(2**31)))
    for fn in _t0_fns():
        _check_verdict(fn(key, tree, logits), tree, path, bonus)


@functools.lru_cache(maxsize=None)
def _greedy_fn():
    return jax.jit(functools.partial(verify.greedy, horizon=H))


@functools.lru_cache(maxsize=None)
def _t0_fns():
    t0 = Sampling(0.0)
    return tuple(
        jax.jit(functools.partial(f, sampling=t0, horizon=H))
        for f in (
            verify.tev,
            verify.predraw,
            functools.partial(verify.predraw, method="gumbel"),
            verify.sequential_residual,
        )
    )


@pytest.mark.parametrize("vocab,block", [(7, 512), (1000, 64), (4097, 512)])
def test_inverse_cdf_matches_float64_search(vocab, block):
    rng = np.random.default_rng(vocab)
    rows = 64
    z = rng.standard_normal((rows, vocab)).astype(np.float32) * 3
    z[rng.random((rows, vocab)) < 0.3] = -np.inf
    z[:, 0] = -np.inf  # u = 0 must skip leading zero-mass tokens
    z[0, :] = -np.inf
    z[0, vocab // 2] = 0.0  # a one-token row
    z = z - np.max(z, axis=-1, keepdims=True)
    u = _grid_uniforms(rng, rows)
    u[:4] = [0.0, 0.0, 1 - 2.0**-24, 0.5]
    draw = jax.jit(lambda u, z: inverse_cdf(u, Scores(z, 1.0), block))
    got = np.asarray(draw(u, z))
    want = [ref.inverse_cdf(u[r], np.exp(z[r].astype(np.float64))) for r in range(rows)]
    np.testing.assert_array_equal(got, want)
    assert np.all(np.isfinite(z[np.arange(rows), got]))


def test_uniform_grid():
    u = np.asarray(uniform(jax.random.key(0), (100_000,)))
    assert u.dtype == np.float32 and u.min() >= 0 and u.max() < 1
    np.testing.assert_array_equal(u * 2**24, np.round(u * 2**24))
    assert abs(u.mean() - 0.5) < 0.005


@functools.partial(jax.jit, static_argnums=2)
def _residual_draws(tree, logits, sampling, u):
    scores = target_scores(logits, sampling)
    return jax.vmap(lambda u: verify._residual_draw(u, tree, scores, jnp.int32(0)))(u)


def test_residual_fallback_when_children_hold_the_whole_support():
    """top_k = 2 and both top tokens are children: the residual is empty; the bonus
    falls back to p_node (so it is one of the two support tokens, never garbage)."""
    logits = np.zeros((N, V), np.float32)
    logits[:, 1], logits[:, 3] = 2.0, 1.0
    tree = make_tree([0, 1, 3], [-1, 0, 0], N)
    draws = _residual_draws(tree, logits, Sampling(1.0, top_k=2), np.linspace(0, 1 - 2.0**-24, 101))
    assert set(np.asarray(draws).tolist()) == {1, 3}


def test_residual_with_tiny_mass_is_exact():
    """Children hold all but e^-80 of the mass: the residual is still sampled exactly
    (log space), here a point mass on the one remaining token."""
    logits = np.full((N, V), -np.inf, np.float32)
    logits[0, :4] = 80.0
    logits[0, 4] = 0.0
    tree = make_tree([0, 0, 1, 2, 3], [-1, 0, 0, 0, 0], N)
    draws = _residual_draws(tree, logits, Sampling(1.0), np.linspace(0, 1 - 2.0**-24, 11))
    np.testing.assert_array_equal(np.asarray(draws), 4)


def test_vmap_over_keys_trees_and_logits():
    rng = np.random.default_rng(3)
    trees = [
        make_tree([0], [-1], N),
        make_tree([1, 2, 3, 4], [-1, 0, 1, 2], N),
        make_tree([0, 1, 2, 3, 4, 0], [-1, 0, 0, 0, 1, 4], N),
    ]
    batch = jax.tree.map(lambda *x: jnp.stack(x), *trees)
    logits = rng.standard_normal((3, N, V)).astype(np.float32)
    keys = jax.random.split(jax.random.key(7), 3)
    s = Sampling(0.9)
    # (test_verify_stats vmaps every verifier over trees and keys; one is enough here.)
    for name, f in (("tev", verify.tev),):
        got = jax.jit(jax.vmap(functools.partial(f, sampling=s, horizon=H)))(keys, batch, logits)
        _, size, ref_fn = CORES[name]
        for b in range(3):
            tokens, parents, n = ref.host_tree(trees[b])
            u = np.asarray(uniform(keys[b], (size(N),)))
            ref_u = u if name == "tev" else np.concatenate([u[:n], u[N:]])
            path, bonus = ref_fn(ref_u, tokens, parents, ref.log_probs(logits[b, :n], 0.9))
            _check_verdict(jax.tree.map(lambda x: x[b], got), trees[b], path, bonus)
    got = jax.vmap(functools.partial(verify.greedy, horizon=H))(batch, logits)
    chex.assert_shape(got.path, (3, H + 1))


def test_bad_predraw_method():
    tree = make_tree([0], [-1], N)
    with pytest.raises(ValueError, match="method"):
        verify.predraw(jax.random.key(0), tree, np.zeros((N, V)), Sampling(), horizon=H,
                       method="cumsum")


@pytest.mark.parametrize("vocab", [5, 300, 1000])
def test_two_stage_argmax_matches_argmax(vocab):
    rng = np.random.default_rng(vocab)
    x = rng.integers(-3, 3, (64, vocab)).astype(np.float32)  # many ties
    x[0] = -np.inf
    x[1, -1] = 10.0  # the maximum in the tail block
    got = np.asarray(jax.jit(functools.partial(argmax, block=128))(x))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))


def test_greedy_scores_equal_the_one_hot_they_replace():
    """At T = 0 `target_scores` holds each row's argmax instead of writing the one-hot
    log-probabilities (`sampling.log_probs`): block masses, gathered blocks, edge
    log-probabilities and draws equal the materialised one-hot's, ties (lowest index)
    and a vocabulary that is not a multiple of the block included (the verdicts at T = 0:
    `test_all_verifiers_at_t0_follow_the_argmax`)."""
    from tev_jax.exit_law import edge_log_probs
    from tev_jax.sampling import log_probs
    from tev_jax.vocab import block_masses, gather_blocks

    greedy = Sampling(0.0)
    rng = np.random.default_rng(0)
    vocab, block = 300, 128
    logits = np.round(rng.standard_normal((N, vocab)), 1).astype(np.float32)  # with ties
    logits[2, [7, 200]] = logits[2].max() + 1.0                              # a tie at the top
    lazy = target_scores(jnp.asarray(logits), greedy)
    dense = Scores(log_probs(jnp.asarray(logits), greedy), 1.0)
    assert lazy.top is not None and dense.top is None and int(lazy.top[2]) == 7
    rows, blocks = jnp.arange(N), jnp.asarray(rng.integers(0, 3, N))
    np.testing.assert_array_equal(block_masses(lazy, block), block_masses(dense, block))
    np.testing.assert_array_equal(gather_blocks(lazy, rows, blocks, block),
                                  gather_blocks(dense, rows, blocks, block))
    u = uniform(jax.random.key(1), (N,))
    np.testing.assert_array_equal(inverse_cdf(u, lazy), inverse_cdf(u, dense))
    top = np.argmax(logits, axis=-1)
    for _ in range(20):
        parents = [-1] + [int(rng.integers(0, i)) for i in range(1, N)]
        tokens = rng.permutation(vocab)[:N]          # siblings' tokens differ
        for i in range(1, N):                        # half the edges take the argmax
            siblings = [tokens[j] for j in range(1, N) if parents[j] == parents[i] and j != i]
            if rng.random() < 0.5 and top[parents[i]] not in siblings:
                tokens[i] = top[parents[i]]
        tree = make_tree(tokens, parents, N)
        np.testing.assert_array_equal(edge_log_probs(tree, lazy), edge_log_probs(tree, dense))
