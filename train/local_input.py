"""Process-local input: each process reads only the batch rows its devices hold.

The global micro-batch [B, ...] is split over the mesh's batch axes. A process asks
`batch_rows` which rows of it land on its own devices, reads only those
(``RolloutSet.batch_at(..., rows=rows)``), and `place_local_batch` assembles the global
``jax.Array`` from every process's part (``jax.make_array_from_process_local_data``).
Rows are positions in the batch of (seed, step), so the global batch is the same for
any number of processes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from train.placement import Placement, host_arrays
from train.state import Batch


def local_indices(sharding, shape: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """Per dimension, the sorted global indices that this process's devices hold.

    This is the layout ``jax.make_array_from_process_local_data`` expects: a process's
    local array is the global array restricted to these indices.
    """
    held = [set() for _ in shape]
    for index in sharding.addressable_devices_indices_map(tuple(shape)).values():
        for d, (sl, n) in enumerate(zip(index, shape)):
            held[d].update(range(*sl.indices(n)))
    return tuple(np.array(sorted(h), np.int64) for h in held)


def batch_rows(place: Placement, batch_shape: tuple[int, int, int]) -> np.ndarray | None:
    """Rows of the global micro-batch held by this process (None: one device, all rows).

    Args:
      batch_shape: (B, L, A).
    """
    if place.mesh is None:
        return None
    b, length, a = batch_shape
    rows = local_indices(place.batch.tokens, (b, length))[0]
    for sharding in (place.batch.anchors, place.batch.valid, place.batch.in_bounds):
        if not np.array_equal(local_indices(sharding, (b, a))[0], rows):
            raise ValueError("the batch arrays are split over different batch rows")
    return rows


def place_local_batch(host_batch, place: Placement, batch_shape: tuple[int, int, int]) -> Batch:
    """The global device batch from this process's rows.

    Args:
      host_batch: a `train.rollouts.HostBatch` holding the rows `batch_rows` names
        (all B rows without a mesh).
      batch_shape: (B, L, A).
    """
    arrays = host_arrays(host_batch)
    if place.mesh is None:
        return jax.tree.map(jnp.asarray, arrays)
    b, length, a = batch_shape

    def build(x, sharding, shape):
        held = local_indices(sharding, shape)
        local = x[np.ix_(np.arange(x.shape[0]), *held[1:])]   # rows are already local
        return jax.make_array_from_process_local_data(sharding, local, shape)

    return Batch(tokens=build(arrays.tokens, place.batch.tokens, (b, length)),
                 anchors=build(arrays.anchors, place.batch.anchors, (b, a)),
                 valid=build(arrays.valid, place.batch.valid, (b, a)),
                 in_bounds=build(arrays.in_bounds, place.batch.in_bounds, (b, a)))


__all__ = ["batch_rows", "local_indices", "place_local_batch"]
