"""The jitted DDTree builder against the heap reference, brute force and numpy.

Every configuration (H, V, budget) is compiled once (vmapped over a batch of seeds) and
reused; the whole file runs in about a minute on two CPU cores.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
from hypothesis import given, settings
from hypothesis import strategies as st

from tev_jax import ddtree
from tev_jax.testing.heap_ddtree import heap_build, numpy_topk_logq
from tev_jax.tree import DraftTree, validate

FIELDS = ("tokens", "parents", "depths", "valid", "logq", "score")
KINDS = ("gauss", "ties", "one_hot", "masked", "wide")


@functools.lru_cache(maxsize=None)
def _builder(budget: int):
    return jax.jit(jax.vmap(ddtree.build_tree, in_axes=(0, 0, None)), static_argnums=2)


@functools.lru_cache(maxsize=None)
def _topk(k: int):
    return jax.jit(jax.vmap(ddtree.topk_logq, in_axes=(0, None)), static_argnums=1)


def _logits(rng, kind: str, h: int, v: int) -> np.ndarray:
    """float32 [H, V] draft logits of a given flavour (every row has a finite entry)."""
    x = rng.standard_normal((h, v)) * rng.choice([0.3, 1.0, 3.0])
    if kind == "ties":
        x = np.round(x * 2) / 2  # many exactly equal logits, hence equal scores
    elif kind == "one_hot":
        row = rng.integers(h)
        x[row] = np.round(x[row])
        x[row, rng.integers(v)] = 60.0  # q = 0 exactly on one token in float32
        x[rng.integers(h), rng.integers(v)] += 12.0
    elif kind == "masked":
        holes = rng.random((h, v)) < 0.6
        holes[np.arange(h), rng.integers(v, size=h)] = False
        x = np.where(holes, -np.inf, np.round(x))
    elif kind == "wide":
        x = x * 30.0
    return x.astype(np.float32)


def _as_numpy(tree, info) -> dict[str, np.ndarray]:
    arrays = (tree.tokens, tree.parents, tree.depths, tree.valid, info.logq, info.score)
    return {f: np.asarray(a) for f, a in zip(FIELDS, arrays)}


def _row(batch: dict[str, np.ndarray], b: int) -> dict[str, np.ndarray]:
    return {f: batch[f][b] for f in FIELDS}


def _paths(out: dict[str, np.ndarray]) -> dict[tuple[int, ...], float]:
    """Token path (root excluded) of every valid node -> its score."""
    paths: dict[int, tuple[int, ...]] = {0: ()}
    for i in range(1, int(out["valid"].sum())):
        paths[i] = paths[int(out["parents"][i])] + (int(out["tokens"][i]),)
    return {paths[i]: float(out["score"][i]) for i in paths if i}


def _check_structure(out: dict[str, np.ndarray], logits_HV: np.ndarray, horizon: int) -> None:
    """validate, prefix closure, scores = parent score + logq, logq = log_softmax."""
    validate(DraftTree(*(jnp.asarray(out[f]) for f in FIELDS[:4])), horizon=horizon)
    n = int(out["valid"].sum())
    paths = _paths(out)
    assert all(p[:-1] in paths or len(p) == 1 for p in paths)  # prefix-closed
    par = out["parents"][1:n]
    np.testing.assert_array_equal(out["score"][1:n],
                                  (out["score"][par] + out["logq"][1:n]).astype(np.float32))
    logp = scipy.special.log_softmax(logits_HV.astype(np.float64), axis=-1)
    ref_logq = logp[out["depths"][1:n] - 1, out["tokens"][1:n]]
    scale = np.max(np.abs(logits_HV[np.isfinite(logits_HV)]))  # float32 rounding of the logits
    np.testing.assert_allclose(out["logq"][1:n], ref_logq, rtol=1e-5, atol=1e-5 + 4e-7 * scale)
    assert np.isfinite(out["score"][:n]).all()
    assert not out["valid"][n:].any()
    # slot order: score descending, equal scores by depth ascending
    key = np.stack([-out["score"][1:n], out["depths"][1:n]], axis=1)
    assert all(tuple(a) <= tuple(b) for a, b in zip(key[:-1], key[1:]))


CASES = [  # (H, V, budget, seeds)
    (1, 2, 0, 4), (1, 2, 1, 4), (1, 2, 5, 4), (1, 7, 3, 6),
    (3, 2, 5, 8), (3, 4, 30, 8), (3, 7, 16, 8),
    (7, 3, 40, 8), (7, 50, 64, 8), (7, 2, 300, 6),
    (15, 2, 100, 8), (15, 5, 17, 8), (15, 300, 256, 6), (15, 2000, 1024, 3),
    (15, 4, 1024, 3),
]


@pytest.mark.parametrize("horizon,vocab,budget,seeds", CASES)
def test_matches_heap(horizon, vocab, budget, seeds):
    """Slot-for-slot equality with the heap over the same top-K arrays, many seeds."""
    rng = np.random.default_rng(1000 * horizon + vocab + budget)
    kinds = list(itertools.islice(itertools.cycle(KINDS), seeds))
    logits = np.stack([_logits(rng, k, horizon, vocab) for k in kinds])
    roots = rng.integers(vocab, size=seeds).astype(np.int32)
    got = _as_numpy(*_builder(budget)(logits, roots, budget))
    k = max(min(budget, vocab), 1)
    tokens, logq = (np.asarray(a) for a in _topk(k)(logits, k))
    for b in range(seeds):
        ref = heap_build(tokens[b], logq[b], int(roots[b]), budget)
        out = _row(got, b)
        for f in FIELDS:
            np.testing.assert_array_equal(out[f], ref[f], err_msg=f"{f} ({kinds[b]}, seed {b})")
        _check_structure(out, logits[b], horizon)
        # padding only when fewer than `budget` candidates have a finite score
        n_finite = [min(int(c), k) for c in np.isfinite(logits[b]).sum(axis=1)]
        n_cands = sum(math.prod(n_finite[:d]) for d in range(1, horizon + 1)) if budget else 0
        assert out["valid"].sum() == min(budget, n_cands) + 1
        if sum(k ** d for d in range(1, horizon + 1)) <= 4000:
            _check_brute_force(out, tokens[b], logq[b], budget)


def test_big_vocab_matches_heap():
    """The full Qwen vocabulary once (H = 15, V = 151 936)."""
    horizon, vocab, budget = 15, 151936, 64
    rng = np.random.default_rng(7)
    logits = np.stack([_logits(rng, "gauss", horizon, vocab), _logits(rng, "ties", horizon, vocab)])
    roots = np.array([3, 151935], np.int32)
    got = _as_numpy(*_builder(budget)(logits, roots, budget))
    tokens, logq = (np.asarray(a) for a in _topk(budget)(logits, budget))
    for b in range(2):
        ref = heap_build(tokens[b], logq[b], int(roots[b]), budget)
        for f in FIELDS:
            np.testing.assert_array_equal(got[f][b], ref[f], err_msg=f)
        _check_structure(_row(got, b), logits[b], horizon)
    # the jitted top-K agrees with numpy (float64) on tokens and log-probabilities
    np_tokens, np_logq = numpy_topk_logq(logits[1], budget)
    np.testing.assert_array_equal(tokens[1], np_tokens)
    np.testing.assert_allclose(logq[1], np_logq, rtol=1e-5, atol=1e-4)


def _brute_force(tokens_HK: np.ndarray, logq_HK: np.ndarray, budget: int):
    """The first ``budget`` candidates of the documented total order, by enumeration.

    Returns a list of (token path, float32 score), best first.
    """
    h, k = logq_HK.shape
    scores = {(): np.float32(0.0)}  # rank path -> float32 score summed from the root
    for depth in range(1, h + 1):
        for path in itertools.product(range(k), repeat=depth):
            scores[path] = np.float32(scores[path[:-1]] + logq_HK[depth - 1, path[-1]])
    position = {(): 0}  # placed candidates -> position among the placed ones of their depth
    remaining = {p for p in scores if p and np.isfinite(scores[p])}
    order = []

    def key(p):
        i = position[p[:-1]]
        return (-scores[p], len(p), i + p[-1], i)

    while remaining and len(order) < budget:
        # A candidate whose parent is not placed yet has an unplaced ancestor that
        # precedes it, so the next candidate in the order always has a placed parent.
        best = min((p for p in remaining if p[:-1] in position), key=key)
        position[best] = sum(len(q) == len(best) for q in order)
        order.append(best)
        remaining.remove(best)
    return [(tuple(int(tokens_HK[d, r]) for d, r in enumerate(p)), scores[p]) for p in order]


def _check_brute_force(out, tokens_HK, logq_HK, budget):
    """Slot i holds the i-th candidate of the order: the tree is the top-`budget` set."""
    ranked = _brute_force(tokens_HK, logq_HK, budget)
    n = int(out["valid"].sum())
    assert n - 1 == len(ranked)  # every slot used unless the finite candidates ran out
    paths = {0: ()}
    for i in range(1, n):
        paths[i] = paths[int(out["parents"][i])] + (int(out["tokens"][i]),)
        assert (paths[i], out["score"][i]) == ranked[i - 1]


HYPO_SHAPE, HYPO_BUDGET = (3, 4), 11


@settings(max_examples=40, deadline=None)
@given(values=st.lists(st.sampled_from([-np.inf, -2.0, -1.0, -0.5, 0.0, -0.0, 0.5, 1.0, 9.0, 40.0]),
                       min_size=12, max_size=12))
def test_ties_brute_force(values):
    """Logits drawn from a few values (exact ties, -0.0, q = 0 rows, masked tokens):
    the tree is the top-`budget` set in the documented order, and equals the heap."""
    logits = np.array(values, np.float32).reshape(HYPO_SHAPE)
    logits[:, 1] = np.where(np.all(np.isneginf(logits), axis=1), 0.0, logits[:, 1])
    got = _as_numpy(*_builder(HYPO_BUDGET)(logits[None], np.array([1], np.int32), HYPO_BUDGET))
    out = _row(got, 0)
    k = min(HYPO_BUDGET, HYPO_SHAPE[1])
    tokens, logq = (np.asarray(a)[0] for a in _topk(k)(logits[None], k))
    _check_brute_force(out, tokens, logq, HYPO_BUDGET)
    ref = heap_build(tokens, logq, 1, HYPO_BUDGET)
    for f in FIELDS:
        np.testing.assert_array_equal(out[f], ref[f], err_msg=f)
    _check_structure(out, logits, HYPO_SHAPE[0])


def test_vmap_equals_one_by_one():
    horizon, vocab, budget = 7, 50, 64
    rng = np.random.default_rng(3)
    logits = np.stack([_logits(rng, k, horizon, vocab) for k in KINDS])
    roots = np.arange(len(KINDS), dtype=np.int32)
    batched = _as_numpy(*_builder(budget)(logits, roots, budget))
    single = jax.jit(ddtree.build_tree, static_argnums=2)
    for b in range(len(KINDS)):
        one = _as_numpy(*single(logits[b], roots[b], budget))
        for f in FIELDS:
            np.testing.assert_array_equal(batched[f][b], one[f], err_msg=f)


def test_without_jit_matches_jit():
    rng = np.random.default_rng(4)
    logits = _logits(rng, "ties", 2, 3)
    eager = _as_numpy(*ddtree.build_tree(jnp.asarray(logits), 2, 4))
    jitted = _as_numpy(*jax.jit(ddtree.build_tree, static_argnums=2)(logits, 2, 4))
    for f in FIELDS:
        np.testing.assert_array_equal(eager[f], jitted[f], err_msg=f)


def test_budget_zero_is_root_only():
    tree, info = ddtree.build_tree(jnp.zeros((4, 9)), 5, 0)
    assert tree.num_slots == 1 and int(tree.tokens[0]) == 5 and bool(tree.valid[0])
    validate(tree, horizon=4)


def test_chain():
    horizon, vocab = 6, 30
    rng = np.random.default_rng(5)
    logits = np.stack([_logits(rng, k, horizon, vocab) for k in KINDS])
    roots = np.arange(len(KINDS), dtype=np.int32) + 11
    chain = jax.jit(jax.vmap(ddtree.build_chain))
    got = _as_numpy(*chain(logits, roots))
    tokens, logq = (np.asarray(a) for a in _topk(1)(logits, 1))
    for b in range(len(KINDS)):
        out = _row(got, b)
        np.testing.assert_array_equal(out["tokens"][1:], np.argmax(logits[b], axis=-1))
        np.testing.assert_array_equal(out["parents"], np.arange(horizon + 1) - 1)
        ref = heap_build(tokens[b], logq[b], int(roots[b]), horizon)  # K = 1: the chain
        for f in FIELDS:
            np.testing.assert_array_equal(out[f], ref[f], err_msg=f)
        _check_structure(out, logits[b], horizon)


def test_topk_logq_matches_numpy():
    rng = np.random.default_rng(6)
    for kind in KINDS:
        logits = _logits(rng, kind, 5, 37)
        tokens, logq = (np.asarray(a) for a in ddtree.topk_logq(jnp.asarray(logits), 12))
        np_tokens, np_logq = numpy_topk_logq(logits, 12)
        finite = np.isfinite(np_logq)  # the order among -inf (masked) entries is unspecified
        np.testing.assert_array_equal(tokens[finite], np_tokens[finite])
        np.testing.assert_array_equal(np.isfinite(logq), finite)
        np.testing.assert_allclose(logq[finite], np_logq[finite], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("logits,budget,root,match", [
    (np.zeros(5), 3, None, "shape"),
    (np.zeros((0, 5)), 3, None, "at least one row"),
    (np.zeros((3, 5), np.int32), 3, None, "floating"),
    (np.zeros((3, 5)), -1, None, "budget"),
    (np.zeros((3, 5)), 2.5, None, "budget"),
    (np.zeros((3, 5)), True, None, "budget"),
    (np.where(np.eye(3, 5) > 0, np.nan, 0.0), 3, None, "NaN"),
    (np.where(np.eye(3, 5) > 0, np.inf, 0.0), 3, None, r"\+inf"),
    (np.where(np.arange(3)[:, None] == 1, -np.inf, np.zeros((3, 5))), 3, None, "entirely -inf"),
    (np.zeros((3, 5)), 3, 5, "root_token"),
    (np.zeros((2, 3, 5)), 3, np.array([0, -1]), "root_token"),
])
def test_bad_input(logits, budget, root, match):
    with pytest.raises(ValueError, match=match):
        ddtree.check_draft_logits(logits, budget, root)


def test_good_input_passes_and_masked_tokens_are_never_drafted():
    logits = np.array([[0.0, -np.inf, 1.0], [-np.inf, -np.inf, 2.0]], np.float32)
    ddtree.check_draft_logits(logits, 8, 1)
    ddtree.check_draft_logits(logits[None].repeat(3, 0), 8, np.array([0, 1, 2]))
    ddtree.check_draft_logits(jnp.asarray(logits, jnp.bfloat16), 8, 1)
    with pytest.raises(ValueError, match="NaN"):
        ddtree.check_draft_logits(jnp.full((2, 3), jnp.nan, jnp.bfloat16), 8)
    out = _row(_as_numpy(*_builder(8)(logits[None], np.array([1], np.int32), 8)), 0)
    n = int(out["valid"].sum())
    assert n == 1 + 2 + 2  # two tokens at depth 1, each with the single finite token below
    assert set(out["tokens"][1:n][out["depths"][1:n] == 2]) == {2}
    with pytest.raises(ValueError, match="budget"):
        ddtree.build_tree(jnp.asarray(logits), 1, -2)
