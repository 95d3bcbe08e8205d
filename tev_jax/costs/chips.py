"""The chips a plan can be for, from any machine: TPU slices and NVIDIA GPUs.

**TPU slices.** libtpu compiles for a TPU slice on a machine without TPUs (ahead of time):
``get_topology_desc(platform="tpu", topology_name="v5e:2x4")`` returns the slice's
devices, a mesh over them takes abstract arguments, and ``jax.jit(f).lower(...)
.compile()`` runs the real TPU compiler, whose ``memory_analysis()`` and
``cost_analysis()`` are per chip. `slice_devices` wraps that with clear errors;
`CHIPS` holds what the compiler does not know, the chips' peak bf16 FLOP/s, HBM
bandwidth and HBM capacity (from Google Cloud's TPU documentation), for rooflines and
memory checks. Multi-host slices work the same way (``v5e:4x4``: 16 chips on 4 hosts).
Needs the ``tpu`` extra (``pip install -e ".[tpu]"``, libtpu matching jax). libtpu takes
a lock per process: `slice_devices` sets ``ALLOW_MULTIPLE_LIBTPU_LOAD=1`` (unless set)
so that several planning processes can run; a process killed without it leaves
``libtpu_lockfile`` in the temp directory (remove it). On a machine without TPUs set
``JAX_PLATFORMS=cpu`` so that jax does not try to start the TPU backend for the local
devices.

**NVIDIA GPUs.** The CUDA plugin compiles for a GPU it has never seen, ahead of time, from
a target description (XLA's ``GpuTargetConfigProto`` in text form: core count, shared
memory, L2, clock, memory, compute capability): ``get_topology_desc(platform="cuda",
target_config=TEXT, topology="1x1x8")`` gives eight abstract GPUs, a mesh over them
takes abstract arguments, and ``jax.jit(f).lower(...).compile()`` runs the real GPU
compiler (Triton and cuBLAS fusions included). Its ``memory_analysis()`` is per GPU;
its ``cost_analysis()`` is empty, so FLOPs and bytes come from the optimised HLO
(`tev_jax.costs.op_costs`). `GPUS` holds each GPU's description (from NVIDIA's data
sheets and the CUDA programming guide's compute-capability tables) and the figures the
rooflines use; `gpu_devices('h100x8')` / `gpu_mesh` wrap the plugin with clear errors.
Multi-host servers are named by their GPU count (``h100x16``: two hosts of 8). Needs the
``gpu`` extra (``pip install -e ".[gpu]"``: the CUDA plugin at the project's jax
version, with only the NVIDIA compiler wheels). Without a GPU driver the plugin's
version check fails when jax starts (it calls ``cuInit``) unless ``JAX_PLATFORMS``
leaves cuda out (``JAX_PLATFORMS=cpu``, as for TPU plans: the plugin still compiles) or
``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` is set (`gpu_devices` sets it, in time only when
jax's backends have not started yet).

**Either.** `chip_of` / `local_chip` name a device kind's chip and `plan_mesh` builds a
plan's mesh from a slice or GPU name.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re

import jax

from tev_jax.runtime import platforms

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


_SLICE_NAME = re.compile(r"^([a-zA-Z0-9_ ]+)[=_:]([0-9x]+)(_twisted|_untwisted)?$")


def slice_devices(name: str) -> Slice:
    """The devices of the TPU slice ``name`` (any name libtpu knows: 'v5e:2x4',
    'v5p:2x2x2', 'v6e:4x4', multi-host included), compiled for from this machine.

    Raises:
      ValueError: libtpu is not installed (the message says how to get it), or the
        name is malformed or unknown to libtpu (its own reason included).
    """
    m = _SLICE_NAME.match(name or "")
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


# ------------------------------------------------------------------ NVIDIA GPUs

GPUS_PER_HOST = 8

CUDA_MINOR = {12: 9}
"""The CUDA runtime a plan's target description names, per CUDA major of the plugin
(x.0 for a major not listed)."""


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """One GPU: what the compiler needs to know of it, and the roofline's figures.

    Attributes:
      chip: the published figures (`tev_jax.costs.chips.Chip`: peak dense bf16 FLOP/s,
        HBM bandwidth and capacity, their source).
      compute_capability: (major, minor), e.g. (9, 0) for Hopper.
      sms: streaming multiprocessors (the compiler's ``core_count``).
      fp32_per_sm: FP32 lanes per SM (``fpus_per_core``).
      clock_ghz: boost clock.
      l2_bytes: L2 cache.
      smem_per_sm, smem_per_block_optin: shared memory per SM and the most one block
        may opt in to (CUDA programming guide, compute-capability table).
    """

    chip: Chip
    compute_capability: tuple[int, int]
    sms: int
    fp32_per_sm: int
    clock_ghz: float
    l2_bytes: int
    smem_per_sm: int
    smem_per_block_optin: int

    @property
    def name(self) -> str:
        return self.chip.name

    def target_config(self, cuda_major: int = 12) -> str:
        """The ``GpuTargetConfigProto`` text the CUDA plugin compiles for, with the CUDA
        runtime of the plugin's major version (12.9 or 13.0)."""
        major, minor = self.compute_capability
        info = {
            "threads_per_block_limit": 1024, "threads_per_warp": 32,
            "shared_memory_per_block": 48 * 1024, "shared_memory_per_core": self.smem_per_sm,
            "threads_per_core_limit": 2048, "core_count": self.sms,
            "fpus_per_core": self.fp32_per_sm, "block_dim_limit_x": 2**31 - 1,
            "block_dim_limit_y": 65535, "block_dim_limit_z": 65535,
            "memory_bandwidth": int(self.chip.hbm_bandwidth), "l2_cache_size": self.l2_bytes,
            "clock_rate_ghz": self.clock_ghz, "device_memory_size": self.chip.hbm_bytes,
            "shared_memory_per_block_optin": self.smem_per_block_optin,
            "registers_per_core_limit": 65536, "registers_per_block_limit": 65536}
        lines = ["gpu_device_info {", *(f"  {k}: {v}" for k, v in info.items()),
                 f"  cuda_compute_capability {{ major: {major} minor: {minor} }}", "}",
                 'platform_name: "CUDA"',
                 "dnn_version_info { major: 9 minor: 8 }",
                 f"runtime_version {{ major: {cuda_major} minor: {CUDA_MINOR.get(cuda_major, 0)} }}",
                 f'device_description_str: "{self.chip.device_kind}"']
        return "\n".join(lines) + "\n"


_HOPPER_SMEM = (233_472, 232_448)  # 228 KiB per SM, 227 KiB per block (cc 9.0, 10.0)
_DATASHEET_H100 = ("https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM: 989 TFLOPS "
                   "dense bf16 (1979 with sparsity), 80 GB HBM3, 3.35 TB/s; 132 SMs, 50 MB L2)")
_DATASHEET_H200 = ("https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM: 989 TFLOPS "
                   "dense bf16 (1979 with sparsity), 141 GB HBM3e, 4.8 TB/s; GH100, 132 SMs)")
_DATASHEET_B200 = ("https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200, 8 GPUs: 18 "
                   "PFLOPS dense fp16/bf16 = 2.25 per GPU, 1440 GB HBM3e = 180 per GPU, "
                   "8 TB/s per GPU; 148 SMs, 126.5 MB L2)")
_DATASHEET_A100 = ("https://www.nvidia.com/en-us/data-center/a100/ (A100 80GB SXM: 312 "
                   "TFLOPS dense bf16, 80 GB HBM2e, 2039 GB/s; 108 SMs, 40 MB L2)")

GPUS: dict[str, GpuSpec] = {g.name: g for g in (
    GpuSpec(Chip("h100", "NVIDIA H100 80GB HBM3", 989e12, 3350 * GB, 80 * GB, _DATASHEET_H100),
            (9, 0), sms=132, fp32_per_sm=128, clock_ghz=1.98, l2_bytes=50 * 2**20,
            smem_per_sm=_HOPPER_SMEM[0], smem_per_block_optin=_HOPPER_SMEM[1]),
    GpuSpec(Chip("h200", "NVIDIA H200", 989e12, 4800 * GB, 141 * GB, _DATASHEET_H200),
            (9, 0), sms=132, fp32_per_sm=128, clock_ghz=1.98, l2_bytes=50 * 2**20,
            smem_per_sm=_HOPPER_SMEM[0], smem_per_block_optin=_HOPPER_SMEM[1]),
    GpuSpec(Chip("b200", "NVIDIA B200", 2250e12, 8000 * GB, 180 * GB, _DATASHEET_B200),
            (10, 0), sms=148, fp32_per_sm=128, clock_ghz=1.965, l2_bytes=126_500 * 2**10,
            smem_per_sm=_HOPPER_SMEM[0], smem_per_block_optin=_HOPPER_SMEM[1]),
    GpuSpec(Chip("a100", "NVIDIA A100-SXM4-80GB", 312e12, 2039 * GB, 80 * GB, _DATASHEET_A100),
            (8, 0), sms=108, fp32_per_sm=64, clock_ghz=1.41, l2_bytes=40 * 2**20,
            smem_per_sm=167_936, smem_per_block_optin=166_912),
)}
"""GPU descriptions by name (the rooflines' figures in ``.chip``)."""

_GPU_NAME = re.compile(r"^([a-z]+[0-9]+)(?:x(\d+))?$")


def parse_gpu_name(name: str) -> tuple[GpuSpec, int]:
    """'h100x8' -> (the H100's `GpuSpec`, 8); a bare 'h100' is one GPU.

    Raises:
      ValueError: a malformed name, an unknown GPU (the known ones listed) or a count
        that is neither up to 8 nor a whole number of 8-GPU hosts.
    """
    m = _GPU_NAME.match((name or "").lower())
    if m is None:
        raise ValueError(f"GPU {name!r} is not a name such as 'h100x8' (GPU x count; "
                         f"GPUs: {', '.join(GPUS)})")
    spec = GPUS.get(m.group(1))
    if spec is None:
        raise ValueError(f"unknown GPU {m.group(1)!r}; choose one of {', '.join(GPUS)} "
                         "(as e.g. 'h100x8')")
    count = int(m.group(2) or 1)
    if count < 1 or (count > GPUS_PER_HOST and count % GPUS_PER_HOST):
        raise ValueError(f"{name!r}: {count} GPUs is neither 1-{GPUS_PER_HOST} on one host "
                         f"nor a whole number of {GPUS_PER_HOST}-GPU hosts")
    return spec, count


def plugin_installed() -> bool:
    """Whether jax's CUDA plugin (the ``gpu`` extra) is installed."""
    return platforms.cuda_plugin_installed()


def gpu_devices(name: str) -> Slice:
    """The abstract devices of the GPU server ``name`` ('h100x8', 'h200x8', 'b200x8',
    'a100x8', 'h100x16' for two hosts), compiled for from this machine.

    Returns:
      A `tev_jax.costs.chips.Slice` (``chip``: the GPU's figures; ``chips``: GPUs).
    Raises:
      ValueError: as `parse_gpu_name`, the CUDA plugin is not installed (the message
        says how to get it), or the plugin refuses the description (its reason).
    """
    spec, count = parse_gpu_name(name)
    cuda_major = platforms.cuda_major()
    if cuda_major is None:
        raise ValueError(f"planning for the GPUs {name!r} needs one of jax's CUDA plugins: "
                         "pip install -e \".[gpu]\" (the cuda12 plugin on Python 3.11, the "
                         "cuda13 one on Python >= 3.12, at the installed jax's version, with "
                         "the NVIDIA compiler wheels)")
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    from jax.experimental import topologies

    hosts = max(count // GPUS_PER_HOST, 1)
    try:
        desc = topologies.get_topology_desc(
            platform="cuda", target_config=spec.target_config(cuda_major),
            topology=f"{hosts}x1x{min(count, GPUS_PER_HOST)}")
    except NotImplementedError as e:  # the plugin did not register when jax started
        raise ValueError(
            f"the CUDA plugin is not running, so {name!r} cannot be compiled for: without a "
            "GPU driver its version check fails when jax starts; start jax with "
            "JAX_PLATFORMS=cpu (the plugin still compiles) or JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1"
        ) from e
    except Exception as e:  # the plugin says what is wrong in its own words
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"the CUDA plugin cannot describe {name!r}: {reason}") from e
    devices = tuple(desc.devices)
    return Slice(name=name, devices=devices, chip=spec.chip, chips=count,
                 hosts=len({d.process_index for d in devices}))


def gpu_mesh(name: str, data: int = 1, fsdp: int | None = 1, tensor: int = 1):
    """A ('data', 'fsdp', 'tensor') mesh over the GPUs of ``name``; -> (mesh, `Slice`).

    Raises:
      ValueError: as `gpu_devices`, or a mesh larger than the server (named).
    """
    return mesh_over(gpu_devices(name), f"the GPUs {name}", data, fsdp, tensor)


# ------------------------------------------------------------- either kind of chip

def chip_of(device_kind: str) -> Chip | None:
    """The `Chip` of a ``device_kind`` ('TPU v5 lite', 'NVIDIA H100 80GB HBM3'), or None
    (a CPU, an unknown TPU or GPU)."""
    chips = (*CHIPS.values(), *(g.chip for g in GPUS.values()))
    return next((c for c in chips if c.device_kind == device_kind), None)


def local_chip() -> Chip | None:
    """The `Chip` of this machine's first device, if `chip_of` knows it."""
    return chip_of(jax.devices()[0].device_kind)


def plan_mesh(topology_name: str | None = None, gpu: str | None = None, data: int = 1,
              fsdp: int | None = 1, tensor: int = 1):
    """The mesh of a plan for a TPU slice (``topology_name``, `tev_jax.slice_mesh`)
    or GPUs (``gpu``, `tev_jax.costs.chips.gpu_mesh`); -> (mesh, `tev_jax.Slice`).

    Raises:
      ValueError: both or neither given, or as `slice_mesh` / `gpu_mesh`.
    """
    if (topology_name is None) == (gpu is None):
        raise ValueError("plan for one of a TPU slice (--topology) or GPUs (--gpu), not "
                         f"{'both' if topology_name else 'neither'}")
    if gpu is not None:
        return gpu_mesh(gpu, data, fsdp, tensor)
    return slice_mesh(topology_name, data, fsdp, tensor)


__all__ = ['CHIPS', 'Chip', 'GB', 'GPUS', 'GPUS_PER_HOST', 'GiB', 'GpuSpec', 'Slice', 'chip_of', 'gpu_devices', 'gpu_mesh', 'local_chip', 'mesh_over', 'parse_gpu_name', 'plan_mesh', 'plugin_installed', 'slice_devices', 'slice_mesh']
