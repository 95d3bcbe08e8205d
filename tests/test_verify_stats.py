"""Statistical exactness of the verifiers: chi-square on (exit node, bonus token).

For a verifier to be exact, ``Pr(exit v, bonus y) = P(v) * p_v(y)`` for every y that
is not a child token of v, and 0 otherwise. The expected table comes from
``reference.brute_force_joint`` (float64 enumeration of target continuations), not from
the library; the statistic is the public harness's (``tev_jax.testing.chi_square``, the
test behind ``check_lossless``).

Protocol (fixed seeds, so every run is the same):
- 10^5 vmapped draws per (verifier, sampling, tree), five tree shapes padded to N = 8
  slots over V = 6 tokens, four samplings (one for the naive Gumbel predraw).
- Cells whose expected count is below 5 are pooled into one cell. Cells that are
  impossible under the exact law (expected probability 0) are checked apart: a float32
  verifier may land there only through rounding (~1e-7 per draw), so more than 3 hits
  in 10^5 draws is a failure.
- Pass when the chi-square p-values of the (exit, bonus) table and of the exit nodes
  alone both exceed ALPHA / 2, ALPHA = 1e-4. There are 13 exactness
  configurations x 5 trees + 1 = 66 tests here, so by Bonferroni the chance that an
  exact verifier fails any of them is at most 66 * 1e-4 = 0.7%.
- Negative controls, each a verifier with one deliberate bug, must be rejected by the
  same test wherever their law differs from the exact one by a total
  variation of at least 0.01; this shows the test has power.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tev_jax import testing, verify, vocab
from tev_jax.exit_law import exit_law
from tev_jax.sampling import Sampling
from tev_jax.testing import reference as ref
from tev_jax.tree import make_tree
from tev_jax.vocab import Scores, target_scores

N, V, H = 8, 6, 3
DRAWS = 100_000
ALPHA = 1e-4
SAMPLINGS = {
    "T0.5": Sampling(0.5),
    "T1": Sampling(1.0),
    "topk3": Sampling(1.0, top_k=3),
    "topp0.8": Sampling(1.0, top_p=0.8),
}


def _shapes():
    """Five trees (tokens, parents) with logits that give their edges real mass."""
    rng = np.random.default_rng(2024)
    out = {}

    def base():
        return rng.standard_normal((N, V)).astype(np.float32)

    out["root_only"] = ([3], [-1], base())
    x = base()
    x[0, 1] += 1.5
    x[1, 2] += 1.5
    x[2, 0] += 1.0
    out["chain"] = ([4, 1, 2, 0], [-1, 0, 1, 2], x)
    x = base()
    x[0, [1, 2, 3, 4]] += [1.0, 0.5, 0.0, 2.0]
    out["star"] = ([0, 1, 2, 3, 4], [-1, 0, 0, 0, 0], x)
    # The root's children carry every token: rho(root) = 0 under every sampling.
    x = base()
    x[2, 5] += 1.0
    out["full_cover"] = ([0, 0, 1, 2, 3, 4, 5, 5], [-1, 0, 0, 0, 0, 0, 0, 3], x)
    # Edges of probability ~1e-6 and ~1 - 1e-6 (at T = 1), with subtrees below.
    x = np.zeros((N, V), np.float32)
    x[0] = [-2.0, 0.2, 14.0, -2.0, -2.0, -2.0]
    x[1] = base()[1]
    x[2] = [5.0, 0.0, 0.0, -8.8, 1.0, 0.0]
    x[3] = base()[3]
    out["tiny_mass"] = ([0, 1, 2, 3, 0], [-1, 0, 0, 2, 2], x)
    return out


SHAPES = _shapes()
NAMES = list(SHAPES)


def _batch():
    trees = [make_tree(t, p, N) for t, p, _ in SHAPES.values()]
    batch = jax.tree.map(lambda *x: jnp.stack(x), *trees)
    logits = np.stack([x for _, _, x in SHAPES.values()])
    return batch, logits


BATCH, LOGITS = _batch()


@functools.lru_cache(maxsize=None)
def _reference(name, sampling):
    tokens, parents, logits = SHAPES[name]
    n = len(tokens)
    logp = ref.log_probs(logits[:n], sampling.temperature, sampling.top_k, sampling.top_p)
    return ref.brute_force_joint(tokens, parents, logp), logp


def _draw(verifier, sampling, seed):
    """(exit, bonus, length) [trees, DRAWS] for every tree shape, one compilation."""
    fn = functools.partial(verifier, sampling=sampling, horizon=H)
    per_tree = jax.vmap(fn, in_axes=(0, None, None))
    run = jax.jit(jax.vmap(per_tree, in_axes=(None, 0, 0)))
    keys = jax.random.split(jax.random.key(seed), DRAWS)
    out = run(keys, BATCH, LOGITS)
    return np.asarray(out.exit_node), np.asarray(out.bonus), np.asarray(out.length)


def _exact(exits, bonuses, joint):
    report = testing.chi_square(exits, bonuses, joint, alpha=ALPHA)
    return report.passed, (report.p_value, report.impossible_hits)


VERIFIERS = {
    "tev": verify.tev,
    "predraw": verify.predraw,
    "predraw_gumbel": functools.partial(verify.predraw, method="gumbel"),
    "sequential_residual": verify.sequential_residual,
}


CONFIGS = [(v, s) for v in VERIFIERS for s in SAMPLINGS if v != "predraw_gumbel"] + [
    ("predraw_gumbel", "topk3"),  # the naive predraw, kept as the benchmark's baseline
]


@pytest.mark.parametrize("vname,sname", CONFIGS)
def test_verifier_is_exact(vname, sname):
    sampling = SAMPLINGS[sname]
    seed = 1000 * list(VERIFIERS).index(vname) + list(SAMPLINGS).index(sname)
    exits, bonuses, lengths = _draw(VERIFIERS[vname], sampling, seed)
    failures = []
    for t, name in enumerate(NAMES):
        joint, _ = _reference(name, sampling)
        ok, detail = _exact(exits[t], bonuses[t], joint)
        if not ok:
            failures.append((name, detail))
        # E[block length] = 1 + coverage, within 5 standard errors.
        depth = np.asarray(BATCH.depths[t])[: joint.shape[0]]
        mean = (joint.sum(-1) * (depth + 1)).sum()
        var = max((joint.sum(-1) * (depth + 1) ** 2).sum() - mean**2, 0.0)
        se = np.sqrt(var / DRAWS) + 1e-9
        if abs(lengths[t].mean() - mean) > 5 * se:
            failures.append((name, "mean length", lengths[t].mean(), mean))
    assert not failures, failures


# ----------------------------------------------------------------------------- controls


def _tev_bonus_from_full(key, tree, logits, sampling, *, horizon):
    """Bug: the bonus is drawn from p_exit, child tokens included."""
    u = vocab.uniform(key, (2,))
    w = exit_law(tree, logits, sampling).w
    exit_node = vocab.inverse_cdf(u[:1], Scores(jnp.log(w)[None], 1.0))[0]
    scores = target_scores(logits, sampling)
    row = Scores(scores.x[exit_node][None], scores.scale)
    bonus = vocab.inverse_cdf(u[1:], row)[0]
    return verify._verdict(tree, exit_node, bonus, horizon)


def _tev_exit_from_reach(key, tree, logits, sampling, *, horizon):
    """Bug: the exit node is drawn from P (normalised) instead of w."""
    u = vocab.uniform(key, (2,))
    reach = exit_law(tree, logits, sampling).reach
    exit_node = vocab.inverse_cdf(u[:1], Scores(jnp.log(reach)[None], 1.0))[0]
    bonus = verify._residual_draw(u[1], tree, target_scores(logits, sampling), exit_node)
    return verify._verdict(tree, exit_node, bonus, horizon)


def _biased_joint(kind, name, sampling):
    """float64 law of a buggy verifier, to know where it differs from the exact one."""
    joint, logp = _reference(name, sampling)
    tokens, parents, _ = SHAPES[name]
    reach, _, w, _ = ref.exit_law_loops(tokens, parents, logp)
    p = np.exp(logp)
    if kind == "bonus_from_full":
        return w[:, None] * p
    resid = np.stack(
        [ref.residual(tokens, parents, logp, v) for v in range(len(tokens))]
    )
    resid /= resid.sum(-1, keepdims=True)
    return (reach / reach.sum())[:, None] * resid


@pytest.mark.parametrize(
    "kind,verifier",
    [("bonus_from_full", _tev_bonus_from_full), ("exit_from_reach", _tev_exit_from_reach)],
)
def test_negative_controls_are_rejected(kind, verifier):
    sampling = SAMPLINGS["topk3"]
    exits, bonuses, _ = _draw(verifier, sampling, seed=77)
    differs = 0
    for t, name in enumerate(NAMES):
        joint, _ = _reference(name, sampling)
        tv = 0.5 * np.abs(_biased_joint(kind, name, sampling) - joint).sum()
        ok, detail = _exact(exits[t], bonuses[t], joint)
        if tv >= 0.01:
            differs += 1
            assert not ok, (name, tv, detail)
    assert differs >= 3


# A case where the coin boundary matters: uniforms on the grid {0, 1/4, 1/2, 3/4}, and
# coin probabilities that are exactly 0 and 1/2 (children of probability 0 and 1/2).
# Every probability is then a multiple of 1/4, so the exact verifier is still exact on
# this grid, while `<=` accepts the probability-0 child whenever u = 0 (1/4 of the
# time) and the probability-1/2 child with probability 3/4.
_COIN_TREE = make_tree([0, 2, 0, 1], [-1, 0, 0, 2], N)
_COIN_LOGITS = np.tile(np.array([0.0, 0.0] + [-np.inf] * (V - 2), np.float32), (N, 1))


@pytest.mark.parametrize("strict", [True, False])
def test_coin_boundary(strict):
    sampling = Sampling(1.0)
    core = functools.partial(
        verify._sequential_residual, sampling=sampling, horizon=H, strict=strict
    )
    u = jax.random.randint(jax.random.key(5), (DRAWS, N + 1), 0, 4).astype(jnp.float32) / 4
    out = jax.jit(jax.vmap(core, in_axes=(0, None, None)))(u, _COIN_TREE, _COIN_LOGITS)
    joint = ref.brute_force_joint(
        [0, 2, 0, 1], [-1, 0, 0, 2], ref.log_probs(_COIN_LOGITS[:4], 1.0)
    )
    ok, detail = _exact(np.asarray(out.exit_node), np.asarray(out.bonus), joint)
    assert ok == strict, detail
