"""The kernel-backend seam: the shared kernel bodies reach Pallas only through the backend object.

* No module of ``pallas_kernels`` other than the Triton backend and its addressing helper imports
  Pallas at all.
* A backend found by name (``pallas_kernels.<name>_backend``) that delegates to the Triton one
  sees every memory access, program id and ``pallas_call`` (the Triton primitives refuse to run
  outside it), and the kernels it builds lower to the same program as the Triton backend's.
"""

import ast
import dataclasses
import re
import sys
import threading
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

import pallas_kernels as pk
from ninfer_kv.layout import PagedKVStorageLayout
from ninfer_kv.views import CyclicKVCacheLayerView, CyclicKVLayout, PagedKVBatchLayerView

PACKAGE = Path(pk.__file__).resolve().parent
B, H, G, D = 2, 2, 4, 64


def _pallas_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
            names += [n.module] + [f"{n.module}.{a.name}" for a in n.names]
    return sorted({m for m in names if m.startswith(("jax.experimental.pallas", "jax._src.pallas"))})


# The Triton backend and its helpers: every module named for Triton (``triton_*.py``), such as the
# 64-bit offset rule of the Triton lowering.
TRITON_MODULES = {p.name for p in PACKAGE.glob("triton_*.py")}


def _imports_of(path: Path, module: str) -> bool:
    tree = ast.parse(path.read_text(), str(path))
    return any(
        isinstance(n, ast.ImportFrom) and n.level == 1 and (n.module == module or any(a.name == module for a in n.names))
        for n in ast.walk(tree)
    )


def test_only_the_triton_modules_import_pallas():
    shared = {p.name: _pallas_imports(p) for p in PACKAGE.glob("*.py") if p.name not in TRITON_MODULES}
    assert {name: mods for name, mods in shared.items() if mods} == {}
    assert _pallas_imports(PACKAGE / "triton_backend.py")  # the control: the walker sees imports
    assert TRITON_MODULES >= {"triton_backend.py", "triton_addressing.py"}
    users = sorted(p.name for p in PACKAGE.glob("*.py") if _imports_of(p, "triton_addressing"))
    assert users == ["triton_backend.py"], f"the Triton addressing helper is used outside the Triton backend: {users}"


_inside = threading.local()


@dataclasses.dataclass(frozen=True)
class _Recording:
    """A backend delegating to the Triton one, counting what the kernel bodies ask of it."""

    name: str = "recording"
    calls: dict = dataclasses.field(default_factory=dict, compare=False)

    def _run(self, method, *args, **kwargs):
        self.calls[method] = self.calls.get(method, 0) + 1
        _inside.depth = getattr(_inside, "depth", 0) + 1
        try:
            return getattr(pk.TRITON, method)(*args, **kwargs)
        finally:
            _inside.depth -= 1

    def program_id(self, axis):
        return self._run("program_id", axis)

    def load(self, ref, **kw):
        return self._run("load", ref, **kw)

    def store(self, ref, value, **kw):
        return self._run("store", ref, value, **kw)

    def load_scalar(self, ref, idx):
        return self._run("load_scalar", ref, idx)

    def check_planes(self, planes, **kw):
        return self._run("check_planes", planes, **kw)

    def pallas_call(self, kernel, **kw):
        return self._run("pallas_call", kernel, **kw)


@pytest.fixture
def recording(monkeypatch):
    """The ``"recording"`` backend, with the Triton primitives refusing calls from outside a backend."""
    backend = _Recording()
    module = types.ModuleType("pallas_kernels.recording_backend")
    module.BACKEND = backend
    monkeypatch.setitem(sys.modules, module.__name__, module)

    def guarded(target, attr):
        original = getattr(target, attr)

        def call(*args, **kwargs):
            assert getattr(_inside, "depth", 0) > 0, f"{attr} called outside the kernel backend"
            return original(*args, **kwargs)

        monkeypatch.setattr(target, attr, call)

    guarded(pl_triton, "load")
    guarded(pl_triton, "store")
    guarded(pl, "program_id")
    guarded(pl, "pallas_call")
    return backend


def _paged_view(profile, order):
    lay = PagedKVStorageLayout(profile, 2, H, D, order)
    planes = {n: jax.ShapeDtypeStruct(s, lay.plane_dtypes()[n]) for n, s in lay.plane_shapes(8).items()}
    return PagedKVBatchLayerView(planes, jax.ShapeDtypeStruct((B + 1, 4), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32),
                                 lay, validate=False)


def _cyclic_view(profile):
    lay = CyclicKVLayout(profile, 2, B + 1, H, D, window=16, slots=32)
    planes = {n: jax.ShapeDtypeStruct(s, lay.plane_dtypes()[n]) for n, s in lay.plane_shapes().items()}
    return CyclicKVCacheLayerView(planes, jax.ShapeDtypeStruct((), jnp.int32), lay, validate=False)


