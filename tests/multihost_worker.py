"""One process of the two-process training test (`tests/test_multihost.py`).

    python tests/multihost_worker.py PROCESS_ID PORT SPEC_JSON

Joins a 2-process job on localhost with 4 CPU devices each (``SPEC["devices"]``), trains
the tiny fixture pair on the mesh of ``SPEC["config"]`` (test_multihost: data 2 x fsdp 4;
test_gcs: checkpoints in a bucket) from a rollout folder, and writes ``proc<i>.json``
(its batch rows, the run's history) and, from process 0, ``result.npz`` (the gathered
final parameters and the gathered global batches of the first updates) into
``SPEC["out"]``. With ``SPEC["sigterm_at_micro"]`` process 1 sends itself SIGTERM
while it reads that micro-batch, as a preempted host would receive it.
"""

from __future__ import annotations

import json
import os
import signal
import sys

PROCESS_ID, PORT, SPEC = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={SPEC.get('devices', 4)}"
os.environ["JAX_PLATFORMS"] = "cpu"
_TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_TESTS), _TESTS]

import jax  # noqa: E402

# The second job of a test loads the step compiled by the first.
jax.config.update("jax_compilation_cache_dir", SPEC["compile_cache"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
# Barrier and heartbeat deadlines as long as the test's own limit: on a loaded machine
# one process may reach a barrier (or the shutdown) minutes after the other; only the
# test decides that the job hangs.
jax.distributed.initialize(coordinator_address=f"localhost:{PORT}", num_processes=2,
                           process_id=PROCESS_ID, initialization_timeout=SPEC["timeout_s"],
                           heartbeat_timeout_seconds=SPEC["timeout_s"],
                           shutdown_timeout_seconds=SPEC["timeout_s"])

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import train_fixtures as tf  # noqa: E402
from train.local_input import batch_rows, place_local_batch  # noqa: E402
from train.loop import make_mesh_for, optim_config, train  # noqa: E402
from train.optimizer import make_optimizer  # noqa: E402
from train.placement import placement  # noqa: E402
from train.rollouts import RolloutSet  # noqa: E402
from train.state import split_models  # noqa: E402


def main() -> None:
    cfg = tf.config(SPEC["out"] + "/run", **SPEC["config"])
    target, drafter = tf.models()
    data = RolloutSet.load(SPEC["data"])
    shape = (cfg.batch_size, data.seq_len, cfg.num_anchors)
    graphs, frozen, _ = split_models(target, drafter)
    _, param_state, _ = nnx.split(drafter, nnx.Param, ...)
    place = placement(make_mesh_for(cfg), graphs, frozen, param_state,
                      make_optimizer(optim_config(cfg))[0], shape)
    rows = batch_rows(place, shape)
    batches = {}
    with place.context():
        for step in range(SPEC["check_batches"]):
            hb = data.batch_at(cfg.seed, step, cfg.batch_size, cfg.num_anchors,
                               drafter.config.horizon, rows=rows,
                               partial=cfg.partial_anchors)
            glob = multihost_utils.process_allgather(place_local_batch(hb, place, shape),
                                                     tiled=True)
            batches.update({f"batch{step}_{k}": np.asarray(getattr(glob, k))
                            for k in ("tokens", "anchors", "valid")})

    if SPEC.get("sigterm_at_micro") is not None and PROCESS_ID == 1:
        read = data.batch_at

        def batch_at(seed, step, *args, **kw):
            if step == SPEC["sigterm_at_micro"]:
                os.kill(os.getpid(), signal.SIGTERM)
            return read(seed, step, *args, **kw)

        data.batch_at = batch_at
    result = train(cfg, target=target, drafter=drafter, data=data, progress=False,
                   save_final_drafter=False, until_update=SPEC["until_update"])
    params = multihost_utils.process_allgather(result.state.params, tiled=True)
    record = {"rows": rows.tolist(), "history": result.history,
              "start_update": result.start_update, "preempted": result.preempted}
    with open(os.path.join(SPEC["out"], f"proc{PROCESS_ID}.json"), "w") as f:
        json.dump(record, f)
    if PROCESS_ID == 0:
        flat = {jax.tree_util.keystr(k): np.asarray(v)
                for k, v in jax.tree_util.tree_leaves_with_path(params)}
        np.savez(os.path.join(SPEC["out"], "result.npz"), **flat, **batches)


if __name__ == "__main__":
    main()
    jax.distributed.shutdown()
