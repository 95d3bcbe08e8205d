"""Draft-OPD (tev_jax.draft_opd): its loss against a direct computation on a hand-built
rollout, and the supervision read from the engine's own rounds (tev_jax.trace)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decode_fixtures import tiny_target
from tev_jax import decode, engine
from tev_jax.draft_opd import OpdConfig, opd_loss, round_targets
from tev_jax.models.drafter_io import init_drafter
from tev_jax.models.lm_head import head_of, head_rows
from tev_jax.sampling import Sampling

H = 4


def _direct(logits, resp, resp_lp, rej, rej_lp, valid, cfg):
    """The objective term by term in float64 Python (the module docstring's formulas)."""
    num = den = 0.0
    for x in np.ndindex(valid.shape):
        if not valid[x]:
            continue
        for o in range(resp.shape[-1]):
            row = logits[x + (o,)].astype(np.float64)
            logq = row - (row.max() + math.log(np.exp(row - row.max()).sum()))
            if resp[x + (o,)] >= 0:
                lp = max(float(resp_lp[x + (o,)]), cfg.logp_floor)
                lq = max(float(logq[resp[x + (o,)]]), cfg.logp_floor)
                p, q = math.exp(lp), math.exp(lq)
                kl = p * (lp - lq) + (1 - p) * (math.log(1 - p) - math.log(1 - q))
                num += cfg.response_weight * min(kl, cfg.cap)
                den += cfg.response_weight
            if rej[x + (o,)] >= 0:
                d = float(np.clip(rej_lp[x + (o,)] - logq[rej[x + (o,)]], -cfg.cap, cfg.cap))
                w = cfg.decay ** o
                num += cfg.rejected_weight * w * min(math.exp(d) - d - 1, cfg.cap)
                den += cfg.rejected_weight * w
    return num / den


def _rollout():
    """Two rows x two anchors over a vocabulary of 12, by hand: anchor (0, 0) accepted
    one draft then the target corrected (rejected tail at offsets 2-4); (0, 1) fully
    accepted (no rejection); (1, 0) rejected at once, a near-certain target token
    (P ~ 1) and a very unlikely one (floored); (1, 1) not a real anchor."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 2, H, 12)).astype(np.float32) * 2
    resp = np.array([[[3, 7, -1, -1], [1, 2, 3, 4]], [[5, -1, -1, -1], [0, 0, 0, 0]]])
    resp_lp = np.array([[[-0.2, -1.5, 0, 0], [-0.1, -0.3, -0.9, -2.0]],
                        [[-1e-8, 0, 0, 0], [0, 0, 0, 0]]], np.float32)
    rej = np.array([[[-1, 9, 4, 4], [-1] * 4], [[6, 2, 11, -1], [1, 1, 1, 1]]])
    rej_lp = np.array([[[0, -3.0, -0.7, -25.0], [0] * 4], [[-14.0, -2.0, -0.05, 0],
                                                         [-1, -1, -1, -1]]], np.float32)
    valid = np.array([[True, True], [True, False]])
    return logits, resp, resp_lp, rej, rej_lp, valid


@pytest.mark.parametrize("cfg", [OpdConfig(), OpdConfig(response_weight=1.0,
                                                        rejected_weight=2.0, decay=0.9),
                                 OpdConfig(rejected_weight=0.0)])
def test_loss_equals_a_direct_computation_on_a_hand_built_rollout(cfg):
    arrays = _rollout()
    total, aux = opd_loss(*map(jnp.asarray, arrays[:-1]), jnp.asarray(arrays[-1]), cfg)
    assert float(total) == pytest.approx(_direct(*arrays, cfg), rel=1e-5)
    assert float(aux["opd_rejected_weight"]) == pytest.approx(sum(   # (1, 1) not counted
        cfg.decay ** o for x in ((0, 0), (1, 0)) for o in range(H) if arrays[3][x + (o,)] >= 0))
    # negative control: the rejected tail matters (without it the loss differs)
    if cfg.rejected_weight:
        no_tail = opd_loss(*map(jnp.asarray, arrays[:3]), jnp.full((2, 2, H), -1),
                           jnp.asarray(arrays[4]), jnp.asarray(arrays[-1]), cfg)[0]
        assert abs(float(no_tail) - float(total)) > 1e-3


def test_loss_over_head_rows_equals_dense_logits_and_has_gradients():
    rng = np.random.default_rng(1)
    target = tiny_target(seed=3)
    head = head_of(target)
    hidden = jnp.asarray(rng.normal(size=(2, 2, H, target.config.hidden_size)), jnp.float32)
    logits = jnp.einsum("xahd,vd->xahv", hidden, head.w) if head.vocab_major else \
        jnp.einsum("xahd,dv->xahv", hidden, head.w)
    _, resp, resp_lp, rej, rej_lp, valid = _rollout()
    args = tuple(map(jnp.asarray, (resp, resp_lp, rej, rej_lp))) + (jnp.asarray(valid),)
    loss = lambda h: opd_loss(head_rows(h, head, 64), *args, OpdConfig())[0]
    grad = jax.grad(loss)(hidden)
    assert np.isfinite(float(loss(hidden))) and float(jnp.abs(grad).max()) > 0
    assert float(jnp.abs(grad[1, 1]).max()) == 0           # not a real anchor
    dense = opd_loss(logits, *args, OpdConfig())[0]
    assert float(dense) == pytest.approx(float(loss(hidden)), rel=1e-4)


@pytest.fixture(scope="module")
def rollout():
    target = tiny_target(seed=38)
    drafter = init_drafter(target, num_layers=1, block_size=H + 1,
                           mask_token_id=target.config.vocab_size - 1, key=1)
    prompts = [[5, 17, 3], [9, 1, 2, 33, 60, 7], [30]]
    config = decode.DecodeConfig(max_new_tokens=40, budget=6, builder="ddtree",
                                 sampling=Sampling(0.0))
    return prompts, engine.generate(target, drafter, prompts, config, key=2, trace=True)


def test_round_targets_record_the_engines_rounds_and_rejections(rollout):
    """Per row: one entry per round the row decoded; the committed tokens rebuild the
    generation; each round supervises min(accepted + 1, H) tokens; where a draft was
    rejected, the rejected proposal at that offset is the drafter's most probable child
    of the exit node and (greedy verification) differs from the target's token."""
    prompts, gen = rollout
    t = gen.trace
    rejections = 0
    for b, row in enumerate(gen.rows()):
        rt = round_targets(t, b, H)
        lengths = gen.stats.block_lengths[:, b]
        lengths = lengths[lengths > 0]
        assert len(rt.anchors_R) == len(lengths) == gen.stats.rounds_per_row[b]
        np.testing.assert_array_equal((rt.response_RH >= 0).sum(1), np.minimum(lengths, H))
        rebuilt = [int(t.tree.tokens[0, b, 0])]
        for i, n in enumerate(lengths):
            rebuilt += [int(x) for x in rt.response_RH[i] if x >= 0]
            if n == H + 1:                                  # the dropped bonus
                r = np.flatnonzero(t.active_RB[:, b])[i]
                rebuilt.append(int(t.verdict.bonus[r, b]))
        assert rebuilt[:len(row)] == row
        np.testing.assert_array_equal(rt.anchors_R[1:], rt.anchors_R[:-1] + lengths[:-1])
        for i, n in enumerate(lengths):
            if n <= H and rt.rejected_RH[i, n - 1] >= 0:
                rejections += 1
                assert rt.rejected_RH[i, n - 1] != rt.response_RH[i, n - 1]
                assert (rt.rejected_RH[i, :n - 1] == -1).all()
                assert rt.rejected_logp_RH[i, n - 1] < 0
    assert rejections >= 5                   # the random drafter is rejected often
