"""Which jax backends the command lines start: no TPU runtime where there is no TPU.

With the ``tpu`` extra installed (libtpu), jax starts the TPU runtime on every run, and on
a machine without TPU chips libtpu prints errors while it looks for them ("Failed to find
host bounds for accelerator type ...", "unexpected worker hostname ..."); the CPU run
then goes on as usual. `skip_absent_tpu` is what ``tev-jax`` and ``tev-train`` call before
any work: where ``JAX_PLATFORMS`` is not set, no TPU chip is on the PCI bus and no NVIDIA
GPU is visible, jax uses the CPU alone. Compiling for a TPU slice (``--topology``) loads
libtpu by itself and is not affected.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import os
from pathlib import Path

GOOGLE_PCI_VENDOR = "0x1ae0"
"""The PCI vendor id of Google's TPU chips (what jax itself looks for)."""


def tpu_chips_present() -> bool:
    """Whether a Google PCI device (a TPU chip) is attached to this machine."""
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            if Path(vendor).read_text().strip() == GOOGLE_PCI_VENDOR:
                return True
        except OSError:
            continue
    return False


def nvidia_gpu_visible() -> bool:
    """Whether an NVIDIA device node exists (a GPU jax's CUDA plugin may use)."""
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def cuda_plugin_installed() -> bool:
    """Whether jax's CUDA plugin (the ``gpu`` extra) is installed: a program traced here
    may then be lowered for NVIDIA GPUs (on one, or ahead of time for one)."""
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no jax_plugins package at all
        return False


@functools.cache
def gpu_kernels_traced() -> bool:
    """`cuda_plugin_installed`, asked once per process. Model code traces its GPU kernels
    (a ``lax.platform_dependent`` branch) only where a GPU lowering is possible: without
    the plugin, CPU and TPU programs trace no Triton kernel."""
    return cuda_plugin_installed()


def skip_absent_tpu() -> bool:
    """Restricts jax to the CPU on a machine with neither TPU chips nor NVIDIA GPUs,
    unless ``JAX_PLATFORMS`` (or ``jax_platforms``) already says which backends to use.
    Call it before the first jax computation; -> whether it did."""
    import jax

    if (os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms
            or tpu_chips_present() or nvidia_gpu_visible()):
        return False
    jax.config.update("jax_platforms", "cpu")
    return True


__all__ = ["GOOGLE_PCI_VENDOR", "nvidia_gpu_visible", "skip_absent_tpu", "tpu_chips_present"]
