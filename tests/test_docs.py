"""The documentation runs as written.

Every ```python block of README.md and of each docs/*.md is extracted and run in order, one
script per file, each in its own subprocess (with a timeout) on the CPU; a listing that is not
meant to run is fenced ```text.  Each block of README.md is also run on its own, one subprocess
per block, so a reader can paste any one of them into a fresh interpreter: every README block
carries its own imports and setup.  Each script must stay under 1 GiB of peak resident memory, and
the docs explain the contract themselves rather than citing files the repository does not have.

What the prose cites exists, checked by parsing only (nothing of the package is imported): across
README.md, docs/*.md, ffi/README.md, the docstrings of examples/*.py and the module docstrings of
``ninfer_kv``, every dotted name ``ninfer_kv.a.b[.c]`` or ``pallas_kernels.a.b`` (in backticks, in a
``:mod:``/``:func:``/``:class:`` role or plain) is a module of the repository or a name a module
defines (a def, class or assignment, or a name it imports or lists in ``__all__``; a class's
attributes are looked up in its body and its bases), every repository path named (``ninfer_kv/…``,
``pallas_kernels/…``, ``tests/…``, ``bench/…``, ``examples/…``, ``ffi/…``, ``docs/….md``) exists, and
every ``from ninfer_kv… import …`` of a ```python block names something that exists.  Each check
lists every broken reference as ``file:line: reference``.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_import_layers import absolute_module

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
PEAK_RSS_LIMIT = 1 << 30
TIMEOUT_S = 120

_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.S | re.M)
_FOOTER = textwrap.dedent(
    """
    import resource as _resource, sys as _sys
    # VmHWM is this process image's own peak; ru_maxrss also keeps the peak of the process that
    # forked it across exec (pytest's, when the suite has grown large).
    try:
        with open("/proc/self/status") as _f:
            _peak = next(int(l.split()[1]) * 1024 for l in _f if l.startswith("VmHWM:"))
    except (OSError, StopIteration):
        _peak = _resource.getrusage(_resource.RUSAGE_SELF).ru_maxrss * (1 if _sys.platform == "darwin" else 1024)
    print(f"__peak_rss_bytes__={_peak}")
    """
)


def fenced_blocks(text: str) -> list[tuple[str, str, int]]:
    """``(language, code, line)`` of every fenced block, in order."""
    return [(m.group(1).strip(), m.group(2), text.count("\n", 0, m.start()) + 2) for m in _FENCE.finditer(text)]


def doc_script(path: Path) -> str:
    """The ```python blocks of ``path`` joined in order, each preceded by a comment with its line."""
    parts = [f"# {path.name}:{line}\n{code}" for lang, code, line in fenced_blocks(path.read_text()) if lang == "python"]
    return "\n".join(parts)


def python_blocks(path: Path) -> list[tuple[str, int]]:
    """``(code, line)`` of every ```python block of ``path``, in order."""
    return [(code, line) for lang, code, line in fenced_blocks(path.read_text()) if lang == "python"]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["JAX_PLATFORMS"] = "cpu"
    if "--xla_force_host_platform_device_count" not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1").strip()
    return env


def test_fence_parser():
    text = "a\n```python\nx = 1\n```\n\n```text\nf(a) -> b\n```\n```\nplain\n```\n"
    assert fenced_blocks(text) == [("python", "x = 1\n", 3), ("text", "f(a) -> b\n", 7), ("", "plain\n", 10)]


@pytest.mark.parametrize("path", DOCS, ids=[p.name for p in DOCS])
def test_python_blocks_parse(path):
    for lang, code, line in fenced_blocks(path.read_text()):
        if lang == "python":
            try:
                compile(code, f"{path.name}:{line}", "exec")
            except SyntaxError as exc:  # pragma: no cover - the message is the point
                pytest.fail(f"{path.name}:{line}: a ```python block does not parse ({exc}); fence listings as ```text")


@pytest.mark.parametrize("path", DOCS, ids=[p.name for p in DOCS])
def test_docs_cite_no_missing_files(path):
    text = path.read_text()
    assert not re.search(r"\bDESIGN\b", text), f"{path.name} cites DESIGN.md, which the repository does not have"
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        assert (path.parent / target).exists(), f"{path.name} links {target}, which does not exist"
    for named in re.findall(r"`([\w.\-]+(?:/[\w.\-]+)+)`", text):  # repository paths named in backticks
        if re.search(r"\.(py|md|ipynb|toml|cc|h)$", named):
            assert (ROOT / named).exists(), f"{path.name} names {named}, which the repository does not have"


def _run_script(script: Path, source: str) -> tuple[subprocess.CompletedProcess, int]:
    """Run ``source`` as ``script`` in a fresh interpreter; returns the process and its peak RSS in bytes."""
    script.write_text(source + _FOOTER)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=_env(), cwd=script.parent, timeout=TIMEOUT_S
    )
    found = re.search(r"__peak_rss_bytes__=(\d+)", proc.stdout)
    return proc, int(found.group(1)) if found else 0


@pytest.mark.parametrize("path", [p for p in DOCS if doc_script(p)], ids=lambda p: p.name)
def test_python_blocks_run_in_order(path, tmp_path):
    proc, peak = _run_script(tmp_path / f"{path.stem}_doc.py", doc_script(path))
    assert proc.returncode == 0, f"{path.name}: the python blocks fail when run in order:\n{proc.stderr[-4000:]}"
    assert peak < PEAK_RSS_LIMIT, f"{path.name}: the python blocks peak at {peak / 2**30:.2f} GiB resident"


_README_BLOCKS = python_blocks(README)


def test_readme_has_python_blocks():
    assert len(_README_BLOCKS) >= 2


@pytest.mark.parametrize(("code", "line"), _README_BLOCKS, ids=[f"README.md:{line}" for _, line in _README_BLOCKS])
def test_readme_python_block_runs_alone(code, line, tmp_path):
    proc, peak = _run_script(tmp_path / f"readme_{line}.py", f"# README.md:{line}\n{code}")
    assert proc.returncode == 0, (
        f"README.md:{line}: the python block fails when run on its own in a fresh interpreter (every README "
        f"block needs its own imports and setup):\n{proc.stderr[-4000:]}"
    )
    assert peak < PEAK_RSS_LIMIT, f"README.md:{line}: the python block peaks at {peak / 2**30:.2f} GiB resident"


def test_readme_cli_examples_print_what_the_readme_shows(capsys):
    """Every ``ninfer-kv plan`` / ``layout`` line of the README runs; the plan example prints the shown text."""
    import shlex

    from ninfer_kv.cli import main

    blocks = fenced_blocks((ROOT / "README.md").read_text())
    ran = 0
    for i, (lang, code, line) in enumerate(blocks):
        if lang != "bash":
            continue
        for command in code.splitlines():
            argv = shlex.split(command, comments=True)
            if argv[:1] != ["ninfer-kv"] or argv[1:2] not in (["plan"], ["layout"]):
                continue
            assert main(argv[1:]) == 0, f"README.md:{line}: {command}"
            out = capsys.readouterr().out
            ran += 1
            nxt = blocks[i + 1] if i + 1 < len(blocks) else None
            if argv[1] == "plan" and nxt is not None and nxt[0] == "text":
                assert out == nxt[1], f"README.md:{nxt[2]}: the shown output of `{command}` is stale"
    assert ran >= 3


# ---------------------------------------------------------------------------------------------
# References: every dotted name, repository path and code-block import the prose cites exists.
# Resolved by parsing the sources with ``ast`` (nothing is imported, so JAX never loads).

REF_PACKAGES = ("ninfer_kv", "pallas_kernels")
REF_DOCS = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "ffi" / "README.md"]
BUILD_OUTPUTS = ("ninfer_kv/_lib",)
"""Paths the build creates (the FFI library), which a source checkout does not have."""

_DOTTED = re.compile(r"(?<![\w./-])(?:ninfer_kv|pallas_kernels)(?:\.[A-Za-z_]\w*)+")
_REPO_PATH = re.compile(r"(?<![\w./-])(?:ninfer_kv|pallas_kernels|tests|bench|examples|ffi|docs)/[\w.\-/]*")
_RELATIVE_ROLE = re.compile(r":(?:mod|func|class|meth|attr|data|exc|obj):`~?(\.[A-Za-z_][\w.]*)`")
LOCAL_PATHS = {"ffi/README.md": ("ffi", re.compile(r"(?<![\w./-])src/[\w.\-/]*"))}
"""Texts that also name paths relative to their own folder: ffi/README.md's ``src/…``."""
_OPAQUE = ("opaque",)  # a name that exists but whose attributes cannot be read off the source


