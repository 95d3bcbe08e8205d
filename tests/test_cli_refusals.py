"""Every bad flag or argument of ``tev-jax`` is refused in one line naming it, with exit
code 2, before any model is compiled and before anything is written: a single PROMPT's
edges (empty, undecodable, beyond the context), flags that do not apply, numbers out of
range, a mesh larger than the devices; and an unwritable output or a missing prompts
file of either command line. The batch job's own refusals: tests/test_batch_job.py;
``tev-train``'s: tests/test_train_cli.py. From issues 26, 38 and 47; the runs use a tiny
saved target decoding autoregressively, called in-process.
"""

from __future__ import annotations

import json

import pytest
from cli_fixtures import (
    AR, PROMPT, batch_argv, refused_last_line, refused_message, refused_one_line,
)
from cli_fixtures import target_dir  # noqa: F401  (a fixture)

from tev_jax import cli
from train import __main__ as train_cli


def test_generate_edges_of_a_single_prompt(tmp_path, target_dir, capsys):  # noqa: F811
    """Issue 26, findings 8, 9, 13 and 18: an empty PROMPT, a prompt + --max-new-tokens
    beyond max_position_embeddings (single and batch), batch-only flags without
    --prompts, --top-p at T = 0, --repeats 0, --draws 0 and --sync-rounds 0 are refused
    with one line naming the flag."""
    single = ["generate", "--target", str(target_dir), *AR]
    assert "the PROMPT is empty" in refused_last_line(single + [""], capsys)
    long = " ".join(["w9"] * 60)
    assert ("PROMPT: the prompt (60 tokens) + --max-new-tokens (8) = 68 tokens exceed the "
            "target's context length (max_position_embeddings = 64)") in refused_last_line(
        single + [long, "--max-new-tokens", "8"], capsys)
    assert "--output only apply to batch generation" in refused_last_line(
        single + [PROMPT, "--output", str(tmp_path / "x.jsonl")], capsys)
    assert not (tmp_path / "x.jsonl").exists()
    assert "--batch-size only apply to batch generation" in refused_last_line(
        single + [PROMPT, "--batch-size", "3"], capsys)
    assert "--top-p has no effect at --temperature 0" in refused_last_line(
        single + [PROMPT, "--top-p", "0.9"], capsys)
    assert "--repeats must be >= 1, got 0" in refused_last_line(
        single + [PROMPT, "--repeats", "0"], capsys)
    assert "--draws must be >= 1, got 0" in refused_last_line(
        ["exit-law", "--demo", "--draws", "0"], capsys)
    assert "--sync-rounds must be >= 1" in refused_last_line(
        batch_argv(target_dir, tmp_path, "--sync-rounds", "0"), capsys)
    (tmp_path / "long.jsonl").write_text(json.dumps({"id": "l", "prompt_ids": [9] * 60}) + "\n")
    argv = batch_argv(target_dir, tmp_path, "--max-new-tokens", "8")
    argv[argv.index("--prompts") + 1] = str(tmp_path / "long.jsonl")
    line = refused_last_line(argv, capsys)
    assert "long.jsonl:1: id 'l': the prompt (60 tokens) + --max-new-tokens (8)" in line
    assert line.endswith("or pass --prompt-len 56 --truncate left (each prompt keeps its "
                         "last tokens)")
    assert not list(tmp_path.glob("out*"))


def test_unwritable_outputs_and_missing_prompts_are_one_line(tmp_path, target_dir,  # noqa: F811
                                                             capsys):
    """Issue 26, finding 7: an --output that cannot be written and a missing
    --prompts-file of tev-train rollouts end with one line, exit code 2."""
    argv = batch_argv(target_dir, tmp_path)
    argv[argv.index("--output") + 1] = "/proc/tev-jax/out.jsonl"
    assert "/proc/tev-jax/out.jsonl: cannot write there" in refused_last_line(argv, capsys)
    code = train_cli.main(["rollouts", "--target", str(target_dir), "--prompts-file",
                           str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "nope.jsonl: no such prompts file" in err[0]
    assert not (tmp_path / "r").exists()


def test_undecodable_prompt_bytes_are_one_line(capsys):
    """Issue 38, item 8: `tev-jax generate $'\\xff\\xfe'` (undecodable argv bytes) names
    the byte."""
    line = refused_one_line(["generate", "\udcff\udcfe"], capsys)
    assert "the PROMPT is not valid UTF-8 text (byte 0xff at character 0)" in line
    line = refused_one_line(["compare", "ok", "\udcfe"], capsys)
    assert "PROMPT 2 is not valid UTF-8 text" in line


def test_compare_checks_the_context_first(capsys, monkeypatch):
    """Issue 38, item 12: `compare hi --max-new-tokens 5000` is refused as generate
    refuses it."""
    from tev_jax.costs import timing

    monkeypatch.setattr(timing, "compare_methods", lambda *a, **k: pytest.fail("ran"))
    line = refused_one_line(["compare", "hi", "--max-new-tokens", "5000"], capsys)
    assert "PROMPT 1: the prompt" in line and "exceed the target's context length" in line


def test_help_is_a_description_and_auto_budget_or_inf_temperature_are_one_line(capsys):
    """Issue 38, nits: --help shows a description, not a docstring; --budget auto without
    --tuning and --temperature inf are one line each."""
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert cli.DESCRIPTION in " ".join(out.split()) and "``" not in out
    assert "--budget auto needs --tuning FILE" in refused_one_line(
        ["generate", "hi", "--budget", "auto"], capsys)
    assert "temperature must be a finite number >= 0, got inf" in refused_one_line(
        ["generate", "hi", "--temperature", "inf"], capsys)


def test_flag_messages(capsys):
    """Issue 47, item 10: 'or None' reads as CLI words; a flag typo shows the
    subcommand's usage (tev-jax and tev-train); a mesh larger than the devices gets the
    XLA_FLAGS hint; exit-law runs without --demo."""
    err = refused_message(["generate", "hi", "--temperature", "1", "--top-p", "2"], capsys)
    assert "--top-p must be in (0, 1] or unset, got 2.0" in err and "None" not in err
    err = refused_message(["generate", "hi", "--bogus"], capsys)
    assert err.startswith("usage: tev-jax generate ") and "unrecognized arguments: --bogus" in err
    with pytest.raises(SystemExit):
        train_cli.main(["run", "--bogus"])
    err = capsys.readouterr().err
    assert "usage: " in err and " run [-h]" in err
    err = refused_message(["generate", "hi", "--mesh-data", "16"], capsys)
    assert "needs 16 devices" in err and "--xla_force_host_platform_device_count" in err
    assert cli.main(["exit-law", "--draws", "200"]) == 0
    assert "mean block length over 200 draws" in capsys.readouterr().out
