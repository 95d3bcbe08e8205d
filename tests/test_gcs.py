"""Checkpoints in a bucket (issue 53), against a GCS emulator (`gcs_emulator`):
``tev-train run --checkpoint-dir gs://...`` saves, is preempted, resumes and ends bit for
bit as a local run; ``--keep-checkpoints`` prunes in the bucket; another run's bucket,
an unreachable, missing or denied one, and remote rollout / output folders are refused
in one line; a writer killed mid-save leaves the last complete checkpoint to resume
from; two processes write one checkpoint and both restore it.

Every check reads the emulator's own object listing (not the local disk)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from gcs_emulator import BUCKET, gcs  # noqa: F401  (a fixture)
import gcs_emulator as ge
import train_fixtures as tf
from train_fixtures import train_dirs  # noqa: F401  (a fixture)
from train import __main__ as train_cli
from train.checkpoint import TrainCheckpointer, abstract_like, steps_in
from train.loop import read_log, train
from train.rollouts import RolloutSet, write_rollouts

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 900   # a hang, not a slow shared machine (a writer takes ~30 s alone)


def _train(root, out, *extra):
    return ["run", "--target-path", str(root / "target"), "--drafter-path",
            str(root / "drafter"), "--data-dir", str(root / "data"), "--out-dir", str(out),
            "--loss", "exit", "--budget", "8", "--batch-size", "8", "--num-anchors", "2",
            "--steps", "4", "--lr", "0.01", "--warmup-steps", "0", "--checkpoint-every", "1",
            "--keep-checkpoints", "2", "--no-progress", *extra]


def _steps(gcs, prefix: str) -> dict[int, bool]:
    """Step folders under ``prefix`` in the emulator's bucket -> committed (orbax's
    ``commit_success.txt`` written)."""
    names = gcs.objects(BUCKET, prefix + "/")
    steps = {int(n.split("/")[1]) for n in names if n.split("/")[1].isdigit()}
    return {s: f"{prefix}/{s}/commit_success.txt" in names for s in sorted(steps)}


def _one_line_refusal(argv, capsys) -> str:
    capsys.readouterr()
    assert train_cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and " error: " in err
    return err


@pytest.fixture(scope="module")
def straight(train_dirs, tmp_path_factory):  # noqa: F811
    """An uninterrupted local run of `_train` (its out-dir)."""
    out = tmp_path_factory.mktemp("straight") / "run"
    assert train_cli.main(_train(train_dirs, out)) == 0
    return out


def _assert_same_run(out: Path, want: Path) -> None:
    """The same log (every metric of every update) and the same drafter, bit for bit."""
    def metrics(path):
        return [{k: v for k, v in r.items() if k not in ("step_seconds", "seq_tokens_per_s")}
                for r in read_log(path / "train_log.jsonl")]

    from safetensors.numpy import load_file

    assert metrics(out) == metrics(want)
    files = sorted(p.name for p in (want / "drafter").glob("*.safetensors"))
    assert files and files == sorted(p.name for p in (out / "drafter").glob("*.safetensors"))
    for name in files:
        got, exp = load_file(out / "drafter" / name), load_file(want / "drafter" / name)
        assert got.keys() == exp.keys()
        for k in exp:
            np.testing.assert_array_equal(got[k], exp[k])


def test_a_checkpointer_writes_prunes_and_restores_in_the_bucket(gcs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    state = lambda x: {"w": np.full((4, 3), float(x), np.float32), "step": np.int32(x)}  # noqa: E731
    with TrainCheckpointer(f"gs://{BUCKET}/unit", every=1, keep=2, async_save=True) as ck:
        for s in (1, 2, 3):
            assert ck.save(s, state(s), {"update": s})
        ck.wait()
        assert ck.all_steps() == [2, 3]
        got, meta, step = ck.restore(abstract_like(state(0)))
    assert step == 3 and meta == {"update": 3}
    np.testing.assert_array_equal(got["w"], state(3)["w"])
    assert _steps(gcs, "unit") == {2: True, 3: True}     # step 1 pruned in the bucket
    assert steps_in(f"gs://{BUCKET}/unit") == [2, 3]
    assert list(tmp_path.iterdir()) == []                  # nothing went to a local "gs:"


def test_remote_folders_are_refused_or_checked_in_one_line(gcs, train_dirs, tmp_path,  # noqa: F811
                                                           capsys, monkeypatch):
    out = tmp_path / "run"
    err = _one_line_refusal(_train(train_dirs, out, "--data-dir", f"gs://{BUCKET}/data"),
                            capsys)
    assert "--data-dir must be a local or mounted folder" in err and "gcsfuse" in err
    err = _one_line_refusal(_train(train_dirs, f"gs://{BUCKET}/out"), capsys)
    assert "--out-dir must be a local" in err and "--checkpoint-dir gs://" in err
    err = _one_line_refusal(["rollouts", "--target", "bundled", "--prompt-set", "x",
                             "--out", f"gs://{BUCKET}/rollouts"], capsys)
    assert "--out must be a local or mounted folder" in err

    err = _one_line_refusal(_train(train_dirs, out, "--checkpoint-dir", "gs://no-bucket/run"),
                            capsys)
    assert "the bucket gs://no-bucket does not exist (HTTP 404" in err
    with monkeypatch.context() as mp:
        for name, value in ge.env(f"http://127.0.0.1:{ge.free_port()}").items():
            mp.setenv(name, value)
        err = _one_line_refusal(_train(train_dirs, out, "--checkpoint-dir",
                                       f"gs://{BUCKET}/refused"), capsys)
    assert f"gs://{BUCKET} is unreachable" in err
    with ge.denying_server() as url, monkeypatch.context() as mp:
        for name, value in ge.env(url).items():
            mp.setenv(name, value)
        err = _one_line_refusal(_train(train_dirs, out, "--checkpoint-dir",
                                       f"gs://{BUCKET}/refused"), capsys)
    assert f"gs://{BUCKET} denies access (HTTP 403" in err
    assert not out.exists() and gcs.objects(BUCKET, "refused/") == []


@pytest.mark.slow
def test_a_preempted_run_resumes_from_the_bucket_bit_identically(
        gcs, train_dirs, straight, tmp_path, capsys, monkeypatch):  # noqa: F811
    """SIGTERM during update 2: saved in the bucket, exit 75; the same command resumes
    and ends as the uninterrupted local run; --keep-checkpoints 2 leaves 2 steps in the
    bucket; a run of other settings pointed at the bucket is refused."""
    monkeypatch.chdir(tmp_path)
    bucket, out = f"gs://{BUCKET}/preempted", tmp_path / "run"
    read = RolloutSet.batch_at

    def batch_at(self, seed, step, *args, **kw):
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return read(self, seed, step, *args, **kw)

    monkeypatch.setattr(RolloutSet, "batch_at", batch_at)
    assert train_cli.main(_train(train_dirs, out, "--checkpoint-dir", bucket)) == 75
    assert f"preempted (SIGTERM) at update 2: checkpoint saved in {bucket}" in \
        capsys.readouterr().err
    assert _steps(gcs, "preempted") == {1: True, 2: True}
    monkeypatch.setattr(RolloutSet, "batch_at", read)

    assert train_cli.main(_train(train_dirs, out, "--checkpoint-dir", bucket)) == 0
    assert "updates 3..4 of 4" in capsys.readouterr().out
    _assert_same_run(out, straight)
    assert _steps(gcs, "preempted") == {3: True, 4: True}
    assert not (out / "checkpoints").exists() and not (tmp_path / "gs:").exists()

    before = gcs.objects(BUCKET, "preempted/")
    err = _one_line_refusal(_train(train_dirs, tmp_path / "other", "--checkpoint-dir", bucket,
                                   "--lr", "0.02"), capsys)
    assert f"cannot resume from step 4 in {bucket}: the config differs (lr:" in err
    err = _one_line_refusal(_train(train_dirs, tmp_path / "other", "--checkpoint-dir", bucket,
                                   "--resume", "false"), capsys)
    assert "holds the checkpoints of an earlier run (steps [3, 4])" in err
    assert gcs.objects(BUCKET, "preempted/") == before
    assert not (tmp_path / "other" / "config.json").exists()

    # a committed newest step that does not restore: moved aside in the bucket, and the
    # run goes on from the step before it
    for name in before:
        if name.startswith("preempted/4/state/") and "commit_success" not in name:
            gcs.put(BUCKET, name, b"garbage")
    assert train_cli.main(_train(train_dirs, out, "--checkpoint-dir", bucket)) == 0
    out_, err = capsys.readouterr()
    assert "resuming from step 3, the newest checkpoint that restores" in err
    assert "updates 4..4 of 4" in out_ and "Traceback" not in err
    _assert_same_run(out, straight)
    names = gcs.objects(BUCKET, "preempted/")
    assert any(n.startswith("preempted/unreadable-4-") for n in names)
    assert _steps(gcs, "preempted") == {3: True, 4: True}


@pytest.mark.slow
def test_a_writer_killed_mid_save_resumes_from_the_last_complete_checkpoint(
        gcs, train_dirs, straight, tmp_path, capsys):  # noqa: F811
    """SIGKILL while update 3's arrays are being written (the relay kills the writer when
    it asks to write their OCDBT manifest): step 3 is in the bucket without its commit
    marker; the rerun resumes from step 2 and ends as the uninterrupted run."""
    bucket, out = f"gs://{BUCKET}/killed", tmp_path / "run"
    writer, killed = [], threading.Event()

    def on_request(method, path):
        if method == "POST" and "name=killed/3/state/ocdbt.process_0/manifest.ocdbt" in path:
            writer[0].send_signal(signal.SIGKILL)
            killed.set()
            return False
        return True

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    log = tmp_path / "writer.log"
    with ge.relay(gcs.url, on_request) as url, open(log, "w") as f:
        writer.append(subprocess.Popen(
            [sys.executable, "-m", "train", *_train(train_dirs, out, "--checkpoint-dir", bucket)],
            env={**env, **ge.env(url)}, stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path))
        try:
            rc = writer[0].wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            writer[0].kill()
            pytest.fail(f"the writer did not finish in {TIMEOUT_S} s")
    assert killed.is_set() and rc == -signal.SIGKILL, log.read_text()[-3000:]
    steps = _steps(gcs, "killed")
    assert steps[2] and steps[3] is False          # 3: objects, but no commit marker

    assert train_cli.main(_train(train_dirs, out, "--checkpoint-dir", bucket)) == 0
    assert "updates 3..4 of 4" in capsys.readouterr().out
    _assert_same_run(out, straight)
    assert _steps(gcs, "killed") == {3: True, 4: True}


WORKER = Path(__file__).with_name("gcs_multihost_worker.py")
TRAIN_WORKER = Path(__file__).with_name("multihost_worker.py")


def _launch(spec: dict, out: Path, worker: Path = WORKER) -> list[dict]:
    """Runs the two processes of ``worker`` to completion; their ``proc<i>.json``."""
    out.mkdir(parents=True, exist_ok=True)
    port = str(ge.free_port())
    procs, logs = [], [out / f"proc{i}.log" for i in range(2)]
    for i, log in enumerate(logs):
        with open(log, "w") as f:
            procs.append(subprocess.Popen(
                [sys.executable, str(worker), str(i), port,
                 json.dumps({**spec, "out": str(out), "timeout_s": TIMEOUT_S})],
                stdout=f, stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the 2-process job did not finish in {TIMEOUT_S} s")
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"process {i}: {p.returncode}\n{log.read_text()[-3000:]}"
    return [json.loads((out / f"proc{i}.json").read_text()) for i in range(2)]


@pytest.mark.slow
def test_two_processes_write_one_checkpoint_and_both_resume_from_it(gcs, tmp_path):
    """jax.distributed on localhost, 2 processes x 2 CPU devices, an array sharded over
    all 4: one job saves step 1 to the bucket, a new job restores it in both processes
    (each gets its own shards back, with the saved sharding)."""
    directory = f"gs://{BUCKET}/two"
    saved = _launch({"directory": directory, "mode": "save"}, tmp_path / "save")
    assert all(r["saved"] and r["steps"] == [1] for r in saved)
    names = gcs.objects(BUCKET, "two/")
    assert "two/1/commit_success.txt" in names
    for i in range(2):     # each process wrote its own shards
        assert any(n.startswith(f"two/1/state/ocdbt.process_{i}/") for n in names)
    restored = _launch({"directory": directory, "mode": "restore"}, tmp_path / "restore")
    for r in restored:
        assert r["step"] == 1 and r["meta"] == {"update": 1} and r["same_sharding"]
        assert r["local"] == r["expected"] and len(r["local"]) == 2
    assert restored[0]["expected"] != restored[1]["expected"]


@pytest.mark.slow
def test_two_processes_preempted_save_in_the_bucket_and_both_resume(gcs, tmp_path):
    """`tests/multihost_worker.py` (2 processes x 1 CPU device, fsdp 2: each process
    holds half of every parameter) with --checkpoint-dir in the bucket: process 1 gets
    SIGTERM, both save the same update there and stop; a new job resumes both from it
    and ends as one process does."""
    data = tf.progressions()
    write_rollouts(tmp_path / "data", [t[:s] for t, (s, _) in zip(data.tokens, data.spans)],
                   [t[s:e] for t, (s, e) in zip(data.tokens, data.spans)], shard_size=16)
    config = {"mesh_fsdp": 2, "checkpoint_dir": f"gs://{BUCKET}/pod"}
    spec = {"data": str(tmp_path / "data"), "config": config, "devices": 1,
            "until_update": 3, "check_batches": 0}
    # a job of 1-device processes that loads the step another job compiled (jax's
    # persistent cache) hangs in its first cross-process all-reduce (jax 0.10.2, CPU):
    # one cache per job
    first = _launch({**spec, "sigterm_at_micro": 0, "compile_cache": str(tmp_path / "cc0")},
                    tmp_path / "two", TRAIN_WORKER)
    assert all(r["preempted"] for r in first)
    saved = first[0]["history"][-1]["update"]
    assert first[1]["history"][-1]["update"] == saved < 3
    steps = _steps(gcs, "pod")
    assert steps[saved] and max(steps) == saved
    names = gcs.objects(BUCKET, f"pod/{saved}/state/")
    for i in range(2):
        assert any(n.startswith(f"pod/{saved}/state/ocdbt.process_{i}/") for n in names)

    second = _launch({**spec, "compile_cache": str(tmp_path / "cc1")}, tmp_path / "two",
                     TRAIN_WORKER)
    assert [r["start_update"] for r in second] == [saved, saved]
    target, drafter = tf.models()
    one = train(tf.config(tmp_path / "one", mesh_fsdp=2), target=target, drafter=drafter,
                data=RolloutSet.load(tmp_path / "data"), until_update=3, progress=False,
                save_final_drafter=False)
    history = first[0]["history"] + second[0]["history"]
    assert [h["update"] for h in history] == [1, 2, 3]
    for key in ("loss", "token_loss", "exit_loss", "grad_norm"):
        # the two programs sum gradients in different orders (tests/test_multihost.py)
        np.testing.assert_allclose([h[key] for h in history],
                                   [h[key] for h in one.history], rtol=2e-5, atol=1e-5)
