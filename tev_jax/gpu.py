"""NVIDIA GPUs from any machine: a GPU server's devices by name, and the GPUs' figures.

The CUDA plugin compiles for a GPU it has never seen, ahead of time, from a target
description (XLA's ``GpuTargetConfigProto`` in text form: core count, shared memory, L2,
clock, memory, compute capability): ``get_topology_desc(platform="cuda",
target_config=TEXT, topology="1x1x8")`` gives eight abstract GPUs, a mesh over them
takes abstract arguments, and ``jax.jit(f).lower(...).compile()`` runs the real GPU
compiler (Triton and cuBLAS fusions included). Its ``memory_analysis()`` is per GPU;
its ``cost_analysis()`` is empty, so FLOPs and bytes come from the optimised HLO
(`tev_jax.op_costs`).

`GPUS` holds each GPU's description (from NVIDIA's data sheets and the CUDA
programming guide's compute-capability tables) and the figures the rooflines use;
`gpu_devices('h100x8')` / `gpu_mesh` wrap the plugin with clear errors. Multi-host
servers are named by their GPU count (``h100x16``: two hosts of 8).

Needs the ``gpu`` extra (``pip install -e ".[gpu]"``: the CUDA plugin at the project's
jax version, with only the NVIDIA compiler wheels). Without a GPU driver the plugin's
version check fails when jax starts (it calls ``cuInit``) unless ``JAX_PLATFORMS``
leaves cuda out (``JAX_PLATFORMS=cpu``, as for TPU plans: the plugin still compiles) or
``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` is set (`gpu_devices` sets it, in time only when
jax's backends have not started yet).
"""

from __future__ import annotations

import dataclasses
import os
import re

from tev_jax import platforms
from tev_jax.topology import GB, Chip, Slice, mesh_over

GPUS_PER_HOST = 8

CUDA_MINOR = {12: 9}
"""The CUDA runtime a plan's target description names, per CUDA major of the plugin
(x.0 for a major not listed)."""


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """One GPU: what the compiler needs to know of it, and the roofline's figures.

    Attributes:
      chip: the published figures (`tev_jax.topology.Chip`: peak dense bf16 FLOP/s,
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

_NAME = re.compile(r"^([a-z]+[0-9]+)(?:x(\d+))?$")


def parse_gpu_name(name: str) -> tuple[GpuSpec, int]:
    """'h100x8' -> (the H100's `GpuSpec`, 8); a bare 'h100' is one GPU.

    Raises:
      ValueError: a malformed name, an unknown GPU (the known ones listed) or a count
        that is neither up to 8 nor a whole number of 8-GPU hosts.
    """
    m = _NAME.match((name or "").lower())
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
      A `tev_jax.topology.Slice` (``chip``: the GPU's figures; ``chips``: GPUs).
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


__all__ = ["GPUS", "GPUS_PER_HOST", "GpuSpec", "gpu_devices", "gpu_mesh", "parse_gpu_name",
           "plugin_installed"]
