"""The native library loads (source tree and installed package) and reports clearly when it cannot."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv.host import ffi_library
from ninfer_kv.ops.ffi import kv as ffi_kv
from ninfer_kv.ops.ffi import handlers as ffi_handlers

REPO = Path(__file__).resolve().parents[2]


def test_library_is_built_and_loaded():
    assert ffi_handlers.is_available(), ffi_handlers.load_error()
    assert ffi_handlers.load_error() is None
    path = Path(ffi_handlers.library_path())
    assert path.is_file() and path.name == ffi_library.LIBRARY_NAME
    lib = ctypes.CDLL(str(path))
    assert lib.NinferKvFfiAbiVersion() == ffi_handlers.ABI_VERSION
    assert lib.NinferKvFfiVectorWidth() in (8, 16)
    assert ffi_handlers.num_threads() >= 1


def test_missing_library_gives_rebuild_instructions(monkeypatch, tmp_path):
    lib = ffi_library.Library()
    monkeypatch.setattr(ffi_library, "_candidates", lambda: [tmp_path / ffi_library.LIBRARY_NAME])
    lib.load()
    assert lib.lib is None
    assert "pip install -e ." in lib.error and "pip install ." in lib.error
    assert str(tmp_path) in lib.error
    monkeypatch.setattr(ffi_handlers, "_LIBRARY", lib)
    assert not ffi_handlers.is_available()
    assert ffi_handlers.load_error() == lib.error
    with pytest.raises(ffi_library.FFIUnavailableError, match="pip install -e"):
        ffi_kv.paged_attention(jnp.zeros((1, 1, 1, 64)), None, None, None, None)


def test_a_library_that_is_not_ours_is_skipped(monkeypatch, tmp_path):
    """A shared library at a candidate path without the ABI entry point is reported, not used."""
    import _ctypes  # an extension module: a loadable shared library that is not ours

    if not getattr(_ctypes, "__file__", None):
        pytest.skip("_ctypes is built into this interpreter")
    fake = tmp_path / ffi_library.LIBRARY_NAME
    fake.symlink_to(_ctypes.__file__)
    lib = ffi_library.Library()
    monkeypatch.setattr(ffi_library, "_candidates", lambda: [fake])
    lib.load()
    assert lib.lib is None and "NinferKvFfiAbiVersion" in lib.error


def _import_in_subprocess(cwd: Path, pythonpath: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NINFER_KV_FFI_LIBRARY")}
    env["JAX_PLATFORMS"] = "cpu"
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    code = "import ninfer_kv.ops.ffi.handlers as f; print(f.is_available(), f.library_path(), f.load_error())"
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def _installed() -> bool:
    try:
        metadata.distribution("ninfer_kv")
    except metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _installed(), reason="ninfer_kv is not installed in this environment (pip install -e .)")
def test_installed_package_loads_the_library_from_another_directory(tmp_path):
    res = _import_in_subprocess(tmp_path, None)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("True "), res.stdout + res.stderr


@pytest.mark.skipif(not _installed(), reason="ninfer_kv is not installed in this environment (pip install -e .)")
def test_source_tree_on_pythonpath_still_finds_the_library():
    res = _import_in_subprocess(REPO, str(REPO))
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("True "), res.stdout + res.stderr


@pytest.mark.parametrize("words", [0, 1, 7, 31, 32, 33, 1000, 4099])
@pytest.mark.parametrize("threads", [0, 1, 3])
def test_the_read_probe_sums_every_word_once(words, threads):
    """The read-bandwidth probe of bench/machine.py reads every word exactly once, whatever the split."""
    if not ffi_handlers.is_available():
        pytest.skip(ffi_handlers.load_error())
    rng = np.random.default_rng(words)
    buf = rng.integers(0, 2**63, size=words, dtype=np.uint64)
    assert ffi_handlers._stream_read(buf, threads) == int(buf.sum(dtype=np.uint64))  # both wrap modulo 2**64
