"""Batch generation files and command line (tev_jax.batch.outputs, `tev-jax generate --prompts`).

Prompts files (JSONL kinds, plain text, every bad-input message), chat templates,
prompt-buffer checks, resumable output with its settings sidecar, process shards and
their merge, the end-to-end command on a tiny saved target (two process shards merged
= the greedy reference; a rerun resumes; another configuration is refused), and the
layering rule: importing tev_jax and its CLI never imports ``train``; the rates a job
reports (tev_jax.batch.rates). The prompts-file job's refusals: tests/test_batch_job.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from decode_fixtures import greedy_reference, tiny_target

from tev_jax import text_io
from tev_jax.batch import outputs
from tev_jax.data import prompts as prompt_sets
from tev_jax.data import tokenizer as tok_lib

V = 64


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# ------------------------------------------------------------------- prompts files


def test_read_prompts_kinds_and_text(tmp_path):
    f = _write(tmp_path / "p.jsonl", [
        '{"id": "a", "prompt": "hello"}', "",
        '{"id": 2, "messages": [{"role": "user", "content": "hi"}]}',
        '{"id": "c", "prompt_ids": [1, 2, 3]}'])
    records = text_io.read_prompts(f)
    assert [(r.id, r.line, r.kind) for r in records] == [
        ("a", 1, "prompt"), (2, 3, "messages"), ("c", 4, "prompt_ids")]
    assert records[2].value == [1, 2, 3]
    text = _write(tmp_path / "p.txt", ["first prompt", "second prompt", ""])
    assert [(r.id, r.value) for r in text_io.read_prompts(text)] == [
        (1, "first prompt"), (2, "second prompt")]


@pytest.mark.parametrize("line, message", [
    ('{"id": "a", "prompt": "x"', "p.jsonl:2: malformed JSON"),
    ('["a"]', "p.jsonl:2: expected a JSON object"),
    ('{"prompt": "x"}', "p.jsonl:2: missing id"),
    ('{"id": "b", "prompt": ""}', "p.jsonl:2: id 'b' has an empty prompt"),
    ('{"id": "b", "prompt": 42}', "p.jsonl:2: id 'b': prompt must be a string, got int 42"),
    ('{"id": "b"}', "p.jsonl:2: id 'b' needs exactly one of"),
    ('{"id": "b", "prompt": "x", "prompt_ids": [1]}', "needs exactly one of"),
    ('{"id": "b", "messages": [{"role": "user"}]}', "messages must be a non-empty list"),
    ('{"id": "b", "prompt_ids": [1, "2"]}', "prompt_ids must be a non-empty list"),
    ('{"id": "ok", "prompt": "y"}', "p.jsonl:2: id 'ok' already used on line 1"),
])
def test_read_prompts_bad_lines(tmp_path, line, message):
    f = _write(tmp_path / "p.jsonl", ['{"id": "ok", "prompt": "x"}', line])
    with pytest.raises(ValueError, match=message):
        text_io.read_prompts(f)


def test_read_prompts_bad_files(tmp_path):
    with pytest.raises(ValueError, match="no such prompts file"):
        text_io.read_prompts(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="a directory; give a prompts file"):
        text_io.read_prompts(tmp_path)
    with pytest.raises(ValueError, match="p.txt:2: empty prompt"):
        text_io.read_prompts(_write(tmp_path / "p.txt", ["a", " ", "b"]))
    with pytest.raises(ValueError, match="no prompts"):
        text_io.read_prompts(_write(tmp_path / "e.jsonl", [""]))


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


def test_prompt_files_name_a_float_id_and_a_json_array(tmp_path):
    """Issue 38, nits: a JSON id 1.5 is named as a bad id (not a missing one); a .json
    array file is told it should be JSONL."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": 1.5, "prompt": "x"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:1: id 1.5 must be a non-empty string or "
                                         r"an integer, got float"):
        text_io.read_prompts(f)
    f = tmp_path / "p.json"
    f.write_text('[{"id": 1, "prompt": "x"}]\n')
    with pytest.raises(ValueError, match=r"p.json: a JSON array; a prompts file is JSONL"):
        text_io.read_prompts(f)


