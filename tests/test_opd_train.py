"""Draft-OPD training runs (``objective='opd'``: `train.opd_step`, `train.opd_rollouts`,
`train.opd_phases`): the step's loss and gradients are `tev_jax.draft_opd.opd_loss` of
the drafter's rows on hand-built rounds; a resumed run equals an uninterrupted one; a
rollout refresh decodes with the trained drafter and changes the supervision."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import train_fixtures as tf
from tev_jax.draft_opd import OpdConfig, opd_loss
from tev_jax.models.drafter import anchor_hidden, draft_head
from tev_jax.models.lm_head import head_of
from tev_jax.tree_scoring import target_context
from train.config import TrainConfig
from train.loop import read_log, train
from train.opd_phases import FOLDER
from train.opd_rollouts import RolloutPlan, RoundBuffer, collect_rounds
from train.opd_step import OpdStepConfig, opd_loss_and_grads
from train.state import split_models

H = tf.BLOCK - 1


def _hand_built_buffer() -> RoundBuffer:
    """Three sequences by hand: rounds with accepted drafts and a correction, a fully
    accepted round, a round rejected at once, a round with a floored target token; the
    third sequence has one round only (padded when A = 2)."""
    rng = np.random.default_rng(5)
    tokens = rng.integers(4, 60, (3, tf.SEQ_LEN)).astype(np.int32)
    row = np.array([0, 0, 1, 1, 2], np.int32)
    anchor = np.array([3, 6, 2, 9, 4], np.int32)
    resp = np.array([[7, 9, -1], [5, 6, 8], [11, -1, -1], [30, 31, -1], [12, 13, 14]])
    resp_lp = np.array([[-0.1, -1.2, 0], [-0.3, -0.2, -0.9], [-1e-8, 0, 0],
                        [-14.0, -0.5, 0], [-0.4, -0.6, -2.0]], np.float32)
    rej = np.array([[-1, -1, 40], [-1, -1, -1], [42, 43, 44], [-1, -1, 20], [-1] * 3])
    rej_lp = np.array([[0, 0, -3.0], [0, 0, 0], [-0.2, -25.0, -1.0], [0, 0, -0.7],
                       [0] * 3], np.float32)
    return RoundBuffer(tokens=tokens, row_R=row, anchor_R=anchor,
                       response_RH=resp.astype(np.int32), response_logp_RH=resp_lp,
                       rejected_RH=rej.astype(np.int32), rejected_logp_RH=rej_lp,
                       block_lengths_R=np.array([2, 4, 1, 2, 4], np.int32))


def _reference_loss(params, graphs, frozen, batch, cfg: OpdConfig):
    """`opd_loss` over dense logits, each round's block run through the drafter on its
    own (one anchor per forward)."""
    target = nnx.merge(graphs.target, frozen.target)
    drafter = nnx.merge(graphs.drafter, params, frozen.drafter_rest)
    head = draft_head(drafter, target)
    assert head.softcap is None and head.multiplier == 1.0
    w = head_of(target).w
    feats, _ = target_context(target, batch.tokens, tuple(drafter.config.target_layer_ids),
                              with_cache=False)
    b, a = batch.anchors.shape
    rows = []
    for j in range(a):
        h = anchor_hidden(drafter, target, feats, batch.tokens, batch.anchors[:, j:j + 1])
        rows.append(jnp.einsum("bahd,vd->bahv", h, w) if head.vocab_major
                    else jnp.einsum("bahd,dv->bahv", h, w))
    logits = jnp.concatenate(rows, axis=1)
    return opd_loss(logits, batch.response, batch.response_logp, batch.rejected,
                    batch.rejected_logp, batch.valid, cfg)[0]


@pytest.mark.parametrize("cfg", [OpdConfig(), pytest.param(  # the fast tier's time, 2026-12-06
    OpdConfig(rejected_weight=2.0, decay=0.9), marks=pytest.mark.slow)])
def test_step_equals_the_draft_opd_loss_on_hand_built_rounds(cfg):
    target, drafter = tf.models()
    buffer = _hand_built_buffer()
    batch = jax.tree.map(jnp.asarray, buffer.batch_at(seed=0, step=0, batch_size=3,
                                                      num_anchors=2))
    # every sequence is drawn once; the one-round sequence is padded
    assert sorted(np.asarray(batch.valid).sum(1).tolist()) == [1, 2, 2]
    graphs, frozen, params = split_models(target, drafter)
    scfg = OpdStepConfig(opd=cfg, taps=tuple(drafter.config.target_layer_ids), horizon=H,
                         vocab_block=16)
    grads, metrics = jax.jit(opd_loss_and_grads, static_argnums=(1, 4))(
        params, graphs, frozen, batch, scfg)
    reference = jax.jit(jax.value_and_grad(_reference_loss), static_argnums=(1, 4))
    ref, ref_grads = reference(params, graphs, frozen, batch, cfg)
    assert float(metrics["loss"]) == pytest.approx(float(ref), rel=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=1e-6)
    assert float(metrics["grad_norm"]) > 0
    # negative control: the rounds' anchors matter (one position later, another loss)
    shifted = batch.replace(anchors=batch.anchors + 1)
    assert abs(float(reference(params, graphs, frozen, shifted, cfg)[0]) - float(ref)) > 1e-4


def _cfg(out_dir, **kw) -> TrainConfig:
    base = dict(objective="opd", steps=6, opd_steps=2, opd_prompts=8, opd_rollout_batch=4,
                opd_max_new_tokens=12, budget=6, num_anchors=4, checkpoint_every=1,
                keep_checkpoints=10)
    base.update(kw)
    return tf.config(out_dir, **base)


def _run(out_dir, until_update=None, **kw):
    target, drafter = tf.models()
    return train(_cfg(out_dir, **kw), target=target, drafter=drafter, data=tf.progressions(),
                 until_update=until_update, progress=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted 6-update run (3 rollout phases), and the same run stopped after
    update 3 (inside phase 1), resumed to update 4 (the first update of phase 2, whose
    rollouts were not made yet) and resumed to the end."""
    whole = tmp_path_factory.mktemp("whole")
    parts = tmp_path_factory.mktemp("parts")
    full = _run(whole)
    stops = [_run(parts, until_update=until) for until in (3, 4, None)]
    return whole, parts, full, stops


