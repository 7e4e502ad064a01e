"""The native ragged forms of the Mosaic TPU backend (``pallas_kernels.mosaic_tpu.ragged``) in TPU interpret mode.

One round holds a chunk ending mid page, an empty row, a decode and a chunk crossing a page boundary,
with padding tokens before the first and after the last row.  Pools hold their pages in a random
physical order; every page no row maps, the other layer and the table entries past each row's
blocks (the sentinel ``-1``) are poison (NaN in float planes, random bytes in integer planes).
Appends must store the float32 reference's bits and change nothing else; attention must be finite,
close to the float32 reference and exact zeros on padding; on the bf16 profile it must also agree
with JAX's own ragged paged attention reference
(``jax.experimental.pallas.ops.tpu.ragged_paged_attention.ref_ragged_paged_attention``) over the
same keys re-paged into its layout.  One case runs with the interpreter's race detector on.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret
from jax.experimental.pallas import tpu as pltpu

from ninfer_kv.schema.layout import PagedKVStorageLayout
from ninfer_kv.ops.reference import (
    paged_append_ragged_reference,
    paged_append_reference,
    paged_attention_ragged_reference,
)
from ninfer_kv.schema.profiles import KVProfile
from ninfer_kv.ops.views import PagedKVBatchLayerView, allocate_planes
from pallas_kernels.mosaic_tpu import paged_append_ragged, paged_attention_ragged

HEADS, GROUP, D, PAGES, BLOCKS, PAGE = 2, 2, 64, 9, 3, 64
LEAD, TAIL = 1, 2  # padding tokens before the first and after the last row

# The round's rows: (table row, kv_len, query length).  A 5-token chunk ending mid page (keys 65..69),
# an empty row, a decode at key 40, a 4-token chunk crossing the page boundary at 128.
TABLE_ROWS = np.array([3, 0, 4, 1], np.int32)
KV_LENS = np.array([70, 10, 41, 130], np.int32)
LENGTHS = np.array([5, 0, 1, 4], np.int32)


def _starts(lengths) -> np.ndarray:
    return (LEAD + np.concatenate([[0], np.cumsum(lengths)])).astype(np.int32)


def _i32(x):
    return jnp.asarray(np.asarray(x, np.int32))


def _pool(profile: KVProfile, order: str, seed: int):
    """A poisoned 2-layer pool (layer 1 used): table rows 3, 0, 4, 1 hold KV_LENS keys on pages in random
    order, table row 2 maps nothing, two physical pages are unused."""
    rng = np.random.default_rng(seed)
    lay = PagedKVStorageLayout(profile, 2, HEADS, D, order)
    planes = allocate_planes(lay, PAGES, fill=float("nan"))
    planes = {n: (p if jnp.issubdtype(p.dtype, jnp.floating) else
                  jnp.asarray(rng.integers(0, 256, p.shape).astype(np.dtype(p.dtype))))
              for n, p in planes.items()}
    perm = iter(rng.permutation(PAGES))
    tables = np.full((5, BLOCKS), -1, np.int32)
    for row, kv_len in zip(TABLE_ROWS, KV_LENS):
        for j in range(-(-int(kv_len) // PAGE)):
            tables[row, j] = next(perm)
    view = PagedKVBatchLayerView(planes, jnp.asarray(tables), jnp.int32(1), lay)
    t = int(KV_LENS.max())
    k, v = (rng.standard_normal((2, len(KV_LENS), t, HEADS, D)).astype(np.float32)
            * np.array([1, 3], np.float32)[:, None, None, None, None])
    view = jax.jit(paged_append_reference)(view, _i32(TABLE_ROWS), jnp.zeros(len(KV_LENS), jnp.int32),
                                           jnp.asarray(k), jnp.asarray(v), _i32(KV_LENS))
    return view, rng


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(f"uint{8 * x.dtype.itemsize}")


# Jitted once per module: the tests share shapes (N = 13 for attention, 77 for appends), so each
# program is traced and compiled once and reused (TPU interpret mode compiles slowly).
@functools.cache
def _jitted(fn, interpret=None):
    return jax.jit(fn if interpret is None else functools.partial(fn, interpret=interpret))


def _attention(view, q, positions, kv_lens, starts, table_rows=TABLE_ROWS, interpret=None):
    args = (jnp.asarray(q), view, _i32(table_rows), _i32(positions), _i32(kv_lens), _i32(starts))
    got = np.asarray(_jitted(paged_attention_ragged, interpret)(*args))
    want = np.asarray(_jitted(paged_attention_ragged_reference)(*args))
    assert got.shape == q.shape and got.dtype == q.dtype
    got, want = got.astype(np.float32), want.astype(np.float32)
    assert np.isfinite(got).all()
    tol = 2e-2 if q.dtype == jnp.bfloat16 else 2e-5
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    n = q.shape[0]
    pad = np.r_[0:int(np.clip(starts[0], 0, n)), int(np.clip(starts[-1], 0, n)):n]
    assert not got[pad].any(), "padding tokens must return exact zeros"
    return got


def _append(view, k, v, positions, starts, table_rows=TABLE_ROWS, interpret=None):
    args = (view, _i32(table_rows), _i32(positions), jnp.asarray(k), jnp.asarray(v), _i32(starts))
    got = _jitted(paged_append_ragged, interpret)(*args).planes
    want = _jitted(paged_append_ragged_reference)(*args).planes
    for name in want:
        np.testing.assert_array_equal(_bits(got[name]), _bits(want[name]), err_msg=name)


N_ATTENTION = int(_starts(LENGTHS)[-1]) + TAIL  # 13 tokens
N_APPEND = 77  # tokens of every append round


def _queries(rng, dtype=np.float32):
    return rng.standard_normal((N_ATTENTION, HEADS * GROUP, D)).astype(np.float32).astype(dtype)


def _kv(rng, dtype=np.float32):
    k, v = (rng.standard_normal((2, N_APPEND, HEADS, D)) * 2).astype(np.float32).astype(dtype)
    return k, v


# The cases: K8V4 (both kinds of scale plane) page-major, BF16 head-major with bfloat16 queries, and
# under -m slow every other (profile, plane order) with float32 inputs.
_DEFAULT = (("k8v4", "page-major"), ("bf16", "head-major"))
_CASES = [pytest.param(KVProfile.K8V4, "page-major", np.float32, id="k8v4-page-major"),
          pytest.param(KVProfile.BF16, "head-major", jnp.bfloat16, id="bf16-head-major")]
_CASES += [pytest.param(p, o, np.float32, id=f"{p.value}-{o}", marks=pytest.mark.slow) for p in KVProfile
           for o in ("page-major", "head-major") if (p.value, o) not in _DEFAULT]


# The K8V4 page-major append and attention run by default in the race-detection test and the
# conformance suite; here the default run takes the bf16 head-major case only.
_BY_DEFAULT = [pytest.param(*c.values, id=c.id, marks=pytest.mark.slow) if c.id == "k8v4-page-major" else c
               for c in _CASES]


@pytest.mark.parametrize("profile, order, q_dtype", _BY_DEFAULT)
def test_ragged_attention_matches_the_reference(profile, order, q_dtype):
    """Each row's queries end at its last key; every real token matches, padding is zeros."""
    view, rng = _pool(profile, order, seed=1)
    _attention(view, _queries(rng, q_dtype), KV_LENS - LENGTHS, KV_LENS, _starts(LENGTHS))


