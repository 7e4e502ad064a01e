"""Triton backend: element offsets wide enough for every plane the planner can produce, in our kernels only.

The Pallas Triton lowering addresses each kernel operand as ``base pointer + element offset`` and
picks the offset type from the operand's size in *bytes*: 64-bit above 2**32 bytes, 32-bit
otherwise (JAX 0.10.x, ``_compute_offsets_from_indices``).  The offsets count *elements* and are
signed, so a 1-byte plane (INT8, FP8 and NVFP4 codes, NVFP4 scales) of more than 2**31 elements
but at most 2**32 bytes (2-4 GiB) would be addressed with i32 offsets that wrap negative past
element 2**31 (for a 32-layer K8V4 pool with H = 8, D = 128: the FP8 key plane of 1024-2048
pages).  Wider dtypes are safe (2**32 bytes of bf16 are 2**31 elements).

Scope: the rule applies to the kernels of this package and to nothing else.  The Triton backend
passes its kernels' compiler parameters as :class:`WideOffsetParams` (a subclass of
``jax.experimental.pallas.triton.CompilerParams``, same fields), and Pallas picks the GPU lowering
of a ``pallas_call`` by the class of its compiler parameters
(``jax._src.pallas.core.register_lowering_rule``, the hook Mosaic GPU registers through).  The rule
registered for :class:`WideOffsetParams` runs JAX's own Triton lowering with the offset function
wrapped for the duration of that call and puts the original back when it returns; the wrapper
acts only in the context lowering our kernel (a ``ContextVar``), so a ``pallas_call`` of anyone
else, lowered before, after or (in another thread) during ours, gets JAX's own offsets.  Inside our
lowering the wrapper hands the lowering a block description whose only difference is an element
type wide enough to cross the byte threshold for an operand of >= 2**31 elements (strides are
computed from the shape).

Where the installed JAX lacks that hook or that offset function (a later version, whose rules are
unknown here), :func:`wide_offsets_supported` is false, the kernels use plain Triton compiler
parameters, and :func:`check_plane_addressing` (the Triton backend's ``check_planes``) refuses
the planes that the 32-bit rule above could not address, naming the plane, its size and the
limit, before a kernel is built.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import threading

import jax.numpy as jnp
from jax.experimental.pallas import triton as pl_triton

__all__ = ["I32_ELEMENTS", "WideOffsetParams", "compiler_params", "wide_offsets_supported", "check_plane_addressing"]

I32_ELEMENTS = 2**31  # element offsets below this fit a signed 32-bit integer
_LOWERING_I64_BYTES = 2**32  # the lowering's own threshold: 64-bit offsets above this many bytes


@dataclasses.dataclass(frozen=True)
class WideOffsetParams(pl_triton.CompilerParams):
    """Triton compiler parameters of this package's kernels: their lowering uses 64-bit offsets
    for every operand of >= 2**31 elements (see the module docstring)."""


_active = contextvars.ContextVar("ninfer_kv_wide_offsets", default=False)
_lock = threading.Lock()
_installed = {"depth": 0, "original": None, "wrapper": None}


def _wrap(original):
    @functools.wraps(original)
    def compute_offsets(block_info, nd_indexer):
        full = block_info.full_shape_dtype
        elements = math.prod(full.shape)
        if (_active.get() and elements >= I32_ELEMENTS
                and elements * jnp.dtype(full.dtype).itemsize <= _LOWERING_I64_BYTES):
            wide = type(full)(full.shape, jnp.uint32)  # same shape, >= 2**33 bytes: the lowering picks i64
            block_info = dataclasses.replace(block_info, full_shape_dtype=wide)
        return original(block_info, nd_indexer)

    return compute_offsets


@contextlib.contextmanager
def _wide_offsets(lowering):
    """Within the block, the lowering in this context uses wide offsets; the wrapper is removed after the last one."""
    with _lock:
        if _installed["depth"] == 0:
            original = lowering._compute_offsets_from_indices
            _installed.update(original=original, wrapper=_wrap(original))
            lowering._compute_offsets_from_indices = _installed["wrapper"]
        _installed["depth"] += 1
    token = _active.set(True)
    try:
        yield
    finally:
        _active.reset(token)
        with _lock:
            _installed["depth"] -= 1
            if _installed["depth"] == 0:
                if lowering._compute_offsets_from_indices is _installed["wrapper"]:
                    lowering._compute_offsets_from_indices = _installed["original"]
                _installed.update(original=None, wrapper=None)


def _lower_with_wide_offsets(ctx, *in_nodes, **params):
    """The GPU lowering of a ``pallas_call`` whose compiler parameters are :class:`WideOffsetParams`."""
    from jax._src.pallas.triton import lowering, pallas_call_registration

    with _wide_offsets(lowering):
        return pallas_call_registration.pallas_call_lowering(ctx, *in_nodes, **params)


@functools.cache
def wide_offsets_supported() -> bool:
    """Whether this JAX has the hooks the rule needs; registers the lowering of :class:`WideOffsetParams` once."""
    try:
        from jax._src.pallas import core as pallas_core
        from jax._src.pallas.triton import lowering, pallas_call_registration
    except ImportError:  # pragma: no cover - depends on the installed JAX
        return False
    block_info = getattr(lowering, "BlockInfo", None)
    if not (callable(getattr(pallas_core, "register_lowering_rule", None))
            and callable(getattr(lowering, "_compute_offsets_from_indices", None))
            and callable(getattr(pallas_call_registration, "pallas_call_lowering", None))
            and block_info is not None and dataclasses.is_dataclass(block_info)):
        return False  # pragma: no cover - depends on the installed JAX
    pallas_core.register_lowering_rule(WideOffsetParams, _lower_with_wide_offsets, "gpu")
    return True


def compiler_params(num_warps: int, num_stages: int, *, interpret: bool) -> pl_triton.CompilerParams:
    """The compiler parameters of one of our kernels: :class:`WideOffsetParams` where the rule is supported."""
    wide = not interpret and wide_offsets_supported()
    return (WideOffsetParams if wide else pl_triton.CompilerParams)(num_warps=num_warps, num_stages=num_stages)


def check_plane_addressing(planes: dict, *, interpret: bool) -> None:
    """Raise ``ValueError`` for a plane the kernels could not address on a GPU.

    With the rule supported every plane is addressable; without it (an unknown JAX version) a
    plane of >= 2**31 elements and at most 2**32 bytes (a 1-byte plane of 2-4 GiB) is refused: it
    would be read and written at wrapped 32-bit offsets.  Interpret mode (CPU) indexes with XLA
    gathers and is not limited.
    """
    if interpret or wide_offsets_supported():
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
