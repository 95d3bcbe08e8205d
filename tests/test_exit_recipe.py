"""The authors' ExitTrain recipe as options: the edge-probability floor of the reach, the
'reach' weighting, a callable weighting, the 'nodes' normaliser of the exit term, and the
``--recipe paper`` preset (against float64 loops and hand-computed sums)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import experiment_scripts
import train_fixtures as tf
from test_exit_train import random_tree, stack
from tev_jax.exit_law import exit_law, floored_reach
from tev_jax.exit_train import objective
from tev_jax.exit_weights import exit_loss, node_weights, tree_exit_weights
from tev_jax.sampling import Sampling
from tev_jax.testing import reference as ref
from train.__main__ import build_parser, config_from_args
from train.config import RECIPES, TrainConfig
from train.loop import step_config

FLOOR = 0.05  # large enough that some edges of the random trees fall below it


def floored_reach_loops(tokens, parents, logp, floor):
    """``prod max(p_parent(token), floor)`` along each path, one node at a time."""
    p = np.exp(logp)
    reach = np.ones(len(tokens))
    for i in range(1, len(tokens)):
        reach[i] = reach[parents[i]] * max(p[parents[i], tokens[i]], floor)
    return reach


def _random_batch(seed=3, count=6, n=9, v=5, h=4):
    rng = np.random.default_rng(seed)
    trees = [random_tree(rng, n, v, h) for _ in range(count)]
    logits = (rng.standard_normal((count, n, v)) * 3).astype(np.float32)
    return trees, logits


def test_floored_weights_match_loops_and_the_floor_bites():
    trees, logits = _random_batch()
    n, v = logits.shape[1:]
    batched = stack(trees, (2, 3))
    _, law = jax.jit(lambda t, z: tree_exit_weights(t, z, Sampling(1.0), "exit"))(
        batched, jnp.asarray(logits).reshape(2, 3, n, v))
    got = {k: np.asarray(node_weights(batched, law, k, FLOOR)).reshape(6, n)
           for k in ("exit", "exit_depth", "prefix", "reach")}
    exact_reach = np.asarray(node_weights(batched, law, "reach")).reshape(6, n)
    bites = 0
    for i, tree in enumerate(trees):
        tokens, parents, m = ref.host_tree(tree)
        logp = ref.log_probs(logits[i])
        reach, rho, _, _ = ref.exit_law_loops(tokens, parents, logp)
        reach_f = floored_reach_loops(tokens, parents, logp, FLOOR)
        depth = np.asarray(ref.depths_of(parents, m), np.float64)
        for name, want in (("reach", reach_f), ("exit", reach_f * rho),
                           ("exit_depth", reach_f * rho * depth), ("prefix", reach)):
            want = want.copy()
            want[0] = 0.0
            np.testing.assert_allclose(got[name][i, :m], want, rtol=1e-5, atol=1e-7,
                                       err_msg=name)
            np.testing.assert_array_equal(got[name][i, m:], 0.0)
        np.testing.assert_allclose(exact_reach[i, 1:m], reach[1:m], rtol=1e-5, atol=1e-7)
        bites += int(np.sum(reach_f[1:] > reach[1:] * (1 + 1e-3)))
    assert bites >= 3, "negative control: the floor must change some weights"
    # single tree, through the exit law directly: same as its row of the batch
    law0 = exit_law(trees[0], jnp.asarray(logits[0]), Sampling(1.0))
    np.testing.assert_allclose(
        jnp.where(trees[0].valid, floored_reach(trees[0], law0.log_a, FLOOR), 0.0)[1:],
        np.where(np.arange(n)[1:] < ref.host_tree(trees[0])[2], got["reach"][0, 1:], 0.0),
        rtol=1e-6)


def test_callable_weighting_is_applied_per_tree_detached_and_masked():
    trees, logits = _random_batch(seed=5)
    n, v = logits.shape[1:]
    batched = stack(trees, (2, 3))
    _, law = tree_exit_weights(batched, jnp.asarray(logits).reshape(2, 3, n, v),
                               Sampling(1.0), "exit")

    def rho_plus_slot(tree, law):   # one tree: [N]
        assert tree.tokens.shape == (n,)
        return law.rho + jnp.arange(n, dtype=jnp.float32)

    got = np.asarray(node_weights(batched, law, rho_plus_slot)).reshape(6, n)
    rho = np.asarray(law.rho).reshape(6, n)
    for i, tree in enumerate(trees):
        m = ref.host_tree(tree)[2]
        np.testing.assert_allclose(got[i, 1:m], rho[i, 1:m] + np.arange(1, m), rtol=1e-6)
        assert got[i, 0] == 0 and np.all(got[i, m:] == 0)
    # detached: no gradient flows through the callable's output
    grad = jax.grad(lambda s: jnp.sum(node_weights(
        batched, law, lambda t, l: l.rho * s)))(2.0)
    assert grad == 0.0
    # and the (non-detached) sum of the same function does have one: the control
    assert jax.grad(lambda s: jnp.sum(law.rho * s))(2.0) != 0.0


@pytest.mark.parametrize("bad, what", [
    (lambda t, l: l.rho[:-1], r"shape \(8,\)"),
    (lambda t, l: jnp.ones((9, 2)), r"shape \(9, 2\)"),
    (lambda t, l: t.depths, r"shape \(9,\) and dtype int32"),
    (lambda t, l: 1.0, "shape None"),
])
def test_callable_weighting_of_wrong_shape_or_dtype_is_a_clear_error(bad, what):
    trees, logits = _random_batch(count=2)
    t = stack(trees, (2,))
    _, law = tree_exit_weights(t, jnp.asarray(logits), Sampling(1.0), "exit")
    with pytest.raises(ValueError, match="exit weighting .*must return a float array of "
                                         r"shape \(9,\).*got " + what):
        node_weights(t, law, bad)


@pytest.mark.parametrize("floor", [-0.1, 1.0, True, "1e-4"])
def test_bad_floor_and_weighting_names_are_errors(floor):
    trees, logits = _random_batch(count=1)
    law = exit_law(trees[0], jnp.asarray(logits[0]), Sampling(1.0))
    with pytest.raises(ValueError, match="exit_floor"):
        node_weights(trees[0], law, "reach", floor)
    with pytest.raises(ValueError, match="unknown exit weighting 'P_tgt'"):
        node_weights(trees[0], law, "P_tgt")


# ---------------------------------------------------------------------- normaliser


def test_nodes_normaliser_divides_by_the_valid_anchors_tree_nodes():
    rng = np.random.default_rng(1)
    b, a, h, v, n = 2, 3, 4, 11, 9
    trees = stack([random_tree(rng, n, v, h) for _ in range(b * a)], (b, a))
    logits = jnp.asarray(rng.standard_normal((b, a, h, v)) * 3, jnp.float32)
    labels = jnp.asarray(rng.integers(0, v, (b, a, h)), jnp.int32)
    valid = jnp.asarray([[True, False, True], [True, True, False]])
    edge = np.asarray(trees.valid & (trees.depths > 0)) & np.asarray(valid)[:, :, None]
    weights = jnp.asarray(np.where(edge, rng.random((b, a, n)) * 0.1, 0.0), jnp.float32)
    cfg = step_config(tf.config("unused", exit_lambda=0.3), tf.models()[1]).objective
    by_weight = objective(logits, labels, valid, trees, weights, cfg)[1]["exit_loss"]
    nodes_cfg = dataclasses.replace(cfg, exit_normalizer="nodes")
    total, aux = objective(logits, labels, valid, trees, weights, nodes_cfg)
    parts = exit_loss(logits, trees, weights)
    np.testing.assert_allclose(by_weight, parts.total / parts.weight, rtol=1e-6)
    np.testing.assert_allclose(aux["exit_loss"], parts.total / edge.sum(), rtol=1e-6)
    np.testing.assert_allclose(total, aux["token_loss"] + 0.3 * aux["exit_loss"], rtol=1e-6)
    # the weights sum to far less than the node count: the two normalisers must differ
    assert float(aux["exit_loss"]) < 0.2 * float(by_weight)
    grad = jax.grad(lambda x: objective(x, labels, valid, trees, weights, nodes_cfg)[0])(logits)
    assert np.all(np.isfinite(grad))


def test_step_config_checks_the_recipe_fields():
    cfg = step_config(tf.config("unused"), tf.models()[1]).objective
    for bad in (dict(exit_normalizer="count"), dict(exit_floor=1.5), dict(loss="P_tgt")):
        with pytest.raises(ValueError):
            dataclasses.replace(cfg, **bad)
    custom = dataclasses.replace(cfg, loss=lambda t, l: l.reach)
    assert custom.builds_trees and callable(custom.weighting)


# -------------------------------------------------------------------------- config


def test_train_config_fields_and_the_paper_recipe(tmp_path):
    with pytest.raises(ValueError, match="exit_normalizer"):
        TrainConfig(exit_normalizer="nodes ")
    with pytest.raises(ValueError, match="exit_floor"):
        TrainConfig(exit_floor=-1e-4)
    parse = lambda *a: config_from_args(build_parser().parse_args(["run", *a]))
    paper = parse("--recipe", "paper")
    for k, v in RECIPES["paper"].items():
        assert getattr(paper, k) == v, k
    assert (paper.loss, paper.exit_normalizer, paper.exit_floor, paper.exit_lambda) == (
        "reach", "nodes", 1e-4, 0.1)
    assert parse().exit_normalizer == "weight" and parse().exit_floor == 0.0
    assert parse("--recipe", "paper", "--exit-lambda", "0.3").exit_lambda == 0.3
    f = tmp_path / "c.json"
    f.write_text('{"exit_normalizer": "weight", "budget": 64}')
    over = parse("--recipe", "paper", "--config", str(f))
    assert (over.exit_normalizer, over.budget, over.loss) == ("weight", 64, "reach")
    with pytest.raises(SystemExit):
        parse("--recipe", "authors")
    scfg = step_config(paper, tf.models()[1]).objective
    assert (scfg.exit_normalizer, scfg.exit_floor, scfg.loss) == ("nodes", 1e-4, "reach")
    assert scfg.prefix_window == 64 and not scfg.needs_cache   # the authors' scoring pass
    assert parse("--recipe", "paper", "--exit-prefix-window", "32").exit_prefix_window == 32
    f.write_text('{"exit_prefix_window": null}')          # the whole prefix, as before
    assert parse("--recipe", "paper", "--config", str(f)).exit_prefix_window is None
    with pytest.raises(ValueError, match="prefix_window"):
        TrainConfig(exit_prefix_window=-1)
    with pytest.raises(ValueError, match="cannot be combined"):
        TrainConfig(exit_prefix_window=64, score_capacities=(0.5,))
    assert paper.partial_anchors and not parse().partial_anchors   # their partial blocks
    assert not parse("--recipe", "paper", "--partial-anchors", "false").partial_anchors
    with pytest.raises(ValueError, match="drafter_every"):
        TrainConfig(drafter_every=-1)


@pytest.mark.slow  # the fast tier's time (README: under 10 minutes here), 2026-12-06
def test_paper_recipe_trains(tmp_path):
    """A few steps of the paper's recipe and of a callable weighting run and lower the
    token loss on the learnable task (same as the other objectives)."""
    from train.loop import train

    fields = {k: v for k, v in RECIPES["paper"].items()
              if k not in ("budget", "num_anchors", "batch_size", "lr")}
    target, drafter = tf.models()
    result = train(tf.config(tmp_path / "paper", steps=12, **fields), target=target,
                   drafter=drafter, data=tf.progressions(), progress=False)
    losses = [h["token_loss"] for h in result.history]
    assert np.isfinite(losses).all() and np.mean(losses[-3:]) < np.mean(losses[:3])
    assert all(h["exit_weight"] > 0 for h in result.history)


# ------------------------------------------------------------------ the sweep script


def test_sweep_variants_parse_and_the_paper_point_is_the_recipe(tmp_path):
    from pathlib import Path

    sweep = experiment_scripts.load("exit_recipe")
    assert len(sweep.GRID) == 1 + 2 * 4 * 4 and set(sweep.SUBSET) <= set(sweep.GRID)
    configs = {}
    for name in sweep.GRID:
        argv = sweep.train_args(sweep.VARIANTS[name], sweep.BASE, "T", Path("runs"),
                                Path("d"), tmp_path / name)
        configs[name] = config_from_args(build_parser().parse_args(argv))
        assert configs[name].out_dir == str(tmp_path / name)
    fields = ("loss", "exit_normalizer", "exit_lambda", "exit_floor")
    paper = RECIPES["paper"]
    assert tuple(getattr(configs["paper"], k) for k in fields) == tuple(paper[k] for k in fields)
    # equal updates, data and optimiser: the configs differ only in the objective
    shared = {k: v for k, v in configs["token"].to_dict().items()
              if k not in fields + ("objective", "out_dir")}
    for cfg in configs.values():
        assert {k: v for k, v in cfg.to_dict().items() if k in shared} == shared
    assert len({tuple(getattr(c, k) for k in fields + ("objective",))
                for c in configs.values()}) == len(configs)


def test_sweep_validation_prompts_are_disjoint_from_the_test_prompts():
    import paper_common as pc
    from tev_jax.data import load_default_tokenizer

    sweep = experiment_scripts.load("exit_recipe")
    setup = pc.Setup(prompts_per_set=16)
    tok = load_default_tokenizer()
    test, val = pc.eval_prompts(tok, setup), sweep.validation_prompts(tok, setup)
    for name in setup.sets:
        assert len(val[name]) == 8 and len(test[name]) == 16
        assert not {tuple(p) for p in val[name]} & {tuple(p) for p in test[name]}, name


def test_strength_study_fine_tunes_differ_only_in_the_objective(tmp_path):
    """experiments/exit_strength: its three fine-tunes share data, updates, optimiser and
    the authors' partial blocks; 'paper' is the whole recipe (objective, scoring window,
    partial anchors) and the base run's snapshots are where the study reads them."""
    from pathlib import Path

    study = experiment_scripts.load("exit_strength")
    configs = {name: config_from_args(build_parser().parse_args(recipe_argv))
               for name, flags in study.VARIANTS.items()
               for recipe_argv in [study.recipe.train_args(
                   flags, study.FINETUNE, "T", Path("d"), Path("base"), tmp_path / name)]}
    objective = ("loss", "exit_normalizer", "exit_lambda", "exit_floor",
                 "exit_prefix_window", "temperature")     # t0-*: the exit law at T = 0
    assert {name: c.temperature for name, c in configs.items() if c.temperature != 1.0} == {
        "t0-paper": 0.0, "t0-weight-exit-l0.3": 0.0}
    paper = configs["paper"]
    for k in objective + ("partial_anchors",):
        assert getattr(paper, k) == RECIPES["paper"][k], k
    shared = {k: v for k, v in configs["token"].to_dict().items()
              if k not in objective + ("objective", "out_dir")}
    assert shared["partial_anchors"] and shared["drafter_path"] == "base"
    for cfg in configs.values():
        assert {k: v for k, v in cfg.to_dict().items() if k in shared} == shared
    runs = tmp_path / "runs"
    assert study.snapshot_path(runs, 500, 5000) == runs / "base" / "drafters" / "update-500"
    assert study.snapshot_path(runs, 5000, 5000) == runs / "base" / "drafter"
    base = config_from_args(build_parser().parse_args(["run", *study.pc.flags(dict(
        study.BASE_RUN, out_dir="o", steps=5000, drafter_every=500))]))
    assert (base.objective, base.drafter_every, base.partial_anchors) == ("token", 500, False)
