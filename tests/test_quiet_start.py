"""Quiet on a CPU (`tev_jax.runtime.platforms.quiet_start`): with the ``tpu`` extra (libtpu) or the
``gpu`` extra (jax's CUDA plugin) installed on a machine without TPUs or GPUs, the
README's snippets and the examples print none of their start-up lines.

The filter is tested on what a C library writes to file descriptor 2 (where the CUDA
plugin and libtpu log), with a line that must survive; the README's first snippet runs
as written in a fresh interpreter whose environment names no platform, so that without
`quiet_start` libtpu (which CI installs) or the CUDA plugin would print. A command run
with no platform named prints nothing from libtpu, and `quiet_tpu_runtime` fills only
the variables the user left unset (issues 38 and 47).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tev_jax.runtime import platforms

README = Path(__file__).resolve().parents[1] / "README.md"
DRIVER_LINE = ("I0000 00:00:1796460962.070192    9221 cudart_stub.cc:31] Could not find cuda "
               "drivers on your machine, GPU will not be used.")
BANNER = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
NOISE = re.compile(r"cudart_stub|absl::InitializeLog|Jax plugin configuration error|"
                   r"TPU_ACCELERATOR_TYPE|TPU_WORKER_HOSTNAMES|Failed to find host bounds|"
                   r"libtpu|InitGoogle")


def test_absent_cuda_lines_are_dropped_and_the_rest_kept():
    kept = ("W1205 cuda_executor.cc:1] something else about cudart_stub.cc\n"
            "a warning the user must see\n")
    text = f"{BANNER}\n{DRIVER_LINE}\n{kept}{BANNER}\r\n{DRIVER_LINE}"
    assert platforms.without_absent_cuda_lines(text) == kept
    assert platforms.without_absent_cuda_lines(kept) == kept


def test_filtered_stderr_drops_what_a_c_library_writes_to_fd_2(capfd):
    with pytest.raises(RuntimeError, match="body failed"):
        with platforms.filtered_stderr(platforms.without_absent_cuda_lines):
            os.write(2, f"{BANNER}\n{DRIVER_LINE}\nkeep me\n".encode())
            print("from python", file=sys.stderr)
            raise RuntimeError("body failed")
    os.write(2, b"after\n")
    err = capfd.readouterr().err  # (under capfd, Python's sys.stderr bypasses fd 2)
    assert sorted(err.splitlines()) == ["after", "from python", "keep me"]


def _first_python_block(text: str) -> str:
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def _extras() -> list[str]:
    tpu = importlib.util.find_spec("libtpu") is not None
    return [name for name, present in (("tpu", tpu), ("gpu", platforms.cuda_plugin_installed()))
            if present]


@pytest.mark.skipif(not _extras(), reason="neither libtpu nor a CUDA plugin is installed: "
                    "nothing would print")
@pytest.mark.skipif(platforms.tpu_chips_present() or platforms.nvidia_gpu_visible(),
                    reason="an accelerator is attached: its runtime is expected to start")
def test_the_readme_snippet_runs_quietly_as_written():
    snippet = _first_python_block(README.read_text())
    assert "quiet_start()" in snippet.split("import jax")[0]
    env = {k: v for k, v in os.environ.items()
           if k != "JAX_PLATFORMS" and not k.startswith("TPU_")}
    run = subprocess.run([sys.executable, "-c", snippet], env=env, capture_output=True,
                         text=True, timeout=120, cwd=README.parent)
    assert run.returncode == 0, run.stderr
    noisy = [line for line in run.stderr.splitlines() if NOISE.search(line)]
    assert not noisy, f"with the {_extras()} extra: {noisy}"
    assert run.stdout.strip()


@pytest.mark.slow
@pytest.mark.skipif(not _extras(), reason="neither libtpu nor a CUDA plugin is installed: "
                    "nothing would print")
@pytest.mark.skipif(platforms.tpu_chips_present() or platforms.nvidia_gpu_visible(),
                    reason="an accelerator is attached: its runtime is expected to start")
@pytest.mark.parametrize("argv", [["-m", "tev_jax.cli", "exit-law"],
                                  ["-m", "train", "plan", "--help"]])
def test_the_documented_commands_run_quietly(argv):
    env = {k: v for k, v in os.environ.items()
           if k != "JAX_PLATFORMS" and not k.startswith("TPU_")}
    run = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True,
                         timeout=300, cwd=README.parent)
    assert run.returncode == 0, run.stderr
    noisy = [line for line in run.stderr.splitlines() if NOISE.search(line)]
    assert not noisy, f"with the {_extras()} extra: {noisy}"


def test_no_libtpu_noise_without_tpus(tmp_path):
    """Issue 38, item 3: with the tpu extra installed, a command on a machine without TPU
    chips prints nothing from libtpu (jax is kept to the CPU; JAX_PLATFORMS is not set)."""
    if platforms.tpu_chips_present() or platforms.nvidia_gpu_visible():
        pytest.skip("a machine with accelerators")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    run = subprocess.run([sys.executable, "-m", "tev_jax.cli", "exit-law", "--demo",
                          "--draws", "10", "--show", "1"], env=env, capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0 and "mean block length" in run.stdout
    for noise in ("TPU", "libtpu", "hostname", "InitGoogle"):
        assert noise not in run.stderr, run.stderr


def test_quiet_tpu_runtime_fills_only_unset_variables(monkeypatch):
    """Issue 47, item 12: without TPU chips, libtpu's environment is filled so that it
    starts without its errors; a variable the user set is kept, and a TPU machine is left
    alone."""
    for name in platforms.QUIET_TPU_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TPU_WORKER_ID", "3")
    monkeypatch.setattr(platforms, "tpu_chips_present", lambda: False)
    assert platforms.quiet_tpu_runtime()
    assert os.environ["TPU_WORKER_HOSTNAMES"] == "localhost" and os.environ["TPU_WORKER_ID"] == "3"
    monkeypatch.delenv("TPU_WORKER_HOSTNAMES")
    monkeypatch.setattr(platforms, "tpu_chips_present", lambda: True)
    assert not platforms.quiet_tpu_runtime() and "TPU_WORKER_HOSTNAMES" not in os.environ


def quiet_before_jax(source: str) -> bool:
    """Whether a script calls ``quiet_start()`` (under ``if __name__ == "__main__":``,
    as the examples do) before any statement that imports jax, flax or a module of
    ours other than `tev_jax.runtime.platforms` (which imports no jax)."""
    import ast

    for node in ast.parse(source).body:
        if isinstance(node, ast.If) and "quiet_start()" in ast.unparse(node):
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""])
            if any(n != "tev_jax.runtime.platforms" and n.split(".")[0] in (
                    "jax", "flax", "tev_jax", "train", "paper_common") for n in names):
                return False
    return False


def test_every_experiment_script_starts_quiet():
    """Issue 58, item 3: ``python experiments/tree_builder/run.py --quick`` printed
    libtpu's start-up lines (no script called `quiet_start`). Negative controls: a script
    that imports jax first, and one that never calls it."""
    scripts = sorted(README.parent.glob("experiments/*/run.py"))
    assert len(scripts) > 20
    loud = [str(p.relative_to(README.parent)) for p in scripts
            if not quiet_before_jax(p.read_text())]
    assert not loud, loud
    good = ('import sys\nfrom tev_jax.runtime.platforms import quiet_start\n'
            'if __name__ == "__main__":\n    quiet_start()\nimport jax\n')
    assert quiet_before_jax(good)
    assert not quiet_before_jax("import jax\n" + good)
    assert not quiet_before_jax("import sys\nimport jax\n")
