"""The public exactness harness (`tev_jax.testing`): its reference law, its statistic,
its wiring (draws, consistency of paths, errors) and its import without hypothesis.

The statistic's power against biased verifiers is tested in test_verify_stats (negative
controls) and measured in experiments/lossless_power.
"""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from scipy import stats

from tev_jax import testing, verify
from tev_jax.sampling import Sampling
from tev_jax.testing import reference as ref
from tev_jax.testing import strategies as tst
from tev_jax.tree import make_tree

ROOT = pathlib.Path(__file__).resolve().parent.parent
H = 3
TREE = make_tree([0, 1, 2, 3, 0], [-1, 0, 0, 2, 2], 8)
LOGITS = np.random.default_rng(0).standard_normal((8, 6)).astype(np.float32)
T1 = Sampling(1.0)


@settings(max_examples=40, deadline=None)
@given(tst.tree_lists(max_nodes=6, vocab=4, max_depth=3),
       tst.logits(num_slots=6, vocab=4))
def test_exact_joint_is_the_enumerated_law(tree_lists, logits):
    tokens, parents = tree_lists
    n = len(tokens)
    logp = ref.log_probs(logits[:n], 1.0)
    np.testing.assert_allclose(ref.exact_joint(tokens, parents, logp),
                               ref.brute_force_joint(tokens, parents, logp), atol=1e-12)


def test_p_value_is_the_chi_square_survival_function():
    joint = testing.exact_law(TREE, LOGITS, T1)
    rng = np.random.default_rng(1)
    cells = rng.choice(joint.size, size=5000, p=joint.ravel())
    exits, bonuses = np.divmod(cells, joint.shape[1])
    report = testing.chi_square(exits, bonuses, joint)
    want = stats.chi2.sf(report.statistic, report.dof)
    assert report.dof > 5 and report.inconsistent == 0
    np.testing.assert_allclose(report.p_value, want, rtol=1e-4)
    # A table from another law is rejected; out-of-range draws are inconsistent.
    skewed = testing.chi_square(np.zeros(5000, int), bonuses, joint)
    assert not skewed.passed and skewed.p_value < 1e-4
    assert testing.chi_square(exits + 5, bonuses, joint).inconsistent == 5000


def test_check_lossless_passes_tev_and_rejects_a_biased_verifier():
    report = testing.assert_lossless(verify.tev, TREE, LOGITS, T1, horizon=H,
                                     num_draws=20_000, seed=3)
    assert report.passed and report.num_draws == 20_000 and report.dof > 5

    def bonus_anywhere(key, tree, logits, sampling, *, horizon):
        v = verify.tev(key, tree, logits, sampling, horizon=horizon)
        return v.replace(bonus=jax.random.categorical(key, logits[v.exit_node]))

    with pytest.raises(AssertionError, match="not lossless.*impossible hits"):
        testing.assert_lossless(bonus_anywhere, TREE, LOGITS, T1, horizon=H,
                                num_draws=20_000)


def test_a_wrong_path_is_inconsistent():
    """The (exit, bonus) law of TEV with the path cut to the root: only the consistency
    check can see it."""
    def root_path(key, tree, logits, sampling, *, horizon):
        v = verify.tev(key, tree, logits, sampling, horizon=horizon)
        return v.replace(path=jnp.full((horizon + 1,), -1, jnp.int32).at[0].set(0))

    report = testing.check_lossless(root_path, TREE, LOGITS, T1, horizon=H, num_draws=5000)
    assert report.p_value > 1e-4 and report.inconsistent > 1000 and not report.passed


def test_bad_inputs_raise_value_errors():
    check = functools.partial(testing.check_lossless, horizon=H, num_draws=100)
    with pytest.raises(ValueError, match=r"shape \[N, V\] = \[8, V\]"):
        check(verify.tev, TREE, LOGITS[:4], T1)
    with pytest.raises(ValueError, match="NaN"):
        check(verify.tev, TREE, np.where(np.eye(8, 6) > 0, np.nan, LOGITS), T1)
    with pytest.raises(ValueError, match="rule 3"):
        testing.check_lossless(verify.tev, TREE, LOGITS, T1, horizon=1)
    with pytest.raises(ValueError, match="num_draws"):
        check(verify.tev, TREE, LOGITS, T1, num_draws=0)
    with pytest.raises(ValueError, match="must return a tev_jax.verify.Verdict"):
        check(lambda k, t, x, s, *, horizon: t.tokens, TREE, LOGITS, T1)
    with pytest.raises(ValueError, match=r"path \[H\+1\] = \[4\]"):
        check(lambda k, t, x, s, *, horizon: verify.tev(k, t, x, s, horizon=horizon + 1),
              TREE, LOGITS, T1)


def test_import_without_hypothesis():
    code = ("import sys; sys.modules['hypothesis'] = None; import tev_jax.testing as t; "
            "assert 'tev_jax.testing.strategies' not in sys.modules; print(t.check_lossless)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"), cwd=ROOT)
    assert out.returncode == 0, out.stderr
