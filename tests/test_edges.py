"""Issue 26: the edges a user meets — files, locks, checkpoints, interrupts, messages.

Each test names the finding of issue 26 it pins. The command lines run on a tiny saved
target (V = 64, a word-level tokenizer, a 64-token context) decoding autoregressively,
and a tiny training run (the models of ``train_fixtures``), so every program compiles in
seconds; both command lines are called in-process (``tev_jax.cli.main``,
``train.__main__.main``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import sys

import pytest
from decode_fixtures import greedy_reference
from train_fixtures import train_dirs  # noqa: F401  (a fixture)

from tev_jax import cli, text_io
from tev_jax.batch import continuous, outputs
from tev_jax.costs import timing
from tev_jax.data import prompts as prompt_sets
from tev_jax.models import ModelConfig, bundled, init_target, save_target
from tev_jax.models.checkpoint_io import weights_fingerprint
from tev_jax.runtime import exit_codes
from train import __main__ as train_cli
from train.checkpoint import TrainCheckpointer
from train.loop import check_data_target
from train.rollouts import RolloutSet, write_rollouts

V = 64
CONFIG = ModelConfig(model_type="qwen3", vocab_size=V, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                     max_position_embeddings=64)
PROMPT = "w5 w17 w3"
AR = ["--builder", "none", "--max-new-tokens", "4"]


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def _target(cfg=CONFIG):
    target = init_target(cfg, key=8)
    target.lm_head[...] = target.lm_head[...] * 20.0
    return target


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "target"
    save_target(_target(), path, tokenizer=_tokenizer())
    return path


def _prompts_file(path, n=5):
    rows = [{"id": f"q{i}", "prompt_ids": [5 + i, 17, 3 + i][: 1 + i % 3]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _batch(target_dir, tmp_path, *extra):
    return ["generate", "--prompts", str(_prompts_file(tmp_path / "p.jsonl")),
            "--output", str(tmp_path / "out.jsonl"), "--target", str(target_dir), *AR,
            "--batch-size", "2", *extra]


def _refused(argv, capsys) -> str:
    """The one error line of a refused tev-jax command (exit code 2)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("tev-jax")
    return err[-1]


# --------------------------------------------------------------- batch outputs


def test_merge_refuses_incomplete_shards_and_writes_input_order(tmp_path):
    """Issue 26, finding 2 (and 16: merged rows in input order): a shard cut to 1 of its
    3 lines is refused, naming the shard and the rerun; a complete set merges in the
    prompts file's order, whatever order the rows finished in."""
    out = tmp_path / "out.jsonl"
    ids = [f"q{i}" for i in range(7)]
    shards = [outputs.shard_path(out, i, 2) for i in range(2)]
    for i, shard in enumerate(shards):
        mine = outputs.shard_of(list(enumerate(ids)), i, 2)
        with outputs.lock_output(shard):
            _, f = outputs.open_output(shard, {"seed": 0, "run": {"process_index": i}},
                                        expected=len(mine))
            with f:
                for index, rid in reversed(mine):  # finished last-first
                    outputs.write_line(f, {"id": rid, "index": index})
    full = shards[1].read_text()
    shards[1].write_text(full.splitlines(keepends=True)[0])
    with pytest.raises(ValueError, match=r"out.1-of-2.jsonl is incomplete: 1 of its 3 "
                                         r"results \(2 missing\); rerun process 1 of 2"):
        outputs.merge_outputs(out)
    assert not out.exists()
    shards[1].write_text(full)
    assert outputs.merge_outputs(out) == 7
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ids
    assert json.loads(outputs.settings_path(out).read_text())["run"]["expected"] == 7


