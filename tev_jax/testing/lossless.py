"""Is a verifier lossless? A chi-square test of its (exit node, bonus token) law.

A verifier is lossless (exact) when its output block is distributed as the target's own
continuation, i.e. for every node v and token y::

    Pr(exit v, bonus y) = P(v) * p_v(y)   if y is not the token of a child of v,
                          0               otherwise,

where ``p_v`` is the target's transformed distribution at v and ``P(v)`` the product
of the target's probabilities of the tokens on v's path. `check_lossless` draws the
verifier ``num_draws`` times on one tree (one key per draw, vmapped and jitted) and
compares the table of (exit, bonus) counts with this law, computed in float64 from the
logits by `tev_jax.testing.reference` (independently of the library's exit law).

The statistics:

- Impossible cells (exact probability <= 1e-12: child tokens, masked tokens) are
  counted apart. A float32 verifier may land there only through rounding (about
  2^-24 per draw), so more than ``max_impossible_hits`` (default 3) draws there fail.
- Two Pearson chi-square tests over the possible cells: one of the (exit, bonus)
  table, one of the exit nodes alone (a verifier that misplaces exits spreads its error
  over many (exit, bonus) cells; the exit table has only the tree's n cells, so it sees
  that error with far fewer degrees of freedom). In each, cells expecting fewer than 5
  draws are pooled into one, so that the chi-square approximation holds, and expected
  counts are rescaled to the draws that fell in possible cells; the statistic has
  ``cells - 1`` degrees of freedom, the p-value is the chi-square survival function
  (``jax.scipy.stats.chi2.sf``).
- The verifier passes when both p-values exceed ``alpha / 2`` (default alpha = 1e-4),
  at most ``max_impossible_hits`` draws are impossible, and every draw is consistent
  (exit node among the real nodes, bonus in the vocabulary, ``path`` the root-to-exit
  path, ``length`` its depth + 1). An exact verifier then fails with probability at
  most about ``alpha``; with k checks, Bonferroni bounds the chance that any fails by
  ``k * alpha``.
- Power. A law at total variation ``tv`` from the exact one gives the statistic a
  non-centrality ``D * sum (q - p)^2 / p >= D * (2 tv)^2`` (Cauchy-Schwarz; equality
  when the error is spread in proportion to ``p``): at the default D = 10^5 draws, at
  least 40 for tv = 0.01, and much more when the error sits on a few cells or on
  impossible ones. Measured at the defaults (``experiments/lossless_power``: mixtures
  of TEV and a biased verifier at a known tv, 10 trials per point, trees of 5 to 16
  nodes over V = 6 to 4096, the bundled models' DDTree included): an error that puts
  mass on impossible cells (a wrong residual) was rejected from tv = 0.002 on in every
  trial; an error that only moves mass between exit nodes (the hard case) from
  tv = 0.01 (9 or 10 of 10 trials; all at 0.02; 1 to 6 at 0.005; none at 0.002); the
  exact verifier was never rejected. The non-centrality grows linearly with
  ``num_draws``: more draws catch smaller errors.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from tev_jax.extensions import Verifier, check_hashable, check_verdict
from tev_jax.sampling import Sampling, check_finite
from tev_jax.testing import reference as ref
from tev_jax.tree import DraftTree, validate

IMPOSSIBLE = 1e-12  # exact cell probability at or below which a cell is impossible
MIN_EXPECTED = 5.0  # possible cells expecting fewer draws are pooled


@dataclasses.dataclass(frozen=True)
class LosslessReport:
    """The outcome of `check_lossless`.

    Attributes:
      statistic: the chi-square statistic of the (exit, bonus) table over the possible
        cells (pooled).
      dof: its degrees of freedom (cells after pooling - 1; 0 if one cell).
      p_value: its chi-square survival function (1.0 when ``dof == 0``).
      exit_statistic, exit_dof, exit_p_value: the same for the exit nodes alone.
      impossible_hits: draws that fell in cells of exact probability 0.
      inconsistent: draws whose exit node is outside the tree's real nodes, or whose
        ``path`` / ``length`` do not match the exit node.
      num_draws: draws made.
      alpha: the significance level.
      max_impossible_hits: the impossible hits tolerated (float32 rounding).
      tv: total variation between the observed frequencies and the exact law (a
        descriptive number: it is about ``sqrt(cells / num_draws)`` even when exact).
      passed: both p-values above ``alpha / 2``, ``impossible_hits <=
        max_impossible_hits`` and no inconsistent draw.
    """

    statistic: float
    dof: int
    p_value: float
    exit_statistic: float
    exit_dof: int
    exit_p_value: float
    impossible_hits: int
    inconsistent: int
    num_draws: int
    alpha: float
    max_impossible_hits: int
    tv: float

    @property
    def passed(self) -> bool:
        return (min(self.p_value, self.exit_p_value) > self.alpha / 2
                and self.inconsistent == 0
                and self.impossible_hits <= self.max_impossible_hits)

    def __str__(self) -> str:
        verdict = "lossless (not rejected)" if self.passed else "NOT lossless (rejected)"
        return (f"{verdict}: (exit, bonus) chi2={self.statistic:.1f} dof={self.dof} "
                f"p={self.p_value:.3g}; exit chi2={self.exit_statistic:.1f} "
                f"dof={self.exit_dof} p={self.exit_p_value:.3g} (each against "
                f"alpha/2={self.alpha / 2:g}); impossible hits "
                f"{self.impossible_hits} (max {self.max_impossible_hits}), inconsistent "
                f"{self.inconsistent}, observed TV {self.tv:.4f}, {self.num_draws} draws")


def exact_law(tree: DraftTree, target_logits_NV, sampling: Sampling) -> np.ndarray:
    """The exact (exit node, bonus) law of a lossless verifier; float64 [n, V] over the
    tree's n real nodes (`tev_jax.testing.reference.exact_joint`)."""
    tokens, parents, n = ref.host_tree(tree)
    logp = ref.log_probs(np.asarray(target_logits_NV)[:n], sampling.temperature,
                         sampling.top_k, sampling.top_p)
    return ref.exact_joint(tokens, parents, logp)


