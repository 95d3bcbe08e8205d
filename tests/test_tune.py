"""The budget from the exit law (tev_jax.costs.tune) and budget='auto'.

- DDTree trees are nested: the budget-b tree is the first b + 1 slots of the budget-N
  tree (property test on random draft logits, ties excluded), so one exit law at budget
  N gives 1 + C of every smaller tree.
- τ(b) read from the budget-N law equals the mean block length of the exact verifiers
  (TEV, predraw) on the budget-b trees: z-tests at a stated significance, with a
  negative control (the budget-N value against budget-b lengths) that must be rejected.
- End to end at T = 0 the prediction is exact: `tune` on a tiny target predicts the
  τ that `engine.generate` measures, to float precision.
- The tuning file round-trips and is refused for other models or another vocabulary;
  budget='auto' picks per batch size in generate, the CLI and continuous batching (which
  moves its last rows onto smaller slot programs and keeps exact greedy tokens).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cli_fixtures import nothing_but, prompts_file, refused_one_line
from decode_fixtures import TableDrafter, greedy_reference, oracle_table, tiny_target
from hypothesis import given, settings
from hypothesis import strategies as st

from tev_jax import cli, ddtree, decode, engine, extensions, programs, slots
from tev_jax.batch import continuous
from tev_jax.budget import AutoBudget, model_fingerprint, resolve_budget
from tev_jax.costs import round_costs, tune
from tev_jax.data import load_default_tokenizer
from tev_jax.exit_law import exit_law
from tev_jax.models import ModelConfig, init_target, save_target
from tev_jax.models.drafter_io import init_drafter, save_drafter
from tev_jax.prompts import Request
from tev_jax.runtime import platforms
from tev_jax.sampling import Sampling
from tev_jax.testing import draw_verdicts
from tev_jax.verify import predraw, tev

V = 64
H = 4
M = 16
N_MAX = 8  # the largest budget of the end-to-end tuning


@pytest.fixture(scope="module")
def models():
    """A tiny target and a context-free drafter whose rows are the target's greedy chain
    after the root alone, plus noise: right often, not always."""
    target = tiny_target(seed=6)
    table = oracle_table(target, [1], H)
    noise = np.random.default_rng(0).standard_normal(table.shape) * 2.0
    return target, TableDrafter(table + noise)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(0, V, size=int(n)).tolist() for n in (5, 9, 12)]


PROGRESS: list[tuple[str, int, int]] = []  # what the tuned fixture's tuner reported


@pytest.fixture(scope="module")
def tuned(models, prompts):
    target, drafter = models
    config = decode.DecodeConfig(max_new_tokens=M, prompt_len=16)
    return tune.tune(target, drafter, prompts, config, budgets=(2, N_MAX),
                     batch_sizes=(1,), repeats=1,
                     progress=lambda *step: PROGRESS.append(step))


def test_tune_reports_progress(tuned):
    """Issue 47, item 11: the tuner reports the prompts, the contexts and the budget
    programs as it gets them done (tev-jax tune draws a bar of each)."""
    whats = [w for w, _, _ in PROGRESS]
    assert whats.index("prompts") < whats.index("contexts") < whats.index("programs")
    # programs: AR and the two budgets, each a round and a no-op (its dispatch)
    assert ("prompts", 3, 3) in PROGRESS and ("programs", 6, 6) in PROGRESS
    assert ("timed passes", 1, 1) in PROGRESS
    assert all(0 <= done <= total for _, done, total in PROGRESS)
    # issue 51, item 7: each step shows its bar at 0 before its first compilation, so
    # the previous bar does not sit full while the next step compiles
    for what in ("prompts", "contexts", "programs", "timed passes"):
        assert next(done for w, done, _ in PROGRESS if w == what) == 0, what


# ------------------------------------------------------------------- nested trees


@functools.lru_cache(maxsize=None)
def _build(budget: int):
    return jax.jit(jax.vmap(lambda x, r: ddtree.build_tree(x, r, budget)))


@functools.lru_cache(maxsize=None)
def _laws(sampling: Sampling):
    return jax.jit(jax.vmap(lambda t, x: exit_law(t, x, sampling)))


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([0.3, 1.0, 4.0]),
       temperature=st.sampled_from([0.0, 1.0]))
def test_trees_are_nested_and_tau_comes_from_one_law(seed, scale, temperature):
    """Budget-b trees are prefixes of the budget-N tree (ties excluded: scores equal in
    float32 are dropped); the prefix sums of the budget-N reach are 1 + C of each."""
    rng = np.random.default_rng(seed)
    c, h, v, big = 32, 4, 12, 24
    logits = jnp.asarray(rng.standard_normal((c, h, v)) * scale, jnp.float32)
    roots = jnp.asarray(rng.integers(0, v, c), jnp.int32)
    tree_n, info_n = _build(big)(logits, roots)
    score = np.asarray(info_n.score)[:, 1:]
    valid = np.asarray(tree_n.valid)[:, 1:]
    ties = np.array([len(set(s[m])) < m.sum() for s, m in zip(score, valid)])
    target_logits = jnp.asarray(rng.standard_normal((c, big + 1, v)) * 2, jnp.float32)
    sampling = Sampling(temperature=temperature)
    law_n = _laws(sampling)(tree_n, target_logits)
    tr = tune.TreeReach(reach=np.asarray(law_n.reach, np.float64),
                        depth=np.asarray(tree_n.depths), prompt=np.arange(c),
                        position=np.zeros(c, int), lengths=np.full(c, 2), horizon=h)
    tau_cb = tune.tau_per_context(tr)
    for b in (1, 5, 16):
        tree_b, _ = _build(b)(logits, roots)
        for field in ("tokens", "parents", "depths", "valid"):
            got = np.asarray(getattr(tree_b, field))[~ties]
            want = np.asarray(getattr(tree_n, field))[~ties, : b + 1]
            np.testing.assert_array_equal(got, want, err_msg=f"{field} at budget {b}")
        law_b = _laws(sampling)(tree_b, target_logits[:, : b + 1])
        np.testing.assert_allclose(tau_cb[~ties, b],
                                   np.asarray(law_b.expected_length)[~ties], atol=2e-5)


# ------------------------------------------------- the law against exact verifiers

ALPHA_Z = 4.42  # two-sided 1e-5 per comparison: 4 comparisons stay below 1e-4 overall
DRAWS = 10_000


def _one_tree(seed: int, budget: int):
    """Random draft logits [1, H, V], their DDTree of ``budget`` nodes ([1, N]), and
    target logits at its nodes that follow the draft (so that target flow goes deep)."""
    rng = np.random.default_rng(seed)
    h, v = 3, 10
    draft = jnp.asarray(rng.standard_normal((1, h, v)) * 1.5, jnp.float32)
    tree, _ = _build(budget)(draft, jnp.zeros(1, jnp.int32))
    depth = np.asarray(tree.depths)[0]
    target = np.asarray(draft)[0, np.clip(depth, 0, h - 1)] * 1.2 + rng.standard_normal(
        (budget + 1, v)) * 0.5
    return draft, tree, jnp.asarray(target, jnp.float32)[None]


def test_tau_is_the_mean_block_length_of_exact_verifiers():
    """At T = 0.8, top-p 0.95, seed 0, 10 000 draws per (verifier, budget): the mean
    block length on the budget-b tree is within 4.42 standard errors of τ(b) read from
    the budget-12 law; τ(b + 1), one node more (negative control), is rejected."""
    big, h = 12, 3
    sampling = Sampling(temperature=0.8, top_p=0.95)
    draft, tree_n, logits_n = _one_tree(0, big)
    law = _laws(sampling)(tree_n, logits_n)
    tr = tune.TreeReach(reach=np.asarray(law.reach, np.float64),
                        depth=np.asarray(tree_n.depths), prompt=np.zeros(1, int),
                        position=np.zeros(1, int), lengths=np.full(1, 2), horizon=h)
    tau_b = tune.tau_per_context(tr)[0]
    for b in (2, 5):
        tree_b, _ = _build(b)(draft, jnp.zeros(1, jnp.int32))  # = the first b + 1 slots
        np.testing.assert_array_equal(np.asarray(tree_b.parents),
                                      np.asarray(tree_n.parents)[:, : b + 1])
        tree_b = jax.tree.map(lambda x: x[0], tree_b)
        for verifier in (tev, predraw):
            lengths = draw_verdicts(verifier, tree_b, logits_n[0, : b + 1], sampling,
                                    horizon=h, num_draws=DRAWS, seed=b).length
            se = lengths.std(ddof=1) / np.sqrt(DRAWS)
            z = (lengths.mean() - tau_b[b]) / se
            assert abs(z) < ALPHA_Z, (verifier.__name__, b, lengths.mean(), tau_b[b])
            z_control = (lengths.mean() - tau_b[b + 1]) / se
            assert abs(z_control) > ALPHA_Z, (verifier.__name__, b, "control not rejected")


# --------------------------------------------------------------------- end to end


def test_prediction_equals_generate_at_t0(models, prompts, tuned):
    """At T = 0 every block length is determined, so the visit-weighted τ(b) is what
    `engine.generate` measures (to float precision), at every tuned budget."""
    target, drafter = models
    for b in (2, N_MAX):
        config = decode.DecodeConfig(max_new_tokens=M, budget=b, prompt_len=16)
        gen = engine.generate(target, drafter, prompts, config)
        assert tuned.tau[b] == pytest.approx(gen.stats.tau, abs=1e-9), b
        assert tuned.tau_se[b] >= 0
    assert tuned.tau[N_MAX] > tuned.tau[2] > 1.0


def test_best_budget_is_the_fastest_choice_ar_included():
    tau = {16: 2.0, 64: 3.0}
    cost = {1: {16: 1.0, 64: 1.2}, 8: {16: 3.0, 64: 8.0}}
    best = round_costs.best_budgets(tau, cost, ar={1: 0.9, 8: 1.0})
    assert best[1]["budget"] == 64 and best[1]["speedup"] == pytest.approx(3.0 * 0.9 / 1.2)
    assert best[8] == {"budget": 0, "tau": 1.0, "tokens_per_second": 8.0, "speedup": 1.0}


# ------------------------------------------------------------------- tuning files


def test_tuning_file_round_trips_and_feeds_auto(tmp_path, tuned, models):
    path = tmp_path / "tune.json"
    tuned.write(path)
    raw = json.loads(path.read_text())
    for key in tune.TUNING_KEYS:
        assert key in raw
    assert set(raw["cost_seconds"]) == {"1"} and set(raw["tau"]) == {"2", str(N_MAX)}
    assert set(raw["best"]["1"]) == {"budget", "tau", "tokens_per_second", "speedup"}
    again = tune.Tuning.read(path)
    assert again == tuned
    config = decode.DecodeConfig(budget="auto", tuning=str(path))
    auto = config.budget
    assert isinstance(auto, AutoBudget) and auto.source == str(path)
    assert auto.table == ((1, tuned.best[1]["budget"]),)
    hash(config)  # a static jit argument
    target, drafter = models
    resolved = resolve_budget(config, 1, target, drafter)
    want = tuned.best[1]["budget"]
    assert (resolved.builder, resolved.budget) == (("none", 64) if want == 0
                                                   else ("ddtree", want))


def test_tuning_refuses_other_models_and_bad_files(tmp_path, tuned, models):
    target, drafter = models
    path = tmp_path / "tune.json"
    tuned.write(path)
    config = decode.DecodeConfig(budget="auto", tuning=str(path))
    cfg = target.config
    with pytest.raises(ValueError, match="vocabulary of 64 tokens, but this target has 96"):
        resolve_budget(config, 1, init_target(dataclasses.replace(cfg, vocab_size=96)),
                              drafter)
    with pytest.raises(ValueError, match="target's architecture differs"):
        resolve_budget(config, 1, init_target(dataclasses.replace(cfg, num_layers=3)),
                              drafter)
    with pytest.raises(ValueError, match="the weights differ"):
        resolve_budget(config, 1, tiny_target(seed=4), drafter)
    with pytest.raises(ValueError, match="drafter's architecture differs"):
        resolve_budget(config, 1, target, init_drafter(target, num_layers=1,
                                                              block_size=H + 1,
                                                              mask_token_id=V - 1))
    with pytest.raises(ValueError, match="needs a tuning file"):
        decode.DecodeConfig(budget="auto")
    (tmp_path / "bad.json").write_text(json.dumps({"tau": {}}))
    with pytest.raises(ValueError, match="not a tuning file"):
        decode.DecodeConfig(budget="auto", tuning=str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="not a tuning file: missing"):
        tune.Tuning.read(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="cannot read the tuning file"):
        decode.DecodeConfig(budget="auto", tuning=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="resolve budget='auto'"):
        engine.Engine.create(target, drafter, config, 1, prompt_len=8)


# ------------------------------------------------------------ auto per batch size


def test_auto_picks_per_batch_size(models, prompts):
    target, drafter = models
    auto = AutoBudget(((3, N_MAX), (8, 0), (1, 2)))
    assert auto.table == ((1, 2), (3, N_MAX), (8, 0))
    assert [auto.pick(b) for b in (1, 2, 3, 4, 5, 6, 64)] == [2, N_MAX, N_MAX, N_MAX, 0, 0, 0]
    config = decode.DecodeConfig(max_new_tokens=M, budget=auto, prompt_len=16)
    three = engine.generate(target, drafter, prompts, config)
    fixed = engine.generate(target, drafter, prompts,
                            dataclasses.replace(config, budget=N_MAX))
    assert three.rows() == fixed.rows() and three.stats.rounds == fixed.stats.rounds
    assert three.stats.tau > 1.0
    six = engine.generate(target, drafter, prompts * 2, config)
    assert six.stats.tau == 1.0 and six.rows() == three.rows() * 2  # AR at B = 6


@pytest.mark.slow
def test_continuous_batching_switches_budgets_on_smaller_slots(models):
    """Mixed table (AR at 2 slots, a tree at 1): rows stop at different rounds, the last
    one moves onto the 1-slot program, and every request keeps its greedy tokens."""
    target, drafter = models
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, V - 1, size=int(k)).tolist() for k in rng.integers(1, 16, 5)]
    reference = greedy_reference(target, prompts, M)
    # a stop token that ends some rows, at different positions, and not others
    firsts = {t: {row.index(t) for row in reference if t in row} for t in range(V)}
    stop = (max(range(V), key=lambda t: (len(firsts[t]) if
                                         sum(t in row for row in reference) < 4 else 0)),)
    auto = AutoBudget(((1, N_MAX), (2, 0)))
    config = decode.DecodeConfig(max_new_tokens=M, budget=auto, prompt_len=16,
                                 stop_token_ids=stop)
    plan = slots.slot_configs(config, 2)
    assert plan[1].budget == N_MAX and plan[1].builder == "ddtree"
    assert plan[2].builder is extensions.root_only_builder  # AR that keeps the context
    assert plan[1].max_cache_len == plan[2].max_cache_len
    before = programs.take_rows_jit._cache_size()
    got = {r.id: r for r in continuous.generate_continuous(
        target, drafter, [Request(i, p) for i, p in enumerate(prompts)], config,
        batch_size=2)}
    assert programs.take_rows_jit._cache_size() > before  # the tail moved to fewer slots
    for i in range(len(prompts)):
        want = reference[i]
        ends = [j for j, t in enumerate(want) if t in stop]
        assert got[i].token_ids == (want[: ends[0] + 1] if ends else want), i
    assert any(r.rounds and r.tau > 1.0 for r in got.values())  # trees ran at the tail


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install -e '.[tpu]')")
@pytest.mark.slow  # the fast tier's time (README: under 10 minutes here), 2026-12-06
def test_roofline_costs_for_a_tpu_slice():
    """--topology: the round and AR step compiled for v5e:2x4 (tensor 8), roofline
    seconds from the compiler's FLOPs and bytes; a tree round costs more than a step."""
    cfg = ModelConfig("qwen3", vocab_size=4096, hidden_size=256, intermediate_size=768,
                      num_layers=1, num_heads=16, num_kv_heads=8, head_dim=64, qk_norm=True,
                      tie_word_embeddings=True)
    cost, ar = round_costs.roofline_costs(cfg, decode.DecodeConfig(max_new_tokens=8, prompt_len=16),
                                   [16], [2], topology="v5e:2x4")
    assert set(cost) == {2} and set(cost[2]) == {16} and set(ar) == {2}
    assert cost[2][16] > ar[2] > 0
    with pytest.raises(ValueError, match="not a TPU slice name"):
        round_costs.roofline_costs(cfg, decode.DecodeConfig(prompt_len=16), [16], [2],
                            topology="nonsense")


