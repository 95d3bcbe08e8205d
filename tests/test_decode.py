"""The decode engine at T = 0: exact greedy output, stopping, errors (tev_jax.decode).

Reference: a cache-free greedy loop over `tev_jax.models.score` (no KV cache, no tree,
no engine). Every builder x verifier combination must reproduce it token for token,
for prompts of different lengths over 200 tokens, with a random DFlash drafter (short
accepted blocks) and with the oracle drafter (full blocks; with DDTree the accepted path
runs through later slots, so `commit` moves key/value entries).

Compilation dominates the run time on CPU, so the combinations run on the un-fused path
(`profile_generate`, which compiles each stage once per setting of the fields it reads
and shares the rest). The fused `lax.while_loop` path composes the very same stage
functions; it is checked against the reference for AR decoding and against the un-fused
path, draw for draw, for DDTree + TEV at T = 1. One drafter covers both qualities:
`MixDrafter` switches between the DFlash drafter and the oracle with a runtime flag.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_fixtures import MixDrafter, greedy_reference, tiny_target
from flax import nnx

from tev_jax import decode, engine, extensions, programs
from tev_jax.costs import timing
from tev_jax.models.drafter_io import init_drafter
from tev_jax.sampling import Sampling
from tev_jax.testing.drafters import OracleDrafter

V = 64
H = 4
BUDGET = 8
M = 200
CACHE_LEN = 256  # fixed, so that chain and DDTree runs share compilations
PROMPTS = [[5, 17, 3], [9, 1, 2, 33, 60, 7, 12, 40, 41, 8, 2], [30]]
GREEDY = Sampling(temperature=0.0)


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=38)  # a seed whose greedy continuations do not fall into short loops


@pytest.fixture(scope="module")
def reference(target):
    return greedy_reference(target, PROMPTS, M)


@pytest.fixture(scope="module")
def drafter(target):
    dflash = init_drafter(target, num_layers=1, block_size=H + 1, mask_token_id=V - 1, key=1)
    # scale < 1 flattens the oracle's rows, so DDTree slots interleave depths and the
    # accepted path runs through later slots (commit must move entries).
    return MixDrafter(dflash, OracleDrafter(H + 1, scale=0.5))


def _config(**kw):
    return decode.DecodeConfig(**{"max_new_tokens": M, "budget": BUDGET, "sampling": GREEDY,
                                  "max_cache_len": CACHE_LEN, **kw})


def test_reference_is_not_degenerate(reference):
    assert all(len(set(r)) > 20 for r in reference)


def test_ar_fused_equals_reference(target, reference):
    gen = engine.generate_ar(target, PROMPTS, _config())
    assert gen.rows() == reference
    np.testing.assert_array_equal(gen.lengths, M)
    assert gen.stats.tau == 1.0


@pytest.mark.parametrize("quality", [pytest.param("random", marks=pytest.mark.slow), "oracle"])
def test_every_builder_and_verifier_is_greedy_exact(target, drafter, reference, quality):
    # ~25 rounds a run with the random drafter (its rounds are short): its first 32
    # tokens; the oracle's full blocks: the first 64 (the slow tier runs all M = 200)
    _check_greedy_exact(target, drafter, reference, quality, 64 if quality == "oracle" else 32)


@pytest.mark.slow
@pytest.mark.parametrize("quality", ["random", "oracle"])
def test_every_builder_and_verifier_is_greedy_exact_for_200_tokens(target, drafter,
                                                                   reference, quality):
    """Slow tier (issue 47, item 16): the greedy-exactness runs at full length."""
    _check_greedy_exact(target, drafter, reference, quality, M)


def _check_greedy_exact(target, drafter, reference, quality, m):
    drafter.use_oracle[...] = jnp.asarray(quality == "oracle")
    for builder in ("chain", "ddtree"):
        for verifier in extensions.VERIFIERS:
            gen = timing.profile_generate(
                target, drafter, PROMPTS,
                _config(builder=builder, verifier=verifier, track_exit_law=True,
                        max_new_tokens=m), key=3, warmup=False)
            assert gen.rows() == [r[:m] for r in reference], (builder, verifier)
            s = gen.stats
            assert (s.block_lengths.sum(0) >= m - 1).all()  # the last block may pass m
            # At T = 0 the exit law is a point mass: 1 + coverage is the block length.
            np.testing.assert_allclose(s.expected_lengths, s.block_lengths, atol=1e-5)
            tau = s.tau
            if quality == "oracle":
                # Full blocks: every round moves H entries of the KV cache.
                assert tau > 2, (builder, verifier, tau)
                if builder == "chain":
                    assert tau == H + 1, (verifier, tau)
                else:
                    assert gen.stats.kv_moves.min() > 0, verifier
            else:
                assert 1 <= tau < H + 1


def _check_trace(trace, gen):
    """Issue 38: a `tev_jax.trace.RoundTrace` against the generation it recorded: accepted
    lengths, the output blocks rebuilding the tokens, paths along parent links, each
    round's root the previous bonus, draft log-probabilities on the nodes only."""
    np.testing.assert_array_equal(trace.block_lengths, gen.stats.block_lengths)
    assert trace.rounds == gen.stats.rounds
    for b, row in enumerate(gen.rows()):
        first = int(trace.tree.tokens[0, b, 0])  # round 0's root: the prefill's token
        assert ([first] + [t for block in trace.blocks(b) for t in block])[:len(row)] == row
    path = trace.verdict.path
    assert (path[:, :, 0] == 0).all()
    for r in range(trace.rounds):
        for b in range(len(gen.lengths)):
            nodes = path[r, b, :trace.verdict.length[r, b]]
            assert (trace.tree.parents[r, b, nodes[1:]] == nodes[:-1]).all()
            if r + 1 < trace.rounds and trace.active_RB[r + 1, b]:
                assert trace.tree.tokens[r + 1, b, 0] == trace.verdict.bonus[r, b]
    node = trace.tree.valid & (trace.tree.depths > 0)
    logp = trace.draft_logp_RBN
    assert np.isfinite(logp).all() and (logp[node] <= 0).all() and (logp[~node] == 0).all()


