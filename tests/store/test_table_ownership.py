"""Each bookkeeping table owns its transitions: no other module assigns into its arrays.

``LogicalPageTable`` (``logical_page.py``) and ``AddressSpaceTable`` (``address_space.py``) keep
their state in struct-of-arrays fields; every change goes through a named transition method of the
table.  This test walks the source of every module of the package and fails on an assignment
(``=``, ``+=``, ...) into ``<expr>.<field>[...]`` where ``<field>`` is one of a table's arrays
and the module is not the table's own, or on an in-place numpy write into such a field
(``np.add.at(pages.refs, ...)``, ``out=pages.refs``).
"""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

import ninfer_kv
from ninfer_kv.store.address_space import AddressSpaceTable
from ninfer_kv.store.logical_page import LogicalPageTable

PACKAGE = pathlib.Path(ninfer_kv.__file__).parent
OWNERS = {
    "address_space.py": AddressSpaceTable(2, 4, pool="scan"),
    "logical_page.py": LogicalPageTable(4, pool="scan"),
}


def _fields(table) -> set[str]:
    """The table's array (and list) fields: the state its transitions own."""
    return {k for k, v in vars(table).items() if isinstance(v, (list, np.ndarray))}


FIELDS = {owner: _fields(table) for owner, table in OWNERS.items()}
# tables are reached as ``pages``/``spaces`` attributes or through the usual short aliases
TABLE_OWNER = {
    "pages": "logical_page.py",
    "pg": "logical_page.py",
    "spaces": "address_space.py",
    "sp": "address_space.py",
}


def _base_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _foreign_field(node: ast.AST, module: str) -> bool:
    """Whether ``node`` is ``<table>.<field>``, a field of a table that ``module`` does not own."""
    if not isinstance(node, ast.Attribute):
        return False
    owner = TABLE_OWNER.get(_base_name(node.value))
    return owner is not None and owner != module and node.attr in FIELDS[owner]


def _targets(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Assign):
        out = []
        for t in node.targets:
            out.extend(t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])
        return out
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    return []


def violations(source: str, module: str) -> list[tuple[int, str]]:
    """``(line, code)`` of every write by ``module`` into another module's table arrays."""
    found = []
    for node in ast.walk(ast.parse(source)):
        for t in _targets(node):
            if isinstance(t, ast.Subscript) and _foreign_field(t.value, module):
                found.append((node.lineno, ast.unparse(t)))
        if isinstance(node, ast.Call):
            func = node.func
            written = []
            if isinstance(func, ast.Attribute) and func.attr == "at" and node.args:
                written.append(node.args[0])  # np.add.at(pages.refs, ...)
            written.extend(k.value for k in node.keywords if k.arg == "out")
            for w in written:
                for el in w.elts if isinstance(w, ast.Tuple) else [w]:
                    if _foreign_field(el, module):
                        found.append((node.lineno, ast.unparse(node)))
    return found


def _modules() -> list[pathlib.Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_table_fields_are_known():
    assert {"refs", "active_refs", "writer", "device_page", "pins", "host_page", "host_extent"} <= FIELDS[
        "logical_page.py"
    ]
    assert {"membership", "n_blocks", "mapped", "committed", "live", "ent_pages", "target", "bundle"} <= FIELDS[
        "address_space.py"
    ]


def test_no_module_writes_another_modules_table_arrays():
    bad = []
    for path in _modules():
        owner = path.name if path.parent.name == "store" else None
        for line, code in violations(path.read_text(), owner or str(path)):
            bad.append(f"{path.relative_to(PACKAGE)}:{line}: {code}")
    assert not bad, "writes into a table's arrays outside the table (use its transition methods):\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "code",
    [
        "self.pages.refs[slots] -= 1",
        "pg.writer[dead] = -1",
        "sp.membership[owner, blocks] = slots",
        "self.rt.spaces.committed[rows] = frontiers",
        "pg.host_extent[s] = None",
        "a, pg.host_page[s] = 1, 2",
        "np.add.at(pg.refs, slots, 1)",
        "np.maximum(x, y, out=pg.protected)",
    ],
)
def test_scan_detects_foreign_writes(code):
    assert violations(code, "runtime.py")


def test_scan_allows_reads_and_owner_writes():
    assert not violations("x = pg.refs[slots] == 0\ny = sp.committed[rows]\npg.pin(slots)", "runtime.py")
    assert not violations("self.refs[slots] += 1", "runtime.py")
    assert not violations("pg.refs[slots] += 1", "logical_page.py")
    assert not violations("sp.committed[rows] = f", "address_space.py")
    assert violations("pg.committed[slots] = c", "address_space.py")