def _pearson(observed, probs) -> tuple[float, int, float]:
    """Pearson's chi-square of counts against cell probabilities: impossible cells left
    out, possible cells expecting fewer than 5 pooled into one; -> (statistic, dof, p)."""
    possible = probs > IMPOSSIBLE
    obs, expected = observed[possible], probs[possible]
    expected = expected * obs.sum() / max(expected.sum(), 1e-300)
    small = expected < MIN_EXPECTED
    if small.any():
        obs = np.append(obs[~small], obs[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    dof = expected.size - 1
    if dof < 1 or obs.sum() == 0:
        return 0.0, 0, 1.0
    stat = float(np.sum((obs - expected) ** 2 / expected))
    return stat, dof, float(jax.scipy.stats.chi2.sf(stat, dof))


def chi_square(exits, bonuses, joint, *, max_impossible_hits: int = 3,
               alpha: float = 1e-4) -> LosslessReport:
    """Tests observed (exit, bonus) draws against an exact law ``joint`` [n, V].

    Args:
      exits: int [D] exit nodes of D draws; values outside ``[0, n)`` are inconsistent.
      bonuses: int [D] bonus tokens; values outside ``[0, V)`` are inconsistent.
      joint: float64 [n, V] cell probabilities, summing to 1.
      max_impossible_hits, alpha: see the module docstring.

    Returns:
      A `LosslessReport` (``inconsistent`` counts the out-of-range draws only).
    """
    exits, bonuses = np.asarray(exits).ravel(), np.asarray(bonuses).ravel()
    joint = np.asarray(joint, np.float64)
    n, vocab = joint.shape
    draws = exits.size
    inside = (exits >= 0) & (exits < n) & (bonuses >= 0) & (bonuses < vocab)
    observed = np.bincount(exits[inside] * vocab + bonuses[inside],
                           minlength=n * vocab).astype(np.float64)
    flat = joint.reshape(-1)
    stat, dof, p_value = _pearson(observed, flat)
    exit_stat, exit_dof, exit_p = _pearson(observed.reshape(n, vocab).sum(-1), joint.sum(-1))
    return LosslessReport(
        statistic=stat, dof=dof, p_value=p_value, exit_statistic=exit_stat,
        exit_dof=exit_dof, exit_p_value=exit_p,
        impossible_hits=int(observed[flat <= IMPOSSIBLE].sum()),
        inconsistent=int((~inside).sum()), num_draws=draws, alpha=alpha,
        max_impossible_hits=max_impossible_hits,
        tv=0.5 * float(np.abs(observed / max(draws, 1) - flat).sum()))


@functools.partial(jax.jit, static_argnames=("verifier", "sampling", "horizon", "chunk"))
def _draw(keys_D, tree, target_logits_NV, *, verifier, sampling, horizon, chunk):
    one = lambda key: verifier(key, tree, target_logits_NV, sampling, horizon=horizon)
    return jax.lax.map(one, keys_D, batch_size=chunk)


def draw_verdicts(verifier: Verifier, tree: DraftTree, target_logits_NV, sampling: Sampling,
                  *, horizon: int, num_draws: int, seed: int = 0):
    """``num_draws`` verdicts of ``verifier`` on one tree, one key per draw (vmapped in
    chunks that keep about 2^24 logit-sized entries live); fields [D, ...] as numpy."""
    n, vocab = np.shape(target_logits_NV)
    chunk = int(max(1, min(num_draws, 2**24 // (n * vocab))))
    keys = jax.random.split(jax.random.key(seed), num_draws)
    out = _draw(keys, tree, jnp.asarray(target_logits_NV, jnp.float32), verifier=verifier,
                sampling=sampling, horizon=horizon, chunk=chunk)
    return jax.tree.map(np.asarray, out)


def _check_inputs(verifier, tree, target_logits_NV, sampling, horizon, num_draws):
    check_hashable(verifier, "verifier")
    if not isinstance(sampling, Sampling):
        raise ValueError(f"sampling must be a tev_jax.sampling.Sampling, got {sampling!r}")
    if isinstance(num_draws, bool) or not isinstance(num_draws, int) or num_draws < 1:
        raise ValueError(f"num_draws must be a positive int, got {num_draws!r}")
    validate(tree, horizon)
    logits = np.asarray(target_logits_NV)
    if logits.ndim != 2 or logits.shape[0] != tree.num_slots:
        raise ValueError(f"target_logits_NV must have shape [N, V] = [{tree.num_slots}, V] "
                         f"for a tree of N = {tree.num_slots} slots, got {list(logits.shape)}")
    n = int(np.asarray(tree.valid).sum())
    check_finite(logits[:n])
    if int(np.asarray(tree.tokens)[:n].max()) >= logits.shape[1]:
        raise ValueError(f"tree tokens must lie in [0, V={logits.shape[1]})")


def check_lossless(verifier: Verifier, tree: DraftTree, target_logits_NV, sampling: Sampling,
                   *, horizon: int, num_draws: int = 100_000, seed: int = 0,
                   alpha: float = 1e-4, max_impossible_hits: int = 3) -> LosslessReport:
    """Tests whether ``verifier``'s (exit node, bonus) law on one tree is the exact one.

    See the module docstring for the statistics, the significance and the power.

    Args:
      verifier: a `tev_jax.extensions.Verifier`
        ``(key, tree, target_logits_NV, sampling, *, horizon) -> Verdict``.
      tree: a single valid `DraftTree` [N] of depth at most ``horizon``.
      target_logits_NV: [N, V] target logits of its nodes (padding rows ignored).
      sampling: the target's sampling transform.
      horizon: H, passed to the verifier.
      num_draws: D, the number of verifier calls (keys split from ``seed``).
      seed: the PRNG seed; a fixed seed makes the test deterministic.
      alpha: the significance level.
      max_impossible_hits: draws tolerated in cells of exact probability 0.

    Returns:
      A `LosslessReport`; ``report.passed`` is the verdict.

    Raises:
      ValueError: an invalid tree, logits of the wrong shape or with NaN / +inf, or a
        verifier that does not return a single-row `Verdict` with a [H+1] path.
    """
    _check_inputs(verifier, tree, target_logits_NV, sampling, horizon, num_draws)
    logits = jnp.asarray(target_logits_NV, jnp.float32)
    check_verdict(jax.eval_shape(lambda k: verifier(k, tree, logits, sampling,
                                                    horizon=horizon), jax.random.key(0)),
                  horizon)
    out = draw_verdicts(verifier, tree, logits, sampling, horizon=horizon,
                        num_draws=num_draws, seed=seed)
    joint = exact_law(tree, target_logits_NV, sampling)
    report = chi_square(out.exit_node, out.bonus, joint,
                        max_impossible_hits=max_impossible_hits, alpha=alpha)
    _, parents, n = ref.host_tree(tree)
    paths_NP = np.full((n, horizon + 1), -1)
    for v in range(n):
        path = ref.ancestors(parents, v)[::-1]
        paths_NP[v, :len(path)] = path
    exit_D = np.clip(out.exit_node, 0, n - 1)
    wrong = (np.any(out.path != paths_NP[exit_D], axis=-1)
             | (out.length != (paths_NP[exit_D] >= 0).sum(-1))) & (
        (out.exit_node >= 0) & (out.exit_node < n))
    return dataclasses.replace(report, inconsistent=report.inconsistent + int(wrong.sum()))


def assert_lossless(verifier: Verifier, tree: DraftTree, target_logits_NV,
                    sampling: Sampling, **kwargs) -> LosslessReport:
    """`check_lossless`; raises ``AssertionError`` with the report unless it passed.

    Returns:
      The `LosslessReport` (passed).
    """
    report = check_lossless(verifier, tree, target_logits_NV, sampling, **kwargs)
    if not report.passed:
        raise AssertionError(f"verifier {getattr(verifier, '__name__', verifier)!r} is "
                             f"not lossless: {report}")
    return report
