"""The sampling transform (temperature, top-k, top-p) against a float64 numpy loop."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tev_jax.sampling import Sampling, check_finite, log_probs
from tev_jax.testing import reference as ref

SAMPLINGS = [
    Sampling(1.0),
    Sampling(0.6),
    Sampling(2.0),
    Sampling(1.0, top_k=1),
    Sampling(0.8, top_k=4),
    Sampling(1.0, top_p=0.5),
    Sampling(0.7, top_p=0.95),
    Sampling(1.2, top_k=5, top_p=0.8),
    Sampling(0.0),
]


@functools.lru_cache(maxsize=None)
def _fn(sampling):
    return jax.jit(functools.partial(log_probs, sampling=sampling))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), sampling=st.sampled_from(SAMPLINGS),
       scale=st.sampled_from([0.1, 1.0, 5.0]))
def test_matches_numpy(seed, sampling, scale):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((6, 16)) * scale).astype(np.float32)
    holes = rng.random(logits.shape) < 0.1
    holes[:, 3] = False  # keep every row's support non-empty
    logits[holes] = -np.inf
    got = np.asarray(_fn(sampling)(logits))
    want = ref.log_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], atol=2e-5)
    np.testing.assert_allclose(np.exp(got).sum(-1), 1.0, atol=1e-5)


def test_top_k_keeps_ties_at_the_kth_value():
    logits = np.array([[3.0, 2.0, 2.0, 1.0, 0.0]], np.float32)
    got = np.asarray(log_probs(logits, Sampling(1.0, top_k=2)))
    np.testing.assert_array_equal(np.isfinite(got), [[True, True, True, False, False]])


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    p = np.array([0.5, 0.25, 0.15, 0.1])
    logits = np.log(p).astype(np.float32)[None]
    for top_p, kept in [(0.4, 1), (0.6, 2), (0.8, 3), (0.95, 4), (1.0, 4)]:
        got = np.asarray(log_probs(logits, Sampling(1.0, top_p=top_p)))
        assert np.isfinite(got).sum() == kept, top_p
        np.testing.assert_allclose(np.exp(got[0, :kept]), p[:kept] / p[:kept].sum(), rtol=1e-5)


def test_temperature_zero_is_one_hot_at_the_first_argmax():
    logits = np.array([[0.0, 2.0, 2.0, 1.0], [5.0, -1.0, 5.0, 0.0]], np.float32)
    got = np.asarray(log_probs(logits, Sampling(0.0)))
    np.testing.assert_array_equal(got == 0, [[0, 1, 0, 0], [1, 0, 0, 0]])
    assert np.all((got == 0) | (got == -np.inf))


def test_top_k_at_least_vocab_is_plain_temperature():
    logits = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    np.testing.assert_allclose(
        log_probs(logits, Sampling(0.9, top_k=5)), log_probs(logits, Sampling(0.9)), atol=1e-6
    )


def test_sampling_is_a_frozen_hashable_static_argument():
    s = Sampling(0.5, top_k=3)
    assert hash(s) == hash(Sampling(0.5, top_k=3)) and s == Sampling(0.5, top_k=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.temperature = 1.0
    f = jax.jit(log_probs, static_argnames="sampling")
    np.testing.assert_allclose(f(np.zeros((1, 4)), sampling=s), np.log(0.25), atol=1e-6)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=0), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
    ],
)
def test_bad_sampling_is_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Sampling(**kwargs)


def test_check_finite():
    good = np.array([[0.0, -np.inf, 1.0]], np.float32)
    check_finite(good)
    with pytest.raises(ValueError, match=r"NaN or \+inf \(first at index \(0, 1\)\)"):
        check_finite(np.array([[0.0, np.nan, 1.0]]))
    with pytest.raises(ValueError, match="NaN or"):
        check_finite(np.array([[0.0, np.inf]]))
    with pytest.raises(ValueError, match="every token is -inf"):
        check_finite(np.array([[0.0, 1.0], [-np.inf, -np.inf]]))