@pytest.mark.slow
def test_resumed_opd_run_equals_an_uninterrupted_one(runs):
    whole, parts, full, stops = runs
    assert [s.start_update for s in stops] == [0, 3, 4] and stops[-1].update == 6
    for a, b in zip(jax.tree.leaves(full.state.params), jax.tree.leaves(stops[-1].state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    log_a, log_b = read_log(whole / "train_log.jsonl"), read_log(parts / "train_log.jsonl")
    assert [r["update"] for r in log_b] == list(range(1, 7))
    for ra, rb in zip(log_a, log_b):
        assert ra["loss"] == rb["loss"] and ra["rollout_tau"] == rb["rollout_tau"]
    for phase in range(3):
        a = RoundBuffer.load(whole / FOLDER / f"phase-{phase:06d}.npz")
        b = RoundBuffer.load(parts / FOLDER / f"phase-{phase:06d}.npz")
        assert a.fingerprint() == b.fingerprint() and a.info == b.info
    # the losses move: the run trains
    assert log_a[-1]["loss"] != log_a[0]["loss"]


@pytest.mark.slow  # issue 58, item 11: the fast tier's headroom
def test_resume_inside_a_phase_needs_its_rollouts(tmp_path):
    _run(tmp_path, steps=4, until_update=3, checkpoint_every=100, keep_checkpoints=1)
    # the one checkpoint (update 3) is in phase 1: phase 0's rollouts were deleted
    assert sorted(p.name for p in (tmp_path / FOLDER).iterdir()) == ["phase-000001.npz"]
    (tmp_path / FOLDER / "phase-000001.npz").unlink()
    with pytest.raises(ValueError, match="rollouts of phase 1"):
        _run(tmp_path, steps=4)


@pytest.mark.slow
def test_a_rollout_refresh_changes_the_supervision(runs, tmp_path):
    """Phase 1's rollouts are the drafter after update 2 decoding phase 1's prompts: the
    same prompts, key and plan with that drafter give them back bit for bit; with the
    initial drafter they differ (the refresh is on-policy). Every round's committed
    tokens are the sequence's tokens after its anchor."""
    whole = runs[0]
    target, drafter = tf.models()
    at2 = train(_cfg(tmp_path), target=target, drafter=drafter, data=tf.progressions(),
                until_update=2, progress=False).drafter
    buf = RoundBuffer.load(whole / FOLDER / "phase-000001.npz")
    assert buf.info["update"] == 2 and buf.info["phase"] == 1
    prompts = [tf.progressions().read(np.array([i]))[0, :int(tf.progressions().spans[i, 0])]
               .tolist() for i in buf.info["prompt_ids"]]
    plan = RolloutPlan(max_new_tokens=12, builder="ddtree", budget=6, verifier="tev",
                       temperature=0.0, batch_size=4,
                       prompt_len=int(tf.progressions().spans[:, 0].max()))
    key = jax.random.fold_in(jax.random.key(0), 1)
    again = collect_rounds(target, at2, prompts, plan, key)
    assert again.fingerprint() == buf.fingerprint()
    stale = collect_rounds(target, drafter, prompts, plan, key)
    assert stale.fingerprint() != buf.fingerprint()
    assert not np.array_equal(stale.rejected_RH, buf.rejected_RH) or \
        stale.num_rounds != buf.num_rounds
    # alignment: the committed tokens of a round follow its anchor in the sequence
    for r in range(buf.num_rounds):
        seq = buf.tokens[buf.row_R[r]]
        for o in range(H):
            pos = buf.anchor_R[r] + 1 + o
            if buf.response_RH[r, o] >= 0 and pos < len(seq) and seq[pos]:
                assert buf.response_RH[r, o] == seq[pos]
    # and the refresh changed what the run trains on between phases 0 and 1
    buf0 = RoundBuffer.load(whole / FOLDER / "phase-000000.npz")
    assert buf0.info["params"] != buf.info["params"]


def test_objective_flag_and_the_older_loss_spelling():
    assert TrainConfig(loss="token").objective == "token"
    assert TrainConfig(objective="token").run_fingerprint() == \
        TrainConfig(loss="token").run_fingerprint()
    with pytest.raises(ValueError, match="objective must be one of"):
        TrainConfig(objective="dpo")
    with pytest.raises(ValueError, match="opd run takes no loss"):
        TrainConfig(objective="opd", loss="token")
    with pytest.raises(ValueError, match="opd_steps must be a positive int"):
        TrainConfig(objective="opd", opd_steps=0)
    # opd fields are part of an opd run's fingerprint only
    assert "opd_steps" in TrainConfig(objective="opd").run_fingerprint()
    assert "opd_steps" not in TrainConfig().run_fingerprint()
    json.dumps(TrainConfig(objective="opd").to_dict())


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (host) devices")
def test_opd_run_on_a_mesh_equals_the_single_device_run(tmp_path):
    """The sharded step (drafter and batch over data x fsdp, the target fsdp-sharded) and
    the rollouts decoded on the same mesh train the drafter as one device does."""
    one = _run(tmp_path / "one", steps=3)
    mesh = _run(tmp_path / "mesh", steps=3, mesh_data=2, mesh_fsdp=2)
    for a, b in zip(jax.tree.leaves(one.state.params), jax.tree.leaves(mesh.state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-5)
    la, lb = read_log(tmp_path / "one" / "train_log.jsonl"), read_log(
        tmp_path / "mesh" / "train_log.jsonl")
    assert [r["rollout_tau"] for r in la] == [r["rollout_tau"] for r in lb]
    np.testing.assert_allclose([r["loss"] for r in la], [r["loss"] for r in lb], rtol=1e-4)


@pytest.mark.slow
def test_plan_of_the_opd_step_and_its_rollout_programs(tmp_path, capsys):
    """``tev-train plan --objective opd``: the OPD step's arguments are the token step's
    plus the rounds' four [B, A, H] arrays less the token batch's in_bounds [B, A];
    the rollout prefill and round are compiled too."""
    from train.__main__ import main

    config_json = tmp_path / "config.json"
    config_json.write_text(json.dumps(tf.TARGET.to_hf()))
    b, a = 4, 2
    common = ["plan", "--target", str(config_json), "--num-taps", "2", "--block-size",
              str(tf.BLOCK), "--batch", str(b), "--seq-len", str(tf.SEQ_LEN), "--anchors",
              str(a), "--budget", "8", "--mesh-fsdp", "1", "--json"]
    assert main(common + ["--objective", "token"]) == 0
    token = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(common + ["--objective", "opd", "--rollout-batch", "2",
                          "--rollout-prompt-len", "8", "--rollout-new-tokens", "8"]) == 0
    opd = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert opd["objective"] == "opd" and token["objective"] == "token"
    assert opd["argument_bytes"] - token["argument_bytes"] == 4 * b * a * H * 4 - b * a * 4
    assert opd["model_flops"] == token["model_flops"]          # neither scores trees
    programs = opd["rollouts"]["programs"]
    assert set(programs) == {"prefill", "round"}
    assert all(p["argument_bytes"] > 0 for p in programs.values())
    assert main(common + ["--objective", "dpo"]) == 2
    assert "--objective must be one of" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_opd_run_preempted_and_resumed_equals_an_uninterrupted_one(tmp_path, capsys,
                                                                      monkeypatch):
    """``tev-train run --objective opd --init-from DRAFTER``: SIGTERM during update 2
    saves a checkpoint and exits 75; the same command resumes and ends with the summary;
    the drafter equals the one of an uninterrupted run."""
    import os
    import signal

    from safetensors.numpy import load_file

    from train import __main__ as train_cli

    tf.write_train_dirs(tmp_path)
    argv = lambda out: [
        "run", "--objective", "opd", "--target-path", str(tmp_path / "target"),
        "--init-from", str(tmp_path / "drafter"), "--data-dir", str(tmp_path / "data"),
        "--out-dir", str(out), "--steps", "4", "--opd-steps", "2", "--opd-prompts", "4",
        "--opd-rollout-batch", "4", "--opd-max-new-tokens", "8", "--budget", "6",
        "--batch-size", "4", "--num-anchors", "4", "--lr", "0.01", "--warmup-steps", "0",
        "--no-progress"]
    assert train_cli.main(argv(tmp_path / "whole")) == 0
    capsys.readouterr()

    read = RoundBuffer.batch_at

    def batch_at(self, seed, step, *args, **kw):
        if step == 1:                      # preempted during update 2
            os.kill(os.getpid(), signal.SIGTERM)
        return read(self, seed, step, *args, **kw)

    monkeypatch.setattr(RoundBuffer, "batch_at", batch_at)
    assert train_cli.main(argv(tmp_path / "parts")) == 75
    assert "train run: preempted (SIGTERM) at update 2: checkpoint saved in " in (
        capsys.readouterr().err)
    monkeypatch.setattr(RoundBuffer, "batch_at", read)
    assert train_cli.main(argv(tmp_path / "parts")) == 0
    summary = capsys.readouterr().out
    assert "updates 3..4 of 4" in summary and "opd_response" in summary
    assert "rollout_tau" in summary
    a = load_file(tmp_path / "whole" / "drafter" / "model.safetensors")
    b = load_file(tmp_path / "parts" / "drafter" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_comparison_arms_match_updates_schedule_and_batch(tmp_path):
    """experiments/draft_opd: every arm fine-tunes the same base drafter with the same
    updates, learning-rate schedule, batch, anchors and seed; the arms differ only in
    the objective's fields, and the paired ratios and the winner rule read the records
    as the issue states (≥ 3 % above token-only by 2 paired SE in every cell)."""
    from types import SimpleNamespace

    import experiment_scripts
    from train.__main__ import build_parser, config_from_args

    study = experiment_scripts.load("draft_opd")
    args = SimpleNamespace(snapshot_every=50, opd_steps=10, opd_prompts=16,
                           opd_max_new_tokens=160)
    configs = {arm: config_from_args(build_parser().parse_args(["run", *study.pc.flags(dict(
        study.arm_flags(arm, args, 200, 1), target_path="T", data_dir="d",
        drafter_path="base", out_dir=str(tmp_path / arm)))]))
        for arm in ("token", "exittrain", "opd")}
    assert {a: c.objective for a, c in configs.items()} == {
        "token": "token", "exittrain": "exittrain", "opd": "opd"}
    matched = ("steps", "lr", "warmup_steps", "end_lr_ratio", "batch_size", "num_anchors",
               "seed", "drafter_path", "weight_decay", "b1", "b2", "grad_clip", "budget")
    for name in matched:
        assert len({getattr(c, name) for c in configs.values()}) == 1, name
    assert configs["opd"].opd_steps == 10 and configs["opd"].opd_temperature == 0.0
    assert configs["exittrain"].loss == "reach" and configs["exittrain"].exit_prefix_window == 64

    def rec(drafter, values, budget=64, temp=0.0):
        return dict(drafter=drafter, budget=budget, temperature=temp, set="gsm",
                    values=values, prompt=[0, 0, 1, 1])

    cells = [(64, 0.0)]
    base = [2.0, 2.0, 4.0, 4.0]
    records = [rec("base", base)]
    for s, gain in zip((0, 1, 2), (1.10, 1.12, 1.08)):
        records += [rec(f"token-s{s}", base), rec(f"opd-s{s}", [v * gain for v in base]),
                    rec(f"exittrain-s{s}", [v * (1.02 + 0.04 * (s - 1)) for v in base])]
    run_args = SimpleNamespace(arms=["token", "exittrain", "opd"], seeds=[0, 1, 2])
    summ = study.summary(records, run_args, cells)
    assert summ["B64-T0"]["opd"]["vs_token"] == pytest.approx(1.10)
    assert summ["B64-T0"]["opd"]["se_paired"] == pytest.approx(0.02 / np.sqrt(3))
    assert study.winners(summ, run_args.arms) == ["opd"]   # exittrain: 1.02 ± 0.023
