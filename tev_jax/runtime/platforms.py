"""Which jax backends the command lines start: no TPU runtime where there is no TPU.

With the ``tpu`` extra installed (libtpu), jax starts the TPU runtime on every run, and on
a machine without TPU chips libtpu prints errors while it looks for them ("Failed to find
host bounds for accelerator type ...", "unexpected worker hostname ..."); the CPU run
then goes on as usual. With the ``gpu`` extra (jax's CUDA plugin) on a machine without a
CUDA driver, the plugin prints "cudart_stub.cc ... Could not find cuda drivers on your
machine" when jax is imported and again when jax starts its backends, even with
``JAX_PLATFORMS=cpu``. `quiet_start` is what ``tev-jax``, ``tev-train``, the examples and
the README's snippets call first, before anything imports jax: where ``JAX_PLATFORMS``
is not set, no TPU chip is on the PCI bus and no NVIDIA GPU is visible, jax uses the CPU
alone (`skip_absent_tpu`), libtpu is quieted (`quiet_tpu_runtime`) and the CUDA
plugin's driver lines are dropped (`without_absent_cuda_lines`). Compiling for a TPU slice
(``--topology``) or a GPU (``--gpu``) loads the plugin by itself and is not affected.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import importlib.metadata
import os
import pkgutil
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
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


ABSENT_CUDA_LINES = (
    re.compile(r"cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine"),
    re.compile(r"^WARNING: All log messages before absl::InitializeLog\(\) is called are "
               r"written to STDERR$"),
)
"""What jax's CUDA plugin writes to stderr where no CUDA driver is installed: the
driver line (once per plugin library loaded) and absl's banner before each."""


def without_absent_cuda_lines(text: str) -> str:
    """``text`` (what went to stderr) without `ABSENT_CUDA_LINES`; every other line kept,
    in order."""
    return "".join(line for line in text.splitlines(keepends=True)
                   if not any(p.search(line.rstrip("\r\n")) for p in ABSENT_CUDA_LINES))


@contextlib.contextmanager
def filtered_stderr(keep: Callable[[str], str]) -> Iterator[None]:
    """Sends file descriptor 2 (where C++ libraries log) to a temporary file for the body,
    then writes ``keep(what it caught)`` to stderr, also when the body raises."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            text = keep(caught.read().decode("utf-8", "replace"))
            if text:
                sys.stderr.write(text)
                sys.stderr.flush()


def _register_plugins() -> None:
    # jax loads its plugins (the CUDA plugin prints its driver line there) when it first
    # starts a backend; registering them now, inside `filtered_stderr`, starts no backend,
    # so that jax.distributed.initialize and XLA_FLAGS set later still apply. jax has no
    # public name for this step; where a release lacks it, the line is left to print.
    from jax._src import xla_bridge

    register = getattr(xla_bridge, "_discover_and_register_pjrt_plugins", None)
    if register is not None:
        register()


def quiet_start() -> bool:
    """What a command line (or a script) calls first, before anything imports jax: jax on
    the CPU where no TPU or NVIDIA GPU is attached and ``JAX_PLATFORMS`` is unset
    (`skip_absent_tpu`), libtpu quiet (`quiet_tpu_runtime`), and, where jax's CUDA
    plugin is installed but no NVIDIA GPU is visible, the plugin's driver lines dropped
    from stderr (`without_absent_cuda_lines`; everything else it printed is kept). Starts
    no backend. -> whether it restricted jax to the CPU.

    Called after jax was imported, the lines printed at import have already gone out;
    the ones of the backends' start are still dropped.
    """
    quiet_tpu_runtime()
    if not cuda_plugin_installed() or nvidia_gpu_visible():
        return skip_absent_tpu()
    with filtered_stderr(without_absent_cuda_lines):
        restricted = skip_absent_tpu()  # imports jax
        _register_plugins()
    return restricted


__all__ = ["ABSENT_CUDA_LINES", "CUDA_PLUGIN_NAME", "GOOGLE_PCI_VENDOR", "QUIET_TPU_ENV",
           "cuda_major", "cuda_plugin_installed", "cuda_plugins", "filtered_stderr",
           "gpu_kernels_traced", "nvidia_gpu_visible", "quiet_start", "quiet_tpu_runtime",
           "skip_absent_tpu", "tpu_chips_present", "without_absent_cuda_lines"]
