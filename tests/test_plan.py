"""Memory planning: abstract models, the compiled report, growth, the pre-flight check.

Everything here compiles small programs on abstract (weightless) models; nothing runs.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import pytest
from cli_fixtures import refused_one_line
from flax import nnx

from tev_jax import cli, decode, sharding, slots
from tev_jax.costs import plan
from tev_jax.costs.plan import GiB
from tev_jax.models import ModelConfig, init_target
from tev_jax.models.drafter_io import init_drafter
from tev_jax.sampling import Sampling

# Attention-heavy on purpose: a dense [T, T + L] score tensor would dominate its memory.
TINY = ModelConfig(model_type="qwen3", vocab_size=256, hidden_size=64,
                   intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, qk_norm=True)
CONFIG = decode.DecodeConfig(max_new_tokens=8, budget=8, prompt_len=256,
                             max_cache_len=512, sampling=Sampling(temperature=1.0))
# The autoregressive program (the prefill, the cache, one-token rounds) compiles fastest;
# tests that plan it with these settings share one compilation (jax caches it).
AR = dataclasses.replace(CONFIG, builder="none")


def _temp(batch=2, prompt_len=512, cache_len=1024) -> int:
    config = dataclasses.replace(AR, prompt_len=prompt_len, max_cache_len=cache_len)
    return plan.plan_decode(TINY, config, batch).temp_bytes


def test_abstract_models_hold_no_weights():
    target = plan.abstract_target(plan.preset("qwen3-8b"))
    drafter = plan.abstract_drafter(target.config, jnp.bfloat16, num_layers=2)
    assert type(target.embed_tokens.get_value()).__name__ == "ShapeDtypeStruct"
    assert target.embed_tokens.get_value().shape == (151_936, 4096)
    assert drafter.config.target_layer_ids == (1, 33)
    assert drafter.fc.kernel.get_value().dtype == jnp.bfloat16


def test_report_counts_parameters_and_caches():
    r32 = plan.plan_decode(TINY, AR, 2)
    r16 = plan.plan_decode(TINY, AR, 2, dtype=jnp.bfloat16)
    assert r32.argument_bytes >= 4 * TINY.num_params
    assert r32.output_bytes >= 2 * TINY.num_layers * 2 * 512 * TINY.num_kv_heads * 16 * 4
    assert r16.argument_bytes < 0.6 * r32.argument_bytes
    assert r32.peak_bytes == (r32.argument_bytes + r32.output_bytes + r32.temp_bytes
                              - r32.alias_bytes + r32.code_bytes)
    assert "temporary" in r32.format() and r32.compile_seconds >= 0


@pytest.mark.slow  # the fast tier's time (README: under 10 minutes here), 2026-12-06
def test_temporary_memory_grows_linearly():
    """Doubling B or L at most doubles scratch (+10%); doubling P and L together too.

    The last check fails with prefill attention that holds the [T, T + L] scores
    whole: they grow fourfold when both double. It starts from a prompt of one query
    block (512): below that a score block [T, min(T, 512)] itself grows with T.
    """
    base = _temp()
    assert _temp(batch=4) <= 2.2 * base
    assert _temp(cache_len=2048) <= 2.2 * base
    assert _temp(prompt_len=1024, cache_len=2048) <= 2.2 * base


def test_per_device_figures_on_a_mesh():
    one = plan.plan_decode(TINY, AR, 2)
    mesh = sharding.make_mesh(data=2, fsdp=1, tensor=2)
    split = plan.plan_decode(TINY, AR, 2, mesh=mesh)
    # tensor 2 halves every weight but the norms; data x tensor quarters the caches
    assert split.argument_bytes < 0.6 * one.argument_bytes
    assert split.output_bytes < 0.35 * one.output_bytes
    with pytest.raises(ValueError, match="batch"):
        plan.plan_decode(TINY, AR, 3, mesh=mesh)


@pytest.mark.slow  # the fast tier's time (README: under 10 minutes here), 2026-12-06
def test_serving_plan_has_a_line_per_slot_count_and_each_rows_settings(tmp_path, capsys):
    """Issue 59, item 1: ``tev-jax plan --serve`` compiles a round and an AR step at each
    slot count ``tev-jax serve --max-batch 4`` runs (1, 2, 4), with each row's own
    sampling: the round holds the rows' transformed [B, N, V] logits, so its peak grows
    with the slots, and equals `plan_serving`'s."""
    (tmp_path / "config.json").write_text(json.dumps(TINY.to_hf()))
    argv = ["plan", "--config", str(tmp_path), "--batch", "4", "--prompt-len", "64",
            "--max-new-tokens", "8", "--budget", "8", "--serve", "--json", "-"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    rows = json.loads(out[out.index("{"):])["slot_counts"]
    assert [r["slots"] for r in rows] == [1, 2, 4] and {r["budget"] for r in rows} == {8}
    peaks = [r["round_peak_bytes"] for r in rows]
    assert peaks == sorted(peaks) and peaks[0] < peaks[-1]
    config = decode.DecodeConfig(prompt_len=64, max_new_tokens=8, budget=8)
    direct = plan.plan_serving(TINY, slots.serving_configs(config, 4))
    assert direct[4].programs["round"].peak_bytes == peaks[-1]
    static = plan.plan_decode_programs(TINY, config, 4, programs=("round",))
    assert static.programs["round"].temp_bytes < direct[4].programs["round"].temp_bytes


def test_model_config_from_preset_file_and_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY.to_hf()))
    assert plan.model_config(str(tmp_path)) == TINY
    assert plan.model_config(str(tmp_path / "config.json"), num_layers=1).num_layers == 1
    assert plan.model_config("qwen3-4b", num_layers=2).hidden_size == 2560
    with pytest.raises(ValueError, match="neither a model preset"):
        plan.model_config(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="num_layers"):
        plan.model_config("qwen3-4b", num_layers=0)