@pytest.mark.parametrize("profile, order, q_dtype", _BY_DEFAULT)
def test_ragged_append_is_bit_exact(profile, order, q_dtype):
    """A chunk crossing a page boundary, an empty row, a decode at a page start, a chunk of more than a
    page ending at capacity: the reference's bits, nothing else touched."""
    view, rng = _pool(profile, order, seed=2)
    lengths = np.array([7, 0, 1, 66], np.int32)
    positions = np.array([60, 3, 64, BLOCKS * PAGE - 66], np.int32)
    starts = _starts(lengths)
    assert starts[-1] + TAIL == N_APPEND
    k, v = _kv(rng, q_dtype)
    _append(view, k, v, positions, starts)


def test_ragged_out_of_range_rules_match_the_reference():
    """Under jax.jit: a table row outside [0, C) is inert, a -1 table entry drops its tokens and hides its
    keys, negative positions are dropped (a row's tokens from position 0 on are kept) and a query at a
    negative position sees no key; the append round's 62 padding tokens after its last row are inert."""
    view, rng = _pool(KVProfile.K8V4, "page-major", seed=3)
    table_rows = np.array([7, 2, 4, -1], np.int32)  # 7 and -1: no table row; 2: every entry -1
    for lengths, positions, kv_lens, n in (
            ([3, 2, 1, 4], [10, 70, -3, 0], [20, 80, 41, 5], N_ATTENTION),
            ([3, 2, 5, 4], [10, 70, -3, 0], None, N_APPEND)):
        starts = _starts(lengths)
        assert starts[-1] + TAIL <= n
        if kv_lens is None:
            k, v = _kv(rng)
            _append(view, k, v, positions, starts, table_rows=table_rows)
        else:
            _attention(view, _queries(rng), positions, kv_lens, starts, table_rows=table_rows)
    # the table row of the decode row above holds real keys: a query at a negative position sees none
    starts = _starts([3, 2, 1, 4])
    got = _attention(view, _queries(rng), [66, 70, -1, -2], [70, 80, 41, 130], starts,
                     table_rows=np.array([3, 2, 4, 1], np.int32))
    assert not got[starts[1]:starts[3] + 2].any(), "no visible key: zeros"
    assert np.abs(got[starts[3] + 2:starts[4]]).sum(axis=(1, 2)).all(), "positions 0 and 1 of the last row see keys"


