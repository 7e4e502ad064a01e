"""The FFI library's handlers: its XLA handlers registered for the CPU platform, what it runs on this
machine, and the availability check of the ``"ffi"`` backend.

The ops of :mod:`.kv`, :mod:`.products` and :mod:`.work_ops` call the handlers this module registers.

The library ``libninfer_kv_ffi`` is built by ``pip install .`` / ``pip install -e .`` (CMake, see
``ffi/CMakeLists.txt``) and loaded once, with ctypes, by :mod:`ninfer_kv.host.ffi_library` (which imports no
JAX; this module registers the handlers with JAX when it is imported).  When
``$NINFER_KV_FFI_LIBRARY`` is set (and not empty) it is the only path tried; otherwise the library
is looked for, in order, at:

1. ``ninfer_kv/_lib/`` in the package (a regular install, or a copy placed in the source tree);
2. the ``ninfer_kv/_lib/`` of the installed ``ninfer_kv`` distribution — this is what an editable
   install provides when the source tree shadows it (``PYTHONPATH=<repo>``);
3. the scikit-build build trees ``<repo>/build/*/ffi/`` (newest first).

A candidate built for another version of the handler contract is skipped.  When no library loads,
:func:`is_available` is ``False``, :func:`load_error` says why and how to rebuild, and every op
raises :class:`FFIUnavailableError` with that text.

``$NINFER_KV_FFI_LIBRARY`` is an explicit choice, so no other library stands in for it: when the
file it names is missing, does not load, is not this library or is a stale build, the first use
(:func:`is_available`, :func:`info`, any op; ``impl="auto"`` and ``impl="ffi"`` included) raises
:class:`FFILibraryPathError` naming the path, and ``impl="auto"`` does not fall back to the
reference.  :func:`load_error` returns the same text without raising.

Threads: ``NINFER_KV_FFI_THREADS`` (read when the library first runs) sets the total thread count
(the calling thread included); the default is the number of hardware threads.

Instruction sets: the library holds the kernels compiled for several levels (x86-64: ``baseline``,
``avx2`` = x86-64-v3, ``avx512`` = x86-64-v4, ``avx512vnni`` = x86-64-v4 with AVX512-VNNI and
AVX512-VBMI; aarch64: ``neon``; a ``-march=native`` build: ``native``) and picks the best level this
CPU supports when it loads.  ``NINFER_KV_FFI_ISA`` (read once, on import) forces a level; a level
that is not compiled in or that the CPU cannot run is refused: the library is then unavailable and
:func:`load_error` says why.  :func:`info` reports the level in use, the compiled-in and the
supported levels.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from ...host import ffi_library
from ...host.ffi_library import REBUILD_HINT, FFILibraryPathError, FFIUnavailableError
from ...schema.profiles import KVCodec, KVProfile

__all__ = [
    "is_available",
    "load_error",
    "unavailable_reason",
    "library_path",
    "num_threads",
    "info",
    "FFIInfo",
    "arithmetic",
    "Arithmetic",
    "ARITHMETIC_NAMES",
    "fixed_splits",
    "ABI_VERSION",
    "TARGETS",
]

ABI_VERSION = ffi_library.ABI_VERSION

TARGETS = {
    "ninfer_kv_paged_append": "NinferKvPagedAppend",
    "ninfer_kv_paged_attention": "NinferKvPagedAttention",
    "ninfer_kv_paged_append_ragged": "NinferKvPagedAppendRagged",
    "ninfer_kv_paged_attention_ragged": "NinferKvPagedAttentionRagged",
    "ninfer_kv_paged_attention_variants": "NinferKvPagedAttentionVariants",
    "ninfer_kv_paged_attention_ragged_variants": "NinferKvPagedAttentionRaggedVariants",
    "ninfer_kv_cyclic_append": "NinferKvCyclicAppend",
    "ninfer_kv_cyclic_attention": "NinferKvCyclicAttention",
    "ninfer_kv_matmul_bf16": "NinferKvMatmulBf16",
    "ninfer_kv_matmul_bf16_packed": "NinferKvMatmulBf16Packed",
    "ninfer_kv_apply_tables": "NinferKvApplyTables",
    "ninfer_kv_write_pages": "NinferKvWritePages",
}
"""XLA custom-call target name -> exported handler symbol."""

_CODEC_ID = {codec: codec.spec.ffi_id for codec in KVCodec}  # the codec spec table (CODEC_SPECS)

_LIBRARY = ffi_library.LIBRARY


def _register(library: ffi_library.Library) -> None:
    """Register the handlers of the loaded library for the CPU platform (once, on import); a failure
    makes the library unusable and says why."""
    if library.lib is None:
        return
    try:
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library.lib, symbol)), platform="cpu")
    except Exception as e:  # registration failure makes the library unusable
        library.lib = None
        library.error = f"registering the ninfer_kv FFI targets from {library.path} failed: {e}; {REBUILD_HINT}"


_register(_LIBRARY)


def is_available() -> bool:
    """Whether the FFI library loaded and its targets are registered for the CPU platform.

    Raises :class:`FFILibraryPathError` when ``$NINFER_KV_FFI_LIBRARY`` names a file that did not
    load (the variable is a request for that file, so "unavailable" would hide the mistake).
    """
    if _LIBRARY.path_error is not None:
        raise FFILibraryPathError(_LIBRARY.path_error)
    return _LIBRARY.lib is not None


def load_error() -> str | None:
    """Why the library is unavailable (with rebuild instructions); ``None`` when it loaded.  Never raises."""
    return _LIBRARY.error


def library_path() -> str | None:
    """Path of the loaded library, or ``None``."""
    return None if _LIBRARY.path is None else str(_LIBRARY.path)


def num_threads() -> int:
    """Threads the kernels use (the calling thread included)."""
    lib = _require()
    lib.NinferKvFfiNumThreads.restype = ctypes.c_int
    return int(lib.NinferKvFfiNumThreads())


@dataclass(frozen=True)
class FFIInfo:
    """What the loaded library runs on this machine."""

    isa: str
    """The instruction-set level in use (``baseline``, ``avx2``, ``avx512``, ``avx512vnni``, ``neon`` or
    ``native``)."""
    compiled: tuple[str, ...]
    """Levels compiled into the library, best first."""
    supported: tuple[str, ...]
    """Compiled-in levels this CPU can run, best first (the first is the default)."""
    forced: bool
    """Whether ``NINFER_KV_FFI_ISA`` chose the level."""
    vector_width: int
    """float32 lanes per SIMD vector of the level in use."""
    threads: int
    """Threads the kernels use (the calling thread included)."""
    cpu_features: tuple[str, ...]
    """CPU features the library detected."""
    library: str
    """Path of the loaded library."""

    def summary(self) -> str:
        """One line for logs and benchmark headers."""
        how = "forced by NINFER_KV_FFI_ISA" if self.forced else "auto"
        return (
            f"FFI ISA {self.isa} ({how}; compiled {','.join(self.compiled)}; supported {','.join(self.supported)}), "
            f"{self.vector_width} float lanes, {self.threads} threads"
        )


def info() -> FFIInfo:
    """The instruction-set level in use, the compiled-in and supported levels, lanes and threads.

    Raises :class:`FFIUnavailableError` when the library is unavailable (including a
    ``NINFER_KV_FFI_ISA`` level this CPU cannot run).
    """
    lib = _require()

    def names(fn) -> tuple[str, ...]:
        return tuple(x for x in fn().decode().split(",") if x)

    lib.NinferKvFfiVectorWidth.restype = ctypes.c_int
    forced = _LIBRARY.forced_isa not in ("", "auto")
    return FFIInfo(
        isa=lib.NinferKvFfiIsa().decode(),
        compiled=names(lib.NinferKvFfiIsaCompiled),
        supported=names(lib.NinferKvFfiIsaSupported),
        forced=forced,
        vector_width=int(lib.NinferKvFfiVectorWidth()),
        threads=num_threads(),
        cpu_features=names(lib.NinferKvFfiCpuFeatures),
        library=str(_LIBRARY.path),
    )


ARITHMETIC_NAMES = ("float32", "int8x2")
"""The products an attention kernel may use, by the library's code (``NinferKvFfiArithmetic``):

