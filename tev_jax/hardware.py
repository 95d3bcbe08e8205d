"""The chips a plan can be for, TPU slices and NVIDIA GPUs: the one module that knows
both. `tev_jax.topology` describes TPU slices and `tev_jax.gpu` NVIDIA GPUs (which builds
on topology's `Chip` / `Slice`; topology never imports it), so neither imports a module
that imports it back.
"""

from __future__ import annotations

import jax

from tev_jax import gpu as gpus
from tev_jax import topology
from tev_jax.topology import Chip


def chip_of(device_kind: str) -> Chip | None:
    """The `Chip` of a ``device_kind`` ('TPU v5 lite', 'NVIDIA H100 80GB HBM3'), or None
    (a CPU, an unknown TPU or GPU)."""
    chips = (*topology.CHIPS.values(), *(g.chip for g in gpus.GPUS.values()))
    return next((c for c in chips if c.device_kind == device_kind), None)


def local_chip() -> Chip | None:
    """The `Chip` of this machine's first device, if `chip_of` knows it."""
    return chip_of(jax.devices()[0].device_kind)


def plan_mesh(topology_name: str | None = None, gpu: str | None = None, data: int = 1,
              fsdp: int | None = 1, tensor: int = 1):
    """The mesh of a plan for a TPU slice (``topology_name``, `tev_jax.topology.slice_mesh`)
    or GPUs (``gpu``, `tev_jax.gpu.gpu_mesh`); -> (mesh, `tev_jax.topology.Slice`).

    Raises:
      ValueError: both or neither given, or as `slice_mesh` / `gpu_mesh`.
    """
    if (topology_name is None) == (gpu is None):
        raise ValueError("plan for one of a TPU slice (--topology) or GPUs (--gpu), not "
                         f"{'both' if topology_name else 'neither'}")
    if gpu is not None:
        return gpus.gpu_mesh(gpu, data, fsdp, tensor)
    return topology.slice_mesh(topology_name, data, fsdp, tensor)


__all__ = ["chip_of", "local_chip", "plan_mesh"]