@pytest.mark.skipif(not platforms.cuda_plugin_installed(),
                    reason="the CUDA plugin is not installed (pip install -e '.[gpu]')")
def test_costs_on_gpus_are_calibrated_where_the_gpu_was_measured():
    """--gpu: on an H200 (a committed table) the costs are the calibrated estimate, which
    pays every kernel launch (a tiny model's AR step: ~50 launches, ~0.1 ms); on an H100
    (no table) the roofline, a few microseconds for the same program."""
    cfg = ModelConfig("qwen3", vocab_size=4096, hidden_size=256, intermediate_size=768,
                      num_layers=1, num_heads=16, num_kv_heads=8, head_dim=64, qk_norm=True,
                      tie_word_embeddings=True)
    config = decode.DecodeConfig(max_new_tokens=8, prompt_len=16)
    assert round_costs.cost_basis("h200x1") == "calibrated estimate"
    assert round_costs.cost_basis("h100x1") == "roofline"
    cost, ar = round_costs.roofline_costs(cfg, config, [16], [2], gpu="h200x1")
    assert cost[2][16] > ar[2] >= 5e-5
    _, floor = round_costs.roofline_costs(cfg, config, [16], [2], gpu="h100x1")
    assert 0 < floor[2] < 1e-5
    with pytest.raises(ValueError, match="one of a TPU slice"):
        round_costs.roofline_costs(cfg, config, [16], [2], topology="v5e:2x4", gpu="h200x1")


