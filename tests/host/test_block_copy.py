"""``copy_blocks`` writes exactly the bytes ``numpy`` would, through the library's streaming copy
and through the numpy fallback, for the strided layouts the Host tier uses."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer_kv.host import ffi_library
from ninfer_kv.host import block_copy
from ninfer_kv.host.block_copy import copy_blocks

needs_library = pytest.mark.skipif(ffi_library.LIBRARY.lib is None, reason="the FFI library is not built")


@pytest.fixture
def small_threshold(monkeypatch):
    """Route even small copies through the library, so that many shapes reach it."""
    monkeypatch.setattr(block_copy, "MIN_BYTES", 0)
    monkeypatch.setattr(block_copy, "MIN_BLOCK_BYTES", 1)


def _planes(rng, pages, layers, heads, p, x, dtype=np.uint8):
    return rng.integers(0, 256, size=(layers, pages, heads, p, x * np.dtype(dtype).itemsize), dtype=np.uint8).view(dtype)


@needs_library
@settings(max_examples=40, deadline=None)
@given(
    pages=st.integers(1, 9),
    layers=st.integers(1, 3),
    heads=st.integers(1, 3),
    p=st.sampled_from([1, 4, 16]),
    x=st.sampled_from([1, 2, 8, 64]),
    item=st.sampled_from([1, 2, 4]),
    axis=st.sampled_from([1, 2]),
    gather=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_streaming_copy_equals_numpy(pages, layers, heads, p, x, item, axis, gather, seed):
    """Page-major and head-major planes to the Host page order (the offload gather) and back."""
    rng = np.random.default_rng(seed)
    dtype = {1: np.uint8, 2: np.uint16, 4: np.uint32}[item]
    plane = _planes(rng, pages, layers, heads, p, x, dtype)
    if axis == 2:
        plane = np.ascontiguousarray(np.moveaxis(plane, 1, 2))  # (L, H, N, P, X)
    src = np.moveaxis(plane, axis, 0)
    index = rng.permutation(pages)[: rng.integers(1, pages + 1)] if gather else None
    want = src[index] if gather else src.copy()
    old = block_copy.MIN_BYTES, block_copy.MIN_BLOCK_BYTES
    block_copy.MIN_BYTES, block_copy.MIN_BLOCK_BYTES = 0, 1
    try:
        out = np.full(want.shape, 0xA5, dtype)
        copy_blocks(out, src, index)
        np.testing.assert_array_equal(out, want)
        if not gather:  # and back: Host page order into the plane, in place
            back = np.zeros_like(plane)
            copy_blocks(np.moveaxis(back, axis, 0), want)
            np.testing.assert_array_equal(back, plane)
    finally:
        block_copy.MIN_BYTES, block_copy.MIN_BLOCK_BYTES = old


@needs_library
def test_large_copy_is_split_and_exact():
    """Blocks above the 1 MiB piece size, across threads, and a strided Host-page source."""
    rng = np.random.default_rng(1)
    stride, block, pages = (3 << 20) + 4096, (2 << 20) + 100, 5
    arena = rng.integers(0, 256, size=stride * pages, dtype=np.uint8)
    src = np.lib.stride_tricks.as_strided(arena[64:], shape=(pages, block), strides=(stride, 1))
    out = np.zeros((pages, block), np.uint8)
    copy_blocks(out, src)
    np.testing.assert_array_equal(out, src)
    out2 = np.zeros((3, block), np.uint8)
    copy_blocks(out2, src, np.array([4, 0, 2]))
    np.testing.assert_array_equal(out2, src[[4, 0, 2]])


def test_without_the_library_numpy_writes_the_same(monkeypatch):
    monkeypatch.setattr(block_copy, "LIBRARY", ffi_library.Library())  # never loaded: no library
    rng = np.random.default_rng(2)
    src = _planes(rng, 6, 2, 2, 16, 64)
    out = np.zeros((6, 2, 2, 16, 64), np.uint8)
    copy_blocks(out, np.moveaxis(src, 1, 0))
    np.testing.assert_array_equal(out, np.moveaxis(src, 1, 0))
    out = np.zeros((2, 2, 2, 16, 64), np.uint8)
    copy_blocks(out, np.moveaxis(src, 1, 0), np.array([5, 1]))
    np.testing.assert_array_equal(out, np.moveaxis(src, 1, 0)[[5, 1]])


def test_overlapping_arrays_take_numpy(small_threshold):
    buf = np.arange(64, dtype=np.uint8)
    copy_blocks(buf[8:40], buf[0:32])  # numpy's copy of overlapping memory is a memmove
    np.testing.assert_array_equal(buf[8:40], np.arange(32, dtype=np.uint8))


@pytest.mark.parametrize(
    "dst, src, index, match",
    [
        (np.zeros((2, 4), np.uint8), np.zeros((3, 4), np.uint8), None, r"destination uint8 \(2, 4\).*source uint8 \(3, 4\)"),
        (np.zeros((2, 4), np.uint8), np.zeros((2, 2), np.uint16), None, "same shape and item size"),
        (np.zeros((2, 4), np.uint8), np.zeros((3, 4), np.uint8), np.array([0, 3]), r"0\.\.3; allowed range is \[0, 2\]"),
        (np.zeros((2, 4), np.uint8), np.zeros((3, 4), np.uint8), np.array([-1, 0]), r"allowed range is \[0, 2\]"),
        (np.zeros((2, 4), np.uint8), np.zeros((3, 4), np.uint8), np.array([0.0, 1.0]), "1-D integer array"),
    ],
)
def test_bad_arguments_are_refused_before_writing(dst, src, index, match):
    dst[...] = 7
    with pytest.raises(ValueError, match=match):
        copy_blocks(dst, src, index)
    assert (dst == 7).all()


def test_read_only_destination_is_refused():
    dst = np.zeros(4, np.uint8)
    dst.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        copy_blocks(dst, np.ones(4, np.uint8))


@needs_library
def test_the_library_refuses_bad_dims_and_writes_nothing():
    lib = ffi_library.LIBRARY.lib
    dst = np.zeros(16, np.uint8)
    shape = np.zeros(9, np.int64)
    assert lib.NinferKvFfiCopyBlocks(dst.ctypes.data, dst.ctypes.data, 9, shape.ctypes.data, shape.ctypes.data,
                                     shape.ctypes.data, None, 4, 1) == -1
    neg = np.array([-1], np.int64)
    assert lib.NinferKvFfiCopyBlocks(dst.ctypes.data, dst.ctypes.data, 1, neg.ctypes.data, neg.ctypes.data,
                                     neg.ctypes.data, None, 4, 1) == -1
