"""Every public name of the package has a docstring.

The public API is what ``ninfer_kv.__all__`` and the ``__all__`` of the submodules in
:data:`ROOTS` export, followed into every module those lists name.  For each exported module, class and
function the walk checks the object's own docstring; for each class also every public
(non-underscore) function, classmethod, staticmethod and property defined on it or on any of its
bases from this package (a private base's public methods are part of the subclass's API).

A docstring counts only when the object wrote it: a class's ``__doc__`` is its own (never
inherited), and the signature line ``dataclasses`` fills in for a class without one
(``"Name(field: type, ...)"``) counts as missing, as does the ``"Name(a, b)"`` line of a
``typing.NamedTuple``.  The test lists every undocumented name in one failure.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import sys
import types

import pytest

PACKAGE = "ninfer_kv"
ROOTS = (
    "ninfer_kv",
    "ninfer_kv.ops",
    "ninfer_kv.ops.codecs",
    "ninfer_kv.planning",
    "ninfer_kv.store",
    "ninfer_kv.store.sharded",
    "ninfer_kv.device",
    "ninfer_kv.device.sharded_ops",
    "ninfer_kv.ops.views",
    "ninfer_kv.schema.layout",
    "ninfer_kv.host",
    "ninfer_kv.schema.errors",
    "ninfer_kv.schema.round_work",
    "ninfer_kv.schema.profiles",
    "ninfer_kv.schema.buckets",
)
"""The root's step-author names and the named submodules that hold the rest of the API."""


def _ours(obj) -> bool:
    return (getattr(obj, "__module__", None) or "").split(".")[0] == PACKAGE


def _auto_doc(cls) -> str | None:
    """The docstring ``dataclasses`` or ``typing.NamedTuple`` generates for an undocumented class."""
    if dataclasses.is_dataclass(cls):
        try:
            return cls.__name__ + str(inspect.signature(cls)).replace(" -> None", "")
        except (TypeError, ValueError):
            return cls.__name__
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        return f"{cls.__name__}({', '.join(cls._fields)})"
    return None


def _has_doc(obj) -> bool:
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    if not isinstance(doc, str) or not doc.strip():
        return False
    return not (inspect.isclass(obj) and doc == _auto_doc(obj))


def _members(cls):
    """``(name, object to check)`` of the public callables and properties ``cls`` defines itself."""
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, property):
            yield name, value.fget if value.fget is not None else value
        elif isinstance(value, (classmethod, staticmethod)):
            yield name, value.__func__
        elif inspect.isfunction(value) or inspect.isclass(value):
            yield name, value
        elif callable(value) and not isinstance(value, enum.Enum) and hasattr(value, "__wrapped__"):
            yield name, value  # a decorated function (functools.wraps, jax.jit)


def public_api(roots=ROOTS) -> tuple[list[str], list[str]]:
    """Walk the public API from the modules ``roots``; returns ``(checked, missing)`` qualified names."""
    seen: set[int] = set()  # objects visited as exported names
    walked: set[int] = set()  # classes whose members were checked
    checked: set[str] = set()
    missing: set[str] = set()

    def note(qualname: str, obj) -> None:
        checked.add(qualname)
        if not _has_doc(obj):
            missing.add(qualname)

    def visit(label: str, obj) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, types.ModuleType):
            if obj.__name__.split(".")[0] != PACKAGE:
                return
            note(obj.__name__, obj)
            for name in getattr(obj, "__all__", ()):
                if not hasattr(obj, name):
                    missing.add(f"{obj.__name__}.{name} (listed in __all__ but not defined)")
                    continue
                visit(f"{obj.__name__}.{name}", getattr(obj, name))
        elif inspect.isclass(obj):
            if not _ours(obj):
                return
            note(f"{obj.__module__}.{obj.__qualname__}", obj)
            for base in obj.__mro__:
                if _ours(base) and id(base) not in walked:
                    walked.add(id(base))
                    for name, member in _members(base):
                        note(f"{base.__module__}.{base.__qualname__}.{name}", member)
        elif callable(obj) and _ours(obj):
            note(f"{obj.__module__}.{getattr(obj, '__qualname__', label)}", obj)

    for root in roots:
        visit(root, importlib.import_module(root))
    return sorted(checked), sorted(missing)


def test_every_public_name_has_a_docstring():
    checked, missing = public_api()
    assert not missing, (
        f"{len(missing)} of {len(checked)} public names have no docstring:\n  " + "\n  ".join(missing)
    )


def test_the_walk_reaches_the_whole_api():
    """The walk follows __all__ into classes, their package bases and the modules __all__ names."""
    checked, _ = public_api()
    for name in (
        "ninfer_kv.ops.codecs.quantize_int8_g64",  # a module named in ninfer_kv.__all__
        "ninfer_kv.ops.paged_attention",
        "ninfer_kv.planning.plan.KVPlan.to_json",  # a method
        "ninfer_kv.planning.plan.KVPlan.device_bytes",  # a property
        "ninfer_kv.schema.kinds.PoolKind.parse",  # a classmethod
        "ninfer_kv.ops.views._LayerViewBase.tree_flatten",  # a public method of a private base
        "ninfer_kv.store.activation.ActivationVerbs.activate",  # a verb of one of the families KVStore unites
    ):
        assert name in checked, f"the walk does not reach {name}"
    assert len(checked) > 300


def test_the_walk_flags_what_lacks_a_docstring(monkeypatch):
    probe = types.ModuleType("ninfer_kv._docstring_probe")
    probe.__doc__ = "A module for this test."
    code = '''
import dataclasses

class _Base:
    def inherited(self):
        pass

@dataclasses.dataclass
class Undocumented(_Base):
    x: int

    def method(self):
        pass

    @property
    def prop(self):
        return 1

    @classmethod
    def cmethod(cls):
        pass

    @staticmethod
    def smethod():
        pass

    def _private(self):
        pass

class Documented:
    """Has one."""

    def method(self):
        """Has one."""

def function():
    pass
'''
    monkeypatch.setitem(sys.modules, probe.__name__, probe)
    exec(compile(code, probe.__name__, "exec"), probe.__dict__)
    probe.__all__ = ["Undocumented", "Documented", "function", "absent"]
    _, missing = public_api((probe.__name__,))
    p = probe.__name__
    assert missing == sorted(
        [
            f"{p}.Undocumented",
            f"{p}.Undocumented.method",
            f"{p}.Undocumented.prop",
            f"{p}.Undocumented.cmethod",
            f"{p}.Undocumented.smethod",
            f"{p}._Base.inherited",
            f"{p}.function",
            f"{p}.absent (listed in __all__ but not defined)",
        ]
    )


if __name__ == "__main__":  # pragma: no cover - a quick listing for maintainers
    sys.exit(pytest.main([__file__, "-q"]))