def test_chat_templates_and_encoding(tmp_path):
    from tev_jax.models.bundled import bundled_paths

    tokenizer = tok_lib.load_default_tokenizer()
    config = json.loads((bundled_paths().target / "tokenizer_config.json").read_text())
    user = [{"role": "user", "content": "What is 2 + 3?"}]
    assert text_io.chat_formatter(config)(user) == tok_lib.format_chat("What is 2 + 3?")
    assert text_io.chat_formatter(None)(user) == tok_lib.format_chat("What is 2 + 3?")
    with pytest.raises(ValueError, match="must be one user turn"):
        text_io.chat_formatter(None)(user + [{"role": "assistant", "content": "5"}])
    with pytest.raises(ValueError, match="chat template: system messages must be followed"):
        text_io.chat_formatter(config)([{"role": "system", "content": "x"}])

    # A template that writes BOS itself: no second BOS from the tokenizer.
    with_bos = {"chat_template": "{{ bos_token }}{{ messages[0]['content'] }}",
                "bos_token": tok_lib.BOS}
    records = text_io.read_prompts(_write(tmp_path / "p.jsonl", [
        '{"id": "m", "messages": [{"role": "user", "content": "hi there"}]}',
        '{"id": "t", "prompt": "hi there"}', '{"id": "i", "prompt_ids": [7, 8, 9, 10]}']))
    enc = lambda **kw: text_io.encode_records(
        records, tokenizer, text_io.chat_formatter(with_bos), vocab_size=4096, **kw)
    m, t, i = enc(prompt_len=None, truncate=False)
    assert m.prompt_ids == t.prompt_ids == tokenizer.encode("hi there").ids
    assert m.prompt_ids[0] == tok_lib.BOS_ID and m.prompt_ids[1] != tok_lib.BOS_ID
    assert i.prompt_ids == [7, 8, 9, 10]
    with pytest.raises(ValueError, match=r"prompts:3: id 'i': the prompt has 4 tokens, more "
                                         r"than the prompt buffer \(3\).*--truncate left"):
        enc(prompt_len=3, truncate=False)
    assert enc(prompt_len=3, truncate=True)[2].prompt_ids == [8, 9, 10]
    with pytest.raises(ValueError, match=r"prompts:3: id 'i': token id 10 is outside the "
                                         r"vocabulary \[0, 10\)"):
        text_io.encode_records(records[2:], tokenizer, None, vocab_size=10,
                                prompt_len=None, truncate=False)


# ------------------------------------------------------------------------- output


def test_output_resume_and_settings(tmp_path):
    out = tmp_path / "out.jsonl"
    settings = {"builder": "ddtree", "seed": 0, "run": {"batch_size": 8}}
    done, f = outputs.open_output(out, settings)
    assert done == set()
    with f:
        outputs.write_line(f, {"id": "a", "text": "x"})
        outputs.write_line(f, {"id": 2, "text": "y"})
        f.write('{"id": "c", "te')  # an interrupted write
    rerun = dict(settings, run={"batch_size": 32})  # run entries may change
    done, f = outputs.open_output(out, rerun)
    f.close()
    assert done == {'"a"', "2"}
    assert out.read_text().endswith('"y"}\n')  # the partial line is cut, its id reruns
    side = json.loads(outputs.settings_path(out).read_text())
    fingerprint = outputs.settings_fingerprint(settings)
    assert side == dict(settings, run={"batch_size": 32, "fingerprint": fingerprint})

    with pytest.raises(ValueError, match=r"other settings \(seed differ.*--force"):
        outputs.open_output(out, dict(settings, seed=1))
    done, f = outputs.open_output(out, dict(settings, seed=1), force=True)
    f.close()
    assert done == {'"a"', "2"}
    assert json.loads(outputs.settings_path(out).read_text())["seed"] == 1
    # issue 26, finding 13: the rows made before keep their settings on disk
    kept = tmp_path / f"out.settings.{fingerprint}.json"
    assert json.loads(kept.read_text())["seed"] == 0

    stray = _write(tmp_path / "other.jsonl", ['{"id": 1}'])
    with pytest.raises(ValueError, match="has no settings file"):
        outputs.open_output(stray, settings)
    outputs.settings_path(stray).write_text(json.dumps(settings))
    _write(stray, ["not json"])
    with pytest.raises(ValueError, match="other.jsonl:1: not a JSON line"):
        outputs.open_output(stray, settings)


