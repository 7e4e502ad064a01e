"""C++ XLA FFI CPU kernels of the paged and cyclic ops.

The four ops have the signatures and semantics of :mod:`ninfer_kv.ops.reference`; inputs are
validated by :mod:`ninfer_kv.ops` before they get here.  They run as typed XLA FFI custom calls on
the CPU platform:

* ``paged_append`` / ``cyclic_append`` quantize with codes bit-identical to :mod:`ninfer_kv.codecs`
  and write in place: every plane operand is aliased to its result (``input_output_aliases``), so
  a ``jax.jit`` caller that donates the planes gets no copy of them.
* ``paged_attention`` / ``cyclic_attention`` run a single-pass online softmax in float32 over the
  pages (or ring slots) each query sees, dequantizing page by page, with the work split over
  (batch row, KV head[, query block][, context split]) on a persistent thread pool.  They never
  read a page outside a row's visible range.  Their products are float32, except the scores of
  NVFP4 keys at the ``avx512vnni`` level, which multiply the query rounded to 15 bits with the
  key codes in integers (:func:`arithmetic` reports the products per profile; docs/ACCURACY.md
  measures what they add).

The library ``libninfer_kv_ffi`` is built by ``pip install .`` / ``pip install -e .`` (CMake, see
``ffi/CMakeLists.txt``) and loaded once, with ctypes, by :mod:`ninfer_kv.ffi_library` (which imports no
JAX; this module registers the handlers with JAX when it is imported).  When
``$NINFER_KV_FFI_LIBRARY`` is set (and not empty) it is the only path tried; otherwise the library
is looked for, in order, at:

1. ``ninfer_kv/_lib/`` beside this file (a regular install, or a copy placed in the source tree);
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

``jax.vmap`` over an op uses ``vmap_method="sequential"``: one custom call per mapped element.
The kernels are already batched over B, so vmap is a convenience, and "sequential" keeps two
properties the other methods lose: operands that are not mapped (the planes, above all) are
passed as they are instead of being broadcast to the mapped size, and an append mapped over
planes updates each element's planes separately.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
from dataclasses import dataclass
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import ffi_library
from .ffi_library import REBUILD_HINT, FFILibraryPathError, FFIUnavailableError
from .geometry import PlaneOrder
from .layout import word_dtype
from .packed_weight import PackedWeight
from .profiles import KVCodec, KVProfile
from .views import CyclicKVCacheLayerView, PagedKVBatchLayerView

__all__ = [
    "paged_append",
    "paged_attention",
    "paged_append_ragged",
    "paged_attention_ragged",
    "cyclic_append",
    "cyclic_attention",
    "matmul_bf16",
    "matmul_bf16_many",
    "matmul_bf16_packed",
    "matmul_bf16_packed_many",
    "PACKED_KERNELS",
    "packed_kernel",
    "packed_amx_status",
    "packed_amx_reference",
    "fixed_splits",
    "apply_tables",
    "write_pages",
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
    "ABI_VERSION",
    "TARGETS",
]

ABI_VERSION = ffi_library.ABI_VERSION

TARGETS = {
    "ninfer_kv_paged_append": "NinferKvPagedAppend",
    "ninfer_kv_paged_attention": "NinferKvPagedAttention",
    "ninfer_kv_paged_append_ragged": "NinferKvPagedAppendRagged",
    "ninfer_kv_paged_attention_ragged": "NinferKvPagedAttentionRagged",
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


# -- operand preparation ---------------------------------------------------------------------------


def _codec_attrs(profile: KVProfile) -> dict:
    return {"k_codec": np.int32(_CODEC_ID[profile.k_codec]), "v_codec": np.int32(_CODEC_ID[profile.v_codec])}


def _plane_list(planes: dict, profile: KVProfile) -> list:
    """Planes in schema order (k, [k_scale], v, [v_scale]): the handlers' operand order."""
    return [planes[name] for name in profile.plane_names()]


def _i32(x) -> jax.Array:
    return jnp.asarray(x, jnp.int32)


def _layer(layer) -> jax.Array:
    return jnp.asarray(layer, jnp.int32).reshape(())