def _stdlib(module: str):
    """A standard-library module as a ``("python", module)`` target (importing it is cheap and safe);
    ``_OPAQUE`` for any other package outside the repository (JAX is never imported)."""
    if module.split(".")[0] not in sys.stdlib_module_names:
        return _OPAQUE
    try:
        return ("python", importlib.import_module(module))
    except ImportError:
        return _OPAQUE


class SourceIndex:
    """Module files and their top-level bindings, read with ``ast`` (never imported)."""

    def __init__(self, root: Path = ROOT):
        self.root = root
        self._parsed: dict[str, tuple] = {}

    def module_file(self, module: str) -> Path | None:
        """The file (or namespace-package folder) of a repository module, else ``None``."""
        if module.split(".")[0] not in REF_PACKAGES:
            return None
        base = self.root.joinpath(*module.split("."))
        if (base / "__init__.py").is_file():
            return base / "__init__.py"
        if base.with_suffix(".py").is_file():
            return base.with_suffix(".py")
        if base.is_dir() and any(base.glob("*.py")):
            return base  # a namespace package
        return None

    def _bindings(self, module: str) -> tuple[dict, set, str]:
        """``(name -> binding, __all__ names, package)`` of a module's top level."""
        if module not in self._parsed:
            path = self.module_file(module)
            names: dict = {}
            public: set = set()
            is_package = path is None or path.is_dir() or path.name == "__init__.py"
            package = module if is_package else module.rpartition(".")[0]
            body = [] if path is None or path.is_dir() else ast.parse(path.read_text(), str(path)).body
            self._collect(body, module, package, names, public)
            self._parsed[module] = (names, public, package)
        return self._parsed[module]

    def _collect(self, body, module, package, names, public):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names[node.name] = ("def",)
            elif isinstance(node, ast.ClassDef):
                names[node.name] = ("class", module, node)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            names[n.id] = ("value",)
                            if n.id == "__all__" and isinstance(node.value, (ast.List, ast.Tuple)):
                                public |= {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        names[a.asname] = ("module", a.name)
                    else:
                        names.setdefault(a.name.split(".")[0], ("module", a.name.split(".")[0]))
            elif isinstance(node, ast.ImportFrom):
                source = absolute_module(package, node.level, node.module)
                for a in node.names:
                    if a.name != "*":
                        names[a.asname or a.name] = ("from", source, a.name)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                for block in ("body", "orelse", "finalbody"):
                    self._collect(getattr(node, block, []), module, package, names, public)
                for handler in getattr(node, "handlers", []):
                    self._collect(handler.body, module, package, names, public)

    def _follow(self, binding, depth: int):
        kind = binding[0]
        if kind == "module":
            return binding if self.module_file(binding[1]) else _stdlib(binding[1])
        if kind == "from":
            if self.module_file(binding[1]) is None:  # imported from outside the repository
                found = _stdlib(binding[1])
                return found if found is _OPAQUE else self.member(found, binding[2], depth + 1)
            return self.member(("module", binding[1]), binding[2], depth + 1)
        if kind == "class":
            return binding
        return _OPAQUE

    def member(self, target, name: str, depth: int = 0):
        """What ``name`` is on ``target`` (a module or a class binding), ``_OPAQUE`` when it exists but
        cannot be looked into, ``None`` when it does not exist."""
        if depth > 20 or target is _OPAQUE:
            return _OPAQUE
        if target[0] == "python":  # the standard library: read the real object (a class's MRO too)
            obj = target[1]
            if isinstance(obj, type) and any(name in vars(k) for k in obj.__mro__):
                return _OPAQUE
            return ("python", getattr(obj, name)) if hasattr(obj, name) else None
        if target[0] == "module":
            module = target[1]
            if self.module_file(f"{module}.{name}"):
                return ("module", f"{module}.{name}")
            names, public, _ = self._bindings(module)
            if name in names:
                return self._follow(names[name], depth)
            return _OPAQUE if name in public else None
        _, module, cls = target
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                return ("class", module, node) if isinstance(node, ast.ClassDef) else _OPAQUE
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(n, ast.Name) and n.id == name for t in targets for n in ast.walk(t)):
                    return _OPAQUE
        for n in ast.walk(cls):  # self.name = ... in a method
            if isinstance(n, ast.Attribute) and n.attr == name and isinstance(n.ctx, ast.Store):
                return _OPAQUE
        for base in cls.bases:
            found = self._base(module, base, depth)
            if found is _OPAQUE:
                return _OPAQUE  # a base from outside the repository may define it
            if found is not None:
                hit = self.member(found, name, depth + 1)
                if hit is not None:
                    return hit
        return None

    def _base(self, module: str, expr, depth: int):
        if isinstance(expr, ast.Subscript):
            expr = expr.value
        chain = []
        while isinstance(expr, ast.Attribute):
            chain.append(expr.attr)
            expr = expr.value
        if not isinstance(expr, ast.Name):
            return _OPAQUE
        target = self.member(("module", module), expr.id, depth + 1)
        if target is None and hasattr(builtins, expr.id):
            target = ("python", getattr(builtins, expr.id))
        for attr in reversed(chain):
            if target is None or target is _OPAQUE:
                break
            target = self.member(target, attr, depth + 1)
        return _OPAQUE if target is None else target

    def resolves(self, dotted: str) -> bool:
        """Whether ``a.b.c`` names a module of the repository or something defined in one."""
        parts = dotted.split(".")
        for i in range(len(parts), 0, -1):
            if self.module_file(".".join(parts[:i])):
                break
        else:
            return False
        target = ("module", ".".join(parts[:i]))
        for name in parts[i:]:
            target = self.member(target, name)
            if target is None:
                return False
            if target is _OPAQUE:
                return True
        return True