def test_shards_and_merge(tmp_path):
    out = tmp_path / "out.jsonl"
    assert outputs.shard_path(out, 0, 1) == out
    assert outputs.shard_path(out, 1, 3).name == "out.1-of-3.jsonl"
    with pytest.raises(ValueError, match="process index 3 is outside"):
        outputs.shard_path(out, 3, 3)
    items = list(range(10))
    shards = [outputs.shard_of(items, i, 3) for i in range(3)]
    assert sorted(sum(shards, [])) == items and shards[1] == [1, 4, 7]

    with pytest.raises(ValueError, match="no shards"):
        outputs.merge_outputs(out)
    settings = {"seed": 0}
    for i in range(3):
        _, f = outputs.open_output(outputs.shard_path(out, i, 3),
                                    dict(settings, run={"process_index": i}))
        with f:
            for rid in shards[i]:
                outputs.write_line(f, {"id": rid})
    assert outputs.merge_outputs(out) == 10
    assert sorted(json.loads(line)["id"] for line in out.read_text().splitlines()) == items
    assert json.loads(outputs.settings_path(out).read_text())["seed"] == 0
    with pytest.raises(ValueError, match="exists; remove it or use --force"):
        outputs.merge_outputs(out)

    with outputs.shard_path(out, 2, 3).open("a") as f:
        f.write('{"id": 0}\n')
    with pytest.raises(ValueError, match="id 0 is in shards 0 and 2"):
        outputs.merge_outputs(out, force=True)
    outputs.settings_path(outputs.shard_path(out, 2, 3)).write_text('{"seed": 1}')
    with pytest.raises(ValueError, match="different settings"):
        outputs.merge_outputs(out, force=True)
    outputs.shard_path(out, 1, 3).unlink()
    with pytest.raises(ValueError, match=r"shards \[1\] of 3 are missing"):
        outputs.merge_outputs(out, force=True)


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


# ------------------------------------------------------------------- command line


PROMPTS = [[5, 17, 3], [9, 1, 2, 33, 60], [30], [8, 8, 2, 40, 41, 42, 1], [12, 50]]


