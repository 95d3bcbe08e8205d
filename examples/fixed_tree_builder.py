"""A fixed-shape draft tree (Medusa / SpecInfer style) plugged into `engine.generate`.

A `tev_jax.extensions.TreeBuilder` maps one row's draft logits [H, V] and its root
token to a `DraftTree`. This one has a shape fixed ahead of time: node i is the
``RANKS[i]``-th most likely token of its depth's draft row, under parent
``PARENTS[i]``::

    root ── r0 ── r0 ── r0          depth 1: ranks 0, 1, 2 of row 1
         │     └─ r1                depth 2: ranks 0, 1 under the best, 0 under the second
         ├─ r1 ── r0                depth 3: rank 0 under the best path
         └─ r2

Siblings have distinct ranks, so they carry distinct tokens (rule 4 of the tree
contract); the tree has the same N = 8 slots every round, so the engine compiles once.
At temperature 0 any lossless verifier makes the output equal to autoregressive
greedy decoding, which `main` checks on the bundled models.

Run: ``python examples/fixed_tree_builder.py`` from any folder (or ``python -m examples.fixed_tree_builder``
from the repository root).
"""

from __future__ import annotations

from tev_jax.runtime.platforms import quiet_start

if __name__ == "__main__":
    quiet_start()  # before jax is imported: the CPU where no accelerator is attached, quietly

import argparse  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from tev_jax import decode, engine
from tev_jax.models import load_bundled  # noqa: E402
from tev_jax.tree import DraftTree  # noqa: E402

PARENTS = (-1, 0, 0, 0, 1, 1, 2, 4)
RANKS = (0, 0, 1, 2, 0, 1, 0, 0)


def _depths(parents: tuple[int, ...], ranks: tuple[int, ...]) -> np.ndarray:
    """Depth of every node; ValueError unless the shape is a valid tree contract."""
    if len(parents) != len(ranks) or not parents or parents[0] != -1:
        raise ValueError("parents and ranks need one entry per node, root first (parent -1)")
    depths = np.zeros(len(parents), np.int32)
    seen = set()
    for i, (p, r) in enumerate(zip(parents[1:], ranks[1:]), start=1):
        if not 0 <= p < i:
            raise ValueError(f"node {i}: parent {p} must come before it")
        if (p, r) in seen:
            raise ValueError(f"node {i}: two children of node {p} have rank {r}")
        seen.add((p, r))
        depths[i] = depths[p] + 1
    return depths


def fixed_tree_builder(draft_logits_HV: jax.Array, root_token: jax.Array, *,
                       parents: tuple[int, ...] = PARENTS,
                       ranks: tuple[int, ...] = RANKS) -> DraftTree:
    """The fixed-shape tree of one row: node i = rank ``ranks[i]`` of row ``depth(i)``.

    Args:
      draft_logits_HV: float32 [H, V] draft logits (row d-1 is depth d).
      root_token: int32 [], the root.
      parents, ranks: the static shape (tuples, so the builder stays hashable).

    Returns:
      A `DraftTree` with N = len(parents) slots, all valid.
    """
    depths_N = _depths(parents, ranks)
    horizon, vocab = draft_logits_HV.shape
    if depths_N.max() > horizon or max(ranks) >= vocab:
        raise ValueError(f"the fixed tree needs depth <= H = {horizon} and ranks < V = {vocab}")
    top_HK = jax.lax.top_k(draft_logits_HV, max(ranks) + 1)[1]
    rows, cols = np.maximum(depths_N - 1, 0), np.asarray(ranks)
    tokens_N = jnp.where(depths_N > 0, top_HK[rows, cols], jnp.asarray(root_token))
    return DraftTree(tokens=tokens_N.astype(jnp.int32),
                     parents=jnp.asarray(parents, jnp.int32),
                     depths=jnp.asarray(depths_N),
                     valid=jnp.ones(len(parents), bool))


def main(max_new_tokens: int = 48, prompt: str = "def fibonacci(n):") -> dict:
    """Decodes ``prompt`` with the fixed tree and with plain AR decoding (T = 0)."""
    target, drafter, tokenizer = load_bundled()
    ids = [tokenizer.encode(prompt).ids]
    config = decode.DecodeConfig(max_new_tokens=max_new_tokens,
                                 builder=fixed_tree_builder,
                                 verifier="tev")
    spec = engine.generate(target, drafter, ids, config)
    ar = engine.generate_ar(target, ids, config)
    same = spec.rows() == ar.rows()
    print(f"fixed tree (N = {len(PARENTS)}): tau = {spec.stats.tau:.2f} tokens per round, "
          f"output equal to AR greedy: {same}")
    print(repr(tokenizer.decode(spec.rows()[0])))
    return {"same": same, "tau": spec.stats.tau, "tokens": spec.rows()[0]}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--prompt", default="def fibonacci(n):")
    a = p.parse_args()
    main(a.max_new_tokens, a.prompt)
