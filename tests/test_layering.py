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
        "from tev_jax.costs.plan import _bytes",
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
        "5: from tev_jax.costs.plan import _bytes",
        "7: tev_jax.decode._merge",
        "8: tev_jax.engine._generate_jit",
        "9: tev_jax.models.target.Target._stack",
    ]


# ------------------------------------------------------------ models: core and families

MODELS = "tev_jax.models"
# The core every family builds on: it looks families up in the registry, never imports one.
CORE = tuple(f"{MODELS}.{m}" for m in ("registry", "config", "layers", "target",
                                        "checkpoint_io"))
# A family's own modules: its file under families/ and the blocks only families build.
FAMILY_PREFIXES = (f"{MODELS}.families", f"{MODELS}.moe")


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_sources(package: str = "tev_jax") -> dict[str, str]:
    """Dotted module name -> source of every module of a package (``__init__`` as the
    package's own name)."""
    return {_module_of(p): p.read_text() for p in _sources(package)}


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the modules among ``sources`` it imports, at any depth of its code
    (function-level imports included: they close circles too). ``from pkg import x``
    imports the submodule ``pkg.x`` when there is one, else the package ``pkg`` (the
    parent packages a submodule import runs first are not counted: every module would
    reach every other through them); a relative import is resolved against the
    importing module."""
    graph = {}
    packages = {m.rpartition(".")[0] for m in sources}
    for name, source in sources.items():
        package = name if name in packages else name.rpartition(".")[0]
        out = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    out.add(sub if sub in sources else base)
        graph[name] = {m for m in out if m in sources and m != name}
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for m in graph.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def family_imports_of_core(sources: dict[str, str], core=CORE,
                           families=FAMILY_PREFIXES) -> dict[str, list[str]]:
    """Core module -> the family modules it reaches through its imports (directly or
    through other modules, or through the ``tev_jax.models`` package, which registers
    every family)."""
    graph = import_graph(sources)
    bad = {}
    for m in core:
        hits = sorted(r for r in reachable(graph, m)
                      if r == MODELS or r.startswith(tuple(f + "." for f in families))
                      or r in families)
        if hits:
            bad[m] = hits
    return bad


def import_cycles(sources: dict[str, str], within: str = MODELS) -> list[list[str]]:
    """Every circle of imports among the modules of ``within`` (one per strongly
    connected component of two or more modules, or a module importing itself)."""
    graph = {m: {n for n in e if n == within or n.startswith(within + ".")}
             for m, e in import_graph(sources).items()
             if m == within or m.startswith(within + ".")}
    # Tarjan's strongly connected components
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_model_core_imports_no_family():
    """config, layers, target, checkpoint_io (and the registry) reach no family module,
    not even through a function-level import: families register themselves."""
    sources = package_sources()
    assert set(CORE) <= set(sources)
    assert f"{MODELS}.families.qwen3" in sources and f"{MODELS}.families.gemma4" in sources
    assert not family_imports_of_core(sources), family_imports_of_core(sources)


def test_no_import_circle_in_the_models():
    assert not import_cycles(package_sources()), import_cycles(package_sources())


def test_the_import_checks_catch_circles_and_core_reaching_a_family():
    """Negative controls on synthetic sources: a core module importing a family at
    function level, through another module, or through the package; and a circle."""
    base = {
        MODELS: "from tev_jax.models import families\n",
        f"{MODELS}.families": "from tev_jax.models.families import fam\n",
        f"{MODELS}.families.fam": "from tev_jax.models import layers\n",
        f"{MODELS}.layers": "from tev_jax.models.config import X\n",
        f"{MODELS}.config": "import math\n",
        f"{MODELS}.helper": "",
    }
    core = (f"{MODELS}.layers", f"{MODELS}.config")
    assert not family_imports_of_core(base, core) and not import_cycles(base)
    lazy = {**base, f"{MODELS}.config": "def f():\n    from .families import fam\n"}
    assert family_imports_of_core(lazy, core) == {
        f"{MODELS}.config": [f"{MODELS}.families.fam"],
        f"{MODELS}.layers": [f"{MODELS}.families.fam"]}
    assert import_cycles(lazy) == [[f"{MODELS}.config", f"{MODELS}.families.fam",
                                    f"{MODELS}.layers"]]
    indirect = {**base, f"{MODELS}.helper": "from tev_jax.models import families\n",
                f"{MODELS}.config": "from tev_jax.models import helper\n"}
    assert f"{MODELS}.config" in family_imports_of_core(indirect, core)
    via_package = {**base, f"{MODELS}.config": "from tev_jax.models import Target\n"}
    assert family_imports_of_core(via_package, core)[f"{MODELS}.config"][0] == MODELS


# ------------------------------------------------------------------------ the wings

SERVER, BATCH, COSTS = "tev_jax.server", "tev_jax.batch", "tev_jax.costs"


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def reaches(sources: dict[str, str], froms: str, tos: tuple[str, ...]) -> dict[str, list[str]]:
    """Module of ``froms`` -> the modules under any of ``tos`` it reaches through its
    imports (at any depth, function-level imports included)."""
    graph = import_graph(sources)
    bad = {}
    for m in graph:
        if _within(m, froms):
            hits = sorted(r for r in reachable(graph, m) if any(_within(r, t) for t in tos))
            if hits:
                bad[m] = hits
    return bad


def room_of(module: str) -> str:
    """The room of a module of the library: its top-level subpackage, or the root
    module itself (``tev_jax.costs.plan`` -> ``costs``, ``tev_jax.tree`` -> ``tree``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def room_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Room (`room_of`) -> the other rooms its modules import (the package's own
    ``__init__`` left out: it imports no room)."""
    rooms: dict[str, set[str]] = {}
    for m, deps in import_graph(sources).items():
        rooms.setdefault(room_of(m), set()).update(
            room_of(d) for d in deps if room_of(d) != room_of(m) and d != "tev_jax")
    return rooms


def room_cycles(sources: dict[str, str]) -> list[list[str]]:
    """Circles between rooms (`room_of`): a subpackage whose modules import a root module
    that imports back into the subpackage is one, even if no two modules form a circle."""
    as_modules = {f"r.{r}": "\n".join(f"import r.{d}" for d in sorted(deps))
                  for r, deps in room_graph(sources).items()}
    return [[c[2:] for c in cycle] for cycle in import_cycles(as_modules, within="r")]


def floors(sources: dict[str, str]) -> list[str]:
    """The longest chain of rooms that import each other, top first (its length is the
    number of floors: a room that imports none stands on the first). No circles."""
    rooms = room_graph(sources)
    chains: dict[str, list[str]] = {}

    def chain(room: str) -> list[str]:
        if room not in chains:
            below = [chain(d) for d in sorted(rooms.get(room, ()))]
            chains[room] = [room] + max(below, key=len, default=[])
        return chains[room]

    return max((chain(r) for r in sorted(rooms)), key=len, default=[])


def _library_and_training() -> dict[str, str]:
    return package_sources("tev_jax") | package_sources("train")


def test_the_server_and_the_batch_job_never_import_each_other():
    sources = package_sources()
    assert any(_within(m, SERVER) for m in sources) and any(_within(m, BATCH) for m in sources)
    assert not reaches(sources, SERVER, (BATCH,)), reaches(sources, SERVER, (BATCH,))
    assert not reaches(sources, BATCH, (SERVER,)), reaches(sources, BATCH, (SERVER,))


def test_training_never_imports_the_command_line_or_the_batch_job():
    sources = _library_and_training()
    bad = reaches(sources, "train", ("tev_jax.cli", BATCH, SERVER))
    assert not bad, bad


def test_models_and_kernels_never_import_the_cost_modules():
    sources = package_sources()
    bad = reaches(sources, "tev_jax.models", (COSTS,)) | reaches(sources, "tev_jax.kernels",
                                                                 (COSTS,))
    assert not bad, bad


def test_no_circle_between_the_rooms_of_the_library():
    """Rooms: the root modules and the subpackages. Imports between them only point one
    way (the root's method modules never import a wing that imports them back)."""
    assert not room_cycles(package_sources()), room_cycles(package_sources())


MAX_FLOORS = 11
"""Issue 56: the library's rooms stand on at most this many floors (44 rooms on 13
floors before it; the command line, a wing (server or batch job), the costs, the engine,
its programs, the decode loop and the method's modules below)."""


def test_the_library_stands_on_at_most_eleven_floors():
    tower = floors(package_sources())
    assert len(tower) <= MAX_FLOORS, " -> ".join(tower)
    # negative control: a chain of one room more than allowed
    chain = {f"tev_jax.r{i}": f"from tev_jax import r{i + 1}\n" for i in range(MAX_FLOORS)}
    chain[f"tev_jax.r{MAX_FLOORS}"] = "import math\n"
    assert floors(chain) == [f"r{i}" for i in range(MAX_FLOORS + 1)]


def test_the_wing_checks_catch_what_they_forbid():
    """Negative controls on synthetic sources: the server reaching the batch job through
    a shared module, a model importing a cost module in a function, and two rooms
    importing each other through different modules."""
    base = {
        "tev_jax.slots": "import math\n",
        "tev_jax.server.scheduler": "from tev_jax import slots\n",
        "tev_jax.batch.job": "from tev_jax.slots import Slots\n",
        "tev_jax.models.attention": "from tev_jax.kernels import scopes\n",
        "tev_jax.kernels.scopes": "import re\n",
        "tev_jax.costs.op_costs": "from tev_jax.kernels import scopes\n",
    }
    assert not reaches(base, SERVER, (BATCH,)) and not room_cycles(base)
    assert not reaches(base, "tev_jax.models", (COSTS,))
    shared = {**base, "tev_jax.slots": "from tev_jax.batch import job\n"}
    assert reaches(shared, SERVER, (BATCH,)) == {
        "tev_jax.server.scheduler": ["tev_jax.batch.job"]}
    lazy = {**base, "tev_jax.kernels.scopes": "def f():\n    from tev_jax.costs import op_costs\n"}
    assert reaches(lazy, "tev_jax.models", (COSTS,)) == {
        "tev_jax.models.attention": ["tev_jax.costs.op_costs"]}
    assert room_cycles(lazy) == [["costs", "kernels"]]


def module_map_misses(readme: str, package: Path) -> list[str]:
    """The root modules and subpackages of ``package`` that the README's module map
    (the table under "What is here") does not name as ``tev_jax/NAME.py`` or
    ``tev_jax/NAME/``."""
    table = readme.split("## What is here", 1)[1].split("\n## ", 1)[0]
    names = ([f"{package.name}/{p.name}" for p in sorted(package.glob("*.py"))
              if p.name != "__init__.py"]
             + [f"{package.name}/{p.name}/" for p in sorted(package.iterdir())
                if (p / "__init__.py").is_file()])
    return [n for n in names if f"`{n}`" not in table]


def test_the_readme_module_map_names_every_module_and_subpackage(tmp_path):
    assert not module_map_misses((ROOT / "README.md").read_text(), ROOT / "tev_jax")
    fake = tmp_path / "tev_jax"  # negative control: a module the map does not name
    (fake / "wing").mkdir(parents=True)
    (fake / "wing" / "__init__.py").write_text("")
    (fake / "tree.py").write_text("")
    (fake / "unmapped.py").write_text("")
    readme = "## What is here\n| `tev_jax/tree.py` | `tev_jax/wing/` |\n## Next\n"
    assert module_map_misses(readme, fake) == ["tev_jax/unmapped.py"]
