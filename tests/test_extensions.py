"""The extension points' host-side checks (`tev_jax.extensions`): names resolve to
builders of the same form as a user's, N is read from a builder's output shape, and a
function of the wrong type or shape fails with a ValueError naming the field and the
shapes."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tev_jax import ddtree, decode, engine, extensions, verify
from tev_jax.sampling import Sampling
from tev_jax.tree import DraftTree

H, V = 4, 11


def _logits():
    return jnp.asarray(np.random.default_rng(0).standard_normal((H, V)), jnp.float32)


@pytest.mark.parametrize("name,budget,slots", [("ddtree", 6, 7), ("chain", 6, H + 1),
                                               ("none", 6, 1)])
def test_named_builders_are_builders(name, budget, slots):
    builder = extensions.resolve_builder(name, budget)
    assert isinstance(builder, extensions.TreeBuilder)
    horizon = 0 if name == "none" else H
    assert extensions.builder_num_slots(builder, horizon, V) == slots
    if name != "none":
        tree = builder(_logits(), jnp.int32(2))
        reference = (ddtree.build_tree(_logits(), 2, budget) if name == "ddtree"
                     else ddtree.build_chain(_logits(), 2))[0]
        jax.tree.map(np.testing.assert_array_equal, tree, reference)
        assert tree.tokens.shape == (slots,)  # DDTree's untraced num_slots is its shape


def test_ddtree_batched_form_builds_the_rows_trees():
    x_BHV = jnp.asarray(np.random.default_rng(1).standard_normal((3, H, V)), jnp.float32)
    roots = jnp.asarray([1, 2, 3], jnp.int32)
    builder = extensions.DDTreeBuilder(7)
    jax.tree.map(np.testing.assert_array_equal, extensions.batched(builder)(x_BHV, roots),
                 jax.vmap(builder)(x_BHV, roots))
    assert builder == extensions.DDTreeBuilder(7) and hash(builder) == hash(
        extensions.DDTreeBuilder(7))  # equal configs share a compilation


def test_a_user_builder_is_taken_as_is():
    def star(draft_logits_HV, root_token):
        top = jax.lax.top_k(draft_logits_HV[0], 3)[1].astype(jnp.int32)
        return DraftTree(tokens=jnp.concatenate([root_token[None], top]),
                         parents=jnp.asarray([-1, 0, 0, 0], jnp.int32),
                         depths=jnp.asarray([0, 1, 1, 1], jnp.int32),
                         valid=jnp.ones(4, bool))

    assert extensions.resolve_builder(star, 64) is star
    assert extensions.builder_num_slots(star, H, V) == 4


def _bad_builders():
    ok = extensions.DDTreeBuilder(3)
    return {
        "a tuple": (lambda x, r: ddtree.build_tree(x, r, 3), "builder must return a .*got tuple"),
        "fields of two lengths": (lambda x, r: ok(x, r).replace(valid=jnp.ones(2, bool)),
                                  r"shape \[N\].*'valid': \(2,\)"),
        "a batch axis": (lambda x, r: jax.tree.map(lambda a: a[None], ok(x, r)),
                         r"shape \[N\].*\(1, 4\)"),
        "float tokens": (lambda x, r: ok(x, r).replace(tokens=jnp.zeros(4)),
                         "wrong dtype.*'tokens': 'float32'"),
    }


@pytest.mark.parametrize("what", list(_bad_builders()))
def test_a_builder_of_the_wrong_type_or_shape_is_named(what):
    fn, match = _bad_builders()[what]
    with pytest.raises(ValueError, match=match):
        extensions.builder_num_slots(fn, H, V)


def test_a_verifier_of_the_wrong_type_or_shape_is_named():
    s = Sampling(1.0)
    extensions.check_verifier(verify.tev, 5, H, V, s)
    with pytest.raises(ValueError, match="must return a tev_jax.verify.Verdict, got tuple"):
        extensions.check_verifier(lambda k, t, x, s, *, horizon: (t.tokens, 1), 5, H, V, s)
    too_long = lambda k, t, x, s, *, horizon: verify.tev(k, t, x, s, horizon=horizon + 2)
    with pytest.raises(ValueError, match=r"path.*\(7,\).*path \[H\+1\] = \[5\]"):
        extensions.check_verifier(too_long, 5, H, V, s)
    batched = lambda k, t, x, s, *, horizon: jax.tree.map(
        lambda a: a[None], verify.tev(k, t, x, s, horizon=horizon))
    with pytest.raises(ValueError, match="scalar length"):
        extensions.check_verifier(batched, 5, H, V, s)


def test_unknown_names_and_unhashable_functions_are_refused():
    with pytest.raises(ValueError, match="builder must be one of"):
        extensions.resolve_builder("medusa", 8)

    class Unhashable:
        __hash__ = None

        def __call__(self, draft_logits_HV, root_token):
            raise AssertionError("not called")

    with pytest.raises(ValueError, match="builder must be hashable"):
        extensions.check_hashable(Unhashable(), "builder")
    with pytest.raises(ValueError, match="verifier must be a name or a callable"):
        extensions.check_hashable(3, "verifier")


# ----------------------------------------------------------------- in the decode engine


@pytest.fixture(scope="module")
def models():
    from decode_fixtures import tiny_target
    from tev_jax.testing.drafters import OracleDrafter

    return tiny_target(seed=8), OracleDrafter(H + 1, scale=0.5)


@pytest.mark.slow  # the fast tier's time (README: under 10 minutes here), 2026-12-06
def test_a_callable_builder_takes_the_named_builders_path(models):
    """The named builder (DDTree's batched form) and a plain one-row function that builds
    the same trees (vmapped by the engine) decode alike (same key, T = 1)."""
    target, drafter = models
    prompts = [[5, 17, 3], [9, 1, 2, 33]]
    cfg = lambda **kw: decode.DecodeConfig(max_new_tokens=16, sampling=Sampling(1.0),
                                           budget=6, **kw)
    named = engine.generate(target, drafter, prompts, cfg(builder="ddtree"), key=3)
    fn = lambda draft_logits_HV, root: ddtree.build_tree(draft_logits_HV, root, 6)[0]
    passed = engine.generate(target, drafter, prompts, cfg(builder=fn), key=3)
    np.testing.assert_array_equal(named.tokens, passed.tokens)
    np.testing.assert_array_equal(named.stats.block_lengths, passed.stats.block_lengths)
    assert named.stats.tau > 1.2  # the trees were used


def test_the_engine_names_a_bad_builder_or_verifier(models):
    target, drafter = models
    bad_builder = lambda x, r: ddtree.build_tree(x, r, 3)  # (tree, info), not a tree
    with pytest.raises(ValueError, match="builder must return a tev_jax.tree.DraftTree"):
        engine.generate(target, drafter, [[1, 2]], decode.DecodeConfig(
            max_new_tokens=4, builder=bad_builder))
    long_path = lambda k, t, x, s, *, horizon: verify.tev(k, t, x, s, horizon=horizon + 1)
    with pytest.raises(ValueError, match=r"path \[H\+1\] = \[5\]"):
        engine.generate(target, drafter, [[1, 2]], decode.DecodeConfig(
            max_new_tokens=4, budget=6, verifier=long_path, sampling=Sampling(1.0)))
    with pytest.raises(ValueError, match="builder must be hashable"):
        decode.DecodeConfig(builder=type("B", (), {"__hash__": None, "__call__": bad_builder})())