def test_ragged_with_race_detection():
    """A decode and two chunks, append then attention, under the race detector: same results, no race."""
    view, rng = _pool(KVProfile.K8V4, "page-major", seed=4)
    params = pltpu.InterpretParams(detect_races=True)
    lengths = np.array([3, 0, 1, 2], np.int32)
    positions = KV_LENS - 4
    starts = _starts(lengths)
    n = int(starts[-1]) + TAIL
    k, v = rng.standard_normal((2, n, HEADS, D)).astype(np.float32)
    _append(view, k, v, positions, starts, interpret=params)
    assert not tpu_interpret.races.races_found, "the race detector found a race in paged_append_ragged"
    q = rng.standard_normal((n, HEADS * GROUP, D)).astype(np.float32)
    _attention(view, q, positions, positions + lengths, starts, interpret=params)
    assert not tpu_interpret.races.races_found, "the race detector found a race in paged_attention_ragged"


def _jax_layout(view: PagedKVBatchLayerView, kv_lens, page_size: int, rng):
    """The bf16 keys and values of each row re-paged for JAX's reference: ``kv_pages (P, page_size, 2H, D)``
    (K heads at even, V heads at odd combined heads), pages in random order, and ``page_indices (R, W)``."""
    lay = view.layout
    planes = {n: np.asarray(view.planes[n][1], np.float32) for n in ("k", "v")}  # layer 1
    tables = np.asarray(view.block_tables)
    per_row = [-(-int(n) // page_size) for n in kv_lens]
    width = max(per_row)
    order = rng.permutation(sum(per_row))
    kv_pages = np.zeros((len(order), page_size, 2 * HEADS, D), np.float32)
    page_indices = np.zeros((len(kv_lens), width), np.int32)
    used = 0
    for r, (row, n) in enumerate(zip(TABLE_ROWS, kv_lens)):
        j = np.arange(int(n))
        pages, cols = tables[row, j // PAGE], j % PAGE
        for name, parity in (("k", 0), ("v", 1)):
            # (keys, H, D) in logical order from our planes
            x = (planes[name][pages, :, cols] if lay.order.value == "page-major"
                 else np.transpose(planes[name][:, pages, cols], (1, 0, 2)))
            for p in range(per_row[r]):
                chunk = x[p * page_size:(p + 1) * page_size]
                kv_pages[order[used + p], :len(chunk), parity::2] = chunk
        page_indices[r, :per_row[r]] = order[used:used + per_row[r]]
        used += per_row[r]
    return jnp.asarray(kv_pages, jnp.bfloat16), jnp.asarray(page_indices)


def test_bf16_agrees_with_jax_ragged_paged_attention_reference():
    """The bf16 pool's round against JAX's own ragged reference (its pages of 16 keys built from our
    planes; no sliding window, no soft cap): the same outputs within bfloat16 rounding."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
        ref_ragged_paged_attention,
    )

    view, rng = _pool(KVProfile.BF16, "head-major", seed=5)
    q = _queries(rng, jnp.bfloat16)
    starts = _starts(LENGTHS)
    sm_scale = 1.0 / D**0.5  # the ops' default
    got = _attention(view, q, KV_LENS - LENGTHS, KV_LENS, starts)
    kv_pages, page_indices = _jax_layout(view, KV_LENS, 16, rng)
    real = slice(int(starts[0]), int(starts[-1]))
    want = ref_ragged_paged_attention(jnp.asarray(q[real]), kv_pages, _i32(KV_LENS), page_indices,
                                      _i32(starts - starts[0]), _i32([len(KV_LENS)]), sm_scale=sm_scale,
                                      sliding_window=None, soft_cap=None)
    np.testing.assert_allclose(got[real].astype(np.float32), np.asarray(want, np.float32), rtol=3e-2, atol=3e-2)
    assert not got[:starts[0]].astype(np.float32).any() and not got[starts[-1]:].astype(np.float32).any()