def _kv_inputs(k, v) -> tuple[jax.Array, jax.Array]:
    """k and v as one dtype the kernels read: both bfloat16, or both float32 (exact widening)."""
    k, v = jnp.asarray(k), jnp.asarray(v)
    if k.dtype == jnp.bfloat16 and v.dtype == jnp.bfloat16:
        return k, v
    return k.astype(jnp.float32), v.astype(jnp.float32)


def _query(q) -> jax.Array:
    q = jnp.asarray(q)
    return q if q.dtype in (jnp.float32, jnp.bfloat16) else q.astype(jnp.float32)


def _sm_scale(sm_scale, head_dim: int) -> np.float32:
    return np.float32((1.0 / head_dim**0.5) if sm_scale is None else sm_scale)


def _append_call(target: str, planes: list, n_fixed: int):
    return jax.ffi.ffi_call(
        target,
        tuple(jax.ShapeDtypeStruct(p.shape, p.dtype) for p in planes),
        input_output_aliases={n_fixed + i: i for i in range(len(planes))},
        vmap_method="sequential",
    )


# -- ops -------------------------------------------------------------------------------------------


def _paged_attention_call(target: str, q_in: jax.Array, view: PagedKVBatchLayerView, vectors, sm_scale):
    """One paged attention handler: q, the tables, the layer, the int32 ``vectors``, the planes."""
    lay = view.layout
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q_in.shape, q_in.dtype), vmap_method="sequential")
    return call(
        q_in,
        _i32(view.block_tables),
        _layer(view.layer),
        *(_i32(x) for x in vectors),
        *_plane_list(view.planes, lay.profile),
        head_major=np.int32(lay.order is PlaneOrder.HEAD_MAJOR),
        sm_scale=_sm_scale(sm_scale, q_in.shape[-1]),
        no_splits=np.int32(_NO_SPLITS.get()),
        **_codec_attrs(lay.profile),
    )


def _paged_append_call(target: str, view: PagedKVBatchLayerView, vectors, k, v) -> PagedKVBatchLayerView:
    """One paged append handler: the tables, the layer, the int32 ``vectors``, k, v, the planes (aliased)."""
    lay = view.layout
    planes = _plane_list(view.planes, lay.profile)
    kk, vv = _kv_inputs(k, v)
    call = _append_call(target, planes, n_fixed=4 + len(vectors))
    out = call(
        _i32(view.block_tables),
        _layer(view.layer),
        *(_i32(x) for x in vectors),
        kk,
        vv,
        *planes,
        head_major=np.int32(lay.order is PlaneOrder.HEAD_MAJOR),
        **_codec_attrs(lay.profile),
    )
    return view.replace(planes=dict(zip(lay.profile.plane_names(), out)))


def paged_append(
    view: PagedKVBatchLayerView, table_rows, positions, k, v, valid
) -> PagedKVBatchLayerView:
    """Quantize ``k, v (B, T, H, D)`` and write tokens ``t < valid[b]`` at ``positions[b] + t``.

    Returns the view with the updated planes; the planes are written in place when the caller's
    ``jax.jit`` donates them (otherwise XLA copies them first).
    """
    _require()
    return _paged_append_call("ninfer_kv_paged_append", view, (table_rows, positions, valid), k, v)


def paged_attention(q, view: PagedKVBatchLayerView, table_rows, positions, kv_lens, *, sm_scale=None) -> jax.Array:
    """Causal GQA attention of ``q (B, T, Hq, D)`` over the paged view; ``(B, T, Hq, D)`` in q's dtype.

    ``sm_scale`` (default ``1 / sqrt(D)``) is a static Python number: it becomes an attribute of the
    custom call.
    """
    _require()
    out = _paged_attention_call("ninfer_kv_paged_attention", _query(q), view, (table_rows, positions, kv_lens),
                                sm_scale)
    return out.astype(jnp.asarray(q).dtype)