_I32 = jax.ShapeDtypeStruct((B,), jnp.int32)


def _tokens(t, heads, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct((B, t, heads, D), dtype)


def _programs(monkeypatch, backend: str):
    """``(name, lowered CUDA program)`` of every op on ``backend`` (decode with splits, a chunk, appends).

    The program is the StableHLO text with each Triton kernel printed without source locations
    (the serialized kernel carries the Python call stack, which differs between backends).
    """
    from jax._src.pallas.triton import pallas_call_registration as registration

    kernels = []
    original = registration.lowering.lower_jaxpr_to_triton_module

    def capture(*a, **k):
        result = original(*a, **k)
        kernels.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", capture)

    def lower(fn, args):
        kernels.clear()
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert kernels, "no Triton kernel was lowered"
        return "\n".join(kernels) + re.sub(r'ir = "[^"]*"', 'ir = "<kernel>"', text)

    pv, cv = _paged_view("k8v4", "head-major"), _cyclic_view("k8v4")
    cases = [
        ("paged_append", lambda v, r, p, k, n: pk.paged_append(v, r, p, k, k, n, interpret=False,
                                                               config=pk.PagedAppendConfig(backend=backend)),
         (pv, _I32, _I32, _tokens(3, H, jnp.float32), _I32)),
        ("paged_attention", lambda q, v, r, p, n: pk.paged_attention(
            q, v, r, p, n, interpret=False, config=pk.PagedAttentionConfig(k_splits=2, backend=backend)),
         (_tokens(1, H * G), pv, _I32, _I32, _I32)),
        ("paged_attention_chunk", lambda q, v, r, p, n: pk.paged_attention(
            q, v, r, p, n, interpret=False, config=pk.PagedAttentionConfig(block_k=128, backend=backend)),
         (_tokens(8, H * G, jnp.float32), pv, _I32, _I32, _I32)),
        ("cyclic_append", lambda v, r, p, k, n: pk.cyclic_append(v, r, p, k, k, n, interpret=False,
                                                                 config=pk.CyclicAppendConfig(backend=backend)),
         (cv, _I32, _I32, _tokens(3, H), _I32)),
        ("cyclic_attention", lambda q, v, r, p, n: pk.cyclic_attention(
            q, v, r, p, n, interpret=False, config=pk.CyclicAttentionConfig(k_splits=2, backend=backend)),
         (_tokens(1, H * G), cv, _I32, _I32, _I32)),
    ]
    return [(name, lower(fn, args)) for name, fn, args in cases]


def test_a_backend_by_name_sees_every_pallas_operation_and_builds_the_same_kernels(monkeypatch, recording):
    assert pk.kernel_backend("recording") is recording
    assert "recording" not in pk.kernel_backend_names()  # only modules on disk are listed
    got = _programs(monkeypatch, "recording")
    for method in ("program_id", "load", "store", "load_scalar", "check_planes", "pallas_call"):
        assert recording.calls.get(method, 0) > 0, f"the kernels never called {method}: {recording.calls}"
    assert recording.calls["pallas_call"] == len(got)
    _inside.depth = 1  # the Triton backend itself is allowed to call the primitives
    try:
        want = _programs(monkeypatch, "triton")
    finally:
        _inside.depth = 0
    for (name, text), (_, ref) in zip(got, want):
        assert text == ref, f"{name}: the recording backend built another program"


def test_bound_ops_run_on_their_backend(recording):
    paged_append, paged_attention, cyclic_append, cyclic_attention = pk.bound_ops("recording")
    pv = _paged_view("bf16", "page-major")
    fn = lambda q, v, r, p, n: paged_attention(q, v, r, p, n, interpret=False)  # noqa: E731
    jax.jit(fn).trace(_tokens(1, H * G), pv, _I32, _I32, _I32).lower(lowering_platforms=("cuda",))
    assert recording.calls["pallas_call"] == 1
    fn = lambda q, v, r, p, n: paged_attention(q, v, r, p, n, interpret=False,  # noqa: E731
                                                config=pk.PagedAttentionConfig(block_k=128))  # keeps block_k
    jax.jit(fn).trace(_tokens(1, H * G), pv, _I32, _I32, _I32).lower(lowering_platforms=("cuda",))
    assert recording.calls["pallas_call"] == 2
    assert paged_attention.__name__ == "paged_attention_recording"
    with pytest.raises(ValueError, match="no 'absent' implementation of cyclic_append"):
        pk.bound_ops("absent")[2](_cyclic_view("bf16"), _I32, _I32, _tokens(1, H), _tokens(1, H), _I32)
