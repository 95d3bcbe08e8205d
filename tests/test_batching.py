"""Continuous batching (tev_jax.batch.continuous): exact per request, a few compilations.

T = 0: more prompts than slots, of mixed lengths, with a stop token so rows finish at
different rounds and slots are refilled one or two at a time. Every request's tokens
must equal the cache-free greedy reference (`greedy_reference`, no engine), and its
rounds and τ must equal `engine.generate` of that prompt alone. A second set of prompts
of other lengths then runs without compiling anything new.

T = 1: the first two tokens of one prompt, repeated over many requests among requests
of a second prompt, against their exact law from the target's logits (chi-square).
"""

from __future__ import annotations

import numpy as np
import pytest
from decode_fixtures import greedy_reference, jit_score, tiny_target
from scipy import stats

from tev_jax import decode, engine, programs, slots
from tev_jax.batch import continuous
from tev_jax.models.drafter_io import init_drafter
from tev_jax.prompts import Request
from tev_jax.sampling import Sampling

V = 64
H = 4
P = 32
M = 24
STOP = (11,)


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=12)  # a seed where some rows (not all) hit the stop token


@pytest.fixture(scope="module")
def drafter(target):
    return init_drafter(target, num_layers=1, block_size=H + 1, mask_token_id=V - 1, key=1)


def _prompts(seed, n):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, V - 1, size=int(k)).tolist() for k in rng.integers(1, P + 1, n)]


def _until_stop(tokens):
    ends = [i for i, t in enumerate(tokens) if t in STOP]
    return tokens[: ends[0] + 1] if ends else tokens


def _run(target, drafter, prompts, config, batch_size, key=0, widths=None):
    requests = [Request(i, p) for i, p in enumerate(prompts)]
    results = list(continuous.generate_continuous(target, drafter, requests, config,
                                                batch_size=batch_size, key=key,
                                                widths=widths))
    assert sorted(r.id for r in results) == list(range(len(prompts)))
    return {r.id: r for r in results}


@pytest.mark.slow  # issue 58, item 11: the fast tier's headroom
def test_every_request_equals_its_prompt_alone_at_t0(target, drafter):
    config = decode.DecodeConfig(max_new_tokens=M, budget=6, stop_token_ids=STOP,
                                 prompt_len=P)
    widths = (16, P)
    before = programs.refill_jit._cache_size()
    prompts = _prompts(0, 8)
    got = _run(target, drafter, prompts, config, batch_size=2, widths=widths)
    reference = greedy_reference(target, prompts, M)
    stopped = 0
    for i, prompt in enumerate(prompts):
        want = _until_stop(reference[i])
        assert got[i].token_ids == want, i
        assert got[i].stop_reason == ("stop" if want[-1] in STOP else "length")
        stopped += want[-1] in STOP
        alone = engine.generate(target, drafter, [prompt], config)
        assert got[i].rounds == int(alone.stats.rounds_per_row[0])
        if got[i].rounds:
            assert got[i].tau == pytest.approx(alone.stats.tau)
        assert got[i].prompt_tokens == len(prompt)
    assert 0 < stopped < len(prompts)  # rows end at different rounds: slots are refilled

    # Prompts of other lengths compile nothing new: at most one refill program per
    # (rows, width) bucket, 2 x 2 here, and one rounds program.
    rounds_programs = programs.run_rounds_jit._cache_size()
    more = _prompts(1, 6)
    again = _run(target, drafter, more, config, batch_size=2, widths=widths)
    assert programs.run_rounds_jit._cache_size() == rounds_programs
    assert programs.refill_jit._cache_size() - before <= 4
    reference = greedy_reference(target, more, M)
    assert [again[i].token_ids for i in range(len(more))] == [_until_stop(r) for r in reference]


@pytest.mark.slow
def test_t1_each_request_equals_its_row_of_one_generation(target, drafter):
    """Row keys (`tev_jax.decode.step_keys`): at T = 1 the j-th request of a continuous
    batch draws what row j of one plain generation of all prompts draws with the same
    key, whatever the slot count (2 or 3 slots: other batch mates, slots and join
    rounds). Negative control: another key changes most requests."""
    config = decode.DecodeConfig(max_new_tokens=M, budget=6, stop_token_ids=STOP,
                                 prompt_len=P, sampling=Sampling(temperature=1.0))
    prompts = _prompts(2, 7)
    whole = engine.generate(target, drafter, prompts, config, key=4)
    want = [_until_stop(whole.rows()[j]) for j in range(len(prompts))]
    for n_slots in (2, 3):
        got = _run(target, drafter, prompts, config, batch_size=n_slots, key=4, widths=(16, P))
        assert [got[j].token_ids for j in range(len(prompts))] == want, n_slots
    other = _run(target, drafter, prompts, config, batch_size=2, key=5, widths=(16, P))
    assert sum(other[j].token_ids != want[j] for j in range(len(prompts))) >= 4