def paged_append_ragged(view: PagedKVBatchLayerView, table_rows, positions, k, v, query_starts) -> PagedKVBatchLayerView:
    """:func:`paged_append` of a ragged batch: ``k, v (N, H, D)`` hold the tokens of ``R`` rows one
    after another, row ``r`` tokens ``[query_starts[r], query_starts[r + 1])`` (``ninfer_kv.ops``
    has the rules); one pass over the tokens, no padding to a rectangle."""
    _require()
    k, v = jnp.asarray(k), jnp.asarray(v)
    return _paged_append_call("ninfer_kv_paged_append_ragged", view, (table_rows, positions, query_starts),
                              k[None], v[None])


def paged_attention_ragged(q, view: PagedKVBatchLayerView, table_rows, positions, kv_lens, query_starts, *,
                           sm_scale=None) -> jax.Array:
    """:func:`paged_attention` of a ragged batch: ``q (N, Hq, D)`` holds the queries of ``R`` rows one
    after another (see :func:`paged_append_ragged`); ``(N, Hq, D)`` in q's dtype, zeros for tokens
    of no row.  Each row's queries are blocked as the rectangular form blocks a row of that length."""
    _require()
    out = _paged_attention_call("ninfer_kv_paged_attention_ragged", _query(q)[None], view,
                                (table_rows, positions, kv_lens, query_starts), sm_scale)
    return out[0].astype(jnp.asarray(q).dtype)


def cyclic_append(view: CyclicKVCacheLayerView, rows, positions, k, v, valid) -> CyclicKVCacheLayerView:
    """Write tokens ``t < valid[b]`` of row ``rows[b]`` at ring slots ``(positions[b] + t) mod slots``."""
    _require()
    lay = view.layout
    planes = _plane_list(view.planes, lay.profile)
    kk, vv = _kv_inputs(k, v)
    call = _append_call("ninfer_kv_cyclic_append", planes, n_fixed=6)
    out = call(
        _i32(rows),
        _i32(positions),
        _i32(valid),
        _layer(view.layer),
        kk,
        vv,
        *planes,
        **_codec_attrs(lay.profile),
    )
    return view.replace(planes=dict(zip(lay.profile.plane_names(), out)))


def cyclic_attention(q, view: CyclicKVCacheLayerView, rows, positions, kv_lens, *, sm_scale=None) -> jax.Array:
    """Windowed GQA attention over ring buffers; ``(B, T, Hq, D)`` in q's dtype (static ``sm_scale``)."""
    _require()
    lay = view.layout
    q_in = _query(q)
    call = jax.ffi.ffi_call(
        "ninfer_kv_cyclic_attention", jax.ShapeDtypeStruct(q_in.shape, q_in.dtype), vmap_method="sequential"
    )
    out = call(
        q_in,
        _i32(rows),
        _i32(positions),
        _i32(kv_lens),
        _layer(view.layer),
        *_plane_list(view.planes, lay.profile),
        window=np.int32(lay.window),
        sm_scale=_sm_scale(sm_scale, q_in.shape[-1]),
        no_splits=np.int32(_NO_SPLITS.get()),
        **_codec_attrs(lay.profile),
    )
    return out.astype(jnp.asarray(q).dtype)


# -- the model's weight products ---------------------------------------------------------------------


def matmul_bf16(x, w) -> jax.Array:
    """``x @ w.T`` in float32 for bfloat16 ``x (..., K)`` and ``w (N, K)`` (an ``nn.Linear`` weight).

    Each output element is one fixed sequence of float32 operations over its row of ``x`` and of
    ``w`` (16 lanes over K in chunks of 32, then a fixed reduction tree; ``ffi/src/matmul.cc``), so a
    row's result never depends on the other rows, on their number or on the thread split, and it is
    the same at every instruction-set level (a product of two bfloat16 values is exact in float32).
    One row of ``x`` streams each weight once, front to back: a decode step's products at memory
    speed.

    Raises ``ValueError`` naming the operand for a dtype other than bfloat16 or mismatched K.
    """
    return matmul_bf16_many(x, (w,))[0]