def test_plan_command_json(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(TINY.to_hf()))
    argv = ["plan", "--config", str(tmp_path), "--batch", "2", "--prompt-len", "256",
            "--cache-len", "512", "--max-new-tokens", "8", "--budget", "8",
            "--builder", "none", "--temperature", "1", "--programs", "generation",
            "--json", "-"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    full = json.loads(out)
    assert "[1/1] generation compiled" in err  # a line per program (issue 58, item 9)
    assert cli.main(argv + ["--layers", "1"]) == 0
    fewer = json.loads(capsys.readouterr().out)
    assert full["layers"] == 2 and fewer["layers"] == 1
    direct = plan.plan_decode(TINY, AR, 2)
    assert full["programs"]["generation"]["temp_bytes"] == direct.temp_bytes
    assert fewer["programs"]["generation"]["argument_bytes"] < direct.argument_bytes
    with pytest.raises(SystemExit):
        cli.main(["plan", "--model", "qwen3-4b", "--config", str(tmp_path)])


def test_plan_flags_are_checked(capsys):
    """Issue 38, item 13 (tev-jax plan): --tau below 1, and --tau without a roofline (no
    --topology), are refused; so are --batch 0 and --layers 0."""
    base = ["plan", "--model", "qwen3-0.6b", "--layers", "1", "--programs", "prefill"]
    assert "--tau must be a number >= 1" in refused_one_line(base + ["--tau", "-1"], capsys)
    assert "--tau needs a roofline" in refused_one_line(base + ["--tau", "4"], capsys)
    assert "--batch must be >= 1" in refused_one_line(base + ["--batch", "0"], capsys)
    assert "--layers must be >= 1" in refused_one_line(base[:3] + ["--layers", "0"], capsys)


# ------------------------------------------------------------------------ pre-flight


@pytest.fixture(scope="module")
def tiny_models():
    target = init_target(TINY, key=0)
    return target, init_drafter(target, num_layers=1, block_size=4, mask_token_id=255, key=1)


def _refuse_compiling(*_):
    raise AssertionError("the analytic floor should have refused before compiling")


def test_preflight_refuses_from_shapes_before_compiling(tiny_models, monkeypatch):
    target, drafter = tiny_models
    config = dataclasses.replace(CONFIG, budget=2000, max_cache_len=None)
    floor = plan.decode_floor(target, drafter, config, 1)
    assert floor["tree mask"] == 2001 ** 2 and floor["tree logits"] == 2001 * 256 * 4
    monkeypatch.setattr(plan, "available_bytes", lambda devices=None: (2**20, "test memory"))
    monkeypatch.setattr(plan, "compile_report", _refuse_compiling)
    with pytest.raises(plan.NotEnoughMemory, match=r"lower budget \(2000\)") as e:
        plan.check_decode_fits(target, drafter, config, 1)
    assert "\n" not in str(e.value) and "of test memory is free" in str(e.value)


def test_a_wide_budget_is_refused_before_compiling_naming_every_part(tiny_models, monkeypatch):
    """Issue 51, item 7: at budget 100000 the exact verifiers' float32 table over node
    pairs (37 GiB) is part of the floor, so a machine with 20 GiB refuses it from shapes
    (it compiled first, then refused 84.5 GiB); the parts printed add up to the total."""
    target, drafter = tiny_models
    config = dataclasses.replace(CONFIG, budget=100_000, max_cache_len=None)
    floor = plan.decode_floor(target, drafter, config, 1)
    assert floor["verifier pairs"] == 4 * 100_001 ** 2
    greedy = dataclasses.replace(config, verifier="greedy", sampling=Sampling(temperature=0.0))
    assert plan.decode_floor(target, drafter, greedy, 1)["verifier pairs"] == 0
    monkeypatch.setattr(plan, "available_bytes", lambda devices=None: (20 * GiB, "test memory"))
    monkeypatch.setattr(plan, "compile_report", _refuse_compiling)
    with pytest.raises(plan.NotEnoughMemory) as e:
        plan.check_decode_fits(target, drafter, config, 1)
    total, parts = re.search(r"needs ([\d.]+) GiB per device \((.*) GiB\)", str(e.value)).groups()
    assert "verifier pairs 37.25" in parts and "lower budget (100000)" in str(e.value)
    assert sum(float(x) for x in re.findall(r" ([\d.]+)(?: \+|$)", parts)) == pytest.approx(
        float(total), abs=0.02)


def test_a_compiled_shortfall_names_what_the_floor_does_not():
    msg = plan.shortfall(10 * GiB, {"kv cache": GiB, "tree mask": 2 * GiB, "tree logits": 0},
                         5 * GiB, "test memory", CONFIG)
    assert "needs 10.00 GiB per device (kv cache 1.00 + tree mask 2.00 + other compiled " \
           "buffers 7.00 GiB) but 5.0 GiB of test memory is free" in msg


def test_preflight_uses_the_compiled_program(tiny_models, monkeypatch):
    target, drafter = tiny_models
    floor = sum(plan.decode_floor(target, drafter, CONFIG, 1).values())
    monkeypatch.setattr(plan, "available_bytes", lambda devices=None: (floor, "test memory"))
    with pytest.raises(plan.NotEnoughMemory, match="test memory is free"):
        plan.check_decode_fits(target, drafter, CONFIG, 1)
    monkeypatch.setattr(plan, "available_bytes", lambda devices=None: (2**40, "test memory"))
    report = plan.check_decode_fits(target, drafter, CONFIG, 1)
    assert floor < report.output_bytes + report.temp_bytes
    params = sum(x.size for x in jax.tree.leaves(nnx.state((target, drafter))))
    assert params > TINY.num_params and report.argument_bytes >= 4 * params


def test_generate_refuses_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(plan, "available_bytes", lambda devices=None: (2**30, "test memory"))
    monkeypatch.setattr(plan, "compile_report", _refuse_compiling)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", "Once upon a time", "--budget", "100000"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tev-jax generate: error: not enough memory") and "\n" not in err
    assert "lower --budget (100000)" in err  # issue 47, item 10: error: and the flag


def test_preflight_builds_nothing_in_proportion_to_the_budget(tiny_models, monkeypatch):
    """Issue 26, finding 1: a huge budget is refused from shapes alone, in milliseconds,
    without the (budget x K) pair table of the DDTree builder (which OOM-killed the host
    at --budget 1000000000)."""
    import time
    import tracemalloc

    target, drafter = tiny_models
    monkeypatch.setattr(plan, "available_bytes", lambda devices=None: (2**30, "test memory"))
    monkeypatch.setattr(plan, "compile_report", _refuse_compiling)
    for budget in (200_000, 10**9):
        config = dataclasses.replace(CONFIG, budget=budget, max_cache_len=None)
        tracemalloc.start()
        t0 = time.perf_counter()
        with pytest.raises(plan.NotEnoughMemory, match=rf"lower budget \({budget}\)"):
            plan.check_decode_fits(target, drafter, config, 1)
        seconds = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 4 * 2**20 and seconds < 2.0, (budget, peak, seconds)
        assert plan.decode_floor(target, drafter, config, 1)["tree mask"] == (budget + 1) ** 2
