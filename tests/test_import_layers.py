"""The package's import graph: the layers of docs/ARCHITECTURE.md, no cycles, no JAX below the ops.

Every module of ``ninfer_kv`` and ``pallas_kernels`` is parsed (never imported) and every import it
can run is an edge: top-level, inside functions and under ``TYPE_CHECKING``.  Importing ``a.b.c``
also runs ``a/__init__.py`` and ``a/b/__init__.py``, so those are edges too, and ``from a import b``
is an edge to the submodule ``a.b`` when there is one.  The graph must have no cycle.

Every module has a rank (:data:`LAYERS`); an import may point to its own rank or below, never up,
and no module ranked below the ops imports JAX anywhere.

The edges to the importer's own ancestor packages are left out: they ran before the importer
did, whatever it imports.  So that this is sound, a module may never import a re-exported name
from one of its ancestor packages (``from ninfer_kv import KVStore`` inside ``ninfer_kv``, whose
``__init__`` may still be running): it imports the module that defines it.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ninfer_kv", "pallas_kernels")

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # vocabulary: plain Python and numpy, no JAX
    ("schema", ("ninfer_kv.schema",)),
    ("planning", ("ninfer_kv.planning",)),
    ("host", ("ninfer_kv.host",)),
    ("store", ("ninfer_kv.store",)),
    # stateless functions over arrays: codecs, views, the op registry, its kernels and the FFI's
    ("ops", ("ninfer_kv.ops", "pallas_kernels")),
    ("device", ("ninfer_kv.device",)),
    ("models", ("ninfer_kv.models",)),
    ("engine", ("ninfer_kv.engine",)),
    ("cli", ("ninfer_kv.cli",)),
    ("applications", ("ninfer_kv.demo", "ninfer_kv.server")),
    ("facade", ("ninfer_kv", "ninfer_kv.__main__")),
)
"""Ranks, lowest first: a module's rank is that of the longest prefix listed."""

JAX_FREE_BELOW = "ops"
"""Modules ranked below this layer import no JAX, not even inside a function."""


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _with_parents(name: str, modules: dict) -> list[str]:
    """``a.b.c`` -> the modules importing it runs: ``a``, ``a.b``, ``a.b.c`` (those that exist)."""
    parts = name.split(".")
    return [m for m in (".".join(parts[: i + 1]) for i in range(len(parts))) if m in modules]


def _is_descendant(m: str, pkg: str) -> bool:
    return m.startswith(pkg + ".")


def _imports(name: str, path: Path):
    """``(target module, imported names or None, line)`` of every import statement of a module."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            yield absolute_module(package, node.level, node.module), [a.name for a in node.names], node.lineno


def absolute_module(package: str, level: int, module: str | None) -> str:
    """The module an ``ImportFrom`` of ``level`` dots names, made absolute from the importer's ``package``."""
    if not level:
        return module or ""
    base = package.split(".")
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for mod, names, _ in _imports(name, path):
            targets = [mod] + [f"{mod}.{n}" for n in names or ()]
            for t in targets:
                for m in _with_parents(t, modules):
                    if m != name and not _is_descendant(name, m):  # an ancestor of the importer: ran already
                        graph[name].add(m)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (as a path that returns to its start), or ``None``."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def rank(module: str) -> tuple[int, str]:
    """``(rank, layer name)`` of a module: the layer of the longest listed prefix."""
    best = None
    for i, (layer, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[0]):
                best = (len(p), i, layer)
    if best is None:
        raise AssertionError(f"{module} has no layer: add it (or its package) to LAYERS and to docs/ARCHITECTURE.md")
    return best[1], best[2]


def _explicit_edges():
    """``(importer, imported module, line)`` of every import naming a module of the package (the
    parent packages a dotted import also runs are left out: the rank of the named module decides)."""
    modules = _modules()
    for name, path in modules.items():
        for mod, names, line in _imports(name, path):
            subs = [f"{mod}.{n}" for n in names or () if f"{mod}.{n}" in modules]
            # ``from pkg import submodule`` names the submodule; the package counts for any other name
            targets = subs + ([mod] if mod in modules and (not names or len(subs) < len(names)) else [])
            if not targets and mod.split(".")[0] in PACKAGES:
                targets = [m for m in _with_parents(mod, modules)][-1:]
            for t in targets:
                if t != name and not _is_descendant(name, t):
                    yield name, t, path, line