# ----------------------------------------------------------------------------- cli


@pytest.mark.slow  # the fast tier's time (README: under 10 minutes here), 2026-12-06
def test_cli_tune_then_generate_auto(tmp_path, capsys, monkeypatch, tuned):
    """`tev-jax tune --json` on a saved tiny pair (the library call replaced by a
    stand-in that checks what the flags became), then `generate --budget auto` reads the
    file; a drafter it was not tuned for is refused in one line."""
    def stand_in(target, drafter, prompt_ids, config, *, budgets, batch_sizes, **kw):
        assert prompt_ids == [[1, 50, 60, 70], [1, 80, 90]]
        assert (budgets, batch_sizes, config.max_new_tokens) == ((2, 4), (1,), 6)
        assert config.sampling == Sampling(temperature=0.5, top_k=20)
        return dataclasses.replace(
            tuned, tau={2: 1.5, 4: 1.6}, tau_se={2: 0.1, 4: 0.1},
            cost_seconds={1: {2: 1.0, 4: 1.0}}, ar_seconds={1: 1.0},
            best={1: {"budget": 4, "tau": 1.6, "tokens_per_second": 1.6, "speedup": 1.6}},
            model=model_fingerprint(target, drafter))

    monkeypatch.setattr(tune, "tune", stand_in)
    tokenizer = load_default_tokenizer()
    cfg = ModelConfig(model_type="qwen3", vocab_size=tokenizer.get_vocab_size(),
                      hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, qk_norm=True)
    target = init_target(cfg, key=0)
    save_target(target, tmp_path / "target", tokenizer=tokenizer)
    for name, key in (("d1", 1), ("d2", 2)):
        save_drafter(init_drafter(target, num_layers=1, block_size=3, mask_token_id=5,
                                  key=key), tmp_path / name)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt_ids": ids}) + "\n"
                               for i, ids in enumerate([[1, 50, 60, 70], [1, 80, 90]])))
    common = ["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "d1")]
    out = tmp_path / "tune.json"
    assert cli.main(["tune", "--prompts", str(prompts), *common, "--budgets", "2,4",
                     "--batch", "1", "--max-new-tokens", "6", "--temperature", "0.5",
                     "--top-k", "20", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "tau(b)" in printed and "best" in printed
    tuning = json.loads(out.read_text())
    assert set(tuning["tau"]) == {"2", "4"} and set(tuning["best"]) == {"1"}
    assert cli.main(["generate", "hello", *common, "--budget", "auto", "--tuning", str(out),
                     "--max-new-tokens", "4"]) == 0
    assert "(budget 4, auto from" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["generate", "hello", "--target", str(tmp_path / "target"), "--drafter",
                  str(tmp_path / "d2"), "--budget", "auto", "--tuning", str(out)])
    assert "tuned for other models" in capsys.readouterr().err


def test_tune_refuses_before_tuning(tmp_path, capsys, monkeypatch):
    """Issue 38, item 11: tune's --repeats 0, an unwritable --json and --figure without
    matplotlib are refused before the tuning runs (whose result would be lost)."""
    p = str(prompts_file(tmp_path / "p.jsonl"))
    assert "--repeats must be >= 1, got 0" in refused_one_line(
        ["tune", "--prompts", p, "--repeats", "0"], capsys)
    assert "--json" in refused_one_line(
        ["tune", "--prompts", p, "--json", str(tmp_path / "x" / "t")], capsys)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    line = refused_one_line(["tune", "--prompts", p, "--figure", str(tmp_path / "t.png")],
                            capsys)
    assert "--figure" in line and "needs matplotlib" in line
    nothing_but(tmp_path, "p.jsonl")
