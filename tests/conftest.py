"""Test configuration, set before jax is imported anywhere: 8 host CPU devices, and
XLA:CPU's cheap code generation (the tests' programs are tiny: compiling them is most of
the suite's time, and LLVM's optimisation passes roughly a fifth of that)."""

import gc
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu (the tpu extra: compiling for TPU slices) locks per process; the two pytest-xdist
# workers each load it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop jax's compiled programs after each test module.

    Every XLA:CPU executable holds a few memory mappings; the whole suite compiles
    thousands of programs, and past the kernel's ``vm.max_map_count`` (65530 by default)
    the next compilation aborts the process.
    """
    yield
    import jax

    jax.clear_caches()
    gc.collect()
