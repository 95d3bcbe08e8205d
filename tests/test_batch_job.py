"""The prompts-file job (`tev_jax.batch.job`: ``tev-jax generate --prompts P --output O``)
on a tiny saved target decoding autoregressively, called in-process: one writer per
output, settings that would make the output lie are refused, a refused job writes
nothing (not the output, its settings file or its lock), an automatic budget and a batch
size above the prompts both run. The files themselves (prompts files, outputs, shards):
tests/test_batch_io.py; interrupts: tests/test_interrupts.py. From issues 26, 38, 47 and 51.
"""

from __future__ import annotations

import json
import os

import pytest
from cli_fixtures import (
    V, batch_argv, job_argv, mixed_prompts_file, nothing_but, prompts_file, refused_last_line,
    refused_message, refused_one_line, word_tokenizer,
)
from cli_fixtures import model_dirs, target_dir  # noqa: F401  (fixtures)

from tev_jax import cli, text_io
from tev_jax.batch import outputs
from tev_jax.runtime import locks


def test_one_writer_per_output_and_duplicates_named(tmp_path, target_dir, capsys):  # noqa: F811
    """Issue 26, finding 3: a second writer of one --output is refused with one line
    naming the holder, before anything is written; a file two writers filled names its
    duplicate ids."""
    out = tmp_path / "out.jsonl"
    with locks.lock_output(out):
        line = refused_last_line(batch_argv(target_dir, tmp_path), capsys)
        assert f"is being written by another process (pid {os.getpid()} on " in line
        assert not out.exists() and not outputs.settings_path(out).exists()
    assert not locks.lock_path(out).exists()
    out.write_text('{"id": "a"}\n{"id": "b"}\n{"id": "a"}\n')
    with pytest.raises(ValueError, match=r"out.jsonl:3: id 'a' is also on line 1"):
        outputs.read_done_ids(out)


def test_a_batch_the_mesh_does_not_divide_writes_nothing(tmp_path, target_dir,  # noqa: F811
                                                         capsys):
    """Issue 26, finding 18: a data mesh that does not divide --batch-size is refused
    before the output, its sidecar or its lock exist."""
    from tev_jax import sharding

    if not sharding.device_count_ok(2):
        pytest.skip("needs 2 devices")
    line = refused_last_line(batch_argv(target_dir, tmp_path, "--batch-size", "3",
                                        "--mesh-data", "2"), capsys)
    assert "batch of 3" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl"]


def test_force_with_other_settings_on_a_complete_output_is_refused(tmp_path,
                                                                   target_dir,  # noqa: F811
                                                                   capsys):
    """Issue 51, item 6: ``--force`` with changed settings on an output that already has
    every result would decode nothing yet rewrite its settings file to name the new
    settings (a file that then lies about its rows): refused, the file unchanged. With a
    prompt left to decode, --force goes on (the control)."""
    assert cli.main(batch_argv(target_dir, tmp_path)) == 0
    side = outputs.settings_path(tmp_path / "out.jsonl")
    before = side.read_text()
    line = refused_last_line(batch_argv(target_dir, tmp_path, "--force", "--seed", "7"),
                             capsys)
    assert "--force with other settings (seed) would decode nothing" in line
    assert side.read_text() == before
    (tmp_path / "more").mkdir()
    more = batch_argv(target_dir, tmp_path / "more", "--force", "--seed", "7")
    more[more.index("--output") + 1] = str(tmp_path / "out.jsonl")
    mixed_prompts_file(tmp_path / "more" / "p.jsonl", n=6)
    assert cli.main(more) == 0
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 6
    assert '"seed": 7' in side.read_text()


def test_batch_generation_with_an_automatic_budget(model_dirs, tmp_path, capsys):  # noqa: F811
    """Issue 38, item 1: the README's `generate --prompts P --output O --budget auto
    --tuning T` runs (here a tuning that picks plain AR at every batch size) instead of
    refusing the unresolved budget."""
    tuning = tmp_path / "tuning.json"
    tuning.write_text(json.dumps({"best": {"1": {"budget": 0}, "8": {"budget": 0}}}))
    argv = ["generate", "--prompts", str(prompts_file(tmp_path / "p.jsonl")), "--output",
            str(tmp_path / "out.jsonl"), "--target", str(model_dirs / "target"), "--drafter",
            str(model_dirs / "drafter"), "--max-new-tokens", "3", "--budget", "auto",
            "--tuning", str(tuning), "--batch-size", "2"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 5
    assert "tau=0.00" not in err  # nit: no tau before any round
    assert cli.main(argv) == 0  # a complete output: nothing to do, said so
    assert "nothing was left to decode" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--chat"], ["--compare-ar"], ["--repeats", "3"],
                                   ["--no-stream"]])