def test_t1_first_tokens_follow_the_target(target, drafter):
    """Chi-square of (t0, t1) of prompt A over 600 requests, at significance 1e-3.

    The exact law is p(t0 | A) p(t1 | A, t0) at T = 1, from full forwards of the target.
    t0 is drawn by the prefill (refilled into varying slots), t1 by the first round
    (DFlash chain + TEV). Cells with expected count < 5 are pooled. Negative control: the
    same samples against the law at T = 0.8 must be rejected.
    """
    prompt_a, prompt_b = [5, 17, 3, 40], [9, 1, 2, 33, 60, 7, 12, 40, 41]
    n = 600
    prompts = [prompt_a if i % 3 else prompt_b for i in range(3 * n // 2)]
    config = decode.DecodeConfig(max_new_tokens=2, builder="chain", prompt_len=16,
                                 sampling=Sampling(temperature=1.0))
    got = _run(target, drafter, prompts, config, batch_size=4, key=3, widths=(16,))
    pairs = np.array([got[i].token_ids for i in range(len(prompts)) if i % 3])
    assert pairs.shape == (n, 2)

    score = jit_score(target)
    seqs = np.array([prompt_a + [t] for t in range(V)])
    logits = score(seqs)  # [V, 5, V]: position 3 -> t0, position 4 -> t1 after t0

    def law(temperature):
        p0 = _softmax(logits[0, len(prompt_a) - 1] / temperature)
        p1 = _softmax(logits[:, len(prompt_a)] / temperature)
        return (p0[:, None] * p1).ravel()

    counts = np.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V)
    assert _chi2_pvalue(counts, law(1.0)) > 1e-3
    assert _chi2_pvalue(counts, law(0.8)) < 1e-3


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _chi2_pvalue(counts, probs):
    n = counts.sum()
    order = np.argsort(probs)[::-1]
    expected, observed = n * probs[order], counts[order]
    big = expected >= 5
    e = np.append(expected[big], expected[~big].sum())
    o = np.append(observed[big], observed[~big].sum())
    return stats.chisquare(o, e * o.sum() / e.sum()).pvalue


def test_bad_requests_and_settings_raise(target, drafter):
    config = decode.DecodeConfig(max_new_tokens=4, budget=6, prompt_len=8)
    run = lambda reqs, cfg=config, b=2: list(
        continuous.generate_continuous(target, drafter, reqs, cfg, batch_size=b))
    with pytest.raises(ValueError, match="'long': the prompt has 9 tokens, more than the "
                                         r"prompt buffer \(8\)"):
        run([Request("long", [1] * 9)])
    with pytest.raises(ValueError, match="request 7: token id 64 is outside"):
        run([Request(7, [1, 64])])
    with pytest.raises(ValueError, match="request 'e': the prompt is empty"):
        run([Request("e", [])])
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        run([Request(0, [1])], b=0)
    with pytest.raises(ValueError, match="prompt_len set"):
        run([Request(0, [1])], cfg=decode.DecodeConfig(max_new_tokens=4))


def test_buckets():
    assert slots.width_buckets(256, count=3) == (64, 128, 256)
    assert slots.width_buckets(576) == (40, 72, 144, 288, 576)
    assert slots.width_buckets(20) == (8, 16, 20)
    assert slots.width_buckets(8, count=4) == (8,)
    assert slots.row_buckets(1) == (1,)
    assert slots.row_buckets(8) == (1, 2, 4, 8)
    assert slots.row_buckets(6) == (1, 2, 4, 6)


@pytest.mark.slow
def test_on_a_mesh_the_tokens_are_the_same(target):
    from tev_jax import sharding as shd

    if not shd.device_count_ok(4):
        pytest.skip("needs 4 devices")
    mesh = shd.make_mesh(data=2, fsdp=1, tensor=2)
    config = decode.DecodeConfig(max_new_tokens=12, builder="none", stop_token_ids=STOP,
                                 prompt_len=16)
    prompts = _prompts(2, 7)
    prompts = [p[:16] for p in prompts]
    requests = [Request(i, p) for i, p in enumerate(prompts)]
    got = {r.id: r.token_ids for r in continuous.generate_continuous(
        target, None, requests, config, batch_size=4, mesh=mesh)}
    reference = greedy_reference(target, prompts, 12)
    assert [got[i] for i in range(len(prompts))] == [_until_stop(r) for r in reference]
    with pytest.raises(ValueError, match="do not divide"):
        list(continuous.generate_continuous(target, None, requests, config, batch_size=3,
                                          mesh=mesh))
