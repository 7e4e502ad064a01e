"""Each bookkeeping table owns its transitions: no other module writes its arrays or calls its
transitions except the one object that composes it.

The tables are recognised by type: the scan finds every ``self.<attribute> = <Table>(...)`` in the
package (so ``rt.pages`` is a ``LogicalPageTable`` because ``PoolRuntime`` builds it so, whatever
the name) and follows local aliases (``pg = rt.pages``).  For every table it then fails on

* an assignment (``=``, ``+=``, ...) into ``<table>.<array field>[...]``, or an in-place numpy write
  into such a field (``np.add.at(pg.refs, ...)``, ``out=pg.refs``), outside the table's module;
* a call of one of the table's transitions (every public method that is not a query) outside the
  table's module and its composer: ``PoolRuntime`` (``runtime.py``) for the pool-level tables, the
  store's core and verb families for the execution rows.  The Host tier, for one, changes pool and
  page state only through ``PoolRuntime``'s named transitions (its offload and restore state
  machines, ``host_offload.py`` and ``host_restore.py``, included); a pool's Host replica table
  (``PoolHostReplicas``: extent memberships, the arena bookkeeping) is composed by the runtime too.
"""

from __future__ import annotations

import ast
import inspect
import pathlib

import numpy as np
import pytest

import ninfer_kv
from ninfer_kv.host import HostKVArena
from ninfer_kv.schema.layout import PagedKVStorageLayout
from ninfer_kv.store.address_space import AddressSpaceTable
from ninfer_kv.store.block_tables import BlockTableMatrix
from ninfer_kv.store.frontier_history import FrontierHistory
from ninfer_kv.store.logical_page import LogicalPageTable
from ninfer_kv.store.page_writes import PageWrites
from ninfer_kv.store.pool import DevicePagePool
from ninfer_kv.store.pool_host_replicas import PoolHostReplicas
from ninfer_kv.store.rows import ExecutionRows

PACKAGE = pathlib.Path(ninfer_kv.__file__).parent
_RUNTIME = {"runtime.py"}
_STORE = {"core.py", "activation.py", "work_verbs.py", "row_verbs.py", "inspection.py", "store.py"}

# table class -> (an instance to read its fields from, its module, its composers, its queries)
TABLES = {
    "LogicalPageTable": (
        LogicalPageTable(4, pool="scan"),
        "logical_page.py",
        _RUNTIME,
        {"check", "free_slots", "host_replica", "host_valid", "num_live", "snapshot", "column_snapshot"},
    ),
    "AddressSpaceTable": (
        AddressSpaceTable(2, 4, pool="scan"),
        "address_space.py",
        _RUNTIME,
        {"check", "pages_of", "snapshot", "column_snapshot"},
    ),
    "DevicePagePool": (
        DevicePagePool(4, owners=2, name="scan"),
        "pool.py",
        _RUNTIME,
        {
            "allocated",
            "available",
            "reserved",
            "reservation",
            "reservations",
            "generations",
            "is_free",
            "lease",
            "snapshot",
            "audit_invariants",
            "check_leases",
        },
    ),
    "BlockTableMatrix": (BlockTableMatrix(2, 4), "block_tables.py", _RUNTIME, {"pending", "pending_keys", "snapshot"}),
    "PageWrites": (
        PageWrites(PagedKVStorageLayout("bf16", 1, 1, 16), 4),
        "page_writes.py",
        _RUNTIME,
        {"counts", "touches", "snapshot"},
    ),
    "FrontierHistory": (
        FrontierHistory(2, 4),
        "frontier_history.py",
        _RUNTIME,
        {"intact_row", "intact_checkpoint", "snapshot"},
    ),
    "PoolHostReplicas": (
        PoolHostReplicas(LogicalPageTable(4, pool="scan"), PagedKVStorageLayout("bf16", 1, 1, 16), "scan",
                         HostKVArena(4096, prefault=False)),
        "pool_host_replicas.py",
        _RUNTIME,
        {"restore_sources", "occupancy", "audit_invariants", "snapshot"},
    ),
    "ExecutionRows": (
        ExecutionRows(2),
        "rows.py",
        _STORE,
        {"active", "check", "check_one", "audit_invariants", "free", "snapshot"},
    ),
}
CLASSES = {
    "LogicalPageTable": LogicalPageTable,
    "AddressSpaceTable": AddressSpaceTable,
    "DevicePagePool": DevicePagePool,
    "BlockTableMatrix": BlockTableMatrix,
    "PageWrites": PageWrites,
    "FrontierHistory": FrontierHistory,
    "PoolHostReplicas": PoolHostReplicas,
    "ExecutionRows": ExecutionRows,
}


def _fields(name: str) -> set[str]:
    """A table's array (and list/dict) fields: the state its transitions own."""
    instance = TABLES[name][0]
    return {k for k, v in vars(instance).items() if isinstance(v, (list, dict, np.ndarray))}


def _transitions(name: str) -> set[str]:
    cls, queries = CLASSES[name], TABLES[name][3]
    return {n for n, v in inspect.getmembers(cls) if not n.startswith("_") and callable(v)} - queries


FIELDS = {name: _fields(name) for name in TABLES}
TRANSITIONS = {name: _transitions(name) for name in TABLES}


def _modules() -> list[pathlib.Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def attribute_types(sources) -> dict[str, str]:
    """``{attribute: table class}`` from every ``self.<attribute> = <Table>(...)`` of the sources."""
    out = {}
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign) and node.value is not None
                else []
            )
            value = getattr(node, "value", None)
            if not isinstance(value, ast.Call) or not isinstance(value.func, ast.Name) or value.func.id not in TABLES:
                continue
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    out[t.attr] = value.func.id
    return out


ATTRS = attribute_types(p.read_text() for p in _modules())


