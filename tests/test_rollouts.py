"""Rollout storage: shards written by any number of processes hold the same sequences,
the manifest appears only once every shard is complete, format-1 folders still load,
and a process reads the rows of its part of a batch consistently with the whole batch.
``tev-train rollouts`` (issues 26 and 38): prompts files read as generate reads them,
the target's fingerprint recorded (training refuses another target's rollouts), another
run's rollouts kept without --force, bad flags refused in one line with nothing written."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

import train_fixtures as tf
from cli_fixtures import (
    CONFIG, nothing_but, train_refused_one_line, word_target, word_tokenizer,
)
from cli_fixtures import model_dirs, target_dir  # noqa: F401  (fixtures)

from tev_jax.models import init_target, save_target
from tev_jax.models.checkpoint_io import weights_fingerprint
from train.__main__ import main
from train.loop import check_data_target
from train.rollouts import (
    FORMAT_V1,
    RolloutConfig,
    RolloutSet,
    make_rollouts,
    write_manifest,
    write_rollouts,
    write_shard,
)

PROMPTS = [[1, 5, 9, 11], [1, 7], [1, 20, 21, 22, 23, 24], [1, 8, 9]]
RC = RolloutConfig(max_prompt_len=5, max_new_tokens=6, stop_token_ids=(2,), batch_size=2,
                   shard_size=2, seed=3)


def _arrays(data: RolloutSet):
    return data.tokens, data.spans


def test_rollouts_round_trip(tmp_path):
    from tev_jax.decode import DecodeConfig
    from tev_jax.engine import generate_ar

    target, _ = tf.models()
    manifest = make_rollouts(target, PROMPTS, tmp_path / "roll", RC)
    assert [s["count"] for s in manifest["shards"]] == [2, 2]
    data = RolloutSet.load(tmp_path / "roll")
    dc = DecodeConfig(max_new_tokens=6, builder="none", sampling=RC.sampling,
                      stop_token_ids=(2,))
    cut = [p[-5:] for p in PROMPTS]
    for shard in range(2):        # shard i, batch 0: fold_in(fold_in(key(seed), i), 0)
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(3), shard), 0)
        gen = generate_ar(target, cut[2 * shard:2 * shard + 2], dc, key).rows()
        for j, (p, r) in enumerate(zip(cut[2 * shard:], gen)):
            start, end = data.spans[2 * shard + j]
            assert start == len(p) and end == len(p) + len(r)
            np.testing.assert_array_equal(data.tokens[2 * shard + j, :end], p + r)
            assert (data.tokens[2 * shard + j, end:] == 0).all()
    assert data.fingerprint() == RolloutSet(data.tokens, data.spans).fingerprint()
    (tmp_path / "roll" / "shard-00001-of-00002.spans.npy").unlink()
    with pytest.raises(ValueError, match="shard-00001-of-00002.spans.npy is missing"):
        RolloutSet.load(tmp_path / "roll")


def test_two_processes_write_the_same_set_and_the_last_writes_the_manifest(tmp_path, capsys):
    target, _ = tf.models()
    make_rollouts(target, PROMPTS, tmp_path / "one", RC)
    one = RolloutSet.load(tmp_path / "one")
    calls = []
    assert make_rollouts(target, PROMPTS, tmp_path / "two", RC, progress=calls.append,
                         process_index=1, process_count=2) is None
    assert sum(calls) == 2                      # shard 1 only
    assert not (tmp_path / "two" / "manifest.json").exists()
    with pytest.raises(ValueError, match="no manifest.json .*--merge"):
        RolloutSet.load(tmp_path / "two")
    with pytest.raises(ValueError, match=r"1 of 2 shards are not written yet \(missing \[0\]\)"):
        write_manifest(tmp_path / "two")
    assert main(["rollouts", "--merge", "--out", str(tmp_path / "two")]) == 2
    assert "not written yet" in capsys.readouterr().err
    assert make_rollouts(target, PROMPTS, tmp_path / "two", RC, process_index=0,
                         process_count=2) is not None
    two = RolloutSet.load(tmp_path / "two")
    for a, b in zip(_arrays(one), _arrays(two)):
        np.testing.assert_array_equal(a, b)
    assert one.fingerprint() == two.fingerprint()

    # A restarted process keeps its complete shards; another run's shard is refused.
    calls.clear()
    make_rollouts(target, PROMPTS, tmp_path / "two", RC, progress=calls.append,
                  process_index=1, process_count=2)
    assert calls == []
    other = dataclasses.replace(RC, seed=4)
    make_rollouts(target, PROMPTS, tmp_path / "mixed", RC, process_index=0, process_count=2)
    with pytest.raises(ValueError, match=r"holds the rollouts of another run \(seed differ\)"):
        make_rollouts(target, PROMPTS, tmp_path / "mixed", other, process_index=1,
                      process_count=2)
    write_shard(tmp_path / "mixed", 1, 2, np.zeros((2, 16), np.int32),
                np.zeros((2, 2), np.int32), key="another run")   # a shard written by hand
    assert not (tmp_path / "mixed" / "manifest.json").exists()
    with pytest.raises(ValueError, match="shards disagree on key"):
        write_manifest(tmp_path / "mixed")
    make_rollouts(target, PROMPTS, tmp_path / "mixed", other, process_index=1,
                  process_count=2, replace=True)                  # --force: replaced
    assert not (tmp_path / "mixed" / "shard-00000-of-00002.json").exists()
    (tmp_path / "two" / "manifest.json").unlink()
    assert main(["rollouts", "--merge", "--out", str(tmp_path / "two")]) == 0
    assert RolloutSet.load(tmp_path / "two").fingerprint() == one.fingerprint()


def test_format_1_folders_still_load(tmp_path):
    data = tf.progressions(num=10)
    folder = tmp_path / "v1"
    folder.mkdir()
    shards = []
    for s, rows in enumerate((slice(0, 6), slice(6, 10))):
        np.save(folder / f"tokens-{s:05d}.npy", data.tokens[rows])
        np.save(folder / f"spans-{s:05d}.npy", data.spans[rows])
        shards.append({"tokens": f"tokens-{s:05d}.npy", "spans": f"spans-{s:05d}.npy",
                       "count": len(data.tokens[rows])})
    (folder / "manifest.json").write_text(json.dumps(
        {"format": FORMAT_V1, "seq_len": data.seq_len, "pad_id": 0, "num_sequences": 10,
         "shards": shards, "info": {}}))
    loaded = RolloutSet.load(folder)
    for a, b in zip(_arrays(loaded), _arrays(data)):
        np.testing.assert_array_equal(a, b)
    assert loaded.fingerprint() == data.fingerprint()
    (folder / "manifest.json").write_text(json.dumps({"format": "tev-jax-rollouts/9"}))
    with pytest.raises(ValueError, match="format 'tev-jax-rollouts/9'"):
        RolloutSet.load(folder)


def test_rows_of_a_batch_agree_with_the_whole_batch(tmp_path):
    data = tf.progressions()
    write_rollouts(tmp_path / "set", list(data.tokens[:, :3]), list(data.tokens[:, 3:]),
                   shard_size=24)                  # shards of 24, 24 and 16 sequences
    loaded = RolloutSet.load(tmp_path / "set")
    assert loaded.fingerprint() == data.fingerprint()
    rows = np.array([1, 4, 5, 6])
    for step in (0, 9):                            # step 9 spans two epochs
        whole = loaded.batch_at(5, step, 8, 2, 3)
        part = loaded.batch_at(5, step, 8, 2, 3, rows=rows)
        for name in ("tokens", "anchors", "valid", "indices"):
            np.testing.assert_array_equal(getattr(part, name), getattr(whole, name)[rows])
        np.testing.assert_array_equal(whole.tokens, data.tokens[whole.indices])
    other = loaded.batch_at(5, 1, 8, 2, 3, rows=rows)
    assert not np.array_equal(other.indices, part.indices)       # the step matters


def test_rollouts_of_another_target_are_refused(tmp_path):
    """Issue 26, finding 14: training refuses rollouts whose manifest names another
    target (by its weights' fingerprint)."""
    a, b = tmp_path / "a", tmp_path / "b"
    save_target(word_target(), a, tokenizer=word_tokenizer())
    save_target(init_target(CONFIG, key=9), b, tokenizer=word_tokenizer())
    assert weights_fingerprint(a) != weights_fingerprint(b)
    write_rollouts(tmp_path / "data", [[1, 2]], [[3, 4]],
                   info={"target": str(a), "target_fingerprint": weights_fingerprint(a)})
    data = RolloutSet.load(tmp_path / "data")
    check_data_target(data, str(a), tmp_path / "data")
    with pytest.raises(ValueError, match=r"generated by another target .* than "
                                         r"target_path="):
        check_data_target(data, str(b), tmp_path / "data")


def test_rollouts_read_prompts_as_generate_does(tmp_path, target_dir, capsys):  # noqa: F811
    """Issue 26, finding 12 (and 14): tev-train rollouts reads prompts files with
    generate's reader (messages and prompt_ids records, ids optional, errors naming the
    line), records the target's fingerprint, and refuses to replace another run's
    rollouts without --force."""
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "w5 w6"}\n{"prompt_ids": [7, 8, 9]}\n')
    argv = ["rollouts", "--target", str(target_dir), "--prompts-file", str(p), "--out",
            str(tmp_path / "r"), "--max-prompt-len", "8", "--max-new-tokens", "4",
            "--stop-ids", "", "--batch-size", "2"]
    assert main(argv) == 0
    assert "| 2/2 [" in capsys.readouterr().err  # issue 38, item 14: a total and an ETA
    data = RolloutSet.load(tmp_path / "r")
    assert data.tokens[1, :3].tolist() == [7, 8, 9] and data.spans.tolist() == [[2, 6], [3, 7]]
    assert data.manifest["info"]["target_fingerprint"] == weights_fingerprint(target_dir)
    assert main(argv + ["--seed", "1"]) == 2
    assert "holds the rollouts of another run (seed differ)" in capsys.readouterr().err
    assert RolloutSet.load(tmp_path / "r").fingerprint() == data.fingerprint()
    p.write_text('{"prompt": "w5"}\n{"prompt": "w6"\n')
    assert main(argv) == 2
    assert "p.jsonl:2: malformed JSON" in capsys.readouterr().err


