"""TPU slices from any machine: a slice's devices by name, and the chips' published figures.

libtpu compiles for a TPU slice on a machine without TPUs (ahead of time):
``get_topology_desc(platform="tpu", topology_name="v5e:2x4")`` returns the slice's
devices, a mesh over them takes abstract arguments, and ``jax.jit(f).lower(...)
.compile()`` runs the real TPU compiler, whose ``memory_analysis()`` and
``cost_analysis()`` are per chip. `slice_devices` wraps that with clear errors;
`CHIPS` holds what the compiler does not know, the chips' peak bf16 FLOP/s, HBM
bandwidth and HBM capacity (from Google Cloud's TPU documentation), for rooflines and
memory checks. Multi-host slices work the same way (``v5e:4x4``: 16 chips on 4 hosts).
`tev_jax.gpu` builds on this module for NVIDIA GPUs (never the other way round);
`tev_jax.hardware` is where both are known (a device kind's chip, a plan's mesh).

Needs the ``tpu`` extra (``pip install -e ".[tpu]"``, libtpu matching jax). libtpu takes
a lock per process: `slice_devices` sets ``ALLOW_MULTIPLE_LIBTPU_LOAD=1`` (unless set)
so that several planning processes can run; a process killed without it leaves
``libtpu_lockfile`` in the temp directory (remove it). On a machine without TPUs set ``JAX_PLATFORMS=cpu`` so that
jax does not try to start the TPU backend for the local devices.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re


GB = 10**9
GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    """Published figures of one TPU chip.

    Attributes:
      name: the generation as topology names spell it ('v5e').
      device_kind: what ``jax.Device.device_kind`` says ('TPU v5 lite').
      peak_flops: peak bf16 FLOP/s per chip.
      hbm_bandwidth: HBM bytes/s per chip.
      hbm_bytes: HBM capacity per chip.
      source: where the figures come from.
    """

    name: str
    device_kind: str
    peak_flops: float
    hbm_bandwidth: float
    hbm_bytes: int
    source: str


CHIPS: dict[str, Chip] = {c.name: c for c in (
    Chip("v4", "TPU v4", 275e12, 1200 * GB, 32 * GiB,
         "https://cloud.google.com/tpu/docs/v4 (275 TFLOPs bf16; HBM2 32 GiB, 1200 GBps)"),
    Chip("v5e", "TPU v5 lite", 197e12, 819 * GB, 16 * GB,
         "https://cloud.google.com/tpu/docs/v5e (197 TFLOPs bf16; HBM2 16 GB, 819 GBps)"),
    Chip("v5p", "TPU v5", 459e12, 2765 * GB, 95 * GB,
         "https://cloud.google.com/tpu/docs/v5p (459 TFLOPs bf16; HBM2e 95 GB, 2765 GBps)"),
    Chip("v6e", "TPU v6 lite", 918e12, 1638 * GB, 32 * GB,
         "https://cloud.google.com/tpu/docs/v6e (918 TFLOPs bf16; HBM 32 GB, 1638 GBps)"),
)}
"""Chip figures by generation name."""


@dataclasses.dataclass(frozen=True)
class Slice:
    """The devices of a named TPU slice.

    Attributes:
      name: the topology name ('v5e:2x4').
      devices: the slice's devices (abstract: they compile, they do not run).
      chip: its chip's figures (None for a generation `CHIPS` does not list).
      chips: chips in the slice (the product of the name's dimensions).
      hosts: processes (hosts) the slice spans.
    """

    name: str
    devices: tuple
    chip: Chip | None
    chips: int
    hosts: int

    @property
    def devices_per_chip(self) -> int:
        """1, or 2 where the slice lists each TensorCore as a device (v4)."""
        return max(len(self.devices) // self.chips, 1)


_NAME = re.compile(r"^([a-zA-Z0-9_ ]+)[=_:]([0-9x]+)(_twisted|_untwisted)?$")


def slice_devices(name: str) -> Slice:
    """The devices of the TPU slice ``name`` (any name libtpu knows: 'v5e:2x4',
    'v5p:2x2x2', 'v6e:4x4', multi-host included), compiled for from this machine.

    Raises:
      ValueError: libtpu is not installed (the message says how to get it), or the
        name is malformed or unknown to libtpu (its own reason included).
    """
    m = _NAME.match(name or "")
    if m is None:
        raise ValueError(f"topology {name!r} is not a TPU slice name such as 'v5e:2x4' "
                         "(generation:dimensions)")
    if importlib.util.find_spec("libtpu") is None:
        raise ValueError(f"planning for the TPU slice {name!r} needs libtpu: pip install "
                         "-e \".[tpu]\" (the libtpu that matches the installed jax)")
    # Planning compiles only; several planning processes may share libtpu (its lock is
    # for processes that own chips).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=name)
    except Exception as e:  # libtpu says what is wrong in its own words
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "lockfile" in reason:
            raise ValueError(f"libtpu is locked by another process ({reason}); set "
                             "ALLOW_MULTIPLE_LIBTPU_LOAD=1 before jax starts, or remove "
                             "the stale lock file") from e
        raise ValueError(f"unknown TPU topology {name!r}: {reason}") from e
    devices = tuple(desc.devices)
    kind = devices[0].device_kind
    return Slice(name=name, devices=devices,
                 chip=next((c for c in CHIPS.values() if c.device_kind == kind), None),
                 chips=math.prod(int(d) for d in m.group(2).split("x")),
                 hosts=len({d.process_index for d in devices}))


def slice_mesh(name: str, data: int = 1, fsdp: int | None = 1, tensor: int = 1):
    """A ('data', 'fsdp', 'tensor') mesh over the chips of the TPU slice ``name``;
    -> (mesh, `Slice`). ``fsdp`` None takes every remaining chip.

    Raises:
      ValueError: as `slice_devices`, or a mesh larger than the slice (named).
    """
    return mesh_over(slice_devices(name), f"the slice {name}", data, fsdp, tensor)


def mesh_over(devices: Slice, what: str, data: int = 1, fsdp: int | None = 1,
              tensor: int = 1):
    """A ('data', 'fsdp', 'tensor') mesh over a `Slice`'s devices; -> (mesh, the `Slice`).

    Raises:
      ValueError: a mesh larger than the devices, naming ``what`` they are.
    """
    from tev_jax import sharding as shd

    try:
        mesh = shd.make_mesh(data, fsdp, tensor, devices=devices.devices)
    except ValueError as e:
        raise ValueError(f"{e}: the mesh does not fit {what}") from e
    return mesh, devices


__all__ = ["CHIPS", "Chip", "GB", "GiB", "Slice", "mesh_over", "slice_devices", "slice_mesh"]
