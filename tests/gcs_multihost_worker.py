"""One process of the two-process bucket checkpoint test (`tests/test_gcs.py`).

    python tests/gcs_multihost_worker.py PROCESS_ID PORT SPEC_JSON

Joins a 2-process job on localhost with 2 CPU devices each, checks the bucket
(`train.storage.check_bucket`) and, with ``SPEC["mode"]`` ``save``, writes an array
sharded over the 4 devices as step 1 of the `train.checkpoint.TrainCheckpointer` at
``SPEC["directory"]``; with ``restore`` it restores the newest step. Writes
``proc<i>.json`` into ``SPEC["out"]``. The emulator's environment comes from the test.
"""

from __future__ import annotations

import json
import os
import sys

PROCESS_ID, PORT, SPEC = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import jax  # noqa: E402

jax.distributed.initialize(coordinator_address=f"localhost:{PORT}", num_processes=2,
                           process_id=PROCESS_ID, initialization_timeout=SPEC["timeout_s"],
                           heartbeat_timeout_seconds=SPEC["timeout_s"],
                           shutdown_timeout_seconds=SPEC["timeout_s"])

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from train.checkpoint import TrainCheckpointer, abstract_like  # noqa: E402
from train.storage import check_bucket  # noqa: E402


def main() -> dict:
    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices())
    rows, whole = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
    want = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    state = {"w": jax.make_array_from_callback(want.shape, rows, lambda i: want[i]),
             "step": jax.make_array_from_callback((), whole, lambda i: np.int32(7))}
    check_bucket(SPEC["directory"])
    with TrainCheckpointer(SPEC["directory"], every=1, keep=2) as ck:
        if SPEC["mode"] == "save":
            saved = ck.save(1, state, {"update": 1})
            ck.wait()
            return {"saved": saved, "steps": ck.all_steps()}
        got, meta, step = ck.restore(abstract_like(state))
    shards = sorted(got["w"].addressable_shards, key=lambda s: s.index[0].start)
    mine = sorted(state["w"].addressable_shards, key=lambda s: s.index[0].start)
    return {"step": step, "meta": meta, "same_sharding": got["w"].sharding == rows,
            "local": [np.asarray(s.data).tolist() for s in shards],
            "expected": [want[s.index].tolist() for s in mine]}


if __name__ == "__main__":
    record = main()
    with open(os.path.join(SPEC["out"], f"proc{PROCESS_ID}.json"), "w") as f:
        json.dump(record, f)
    jax.distributed.shutdown()
