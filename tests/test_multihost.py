"""Two processes x 4 CPU devices (jax.distributed on localhost) train like one process
with 8 devices, each reading only its half of every batch; one host's SIGTERM makes both
save at the same update, and a new job resumes to the same final state."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import train_fixtures as tf
from tev_jax import sharding as shd
from train.loop import train
from train.rollouts import RolloutSet, write_rollouts

WORKER = Path(__file__).with_name("multihost_worker.py")
CONFIG = dict(mesh_data=2, mesh_fsdp=4)
UPDATES = 3
TIMEOUT_S = 900         # a hang, not a slow shared machine (the job takes ~200 s alone)

pytestmark = pytest.mark.skipif(not shd.device_count_ok(8), reason="needs 8 host devices")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(out: Path, data: Path, **spec) -> list[dict]:
    """Runs both processes to completion; returns their ``proc<i>.json`` records."""
    out.mkdir(parents=True, exist_ok=True)
    spec = json.dumps({"out": str(out), "data": str(data), "config": CONFIG,
                       "until_update": UPDATES, "check_batches": 0, "timeout_s": TIMEOUT_S,
                       "compile_cache": str(out.parent / "compile_cache"), **spec})
    port = str(_free_port())
    # Each process logs to a file, not a pipe: an unread pipe that fills up blocks its
    # writer, and the other process then waits for it at the next barrier.
    logs = [out / f"proc{i}.log" for i in range(2)]
    procs = []
    for i, log in enumerate(logs):
        with open(log, "w") as f:
            procs.append(subprocess.Popen([sys.executable, str(WORKER), str(i), port, spec],
                                          stdout=f, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the 2-process job did not finish in {TIMEOUT_S} s")
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, (f"process {i} exited with {p.returncode}:\n"
                                   f"{log.read_text()[-3000:]}")
    return [json.loads((out / f"proc{i}.json").read_text()) for i in range(2)]


def _close(a, b):
    # The two programs sum the gradients in different orders (across processes), and
    # Adam divides each update by the gradient's own scale, so a parameter whose gradient
    # is near zero may move a few 1e-6 differently; a wrong batch or a lost update moves
    # it by about the learning rate (1e-2).
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-5)


@pytest.mark.slow
def test_two_processes_match_one_and_resume_after_sigterm(tmp_path):
    data = tf.progressions()
    prompts = [t[:s] for t, (s, _) in zip(data.tokens, data.spans)]
    responses = [t[s:e] for t, (s, e) in zip(data.tokens, data.spans)]
    write_rollouts(tmp_path / "data", prompts, responses, shard_size=16)
    loaded = RolloutSet.load(tmp_path / "data")
    target, drafter = tf.models()
    one = train(tf.config(tmp_path / "one", **CONFIG), target=target, drafter=drafter,
                data=loaded, until_update=UPDATES, progress=False, save_final_drafter=False)

    # Process 1 is "preempted" while it reads the first update's batch.
    first = _launch(tmp_path / "two", tmp_path / "data", sigterm_at_micro=0, check_batches=2)
    assert all(r["preempted"] for r in first)
    saved = first[0]["history"][-1]["update"]
    assert first[1]["history"][-1]["update"] == saved < UPDATES    # both stop at one update
    rows = [set(r["rows"]) for r in first]
    assert rows[0].isdisjoint(rows[1]) and rows[0] | rows[1] == set(range(8))
    got = np.load(tmp_path / "two" / "result.npz")
    for step in range(2):      # the global batch is the one-process batch, bit for bit
        whole = loaded.batch_at(0, step, 8, 2, drafter.config.horizon)
        for k in ("tokens", "anchors", "valid"):
            np.testing.assert_array_equal(got[f"batch{step}_{k}"], getattr(whole, k))

    second = _launch(tmp_path / "two", tmp_path / "data")
    assert second[0]["start_update"] == saved and not second[0]["preempted"]
    history = first[0]["history"] + second[0]["history"]
    assert [h["update"] for h in history] == list(range(1, UPDATES + 1))
    for key in ("loss", "token_loss", "exit_loss", "tau", "grad_norm", "lr"):
        _close([h[key] for h in history], [h[key] for h in one.history])
    got = np.load(tmp_path / "two" / "result.npz")
    want = jax.device_get(one.state.params)
    for path, leaf in jax.tree_util.tree_leaves_with_path(want):
        _close(got[jax.tree_util.keystr(path)], leaf)
