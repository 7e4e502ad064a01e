"""``copy_blocks``: ``dst[...] = src`` (or ``src[index]``) for page data, at memory speed on the CPU.

The Host tier moves whole pages between extents, staging buffers and CPU planes.  Those copies are
strided: a plane's block of one page is contiguous (half a MiB for the K codes of a typical
page), but consecutive pages' blocks are a Host page stride apart.  numpy copies such an array
block by block with ordinary stores, so every destination cache line is first read (read for
ownership) and the copy runs at about two thirds of what one large ``memcpy`` reaches; and it runs
on one thread.

:func:`copy_blocks` hands the copy to the FFI library's ``NinferKvFfiCopyBlocks``: the arrays are
reduced to their largest common contiguous block and a few outer (shape, stride) pairs, and the
blocks are copied with streaming stores, split over the kernel threads.  Without the library, or
for copies too small or too fragmented to gain, it is :func:`numpy.copyto` / :func:`numpy.take`:
the bytes written are the same either way.
"""

from __future__ import annotations

import numpy as np

from .ffi_library import LIBRARY

__all__ = ["copy_blocks", "MIN_BYTES", "MIN_BLOCK_BYTES"]

MIN_BYTES = 1 << 18
"""Copies smaller than this (in bytes) are left to numpy: the call and the threads cost more."""

MIN_BLOCK_BYTES = 1 << 10
"""Contiguous blocks smaller than this are left to numpy: streaming stores need long runs."""

_MAX_DIMS = 8


def _dims(dst: np.ndarray, src: np.ndarray) -> tuple[list[tuple[int, int, int]], int]:
    """``(outer, block)``: ``outer`` lists ``(extent, dst stride, src stride)`` from the outermost
    axis in, ``block`` is the bytes of the contiguous block both arrays share at the inside."""
    item = dst.dtype.itemsize
    dims = [(n, ds, ss) for n, ds, ss in zip(dst.shape, dst.strides, src.strides) if n != 1]
    block = item
    while dims and dims[-1][1] == block and dims[-1][2] == block:
        block *= dims.pop()[0]
    merged: list[tuple[int, int, int]] = []
    for n, ds, ss in dims:  # fold an axis into the one before when it continues it in both arrays
        if merged and merged[-1][1] == n * ds and merged[-1][2] == n * ss:
            m = merged.pop()
            merged.append((m[0] * n, ds, ss))
        else:
            merged.append((n, ds, ss))
    return merged, block


def copy_blocks(dst: np.ndarray, src: np.ndarray, index: np.ndarray | None = None) -> None:
    """``dst[...] = src`` (``index`` None) or ``dst[...] = src[index]`` (a gather along axis 0),
    byte for byte.

    ``dst`` and ``src`` (or ``src[index]``) must have the same shape and item size and must not
    overlap; ``index`` must be integers in ``[0, len(src))``.  Bad arguments raise ``ValueError``
    before anything is written.
    """
    if index is not None:
        index = np.asarray(index)
        if index.ndim != 1 or not np.issubdtype(index.dtype, np.integer):
            raise ValueError(f"index must be a 1-D integer array, got {index.dtype} of shape {index.shape}")
        if index.size and (int(index.min()) < 0 or int(index.max()) >= src.shape[0]):
            raise ValueError(
                f"index holds {int(index.min())}..{int(index.max())}; allowed range is [0, {src.shape[0] - 1}]"
            )
        shape = (index.size,) + tuple(src.shape[1:])
    else:
        shape = tuple(src.shape)
    if tuple(dst.shape) != shape or dst.dtype.itemsize != src.dtype.itemsize:
        raise ValueError(
            f"copy_blocks: destination {dst.dtype} {tuple(dst.shape)} does not match source "
            f"{src.dtype} {shape} (same shape and item size needed)"
        )
    if not dst.flags.writeable:
        raise ValueError("copy_blocks: the destination is read-only")
    src = src.view(dst.dtype) if src.dtype != dst.dtype else src
    lib = LIBRARY.lib
    if lib is not None and dst.nbytes >= MIN_BYTES and not np.may_share_memory(dst, src):
        if _stream(lib, dst, src, index):
            return
    if index is None:
        np.copyto(dst, src)
    else:
        np.take(src, index.astype(np.intp, copy=False), axis=0, out=dst)


def _stream(lib, dst: np.ndarray, src: np.ndarray, index: np.ndarray | None) -> bool:
    """The copy through the library; ``False`` (nothing written) when its shape does not suit it."""
    if index is not None:
        # axis 0 is gathered: keep it as the outermost axis (extent len(index)), reduce the rest
        inner, block = _dims(dst[:1], src[:1])  # the size-1 axis 0 drops out
        outer = [(int(index.size), dst.strides[0], src.strides[0])] + inner
        idx = np.ascontiguousarray(index, dtype=np.int64)
    else:
        outer, block = _dims(dst, src)
        idx = None
    if block < MIN_BLOCK_BYTES or len(outer) > _MAX_DIMS:
        return False
    shape = np.array([d[0] for d in outer], np.int64)
    dst_strides = np.array([d[1] for d in outer], np.int64)
    src_strides = np.array([d[2] for d in outer], np.int64)
    rc = lib.NinferKvFfiCopyBlocks(
        dst.ctypes.data,
        src.ctypes.data,
        len(outer),
        shape.ctypes.data,
        dst_strides.ctypes.data,
        src_strides.ctypes.data,
        None if idx is None else idx.ctypes.data,
        block,
        0,
    )
    return rc == 0  # arguments the library refuses: nothing was copied
