"""Hypothesis strategies for random valid draft trees and target logits.

This is the one module of `tev_jax.testing` that imports ``hypothesis`` (a test
dependency, in the ``test`` extra); import it explicitly::

    from hypothesis import given
    from tev_jax.testing import strategies as tst

    @given(tst.trees(max_nodes=8, vocab=5), ...)
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from tev_jax.tree import make_tree

__all__ = ["grow_tree", "logits", "tree_lists", "trees"]


def grow_tree(num_nodes: int, root_token: int, vocab: int, max_depth: int | None, pick
              ) -> tuple[list[int], list[int]]:
    """(tokens, parents) of a valid tree of at most ``num_nodes`` nodes, grown one node at a
    time: ``pick(options)`` chooses the parent among the nodes that can take a child, then
    the child's token among its parent's unused ones (a hypothesis draw or a numpy rng).

    Parents come before children, depth is at most ``max_depth`` and siblings carry
    distinct tokens (a node has at most ``vocab`` children).
    """
    tokens, parents, depths = [root_token], [-1], [0]
    used: dict[int, set[int]] = {0: set()}
    for i in range(1, num_nodes):
        open_parents = [
            p for p in range(i)
            if len(used[p]) < vocab and (max_depth is None or depths[p] < max_depth)
        ]
        if not open_parents:
            break
        p = pick(open_parents)
        tok = pick(sorted(set(range(vocab)) - used[p]))
        used[p].add(tok)
        used[i] = set()
        tokens.append(tok)
        parents.append(p)
        depths.append(depths[p] + 1)
    return tokens, parents


@st.composite
def tree_lists(draw, max_nodes: int = 8, vocab: int = 5, max_depth: int | None = None):
    """(tokens, parents) of a valid tree with 1..max_nodes nodes, tokens in [0, vocab)
    (`grow_tree`)."""
    n = draw(st.integers(1, max_nodes))
    root = draw(st.integers(0, vocab - 1))
    return grow_tree(n, root, vocab, max_depth, lambda options: draw(st.sampled_from(options)))


@st.composite
def trees(draw, max_nodes: int = 8, vocab: int = 5, max_depth: int | None = None,
          num_slots: int | None = None):
    """A padded ``DraftTree`` (N = ``num_slots`` or ``max_nodes``)."""
    tokens, parents = draw(tree_lists(max_nodes, vocab, max_depth))
    return make_tree(tokens, parents, num_slots or max_nodes)


@st.composite
def logits(draw, num_slots: int, vocab: int):
    """float32 [N, V] target logits: Gaussian with a random scale, sometimes with a few
    very large entries (children covering almost all mass) or -inf entries."""
    seed = draw(st.integers(0, 2**32 - 1))
    scale = draw(st.sampled_from([0.1, 1.0, 3.0, 10.0]))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_slots, vocab)) * scale
    if draw(st.booleans()):
        spikes = rng.random((num_slots, vocab)) < 0.2
        x = np.where(spikes, x + 25.0, x)
    if draw(st.booleans()):
        holes = rng.random((num_slots, vocab)) < 0.2
        holes[:, 0] = False
        x = np.where(holes, -np.inf, x)
    return x.astype(np.float32)
