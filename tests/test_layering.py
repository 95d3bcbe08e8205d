"""The package's layering, checked on the source: no module reads another's private names,
and the library never imports the training package.

Every ``.py`` file under tev_jax/, train/, experiments/ and examples/ is parsed (nothing is
imported). A module's private names are those starting with one underscore; a file may
use its own, but reading ``module._name`` of a module it imported, or ``from module
import _name``, is a violation (dunders such as ``__version__`` are public). Names are
resolved through the file's own imports (``import a.b as m``, ``from a import b``), so
local objects with underscore attributes (``self._x``, ``jitted._cache_size``) are not
module reads. Test files are not checked: a test may pin an implementation detail.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tev_jax", "train", "experiments", "examples")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_names(tree: ast.AST) -> dict[str, str]:
    """Local name -> dotted module for every ``import`` / ``from ... import`` of modules."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    names[a.asname] = a.name
                else:
                    names[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                # ``from pkg import mod``: mod may be a module; an attribute read on it
                # is then a module read. (From-imports of functions are harmless here:
                # their underscore attributes are not module privates of ours.)
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _ours(module: str) -> bool:
    return module.split(".")[0] in PACKAGES


def private_reads(source: str, filename: str = "<source>") -> list[str]:
    """The private cross-module reads of one file, as ``'line: what'`` strings."""
    tree = ast.parse(source, filename)
    modules = _module_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and _ours(node.module):
            found += [f"{node.lineno}: from {node.module} import {a.name}"
                      for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names
                      if _ours(a.name) and any(_private(p) for p in a.name.split("."))]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            chain = []
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            # report the first private name of a chain only (a._b._c is one read of _b)
            if (isinstance(base, ast.Name) and base.id in modules
                    and not any(_private(c) for c in chain)):
                module = ".".join([modules[base.id], *reversed(chain)])
                if _ours(module):
                    found.append(f"{node.lineno}: {module}.{node.attr}")
    return found


def _sources(package: str):
    return sorted((ROOT / package).rglob("*.py"))


def test_no_module_reads_another_modules_private_names():
    bad = {}
    for package in PACKAGES:
        for path in _sources(package):
            reads = private_reads(path.read_text(), str(path))
            if reads:
                bad[str(path.relative_to(ROOT))] = reads
    assert not bad, f"private names read across modules: {bad}"


def test_the_library_never_imports_the_training_package():
    bad = []
    for path in _sources("tev_jax"):
        for node in ast.walk(ast.parse(path.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module
                    else [])
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} imports {m}" for m in mods
                    if m.split(".")[0] in ("train", "experiments", "tests")]
    assert not bad, bad


def test_the_check_catches_private_reads():
    """Negative controls: each way of reaching a private name is reported; a module's
    own privates, dunders, other objects' underscore attributes and other packages'
    privates are not."""
    source = "\n".join([
        "import tev_jax.decode as dec",
        "from tev_jax import engine",
        "from tev_jax.models import target as tgt",
        "import tev_jax",
        "from tev_jax.plan import _bytes",
        "import numpy as np",
        "x = dec._merge",
        "y = engine._generate_jit._cache_size()",
        "z = tgt.Target._stack",
        "w = tev_jax.decode._setup",
        "ok = tev_jax.__version__",
        "ok2 = np._NoValue",
        "def f(self):",
        "    return self._cache, _local",
    ])
    assert sorted(private_reads(source)) == [
        "10: tev_jax.decode._setup",
        "5: from tev_jax.plan import _bytes",
        "7: tev_jax.decode._merge",
        "8: tev_jax.engine._generate_jit",
        "9: tev_jax.models.target.Target._stack",
    ]
