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


SLOW_FIRST = ("test_interrupts.py", "test_train_interrupts.py", "test_decode.py",
              "test_decode_mesh.py", "test_gemma4.py", "test_moe.py", "test_moe_train.py",
              "test_tpu_plan.py", "test_decode_stats.py", "test_tune.py",
              "test_train_step.py", "test_functional_contract.py", "test_multihost.py",
              "test_gpu_measure.py", "test_decode_speed_script.py", "test_engine.py",
              "test_batch_job.py", "test_cli_output.py")
"""The files with the most test time (about 35–100 s each on the 2-core machine, measured
2026-12-04 with --durations=0), longest first; the two interrupt files first: in the slow
tier (-m slow) their 80 interrupted commands take the longest (``tev-jax``'s two about
20 minutes, ``tev-train``'s two about 9, measured 2026-12-05), so each starts at once on
a worker and the rest fills in behind the shorter."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: the full-power tier (chi-square at 10^5, every mesh, 200-token "
        "greedy runs, 20 interrupts per command); CI runs it after the fast tier: "
        "pytest -m slow")


def pytest_collection_modifyitems(items):
    """Runs the slowest files first: pytest-xdist's per-file scheduling hands files out in
    collection order, so the two workers then end together, instead of one waiting out a
    long file that started last (that tail was about 45 s of a 617 s run)."""
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
