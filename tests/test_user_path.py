"""Issue 38: the user's path, round two — one line per mistake, nothing written by a
refused run, every documented command working.

Each test names the numbered item of issue 38 it pins. Most refusals happen before any
model is compiled; the runs that decode use a tiny saved target (V = 64, a word-level
tokenizer) decoding autoregressively. Both command lines are called in-process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tev_jax import cli, text_io
from tev_jax.batch import outputs
from tev_jax.costs import plan
from tev_jax.models import ModelConfig, init_target, save_target
from tev_jax.models.drafter_io import init_drafter, save_drafter
from train import __main__ as train_cli
from train.rollouts import RolloutConfig, make_rollouts, write_rollouts

V = 64
CONFIG = ModelConfig(model_type="qwen3", vocab_size=V, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                     max_position_embeddings=64)
AR = ["--builder", "none", "--max-new-tokens", "4"]


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target = init_target(CONFIG, key=8)
    target.lm_head[...] = target.lm_head[...] * 20.0
    save_target(target, root / "target", tokenizer=_tokenizer())
    save_drafter(init_drafter(target, num_layers=1, block_size=3, mask_token_id=V - 1, key=1),
                 root / "drafter")
    return root


def _prompts(path, n=5):
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt_ids": [5 + i, 17, 3]}) + "\n"
                            for i in range(n)))
    return path


def _batch(dirs, tmp_path, *extra):
    return ["generate", "--prompts", str(_prompts(tmp_path / "p.jsonl")), "--output",
            str(tmp_path / "out.jsonl"), "--target", str(dirs / "target"), *AR, *extra]


def _one_line(capsys, prog="tev-jax") -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(prog), err
    return err[0]


def _refused(argv, capsys) -> str:
    """The one stderr line of a refused tev-jax command (exit code 2, no usage lines)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    line = _one_line(capsys)
    assert line.startswith(f"tev-jax {argv[0]}: error: ")
    return line


def _train_refused(argv, capsys) -> str:
    """The one stderr line of a refused tev-train command (exit code 2)."""
    capsys.readouterr()
    assert train_cli.main(argv) == 2
    return _one_line(capsys, "python -m train")


def _nothing_but(folder, *names):
    assert sorted(p.name for p in folder.iterdir()) == sorted(names)


# ------------------------------------------------------------------------ tev-jax


def test_batch_generation_with_an_automatic_budget(dirs, tmp_path, capsys):
    """Item 1: the README's `generate --prompts P --output O --budget auto --tuning T`
    runs (here a tuning that picks plain AR at every batch size) instead of refusing
    the unresolved budget."""
    tuning = tmp_path / "tuning.json"
    tuning.write_text(json.dumps({"best": {"1": {"budget": 0}, "8": {"budget": 0}}}))
    argv = ["generate", "--prompts", str(_prompts(tmp_path / "p.jsonl")), "--output",
            str(tmp_path / "out.jsonl"), "--target", str(dirs / "target"), "--drafter",
            str(dirs / "drafter"), "--max-new-tokens", "3", "--budget", "auto", "--tuning",
            str(tuning), "--batch-size", "2"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 5
    assert "tau=0.00" not in err  # nit: no tau before any round
    assert cli.main(argv) == 0  # a complete output: nothing to do, said so
    assert "nothing was left to decode" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--chat"], ["--compare-ar"], ["--repeats", "3"],
                                   ["--no-stream"]])
def test_single_prompt_flags_are_refused_with_a_prompts_file(dirs, tmp_path, capsys, flags):
    """Item 2 (and the nit on tev-jax's errors: one line, one prefix, no usage)."""
    line = _refused(_batch(dirs, tmp_path, *flags), capsys)
    assert f"{flags[0]} only applies to a single PROMPT" in line
    assert ("'messages'" in line) == (flags[0] == "--chat")  # the hint of that flag only
    _nothing_but(tmp_path, "p.jsonl")