def matmul_bf16_many(x, weights) -> tuple[jax.Array, ...]:
    """:func:`matmul_bf16` of one ``x`` with each of ``weights`` (the same K), in one call: ``x`` is
    prepared once and the weights stream one after another (q, k and v; gate and up).  The results
    are bit-identical to one :func:`matmul_bf16` per weight."""
    _require()
    x = jnp.asarray(x)
    weights = tuple(jnp.asarray(w) for w in weights)
    if not weights:
        raise ValueError("matmul_bf16: at least one weight is needed")
    for name, a in (("x", x),) + tuple((f"w[{i}]", w) for i, w in enumerate(weights)):
        if a.dtype != jnp.bfloat16:
            raise ValueError(f"matmul_bf16: {name} must be bfloat16, got {a.dtype}")
    for i, w in enumerate(weights):
        if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[1]:
            raise ValueError(f"matmul_bf16: x {x.shape} and w[{i}] {w.shape} are not (..., K) and (N, K)")
    lead = x.shape[:-1]
    rows = int(np.prod(lead, dtype=np.int64))
    outs = jax.ffi.ffi_call("ninfer_kv_matmul_bf16",
                            tuple(jax.ShapeDtypeStruct((rows, w.shape[0]), jnp.float32) for w in weights),
                            vmap_method="sequential")(x.reshape(rows, x.shape[-1]), *weights)
    return tuple(o.reshape(*lead, w.shape[0]) for o, w in zip(outs, weights))


PACKED_KERNELS = ("amx-chunks", "amx-pairs", "vdpbf16ps", "fma")
"""The forms of :func:`matmul_bf16_packed`, by :func:`packed_kernel`:

* ``amx-chunks``, ``amx-pairs``: AMX tiles (TDPBF16PS, CPUs with AMX-BF16), in that order of
  ``ffi/src/packed_order.h`` (which one the CPU computes is checked once per process, bit for bit,
  before AMX is used; neither matching means no AMX);
* ``vdpbf16ps``: AVX512_BF16's pair products, in the pairs order;
* ``fma``: float32 FMAs emulating VDPBF16PS bit for bit (every other CPU, or
  ``$NINFER_KV_FFI_BF16=0``).
"""


def packed_kernel() -> str:
    """The form :func:`matmul_bf16_packed` runs here, one of :data:`PACKED_KERNELS`.  The AMX forms
    give other bits than the other two (their own order); each form is batch invariant on its own.
    ``$NINFER_KV_FFI_AMX=0`` keeps the machine off AMX, ``$NINFER_KV_FFI_BF16=0`` off every BF16
    instruction (both read once per process)."""
    lib = _require()
    lib.NinferKvFfiPackedKernel.restype = ctypes.c_char_p
    return lib.NinferKvFfiPackedKernel().decode()


def packed_amx_status() -> str:
    """Why :func:`matmul_bf16_packed` does not use AMX here (``""`` when it does): no AMX-BF16,
    ``$NINFER_KV_FFI_AMX=0``, the OS refused the tile state, or the hardware matched neither AMX
    order (the first differing element named)."""
    lib = _require()
    lib.NinferKvFfiPackedAmxStatus.restype = ctypes.c_char_p
    return lib.NinferKvFfiPackedAmxStatus().decode()


def packed_amx_reference(x: np.ndarray, w: np.ndarray, order: str) -> np.ndarray:
    """The AMX forms' definition in the library's scalar code (what the once-per-process check holds
    the hardware to): ``x (M, K) @ w (N, K).T`` in float32 for bfloat16 numpy arrays, in ``order``
    ``"amx-chunks"`` or ``"amx-pairs"``.  Runs on every CPU (for tests and comparisons).

    Raises ``ValueError`` naming a bad order, dtype or shape.
    """
    lib = _require()
    orders = PACKED_KERNELS[:2]  # the AMX forms, by their order
    if order not in orders:
        raise ValueError(f"packed_amx_reference: order must be one of {orders}, got {order!r}")
    x, w = np.ascontiguousarray(x), np.ascontiguousarray(w)
    for name, a in (("x", x), ("w", w)):
        if a.dtype != jnp.bfloat16 or a.ndim != 2:
            raise ValueError(f"packed_amx_reference: {name} must be a bfloat16 matrix, got {a.dtype} {a.shape}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"packed_amx_reference: x {x.shape} and w {w.shape} are not (M, K) and (N, K)")
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    fn = lib.NinferKvFfiPackedAmxReference
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int32]
    rc = fn(x.ctypes.data, w.ctypes.data, out.ctypes.data, x.shape[0], w.shape[0], x.shape[1], orders.index(order))
    if rc != 0:
        raise ValueError(f"packed_amx_reference: the library refused x {x.shape}, w {w.shape}")
    return out