def test_single_prompt_flags_are_refused_with_a_prompts_file(model_dirs, tmp_path,  # noqa: F811
                                                             capsys, flags):
    """Issue 38, item 2 (and the nit on tev-jax's errors: one line, one prefix, no usage)."""
    line = refused_one_line(job_argv(model_dirs, tmp_path, *flags), capsys)
    assert f"{flags[0]} only applies to a single PROMPT" in line
    assert ("'messages'" in line) == (flags[0] == "--chat")  # the hint of that flag only
    nothing_but(tmp_path, "p.jsonl")


@pytest.mark.parametrize("damage, named", [("{ broken", "out.settings.json:1: malformed JSON"),
                                           ("[1, 2]", "out.settings.json: expected a JSON "
                                                      "object of settings, got list")])
def test_a_damaged_settings_file_is_named(model_dirs, tmp_path, capsys, damage,  # noqa: F811
                                          named):
    """Issue 38, item 9: a damaged OUT.settings.json is refused naming the file (and line)."""
    outputs.settings_path(tmp_path / "out.jsonl").write_text(damage)
    assert named in refused_one_line(job_argv(model_dirs, tmp_path), capsys)
    assert not (tmp_path / "out.jsonl").exists()


def test_an_unwritable_summary_is_refused_before_the_run(model_dirs, tmp_path,  # noqa: F811
                                                         capsys):
    """Issue 38, item 10: --summary-json into a missing folder is refused before anything
    runs."""
    line = refused_one_line(job_argv(model_dirs, tmp_path, "--summary-json",
                                     str(tmp_path / "no" / "s.json")), capsys)
    assert "--summary-json" in line and "does not exist" in line
    nothing_but(tmp_path, "p.jsonl")


def test_chat_roles_and_oversized_batches_name_the_culprit(model_dirs, tmp_path,  # noqa: F811
                                                           capsys):
    """Issue 38, item 15: a system message with no user turn is refused with its file,
    line and id; a batch size far above the prompts to decode is cut to them before the
    memory check (issue 47, item 10: it was refused in a two-in-one message suggesting a
    lower budget)."""
    from tev_jax.models.bundled import bundled_paths

    config = json.loads((bundled_paths().target / "tokenizer_config.json").read_text())
    chat = text_io.chat_formatter(config)
    f = tmp_path / "m.jsonl"
    f.write_text(json.dumps({"id": "s", "messages": [{"role": "system", "content": "x"}]})
                 + "\n")
    with pytest.raises(ValueError, match=r"m.jsonl:1: id 's': chat template: system "
                       "messages must be followed by a user turn"):
        text_io.encode_records(text_io.read_prompts(f), word_tokenizer(), chat, vocab_size=V,
                                prompt_len=None, truncate=False, where=str(f))
    capsys.readouterr()
    summary = tmp_path / "summary.json"
    assert cli.main(job_argv(model_dirs, tmp_path, "--batch-size", str(10**9),
                             "--summary-json", str(summary))) == 0
    assert json.loads(summary.read_text())["batch_size"] == 5
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 5


def test_a_prompts_file_that_is_also_the_output_is_refused(tmp_path, capsys):
    """Issue 47, item 10: a UTF-8 byte-order mark is accepted; a prompts file that is also
    the output is refused (with --force too) before anything is read or written."""
    p = tmp_path / "p.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"id": "a", "prompt": "hi"}\n')
    assert [r.id for r in text_io.read_prompts(p)] == ["a"]
    text = p.read_bytes()
    err = refused_message(["generate", "--prompts", str(p), "--output", str(p), "--force"],
                          capsys)
    assert "\n" not in err and "--prompts and --output are the same file" in err
    assert p.read_bytes() == text and not (tmp_path / "p.jsonl.lock").exists()