def _saved_job(tmp_path):
    """A tiny target saved with a word-level tokenizer, and `PROMPTS` as a prompts file;
    -> (target, tokenizer, prompts file)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from tev_jax.models import save_target

    target = tiny_target(seed=8)
    words = [f"w{i}" for i in range(V)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    save_target(target, tmp_path / "target", tokenizer=tok)
    f = _write(tmp_path / "p.jsonl", [json.dumps({"id": f"q{i}", "prompt_ids": p})
                                      for i, p in enumerate(PROMPTS)])
    return target, tok, f


def test_cli_batch_generate_shards_resume_and_refusal(tmp_path, capsys):
    from tev_jax import cli

    target, tok, f = _saved_job(tmp_path)
    prompts = PROMPTS
    out = tmp_path / "out.jsonl"
    common = ["generate", "--prompts", str(f), "--output", str(out), "--target",
              str(tmp_path / "target"), "--builder", "none", "--max-new-tokens", "6",
              "--batch-size", "2", "--process-count", "2"]
    for index in ("0", "1"):
        assert cli.main(common + ["--process-index", index,
                                  "--summary-json", str(tmp_path / f"s{index}.json")]) == 0
    assert [json.loads((tmp_path / f"s{i}.json").read_text())["prompts"] for i in (0, 1)] == [3, 2]
    assert cli.main(["merge-outputs", str(out)]) == 0
    got = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    reference = greedy_reference(target, prompts, 6)
    for i, want in enumerate(reference):
        r = got[f"q{i}"]
        assert r["token_ids"] == want and r["text"] == tok.decode(want)
        assert (r["rounds"], r["tau"], r["stop_reason"]) == (5, 1.0, "length")

    # A rerun of shard 0 finds every id done; other settings are refused.
    assert cli.main(common + ["--process-index", "0", "--summary-json",
                              str(tmp_path / "again.json")]) == 0
    again = json.loads((tmp_path / "again.json").read_text())
    assert (again["prompts"], again["skipped"]) == (0, 3)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli.main(common + ["--process-index", "0", "--max-new-tokens", "7"])
    assert "max_new_tokens differ" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(common + ["--process-index", "0", "--prompt-len", "4"])
    assert "p.jsonl:2: id 'q1': the prompt has 5 tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["generate", "--target", str(tmp_path / "target"), "--builder", "none"])
    assert "give a PROMPT, or --prompts FILE" in capsys.readouterr().err


@pytest.mark.slow  # the fast tier's time (README: under 10 minutes here), 2026-12-06
def test_a_sampled_batch_job_does_not_depend_on_processes_batch_or_resume(tmp_path):
    """At T = 1, prompt i of the file decodes with row key i of ``--seed``: two process
    shards merged, one process with 3 slots, and a rerun that resumes after two results
    give the same tokens as row i of one `tev_jax.generate` of all prompts. Negative
    control: another seed changes most of them."""
    from tev_jax import cli, engine
    from tev_jax.decode import DecodeConfig
    from tev_jax.sampling import Sampling

    target, _, f = _saved_job(tmp_path)
    common = ["generate", "--prompts", str(f), "--target", str(tmp_path / "target"),
              "--builder", "none", "--max-new-tokens", "6", "--temperature", "1"]

    def job(name, *flags, seed="3"):
        out = tmp_path / name
        assert cli.main(common + ["--output", str(out), "--seed", seed, *flags]) == 0
        return out

    def tokens(out):
        return {r["id"]: r["token_ids"] for r in map(json.loads, out.read_text().splitlines())}

    sharded = tmp_path / "sharded.jsonl"
    for index in ("0", "1"):
        job("sharded.jsonl", "--batch-size", "2", "--process-count", "2",
            "--process-index", index)
    assert cli.main(["merge-outputs", str(sharded)]) == 0
    whole = engine.generate(target, None, PROMPTS, DecodeConfig(
        max_new_tokens=6, builder="none", sampling=Sampling(temperature=1.0)), key=3)
    want = {f"q{i}": row for i, row in enumerate(whole.rows())}
    assert tokens(sharded) == want
    one = job("one.jsonl", "--batch-size", "3")
    assert tokens(one) == want
    lines = one.read_text().splitlines()
    one.write_text("\n".join(lines[:2]) + "\n")  # as if stopped after two results
    assert tokens(job("one.jsonl", "--batch-size", "3")) == want
    other = tokens(job("other.jsonl", "--batch-size", "3", seed="4"))
    assert sum(other[k] != want[k] for k in want) >= 3


def test_tev_jax_does_not_import_train():
    code = ("import sys, tev_jax, tev_jax.cli, tev_jax.batch.continuous, tev_jax.batch.outputs, "
            "tev_jax.decode; bad = [m for m in sys.modules if m == 'train' or "
            "m.startswith('train.')]; print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_an_output_folder_that_is_a_file_names_the_flag_it_came_from(tmp_path):
    """Issue 51, item 7: tev-train run --out-dir FILE named generate's --output."""
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(ValueError, match=rf"{afile}: cannot write there \({afile} is a file, "
                       r"not a folder\); choose another --out-dir"):
        with outputs.lock_output(afile / "run", flag="--out-dir", what=str(afile)):
            pass
    with pytest.raises(ValueError, match=r"choose another --output$"):
        with outputs.lock_output(afile / "out.jsonl"):
            pass


def test_run_flags_have_their_own_help():
    """Issue 51, item 7: --keep-checkpoints' help repeated --checkpoint-every's."""
    from train.config import field_help

    helps = field_help()
    assert helps["keep_checkpoints"] != helps["checkpoint_every"]
    assert "kept" in helps["keep_checkpoints"] and "every" in helps["checkpoint_every"]


@pytest.mark.parametrize("rate, shown", [(885.31, "885.3"), (10.0, "10.0"), (4.567, "4.57"),
                                         (0.03123, "0.0312"), (0.0004, "0.0004")])
def test_a_slow_generation_does_not_read_zero_tokens_per_second(rate, shown):
    """Issue 51, item 7: --budget 20000 printed '0.0 tokens/s'."""
    from tev_jax.cli.generate import per_second

    assert per_second(rate) == shown


def test_window_rates_ignore_bursts():
    """Issue 47, item 11: rows finishing together do not read as thousands of prompts/s;
    the rate is over the window's real span."""
    from tev_jax.batch.rates import WindowRate

    now = [0.0]
    rate = WindowRate(window=10.0, min_span=2.0, clock=lambda: now[0])
    now[0] = 1.0
    for _ in range(5):                      # five rows in one call
        rate.add(prompts=1, tokens=100)
    assert rate.rate("prompts") is None     # under min_span: no rate yet
    now[0] = 4.0
    rate.add(prompts=1, tokens=100)
    assert rate.rate("prompts") == pytest.approx(6 / 4.0)
    now[0] = 20.0                           # the window moves on
    rate.add(prompts=1, tokens=50)
    assert rate.rate("tokens") is None or rate.rate("tokens") < 100
