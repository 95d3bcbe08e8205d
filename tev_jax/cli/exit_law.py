"""``tev-jax exit-law [--demo]``: an example tree, its exit law and some TEV draws."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from tev_jax.cli import flags

if TYPE_CHECKING:
    import numpy as np

# The demo tree: the last committed word is "the"; the drafter proposed these
# continuations (slot order = a best-first builder's order).
_DEMO_WORDS = ["the", "cat", "dog", "sat", "ran", "on", "mat", "away", "a", "end"]
_DEMO_TOKENS = [0, 1, 2, 3, 4, 3, 5, 7, 0]
_DEMO_PARENTS = [-1, 0, 0, 1, 1, 2, 3, 4, 6]
#   the ─┬─ cat ─┬─ sat ── on ── the
#        │       └─ ran ── away
#        └─ dog ── sat


def _demo_logits(seed: int) -> np.ndarray:
    """Target logits that put most (not all) mass on the drafted continuations."""
    import numpy as np

    rng = np.random.default_rng(seed)
    n, vocab = len(_DEMO_TOKENS), len(_DEMO_WORDS)
    logits = rng.normal(0.0, 0.5, (n, vocab)).astype(np.float32)
    for i in range(1, n):
        logits[_DEMO_PARENTS[i], _DEMO_TOKENS[i]] += 2.5
    return logits


def exit_law_demo(args) -> int:
    """``tev-jax exit-law --demo``: an example tree, its exit law and some TEV draws."""
    import jax
    import numpy as np
    from tev_jax.exit_law import exit_law
    from tev_jax.sampling import check_finite
    from tev_jax.tree import make_tree, render
    from tev_jax.verify import tev

    flags.at_least_one(args, "--draws")
    if args.show < 0:
        raise ValueError(f"--show must be >= 0, got {args.show}")
    sampling = flags.sampling_from(args)
    tree = make_tree(_DEMO_TOKENS, _DEMO_PARENTS)
    horizon = int(np.asarray(tree.depths).max())
    logits = _demo_logits(args.seed)
    check_finite(logits)
    law = jax.jit(exit_law, static_argnames="sampling")(tree, logits, sampling)
    word = _DEMO_WORDS.__getitem__
    print(f"Draft tree over a {len(_DEMO_WORDS)}-word vocabulary, target {sampling}:")
    print("  P = reach, rho = local exit, w = exit weight = P * rho\n")
    print(render(tree, decode=word, annotations={"P": law.reach, "rho": law.rho, "w": law.w}))
    print(f"\nsum w = {float(law.w.sum()):.6f}   coverage C = {float(law.coverage):.4f}   "
          f"expected block length 1 + C = {float(law.expected_length):.4f}")

    draw = jax.jit(jax.vmap(functools.partial(tev, sampling=sampling, horizon=horizon),
                            in_axes=(0, None, None)))
    keys = jax.random.split(jax.random.key(args.seed), max(args.draws, 1))
    verdicts = jax.device_get(draw(keys, tree, logits))
    tokens = np.asarray(tree.tokens)
    print(f"\nTEV draws (exit ~ w, bonus from the exit's residual), seed {args.seed}:")
    for b in range(min(args.show, args.draws)):
        path = [int(s) for s in verdicts.path[b] if s >= 0]
        block = [word(int(tokens[s])) for s in path[1:]] + [f"[{word(int(verdicts.bonus[b]))}]"]
        print(f"  exit slot {int(verdicts.exit_node[b])}: {' '.join(block)}")
    print(f"\nmean block length over {args.draws} draws = {verdicts.length.mean():.4f} "
          f"(exact: {float(law.expected_length):.4f})")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("exit-law", help="show the canonical exit law of a draft tree")
    p.add_argument("--demo", action="store_true",
                   help="use the built-in example tree and synthetic target logits "
                        "(the default, and the only tree this command shows)")
    flags.add_sampling_flags(p, temperature=1.0)
    p.add_argument("--draws", type=int, default=10_000, help="TEV draws for the mean length")
    p.add_argument("--show", type=int, default=5, help="how many draws to print")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the synthetic logits and the draws (default %(default)s)")
    p.set_defaults(func=exit_law_demo)