def docstrings(path: Path, module_only: bool) -> list[tuple[str, int]]:
    """``(text, first line)`` of a Python file's module docstring (and, unless ``module_only``, of
    every class and function docstring)."""
    tree = ast.parse(path.read_text(), str(path))
    defs = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    nodes = [tree] if module_only else [tree, *(n for n in ast.walk(tree) if isinstance(n, defs))]
    out = []
    for node in nodes:
        first = node.body[0] if node.body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            out.append((first.value.value, first.lineno))
    return out


@functools.cache
def reference_texts() -> tuple[tuple[str, str, int], ...]:
    """``(file, text, first line)`` of every text whose references are checked: README.md, docs/*.md,
    ffi/README.md, the docstrings of examples/*.py and the module docstrings of ``ninfer_kv``."""
    out = [(str(p.relative_to(ROOT)), p.read_text(), 1) for p in REF_DOCS]
    for path in sorted((ROOT / "examples").glob("*.py")):
        out += [(str(path.relative_to(ROOT)), text, line) for text, line in docstrings(path, module_only=False)]
    for path in sorted((ROOT / "ninfer_kv").rglob("*.py")):
        out += [(str(path.relative_to(ROOT)), text, line) for text, line in docstrings(path, module_only=True)]
    return tuple(out)