def test_stop_tokens_end_rows_independently(target, drafter, reference):
    drafter.use_oracle[...] = jnp.asarray(True)
    # A stop token that row 0 emits early; the other rows must be unaffected up to theirs.
    stop = reference[0][10]
    config = _config(builder="ddtree", stop_token_ids=(stop,))
    gen = timing.profile_generate(target, drafter, PROMPTS, config, warmup=False, trace=True)
    traced = engine.generate(target, drafter, PROMPTS, config, trace=True)
    np.testing.assert_array_equal(traced.tokens, gen.tokens)
    for t in (gen.trace, traced.trace):
        _check_trace(t, gen)
    assert not traced.trace.active_RB[-1].all()  # row 0 stopped before the others
    np.testing.assert_array_equal(traced.trace.verdict.path, gen.trace.verdict.path)
    np.testing.assert_allclose(traced.trace.draft_logp_RBN, gen.trace.draft_logp_RBN,
                               rtol=1e-5, atol=1e-6)
    for row, ref, n, toks in zip(gen.rows(), reference, gen.lengths, gen.tokens):
        end = ref.index(stop) + 1 if stop in ref else M
        assert row == ref[:end]
        assert n == end
        assert (toks[end:] == decode.PAD_TOKEN).all()
    assert gen.lengths[0] <= 11


def test_profile_reports_stage_times(target, drafter):
    drafter.use_oracle[...] = jnp.asarray(True)
    gen = timing.profile_generate(target, drafter, PROMPTS, _config(builder="chain"))
    t = gen.stats.stage_seconds
    assert set(t) == {"prefill", "draft", "build", "verify", "decide", "commit"}
    assert all(v > 0 for v in t.values())
    assert gen.stats.seconds >= sum(t.values()) - 1e-6


