"""The functional contract of the public algorithm API: jit, vmap and grad change nothing.

Every public function of the algorithm modules (exit law, verifiers, builders, tree
functions, sampling, ExitTrain losses and node weights, the built-in extension
builders) has an entry in ``CASES`` (inputs for two rows) or in ``EXCLUDED`` (with the
reason). For each case the un-transformed call on each row is compared with
``jax.jit`` of it and with ``jax.vmap`` over both rows, and the losses' gradients with
respect to the draft logits with their jitted and vmapped gradients. A new public
function without an entry fails `test_every_public_function_has_an_entry`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tev_jax import (ddtree, exit_law, exit_train, exit_weights, extensions, sampling, tree,
                     tree_scoring, verify, vocab)
from tev_jax.models import lm_head
from tev_jax.models.lm_head import Head
from tev_jax.sampling import Sampling
from tev_jax.tree import make_tree
from tev_jax.vocab import Scores

MODULES = [exit_law, verify, vocab, ddtree, tree, sampling, exit_train, exit_weights, tree_scoring,
           extensions]
N, V, H = 6, 7, 3
T1 = Sampling(1.0)
TOPK = Sampling(0.7, top_k=4)

EXCLUDED = {
    "tev_jax.exit_weights.check_floor": "host-side validation",
    "tev_jax.exit_train.check_score_capacities": "host-side validation",
    "tev_jax.exit_train.check_prefix_window": "host-side validation",
    "tev_jax.ddtree.tree_k": "host-side static K (from shapes)",
    # Host-side validation, construction and display (ValueErrors, numpy, strings).
    "tev_jax.ddtree.check_draft_logits": "host-side input validation",
    "tev_jax.tree.make_tree": "host-side constructor from Python lists",
    "tev_jax.tree.validate": "host-side validation",
    "tev_jax.tree.render": "host-side text rendering",
    "tev_jax.sampling.check_finite": "host-side validation",
    "tev_jax.exit_weights.check_weighting": "host-side validation",
    "tev_jax.extensions.builder_num_slots": "host-side shape check (jax.eval_shape)",
    "tev_jax.extensions.check_hashable": "host-side validation",
    "tev_jax.extensions.check_tree_struct": "host-side shape check",
    "tev_jax.extensions.check_verdict": "host-side shape check",
    "tev_jax.extensions.check_verifier": "host-side shape check (jax.eval_shape)",
    "tev_jax.extensions.resolve_builder": "host-side name lookup",
    "tev_jax.extensions.resolve_verifier": "host-side name lookup",
    "tev_jax.extensions.reads_draft_logits": "host-side attribute lookup of a builder",
    # Model forward passes: functions of a Target module and its caches, compared with
    # dense references (and jitted, as the train step runs them) in test_exit_train.
    "tev_jax.tree_scoring.target_context": "target forward pass (test_exit_train)",
    "tev_jax.tree_scoring.score_tree_nodes": "target forward pass (test_exit_train)",
    "tev_jax.tree_scoring.score_parent_nodes": "target forward pass (test_exit_train)",
    "tev_jax.tree_scoring.score_tree_hidden": "target forward pass (test_exit_train)",
    "tev_jax.tree_scoring.score_parent_hidden": "target forward pass (test_exit_train)",
    "tev_jax.tree_scoring.score_window_hidden": "target forward pass (test_exit_train)",
    "tev_jax.exit_train.exit_targets": "target forward pass (test_train_step)",
    "tev_jax.tree_scoring.blocked_law_ok": "host-side predicate of a static Sampling",
}


def public_functions() -> set[str]:
    """Qualified names of the functions each module defines and exports."""
    out = set()
    for module in MODULES:
        names = getattr(module, "__all__", None) or [n for n in vars(module)
                                                     if not n.startswith("_")]
        for name in names:
            obj = getattr(module, name)
            if inspect.isfunction(obj) and obj.__module__ == module.__name__:
                out.add(f"{module.__name__}.{name}")
    return out


def _trees():
    a = make_tree([2, 1, 3, 0, 5], [-1, 0, 0, 1, 1], N)
    b = make_tree([4, 0, 6, 2], [-1, 0, 1, 2], N)
    return jax.tree.map(lambda *x: jnp.stack(x), a, b)


def _logits(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * 2, jnp.float32)


TREES = _trees()
LOGITS_NV = _logits((2, N, V), 0)
DRAFT_HV = _logits((2, H, V), 1)
KEYS = jax.random.split(jax.random.key(3), 2)
ROOTS = jnp.asarray([2, 4], jnp.int32)
DRAFT_BHV = jnp.stack([DRAFT_HV, DRAFT_HV[::-1]], axis=1)  # two rows of a batch of 2
ROOTS_B = jnp.stack([ROOTS, ROOTS[::-1]], axis=1)
UNIFORMS_N = jax.random.uniform(jax.random.key(4), (2, N))
HIDDEN_ND = _logits((2, N, 4), 5)
HEAD = Head(_logits((V, 4), 6), True)  # a tied [V, D] head
LAWS = jax.vmap(lambda t, x: exit_law.exit_law(t, x, T1))(TREES, LOGITS_NV)
TOKENS_L = jnp.asarray(np.random.default_rng(7).integers(0, V, (2, 12)), jnp.int32)
ANCHORS_A = jnp.asarray([[1, 4, 10], [0, 6, 8]], jnp.int32)


@dataclasses.dataclass(frozen=True)
class Case:
    """``fn(*args)`` with ``args`` batched over two rows; ``grad``: the index of the
    argument to differentiate a scalar ``loss(fn(...))`` by, or None."""

    fn: Callable
    args: tuple
    grad: int | None = None
    loss: Callable = staticmethod(lambda out: out.mean)


def _topk(x_HV):
    return ddtree.topk_logq(x_HV, 3)


def _exit_loss(x_HV, root):
    t = ddtree.build_tree(x_HV, root, 5)[0]
    return exit_weights.exit_loss(x_HV, t, jnp.where(t.depths > 0, 0.5, 0.0))


def _objective(x_HV, root):
    t = ddtree.build_tree(x_HV, root, 5)[0]
    cfg = exit_train.ExitTrainConfig(loss="exit", budget=5, exit_lambda=0.5, sampling=T1,
                                     exit_normalizer="nodes", decay_gamma=2.0)
    labels = jnp.stack([root, root + 1, root + 2]) % V
    return exit_train.objective(x_HV, labels, jnp.asarray(True), t,
                                jnp.where(t.depths > 0, 0.5, 0.0), cfg)


ROW_T = jnp.asarray([0.0, 0.8], jnp.float32)  # one greedy row, one sampled
ROW_K = jnp.asarray([3, 0], jnp.int32)
ROW_P = jnp.asarray([1.0, 0.7], jnp.float32)


def _one_row(fn):
    """A function of a batch of rows, called on a batch of one."""
    return lambda x, *settings: fn(x[None], *(a[None] for a in settings))[0]


CASES = {
    "tev_jax.sampling.row_cut": Case(_one_row(sampling.row_cut), (LOGITS_NV, ROW_K, ROW_P)),
    "tev_jax.vocab.row_scores": Case(
        _one_row(lambda x, t, k, p: vocab.row_scores(
            x, sampling.SamplingRows(t, k, p, jnp.ones(t.shape, bool))).x),
        (LOGITS_NV, ROW_T, ROW_K, ROW_P)),
    "tev_jax.vocab.target_scores": Case(
        lambda x: vocab.target_scores(x, TOPK).x, (LOGITS_NV,)),
    "tev_jax.vocab.block_masses": Case(
        lambda x: vocab.block_masses(Scores(x, 0.5), block=3), (LOGITS_NV,)),
    "tev_jax.vocab.log_normalizer": Case(
        lambda x: vocab.log_normalizer(Scores(x, 1.0)), (LOGITS_NV,)),
    "tev_jax.vocab.gather_blocks": Case(
        lambda x: vocab.gather_blocks(Scores(x, 1.0), jnp.arange(N), jnp.arange(N) % 3, 3),
        (LOGITS_NV,)),
    "tev_jax.exit_law.edge_log_probs": Case(
        lambda t, x: exit_law.edge_log_probs(t, Scores(x, 1.0)), (TREES, LOGITS_NV)),
    "tev_jax.exit_law.exit_law_from_edges": Case(
        lambda t, x: exit_law.exit_law_from_edges(
            t, exit_law.edge_log_probs(t, vocab.target_scores(x, TOPK))),
        (TREES, LOGITS_NV)),
    "tev_jax.exit_law.floored_reach": Case(
        lambda t, x: exit_law.floored_reach(t, exit_law.exit_law(t, x, T1).log_a, 1e-4),
        (TREES, LOGITS_NV)),
    "tev_jax.exit_law.exit_law": Case(lambda t, x: exit_law.exit_law(t, x, TOPK),
                                      (TREES, LOGITS_NV)),
    "tev_jax.vocab.uniform": Case(lambda k: vocab.uniform(k, (5,)), (KEYS,)),
    "tev_jax.vocab.inverse_cdf": Case(
        lambda u, x: vocab.inverse_cdf(u, Scores(x, 1.0), block=3), (UNIFORMS_N, LOGITS_NV)),
    "tev_jax.vocab.first_above": Case(
        lambda u, x: vocab.first_above(jnp.cumsum(jnp.exp(x), -1), u * 3.0, jnp.exp(x)),
        (UNIFORMS_N, LOGITS_NV)),
    "tev_jax.vocab.sample_token": Case(
        lambda k, x: vocab.sample_token(jax.random.split(k, N), x, T1), (KEYS, LOGITS_NV)),
    "tev_jax.vocab.vocab_top_k": Case(lambda x: vocab.vocab_top_k(x, 3), (LOGITS_NV,)),
    "tev_jax.vocab.top_k": Case(lambda x: vocab.top_k(x, 3), (LOGITS_NV,)),
    "tev_jax.vocab.embed_rows": Case(lambda x: vocab.embed_rows(x, jnp.arange(3) * 2),
                                     (LOGITS_NV,)),
    "tev_jax.vocab.cpu_barrier": Case(lambda x: vocab.cpu_barrier(x) * 2.0, (LOGITS_NV,)),
    "tev_jax.verify.tev": Case(lambda k, t, x: verify.tev(k, t, x, T1, horizon=H),
                               (KEYS, TREES, LOGITS_NV)),
    "tev_jax.verify.predraw": Case(lambda k, t, x: verify.predraw(k, t, x, TOPK, horizon=H),
                                   (KEYS, TREES, LOGITS_NV)),
    "tev_jax.verify.sequential_residual": Case(
        lambda k, t, x: verify.sequential_residual(k, t, x, T1, horizon=H),
        (KEYS, TREES, LOGITS_NV)),
    "tev_jax.vocab.argmax": Case(lambda x: vocab.argmax(x, block=3), (LOGITS_NV,)),
    "tev_jax.verify.greedy": Case(lambda t, x: verify.greedy(t, x, horizon=H),
                                  (TREES, LOGITS_NV)),
    "tev_jax.ddtree.topk_logq": Case(_topk, (DRAFT_HV,)),
    "tev_jax.ddtree.build_tree_from_topk": Case(
        lambda x, r: ddtree.build_tree_from_topk(*_topk(x), r, 5), (DRAFT_HV, ROOTS)),
    "tev_jax.ddtree.build_tree": Case(lambda x, r: ddtree.build_tree(x, r, 5),
                                      (DRAFT_HV, ROOTS)),
    "tev_jax.ddtree.build_chain": Case(ddtree.build_chain, (DRAFT_HV, ROOTS)),
    "tev_jax.tree.ancestor_mask": Case(tree.ancestor_mask, (TREES,)),
    "tev_jax.tree.node_paths": Case(lambda t: tree.node_paths(t, H), (TREES,)),
    "tev_jax.tree.path_to": Case(lambda t: tree.path_to(t, jnp.int32(3), H), (TREES,)),
    "tev_jax.tree.children_mask": Case(tree.children_mask, (TREES,)),
    "tev_jax.sampling.log_probs": Case(lambda x: sampling.log_probs(x, TOPK), (LOGITS_NV,)),
    "tev_jax.exit_weights.node_weights": Case(
        lambda t, law: exit_weights.node_weights(t, law, "exit_depth"), (TREES, LAWS)),
    "tev_jax.exit_weights.tree_exit_weights": Case(
        lambda t, x: exit_weights.tree_exit_weights(t, x, T1, "exit"), (TREES, LOGITS_NV)),
    "tev_jax.tree_scoring.parent_mask": Case(tree_scoring.parent_mask, (TREES,)),
    "tev_jax.tree_scoring.exit_laws_from_edges": Case(
        lambda t, x: tree_scoring.exit_laws_from_edges(
            t, exit_law.edge_log_probs(t, Scores(x, 1.0))), (TREES, LOGITS_NV)),
    "tev_jax.tree_scoring.edge_log_probs_blocked": Case(
        lambda t, h: tree_scoring.edge_log_probs_blocked(t, h, HEAD, T1, block=3),
        (TREES, HIDDEN_ND)),
    "tev_jax.exit_weights.token_loss": Case(
        lambda x, r: exit_weights.token_loss(x, jnp.stack([r, r + 1, r + 2]) % V,
                                             jnp.ones(H, bool), decay_gamma=2.0),
        (DRAFT_HV, ROOTS), grad=0),
    "tev_jax.exit_weights.exit_loss": Case(_exit_loss, (DRAFT_HV, ROOTS), grad=0),
    "tev_jax.exit_train.objective": Case(_objective, (DRAFT_HV, ROOTS), grad=0,
                                         loss=lambda out: out[0]),
    "tev_jax.exit_train.block_labels": Case(lambda t, a: exit_train.block_labels(t, a, H),
                                            (TOKENS_L, ANCHORS_A)),
    "tev_jax.ddtree.draft_top_k": Case(
        lambda h: ddtree.draft_top_k(lm_head.head_rows(h, HEAD, 3), 3, block=3),
        (HIDDEN_ND,)),
    "tev_jax.ddtree.build_trees": Case(lambda x, r: ddtree.build_trees(x, r, 5),
                                       (DRAFT_BHV, ROOTS_B)),
    "tev_jax.extensions.batched": Case(extensions.batched(extensions.DDTreeBuilder(5)),
                                       (DRAFT_BHV, ROOTS_B)),
    "tev_jax.extensions.chain_builder": Case(extensions.chain_builder, (DRAFT_HV, ROOTS)),
    "tev_jax.extensions.greedy_verifier": Case(
        lambda k, t, x: extensions.greedy_verifier(k, t, x, T1, horizon=H),
        (KEYS, TREES, LOGITS_NV)),
    "tev_jax.extensions.root_only_builder": Case(extensions.root_only_builder,
                                                 (DRAFT_HV, ROOTS)),
}


def _row(args, b):
    return jax.tree.map(lambda a: a[b], args)


def _assert_same(got, want, what):
    got_leaves, got_def = jax.tree.flatten(got)
    want_leaves, want_def = jax.tree.flatten(want)
    assert got_def == want_def, what
    for g, w in zip(got_leaves, want_leaves):
        if jnp.issubdtype(w.dtype, jnp.floating):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=what)
        elif jnp.issubdtype(w.dtype, jax.dtypes.prng_key):
            np.testing.assert_array_equal(jax.random.key_data(g), jax.random.key_data(w),
                                          err_msg=what)
        else:
            np.testing.assert_array_equal(g, w, err_msg=what)


def test_every_public_function_has_an_entry():
    public = public_functions()
    missing = public - set(CASES) - set(EXCLUDED)
    stale = (set(CASES) | set(EXCLUDED)) - public
    assert not missing, f"public functions without a functional-contract entry: {missing}"
    assert not stale, f"entries for names that are not public functions: {stale}"
    assert not set(CASES) & set(EXCLUDED)


@pytest.mark.parametrize("name", sorted(CASES))
def test_jit_vmap_grad_match_the_plain_call(name):
    case = CASES[name]
    rows = [_row(case.args, b) for b in range(2)]
    plain = [case.fn(*r) for r in rows]
    jitted = jax.jit(case.fn)
    batched = jax.vmap(case.fn)(*case.args)
    for b, r in enumerate(rows):
        _assert_same(jitted(*r), plain[b], f"{name}: jit, row {b}")
        _assert_same(_row(batched, b), plain[b], f"{name}: vmap, row {b}")
    if case.grad is None:
        return
    i = case.grad

    def scalar(x, *rest):
        args = (*rest[:i], x, *rest[i:])
        return case.loss(case.fn(*args))

    grad = jax.grad(scalar)
    plain_g = [grad(r[i], *r[:i], *r[i + 1:]) for r in rows]
    batched_g = jax.vmap(grad)(case.args[i], *case.args[:i], *case.args[i + 1:])
    for b, r in enumerate(rows):
        assert np.all(np.isfinite(plain_g[b])) and np.any(plain_g[b] != 0)
        _assert_same(jax.jit(grad)(r[i], *r[:i], *r[i + 1:]), plain_g[b],
                     f"{name}: jit(grad), row {b}")
        _assert_same(batched_g[b], plain_g[b], f"{name}: vmap(grad), row {b}")


def test_an_unlisted_public_function_is_caught(monkeypatch):
    """Negative control: adding a public function to a module makes the check fail."""
    def new_public_fn(x):
        return x

    new_public_fn.__module__ = verify.__name__
    monkeypatch.setattr(verify, "new_public_fn", new_public_fn, raising=False)
    with pytest.raises(AssertionError, match="new_public_fn"):
        test_every_public_function_has_an_entry()