def _line(text: str, pos: int, first: int) -> int:
    return first + text.count("\n", 0, pos)


def _package_of(name: str) -> str | None:
    """The package a relative reference in the docstrings of repository file ``name`` starts from."""
    parts = name.removesuffix(".py").split("/")
    if not name.endswith(".py") or parts[0] not in REF_PACKAGES:
        return None
    return ".".join(parts[:-1])


def broken_dotted_references(texts, index: SourceIndex) -> list[str]:
    """``file:line: name`` of every ``ninfer_kv.…`` / ``pallas_kernels.…`` name that resolves to nothing,
    and, in a package's own docstrings, of every relative role (``:mod:`.kv```) that does not."""
    bad = []
    for name, text, first in texts:
        found = [(m.start(), m.group(), m.group()) for m in _DOTTED.finditer(text)]
        package = _package_of(name)
        if package:
            found += [(m.start(), m.group(), package + m.group(1)) for m in _RELATIVE_ROLE.finditer(text)]
        for start, shown, full in sorted(found):
            if not index.resolves(full):
                bad.append(f"{name}:{_line(text, start, first)}: {shown}")
    return bad


def missing_repo_paths(texts, root: Path = ROOT) -> list[str]:
    """``file:line: path`` of every repository path named that the repository does not have (a
    placeholder such as ``pallas_kernels/<backend>/`` or a glob is left alone)."""
    bad = []
    for name, text, first in texts:
        base, local = LOCAL_PATHS.get(name, ("", None))
        found = [("", m) for m in _REPO_PATH.finditer(text)]
        found += [(base, m) for m in (local.finditer(text) if local else ())]
        for folder, m in sorted(found, key=lambda f: f[1].start()):
            path = m.group().rstrip(".")
            if text[m.end() : m.end() + 1] in ("<", "*", "{") or path.startswith(BUILD_OUTPUTS):
                continue
            if not (root / folder / path).exists():
                bad.append(f"{name}:{_line(text, m.start(), first)}: {path}")
    return bad


