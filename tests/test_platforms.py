"""Which backends and plugins jax has here (`tev_jax.runtime.platforms`).

The CUDA plugin decides whether model code traces its GPU kernels and whether
``plan --gpu`` can compile: a cuda13 install (jax >= 0.11 GPU images) must be seen as
surely as a cuda12 one, whether jax would find it as a ``jax_plugins`` module or as an
entry point. Each test lays a fake plugin on ``sys.path``; the negative control (a
plugin that is not CUDA's) must not be taken for one.
"""

from __future__ import annotations

import sys

import pytest

from tev_jax.runtime import platforms


@pytest.fixture
def plugin_path(tmp_path, monkeypatch):
    """A folder on sys.path with no jax_plugins yet; -> the folder."""
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "jax_plugins" or m.startswith("jax_plugins.")]:
        monkeypatch.delitem(sys.modules, name)
    return tmp_path


def _namespace_module(root, name):
    (root / "jax_plugins" / name).mkdir(parents=True)
    (root / "jax_plugins" / name / "__init__.py").write_text("")


def _entry_point(root, dist, name):
    info = root / f"{dist}-1.0.dist-info"
    info.mkdir()
    info.joinpath("METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    info.joinpath("entry_points.txt").write_text(f"[jax_plugins]\n{name} = jax_plugins.{name}\n")


@pytest.mark.parametrize("major", [12, 13])
def test_a_cuda_plugin_module_of_either_major_is_found(plugin_path, major):
    _namespace_module(plugin_path, f"xla_cuda{major}")
    assert platforms.cuda_plugins().get(f"xla_cuda{major}") == major
    assert platforms.cuda_plugin_installed()
    assert platforms.cuda_major() >= major


def test_a_cuda13_plugin_declared_only_as_an_entry_point_is_found(plugin_path):
    _entry_point(plugin_path, "fake_jax_cuda13_pjrt", "xla_cuda13")
    assert platforms.cuda_plugins().get("xla_cuda13") == 13
    assert platforms.cuda_major() >= 13


def test_a_plugin_that_is_not_cuda_is_not_taken_for_one(plugin_path, monkeypatch):
    real = platforms.cuda_plugins()  # what this machine has (CI: none)
    _namespace_module(plugin_path, "xla_rocm7")
    _entry_point(plugin_path, "fake_jax_rocm7_pjrt", "xla_rocm7_extra")
    assert platforms.cuda_plugins() == real
    monkeypatch.setattr(platforms, "cuda_plugins", lambda: {})
    assert not platforms.cuda_plugin_installed() and platforms.cuda_major() is None


def test_every_extra_that_names_jax_bounds_it_as_the_dependency_does():
    """An unbounded ``jax[tpu]`` let pip walk back through every jax release when the
    newest one's libtpu was not yet on PyPI (jax 0.12.1 pins libtpu 0.0.53, CI on
    2026-12-06): it reached jax 0.2.15, whose tpu extra is a URL, and the install failed.
    Each extra that asks for jax must carry the dependency's lower and upper bound."""
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement
    from packaging.version import Version

    def bounds(req):
        ops = {spec.operator: Version(spec.version) for spec in req.specifier}
        return ops.get(">="), ops.get("<")

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml")
                            .read_text())["project"]
    (supported,) = [Requirement(r) for r in project["dependencies"] if r.startswith("jax")]
    lowest, newest = bounds(supported)
    named = [Requirement(r) for reqs in project["optional-dependencies"].values()
             for r in reqs if Requirement(r).name == "jax"]
    assert len(named) >= 3, named  # tpu, gpu-cuda12, gpu-cuda13
    for req in named:
        low, high = bounds(req)
        assert low is not None and low >= lowest and high == newest, req
