"""The model's weight products as C++ XLA FFI CPU kernels: bfloat16 rows and packed weights.

:func:`matmul_bf16` streams an ``nn.Linear`` weight as it is; :func:`matmul_bf16_packed` takes a
weight packed once (:mod:`ninfer_kv.ops.ffi.packed_weight`) and reuses its tiles across rows.  Both
are batch invariant: a row's result never depends on the other rows.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .packed_weight import PackedWeight
from .handlers import _require

__all__ = [
    "matmul_bf16",
    "matmul_bf16_many",
    "matmul_bf16_packed",
    "matmul_bf16_packed_many",
    "PACKED_KERNELS",
    "packed_kernel",
    "packed_amx_status",
    "packed_amx_reference",
]


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
