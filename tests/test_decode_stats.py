"""Speculative decoding at T = 1 samples the target's own distribution (tev_jax.decode).

A small-vocabulary target (V = 8) makes the autoregressive law of the first three
generated tokens enumerable exactly: ``p(t0) p(t1 | t0) p(t2 | t0, t1)`` over V^3 = 512
sequences, from cache-free target logits. Generations of one prompt (TEV: 10^5, a batch
of 2 x 50 000 copies; PreDraw and sequential: 5 x 10^4; keys fixed by the seeds below;
the verifiers themselves are tested on 10^5 draws in tests/test_verify_stats.py) use DDTree trees
from a cheap context-free drafter whose first-round rows are the oracle's (the target's
logits along the greedy chain after the prompt and the root), so draft tokens are
accepted often and the verifier decides most of the output. Their counts over the 512
sequences are compared with the exact law by a chi-square test at significance
``ALPHA`` = 1e-3 (cells with an expected count below 5 pooled). A negative control -
TEV with the bonus drawn from the full distribution at the exit instead of the
residual - must be rejected at the same level with 5 x 10^4, the smallest sample used.

The same test runs on a mixture-of-experts target (Qwen3-MoE, 4 experts, top-2) with
TEV (5 x 10^4 generations, one chunk) and the negative control (the same 5 x 10^4, at
which the control is rejected for the dense target too), in the slow tier: its
exactness rests on the routing being the model's.

The same runs check the exit law: over all (round, row) pairs the output-block length
has conditional mean ``1 + coverage`` of that round's tree, so the standardised sum of
``length - (1 + coverage)`` must be below 4 in absolute value (two-sided normal
approximation, significance ~6e-5).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_fixtures import TableDrafter, jit_score, oracle_table, tiny_target
from scipy import stats

from tev_jax import decode
from tev_jax import verify as verify_lib
from tev_jax.costs import timing
from tev_jax.sampling import Sampling, log_probs

V = 8
H = 3
BUDGET = 6
PROMPT = [1, 2, 3]
CHUNK = 50_000
SEEDS = (11, 12)  # one per chunk
ALPHA = 1e-3
SAMPLING = Sampling(temperature=1.0)


def tev_full_bonus(key, tree, logits_NV, sampling, *, horizon):
    """NEGATIVE CONTROL: TEV whose bonus ignores the exit's children (not exact)."""
    k_tev, k_bonus = jax.random.split(key)
    verdict = verify_lib.tev(k_tev, tree, logits_NV, sampling, horizon=horizon)
    bonus = jax.random.categorical(k_bonus, log_probs(logits_NV[verdict.exit_node], sampling))
    return verdict.replace(bonus=bonus.astype(jnp.int32))


# (family, verifier) pairs tested; each family also runs the negative control.
FAMILIES = {"qwen3": 0, "qwen3_moe": 4}          # -> experts
# chunks of CHUNK per verifier: TEV on the dense target 10^5 generations, the others
# 5 x 10^4 (the negative control's single chunk shows that many detect a wrong law)
CHUNKS = {("qwen3", "tev"): 2}
CASES = [("qwen3", "tev"), ("qwen3", "predraw"), ("qwen3", "sequential"),
         ("qwen3_moe", "tev")]


def _tiered(params):
    """pytest params, all in the slow tier: the mixture-of-experts family's (its routing is
    tested against transformers in the fast tier, tests/test_moe.py) and, since
    2026-12-06 (the fast tier's time; 38-55 s each), the dense family's 10^5 generations
    per verifier (the verifiers' laws are tested in the fast tier,
    tests/test_verify_stats.py, and through the engine, tests/test_batching.py)."""
    return [pytest.param(*p, marks=[pytest.mark.slow]) for p in params]


@functools.lru_cache(maxsize=None)
def target(family):
    return tiny_target(vocab=V, hidden=16, layers=1, seed=4, head_scale=20.0,
                       experts=FAMILIES[family])


@functools.lru_cache(maxsize=None)
def ar_law(family):
    """float64 [V, V, V]: the target's law of (t0, t1, t2) after PROMPT."""
    p = len(PROMPT)
    pairs = np.stack(np.meshgrid(np.arange(V), np.arange(V), indexing="ij"), -1).reshape(-1, 2)
    seqs = np.concatenate([np.tile(PROMPT, (V * V, 1)), pairs], axis=1)
    logits = jit_score(target(family))(seqs)
    lp = np.asarray(log_probs(logits, SAMPLING), np.float64).reshape(V, V, p + 2, V)
    law = (lp[0, 0, p - 1][:, None, None] + lp[:, 0, p][:, :, None] + lp[:, :, p + 1])
    law = np.exp(law)
    return law / law.sum()


