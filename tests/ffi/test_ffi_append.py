"""FFI appends write planes bit-identical to the jnp reference (raw bytes, poison included)."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ninfer_kv import ffi_ops
from ninfer_kv.views import PagedKVBatchLayerView

from .ffi_cases import (
    PROFILES,
    assert_planes_identical,
    cyclic_state,
    cyclic_view,
    empty_paged_pool,
    ffi_cyclic_append,
    ffi_paged_append,
    profile_order_pairs,
    ref_cyclic_append,
    ref_paged_append,
    sweep,
)

pytestmark = pytest.mark.skipif(not ffi_ops.is_available(), reason=f"FFI library unavailable: {ffi_ops.load_error()}")


def _kv(rng, b, t, h, d, dtype=np.float32, spread=True):
    x = rng.standard_normal((2, b, t, h, d)).astype(np.float32)
    if spread:  # magnitudes over many binades, so scales and codes cover their ranges
        x *= np.exp2(rng.integers(-20, 20, size=(2, b, t, h, 1))).astype(np.float32)
    x = x.astype(dtype)
    return jnp.asarray(x[0]), jnp.asarray(x[1])


def _step(fn, view, rows, pos, k, v, valid):
    return fn(view, jnp.asarray(rows, jnp.int32), jnp.asarray(pos, jnp.int32), k, v, jnp.asarray(valid, jnp.int32))


@pytest.mark.parametrize(("profile", "order"), profile_order_pairs())
def test_append_sequence_bit_identical(profile, order):
    """Prefill chunks crossing pages at mid-page starts, then decode steps, then a partial chunk.

    Every step has T = 70 (one compiled shape); `valid` makes steps decode-like (1 token per row).
    """
    rng = np.random.default_rng(hash((profile, order)) % 2**32)
    b, h, d = 3, 2, 64
    lay, planes, bt, rows = empty_paged_pool(profile, order, batch=b, logical_pages=4, heads=h, head_dim=d, rng=rng)
    view = PagedKVBatchLayerView({k: jnp.asarray(v) for k, v in planes.items()}, jnp.asarray(bt), 1, lay)
    ffi_view = ref_view = view
    pos = np.array([0, 13, 60], np.int32)
    steps = [
        np.array([70, 51, 0], np.int32),  # chunk: row 2 writes nothing
        np.array([1, 1, 1], np.int32),  # decode
        np.array([1, 0, 1], np.int32),
        np.array([40, 70, 69], np.int32),  # partial chunk, crossing page boundaries
    ]
    for valid in steps:
        k, v = _kv(rng, b, 70, h, d)
        ffi_view = _step(ffi_paged_append, ffi_view, rows, pos, k, v, valid)
        ref_view = _step(ref_paged_append, ref_view, rows, pos, k, v, valid)
        assert_planes_identical(ffi_view.planes, ref_view.planes)
        pos = pos + valid


@pytest.mark.parametrize("profile", sweep(PROFILES, ("int8-g64", "k8v4")))
def test_append_bf16_input_and_traced_layer(profile):
    rng = np.random.default_rng(7)
    b, t, h, d = 2, 5, 2, 64
    lay, planes, bt, rows = empty_paged_pool(profile, "page-major", batch=b, logical_pages=2, heads=h, head_dim=d, rng=rng)
    view = PagedKVBatchLayerView({k: jnp.asarray(v) for k, v in planes.items()}, jnp.asarray(bt), jnp.int32(0), lay)
    k, v = _kv(rng, b, t, h, d, dtype=ml_dtypes.bfloat16)
    args = (rows, [62, 3], k, v, [5, 4])
    assert_planes_identical(_step(ffi_paged_append, view, *args).planes, _step(ref_paged_append, view, *args).planes)


@pytest.mark.parametrize("profile", ["bf16", "fp8-e4m3fn-row256"])
def test_append_head_dim_not_a_multiple_of_the_vector_width(profile):
    rng = np.random.default_rng(11)
    b, t, h, d = 2, 3, 1, 72
    lay, planes, bt, rows = empty_paged_pool(profile, "head-major", batch=b, logical_pages=1, heads=h, head_dim=d, rng=rng)
    view = PagedKVBatchLayerView({k: jnp.asarray(v) for k, v in planes.items()}, jnp.asarray(bt), 1, lay)
    k, v = _kv(rng, b, t, h, d)
    args = (rows, [0, 61], k, v, [3, 3])
    assert_planes_identical(_step(ffi_paged_append, view, *args).planes, _step(ref_paged_append, view, *args).planes)


def _special_rows(d: int) -> np.ndarray:
    """Rows hitting every rounding boundary of the codecs (scales chosen to be powers of two)."""
    e4m3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    e4m3 = np.unique(e4m3[np.isfinite(e4m3) & (e4m3 >= 0)])
    e4m3_mid = (e4m3[:-1] + e4m3[1:]) / 2  # ties: subnormal and normal ranges
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    e2m1_mid = (e2m1[:-1] + e2m1[1:]) / 2
    int8_mid = np.arange(-127, 127, dtype=np.float32) + 0.5
    bf16_mid = np.float32(1.0) + np.float32(2.0**-8) * np.arange(1, 64, 2, dtype=np.float32)
    rows = []

    def row(values, amax, group):
        """values, with every group's last element set to amax (pinning the group's scale)."""
        r = np.resize(np.asarray(values, np.float32), d).copy()
        r[group - 1 :: group] = amax
        return r

    # amax 448 -> FP8 row scale 1; amax 6 -> NVFP4 group scale 1; amax 127 -> INT8 group scale 1
    for chunk in np.array_split(e4m3_mid, max(1, e4m3_mid.size // (d - 1))):
        rows.append(row(np.concatenate([chunk, -chunk]), 448.0, d))
    rows.append(row(np.concatenate([e2m1_mid, -e2m1_mid, e2m1, -e2m1]), 6.0, 16))
    for chunk in np.array_split(int8_mid, max(1, int8_mid.size // 63)):
        rows.append(row(chunk, 127.0, 64))
    rows.append(row(bf16_mid, 2.0, d))
    rows.append(np.zeros(d, np.float32))  # zero scale everywhere
    rows.append(np.full(d, -0.0, np.float32))  # negative zeros
    rows.append(np.full(d, 1e-40, np.float32))  # float32 subnormals (flushed like XLA)
    tiny = np.full(d, 3e-38, np.float32)
    tiny[::3] *= -1
    rows.append(tiny)  # scales that underflow
    big = np.full(d, 3e38, np.float32)
    big[1::2] = -1e-3
    rows.append(big)
    return np.stack(rows)


@pytest.mark.parametrize(
    ("profile", "d"),
    # D = 72 leaves a scalar tail after the vector lanes; NVFP4 needs D % 16 == 0, INT8-G64 D % 64 == 0
    sweep(
        [(p, 64) for p in PROFILES] + [("bf16", 72), ("fp8-e4m3fn-row256", 72), ("nvfp4-g16", 80), ("k8v4", 80)],
        (("int8-g64", 64), ("bf16", 72), ("fp8-e4m3fn-row256", 72), ("nvfp4-g16", 80), ("k8v4", 80)),
    ),
)
def test_append_rounding_boundaries_bit_identical(profile, d):
    rows = _special_rows(d)
    rng = np.random.default_rng(3)
    n = rows.shape[0]
    pages = -(-n // 64)
    lay, planes, bt, trows = empty_paged_pool(profile, "page-major", batch=1, logical_pages=pages, heads=1, head_dim=d, rng=rng)
    view = PagedKVBatchLayerView({k: jnp.asarray(v) for k, v in planes.items()}, jnp.asarray(bt), 0, lay)
    k = jnp.asarray(rows[None, :, None, :])
    v = jnp.asarray(-rows[None, ::-1, None, :].copy())
    args = (trows, [0], k, v, [n])
    assert_planes_identical(_step(ffi_paged_append, view, *args).planes, _step(ref_paged_append, view, *args).planes)


_ROW = hnp.arrays(
    np.float32,
    (4, 64),
    elements=st.floats(-1e6, 1e6, width=32, allow_subnormal=True)
    | st.sampled_from([0.0, -0.0, 0.25, 0.75, 1.25, 2.5, 5.0, 448.0, 127.5, 1e-39]),
)


@settings(max_examples=8, deadline=None)
@given(x=_ROW, profile=st.sampled_from(PROFILES))
def test_append_codes_match_reference_on_arbitrary_rows(x, profile):
    rng = np.random.default_rng(0)
    lay, planes, bt, trows = empty_paged_pool(profile, "page-major", batch=1, logical_pages=1, heads=1, head_dim=64, rng=rng)
    view = PagedKVBatchLayerView({k: jnp.asarray(v) for k, v in planes.items()}, jnp.asarray(bt), 0, lay)
    k = jnp.asarray(x[None, :, None, :])
    args = (trows, [5], k, -k, [4])
    assert_planes_identical(_step(ffi_paged_append, view, *args).planes, _step(ref_paged_append, view, *args).planes)


def test_append_drops_out_of_range_pages_and_layers():
    """Table entries outside [0, N) in the write range and an out-of-range layer write nothing."""
    rng = np.random.default_rng(5)
    lay, planes, bt, rows = empty_paged_pool("k8v4", "page-major", batch=2, logical_pages=2, rng=rng)
    n = planes["k"].shape[1]
    bt[rows[0], 1] = n + 4
    view = PagedKVBatchLayerView({k: jnp.asarray(v) for k, v in planes.items()}, jnp.asarray(bt), 0, lay)
    k, v = _kv(rng, 2, 70, 2, 64)
    args = (rows, [0, 0], k, v, [70, 70])
    assert_planes_identical(_step(ffi_paged_append, view, *args).planes, _step(ref_paged_append, view, *args).planes)
    # A layer outside [0, num_layers) (possible only when traced) writes nothing, like the reference.
    far = PagedKVBatchLayerView(view.planes, view.block_tables, jnp.int32(5), lay, validate=False)
    out = _step(ffi_paged_append, far, *args)
    assert_planes_identical(out.planes, _step(ref_paged_append, far, *args).planes)
    assert_planes_identical(out.planes, view.planes)


@pytest.mark.parametrize("profile", sweep(PROFILES, ("bf16", "k8v4")))
def test_cyclic_append_bit_identical(profile):
    rng = np.random.default_rng(17)
    lay, planes = cyclic_state(profile, rows=3, window=5, slots=8, rng=rng)
    view = cyclic_view(lay, planes, 1)
    ffi_view = ref_view = view
    rows = np.array([2, 0], np.int32)
    pos = np.array([0, 6], np.int32)
    for valid in ([11, 3], [1, 1], [0, 3]):  # 11 > slots: only the last 8 survive
        k, v = _kv(rng, 2, 11, 2, 64)
        args = (rows, pos, k, v, valid)
        ffi_view = _step(ffi_cyclic_append, ffi_view, *args)
        ref_view = _step(ref_cyclic_append, ref_view, *args)
        assert_planes_identical(ffi_view.planes, ref_view.planes)
        pos = pos + np.asarray(valid, np.int32)