* ``float32``: float32 multiply-adds (results agree with the float32 reference to rounding);
* ``int8x2``: the query rounded to 15 bits (one scale per query row, ``|q16| <= 16383``) and split
  exactly into two signed bytes, multiplied by the codes as unsigned bytes with ``vpdpbusd``
  (two byte products per multiply-add of ``q . k``), exact int32 sums scaled back per group.
"""


@dataclass(frozen=True)
class Arithmetic:
    """The products the attention kernel of the level in use takes for one profile and head dim."""

    scores: str
    """Products of ``q . k`` (a name of :data:`ARITHMETIC_NAMES`)."""
    values: str
    """Products of ``p . v`` (a name of :data:`ARITHMETIC_NAMES`)."""

    @property
    def reduced(self) -> bool:
        """Whether either product rounds an operand beyond float32 (its results then differ from the
        float32 reference by more than float32 rounding; docs/ACCURACY.md states by how much)."""
        return self.scores != "float32" or self.values != "float32"


def arithmetic(profile: KVProfile | str, head_dim: int) -> Arithmetic:
    """The products the attention kernel of the level in use multiplies with, for ``profile`` at
    ``head_dim`` (runs holding a non-finite scale, and non-finite queries, always take float32).

    Raises :class:`FFIUnavailableError` when the library is unavailable, ``ValueError`` for a head
    dim that is not positive.
    """
    lib = _require()
    prof = KVProfile(profile)
    if head_dim <= 0:
        raise ValueError(f"head_dim must be positive, got {head_dim}")
    fn = lib.NinferKvFfiArithmetic
    fn.restype = ctypes.c_int32
    fn.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_int32]
    code = int(fn(_CODEC_ID[prof.k_codec], _CODEC_ID[prof.v_codec], int(head_dim)))
    if code < 0:
        raise FFIUnavailableError(f"the FFI library reports no arithmetic for {prof.value} at head dim {head_dim}")
    return Arithmetic(ARITHMETIC_NAMES[code & 0xFF], ARITHMETIC_NAMES[(code >> 8) & 0xFF])


def _stream_read(buf: np.ndarray, threads: int = 0) -> int:
    """Reads a contiguous host array once in ``threads`` slices on the kernel threads (0: one slice
    per thread, 1: the calling thread alone); returns a checksum.

    The read-only streaming counterpart of a memory copy, for the bandwidth figures of
    ``bench/bench_ffi.py``.
    """
    lib = _require()
    buf = np.ascontiguousarray(buf)
    lib.NinferKvFfiStreamRead.restype = ctypes.c_uint64
    lib.NinferKvFfiStreamRead.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32]
    return int(lib.NinferKvFfiStreamRead(buf.ctypes.data, buf.nbytes, threads))


_NO_SPLITS: contextvars.ContextVar[bool] = contextvars.ContextVar("ninfer_kv_ffi_no_splits", default=False)


@contextlib.contextmanager
def fixed_splits():
    """Attention traced inside the block splits no context: each (row, KV head, query block) is one
    task of one thread whatever the batch, so a row's output depends on that row alone (the
    batch-invariant steps use it); it costs parallelism only while the batch has fewer row x head
    tasks than the library has threads.  Read when the attention is traced: a jitted function traced
    outside the block keeps its adaptive splits."""
    token = _NO_SPLITS.set(True)
    try:
        yield
    finally:
        _NO_SPLITS.reset(token)


def _require() -> ctypes.CDLL:
    return ffi_library.require(_LIBRARY)


def _i32(x) -> jax.Array:
    return jnp.asarray(x, jnp.int32)


def unavailable_reason() -> str | None:
    """Why the ``"ffi"`` backend of :mod:`ninfer_kv.ops` cannot run here; ``None`` when it can.

    The registry's availability check.  Raises :class:`FFILibraryPathError` like
    :func:`is_available`: a bad ``$NINFER_KV_FFI_LIBRARY`` is an error, not a reason to fall back.
    """
    if is_available():
        return None
    return f"the XLA FFI library did not load ({load_error()})"
