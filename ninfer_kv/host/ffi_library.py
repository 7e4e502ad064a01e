"""Finding and loading the ninfer_kv FFI library (``libninfer_kv_ffi``) with ctypes, without JAX.

The library holds the XLA FFI handlers of :mod:`ninfer_kv.ops.ffi` (which registers them with
JAX) and plain C functions the JAX-free parts of the package call directly, such as the
streaming block copy of :mod:`ninfer_kv.host.block_copy`.  It is loaded once, on import of this
module; where it is looked for, and what ``$NINFER_KV_FFI_LIBRARY`` and ``$NINFER_KV_FFI_ISA`` do,
is described in :mod:`ninfer_kv.ops.ffi`.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from importlib import metadata
from pathlib import Path

__all__ = [
    "ABI_VERSION",
    "LIBRARY_NAME",
    "LIBRARY_ENV",
    "REBUILD_HINT",
    "FFIUnavailableError",
    "FFILibraryPathError",
    "Library",
    "LIBRARY",
    "require",
]

ABI_VERSION = 7
"""Version of the handler contract (operands, attributes, semantics) this module speaks."""

_LIB_NAMES = {"darwin": "libninfer_kv_ffi.dylib", "win32": "ninfer_kv_ffi.dll"}
LIBRARY_NAME = _LIB_NAMES.get(sys.platform, "libninfer_kv_ffi.so")

REBUILD_HINT = (
    "build it with `pip install -e .` (development) or `pip install .` from the repository root "
    "(needs CMake >= 3.18, a C++17 compiler and jaxlib); set NINFER_KV_FFI_LIBRARY to use a library "
    "built elsewhere"
)

LIBRARY_ENV = "NINFER_KV_FFI_LIBRARY"
"""Environment variable naming the library file to load instead of looking for one."""


class FFIUnavailableError(RuntimeError):
    """The ninfer_kv XLA FFI library is not built or could not be loaded."""


class FFILibraryPathError(FFIUnavailableError):
    """``$NINFER_KV_FFI_LIBRARY`` names a file that is missing or is not a loadable, current
    ninfer_kv FFI library (raised on first use; nothing is loaded in its place)."""


# -- loading ---------------------------------------------------------------------------------------


def _explicit_path() -> Path | None:
    """The path ``$NINFER_KV_FFI_LIBRARY`` names, or ``None`` when it is unset or empty."""
    env = os.environ.get(LIBRARY_ENV)
    return Path(env) if env else None


def _explicit_path_message(path: Path, reason: str) -> str:
    shown = str(path) if path.is_absolute() else f"{path} (resolved: {Path.cwd() / path})"
    return (
        f"{LIBRARY_ENV}={shown}: {reason}; unset {LIBRARY_ENV} to use the library installed with "
        f"ninfer_kv, or point it at a built {LIBRARY_NAME} (`pip install .` from the repository root builds "
        f"one under build/<tag>/ffi/)"
    )


def _candidates() -> list[Path]:
    """Library paths to try, in order (see the module docstring)."""
    explicit = _explicit_path()
    if explicit is not None:
        return [explicit]
    out: list[Path] = []
    here = Path(__file__).resolve().parents[1]  # the ninfer_kv package
    out.append(here / "_lib" / LIBRARY_NAME)
    try:
        dist = metadata.distribution("ninfer_kv")
        for f in dist.files or ():
            if f.name == LIBRARY_NAME:
                out.append(Path(dist.locate_file(f)).resolve())
    except metadata.PackageNotFoundError:
        pass
    repo = here.parent
    builds = glob.glob(str(repo / "build" / "*" / "ffi" / LIBRARY_NAME))
    out.extend(sorted((Path(p) for p in builds), key=lambda p: p.stat().st_mtime, reverse=True))
    seen, unique = set(), []
    for p in out:
        key = str(p)
        if key not in seen:
            seen.add(key)
            unique.append(p)
    return unique


class Library:
    """The loaded library, or why none loaded (state of the process, set once on import)."""

    def __init__(self):
        self.lib: ctypes.CDLL | None = None
        self.path: Path | None = None
        self.error: str | None = None
        self.path_error: str | None = None  # $NINFER_KV_FFI_LIBRARY names a file that did not load
        self.forced_isa: str = ""

    def load(self) -> None:
        reasons = []
        explicit = _explicit_path()
        for path in _candidates():
            reason = self._open(path)
            if reason is None:
                break
            if path == explicit:  # an explicit choice: report it, load nothing else
                self.path_error = self.error = _explicit_path_message(path, reason)
                return
            reasons.append(f"{path}: {reason}")
        if self.lib is None:
            tried = "; ".join(reasons) if reasons else "no candidate paths"
            self.error = f"the ninfer_kv FFI library ({LIBRARY_NAME}) did not load [{tried}]; {REBUILD_HINT}"
            return
        for name in ("NinferKvFfiIsa", "NinferKvFfiIsaError", "NinferKvFfiIsaCompiled", "NinferKvFfiIsaSupported",
                     "NinferKvFfiCpuFeatures"):
            getattr(self.lib, name).restype = ctypes.c_char_p
        self.forced_isa = os.environ.get("NINFER_KV_FFI_ISA", "")  # what the library reads on first use
        isa_error = self.lib.NinferKvFfiIsaError().decode()
        if isa_error:
            self.lib = None
            self.error = f"the ninfer_kv FFI library at {self.path} cannot run: {isa_error}"
            return
        copy = self.lib.NinferKvFfiCopyBlocks
        copy.restype = ctypes.c_int32
        copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32] + [ctypes.c_void_p] * 4 + [
            ctypes.c_int64, ctypes.c_int32]

    def _open(self, path: Path) -> str | None:
        """Load ``path`` as this library; ``None`` on success, else why it was not used."""
        if not path.exists():
            return "not found"
        if not path.is_file():
            return "not a file"
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            return f"not a loadable shared library ({e})"
        try:
            lib.NinferKvFfiAbiVersion.restype = ctypes.c_int
            version = int(lib.NinferKvFfiAbiVersion())
        except AttributeError as e:
            return f"not the ninfer_kv FFI library ({e})"
        if version != ABI_VERSION:
            return f"built for handler version {version}, this module needs {ABI_VERSION} (stale build)"
        self.lib, self.path = lib, path
        return None


LIBRARY = Library()
LIBRARY.load()


def require(library: Library | None = None) -> ctypes.CDLL:
    """The loaded library (``LIBRARY`` by default); raises :class:`FFILibraryPathError` for a bad
    ``$NINFER_KV_FFI_LIBRARY`` and :class:`FFIUnavailableError` when none loaded."""
    library = LIBRARY if library is None else library
    if library.path_error is not None:
        raise FFILibraryPathError(library.path_error)
    if library.lib is None:
        raise FFIUnavailableError(library.error or "the ninfer_kv FFI library is unavailable")
    return library.lib
