"""FFI attention agrees with the float32 jnp reference and never reads poison."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ninfer_kv import ffi_ops

from .ffi_cases import (
    assert_close_to_reference,
    cyclic_state,
    cyclic_view,
    ffi_cyclic_attention,
    ffi_paged_attention,
    paged_state,
    profile_order_pairs,
    ref_cyclic_attention,
    ref_paged_attention,
    sweep,
)

pytestmark = pytest.mark.skipif(not ffi_ops.is_available(), reason=f"FFI library unavailable: {ffi_ops.load_error()}")


def _run_paged(state, q, positions, kv_lens=None, sm_scale=None, layer=None):
    view = state.view(layer)
    args = (
        jnp.asarray(q),
        view,
        jnp.asarray(state.table_rows),
        jnp.asarray(positions, jnp.int32),
        jnp.asarray(state.kv_lens if kv_lens is None else kv_lens, jnp.int32),
    )
    return ffi_paged_attention(*args, sm_scale=sm_scale), ref_paged_attention(*args, sm_scale=sm_scale)


@pytest.mark.parametrize(("profile", "order"), profile_order_pairs())
def test_paged_attention_matches_reference(profile, order):
    """Shuffled pages and table rows, a zero-length row, mid-page frontiers, a chunk of T = 3."""
    rng = np.random.default_rng(abs(hash((profile, order))) % 2**32)
    kv_lens = [130, 0, 64, 7]
    state = paged_state(profile, order, kv_lens=kv_lens, rng=rng)
    q = rng.standard_normal((4, 3, 8, 64)).astype(np.float32)  # H = 2 KV heads, GQA 4
    positions = [127, 0, 61, 9]  # row 3's queries sit past its frontier: they see all 7 keys
    out, ref = _run_paged(state, q, positions)
    assert_close_to_reference(out, ref)
    np.testing.assert_array_equal(np.asarray(out)[1], 0.0)  # no visible key -> zeros


@pytest.mark.parametrize(
    ("gqa", "t"), sweep([(g, t) for g in (1, 4, 8) for t in (1, 3, 64)], ((1, 1), (4, 3), (8, 64), (4, 1)))
)
def test_paged_attention_gqa_and_query_lengths(gqa, t):
    rng = np.random.default_rng(100 * gqa + t)
    kv_lens = [200, 65, 1]
    state = paged_state("k8v4", "page-major", kv_lens=kv_lens, heads=2, rng=rng)
    q = rng.standard_normal((3, t, 2 * gqa, 64)).astype(np.float32)
    positions = [200 - t, 65 - t if t < 65 else 0, 0]
    out, ref = _run_paged(state, q, positions)
    assert_close_to_reference(out, ref)


def test_paged_attention_long_context_uses_context_splits():
    """One row, one KV head: the context is split over threads and the partials combined."""
    rng = np.random.default_rng(1)
    state = paged_state("bf16", "head-major", kv_lens=[3000], heads=1, layers=1, layer=0, rng=rng)
    q = rng.standard_normal((1, 2, 4, 64)).astype(np.float32)
    out, ref = _run_paged(state, q, [2998])
    assert_close_to_reference(out, ref)


@pytest.mark.parametrize(("profile", "d"), [("bf16", 72), ("fp8-e4m3fn-row256", 40), ("nvfp4-g16", 16), ("int8-g64", 256)])
def test_paged_attention_head_dims(profile, d):
    rng = np.random.default_rng(d)
    state = paged_state(profile, "page-major", kv_lens=[90, 33], head_dim=d, rng=rng)
    q = rng.standard_normal((2, 2, 4, d)).astype(np.float32)
    out, ref = _run_paged(state, q, [88, 40])
    assert_close_to_reference(out, ref)


def test_paged_attention_bf16_queries_scale_and_traced_layer():
    rng = np.random.default_rng(9)
    state = paged_state("int8-g64", "page-major", kv_lens=[100, 64], rng=rng)
    q = rng.standard_normal((2, 1, 4, 64)).astype(ml_dtypes.bfloat16)
    out, ref = _run_paged(state, q, [99, 63], sm_scale=0.3, layer=jnp.int32(1))
    assert out.dtype == jnp.bfloat16
    # both round a float32 result to bfloat16: allow one bfloat16 step
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=2**-7, atol=1e-3)


def test_paged_attention_ignores_kv_len_beyond_the_table():
    """kv_len past L * 64 reads only the L addressable blocks (like the reference)."""
    rng = np.random.default_rng(4)
    state = paged_state("fp8-e4m3fn-row256", "page-major", kv_lens=[128], logical_pages=2, rng=rng)
    q = rng.standard_normal((1, 1, 2, 64)).astype(np.float32)
    out, ref = _run_paged(state, q, [500], kv_lens=[1000])
    assert_close_to_reference(out, ref)


def test_paged_attention_fp8_nan_codes_match_reference():
    """Raw e4m3fn NaN codes (0x7F, 0xFF) in value and key rows, as a hand-edited plane holds them.

    A value NaN lands in exactly its column of the rows that see its key (the run takes the exact
    decode); a key NaN turns the rows that see it into NaN; every other output is unaffected.
    """
    rng = np.random.default_rng(31)
    state = paged_state("fp8-e4m3fn-row256", "page-major", kv_lens=[100, 70, 64], rng=rng)
    layer = state.layer
    bt, tr = state.block_tables, state.table_rows
    codes = state.planes["v"].view(np.uint8)
    codes[layer, bt[tr[0], 1], 0, 10, 5] = 0x7F  # batch row 0, key 74, head 0, column 5
    codes[layer, bt[tr[1], 0], 1, 3, 60] = 0xFF  # batch row 1, key 3, head 1, column 60
    state.planes["k"].view(np.uint8)[layer, bt[tr[2], 0], 1, 20, 9] = 0x7F  # batch row 2, key 20, head 1
    q = rng.standard_normal((3, 2, 8, 64)).astype(np.float32)
    positions = [80, 69, 63]  # row 0's first query (position 80) sees key 74; both see it
    out, ref = _run_paged(state, q, positions)
    out, ref = np.asarray(out), np.asarray(ref)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    assert np.isnan(out[0, :, 0:4, 5]).all() and not np.isnan(out[0, :, 0:4, 4]).any()
    assert np.isnan(out[1, :, 4:8, 60]).all() and not np.isnan(out[1, :, 0:4]).any()
    assert np.isnan(out[2, :, 4:8]).all() and not np.isnan(out[2, :, 0:4]).any()
    finite = ~np.isnan(ref)
    assert_close_to_reference(out[finite], ref[finite])


def test_paged_attention_handler_rejects_bad_operands():
    """Malformed operands reach the handler only through a direct ffi_call; it errors, not crashes."""
    call = jax.ffi.ffi_call("ninfer_kv_paged_attention", jax.ShapeDtypeStruct((2, 64), jnp.float32))
    planes = [jnp.zeros((1, 4, 2, 64, 64), jnp.bfloat16)] * 2
    i32 = lambda *s: jnp.zeros(s, jnp.int32)  # noqa: E731
    with pytest.raises(Exception, match="q must be"):
        call(
            jnp.zeros((2, 64), jnp.float32), i32(1, 2), i32(), i32(1), i32(1), i32(1), *planes,
            k_codec=np.int32(0), v_codec=np.int32(0), head_major=np.int32(0), sm_scale=np.float32(1.0),
        ).block_until_ready()


@pytest.mark.parametrize("profile", sweep(["bf16", "k8v4", "int8-g64"], ("k8v4", "int8-g64")))
def test_cyclic_attention_matches_reference(profile):
    rng = np.random.default_rng(23)
    lay, planes = cyclic_state(profile, rows=4, window=20, slots=24, heads=2, rng=rng)
    view = cyclic_view(lay, planes, jnp.int32(1))
    q = jnp.asarray(rng.standard_normal((3, 5, 8, 64)).astype(np.float32))
    rows = jnp.asarray([3, 0, 2], jnp.int32)
    positions = jnp.asarray([50, 3, 21], jnp.int32)  # wrapped ring, a young row, a wrap mid-window
    kv_lens = jnp.asarray([55, 8, 25], jnp.int32)
    out = ffi_cyclic_attention(q, view, rows, positions, kv_lens)
    ref = ref_cyclic_attention(q, view, rows, positions, kv_lens)
    assert_close_to_reference(out, ref)