def _generate(target, drafter, verifier, seed):
    config = decode.DecodeConfig(max_new_tokens=3, builder="ddtree", budget=BUDGET,
                                 verifier=verifier, sampling=SAMPLING, max_cache_len=16,
                                 track_exit_law=True)
    # The un-fused path shares every stage's compilation across verifiers but decide.
    return timing.profile_generate(target, drafter, [PROMPT] * CHUNK, config,
                                   key=seed, warmup=False)


def _chi2_pvalue(counts, law):
    expected = law.reshape(-1) * counts.sum()
    observed = counts.reshape(-1).astype(np.float64)
    small = expected < 5
    exp_c = np.append(expected[~small], expected[small].sum())
    obs_c = np.append(observed[~small], observed[small].sum())
    if exp_c[-1] == 0:
        exp_c, obs_c = exp_c[:-1], obs_c[:-1]
    stat = ((obs_c - exp_c) ** 2 / exp_c).sum()
    return stats.chi2.sf(stat, len(exp_c) - 1)


@functools.lru_cache(maxsize=None)
def runs(family, full=False):
    """verifier name -> (counts [V, V, V], standardised block-length deviation, τ);
    ``full``: every verifier and the negative control on 2 x CHUNK = 10^5 generations
    (the slow tier)."""
    model = target(family)
    drafter = TableDrafter(oracle_table(model, PROMPT, H))
    out = {}
    verifiers = [(v, v) for f, v in CASES if f == family] + [("control", tev_full_bonus)]
    for name, verifier in verifiers:
        counts = np.zeros(V ** 3, np.int64)
        dev, var, blocks, rounds = 0.0, 0.0, 0, 0
        for seed in SEEDS[:len(SEEDS) if full else CHUNKS.get((family, name), 1)]:
            gen = _generate(model, drafter, verifier, seed)
            assert (gen.lengths == 3).all()
            t = gen.tokens
            np.add.at(counts, t[:, 0] * V * V + t[:, 1] * V + t[:, 2], 1)
            diff = gen.stats.block_lengths - gen.stats.expected_lengths
            dev += diff.sum()
            var += (diff ** 2).sum()
            blocks += gen.stats.block_lengths.sum()
            rounds += gen.stats.rounds_per_row.sum()
        out[name] = (counts.reshape(V, V, V), dev / np.sqrt(var), blocks / rounds)
    return out


@pytest.mark.parametrize("family", _tiered([(f,) for f in FAMILIES]))
def test_law_is_not_trivial(family):
    top = np.sort(ar_law(family).reshape(-1))[::-1]
    assert top[0] < 0.5 and (ar_law(family) > 1e-3).sum() > 20


@pytest.mark.parametrize("family,verifier", _tiered(CASES))
def test_first_three_tokens_follow_the_target(family, verifier):
    counts, _, tau = runs(family)[verifier]
    assert tau > 1.3  # the trees matter: draft tokens were accepted
    assert _chi2_pvalue(counts, ar_law(family)) > ALPHA


@pytest.mark.parametrize("family", _tiered([(f,) for f in FAMILIES]))
def test_negative_control_is_rejected(family):
    counts, _, _ = runs(family)["control"]
    assert _chi2_pvalue(counts, ar_law(family)) < ALPHA


@pytest.mark.parametrize("family,verifier", _tiered(CASES))
def test_block_length_matches_exit_law(family, verifier):
    _, z, _ = runs(family)[verifier]
    assert abs(z) < 4


@pytest.mark.slow
@pytest.mark.parametrize("verifier", ["tev", "predraw", "sequential"])
def test_every_verifier_at_full_power(verifier):
    """Slow tier (issue 47, item 16): every verifier on 10^5 generations of the dense
    target (the fast tier runs PreDraw and sequential on 5 x 10^4), its block lengths
    against the exit law, and the negative control rejected at 10^5 too."""
    full = runs("qwen3", full=True)
    counts, z, tau = full[verifier]
    assert counts.sum() == len(SEEDS) * CHUNK and tau > 1.3
    assert _chi2_pvalue(counts, ar_law("qwen3")) > ALPHA
    assert abs(z) < 4
    control, _, _ = full["control"]
    assert control.sum() == len(SEEDS) * CHUNK
    assert _chi2_pvalue(control, ar_law("qwen3")) < ALPHA
