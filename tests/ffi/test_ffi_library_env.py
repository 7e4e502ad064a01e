"""``NINFER_KV_FFI_LIBRARY`` is an explicit choice: a path that does not load is an error naming it,
never a silent switch to another library or (``impl="auto"``) to the reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from ninfer_kv.host import ffi_library
from ninfer_kv.ops.ffi import handlers as ffi_handlers
from ninfer_kv.ops import dispatch
from ninfer_kv.ops import registry
from ninfer_kv.ops.views import allocate_planes

REPO = Path(__file__).resolve().parents[2]

_PROBE = textwrap.dedent(
    """
    import json, warnings
    warnings.simplefilter("error")  # a fallback warning would be an error
    import jax.numpy as jnp, numpy as np
    import ninfer_kv.host.ffi_library as lib
    import ninfer_kv.ops.ffi.handlers as f
    from ninfer_kv import PagedKVBatchLayerView, PagedKVStorageLayout, ops
    from ninfer_kv.ops.views import allocate_planes

    def attempt(fn):
        try:
            return {"ok": fn()}
        except Exception as e:  # what was raised, reported to the test
            return {"error": type(e).__name__, "message": str(e), "ffi_error": isinstance(e, lib.FFIUnavailableError)}

    lay = PagedKVStorageLayout("bf16", 1, 1, 64)
    view = PagedKVBatchLayerView(allocate_planes(lay, 2), jnp.zeros((1, 2), jnp.int32), 0, lay)
    one = jnp.ones(1, jnp.int32)
    q = jnp.ones((1, 1, 2, 64), jnp.float32)
    print(json.dumps({
        "load_error": f.load_error(),
        "is_available": attempt(f.is_available),
        "library_path": f.library_path(),
        "auto": attempt(lambda: ops.resolve_impl("auto", platform="cpu").name),
        "ffi": attempt(lambda: ops.resolve_impl("ffi").name),
        "op": attempt(lambda: float(np.asarray(ops.paged_attention(q, view, jnp.zeros(1, jnp.int32), one - 1, one)).sum())),
    }))
    """
)


def _probe(library: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != ffi_library.LIBRARY_ENV}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if library is not None:
        env[ffi_library.LIBRARY_ENV] = library
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _assert_refused(res: dict, path: str, why: str) -> None:
    assert res["library_path"] is None  # nothing else was loaded in its place
    assert path in res["load_error"] and why in res["load_error"]
    for what in ("is_available", "auto", "ffi", "op"):  # auto does not fall back to the reference
        got = res[what]
        assert got.get("error") == "FFILibraryPathError" and got["ffi_error"], (what, got)
        assert path in got["message"] and why in got["message"], (what, got)
        assert f"unset {ffi_library.LIBRARY_ENV}" in got["message"] and ffi_library.LIBRARY_NAME in got["message"]


def test_missing_path_is_an_error_naming_it(tmp_path):
    missing = str(tmp_path / "nowhere" / ffi_library.LIBRARY_NAME)
    _assert_refused(_probe(missing), missing, "not found")


def test_file_that_is_not_a_library_is_an_error_naming_it(tmp_path):
    text = tmp_path / ffi_library.LIBRARY_NAME
    text.write_text("not a shared library\n")
    _assert_refused(_probe(str(text)), str(text), "not a loadable shared library")


@pytest.mark.skipif(not ffi_handlers.is_available(), reason=f"FFI library unavailable: {ffi_handlers.load_error()}")
def test_good_path_is_used():
    good = ffi_handlers.library_path()
    res = _probe(good)
    assert res["load_error"] is None and res["library_path"] == good
    assert res["is_available"] == {"ok": True}
    assert res["auto"] == {"ok": "ffi"} and res["ffi"] == {"ok": "ffi"} and "ok" in res["op"]


def _load_with(monkeypatch, value: str) -> ffi_library.Library:
    monkeypatch.setenv(ffi_library.LIBRARY_ENV, value)
    lib = ffi_library.Library()
    lib.load()
    return lib


def test_every_reason_names_the_path(monkeypatch, tmp_path):
    """In process: a directory, a shared library that is not ours, a relative path (shown resolved)."""
    lib = _load_with(monkeypatch, str(tmp_path))
    assert lib.lib is None and lib.path_error == lib.error and f"={tmp_path}: not a file" in lib.error
    import _ctypes  # an extension module: a loadable shared library without our entry points

    if getattr(_ctypes, "__file__", None):
        lib = _load_with(monkeypatch, _ctypes.__file__)
        assert lib.lib is None and "not the ninfer_kv FFI library" in lib.error and _ctypes.__file__ in lib.error
    monkeypatch.chdir(tmp_path)
    lib = _load_with(monkeypatch, "missing.so")
    assert f"missing.so (resolved: {tmp_path / 'missing.so'}): not found" in lib.error
    # an empty variable is unset: the usual search runs
    monkeypatch.setenv(ffi_library.LIBRARY_ENV, "")
    assert ffi_library._explicit_path() is None and len(ffi_library._candidates()) >= 1


def test_auto_raises_instead_of_falling_back(monkeypatch, tmp_path):
    """impl='auto' on a CPU surfaces the bad path (no ImplFallbackWarning, no reference)."""
    bad = _load_with(monkeypatch, str(tmp_path / "gone.so"))
    monkeypatch.setattr(ffi_handlers, "_LIBRARY", bad)
    with pytest.raises(ffi_library.FFILibraryPathError, match="gone.so: not found"):
        ffi_handlers.is_available()
    assert "gone.so" in ffi_handlers.load_error()  # the diagnostic itself never raises
    with registry.override_impls():  # fresh loads
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(ffi_library.FFILibraryPathError, match=f"unset {ffi_library.LIBRARY_ENV}"):
                registry.resolve_impl("auto", platform="cpu")
            with pytest.raises(ffi_library.FFILibraryPathError):
                registry.resolve_impl("ffi")
        assert registry.resolve_impl("reference").name == "reference"  # an explicit other impl still works
    with pytest.raises(ffi_library.FFILibraryPathError):
        ffi_handlers.info()
