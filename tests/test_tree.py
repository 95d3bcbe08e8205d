"""Draft-tree arrays: every validation rule, and the derived structure vs python loops."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from tev_jax.testing import reference as ref
from tev_jax.testing import strategies as tst
from tev_jax.tree import (
    DraftTree,
    ancestor_mask,
    children_mask,
    make_tree,
    node_paths,
    path_to,
    render,
    validate,
)

N, H = 8, 4

# A good tree:      0
#                  / \
#                 1   2
#                 |
#                 3
GOOD = dict(
    tokens=[7, 1, 2, 3, 0, 0],
    parents=[-1, 0, 0, 1, -1, -1],
    depths=[0, 1, 1, 2, 0, 0],
    valid=[True, True, True, True, False, False],
)


def _tree(**changes):
    fields = {k: list(v) for k, v in GOOD.items()}
    for name, (slot, value) in changes.items():
        fields[name][slot] = value
    return DraftTree(
        jnp.asarray(fields["tokens"], jnp.int32),
        jnp.asarray(fields["parents"], jnp.int32),
        jnp.asarray(fields["depths"], jnp.int32),
        jnp.asarray(fields["valid"], bool),
    )


def test_good_tree_is_valid():
    validate(_tree())
    validate(_tree(), horizon=2)


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(valid=(0, False)), "rule 1: slot 0 must be valid"),
        (dict(parents=(0, 0)), "rule 1: slot 0 is the root"),
        (dict(depths=(0, 1)), "rule 1: slot 0 is the root"),
        (dict(parents=(4, 2)), "padding slots must have parent -1"),
        (dict(depths=(5, 3)), "padding slots must have parent -1 and depth 0"),
        (dict(parents=(2, 2)), "rule 2: slot 2 has parent 2"),
        (dict(parents=(1, 3), depths=(1, 3)), "rule 2: slot 1 has parent 3"),
        (dict(parents=(1, -1)), "rule 2: slot 1 has parent -1"),
        (dict(depths=(3, 1)), "rule 3: slot 3 has depth 1"),
        (dict(tokens=(2, 1)), "rule 4: slots 1 and 2 are siblings"),
    ],
)
def test_each_rule_rejects_a_malformed_tree(changes, match):
    with pytest.raises(ValueError, match=match):
        validate(_tree(**changes))


def test_valid_slots_must_be_a_prefix():
    tree = _tree(valid=(2, False), parents=(2, -1), depths=(2, 0))  # slot 3 valid after 2
    with pytest.raises(ValueError, match="rule 1: valid slots must form a prefix"):
        validate(tree)


def test_horizon_rule():
    with pytest.raises(ValueError, match="rule 3: slot 3 has depth 2 > horizon 1"):
        validate(_tree(), horizon=1)


def test_shape_rules():
    good = _tree()
    with pytest.raises(ValueError, match="unbatched"):
        validate(jax.tree.map(lambda x: jnp.stack([x, x]), good))
    with pytest.raises(ValueError, match="must all have shape"):
        validate(good.replace(valid=good.valid[:4]))
    empty = DraftTree(*(jnp.zeros((0,), d) for d in (jnp.int32, jnp.int32, jnp.int32, bool)))
    with pytest.raises(ValueError, match="at least one slot"):
        validate(empty)


def test_make_tree_rejects_bad_lists():
    with pytest.raises(ValueError, match="tokens has 2 entries but parents has 1"):
        make_tree([1, 2], [-1])
    with pytest.raises(ValueError, match="at least the root"):
        make_tree([], [])
    with pytest.raises(ValueError, match="num_slots=1 is smaller"):
        make_tree([1, 2], [-1, 0], num_slots=1)
    with pytest.raises(ValueError, match="parents first"):
        make_tree([1, 2, 3], [-1, 2, 0])
    with pytest.raises(ValueError, match="rule 4"):
        make_tree([1, 2, 2], [-1, 0, 0])
    with pytest.raises(ValueError, match="rule 1"):
        make_tree([1, 2], [0, 0])


def test_make_tree_pads():
    tree = make_tree(GOOD["tokens"][:4], GOOD["parents"][:4], num_slots=6)
    for name, want in GOOD.items():
        np.testing.assert_array_equal(np.asarray(getattr(tree, name)), want)
    assert tree.num_slots == 6


def _ref_structure(tree, horizon):
    tokens, parents, n = ref.host_tree(tree)
    size = tree.num_slots
    anc = np.eye(size, dtype=bool)
    kids = np.zeros((size, size), bool)
    paths = np.full((size, horizon + 1), -1)
    for i in range(n):
        chain = ref.ancestors(parents, i)
        anc[i, chain] = True
        paths[i, : len(chain)] = chain[::-1]
        if i:
            kids[parents[i], i] = True
    return anc, kids, paths


def _structure(tree):
    return (ancestor_mask(tree), children_mask(tree), node_paths(tree, H),
            jax.vmap(lambda i: path_to(tree, i, H))(jnp.arange(tree.num_slots)))


def _check_structure(got, tree):
    anc, kids, paths = _ref_structure(tree, H)
    n = int(np.asarray(tree.valid).sum())
    np.testing.assert_array_equal(got[0], anc)
    np.testing.assert_array_equal(got[1], kids)
    np.testing.assert_array_equal(got[2], paths)
    np.testing.assert_array_equal(np.asarray(got[3])[:n], paths[:n])


_structure_jit = jax.jit(_structure)


@settings(max_examples=40, deadline=None)
@given(tree=tst.trees(max_nodes=N, vocab=3, max_depth=H))
def test_structure_matches_python_loops(tree):
    _check_structure(_structure_jit(tree), tree)


class JitTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_jit_equals_no_jit(self):
        """Both variants match the python loops (hence each other) on fixed trees."""
        for tokens, parents in [([0], [-1]), ([1, 2, 3, 4, 5], [-1, 0, 1, 2, 3]),
                                ([0, 1, 2, 0, 1, 0], [-1, 0, 0, 1, 1, 4])]:
            tree = make_tree(tokens, parents, N)
            _check_structure(self.variant(_structure)(tree), tree)


def test_vmap_over_a_batch_of_trees():
    trees = [make_tree([0], [-1], N), make_tree([1, 2, 3], [-1, 0, 1], N)]
    batch = jax.tree.map(lambda *x: jnp.stack(x), *trees)
    got = jax.jit(jax.vmap(ancestor_mask))(batch)
    for b, tree in enumerate(trees):
        np.testing.assert_array_equal(got[b], _ref_structure(tree, H)[0])


def test_render():
    tree = make_tree(GOOD["tokens"][:4], GOOD["parents"][:4], num_slots=6)
    text = render(tree, decode=lambda t: "abcdefgh"[t], annotations={"P": [1, 0.5, 0.25, 0.125]})
    lines = text.splitlines()
    assert lines[0] == "[0] 'h'  P=1.0000"
    assert len(lines) == 4  # padding is not drawn
    assert lines[1].startswith("├─ [1] 'b'") and lines[2].startswith("│  └─ [3] 'd'")
    assert lines[3] == "└─ [2] 'c'  P=0.2500"