def test_one_writer_per_output_and_duplicates_named(tmp_path, target_dir, capsys):
    """Issue 26, finding 3: a second writer of one --output is refused with one line
    naming the holder, before anything is written; a file two writers filled names its
    duplicate ids."""
    out = tmp_path / "out.jsonl"
    with outputs.lock_output(out):
        line = _refused(_batch(target_dir, tmp_path), capsys)
        assert f"is being written by another process (pid {os.getpid()} on " in line
        assert not out.exists() and not outputs.settings_path(out).exists()
    assert not outputs.lock_path(out).exists()
    out.write_text('{"id": "a"}\n{"id": "b"}\n{"id": "a"}\n')
    with pytest.raises(ValueError, match=r"out.jsonl:3: id 'a' is also on line 1"):
        outputs.read_done_ids(out)


def test_unwritable_outputs_and_missing_prompts_are_one_line(tmp_path, target_dir, capsys):
    """Issue 26, finding 7: an --output that cannot be written and a missing
    --prompts-file of tev-train rollouts end with one line, exit code 2."""
    argv = _batch(target_dir, tmp_path)
    argv[argv.index("--output") + 1] = "/proc/tev-jax/out.jsonl"
    assert "/proc/tev-jax/out.jsonl: cannot write there" in _refused(argv, capsys)
    code = train_cli.main(["rollouts", "--target", str(target_dir), "--prompts-file",
                           str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "nope.jsonl: no such prompts file" in err[0]
    assert not (tmp_path / "r").exists()


def test_prompts_files_name_bad_bytes_and_read_the_bundled_sets(tmp_path):
    """Issue 26, findings 11 and 12: a non-UTF-8 prompts file is refused naming its
    line and column; the bundled prompt sets are prompts files (by name or path)."""
    bad = tmp_path / "p.txt"
    bad.write_bytes(b"hello\nna\xefve\n")
    with pytest.raises(ValueError, match=r"p.txt:2: not UTF-8 text \(byte 0xef at column 3\)"):
        text_io.read_prompts(bad)
    for source in ("bundled:gsm", prompt_sets.prompts_dir() / "gsm.jsonl"):
        records = text_io.read_prompts(source)
        assert len(records) == prompt_sets.PROMPT_COUNTS["gsm"]
        assert records[0].kind == "messages" and records[0].id == "gsm_eval_0000"
    assert text_io.read_prompts("bundled:humaneval")[0].kind == "prompt"
    with pytest.raises(ValueError, match="no such bundled prompt set"):
        text_io.read_prompts("bundled:gsm8k")


def test_generate_edges_of_a_single_prompt(tmp_path, target_dir, capsys):
    """Issue 26, findings 8, 9, 13 and 18: an empty PROMPT, a prompt + --max-new-tokens
    beyond max_position_embeddings (single and batch), batch-only flags without
    --prompts, --top-p at T = 0, --repeats 0, --draws 0 and --sync-rounds 0 are refused
    with one line naming the flag."""
    single = ["generate", "--target", str(target_dir), *AR]
    assert "the PROMPT is empty" in _refused(single + [""], capsys)
    long = " ".join(["w9"] * 60)
    assert ("PROMPT: the prompt (60 tokens) + --max-new-tokens (8) = 68 tokens exceed the "
            "target's context length (max_position_embeddings = 64)") in _refused(
        single + [long, "--max-new-tokens", "8"], capsys)
    assert "--output only apply to batch generation" in _refused(
        single + [PROMPT, "--output", str(tmp_path / "x.jsonl")], capsys)
    assert not (tmp_path / "x.jsonl").exists()
    assert "--batch-size only apply to batch generation" in _refused(
        single + [PROMPT, "--batch-size", "3"], capsys)
    assert "--top-p has no effect at --temperature 0" in _refused(
        single + [PROMPT, "--top-p", "0.9"], capsys)
    assert "--repeats must be >= 1, got 0" in _refused(single + [PROMPT, "--repeats", "0"],
                                                       capsys)
    assert "--draws must be >= 1, got 0" in _refused(["exit-law", "--demo", "--draws", "0"],
                                                     capsys)
    assert "--sync-rounds must be >= 1" in _refused(
        _batch(target_dir, tmp_path, "--sync-rounds", "0"), capsys)
    (tmp_path / "long.jsonl").write_text(json.dumps({"id": "l", "prompt_ids": [9] * 60}) + "\n")
    argv = _batch(target_dir, tmp_path, "--max-new-tokens", "8")
    argv[argv.index("--prompts") + 1] = str(tmp_path / "long.jsonl")
    line = _refused(argv, capsys)
    assert "long.jsonl:1: id 'l': the prompt (60 tokens) + --max-new-tokens (8)" in line
    assert line.endswith("or pass --prompt-len 56 --truncate left (each prompt keeps its "
                         "last tokens)")
    assert not list(tmp_path.glob("out*"))


def test_a_batch_the_mesh_does_not_divide_writes_nothing(tmp_path, target_dir, capsys):
    """Issue 26, finding 18: a data mesh that does not divide --batch-size is refused
    before the output, its sidecar or its lock exist."""
    from tev_jax import sharding

    if not sharding.device_count_ok(2):
        pytest.skip("needs 2 devices")
    line = _refused(_batch(target_dir, tmp_path, "--batch-size", "3", "--mesh-data", "2"),
                    capsys)
    assert "batch of 3" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl"]


def test_a_prompt_the_model_ends_at_once(tmp_path, capsys):
    """Issue 26, finding 10: a prompt whose first token is a stop token reports no tau
    (not "tau = nan"), single and batch."""
    first = greedy_reference(_target(), [[5, 17, 3]], 1)[0][0]
    path = tmp_path / "stops"
    save_target(_target(dataclasses.replace(CONFIG, eos_token_ids=(int(first),))), path,
                tokenizer=_tokenizer())
    assert cli.main(["generate", PROMPT, "--target", str(path), *AR]) == 0
    err = capsys.readouterr().err
    assert "1 new token: the target ended the text at its first token" in err
    assert "nan" not in err
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": 1, "prompt_ids": [5, 17, 3]}) + "\n")
    assert cli.main(["generate", "--prompts", str(tmp_path / "p.jsonl"), "--output",
                     str(tmp_path / "o.jsonl"), "--target", str(path), *AR]) == 0
    err = capsys.readouterr().err
    assert "tau n/a (every prompt ended at its first token" in err and "None" not in err


def test_force_with_other_settings_on_a_complete_output_is_refused(tmp_path, target_dir,
                                                                   capsys):
    """Issue 51, item 6: ``--force`` with changed settings on an output that already has
    every result would decode nothing yet rewrite its settings file to name the new
    settings (a file that then lies about its rows): refused, the file unchanged. With a
    prompt left to decode, --force goes on (the control)."""
    assert cli.main(_batch(target_dir, tmp_path)) == 0
    side = outputs.settings_path(tmp_path / "out.jsonl")
    before = side.read_text()
    line = _refused(_batch(target_dir, tmp_path, "--force", "--seed", "7"), capsys)
    assert "--force with other settings (seed) would decode nothing" in line
    assert side.read_text() == before
    (tmp_path / "more").mkdir()
    more = _batch(target_dir, tmp_path / "more", "--force", "--seed", "7")
    more[more.index("--output") + 1] = str(tmp_path / "out.jsonl")
    _prompts_file(tmp_path / "more" / "p.jsonl", n=6)
    assert cli.main(more) == 0
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 6
    assert '"seed": 7' in side.read_text()


def test_interrupts_end_with_one_line_and_a_documented_code(tmp_path, target_dir, capsys,
                                                            monkeypatch):
    """Issue 26, finding 15: Ctrl-C or SIGTERM in batch mode ends with one line saying
    what is on disk and exit code 75 (resumable); the rerun finishes the file in input
    order; a single generation interrupted exits 130."""
    real = continuous.generate_continuous
    stop = {"signal": None}

    def one_then_stop(*args, **kw):
        for i, result in enumerate(real(*args, **kw)):
            yield result
            if stop["signal"] == "int":
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(continuous, "generate_continuous", one_then_stop)

    def unhandled(*_):  # a command that left SIGTERM alone fails here, not pytest
        raise AssertionError("SIGTERM reached the test's handler")

    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        for kind, what in (("int", "interrupted (SIGINT)"), ("term", "terminated (SIGTERM)")):
            stop["signal"] = kind
            capsys.readouterr()
            try:
                code = cli.main(_batch(target_dir, tmp_path))
            except KeyboardInterrupt:
                pytest.fail("the interrupt escaped tev-jax generate")
            assert code == exit_codes.EXIT_RESUMABLE == 75
            err = capsys.readouterr().err.strip().splitlines()
            assert err[-1].startswith(f"tev-jax generate: {what}; ")
            assert "results are in" in err[-1] and "Traceback" not in "".join(err)
        assert signal.getsignal(signal.SIGTERM) is unhandled
    finally:
        signal.signal(signal.SIGTERM, previous)
    monkeypatch.setattr(continuous, "generate_continuous", real)
    assert cli.main(_batch(target_dir, tmp_path)) == 0
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(5))
    assert len({r["settings"] for r in rows}) == 1

    def interrupted(*args, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(timing, "timed_generate", interrupted)
    capsys.readouterr()
    try:
        code = cli.main(["generate", PROMPT, "--target", str(target_dir), *AR])
    except KeyboardInterrupt:
        pytest.fail("the interrupt escaped tev-jax generate")
    assert code == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["compiling the decode program (once per setting) ...",
                   "tev-jax generate: interrupted (SIGINT)"]


def test_streams_to_a_terminal_exactly(target_dir, capsys, monkeypatch):
    """Issue 26, finding 16: on a terminal a "compiling ..." line comes first and the text
    is streamed round by round; what stdout holds at the end is what the piped run
    prints."""
    argv = ["generate", PROMPT, "--target", str(target_dir), *AR]
    assert cli.main(argv) == 0
    piped, piped_err = capsys.readouterr()
    assert piped_err.startswith("compiling the decode program")  # issue 38, item 16
    writes = []
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    real_write = sys.stdout.write
    monkeypatch.setattr(sys.stdout, "write", lambda s: (writes.append(s), real_write(s))[1])
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert out == piped and len([w for w in writes if w.strip()]) > 1
    assert err.startswith("compiling the decode program") and "streamed" in err


def test_one_bundled_drafter_damaged_leaves_the_other_usable(tmp_path):
    """Issue 26, finding 18: damage to one bundled drafter no longer blocks the other."""
    root = tmp_path / "models"
    for sub in ("target", "drafters/exittrain", "drafters/dflash"):
        (root / sub).mkdir(parents=True)
        (root / sub / "config.json").write_text("{}")
        (root / sub / "model.safetensors").write_bytes(sub.encode())
    bundled.write_manifest(root, {"dtype": "float32"})
    (root / "drafters" / "dflash" / "model.safetensors").write_bytes(b"damaged")
    paths = bundled.bundled_paths(root, drafters=("exittrain",))
    assert paths.drafter == root / "drafters" / "exittrain"
    bundled.bundled_paths(root, drafters=())
    with pytest.raises(ValueError, match="dflash/model.safetensors is corrupted"):
        bundled.bundled_paths(root, drafters=("dflash",))


def test_version_and_help_for_every_flag(capsys, monkeypatch):
    """Issue 26, finding 17: --version on both command lines; every flag has help text
    (tev-jax's plan flags are the lead's); tev-train names itself and shows no reST."""
    import argparse

    for main, name in ((cli.main, "tev-jax"), (train_cli.main, "tev-train")):
        with pytest.raises(SystemExit) as e:
            main(["--version"])
        assert e.value.code == 0 and capsys.readouterr().out.startswith(name + " 0.")
    monkeypatch.setattr(sys, "argv", ["/usr/bin/tev-train"])
    parser = train_cli.build_parser()
    assert parser.prog == "tev-train" and "`" not in parser.format_help()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subs.choices.items():
        text = sub.format_help()
        assert "`" not in text, name
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help and not action.help.startswith("(default"), (name, action)
    main_parser = argparse.ArgumentParser()
    sub = main_parser.add_subparsers()
    for add in cli.subcommands():
        add(sub)
    for name, p in sub.choices.items():
        for action in p._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, (name, action.option_strings)


def test_config_errors_name_flags_and_short_runs_get_a_warmup(capsys):
    """Issue 26, finding 17: a config error names the flags typed, not Python fields; the
    default warmup no longer fails a run shorter than it."""
    code = train_cli.main(["run", "--steps", "6", "--warmup-steps", "10"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert "--warmup-steps must be in [0, --steps=6], got 10" in err
    ns = train_cli.build_parser().parse_args(["run", "--steps", "5"])
    assert train_cli.config_from_args(ns).warmup_steps == 5


def test_checkpoints_list_without_deprecation_warnings(tmp_path, caplog):
    """Issue 26, finding 16: listing checkpoints (every tev-train run does) logs no absl
    deprecation warning."""
    with caplog.at_level(logging.WARNING):
        with TrainCheckpointer(tmp_path / "ck") as ck:
            assert ck.all_steps() == []
    assert not [r for r in caplog.records if "deprecated" in r.getMessage()]


def test_rollouts_of_another_target_are_refused(tmp_path):
    """Issue 26, finding 14: training refuses rollouts whose manifest names another
    target (by its weights' fingerprint)."""
    a, b = tmp_path / "a", tmp_path / "b"
    save_target(_target(), a, tokenizer=_tokenizer())
    save_target(init_target(CONFIG, key=9), b, tokenizer=_tokenizer())
    assert weights_fingerprint(a) != weights_fingerprint(b)
    write_rollouts(tmp_path / "data", [[1, 2]], [[3, 4]],
                   info={"target": str(a), "target_fingerprint": weights_fingerprint(a)})
    data = RolloutSet.load(tmp_path / "data")
    check_data_target(data, str(a), tmp_path / "data")
    with pytest.raises(ValueError, match=r"generated by another target .* than "
                                         r"target_path="):
        check_data_target(data, str(b), tmp_path / "data")


def test_rollouts_read_prompts_as_generate_does(tmp_path, target_dir, capsys):
    """Issue 26, finding 12 (and 14): tev-train rollouts reads prompts files with
    generate's reader (messages and prompt_ids records, ids optional, errors naming the
    line), records the target's fingerprint, and refuses to replace another run's
    rollouts without --force."""
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "w5 w6"}\n{"prompt_ids": [7, 8, 9]}\n')
    argv = ["rollouts", "--target", str(target_dir), "--prompts-file", str(p), "--out",
            str(tmp_path / "r"), "--max-prompt-len", "8", "--max-new-tokens", "4",
            "--stop-ids", "", "--batch-size", "2"]
    assert train_cli.main(argv) == 0
    assert "| 2/2 [" in capsys.readouterr().err  # issue 38, item 14: a total and an ETA
    data = RolloutSet.load(tmp_path / "r")
    assert data.tokens[1, :3].tolist() == [7, 8, 9] and data.spans.tolist() == [[2, 6], [3, 7]]
    assert data.manifest["info"]["target_fingerprint"] == weights_fingerprint(target_dir)
    assert train_cli.main(argv + ["--seed", "1"]) == 2
    assert "holds the rollouts of another run (seed differ)" in capsys.readouterr().err
    assert RolloutSet.load(tmp_path / "r").fingerprint() == data.fingerprint()
    p.write_text('{"prompt": "w5"}\n{"prompt": "w6"\n')
    assert train_cli.main(argv) == 2
    assert "p.jsonl:2: malformed JSON" in capsys.readouterr().err


# --------------------------------------------------------------------- training


def _train(root, out, *extra):
    return ["run", "--target-path", str(root / "target"), "--drafter-path",
            str(root / "drafter"), "--data-dir", str(root / "data"), "--out-dir", str(out),
            "--loss", "exit", "--budget", "8", "--batch-size", "8", "--num-anchors", "2",
            "--steps", "4", "--lr", "0.01", "--warmup-steps", "0", "--checkpoint-every", "1",
            "--no-progress", *extra]


@pytest.mark.slow
def test_training_edges(train_dirs, tmp_path, capsys, monkeypatch):
    """Issue 26, findings 4, 5, 6, 15 and 16 on one tiny run:
    15: a preempted run (SIGTERM, checkpoint saved) exits 75, not 0;
    16: the finished run ends with a summary (the drafter's folder, updates/s, losses);
    4: a refused rerun (changed --lr) leaves config.json as it was;
    6: a corrupted newest checkpoint and an empty step folder fall back to the newest
       good one, with one line and no tracebacks;
    5: --resume false moves the earlier checkpoints aside, and the next plain run
       resumes the new ones."""
    out = tmp_path / "run"
    read = RolloutSet.batch_at

    def batch_at(self, seed, step, *args, **kw):
        if step == 1:                      # preempted during update 2
            os.kill(os.getpid(), signal.SIGTERM)
        return read(self, seed, step, *args, **kw)

    monkeypatch.setattr(RolloutSet, "batch_at", batch_at)
    assert train_cli.main(_train(train_dirs, out)) == 75
    assert "train run: preempted (SIGTERM) at update 2: checkpoint saved in " in (
        capsys.readouterr().err)
    monkeypatch.setattr(RolloutSet, "batch_at", read)

    assert train_cli.main(_train(train_dirs, out)) == 0
    summary = capsys.readouterr().out
    assert f"drafter written to {out / 'drafter'}" in summary
    assert "updates 3..4 of 4 in" in summary and "updates/s" in summary
    assert "final (update 4): loss " in summary and "exit_loss" in summary
    config = (out / "config.json").read_text()

    assert train_cli.main(_train(train_dirs, out, "--lr", "0.02")) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "config differs (lr:" in err and "--resume false" in err
    assert (out / "config.json").read_text() == config

    ckdir = out / "checkpoints"
    with TrainCheckpointer(ckdir) as ck:
        steps = ck.all_steps()
    newest = ckdir / str(steps[-1])
    for f in (newest / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    (ckdir / "9").mkdir()                      # an empty step folder
    assert train_cli.main(_train(train_dirs, out, "--steps", "5")) == 2  # steps differ
    capsys.readouterr()
    assert train_cli.main(_train(train_dirs, out, "--until-update", "4")) == 0
    out_, err = capsys.readouterr()
    assert f"resuming from step {steps[-2]}, the newest checkpoint that restores" in err
    assert "Traceback" not in err and "Event loop is closed" not in err
    assert sorted(p.name for p in ckdir.iterdir() if p.name.startswith("unreadable-"))[0] \
        .startswith("unreadable-4-")

    assert train_cli.main(_train(train_dirs, out, "--resume", "false", "--until-update",
                                 "1")) == 0
    err = capsys.readouterr().err
    assert "moved the earlier run's checkpoints" in err
    aside = [p for p in tmp_path.joinpath("run").iterdir() if ".replaced-" in p.name]
    assert len(aside) == 1
    with TrainCheckpointer(ckdir) as ck:
        assert ck.all_steps() == [1]
    assert train_cli.main(_train(train_dirs, out, "--until-update", "2")) == 0
    assert "updates 2..2 of 4" in capsys.readouterr().out
    shutil.rmtree(out)