def upward_imports() -> list[str]:
    bad = []
    for name, target, path, line in _explicit_edges():
        (r, layer), (tr, tlayer) = rank(name), rank(target)
        if tr > r:
            bad.append(f"{path.relative_to(ROOT)}:{line}: {name} ({layer}) imports {target} ({tlayer})")
    return bad


def jax_imports_below_the_ops() -> list[str]:
    limit = [layer for layer, _ in LAYERS].index(JAX_FREE_BELOW)
    bad = []
    for name, path in _modules().items():
        if rank(name)[0] >= limit:
            continue
        for mod, _, line in _imports(name, path):
            if mod.split(".")[0] in ("jax", "jaxlib"):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {name} imports {mod}")
    return bad


def test_every_module_has_a_layer():
    for name in _modules():
        rank(name)


def test_imports_point_down_the_layers():
    bad = upward_imports()
    assert not bad, "imports that point up the layers (docs/ARCHITECTURE.md):\n" + "\n".join(bad)


def test_no_jax_below_the_ops():
    bad = jax_imports_below_the_ops()
    assert not bad, f"modules below the {JAX_FREE_BELOW} layer must not import JAX:\n" + "\n".join(bad)


def test_the_rank_check_can_fail():
    assert rank("ninfer_kv.store.pool") < rank("ninfer_kv.device.state")
    assert rank("ninfer_kv.ops.int_arrays")[1] == "ops" and rank("ninfer_kv.schema.layout")[1] == "schema"
    assert rank("ninfer_kv") > rank("ninfer_kv.server.app")


def test_the_walker_sees_every_kind_of_import():
    g = import_graph()
    assert "ninfer_kv" in g["ninfer_kv.store.store"] or any(
        m.startswith("ninfer_kv") for m in g["ninfer_kv.store.store"]
    )
    # a dotted import counts its parent packages; a cycle through a function-level import is found
    assert find_cycle({"a": {"a.b"}, "a.b": {"c"}, "c": {"a"}}) == ["a", "a.b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_imports_a_re_export_of_its_own_package():
    modules = _modules()
    bad = []
    for name, path in modules.items():
        for mod, names, line in _imports(name, path):
            if (
                names
                and mod in modules
                and (name == mod or _is_descendant(name, mod))
                and modules[mod].name == "__init__.py"
            ):
                for n in names:
                    if f"{mod}.{n}" not in modules:
                        bad.append(f"{path.relative_to(ROOT)}:{line}: from {mod} import {n}")
    assert not bad, "import the defining module instead:\n" + "\n".join(bad)


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_store_imports_no_jax():
    code = (
        "import sys; import ninfer_kv.store, ninfer_kv.store.sharded, ninfer_kv.planning; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib')); print(bad); "
        "sys.exit(1 if bad else 0)"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, f"importing the store imported JAX modules: {proc.stdout[-2000:]}{proc.stderr[-2000:]}"


def _defined_names(path: Path) -> set[str]:
    """Names a module defines itself (functions, classes, assignments), not the ones it imports."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                out |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    return out


def _public_names(path: Path) -> list[str]:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return [e.value for e in node.value.elts]
    return []


def test_one_import_path_per_public_name():
    """A module's ``__all__`` names only what it or its own subpackages define: no name is
    re-exported from another package (the root ``ninfer_kv`` facade is the one exception)."""
    modules = _modules()
    bad = []
    for name, path in modules.items():
        if name == "ninfer_kv":
            continue
        inside = [m for m in modules if m == name or _is_descendant(m, name)]
        defined = set().union(*(_defined_names(modules[m]) for m in inside))
        defined |= {m.rpartition(".")[2] for m in inside}
        for public in _public_names(path):
            if public not in defined:
                bad.append(f"{path.relative_to(ROOT)}: {public} (defined elsewhere: import it from its home)")
    assert not bad, "re-exported names:\n" + "\n".join(bad)