def broken_block_imports(texts, index: SourceIndex) -> list[str]:
    """``file:line: import`` of every ``from ninfer_kv… import name`` / ``import ninfer_kv…`` of a
    ```python block that names a module or a name the repository does not define."""
    bad = []
    for name, text, first in texts:
        for lang, code, line in fenced_blocks(text):
            if lang != "python":
                continue
            try:
                tree = ast.parse(code)
            except SyntaxError:
                continue  # test_python_blocks_parse reports it
            for node in ast.walk(tree):
                where = f"{name}:{first + line - 1 + node.lineno - 1}" if hasattr(node, "lineno") else name
                ours = isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in REF_PACKAGES
                if ours and not node.level:
                    for a in node.names:
                        if not index.resolves(f"{node.module}.{a.name}"):
                            bad.append(f"{where}: from {node.module} import {a.name}")
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        if a.name.split(".")[0] in REF_PACKAGES and index.module_file(a.name) is None:
                            bad.append(f"{where}: import {a.name}")
    return bad


_INDEX = SourceIndex()


def test_dotted_references_resolve():
    bad = broken_dotted_references(reference_texts(), _INDEX)
    assert not bad, "dotted names that name nothing in the repository:\n" + "\n".join(bad)


def test_repo_paths_exist():
    bad = missing_repo_paths(reference_texts())
    assert not bad, "repository paths that do not exist:\n" + "\n".join(bad)


def test_code_block_imports_resolve():
    texts = [(str(p.relative_to(ROOT)), p.read_text(), 1) for p in REF_DOCS]
    bad = broken_block_imports(texts, _INDEX)
    assert not bad, "imports of ```python blocks that name nothing in the repository:\n" + "\n".join(bad)


def test_the_reference_checks_can_fail():
    fake = (
        "The store is `ninfer_kv.store.KVStore` (:func:`ninfer_kv.store.KVStore.activate`), planned by\n"
        "ninfer_kv.planning.plan_kv_cache; not by :mod:`ninfer_kv.no_such_module` nor\n"
        "`ninfer_kv.schema.layout.NoSuchName` nor ninfer_kv.store.KVStore.no_such_verb.\n"
        "See `ninfer_kv/store/core.py`, tests/test_docs.py, docs/LAYOUT.md and `pallas_kernels/<backend>/`,\n"
        "not ninfer_kv/no_such.py or docs/NOPE.md.\n"
        "```python\n"
        "from ninfer_kv.schema.layout import PagedKVStorageLayout, NoSuchLayout\n"
        "import ninfer_kv.no_such\n"
        "```\n"
    )
    texts = [("FAKE.md", fake, 1)]
    assert broken_dotted_references(texts, _INDEX) == [
        "FAKE.md:2: ninfer_kv.no_such_module",
        "FAKE.md:3: ninfer_kv.schema.layout.NoSuchName",
        "FAKE.md:3: ninfer_kv.store.KVStore.no_such_verb",
        "FAKE.md:8: ninfer_kv.no_such",
    ]
    assert missing_repo_paths(texts) == ["FAKE.md:5: ninfer_kv/no_such.py", "FAKE.md:5: docs/NOPE.md"]
    assert broken_block_imports(texts, _INDEX) == [
        "FAKE.md:7: from ninfer_kv.schema.layout import NoSuchLayout",
        "FAKE.md:8: import ninfer_kv.no_such",
    ]
    # ffi/README.md also names its own sources relative to ffi/
    assert missing_repo_paths([("ffi/README.md", "`src/common.h`, `src/dispatch.{h,cc}` and\nsrc/nope.cc", 1)]) == [
        "ffi/README.md:2: src/nope.cc"
    ]
    # a class's attributes: its body, its bases in the repository, a standard-library base's own
    assert _INDEX.resolves("ninfer_kv.schema.kinds.PoolKind.MAIN")
    assert _INDEX.resolves("ninfer_kv.schema.kinds.PoolKind.value")  # enum.Enum's
    assert not _INDEX.resolves("ninfer_kv.schema.kinds.PoolKind.no_such_member")
    # a package's own docstrings may name its modules relatively
    relative = ":mod:`.kv` and :func:`.handlers.arithmetic`, not :mod:`.no_such`"
    assert broken_dotted_references([("ninfer_kv/ops/ffi/__init__.py", relative, 1)], _INDEX) == [
        "ninfer_kv/ops/ffi/__init__.py:1: :mod:`.no_such`"
    ]
    # a docstring's lines count from where it starts in its file
    assert broken_dotted_references([("x.py", "a\nb ninfer_kv.nope", 10)], _INDEX) == ["x.py:11: ninfer_kv.nope"]