@pytest.mark.slow  # the fast tier's time (README: under 10 minutes here), 2026-12-06
def test_fused_path_equals_profiled_path_at_t1(target, drafter):
    """Same key, same stages: the while_loop and the Python loop agree at T = 1."""
    drafter.use_oracle[...] = jnp.asarray(True)
    config = _config(builder="ddtree", verifier="tev", sampling=Sampling(1.0), max_new_tokens=40)
    a = engine.generate(target, drafter, PROMPTS, config, key=7)
    b = timing.profile_generate(target, drafter, PROMPTS, config, key=7, warmup=False,
                                 trace=True)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.stats.block_lengths, b.stats.block_lengths)
    assert a.stats.tau > 1.5
    _check_trace(b.trace, a)  # issue 38: the stages' round trace against generate at T = 1
    c = engine.generate(target, drafter, PROMPTS, config, key=8)
    assert not np.array_equal(a.tokens, c.tokens)


# ------------------------------------------------------------------------------ errors


@pytest.mark.slow  # the fast tier's time (README: under 10 minutes here), 2026-12-06
def test_prompt_len_reuses_one_compilation(target, drafter, reference):
    config = _config(builder="ddtree", max_new_tokens=12, prompt_len=16)
    engine.generate(target, drafter, [PROMPTS[0]], config)  # compiles for P = 16
    compiled = programs.generate_jit._cache_size()
    for i in (1, 2):  # other prompt lengths (11 and 1 tokens): the same program
        out = engine.generate(target, drafter, [PROMPTS[i]], config)
        assert out.rows()[0] == reference[i][:12]
    assert programs.generate_jit._cache_size() == compiled
    # the negative control: without a fixed buffer the 11-token prompt needs its own
    free = _config(builder="ddtree", max_new_tokens=12)
    engine.generate(target, drafter, [PROMPTS[0]], free)
    before = programs.generate_jit._cache_size()
    engine.generate(target, drafter, [PROMPTS[1]], free)
    assert programs.generate_jit._cache_size() == before + 1
    with pytest.raises(ValueError, match=r"more than the prompt buffer \(8\)"):
        engine.generate(target, drafter, [PROMPTS[1]], _config(prompt_len=8))
    with pytest.raises(ValueError, match="prompt_len must be a positive int"):
        _config(prompt_len=0)


def test_bad_inputs_raise(target, drafter):
    config = _config(builder="chain")
    with pytest.raises(ValueError, match="empty"):
        engine.generate(target, drafter, [], config)
    with pytest.raises(ValueError, match="prompt 1: the prompt is empty"):
        engine.generate(target, drafter, [[1, 2], []], config)
    with pytest.raises(ValueError, match=r"token id 64 is outside the vocabulary \[0, 64\)"):
        engine.generate(target, drafter, [[1, 64]], config)
    with pytest.raises(ValueError, match="token id -3"):
        engine.generate(target, drafter, [[-3]], config)
    with pytest.raises(ValueError, match="cache is too short"):
        engine.generate(target, drafter, [[1] * 60], _config(builder="chain", max_cache_len=256))
    with pytest.raises(ValueError, match="needs a drafter"):
        engine.generate(target, None, [[1]], config)
    with pytest.raises(ValueError, match="stop token id 99"):
        engine.generate(target, drafter, [[1]], _config(stop_token_ids=(99,)))


def test_bad_configs_raise():
    with pytest.raises(ValueError, match="temperature 0"):
        decode.DecodeConfig(verifier="greedy", sampling=Sampling(1.0))
    with pytest.raises(ValueError, match="builder"):
        decode.DecodeConfig(builder="beam")
    with pytest.raises(ValueError, match="verifier"):
        decode.DecodeConfig(verifier="eagle")
    with pytest.raises(ValueError, match="max_new_tokens"):
        decode.DecodeConfig(max_new_tokens=0)
    with pytest.raises(ValueError, match="budget"):
        decode.DecodeConfig(budget=0)


