"""Each row its own sampling setting (issue 59, item 2: ``DecodeConfig(sampling=PER_ROW)``).

- `tev_jax.vocab.row_scores` is `tev_jax.sampling.log_probs` row by row: the same
  support, the same probabilities, over settings drawn by hypothesis.
- Exactness per row: one batch of four rows with four settings goes through the decode
  round's decide stage 10^5 times (the verifiers TEV, predraw and sequential); each
  row's (exit, bonus) table is tested against the exact law of its own setting with the
  harness behind ``check_lossless`` (`tev_jax.testing.chi_square`, alpha = 1e-4 per
  test: 12 tests, so an exact verifier fails any with probability at most 0.12 %). The
  negative control decodes the same rows with their settings rotated: every row must
  then fail against its own law.
- The engine: greedy rows of a mixed batch give the static greedy program's tokens; a
  batch of one setting per row equals the static setting's engine at T = 0; engines
  refuse a missing or a superfluous setting.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tev_jax import testing
from tev_jax.decode import DecodeConfig, DecodeSpec, decide_stage
from tev_jax.engine import Engine
from tev_jax.sampling import PER_ROW, Sampling, SamplingRows, log_probs
from tev_jax.tree import make_tree
from tev_jax.vocab import row_scores

N, V, H = 8, 6, 3
DRAWS = 100_000
ALPHA = 1e-4
MIXED = (Sampling(0.5), Sampling(1.0, top_k=3), Sampling(1.0, top_p=0.8),
         Sampling(1.7, top_k=4, top_p=0.9))


def _rows(settings_) -> SamplingRows:
    return jax.tree.map(jnp.asarray, SamplingRows.of(settings_))


@st.composite
def _setting(draw):
    t = draw(st.sampled_from([0.0, 0.3, 1.0, 2.5]))
    k = draw(st.sampled_from([None, 1, 2, 5, 11, 40, 300]))
    p = draw(st.sampled_from([None, 0.2, 0.75, 1.0]))
    return Sampling(t, k, p)


@pytest.mark.slow  # the fast tier's time (README: under 10 minutes here), 2026-12-06
@settings(max_examples=30, deadline=None)
@given(st.lists(_setting(), min_size=1, max_size=5), st.integers(0, 2**31 - 1),
       st.sampled_from([40, 600]), st.sampled_from([0.3, 3.0, 12.0]))
def test_row_scores_is_log_probs_row_by_row(settings_, seed, vocab, scale):
    """Over a vocabulary of 40 (sorted whole) and of 600 (the cut found among the
    `CUT_PREFIX` = 256 largest logits, or, for a flat row's nucleus or a top-k of 300,
    after a sort): the same support and probabilities as the static transform."""
    logits = np.random.default_rng(seed).normal(size=(len(settings_), 3, vocab)) * scale
    logits[:, 1, :4] = logits[:, 1, 4:8]  # ties at the top-k / top-p cuts
    z = row_scores(jnp.asarray(logits, jnp.float32), _rows(settings_)).x
    for b, s in enumerate(settings_):
        want = np.asarray(log_probs(jnp.asarray(logits[b], jnp.float32), s))
        got = np.asarray(jax.nn.log_softmax(z[b], axis=-1))
        assert np.array_equal(np.isinf(want), np.isinf(got)), (b, s)
        kept = ~np.isinf(want)
        np.testing.assert_allclose(got[kept], want[kept], atol=1e-5)


def _tree_and_logits():
    """A 7-node tree over V = 6 with logits that give every edge real mass."""
    tree = make_tree([0, 1, 2, 3, 1, 4, 2], [-1, 0, 0, 1, 1, 2, 3], N)
    rng = np.random.default_rng(59)
    logits = rng.standard_normal((N, V)).astype(np.float32)
    return tree, logits


def _spec(verifier: str) -> DecodeSpec:
    config = DecodeConfig(builder="chain", verifier=verifier, sampling=PER_ROW)
    return DecodeSpec(config=config, batch_size=len(MIXED), prompt_len=8, horizon=H,
                      num_slots=N, taps=(), max_len=32, has_drafter=True)


def _draws(verifier: str, settings_):
    tree, logits = _tree_and_logits()
    b = len(settings_)
    trees = jax.tree.map(lambda x: jnp.broadcast_to(x, (b,) + x.shape), tree)
    logits_BNV = jnp.broadcast_to(jnp.asarray(logits), (b, N, V))
    spec, rows = _spec(verifier), _rows(settings_)

    @jax.jit
    def draw(keys_D):
        one = lambda k: decide_stage(jax.random.split(k, b), trees, logits_BNV, rows,
                                     spec=spec)
        return jax.lax.map(one, keys_D, batch_size=4096)

    out = draw(jax.random.split(jax.random.key(7), DRAWS))
    return tree, logits, np.asarray(out.exit_node), np.asarray(out.bonus)


@pytest.mark.parametrize("verifier", ["tev", "predraw", "sequential"])
def test_a_batch_of_mixed_settings_is_exact_per_row(verifier):
    tree, logits, exits, bonuses = _draws(verifier, MIXED)
    for b, s in enumerate(MIXED):
        report = testing.chi_square(exits[:, b], bonuses[:, b],
                                    testing.exact_law(tree, logits, s), alpha=ALPHA)
        assert report.passed, f"row {b} ({s}): {report}"


def test_rows_decoded_with_each_others_settings_fail():
    """Negative control: the same draws with the settings rotated by one row."""
    tree, logits, exits, bonuses = _draws("tev", MIXED[1:] + MIXED[:1])
    for b, s in enumerate(MIXED):
        report = testing.chi_square(exits[:, b], bonuses[:, b],
                                    testing.exact_law(tree, logits, s), alpha=ALPHA)
        assert not report.passed, f"row {b} ({s}) passed with another row's setting"


# ------------------------------------------------------------------------ the engine


@pytest.fixture(scope="module")
def bundled():
    from tev_jax.models.bundled import load_bundled

    target, drafter, _ = load_bundled()
    return target, drafter


IDS = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23], [3, 4]]
BASE = DecodeConfig(max_new_tokens=16, budget=8, prompt_len=16)


@pytest.mark.slow  # the fast tier's time (README: under 10 minutes here), 2026-12-06
def test_greedy_rows_of_a_mixed_batch_are_the_static_greedy_tokens(bundled):
    target, drafter = bundled
    static = Engine.create(target, drafter, BASE, 4)
    want = static.finish(static.generate(static.prompts(IDS), jax.random.key(0)))
    rows = Engine.create(target, drafter, dataclasses.replace(BASE, sampling=PER_ROW), 4)
    mixed = [Sampling(0.0), Sampling(1.0), Sampling(0.0), Sampling(0.8, top_k=5, top_p=0.9)]
    for settings_, greedy in ((mixed, (0, 2)), (Sampling(0.0), range(4))):
        got = rows.finish(rows.generate(rows.prompts(IDS, settings_), jax.random.key(0)))
        for b in greedy:
            assert got.tokens[b].tolist() == want.tokens[b].tolist(), (settings_, b)
    # negative control: with this key the mixed batch's T = 1 row leaves the greedy text
    got = rows.finish(rows.generate(rows.prompts(IDS, mixed), jax.random.key(0)))
    assert got.tokens[1].tolist() != want.tokens[1].tolist()


def test_engines_refuse_a_missing_or_superfluous_setting(bundled):
    target, drafter = bundled
    rows = Engine.create(target, drafter, dataclasses.replace(BASE, sampling=PER_ROW), 4)
    with pytest.raises(ValueError, match="needs each prompt's setting"):
        rows.prompts(IDS)
    with pytest.raises(ValueError, match="3 sampling settings for 4 prompts"):
        rows.prompts(IDS, [Sampling(0.0)] * 3)
    static = Engine.create(target, drafter, BASE, 4)
    with pytest.raises(ValueError, match="per-row settings need"):
        static.prompts(IDS, Sampling(1.0))
    with pytest.raises(ValueError, match="'greedy' is exact only at temperature 0"):
        DecodeConfig(verifier="greedy", sampling=PER_ROW)
    with pytest.raises(ValueError, match="sampling must be a Sampling or 'per_row'"):
        DecodeConfig(sampling="per-row")


@pytest.mark.slow  # the fast tier's time (README: under 10 minutes here), 2026-12-06
def test_rows_that_ignore_stop_tokens_go_on_and_the_others_end(bundled):
    """vLLM's ``ignore_eos`` as a per-row flag (``SamplingRows.stops``): with a stop token
    that the greedy text reaches early, rows that stop end there (the stop token kept),
    rows that do not give the whole text of a config without stop tokens."""
    target, drafter = bundled
    plain = Engine.create(target, drafter, dataclasses.replace(BASE, sampling=PER_ROW), 4)
    free = plain.finish(plain.generate(plain.prompts(IDS, Sampling(0.0)), jax.random.key(0)))
    stop = int(free.tokens[0][3])  # row 0's fourth token
    config = dataclasses.replace(BASE, sampling=PER_ROW, stop_token_ids=(stop,))
    engine = Engine.create(target, drafter, config, 4)
    rows = SamplingRows.of([Sampling(0.0)] * 4, stops=[True, False, True, False])
    got = engine.finish(engine.generate(engine.prompts(IDS, rows), jax.random.key(0)))
    first = free.tokens[0].tolist().index(stop)
    assert got.tokens[0][: got.lengths[0]].tolist() == free.tokens[0][: first + 1].tolist()
    for b in (1, 3):
        assert got.tokens[b].tolist() == free.tokens[b].tolist()
    assert got.lengths[1] == got.lengths[3] == BASE.max_new_tokens
