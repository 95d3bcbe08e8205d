"""Draft trees as static-shape arrays (docs/design.md §2).

A tree over N slots is four [N] arrays. Slot 0 is the root (the last committed token
the target has not consumed yet); real nodes form the prefix ``0..n-1`` in topological
order (parents first); the rest is padding::

        0 (root)            tokens  = [r, a, b, c, -, -]
       / \\                 parents = [-1, 0, 0, 1, -1, -1]
      1   2                 depths  = [0, 1, 1, 2, 0, 0]
      |                     valid   = [T, T, T, T, F, F]
      3

Everything here except the host constructor, ``validate`` and ``render`` is a pure
function of arrays, jittable and vmappable over a batch of trees.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class DraftTree:
    """A draft tree with N slots (root included).

    Attributes:
      tokens: int32 [N], token of each node; slot 0 is the root.
      parents: int32 [N], parent slot; -1 for the root and padding.
      depths: int32 [N], root 0, child = parent + 1, padding 0.
      valid: bool [N], real node (True) or padding.
    """

    tokens: jax.Array
    parents: jax.Array
    depths: jax.Array
    valid: jax.Array

    @property
    def num_slots(self) -> int:
        return self.tokens.shape[-1]


def make_tree(
    tokens: Sequence[int], parents: Sequence[int], num_slots: int | None = None
) -> DraftTree:
    """Builds a tree on the host from Python lists of its real nodes and pads it.

    Args:
      tokens: token of each real node, root first.
      parents: parent slot of each real node; ``parents[0]`` must be -1.
      num_slots: N, the padded size (default: the number of real nodes).

    Returns:
      A validated ``DraftTree`` with N slots.
    """
    n = len(tokens)
    if len(parents) != n:
        raise ValueError(f"tokens has {n} entries but parents has {len(parents)}")
    if n == 0:
        raise ValueError("a tree needs at least the root node")
    num_slots = n if num_slots is None else num_slots
    if num_slots < n:
        raise ValueError(f"num_slots={num_slots} is smaller than the {n} real nodes")
    tokens_N = np.zeros(num_slots, np.int32)
    parents_N = np.full(num_slots, -1, np.int32)
    depths_N = np.zeros(num_slots, np.int32)
    tokens_N[:n] = tokens
    parents_N[:n] = parents
    for i in range(1, n):
        p = parents_N[i]
        if not 0 <= p < i:
            raise ValueError(
                f"slot {i}: parent {p} must satisfy 0 <= parent < slot (parents first)"
            )
        depths_N[i] = depths_N[p] + 1
    valid_N = np.arange(num_slots) < n
    tree = DraftTree(
        jnp.asarray(tokens_N), jnp.asarray(parents_N), jnp.asarray(depths_N), jnp.asarray(valid_N)
    )
    validate(tree)
    return tree


def validate(tree: DraftTree, horizon: int | None = None) -> None:
    """Checks the invariants of docs/design.md §2 on the host.

    Args:
      tree: a single (unbatched) tree.
      horizon: H, the deepest allowed depth, or None for no limit.

    Raises:
      ValueError: naming the first broken rule.
    """
    tokens, parents, depths, valid = (
        np.asarray(x) for x in (tree.tokens, tree.parents, tree.depths, tree.valid)
    )
    if tokens.ndim != 1:
        raise ValueError(f"expected an unbatched tree with [N] fields, got tokens {tokens.shape}")
    shapes = {f: np.shape(x) for f, x in zip(("tokens", "parents", "depths", "valid"),
                                             (tokens, parents, depths, valid))}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"tree fields must all have shape [N], got {shapes}")
    n_slots = tokens.shape[0]
    if n_slots == 0:
        raise ValueError("a tree needs at least one slot (the root)")
    if not valid[0]:
        raise ValueError("rule 1: slot 0 must be valid (it is the root)")
    if parents[0] != -1 or depths[0] != 0:
        raise ValueError("rule 1: slot 0 is the root: parent -1 and depth 0")
    n = int(valid.sum())
    if not valid[:n].all():
        raise ValueError(f"rule 1: valid slots must form a prefix 0..n-1, got valid={valid}")
    if (parents[n:] != -1).any() or (depths[n:] != 0).any():
        raise ValueError("padding slots must have parent -1 and depth 0")
    children = {}
    for i in range(1, n):
        p = int(parents[i])
        if not 0 <= p < i:
            raise ValueError(
                f"rule 2: slot {i} has parent {p}; need 0 <= parent < slot (topological order)"
            )
        if depths[i] != depths[p] + 1:
            raise ValueError(
                f"rule 3: slot {i} has depth {depths[i]} but its parent {p} has depth {depths[p]}"
            )
        if horizon is not None and depths[i] > horizon:
            raise ValueError(f"rule 3: slot {i} has depth {depths[i]} > horizon {horizon}")
        key = (p, int(tokens[i]))
        if key in children:
            raise ValueError(
                f"rule 4: slots {children[key]} and {i} are siblings (parent {p}) "
                f"with the same token {tokens[i]}"
            )
        children[key] = i


def ancestor_mask(tree: DraftTree) -> jax.Array:
    """``anc[i, j]`` = slot j is slot i or one of its ancestors; bool [N, N].

    This is also the attention mask of the tree verify pass. Padding slots see only
    themselves. Computed by pointer doubling: ceil(log2 N) rounds of gathers.
    """
    n = tree.num_slots
    slots = jnp.arange(n)
    jump_N = jnp.where(tree.parents >= 0, tree.parents, slots)
    anc_NN = (slots[:, None] == slots[None, :]) | (jump_N[:, None] == slots[None, :])
    for _ in range(max(n - 1, 1).bit_length()):
        anc_NN = anc_NN | anc_NN[jump_N]
        jump_N = jump_N[jump_N]
    return anc_NN


def node_paths(tree: DraftTree, horizon: int, anc_NN: jax.Array | None = None) -> jax.Array:
    """Path of every node: its ancestors by depth, root first; int32 [N, H+1], -1 padded.

    ``paths[i, d]`` is the ancestor of slot i at depth d (slot i itself at its own
    depth). The path length of slot i is ``depths[i] + 1``; padding rows are all -1.
    """
    anc_NN = ancestor_mask(tree) if anc_NN is None else anc_NN
    levels = jnp.arange(horizon + 1)
    at_depth_NDN = anc_NN[:, None, :] & (tree.depths[None, None, :] == levels[None, :, None])
    slot_ND = jnp.argmax(at_depth_NDN, axis=-1).astype(jnp.int32)
    on_path_ND = tree.valid[:, None] & (levels[None, :] <= tree.depths[:, None])
    return jnp.where(on_path_ND, slot_ND, -1)


def path_to(tree: DraftTree, node: jax.Array, horizon: int) -> jax.Array:
    """Path of one node (slot index, traced is fine): int32 [H+1], -1 padded.

    The H parent lookups are unrolled (not a loop): a chain of scalar gathers that the
    GPU compiler fuses into one kernel, where a loop launched three per step.
    """
    slot = jnp.asarray(node, jnp.int32)
    steps = [slot]
    for _ in range(horizon):
        slot = jnp.where(slot >= 0, tree.parents[jnp.maximum(slot, 0)], -1)
        steps.append(slot)
    rev_path = jnp.stack(steps)
    # rev_path = [node, parent, ..., root, -1, ...]; put it root first.
    depth = tree.depths[node]
    idx = depth - jnp.arange(horizon + 1)
    return jnp.where(idx >= 0, rev_path[jnp.clip(idx, 0, horizon)], -1)


def children_mask(tree: DraftTree) -> jax.Array:
    """``child[..., i, j]`` = slot j is a (valid) child of slot i; bool [..., N, N]
    (leading axes of batched trees kept)."""
    slots = jnp.arange(tree.num_slots)
    return (tree.parents[..., None, :] == slots[:, None]) & tree.valid[..., None, :]


def render(
    tree: DraftTree,
    decode=None,
    annotations: dict[str, Sequence[float]] | None = None,
) -> str:
    """Draws a tree as indented text, one node per line.

    Args:
      tree: a single tree.
      decode: optional ``token id -> str`` for readable tokens.
      annotations: optional ``name -> per-slot values`` printed beside each node,
        e.g. ``{"P": reach, "w": exit_weights}``.
    """
    tokens, parents, valid = (np.asarray(x) for x in (tree.tokens, tree.parents, tree.valid))
    n = int(valid.sum())
    kids: dict[int, list[int]] = {i: [] for i in range(n)}
    for i in range(1, n):
        kids[int(parents[i])].append(i)
    lines = []

    def label(i):
        tok = decode(int(tokens[i])) if decode else str(int(tokens[i]))
        notes = "  ".join(f"{k}={float(v[i]):.4f}" for k, v in (annotations or {}).items())
        return f"[{i}] {tok!r}" + (f"  {notes}" if notes else "")

    def walk(i, prefix, last, is_root):
        if is_root:
            lines.append(label(i))
            child_prefix = ""
        else:
            lines.append(prefix + ("└─ " if last else "├─ ") + label(i))
            child_prefix = prefix + ("   " if last else "│  ")
        for k, c in enumerate(kids[i]):
            walk(c, child_prefix, k == len(kids[i]) - 1, False)

    walk(0, "", True, True)
    return "\n".join(lines)
