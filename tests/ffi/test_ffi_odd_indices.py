"""The FFI kernels follow the agreed rules for out-of-range indices (nothing is checked under jit).

* a table row (or ring row) outside its range is inert: append writes nothing, attention returns
  zeros;
* a block-table entry outside [0, N), negative included: append drops that block's tokens,
  attention masks its keys exactly like keys beyond kv_lens;
* positions outside [0, L * 64) are dropped by append; attention clips kv_lens to [0, L * 64] and a
  query at a negative position sees no key; valid is clipped to [0, T] (paged and cyclic).

Expected values come from the numpy oracle (``tests/ops/np_codecs.py``), not from the reference.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv import ffi_ops
from ninfer_kv.layout import PagedKVStorageLayout
from ninfer_kv.views import PagedKVBatchLayerView
from tests.ops import np_codecs

from .ffi_cases import (
    P,
    PROFILES,
    assert_close_to_reference,
    cyclic_state,
    cyclic_view,
    ffi_cyclic_append,
    ffi_cyclic_attention,
    ffi_paged_append,
    ffi_paged_attention,
    raw_bytes,
    valid_codes,
)

pytestmark = pytest.mark.skipif(not ffi_ops.is_available(), reason=f"FFI library unavailable: {ffi_ops.load_error()}")

H, D, L = 2, 64, 4  # KV heads, head dim, logical pages per table row


def _filled_pool(profile: str, num_pages: int, rng):
    """A page-major pool whose every page holds valid random codes (all of it readable)."""
    lay = PagedKVStorageLayout(profile, 1, H, D, "page-major")
    shapes = lay.plane_shapes(num_pages)
    return lay, {spec.name: valid_codes(spec, shapes[spec.name], rng) for spec in lay.planes}


def _tokens(planes: dict, page: int, col: int) -> dict:
    return {name: x[0, page, :, col] for name, x in planes.items()}


@pytest.mark.parametrize("profile", PROFILES)
def test_attention_masks_bad_blocks_and_zeroes_inert_rows_and_negative_positions(profile):
    rng = np.random.default_rng(7)
    n = 24
    lay, planes = _filled_pool(profile, n, rng)
    c = 6
    table = rng.permutation(n)[: c * L].reshape(c, L).astype(np.int32)
    table[0, 1] = -5  # negative entry inside batch row 0's visible range
    table[1, 0] = n + 3  # entry >= N inside batch row 1's visible range
    table[4, 2] = 2**31 - 1
    #            b0  b1      b2  b3  b4  b5
    table_rows = [0, 1, c, -1, 4, 5]
    positions = [128, 300, 10, 10, -2, 40]
    kv_lens = [130, 10**6, 20, 20, 50, -7]
    b = len(table_rows)
    q = rng.standard_normal((b, 2, 4 * H, D)).astype(np.float32)
    view = PagedKVBatchLayerView({k: jnp.asarray(v) for k, v in planes.items()}, jnp.asarray(table), 0, lay, validate=False)
    out = np.asarray(
        ffi_paged_attention(jnp.asarray(q), view, jnp.asarray(table_rows), jnp.asarray(positions), jnp.asarray(kv_lens))
    )

    # Oracle: gather every key of every row (masked where the row, block or position says so).
    j_all = L * P
    keys = {name: np.zeros((b, j_all, H) + x.shape[4:], x.dtype) for name, x in planes.items()}
    visible = np.zeros((b, 2, j_all), bool)
    for i in range(b):
        row = table_rows[i]
        if not 0 <= row < c:
            continue
        kv_eff = min(max(kv_lens[i], 0), j_all)
        for j in range(j_all):
            page = int(table[row, j // P])
            if not 0 <= page < n:
                continue
            for name, tok in _tokens(planes, page, j % P).items():
                keys[name][i, j] = tok
            for t in range(2):
                visible[i, t, j] = j < kv_eff and j <= positions[i] + t
    k, v = np_codecs.decode_kv(profile, keys)
    want = np_codecs.attention(q, k, v, visible, 1.0 / np.sqrt(D))
    assert_close_to_reference(out, want)
    np.testing.assert_array_equal(out[2:4], 0.0)  # inert table rows (C and -1)
    np.testing.assert_array_equal(out[4], 0.0)  # negative query positions
    np.testing.assert_array_equal(out[5], 0.0)  # negative kv_len
    assert not visible[0, :, 64:128].any() and visible[0, :, :64].all()  # the masked block of row 0


@pytest.mark.parametrize("profile", ["bf16", "int8-g64", "k8v4"])
def test_append_drops_inert_rows_bad_blocks_and_positions_outside_the_table(profile):
    rng = np.random.default_rng(11)
    n = 40
    lay = PagedKVStorageLayout(profile, 1, H, D, "page-major")
    planes = lay.allocate(n)
    c = 8
    table = rng.permutation(n)[: c * L].reshape(c, L).astype(np.int32)
    table[2, 1] = -1
    table[3, 0] = n
    #            b0  b1  b2  b3  b4     b5  b6
    table_rows = [c, -1, 2, 3, 4, 5, 6]
    positions = [0, 0, 60, 0, -3, L * P - 2, 5]
    valid = [6, 6, 6, 6, 5, 4, -4]
    t_max = 6
    b = len(table_rows)
    k = rng.standard_normal((b, t_max, H, D)).astype(np.float32)
    v = rng.standard_normal((b, t_max, H, D)).astype(np.float32)
    view = PagedKVBatchLayerView(planes, jnp.asarray(table), 0, lay, validate=False)
    out = ffi_paged_append(view, jnp.asarray(table_rows), jnp.asarray(positions), jnp.asarray(k), jnp.asarray(v),
                           jnp.asarray(valid))

    codes = np_codecs.encode_kv(profile, k, v)
    expected = {name: np.zeros(shape, np.dtype(lay.plane_dtypes()[name])) for name, shape in lay.plane_shapes(n).items()}
    written = 0
    for i in range(b):
        row = table_rows[i]
        for t in range(min(max(valid[i], 0), t_max)):
            p = positions[i] + t
            if not 0 <= row < c or not 0 <= p < L * P:
                continue
            page = int(table[row, p // P])
            if not 0 <= page < n:
                continue
            written += 1
            for name in expected:
                expected[name][0, page, :, p % P] = codes[name][i, t]
    assert written == 4 + 0 + 2 + 2  # b2: block 0 only; b3: none (block 0 is >= N); b4: p >= 0; b5: p < L*P
    for name in expected:
        np.testing.assert_array_equal(raw_bytes(out.planes[name]), raw_bytes(expected[name]), err_msg=name)
    # valid above T is clipped to T: one more call with valid = T + 5 writes exactly the T tokens
    out2 = ffi_paged_append(view, jnp.asarray(table_rows[4:5]), jnp.asarray([0]), jnp.asarray(k[4:5]),
                            jnp.asarray(v[4:5]), jnp.asarray([t_max + 5]))
    page = int(table[4, 0])
    for name, x in np_codecs.encode_kv(profile, k[4:5], v[4:5]).items():
        got = np.asarray(out2.planes[name])[0, page, :, :t_max]
        np.testing.assert_array_equal(raw_bytes(got), raw_bytes(np.moveaxis(x[0], 0, 1)))
        assert not raw_bytes(np.asarray(out2.planes[name])[0, page, :, t_max:]).any()


@pytest.mark.parametrize("profile", ["bf16", "k8v4"])
def test_cyclic_rows_outside_the_state_are_inert(profile):
    rng = np.random.default_rng(5)
    rows = 3
    lay, planes = cyclic_state(profile, rows=rows, window=32, slots=64, heads=H, head_dim=D, layers=1, rng=rng)
    view = cyclic_view(lay, planes, 0)
    k = rng.standard_normal((3, 4, H, D)).astype(np.float32)
    bad_rows = jnp.asarray([-1, rows, 1])
    out = ffi_cyclic_append(view, bad_rows, jnp.asarray([0, 0, 0]), jnp.asarray(k), jnp.asarray(k), jnp.asarray([0, 4, 0]))
    for name in planes:  # rows -1 and 3 write nothing (row 1 has valid 0)
        np.testing.assert_array_equal(raw_bytes(out.planes[name]), raw_bytes(planes[name]), err_msg=name)
    # valid above T (and above the ring size) is clipped to T: the same planes as valid = T
    one = jnp.asarray([1])
    full = ffi_cyclic_append(view, one, jnp.asarray([0]), jnp.asarray(k[:1]), jnp.asarray(k[:1]), jnp.asarray([4]))
    over = ffi_cyclic_append(view, one, jnp.asarray([0]), jnp.asarray(k[:1]), jnp.asarray(k[:1]), jnp.asarray([100]))
    for name in planes:
        np.testing.assert_array_equal(raw_bytes(over.planes[name]), raw_bytes(full.planes[name]), err_msg=name)
        assert not np.array_equal(raw_bytes(full.planes[name]), raw_bytes(planes[name])), name
    q = rng.standard_normal((3, 1, 4 * H, D)).astype(np.float32)
    att = np.asarray(ffi_cyclic_attention(jnp.asarray(q), view, bad_rows, jnp.asarray([40, 40, 40]),
                                          jnp.asarray([41, 41, 41])))
    np.testing.assert_array_equal(att[:2], 0.0)
    assert np.isfinite(att[2]).all() and np.abs(att[2]).max() > 0
