"""The exit law against brute-force enumeration of target continuations (float64)."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tev_jax.exit_law import exit_law
from tev_jax.sampling import Sampling
from tev_jax.testing import reference as ref
from tev_jax.testing import strategies as tst
from tev_jax.tree import make_tree

N, V = 8, 5
SAMPLINGS = [
    Sampling(1.0),
    Sampling(0.5),
    Sampling(0.0),
    Sampling(1.0, top_k=2),
    Sampling(0.7, top_p=0.8),
    Sampling(1.3, top_k=3, top_p=0.9),
]


@functools.lru_cache(maxsize=None)
def _law_fn(sampling):
    return jax.jit(functools.partial(exit_law, sampling=sampling))


def _ref_logp(logits, s):
    return ref.log_probs(logits, s.temperature, s.top_k, s.top_p)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), sampling=st.sampled_from(SAMPLINGS))
def test_law_matches_brute_force(data, sampling):
    tree = data.draw(tst.trees(max_nodes=N, vocab=V, max_depth=3))
    logits = data.draw(tst.logits(N, V))
    law = _law_fn(sampling)(tree, logits)
    tokens, parents, n = ref.host_tree(tree)
    logp = _ref_logp(logits[:n], sampling)
    joint = ref.brute_force_joint(tokens, parents, logp)
    w_ref = joint.sum(-1)
    reach_ref = ref.brute_force_reach(tokens, parents, logp)
    np.testing.assert_allclose(np.asarray(law.w)[:n], w_ref, atol=2e-6)
    np.testing.assert_allclose(np.asarray(law.reach)[:n], reach_ref, atol=2e-6)
    _, rho_ref, _, cov_ref = ref.exit_law_loops(tokens, parents, logp)
    np.testing.assert_allclose(np.asarray(law.rho)[:n], rho_ref, atol=2e-6)
    np.testing.assert_allclose(float(law.coverage), cov_ref, atol=1e-5)
    # E[output block length] = E[depth(exit) + 1] under the enumerated law = 1 + C.
    depth = np.asarray(tree.depths)[:n]
    np.testing.assert_allclose(float(law.expected_length), (w_ref * (depth + 1)).sum(), atol=1e-5)
    # Invariants of the law itself.
    w = np.asarray(law.w)
    assert np.all(np.isfinite(w)) and np.all(w >= 0)
    np.testing.assert_allclose(w.sum(), 1.0, atol=1e-5)
    np.testing.assert_array_equal(w[n:], 0.0)
    rho = np.asarray(law.rho)
    assert np.all((rho >= 0) & (rho <= 1))
    np.testing.assert_allclose(float(law.expected_length), 1 + float(law.coverage), atol=1e-6)
    assert np.all(np.asarray(law.log_reach)[n:] == -np.inf)
    assert not np.any(np.isnan(np.asarray(law.log_a)))


@settings(max_examples=30, deadline=None)
@given(data=st.data(), sampling=st.sampled_from(SAMPLINGS[:2] + SAMPLINGS[3:5]))
def test_sibling_order_invariance(data, sampling):
    """Re-listing the nodes in another topological order permutes the law with them."""
    tokens, parents = data.draw(tst.tree_lists(max_nodes=N, vocab=V, max_depth=3))
    n = len(tokens)
    logits = data.draw(tst.logits(N, V))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    # A random topological order: repeatedly pick any node whose parent is placed.
    order, placed = [0], {0}
    while len(order) < n:
        ready = [i for i in range(n) if i not in placed and parents[i] in placed]
        pick = int(rng.choice(ready))
        order.append(pick)
        placed.add(pick)
    new_of_old = {old: new for new, old in enumerate(order)}
    tokens2 = [tokens[o] for o in order]
    parents2 = [-1] + [new_of_old[parents[o]] for o in order[1:]]
    logits2 = logits.copy()
    logits2[:n] = logits[order]
    law1 = _law_fn(sampling)(make_tree(tokens, parents, N), logits)
    law2 = _law_fn(sampling)(make_tree(tokens2, parents2, N), logits2)
    for f in ("reach", "rho", "w"):
        np.testing.assert_allclose(
            np.asarray(getattr(law2, f))[:n], np.asarray(getattr(law1, f))[order], atol=1e-6
        )
    np.testing.assert_allclose(float(law2.coverage), float(law1.coverage), atol=1e-6)


class JitTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_jit_equals_no_jit(self):
        """Both variants match the float64 loop reference (hence each other)."""
        rng = np.random.default_rng(0)
        tokens, parents = [3, 1, 2, 4, 0, 1], [-1, 0, 0, 1, 1, 3]
        tree = make_tree(tokens, parents, N)
        logits = rng.standard_normal((N, V)).astype(np.float32) * 2
        for s in (SAMPLINGS[0], SAMPLINGS[5]):
            law = self.variant(functools.partial(exit_law, sampling=s))(tree, logits)
            reach, rho, w, cov = ref.exit_law_loops(tokens, parents, _ref_logp(logits[:6], s))
            np.testing.assert_allclose(np.asarray(law.reach)[:6], reach, atol=1e-6)
            np.testing.assert_allclose(np.asarray(law.rho)[:6], rho, atol=1e-6)
            np.testing.assert_allclose(np.asarray(law.w)[:6], w, atol=1e-6)
            np.testing.assert_allclose(float(law.coverage), cov, atol=1e-6)


def test_vmap_over_trees_equals_one_by_one():
    rng = np.random.default_rng(1)
    trees = [
        make_tree([0], [-1], N),
        make_tree([1, 2, 3, 4], [-1, 0, 1, 2], N),
        make_tree([0, 1, 2, 3, 4, 0], [-1, 0, 0, 0, 1, 4], N),
    ]
    logits = rng.standard_normal((3, N, V)).astype(np.float32)
    batch = jax.tree.map(lambda *x: jnp.stack(x), *trees)
    s = Sampling(0.8)
    laws = jax.jit(jax.vmap(lambda t, x: exit_law(t, x, s)))(batch, logits)
    for b, tree in enumerate(trees):
        one = exit_law(tree, logits[b], s)
        chex.assert_trees_all_close(jax.tree.map(lambda x: x[b], laws), one, atol=1e-6)


def test_root_only_tree():
    law = _law_fn(Sampling())(make_tree([2], [-1], N), np.zeros((N, V), np.float32))
    np.testing.assert_array_equal(np.asarray(law.w), np.eye(N)[0])
    assert float(law.coverage) == 0 and float(law.expected_length) == 1


@pytest.mark.parametrize("sampling", [Sampling(1.0), Sampling(1.0, top_k=2), Sampling(0.0)])
def test_children_cover_all_mass(sampling):
    """A node whose children hold its whole support: rho = 0 (never negative or NaN)."""
    logits = np.full((N, V), -2.0, np.float32)
    logits[:, 1] = 3.0
    logits[:, 3] = 2.0
    if sampling.top_k is None and not sampling.greedy:
        tokens, parents = [0, 0, 1, 2, 3, 4], [-1, 0, 0, 0, 0, 0]  # all V tokens
    else:
        tokens, parents = [0, 1, 3], [-1, 0, 0]  # the whole top-2 / the argmax and more
    law = _law_fn(sampling)(make_tree(tokens, parents, N), logits)
    rho = np.asarray(law.rho)
    assert 0.0 <= rho[0] <= 2e-7, rho[0]
    assert np.all(np.isfinite(np.asarray(law.w)))
    np.testing.assert_allclose(float(np.asarray(law.w).sum()), 1.0, atol=1e-6)


@pytest.mark.parametrize("gap", [4.0, 8.0, 12.0, 16.0, 20.0, 30.0])
def test_rho_accurate_when_children_cover_almost_all(gap):
    """rho = 1 - sum(children) vs the float64 complement, V = 32 000.

    The children hold all but ~exp(-gap) of the mass. The float32 error of ``1 - sum``
    is absolute, a few ulps of 1 (at most 2.6e-7 measured at V = 32 000 and 151 936):
    the resolution of float32 sampling itself (uniforms on a 2^-24 grid). Relative to
    a rho below ~1e-6 it is large, and no float32 sampler resolves such a rho anyway.
    """
    vocab = 32_000
    rng = np.random.default_rng(int(gap))
    x = rng.standard_normal((2, vocab)).astype(np.float32)
    kids = [5, 17, 99]
    x[0, kids] = [gap + 1.0, gap + 0.5, gap]
    x[0, 5] += np.log(vocab)
    tree = make_tree([0] + kids, [-1, 0, 0, 0], 4)
    logits = np.concatenate([x, rng.standard_normal((2, vocab)).astype(np.float32)])
    law = exit_law(tree, logits, Sampling(1.0))
    logp = ref.log_probs(logits[:1], 1.0)[0]
    rho_ref = np.exp(np.delete(logp, kids)).sum()
    rho = float(law.rho[0])
    assert abs(rho - rho_ref) <= 5e-7, (rho, rho_ref)
    np.testing.assert_allclose(float(law.w.sum()), 1.0, atol=1e-6)


def test_extreme_logits_no_nan():
    """Huge logit ranges and -inf edges: probabilities 0 and 1, never NaN."""
    x = np.array([[1e4, -1e4, 0, 0, 0], [0, 0, 0, 0, -np.inf]] * 4, np.float32)
    tree = make_tree([0, 1, 0, 4, 2], [-1, 0, 0, 2, 3], N)
    for s in SAMPLINGS:
        law = _law_fn(s)(tree, x)
        for f in ("reach", "rho", "w", "coverage"):
            assert not np.any(np.isnan(np.asarray(getattr(law, f)))), (s, f)
        np.testing.assert_allclose(float(law.w.sum()), 1.0, atol=1e-6)


@pytest.mark.parametrize("sampling", [Sampling(1.0), Sampling(0.6), Sampling(1.0, top_k=50)])
def test_edge_log_probs_from_gathered_blocks(sampling):
    """``log a`` is recovered from the token's 128-block; compare with float64 for tokens
    in every block (the short tail block included), at tiny and removed probabilities."""
    vocab, n = 1000, 16
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal((n, vocab)) * 6).astype(np.float32)
    logits[:, 990:] = -np.inf  # part of the tail block is removed
    tokens = [0] + [int(t) for t in rng.choice(vocab, n - 1, replace=False)]
    tokens[1], tokens[2] = 999, 995  # removed tokens
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    law = jax.jit(functools.partial(exit_law, sampling=sampling))(
        make_tree(tokens, parents, n), logits)
    logp = _ref_logp(logits, sampling)
    want = np.array([0.0] + [logp[parents[i], tokens[i]] for i in range(1, n)])
    got = np.asarray(law.log_a)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], atol=2e-5, rtol=1e-5)


def test_cli_demo(capsys):
    from tev_jax.cli import main

    assert main(["exit-law", "--demo", "--draws", "2000", "--temperature", "0.8"]) == 0
    out = capsys.readouterr().out
    assert "sum w = 1.0000" in out and "expected block length 1 + C" in out
    assert out.count("exit slot") == 5
    with pytest.raises(SystemExit):
        main(["exit-law", "--demo", "--temperature", "-1"])
