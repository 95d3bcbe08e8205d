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
import importlib.metadata
import os
import pkgutil
import re
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


CUDA_PLUGIN_NAME = re.compile(r"^xla_cuda(\d+)$")
"""jax's CUDA plugins by module name: ``jax_plugins.xla_cuda12``, ``jax_plugins.xla_cuda13``."""


def cuda_plugins() -> dict[str, int]:
    """jax's CUDA plugins installed here, by name -> their CUDA major version
    (``{'xla_cuda12': 12}``, ``{'xla_cuda13': 13}``; empty without one).

    jax finds a plugin two ways, and so does this: a module of the ``jax_plugins``
    namespace package, or an entry point of the ``jax_plugins`` group (the
    ``jax-cuda*-pjrt`` wheels declare both). Nothing is imported but the namespace
    package, so asking starts no backend.
    """
    names = set()
    try:
        import jax_plugins
        names.update(m.name for m in pkgutil.iter_modules(jax_plugins.__path__))
    except ImportError:  # no jax_plugins package at all
        pass
    names.update(e.name for e in importlib.metadata.entry_points(group="jax_plugins"))
    found = {n: CUDA_PLUGIN_NAME.match(n) for n in names}
    return {n: int(m.group(1)) for n, m in sorted(found.items()) if m}


def cuda_plugin_installed() -> bool:
    """Whether one of jax's CUDA plugins (the ``gpu`` extra: cuda12 or cuda13) is
    installed: a program traced here may then be lowered for NVIDIA GPUs (on one, or
    ahead of time for one)."""
    return bool(cuda_plugins())


def cuda_major() -> int | None:
    """The CUDA major version of the installed CUDA plugin (the newest, where several
    are); None without one."""
    return max(cuda_plugins().values(), default=None)


@functools.cache
def gpu_kernels_traced() -> bool:
    """`cuda_plugin_installed`, asked once per process. Model code traces its GPU kernels
    (a ``lax.platform_dependent`` branch) only where a GPU lowering is possible: without
    the plugin, CPU and TPU programs trace no Triton kernel."""
    return cuda_plugin_installed()


# What libtpu asks the environment for when it starts without a Cloud TPU VM around it
# (compiling for a named slice, --topology): unset, it prints "Failed to find host
# bounds ..." and "unexpected worker hostname ..." errors. A compile for a slice names
# its own topology, so these single-host values do not change what it compiles.
QUIET_TPU_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost",
                 "TPU_WORKER_ID": "0", "TPU_ACCELERATOR_TYPE": "v5litepod-1"}


def quiet_tpu_runtime() -> bool:
    """Sets `QUIET_TPU_ENV` (where a variable is unset) on a machine without TPU chips, so
    that loading libtpu to compile for a slice prints no errors. Call it before jax
    starts a backend; -> whether it did."""
    if tpu_chips_present():
        return False
    for name, value in QUIET_TPU_ENV.items():
        os.environ.setdefault(name, value)
    return True


def skip_absent_tpu() -> bool:
    """Restricts jax to the CPU on a machine with neither TPU chips nor NVIDIA GPUs,
    unless ``JAX_PLATFORMS`` (or ``jax_platforms``) already says which backends to use,
    and quiets libtpu there (`quiet_tpu_runtime`). Call it before the first jax
    computation; -> whether it restricted jax."""
    import jax

    quiet_tpu_runtime()
    if (os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms
            or tpu_chips_present() or nvidia_gpu_visible()):
        return False
    jax.config.update("jax_platforms", "cpu")
    return True


__all__ = ["CUDA_PLUGIN_NAME", "GOOGLE_PCI_VENDOR", "QUIET_TPU_ENV", "cuda_major",
           "cuda_plugin_installed", "cuda_plugins", "gpu_kernels_traced", "nvidia_gpu_visible",
           "quiet_tpu_runtime", "skip_absent_tpu", "tpu_chips_present"]