def test_no_libtpu_noise_without_tpus(tmp_path):
    """Item 3: with the tpu extra installed, a command on a machine without TPU chips
    prints nothing from libtpu (jax is kept to the CPU; JAX_PLATFORMS is not set)."""
    from tev_jax.runtime.platforms import nvidia_gpu_visible, tpu_chips_present

    if tpu_chips_present() or nvidia_gpu_visible():
        pytest.skip("a machine with accelerators")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    run = subprocess.run([sys.executable, "-m", "tev_jax.cli", "exit-law", "--demo",
                          "--draws", "10", "--show", "1"], env=env, capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0 and "mean block length" in run.stdout
    for noise in ("TPU", "libtpu", "hostname", "InitGoogle"):
        assert noise not in run.stderr, run.stderr


def test_undecodable_prompt_bytes_are_one_line(capsys):
    """Item 8: `tev-jax generate $'\\xff\\xfe'` (undecodable argv bytes) names the byte."""
    line = _refused(["generate", "\udcff\udcfe"], capsys)
    assert "the PROMPT is not valid UTF-8 text (byte 0xff at character 0)" in line
    line = _refused(["compare", "ok", "\udcfe"], capsys)
    assert "PROMPT 2 is not valid UTF-8 text" in line


@pytest.mark.parametrize("damage, named", [("{ broken", "out.settings.json:1: malformed JSON"),
                                           ("[1, 2]", "out.settings.json: expected a JSON "
                                                      "object of settings, got list")])
def test_a_damaged_settings_file_is_named(dirs, tmp_path, capsys, damage, named):
    """Item 9: a damaged OUT.settings.json is refused naming the file (and line)."""
    outputs.settings_path(tmp_path / "out.jsonl").write_text(damage)
    assert named in _refused(_batch(dirs, tmp_path), capsys)
    assert not (tmp_path / "out.jsonl").exists()


def test_an_unwritable_summary_is_refused_before_the_run(dirs, tmp_path, capsys):
    """Item 10: --summary-json into a missing folder is refused before anything runs."""
    line = _refused(_batch(dirs, tmp_path, "--summary-json", str(tmp_path / "no" / "s.json")),
                    capsys)
    assert "--summary-json" in line and "does not exist" in line
    _nothing_but(tmp_path, "p.jsonl")


def test_tune_refuses_before_tuning(tmp_path, capsys, monkeypatch):
    """Item 11: tune's --repeats 0, an unwritable --json and --figure without matplotlib
    are refused before the tuning runs (whose result would be lost)."""
    p = str(_prompts(tmp_path / "p.jsonl"))
    assert "--repeats must be >= 1, got 0" in _refused(["tune", "--prompts", p, "--repeats",
                                                        "0"], capsys)
    assert "--json" in _refused(["tune", "--prompts", p, "--json", str(tmp_path / "x" / "t")],
                                capsys)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    line = _refused(["tune", "--prompts", p, "--figure", str(tmp_path / "t.png")], capsys)
    assert "--figure" in line and "needs matplotlib" in line
    _nothing_but(tmp_path, "p.jsonl")


def test_compare_checks_the_context_first(capsys, monkeypatch):
    """Item 12: `compare hi --max-new-tokens 5000` is refused as generate refuses it."""
    from tev_jax.costs import timing

    monkeypatch.setattr(timing, "compare_methods", lambda *a, **k: pytest.fail("ran"))
    line = _refused(["compare", "hi", "--max-new-tokens", "5000"], capsys)
    assert "PROMPT 1: the prompt" in line and "exceed the target's context length" in line


def test_plan_flags_are_checked(capsys):
    """Item 13 (tev-jax plan): --tau below 1, and --tau without a roofline (no
    --topology), are refused."""
    base = ["plan", "--model", "qwen3-0.6b", "--layers", "1", "--programs", "prefill"]
    assert "--tau must be a number >= 1" in _refused(base + ["--tau", "-1"], capsys)
    assert "--tau needs a roofline" in _refused(base + ["--tau", "4"], capsys)
    assert "--batch must be >= 1" in _refused(base + ["--batch", "0"], capsys)
    assert "--layers must be >= 1" in _refused(base[:3] + ["--layers", "0"], capsys)  # nit


@pytest.mark.parametrize("flags, named", [
    (["--anchors", "0"], "--anchors must be >= 1"), (["--seq-len", "0"], "--seq-len must be"),
    (["--target-dtype", "fp8"], "--target-dtype must be one of float32, bfloat16"),
    (["--host-devices", "-1"], "--host-devices must be >= 0"),
    (["--batch", "0"], "--batch must be >= 1"), (["--budget", "0"], "--budget must be >= 1"),
    (["--num-taps", "0"], "--num-taps must be >= 1")])
def test_train_plan_flags_are_checked(capsys, flags, named):
    """Item 13 (tev-train plan): each bad flag is one line naming it, before compiling."""
    assert named in _train_refused(["plan", "--target", "qwen3-0.6b", *flags], capsys)


def test_rollouts_flags(dirs, tmp_path, capsys):
    """Item 14: --limit -1 and an out-of-vocabulary --pad-id / --stop-ids are refused (no
    output folder); the bundled target can be named; a run refused inside decoding
    leaves no empty folder behind."""
    p = tmp_path / "p.txt"
    p.write_text("w5 w6\nw7\n")
    base = ["rollouts", "--prompts-file", str(p), "--out", str(tmp_path / "r"),
            "--max-prompt-len", "8", "--max-new-tokens", "4"]
    t = ["--target", str(dirs / "target")]
    assert "--limit must be >= 0" in _train_refused(base + t + ["--limit", "-1"], capsys)
    assert "--pad-id 99999 is outside" in _train_refused(base + t + ["--pad-id", "99999"],
                                                         capsys)
    assert "--stop-ids takes comma-separated" in _train_refused(
        base + t + ["--stop-ids", "abc"], capsys)
    line = _train_refused(base + ["--target", "bundled", "--pad-id", "-1"], capsys)
    assert "--pad-id -1 is outside the target's vocabulary [0, 4096)" in line
    _nothing_but(tmp_path, "p.txt")
    from tev_jax.models import load_target

    with pytest.raises(ValueError, match="stop token id 99999"):
        make_rollouts(load_target(dirs / "target"), [[5, 6]], tmp_path / "deep" / "r",
                      RolloutConfig(max_prompt_len=4, max_new_tokens=2,
                                    stop_token_ids=(99999,)))
    _nothing_but(tmp_path, "p.txt")


def test_chat_roles_and_oversized_batches_name_the_culprit(dirs, tmp_path, capsys):
    """Item 15: a system message is refused with its file, line and id; a batch size far
    above the prompts to decode is cut to them before the memory check (issue 47, item
    10: it was refused in a two-in-one message suggesting a lower budget)."""
    from tev_jax.models.bundled import bundled_paths

    config = json.loads((bundled_paths().target / "tokenizer_config.json").read_text())
    chat = text_io.chat_formatter(config)
    f = tmp_path / "m.jsonl"
    f.write_text(json.dumps({"id": "s", "messages": [{"role": "system", "content": "x"}]})
                 + "\n")
    with pytest.raises(ValueError, match=r"m.jsonl:1: id 's': chat template: only user"):
        text_io.encode_records(text_io.read_prompts(f), _tokenizer(), chat, vocab_size=V,
                                prompt_len=None, truncate=False, where=str(f))
    capsys.readouterr()
    summary = tmp_path / "summary.json"
    assert cli.main(_batch(dirs, tmp_path, "--batch-size", str(10**9), "--summary-json",
                           str(summary))) == 0
    assert json.loads(summary.read_text())["batch_size"] == 5
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 5


def test_long_commands_say_what_they_do_first(tmp_path, capsys, monkeypatch):
    """Item 16: plan, tev-train plan, tune and compare print what they are doing before
    the long work (here replaced by a stand-in that stops them)."""
    import train.plan
    from tev_jax.costs import timing, tune

    def stop(*args, **kw):
        raise ValueError("stopped")

    monkeypatch.setattr(plan, "plan_decode_programs", stop)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli.main(["plan", "--model", "qwen3-0.6b", "--layers", "1", "--programs", "prefill"])
    assert capsys.readouterr().err.startswith("compiling 1 program(s) (prefill) of qwen3-0.6b")
    monkeypatch.setattr(train.plan, "plan_step", stop)
    assert train_cli.main(["plan", "--target", "qwen3-0.6b", "--mesh-fsdp", "1"]) == 2
    assert capsys.readouterr().err.startswith("compiling one training step")
    monkeypatch.setattr(tune, "tune", stop)
    with pytest.raises(SystemExit):
        cli.main(["tune", "--prompts", str(_prompts(tmp_path / "p.jsonl"))])
    assert "tuning 5 prompt(s): one decode round at budget 128" in capsys.readouterr().err

    def first_method(target, methods, prompts, on_method=None, **kw):
        on_method(0, methods[0][0])
        raise ValueError("stopped")

    monkeypatch.setattr(timing, "compare_methods", first_method)
    with pytest.raises(SystemExit):
        cli.main(["compare", "hi", "--max-new-tokens", "4"])
    assert "[1/3] AR (target alone): compiling 1 prompt(s)" in capsys.readouterr().err


def test_tev_jax_nits(capsys):
    """Nits: --help shows a description, not a docstring; --budget auto without --tuning
    and --temperature inf are one line each."""
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert cli.DESCRIPTION in " ".join(out.split()) and "``" not in out
    assert "--budget auto needs --tuning FILE" in _refused(["generate", "hi", "--budget",
                                                            "auto"], capsys)
    assert "temperature must be a finite number >= 0, got inf" in _refused(
        ["generate", "hi", "--temperature", "inf"], capsys)


def test_printed_text_drops_a_cut_character():
    """Nit: the printed text does not end in a character whose UTF-8 bytes were cut off
    (by max-new-tokens): the byte-level bundled tokenizer, an emoji cut after 2 bytes."""
    from tev_jax.cli.generate import text_of
    from tev_jax.models import load_tokenizer
    from tev_jax.models.bundled import bundled_paths

    tok = load_tokenizer(bundled_paths().target)
    ids = tok.encode("a \U0001F642 b", add_special_tokens=False).ids
    cut = next(k for k in range(len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    assert text_of(tok, ids[:cut]) == tok.decode(ids[:cut])[:-1]
    assert text_of(tok, ids) == tok.decode(ids) == "a \U0001F642 b"


def test_prompt_file_nits(tmp_path):
    """Nits: a JSON id 1.5 is named as a bad id (not a missing one); a .json array file
    is told it should be JSONL."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": 1.5, "prompt": "x"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:1: id 1.5 must be a non-empty string or "
                                         r"an integer, got float"):
        text_io.read_prompts(f)
    f = tmp_path / "p.json"
    f.write_text('[{"id": 1, "prompt": "x"}]\n')
    with pytest.raises(ValueError, match=r"p.json: a JSON array; a prompts file is JSONL"):
        text_io.read_prompts(f)


# ---------------------------------------------------------------------- tev-train


def _run_args(*extra):
    return train_cli.build_parser().parse_args(["run", *extra])


def test_rollouts_too_short_for_the_horizon_are_refused(dirs, tmp_path, capsys):
    """Item 4: rollouts whose responses are shorter than the drafter's horizon are
    refused (every loss would be 0) before anything is written."""
    write_rollouts(tmp_path / "data", [[5, 6, 7]] * 4, [[8, 9]] * 4)
    out = tmp_path / "run"
    line = _train_refused(["run", "--target-path", str(dirs / "target"), "--data-dir",
                           str(tmp_path / "data"), "--out-dir", str(out), "--block-size", "4",
                           "--mask-token-id", "63", "--steps", "2", "--no-progress"], capsys)
    assert "have no anchor to train on: the longest response has 2 tokens" in line
    assert "--block-size=4 needs at least 3" in line
    assert not out.exists()


@pytest.mark.parametrize("value", ["ture", "2", ""])
def test_boolean_flags_are_strict(capsys, value):
    """Item 5: `--resume ture` is a usage error, not false (which would move a run's
    checkpoints aside)."""
    with pytest.raises(SystemExit) as e:
        _run_args("--resume", value)
    assert e.value.code == 2
    assert f"takes true or false, got {value!r}" in capsys.readouterr().err
    assert train_cli.config_from_args(_run_args("--resume", "off")).resume is False


def test_none_sets_optional_fields_and_is_refused_elsewhere(capsys):
    """Item 6: `--exit-prefix-window none` overrides the recipe's 64; `--steps none` is
    refused instead of becoming the default."""
    cfg = train_cli.config_from_args(_run_args("--recipe", "paper", "--exit-prefix-window",
                                               "none"))
    assert cfg.exit_prefix_window is None
    assert train_cli.config_from_args(_run_args("--recipe", "paper")).exit_prefix_window == 64
    with pytest.raises(SystemExit):
        _run_args("--steps", "none")
    assert "takes an int, not 'none'" in capsys.readouterr().err


@pytest.mark.parametrize("flags, named", [
    (["--exit-lambda", "nan"], "--exit-lambda must be a finite number >= 0, got nan"),
    (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
    (["--weight-decay", "-1"], "--weight-decay must be a finite number >= 0"),
    (["--b1", "2"], "--b1 must be a finite number in [0, 1)"),
    (["--b2", "-3"], "--b2 must be a finite number in [0, 1)"),
    (["--max-minutes", "-1"], "--max-minutes must be a number > 0"),
    (["--until-update", "0"], "--until-update must be >= 1"),
    (["--drafter-path", "d", "--block-size", "8"], "--block-size shape a new drafter")])
def test_bad_numbers_are_refused_before_training(capsys, flags, named):
    """Item 7 (and the nits on --max-minutes, --until-update and new-drafter flags with
    --drafter-path): one line naming the flag, before any model is loaded."""
    assert named in _train_refused(["run", *flags], capsys)


def test_target_layer_ids_outside_the_target_name_the_flag():
    """A new drafter's taps beyond the target's layers: one line naming the flag."""
    from tev_jax.models.bundled import bundle_root
    from train.config import TrainConfig
    from train.loop import load_models

    cfg = TrainConfig(target_path=str(bundle_root() / "target"), target_layer_ids=(0, 99))
    with pytest.raises(ValueError, match=r"^--target-layer-ids 99: the target .* has layers 0\.\.3$"):
        load_models(cfg)