def matmul_bf16_packed(x, packed: PackedWeight, out_dtype=jnp.float32) -> jax.Array:
    """``x @ w.T`` in float32 for bfloat16 ``x (..., K)`` and a weight packed once by
    :func:`pack_bf16_weight` (``ffi/src/gemm_packed.cc``); with ``out_dtype=jnp.bfloat16`` the
    float32 result rounded once to bfloat16 (to nearest even) as the kernel writes it: the bits of
    ``.astype(jnp.bfloat16)`` on the float32 result (every NaN the canonical ``0x7FC0``), without
    the float32 array.

    Output ``(m, n)`` is one fixed sequence over the pairs of K: for p = 0, 1, ... a fused
    multiply-add of the odd elements ``x[m, 2p+1] * w[n, 2p+1]``, then of the even ones, from +0,
    denormal inputs read as zero and tiny results flushed to zero (VDPBF16PS's arithmetic, which
    the levels without it emulate bit for bit).  On a CPU with AMX-BF16 the products run on AMX
    tiles in TDPBF16PS's own order instead (:func:`packed_kernel` says which form and order).  So a
    row's result never depends on the other rows, their number or the thread split (batch
    invariance), nor, off AMX, on the instruction-set level; the weight tiles are reused across
    rows: several times the row kernel's (:func:`matmul_bf16`) speed from 8 rows on, and the same
    stream at one row.

    Raises ``ValueError`` naming the operand for a dtype other than bfloat16, a weight that is not
    a :class:`PackedWeight`, a K that differs from the weight's or an ``out_dtype`` other than
    float32 and bfloat16.
    """
    return matmul_bf16_packed_many(x, (packed,), out_dtype)[0]


def matmul_bf16_packed_many(x, weights: Sequence[PackedWeight], out_dtype=jnp.float32) -> tuple[jax.Array, ...]:
    """:func:`matmul_bf16_packed` of one ``x`` with each of ``weights`` (the same K) in one call
    (q, k and v; gate and up), every result in ``out_dtype``; bit-identical to one call per weight."""
    _require()
    x = jnp.asarray(x)
    weights = tuple(weights)
    out_dtype = np.dtype(out_dtype)
    if out_dtype not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16)):
        raise ValueError(f"matmul_bf16_packed: out_dtype must be float32 or bfloat16, got {out_dtype}")
    if not weights:
        raise ValueError("matmul_bf16_packed: at least one weight is needed")
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"matmul_bf16_packed: x must be bfloat16, got {x.dtype}")
    for i, w in enumerate(weights):
        if not isinstance(w, PackedWeight):
            raise ValueError(f"matmul_bf16_packed: w[{i}] must be a PackedWeight (pack_bf16_weight), got "
                             f"{type(w).__name__}")
        if x.ndim < 1 or x.shape[-1] != w.k:
            raise ValueError(f"matmul_bf16_packed: x {x.shape} and w[{i}] (N={w.n}, K={w.k}) are not (..., K) "
                             f"and (N, K)")
    lead = x.shape[:-1]
    rows = int(np.prod(lead, dtype=np.int64))
    outs = jax.ffi.ffi_call("ninfer_kv_matmul_bf16_packed",
                            tuple(jax.ShapeDtypeStruct((rows, w.n), out_dtype) for w in weights),
                            vmap_method="sequential")(x.reshape(rows, x.shape[-1]), *(w.data for w in weights))
    return tuple(o.reshape(*lead, w.n) for o, w in zip(outs, weights))


# -- round work (the CPU lowering of ninfer_kv.device.work.apply_work) ------------------------------