def test_rollouts_flags(model_dirs, tmp_path, capsys):  # noqa: F811
    """Issue 38, item 14: --limit -1 and an out-of-vocabulary --pad-id / --stop-ids are
    refused (no output folder); the bundled target can be named; a run refused inside
    decoding leaves no empty folder behind."""
    p = tmp_path / "p.txt"
    p.write_text("w5 w6\nw7\n")
    base = ["rollouts", "--prompts-file", str(p), "--out", str(tmp_path / "r"),
            "--max-prompt-len", "8", "--max-new-tokens", "4"]
    t = ["--target", str(model_dirs / "target")]
    assert "--limit must be >= 0" in train_refused_one_line(base + t + ["--limit", "-1"],
                                                            capsys)
    assert "--pad-id 99999 is outside" in train_refused_one_line(
        base + t + ["--pad-id", "99999"], capsys)
    assert "--stop-ids takes comma-separated" in train_refused_one_line(
        base + t + ["--stop-ids", "abc"], capsys)
    line = train_refused_one_line(base + ["--target", "bundled", "--pad-id", "-1"], capsys)
    assert "--pad-id -1 is outside the target's vocabulary [0, 4096)" in line
    nothing_but(tmp_path, "p.txt")
    from tev_jax.models import load_target

    with pytest.raises(ValueError, match="stop token id 99999"):
        make_rollouts(load_target(model_dirs / "target"), [[5, 6]], tmp_path / "deep" / "r",
                      RolloutConfig(max_prompt_len=4, max_new_tokens=2,
                                    stop_token_ids=(99999,)))
    nothing_but(tmp_path, "p.txt")
