"""Triton backend: element offsets wide enough for every plane the planner can produce.

The Pallas Triton lowering addresses each kernel operand as ``base pointer + element offset`` and
picks the offset type from the operand's size in *bytes*: 64-bit above 2**32 bytes, 32-bit
otherwise (JAX 0.10.x, ``_compute_offsets_from_indices``).  The offsets count *elements* and are
signed, so a 1-byte plane (INT8, FP8 and NVFP4 codes, NVFP4 scales) of more than 2**31 elements
but at most 2**32 bytes (2-4 GiB) would be addressed with i32 offsets that wrap negative past
element 2**31 (for a 32-layer K8V4 pool with H = 8, D = 128: the FP8 key plane of 1024-2048
pages).  Wider dtypes are safe (2**32 bytes of bf16 are 2**31 elements).

:func:`install_wide_offsets` wraps that lowering function so that an operand of at least 2**31
elements is addressed with 64-bit offsets whatever its byte size (the wrapper changes nothing
else: it hands the lowering a block description whose only difference is an element type wide
enough to cross the byte threshold; strides are computed from the shape).  The Triton backend
(:mod:`pallas_kernels.triton_backend`) installs it before it lowers a kernel.  Where the installed
JAX has no such function (a later version, whose rule is unknown here),
:func:`check_plane_addressing` (the Triton backend's ``check_planes``) refuses the planes that the
32-bit rule above could not address, naming the plane, its size and the limit, before a kernel is
built.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp

__all__ = ["I32_ELEMENTS", "install_wide_offsets", "wide_offsets_installed", "check_plane_addressing"]

I32_ELEMENTS = 2**31  # element offsets below this fit a signed 32-bit integer
_LOWERING_I64_BYTES = 2**32  # the lowering's own threshold: 64-bit offsets above this many bytes

_state = {"installed": False}


def _wrap(original):
    @functools.wraps(original)
    def compute_offsets(block_info, nd_indexer):
        full = block_info.full_shape_dtype
        elements = math.prod(full.shape)
        if elements >= I32_ELEMENTS and elements * jnp.dtype(full.dtype).itemsize <= _LOWERING_I64_BYTES:
            wide = type(full)(full.shape, jnp.uint32)  # same shape, >= 2**33 bytes: the lowering picks i64
            block_info = dataclasses.replace(block_info, full_shape_dtype=wide)
        return original(block_info, nd_indexer)

    compute_offsets.__ninfer_kv_wide_offsets__ = True
    return compute_offsets


def install_wide_offsets() -> bool:
    """Make the Triton lowering use 64-bit offsets for every operand of >= 2**31 elements.

    Idempotent.  Returns whether the lowering is covered (False where the installed JAX has no
    offset function of the known form; :func:`check_plane_addressing` then refuses the planes
    it could not address).
    """
    if _state["installed"]:
        return True
    try:
        from jax._src.pallas.triton import lowering
    except ImportError:  # pragma: no cover - depends on the installed JAX
        return False
    original = getattr(lowering, "_compute_offsets_from_indices", None)
    block_info_type = getattr(lowering, "BlockInfo", None)
    if original is None or block_info_type is None or not dataclasses.is_dataclass(block_info_type):
        return False  # pragma: no cover - depends on the installed JAX
    if not getattr(original, "__ninfer_kv_wide_offsets__", False):
        lowering._compute_offsets_from_indices = _wrap(original)
    _state["installed"] = True
    return True


def wide_offsets_installed() -> bool:
    """Whether :func:`install_wide_offsets` covers the Triton lowering in this process."""
    return _state["installed"]


def check_plane_addressing(planes: dict, *, interpret: bool) -> None:
    """Raise ``ValueError`` for a plane the kernels could not address on a GPU.

    With :func:`install_wide_offsets` in place every plane is addressable; without it (an
    unknown JAX version) a plane of >= 2**31 elements and at most 2**32 bytes (a 1-byte plane of
    2-4 GiB) is refused: it would be read and written at wrapped 32-bit offsets.  Interpret mode
    (CPU) indexes with XLA gathers and is not limited.
    """
    if interpret or install_wide_offsets():
        return
    for name, plane in planes.items():
        elements = math.prod(plane.shape)
        nbytes = elements * jnp.dtype(plane.dtype).itemsize
        if elements >= I32_ELEMENTS and nbytes <= _LOWERING_I64_BYTES:
            raise ValueError(
                f"plane {name!r} of shape {tuple(plane.shape)} ({jnp.dtype(plane.dtype).name}, {nbytes} bytes) "
                f"cannot be addressed by the Pallas Triton kernels with this JAX: planes of >= 2**31 elements "
                f"must be larger than 2**32 bytes (or smaller than 2**31 elements); use fewer pages per pool"
            )