def apply_tables(sync, stamp, tables: Sequence, updates: Sequence) -> tuple[jax.Array, list[jax.Array]]:
    """One round work's block-table updates and order check, in place (CPU).

    ``sync``: the state's ``int32 (5,)`` order record; ``stamp``: the work's ``int32 (2,)``
    ``(serial, store)``; ``tables[i]``: ``int32 (C, L)`` block tables (donate them: they are the
    results' buffers); ``updates[i]``: ``int32 (3, U)`` ``(row, block, page)`` entries (an index
    outside its range, after one wrap of a negative one, is dropped).  Returns the new record and
    tables with exactly the semantics of :func:`ninfer_kv.device.work.apply_work`: applied when
    the work is next in order, else nothing applied, every entry the sentinel and the slip recorded.
    """
    _require()
    tables = [_i32(t) for t in tables]
    if len(tables) != len(updates):
        raise ValueError(f"{len(tables)} tables and {len(updates)} update lists")
    call = jax.ffi.ffi_call(
        "ninfer_kv_apply_tables",
        (jax.ShapeDtypeStruct((5,), jnp.int32),) + tuple(jax.ShapeDtypeStruct(t.shape, t.dtype) for t in tables),
        input_output_aliases={0: 0, **{2 + i: 1 + i for i in range(len(tables))}},
        vmap_method="sequential",
    )
    out = call(_i32(sync), _i32(stamp), *tables, *(_i32(u) for u in updates))
    return out[0], list(out[1:])


def write_pages(sync, stamp, planes: Mapping[str, jax.Array], copies, restores, payload: Mapping, *,
                page_axis: int) -> dict[str, jax.Array]:
    """One pool's page writes of a round work, in place (CPU): COW copies ``(src, dst, columns)``
    and Host restores ``(dst, columns)`` from ``payload[plane]`` words ``(R, layers, H, P, X)``.

    Written only when the work is next in order (``sync``, ``stamp`` as :func:`apply_tables`);
    every source is read before any destination is written; entries with ``columns == 0`` or a
    destination outside the pool write nothing.  ``planes`` are the results' buffers (donate
    them); ``page_axis`` 1 (page-major) or 2 (head-major).  The semantics of
    :func:`ninfer_kv.ops.page_copy.write_pages`, without its whole-plane copies on XLA's CPU
    compiler.
    """
    _require()
    names = list(planes)
    words = []
    for n in names:
        x = planes[n]
        if payload and n in payload:
            words.append(jnp.asarray(payload[n]))
        else:  # no restores: a zero-entry payload (0, layers, H, P, X) of the plane's word type
            heads = x.shape[2] if page_axis == 1 else x.shape[1]
            words.append(jnp.zeros((0, x.shape[0], heads, x.shape[3], x.shape[4]), word_dtype(x.dtype)))
    call = jax.ffi.ffi_call(
        "ninfer_kv_write_pages",
        tuple(jax.ShapeDtypeStruct(planes[n].shape, planes[n].dtype) for n in names),
        input_output_aliases={4 + i: i for i in range(len(names))},
        vmap_method="sequential",
    )
    out = call(_i32(sync), _i32(stamp), _i32(copies), _i32(restores), *(planes[n] for n in names), *words,
               page_axis=np.int64(page_axis))
    return dict(zip(names, out))


# -- ops registry ----------------------------------------------------------------------------------
# ninfer_kv.ops.dispatch registers this module as the "ffi" backend of ninfer_kv.ops.registry
# ("ninfer_kv.ffi_ops:<op>" entries with this check), so the registry imports it, and the library
# loads, only when impl="ffi" or impl="auto" on a CPU first asks for it.


def unavailable_reason() -> str | None:
    """Why the ``"ffi"`` backend of :mod:`ninfer_kv.ops` cannot run here; ``None`` when it can.

    The registry's availability check.  Raises :class:`FFILibraryPathError` like
    :func:`is_available`: a bad ``$NINFER_KV_FFI_LIBRARY`` is an error, not a reason to fall back.
    """
    if is_available():
        return None
    return f"the XLA FFI library did not load ({load_error()})"