def _table_of(node: ast.AST, aliases: dict) -> str | None:
    """The table class an expression holds, by the attribute that names it or a local alias."""
    if isinstance(node, ast.Attribute):
        return ATTRS.get(node.attr)
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    return None


def _aliases(func: ast.AST) -> dict:
    out = {}
    for node in ast.walk(func):
        if isinstance(node, ast.Assign):
            pairs = []
            for t in node.targets:
                if isinstance(t, ast.Name):
                    pairs.append((t, node.value))
                elif isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs.extend(zip(t.elts, node.value.elts))
            for t, v in pairs:
                if isinstance(t, ast.Name):
                    table = _table_of(v, {})
                    if table:
                        out[t.id] = table
    return out


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
    """``(line, code)`` of every write into, or transition of, a table that ``module`` may not change."""
    tree = ast.parse(source)
    scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    scopes.append(tree)
    found = set()
    for scope in scopes:
        aliases = _aliases(scope)

        def foreign_field(node):
            if not isinstance(node, ast.Attribute):
                return False
            table = _table_of(node.value, aliases)
            return table is not None and TABLES[table][1] != module and node.attr in FIELDS[table]

        for node in ast.walk(scope):
            for t in _targets(node):
                if isinstance(t, ast.Subscript) and foreign_field(t.value):
                    found.add((node.lineno, ast.unparse(t)))
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            written = []
            if isinstance(func, ast.Attribute) and func.attr == "at" and node.args:
                written.append(node.args[0])  # np.add.at(pages.refs, ...)
            written.extend(k.value for k in node.keywords if k.arg == "out")
            for w in written:
                for el in w.elts if isinstance(w, ast.Tuple) else [w]:
                    if foreign_field(el):
                        found.add((node.lineno, ast.unparse(node)))
            if isinstance(func, ast.Attribute):
                table = _table_of(func.value, aliases)
                if table is not None and func.attr in TRANSITIONS[table]:
                    _, owner, composers, _ = TABLES[table]
                    if module != owner and module not in composers:
                        found.add((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_every_table_is_found_by_type():
    assert {"pages", "spaces", "pool", "table", "writes", "history", "host_replicas", "rows"} <= set(ATTRS)
    assert ATTRS["pages"] == "LogicalPageTable" and ATTRS["rows"] == "ExecutionRows"
    assert ATTRS["host_replicas"] == "PoolHostReplicas" and TRANSITIONS["PoolHostReplicas"] == {"hold", "release"}
    assert {"refs", "active_refs", "writer", "device_page", "pins", "host_page", "host_extent"} <= FIELDS[
        "LogicalPageTable"
    ]
    assert {"membership", "n_blocks", "mapped", "committed", "live", "ent_pages", "target", "bundle"} <= FIELDS[
        "AddressSpaceTable"
    ]
    assert {"pin", "set_device", "clear_device"} <= TRANSITIONS["LogicalPageTable"]
    assert {"acquire", "release", "materialize"} <= TRANSITIONS["DevicePagePool"]
    assert "host_valid" not in TRANSITIONS["LogicalPageTable"]


def test_no_module_changes_another_modules_table():
    bad = []
    for path in _modules():
        module = path.name if path.parent.name == "store" else str(path)
        for line, code in violations(path.read_text(), module):
            bad.append(f"{path.relative_to(PACKAGE)}:{line}: {code}")
    assert not bad, (
        "changes of a table outside the table and its composer (use their transition methods):\n" + "\n".join(bad)
    )


@pytest.mark.parametrize(
    "code",
    [
        "self.pages.refs[slots] -= 1",
        "pg = rt.pages\npg.writer[dead] = -1",
        "sp = self.spaces\nsp.membership[owner, blocks] = slots",
        "self.rt.spaces.committed[rows] = frontiers",
        "pg = job.rt.pages\npg.host_extent[s] = None",
        "pg = rt.pages\na, pg.host_page[s] = 1, 2",
        "pg, sp = rt.pages, rt.spaces\nnp.add.at(pg.refs, slots, 1)",
        "np.maximum(x, y, out=rt.pages.protected)",
        "def f(rt):\n    anything = rt.pages\n    anything.writer[0] = 1",  # by type, whatever the alias
        "job.rt.pool.acquire(3)",  # a transition of a pool-level table outside its composer
        "def f(rt):\n    p = rt.pages\n    p.pin(slots)",
        "job.rt.host_replicas.release(extents)",  # the extent bookkeeping is the runtime's to change
        "rt.host_replicas.users[extent] = 0",
    ],
)
@pytest.mark.parametrize("module", ["host_tier.py", "host_offload.py", "host_restore.py"])
def test_scan_detects_foreign_changes(code, module):
    assert violations(code, module)


def test_scan_allows_reads_queries_owners_and_composers():
    assert not violations(
        "pg = rt.pages\nx = pg.refs[slots] == 0\ny = rt.spaces.committed[rows]\nz = rt.pages.host_valid(s, c)",
        "host_tier.py",
    )
    assert not violations("rt.pool.acquire(3)\nrt.pages.pin(slots)", "runtime.py")
    assert not violations("self.host_replicas.hold(extent, 3)", "runtime.py")
    assert not violations("x = rt.host_replicas.restore_sources(s, ids)", "host_restore.py")
    assert not violations("self.refs[slots] += 1", "runtime.py")
    assert not violations("pg = rt.pages\npg.refs[slots] += 1", "logical_page.py")
    assert not violations("rt.spaces.committed[rows] = f", "address_space.py")
    assert violations("pg = rt.pages\npg.committed[slots] = c", "address_space.py")
    assert not violations("self.core.rows.lease(row, 1)", "activation.py")
    assert violations("shard._core.rows.lease(row, 1)", "sharded.py")