def test_non_finite_target_logits_raise(target):
    broken = nnx.clone(target)
    broken.lm_head[...] = broken.lm_head[...].at[:, 3].set(jnp.nan)
    with pytest.raises(ValueError, match="target produced non-finite logits"):
        engine.generate_ar(broken, PROMPTS, _config())  # the compilation of test_ar_fused_...


def test_non_finite_draft_logits_raise(target, drafter):
    broken = nnx.clone(drafter)
    broken.use_oracle[...] = jnp.asarray(False)
    norm = broken.dflash.drafter.norm.weight
    norm[...] = norm[...].at[0].set(jnp.nan)
    with pytest.raises(ValueError, match="drafter produced non-finite logits"):
        timing.profile_generate(target, broken, PROMPTS, _config(builder="chain", verifier="tev",
                                                                 track_exit_law=True), warmup=False)


# ------------------------------------------------------------------ command line


@pytest.mark.slow  # the fast tier's time (README: under 10 minutes here), 2026-12-06
def test_cli_generate(tmp_path, target, drafter, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from tev_jax import cli
    from tev_jax.models import save_drafter, save_target

    words = [f"w{i}" for i in range(V)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    save_target(target, tmp_path / "target", tokenizer=tok)
    save_drafter(drafter.dflash.drafter, tmp_path / "drafter")
    prompt = "w5 w17 w3"
    rc = cli.main(["generate", prompt, "--target", str(tmp_path / "target"),
                   "--drafter", str(tmp_path / "drafter"), "--budget", "4",
                   "--max-new-tokens", "12", "--compare-ar"])
    assert rc == 0
    out, err = capsys.readouterr()
    ref = greedy_reference(target, [[5, 17, 3]], 12)[0]
    assert out.strip() == tok.decode([5, 17, 3] + ref)
    assert "tau = " in err and "tokens/s" in err and "speed-up" in err

    with pytest.raises(SystemExit):
        cli.main(["generate", prompt, "--target", str(tmp_path / "target")])
    assert "--drafter is required" in capsys.readouterr().err


@pytest.mark.slow  # the fast tier's time (README: under 10 minutes here), 2026-12-06
def test_trace_records_the_targets_log_probabilities_of_its_tokens(target, drafter):
    """The trace's target log-probabilities (T = 1) of the accepted path and the bonus
    equal a teacher-forced forward over the generated sequence; rejected nodes get their
    own (finite, <= 0), the root and padding 0."""
    drafter.use_oracle[...] = jnp.asarray(False)
    config = _config(builder="ddtree", max_new_tokens=24, sampling=Sampling(1.0))
    gen = engine.generate(target, drafter, PROMPTS, config, key=5, trace=True)
    t = gen.trace
    node = t.tree.valid & (t.tree.depths > 0)
    assert (t.target_logp_RBN[node] <= 0).all() and (t.target_logp_RBN[~node] == 0).all()
    checked = 0
    for b, (prompt, row) in enumerate(zip(PROMPTS, gen.rows())):
        seq = jnp.asarray([prompt + row])
        want = jax.nn.log_softmax(target(seq)[0][0], axis=-1)   # [T, V]: next-token law
        for r in range(t.rounds):
            n, start = int(t.verdict.length[r, b]), int(t.start_RB[r, b])
            if not t.active_RB[r, b] or start + n >= seq.shape[1]:
                continue
            path = t.verdict.path[r, b, :n]
            for d in range(1, n):          # path node at depth d is the token at start + d
                tok = int(t.tree.tokens[r, b, path[d]])
                np.testing.assert_allclose(t.target_logp_RBN[r, b, path[d]],
                                           want[start + d - 1, tok], atol=2e-4)
            np.testing.assert_allclose(t.bonus_logp_RB[r, b],
                                       want[start + n - 1, int(t.verdict.bonus[r, b])],
                                       atol=2e-4)
            checked += n
    assert checked > 20
    assert np.isfinite(t.target_logp_RBN).all() and np.isfinite(t.bonus_logp_RB).all()
