"""The shared code of the paper-reproduction studies (experiments/paper_common.py).

On a tiny random target/drafter pair saved and reloaded through the library's checkpoint
functions: batch-1 timed runs reproduce the AR tokens at T = 0 and give τ = (sum of block
lengths) / rounds consistent with the number of generated tokens; the captured decode
round's logits equal a plain forward pass over context + tree path; tables have a column
per set plus the average; at T = 0 every fixed-tree verification has the exit law's length.
The figures study draws an exit tree with whole depths and a clear root label.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import experiment_scripts  # noqa: E402
import paper_common as pc  # noqa: E402
from tev_jax.models import score  # noqa: E402
from tev_jax.sampling import Sampling  # noqa: E402
from tev_jax.tree import validate  # noqa: E402

SETS = ("gsm", "math")
BUDGET = 6
SETUP = pc.Setup(prompts_per_set=1, max_new_tokens=10, prompt_len=24, temperatures=(0.0,),
                 sets=SETS, stop=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("paper_models")
    target_dir, drafter_root = pc.make_random_models(root, ("dflash", "ft_exit"), layers=1)
    return pc.load_models(target_dir, drafter_root, ("dflash", "ft_exit"))


@pytest.fixture(scope="module")
def prompts(models):
    return pc.eval_prompts(models.tokenizer, SETUP)


def test_prompt_selection_and_truncation():
    assert pc.select_indices(80, 8) == [0, 11, 23, 34, 45, 56, 68, 79]
    assert pc.select_indices(3, 8) == [0, 1, 2]
    assert pc.truncate([1, 2, 3, 4, 5], 3) == [1, 4, 5]
    assert pc.truncate([1, 2], 3) == [1, 2]


def test_timed_runs_match_ar_and_count_rounds(models, prompts):
    methods = [pc.AR, pc.exittrain_method(BUDGET)]
    records = pc.timed_runs(models, methods, prompts, SETUP)
    assert len(records) == len(methods) * len(SETS)
    horizon = models.drafters["ft_exit"].config.block_size - 1
    for r in records:
        assert r["matches_ar"], r  # T = 0: every exact verifier follows the argmax
        assert r["tokens"] == SETUP.max_new_tokens  # no stop tokens: M per prompt
        # every round emits its block; the first token comes from the prefill
        assert r["tau"] == pytest.approx(r["block_sum"] / r["rounds"])
        assert SETUP.max_new_tokens - 1 <= r["block_sum"] <= SETUP.max_new_tokens - 1 + horizon
        assert 1.0 <= r["tau"] <= horizon + 1
        assert r["sr"] > 0
    assert all(r["tau"] == 1.0 and r["sr"] == 1.0 for r in pc.select(records, method="AR"))
    table = pc.per_set_table(records, [m.label for m in methods], 0.0, ("tau", "sr"), SETS,
                             ratio_rows=[(methods[1].label, methods[0].label)])
    lines = table.splitlines()
    assert len(lines) == 2 + len(methods) + 1
    assert lines[0].count("|") - 1 == 1 + 2 * len(SETS) + 2  # sets x (τ, SR) + averages
    ar_row = lines[2].split("|")[1:-1]
    assert ar_row[0].strip() == "AR" and all(c.strip() == "1.00" for c in ar_row[1:])


def test_captured_round_is_a_real_decode_round(models, prompts):
    contexts = [ps[0] + [7] for ps in prompts.values()]
    cap = pc.capture_trees(models, "dflash", contexts, BUDGET)
    horizon = models.drafters["dflash"].config.block_size - 1
    # reference: a plain causal forward over context + the path to the deepest last node
    # (one fixed width, read at the last real position: causal logits ignore what follows)
    graphdef, state = nnx.split(models.target)
    forward = jax.jit(lambda st, toks: score(nnx.merge(graphdef, st), toks))
    seqs, nodes = [], []
    for c, ctx in enumerate(contexts):
        tree = cap.tree_at(c)
        validate(tree, horizon)
        assert int(tree.tokens[0]) == ctx[-1] and cap.starts[c] == len(ctx) - 1
        node = int(np.flatnonzero(np.asarray(tree.valid))[-1])
        path = [node]
        while path[-1] > 0:
            path.append(int(tree.parents[path[-1]]))
        seqs.append(ctx[:-1] + [int(tree.tokens[i]) for i in reversed(path)])
        nodes.append(node)
    width = max(map(len, seqs))
    logits = np.asarray(forward(state, jnp.asarray([s + [0] * (width - len(s)) for s in seqs],
                                                   jnp.int32)))
    for c, (seq, node) in enumerate(zip(seqs, nodes)):
        np.testing.assert_allclose(cap.logits[c, node], logits[c, len(seq) - 1],
                                   atol=2e-4, rtol=2e-4)
    # at T = 0 the exit law is a point mass: every verification has length 1 + C exactly
    greedy = Sampling(temperature=0.0)
    law = pc.exit_laws(cap, greedy)
    np.testing.assert_allclose(law.w.sum(-1), 1.0, atol=1e-5)
    lengths = pc.fixed_tree_lengths(cap, greedy, "tev", horizon, draws=5)
    np.testing.assert_array_equal(
        lengths, np.repeat(np.asarray(law.expected_length).round().astype(int)[:, None], 5, 1))


def test_coverage_study_is_the_greedy_block_length_at_t0(models, prompts):
    cov = experiment_scripts.load("coverage")
    cuts = [0, 2, 5]
    records = cov.coverage(models, prompts, SETUP, cuts, BUDGET, ("dflash", "ft_exit"))
    assert len(records) == 2 * len(SETS)
    horizon = models.drafters["dflash"].config.block_size - 1
    conts = pc.target_continuations(models, prompts, SETUP)
    for r in records:
        ps = prompts[r["set"]]
        contexts = [list(p) + c[: k + 1] for p, c in zip(ps, conts[r["set"]]) for k in cuts]
        assert r["contexts"] == len(contexts) == len(r["values"]) == len(r["prompt"])
        # an independent path: the greedy verifier's block length on the same trees
        cap = pc.capture_trees(models, r["drafter"], contexts, BUDGET)
        greedy = pc.fixed_tree_lengths(cap, Sampling(temperature=0.0), "greedy", horizon, 1)
        np.testing.assert_allclose(r["values"], greedy[:, 0], atol=1e-5)


def test_coverage_ratios_are_paired_and_harmonic():
    cov = experiment_scripts.load("coverage")
    ref = dict(values=[1.0, 2.0, 4.0, 1.5], prompt=[0, 0, 1, 1])
    same_shift = dict(values=[2.0, 4.0, 8.0, 3.0], prompt=ref["prompt"])  # 2x everywhere
    one_prompt = dict(values=[2.0, 4.0, 4.0, 1.5], prompt=ref["prompt"])  # 2x on prompt 0
    for harmonic in (True, False):
        assert cov.avg_ratio([ref], [ref], harmonic) == (1.0, 0.0)
        ratio, se = cov.avg_ratio([same_shift], [ref], harmonic)
        assert ratio == pytest.approx(2.0) and se == pytest.approx(0.0, abs=1e-12)
        ratio, se = cov.avg_ratio([one_prompt], [ref], harmonic)
        assert 1.0 < ratio < 2.0 and se > 0.05  # the gain is one prompt's: not certain
    assert cov.set_mean(ref, harmonic=True) == pytest.approx(4 / (1 + 0.5 + 0.25 + 1 / 1.5))
    assert cov.set_mean(ref, harmonic=False) == pytest.approx(8.5 / 4)


def test_studies_default_to_the_bundled_models_in_a_fresh_clone(tmp_path):
    """From a clone (nothing trained in runs/), a study's default flags name the bundled
    target and drafters; drafters the package does not ship name the command that trains
    them; a trained target in runs/, or explicit flags, are used as given."""
    from tev_jax.models import bundled_paths

    runs_target, runs_drafters = tmp_path / "target" / "hf", tmp_path / "drafters"
    where = dict(trained_target=runs_target, trained_drafters=runs_drafters)
    bundle = bundled_paths(verify=False)
    target, drafters = pc.study_model_dirs(runs_target, runs_drafters, ("dflash", "ft_exit"),
                                           **where)
    assert target == bundle.target
    assert drafters == {"dflash": bundle.drafters["dflash"],
                        "ft_exit": bundle.drafters["exittrain"]}
    with pytest.raises(ValueError, match=r"ft_token, ft_prefix.*python -m train\.demo\.build"):
        pc.study_model_dirs(runs_target, runs_drafters, ("ft_token", "ft_prefix", "ft_exit"),
                            **where)
    mine = tmp_path / "mine"
    assert pc.study_model_dirs(mine, runs_drafters, ("dflash",), **where) == (
        mine, {"dflash": runs_drafters / "dflash" / "drafter"})
    runs_target.mkdir(parents=True)
    (runs_target / "config.json").write_text("{}")
    assert pc.study_model_dirs(runs_target, runs_drafters, ("ft_token",), **where) == (
        runs_target, {"ft_token": runs_drafters / "ft_token" / "drafter"})


@pytest.mark.skipif((pc.DEFAULT_TARGET / "config.json").is_file(),
                    reason="runs/ holds trained study models, which the defaults then name")
def test_a_study_with_default_flags_loads_the_bundled_models():
    args = pc.study_parser("A study.").parse_args(["--quick"])
    models = pc.models_from_args(args, ("dflash", "ft_exit"))
    assert set(models.drafters) == {"dflash", "ft_exit"}
    assert "exittrain" in models.source["ft_exit"]
    assert models.target.config.vocab_size == models.tokenizer.get_vocab_size()


def test_quick_runs_do_not_replace_the_full_results():
    step = experiment_scripts.load("drafter_step")
    assert Path(step.parse_args(["--quick"]).out).name == "results_quick.json"
    assert Path(step.parse_args([]).out).name == "results.json"
    assert step.parse_args(["--quick", "--out", "x.json"]).out == "x.json"


def test_exit_tree_figure_has_whole_depths_and_a_clear_root(tmp_path):
    """Issue 47, item 15 (experiments/figures): the depth axis has ticks at whole depths
    only, and the root's label sits left of the root, clear of its children."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = experiment_scripts.load("figures")
    tree = dict(tokens=[1, 2, 3, 4], parents=[-1, 0, 0, 1], depths=[0, 1, 1, 2],
                reach=[1.0, 0.6, 0.3, 0.4], w=[0.1, 0.2, 0.3, 0.4], coverage=1.3)

    class Tok:
        def decode(self, ids, **kw):
            return f"t{ids[0]}"

    fig, ax = plt.subplots()
    figures.draw_tree(ax, tree, Tok(), "t", 0.4)
    assert list(ax.get_xticks()) == [0, 1, 2]
    root = [t for t in ax.texts if t.get_text().startswith("root")]
    assert len(root) == 1 and root[0].get_horizontalalignment() == "right"
    plt.close(fig)
