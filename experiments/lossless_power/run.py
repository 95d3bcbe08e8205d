"""Power of the exactness harness (`tev_jax.testing.check_lossless`) against small errors.

A verifier at total variation ``tv`` from the exact law is made as a mixture: TEV with
probability ``1 - eps`` and a biased verifier with probability ``eps``, so its law is
``(1 - eps) J + eps J_bug`` and ``tv = eps * TV(J_bug, J)`` exactly (both laws in
float64 from `tev_jax.testing.reference`). Two biases, each a real bug class:

- ``bonus_from_full``: the exit is drawn from ``w`` but the bonus from the full ``p_exit``
  (child tokens included): mass moves into impossible cells;
- ``exit_from_reach``: the exit is drawn from the normalised reach ``P`` instead of ``w``,
  the bonus from the right residual: mass moves between possible cells only.

For every (tree, bias, tv) the harness's test (`tev_jax.testing.chi_square`, the one
`check_lossless` runs, at its defaults: 10^5 draws, alpha = 1e-4, 3 impossible hits) is
run on ``--trials`` independent blocks of draws; the table is the rejection rate. tv = 0
is the exact verifier (the false-rejection rate, expected ~alpha).

    python -m experiments.lossless_power.run            # -> results.json, README table
    python -m experiments.lossless_power.run --trials 5 --no-bundled
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

from tev_jax.runtime.platforms import quiet_start

if __name__ == "__main__":
    quiet_start()  # before jax is imported: no libtpu or CUDA plugin lines on a CPU

import jax
import jax.numpy as jnp
import numpy as np

from examples import custom_verifier
from examples.custom_verifier import verdict, without_children
from tev_jax import testing, verify, vocab
from tev_jax.exit_law import exit_law
from tev_jax.sampling import Sampling, log_probs
from tev_jax.testing import reference as ref
from tev_jax.tree import make_tree
from tev_jax.vocab import Scores

HERE = Path(__file__).resolve().parent
DRAWS = 100_000
TVS = (0.0, 0.002, 0.005, 0.01, 0.02)
SAMPLING = Sampling(1.0)


def biased(key, tree, logits_NV, sampling, *, horizon, bug):
    """One of the two biased verifiers (see the module docstring)."""
    k_exit, k_bonus = jax.random.split(key)
    law = exit_law(tree, logits_NV, sampling)
    logp_NV = log_probs(logits_NV, sampling)
    weights = law.w if bug == "bonus_from_full" else jnp.where(tree.valid, law.reach, 0.0)
    exit_node = jax.random.categorical(k_exit, jnp.log(weights)).astype(jnp.int32)
    row_V = logp_NV[exit_node] if bug == "bonus_from_full" else without_children(
        tree, logp_NV, exit_node)
    # The library's blocked inverse CDF: one uniform per draw, not V Gumbel numbers.
    bonus = vocab.inverse_cdf(jax.random.uniform(k_bonus, (1,)), Scores(row_V[None], 1.0))[0]
    return verdict(tree, exit_node, bonus, horizon)


def mixture(key, tree, logits_NV, sampling, *, horizon, bug, eps):
    """TEV with probability 1 - eps, the biased verifier with probability eps."""
    k_coin, k_exact, k_bug = jax.random.split(key, 3)
    exact = verify.tev(k_exact, tree, logits_NV, sampling, horizon=horizon)
    wrong = biased(k_bug, tree, logits_NV, sampling, horizon=horizon, bug=bug)
    use_bug = jax.random.uniform(k_coin) < eps
    return jax.tree.map(lambda a, b: jnp.where(use_bug, b, a), exact, wrong)


def bug_law(bug, tree, logits_NV):
    """float64 [n, V] law of the biased verifier."""
    tokens, parents, n = ref.host_tree(tree)
    logp = ref.log_probs(np.asarray(logits_NV)[:n], SAMPLING.temperature)
    reach, _, w, _ = ref.exit_law_loops(tokens, parents, logp)
    if bug == "bonus_from_full":
        return w[:, None] * np.exp(logp)
    resid = np.stack([ref.residual(tokens, parents, logp, v) for v in range(n)])
    return (reach / reach.sum())[:, None] * resid / resid.sum(-1, keepdims=True)


def synthetic_trees():
    """Small trees with logits that give their edges real mass (V = 6 and V = 32)."""
    rng = np.random.default_rng(2024)
    x = rng.standard_normal((8, 6)).astype(np.float32)
    x[0, [1, 2, 3, 4]] += [1.0, 0.5, 0.0, 2.0]
    star = (make_tree([0, 1, 2, 3, 4], [-1, 0, 0, 0, 0], 8), x, 3)
    parents = [-1, 0, 0, 0, 1, 1, 2, 4, 4, 7, 3, 10, 0, 12, 9, 6]
    tokens = [5, 3, 7, 1, 2, 9, 3, 4, 8, 0, 6, 11, 12, 5, 1, 2]
    y = (rng.standard_normal((16, 32)) * 1.5).astype(np.float32)
    for i, p in enumerate(parents[1:], start=1):
        y[p, tokens[i]] += 2.0  # the drafted children are likely under the target
    deep = (make_tree(tokens, parents, 16), y, 5)
    return {"star_N8_V6": star, "tree_N16_V32": deep}


def bundled_tree():
    """The bundled models' DDTree (budget 8) for one prompt and its target logits."""
    tree, logits, horizon = custom_verifier.bundled_tree("def fibonacci(n):", 8)
    return {"bundled_N9_V4096": (tree, logits, horizon)}


def rejection_rate(tree, logits, horizon, bug, eps, trials, seed):
    verifier = functools.partial(mixture, bug=bug, eps=float(eps))
    out = testing.draw_verdicts(verifier, tree, logits, SAMPLING, horizon=horizon,
                                num_draws=trials * DRAWS, seed=seed)
    joint = testing.exact_law(tree, logits, SAMPLING)
    rejected = 0
    for t in range(trials):
        s = slice(t * DRAWS, (t + 1) * DRAWS)
        rejected += not testing.chi_square(out.exit_node[s], out.bonus[s], joint).passed
    return rejected / trials


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--no-bundled", action="store_true")
    args = p.parse_args(argv)
    trees = ({} if args.no_bundled else bundled_tree()) | synthetic_trees()
    results = []
    t0 = time.time()
    for name, (tree, logits, horizon) in trees.items():
        joint = testing.exact_law(tree, logits, SAMPLING)
        for bug in ("bonus_from_full", "exit_from_reach"):
            tv_bug = 0.5 * float(np.abs(bug_law(bug, tree, logits) - joint).sum())
            for i, tv in enumerate(TVS):
                if tv > tv_bug:
                    continue
                rate = rejection_rate(tree, logits, horizon, bug, tv / tv_bug, args.trials,
                                      seed=1000 * i + len(results))
                results.append(dict(tree=name, bug=bug, tv=tv, tv_bug=tv_bug,
                                    cells=int((joint > testing.lossless.IMPOSSIBLE).sum()),
                                    rejection_rate=rate, trials=args.trials))
                print(f"{name:18s} {bug:16s} tv={tv:<7g} rejected {rate:.2f} "
                      f"({time.time() - t0:.0f} s)", flush=True)
                (HERE / "results.json").write_text(json.dumps(  # after every point
                    dict(draws=DRAWS, alpha=1e-4, trials=args.trials, results=results),
                    indent=1))
    return results


if __name__ == "__main__":
    main()
