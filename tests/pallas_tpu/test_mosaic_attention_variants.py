"""Sliding windows, logit soft caps and attention sinks in the Mosaic TPU attention kernels (TPU interpret mode).

``pallas_kernels.mosaic_tpu.paged_attention`` (decode and multi-page chunk blocks) and the native
``paged_attention_ragged`` against the float32 reference with the same options.  Pools hold their
pages in a random physical order; pages no row maps, the other layer and table entries past each
row's pages (``-1``) are poison, and so is every page wholly before the window of a row's first
query (NaN in float planes, 0xFF bytes in integer planes): the kernels must not fetch those pages
(counted here by the interpreter's DMAs) and the outputs stay finite.  With the three options
``None`` the traced programs are exactly the plain kernels'.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret

from ninfer_kv.ops.reference import (
    paged_append_reference,
    paged_attention_ragged_reference,
    paged_attention_reference,
)
from ninfer_kv.ops.views import PagedKVBatchLayerView, allocate_planes
from ninfer_kv.schema.layout import PagedKVStorageLayout
from ninfer_kv.schema.profiles import KVProfile
from pallas_kernels.mosaic_tpu import paged_attention, paged_attention_ragged
from pallas_kernels.mosaic_tpu.paged_attention import first_page

D, PAGE, BLOCKS, PAGES = 64, 64, 6, 16
LAYER = 1


def _i32(x):
    return jnp.asarray(np.asarray(x, np.int32))


def _pool(profile: KVProfile, order: str, heads: int, kv_lens, seed: int):
    """A 2-layer pool (layer 1 used): table row ``b`` holds ``kv_lens[b]`` keys on pages in random physical
    order, entries past them are -1; unused pages and layer 0 are poison.  Returns ``(view, tables, rng)``."""
    rng = np.random.default_rng(seed)
    lay = PagedKVStorageLayout(profile, 2, heads, D, order)
    planes = allocate_planes(lay, PAGES, fill=float("nan"))
    planes = {n: (p if jnp.issubdtype(p.dtype, jnp.floating) else
                  jnp.asarray(rng.integers(0, 256, p.shape).astype(np.dtype(p.dtype))))
              for n, p in planes.items()}
    perm = iter(rng.permutation(PAGES))
    tables = np.full((len(kv_lens), BLOCKS), -1, np.int32)
    for row, kv_len in enumerate(kv_lens):
        for j in range(-(-int(kv_len) // PAGE)):
            tables[row, j] = next(perm)
    view = PagedKVBatchLayerView(planes, jnp.asarray(tables), jnp.int32(LAYER), lay)
    k, v = rng.standard_normal((2, len(kv_lens), max(kv_lens), heads, D)).astype(np.float32)
    view = jax.jit(paged_append_reference)(view, _i32(np.arange(len(kv_lens))), _i32(np.zeros(len(kv_lens))),
                                           jnp.asarray(k), jnp.asarray(v * 3), _i32(kv_lens))
    return view, tables, rng


def _poison_pages(view: PagedKVBatchLayerView, physical) -> PagedKVBatchLayerView:
    """The physical pages ``physical`` of the used layer (every head) overwritten with NaN / 0xFF bytes."""
    physical = np.asarray(sorted({int(p) for p in physical}), np.int32)
    if physical.size == 0:
        return view
    planes = {}
    for name, plane in view.planes.items():
        bad = (jnp.full((), jnp.nan, plane.dtype) if jnp.issubdtype(plane.dtype, jnp.floating)
               else jnp.full((), 0xFF, plane.dtype))
        if view.layout.order.value == "page-major":
            planes[name] = plane.at[LAYER, physical].set(bad)
        else:
            planes[name] = plane.at[LAYER, :, physical].set(bad)
    return PagedKVBatchLayerView(planes, view.block_tables, view.layer, view.layout)


def _before_window(tables, rows, first_positions, window):
    """Physical pages wholly before the window of each row's first query (``first_page`` of it)."""
    out = []
    for row, p0 in zip(rows, first_positions):
        out += [int(e) for e in tables[row, :int(first_page(int(p0), window, PAGE))] if e >= 0]
    return out


def _check(got, want, q_dtype):
    got, want = np.asarray(got).astype(np.float32), np.asarray(want).astype(np.float32)
    assert np.isfinite(got).all(), "a poisoned page reached the output"
    tol = 2e-2 if q_dtype == jnp.bfloat16 else 1e-4
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    return got


@functools.cache
def _jitted(fn, **kw):
    return jax.jit(functools.partial(fn, **kw) if kw else fn, static_argnames=("window", "soft_cap"))


def _options(rng, hq, window, soft_cap, sinks):
    return dict(window=window, soft_cap=soft_cap,
                sinks=None if not sinks else jnp.asarray(rng.standard_normal(hq).astype(np.float32) * 2))


def _rect_case(profile, order, group, t_len, window, soft_cap, sinks, q_dtype, seed=0):
    heads = 2 if group == 1 else 1
    kv_lens = np.array([300, 130], np.int32)
    view, tables, rng = _pool(profile, order, heads, kv_lens, seed)
    positions = kv_lens - t_len
    if window is not None:
        view = _poison_pages(view, _before_window(tables, range(2), positions, window))
    hq = heads * group
    q = jnp.asarray((rng.standard_normal((2, t_len, hq, D)) * 3).astype(np.float32)).astype(q_dtype)
    opts = _options(rng, hq, window, soft_cap, sinks)
    args = (q, view, _i32(np.arange(2)), _i32(positions), _i32(kv_lens))
    got = _jitted(paged_attention)(*args, **opts)
    want = _jitted(paged_attention_reference)(*args, **opts)
    assert got.shape == q.shape and got.dtype == q.dtype
    return _check(got, want, q_dtype)


# -- rectangular: decode and a multi-page chunk -----------------------------------------------------------------

@pytest.mark.slow  # by default: the conformance suite's K8V4 case with every option, and the DMA count below
def test_decode_k8v4_gqa4_window_cap_sinks():
    """K8V4 page-major, GQA 4, one query per row: a 50-key window (row 0 skips pages 0..3), soft cap 5, sinks."""
    _rect_case(KVProfile.K8V4, "page-major", 4, 1, 50, 5.0, True, np.float32)


def test_chunk_bf16_gqa1_window_cap_sinks():
    """BF16 head-major, GQA 1, a 70-token chunk (two query tiles, several pages), bfloat16 queries."""
    _rect_case(KVProfile.BF16, "head-major", 1, 70, 64, 20.0, True, jnp.bfloat16)


_SWEEP = [pytest.param(prof, order, group, t, window, cap, sinks, qd,
                       id=f"{prof.value}-{order}-g{group}-t{t}-w{window}-c{cap}-s{int(sinks)}-{np.dtype(qd).name}",
                       marks=pytest.mark.slow)
          for prof, qd in ((KVProfile.BF16, jnp.bfloat16), (KVProfile.K8V4, np.float32))
          for order in ("page-major", "head-major")
          for group in (1, 4)
          for t in (1, 70)
          for window, cap, sinks in ((7, None, False), (64, 50.0, False), (1000, None, True), (100, 8.0, True),
                                     (None, 10.0, False), (None, None, True))]


@pytest.mark.parametrize("profile, order, group, t_len, window, soft_cap, sinks, q_dtype", _SWEEP)
def test_rectangular_sweep(profile, order, group, t_len, window, soft_cap, sinks, q_dtype):
    _rect_case(profile, order, group, t_len, window, soft_cap, sinks, q_dtype, seed=3)


# -- ragged ---------------------------------------------------------------------------------------------------

LEAD, TAIL = 1, 2


def _ragged_case(profile, order, group, window, soft_cap, sinks, q_dtype, seed=1):
    """A 70-token chunk ending at key 300, an empty row, a decode at key 129 and a 5-token chunk at [60, 65)."""
    heads = 2 if group == 1 else 1
    kv_lens = np.array([300, 10, 130, 65], np.int32)
    lengths = np.array([70, 0, 1, 5], np.int32)
    positions = kv_lens - lengths
    starts = (LEAD + np.concatenate([[0], np.cumsum(lengths)])).astype(np.int32)
    n = int(starts[-1]) + TAIL
    view, tables, rng = _pool(profile, order, heads, kv_lens, seed)
    if window is not None:
        live = lengths > 0
        view = _poison_pages(view, _before_window(tables, np.flatnonzero(live), positions[live], window))
    hq = heads * group
    q = jnp.asarray((rng.standard_normal((n, hq, D)) * 3).astype(np.float32)).astype(q_dtype)
    opts = _options(rng, hq, window, soft_cap, sinks)
    args = (q, view, _i32(np.arange(4)), _i32(positions), _i32(kv_lens), _i32(starts))
    got = _check(_jitted(paged_attention_ragged)(*args, **opts),
                 _jitted(paged_attention_ragged_reference)(*args, **opts), q_dtype)
    assert not got[:LEAD].any() and not got[starts[-1]:].any(), "padding tokens must return exact zeros"
    return got


@pytest.mark.slow  # by default: the conformance suite's ragged case with every option, and the DMA count below
def test_ragged_bf16_gqa4_window_cap_sinks():
    _ragged_case(KVProfile.BF16, "page-major", 4, 40, 10.0, True, jnp.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("profile, order, q_dtype", [(KVProfile.K8V4, "head-major", np.float32),
                                                     (KVProfile.BF16, "head-major", np.float32)])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("window, soft_cap, sinks", [(1, None, False), (64, 30.0, True), (500, 5.0, False)])
def test_ragged_sweep(profile, order, q_dtype, group, window, soft_cap, sinks):
    _ragged_case(profile, order, group, window, soft_cap, sinks, q_dtype, seed=5)


# -- no cost when unused --------------------------------------------------------------------------------------

def test_none_options_trace_the_plain_kernels():
    """With all three options ``None`` the traced programs are the plain kernels' (rectangular and ragged)."""
    lay = PagedKVStorageLayout(KVProfile.K8V4, 2, 1, D, "page-major")
    view = PagedKVBatchLayerView(allocate_planes(lay, 4), jnp.zeros((2, 3), jnp.int32), jnp.int32(1), lay)
    rows, pos, lens = _i32([0, 1]), _i32([5, 70]), _i32([6, 71])
    q = jnp.zeros((2, 3, 4, D), jnp.bfloat16)
    none = dict(window=None, soft_cap=None, sinks=None)
    plain = str(jax.make_jaxpr(lambda q, v: paged_attention(q, v, rows, pos, lens))(q, view))
    assert plain == str(jax.make_jaxpr(lambda q, v: paged_attention(q, v, rows, pos, lens, **none))(q, view))
    qr, starts = jnp.zeros((8, 4, D), jnp.float32), _i32([0, 1, 8])
    plain = str(jax.make_jaxpr(lambda q, v: paged_attention_ragged(q, v, rows, pos, lens, starts))(qr, view))
    assert plain == str(jax.make_jaxpr(
        lambda q, v: paged_attention_ragged(q, v, rows, pos, lens, starts, **none))(qr, view))
    windowed = str(jax.make_jaxpr(lambda q, v: paged_attention(q, v, rows, pos, lens, window=4))(q, view))
    assert windowed != str(jax.make_jaxpr(lambda q, v: paged_attention(q, v, rows, pos, lens))(q, view))


# -- pages outside the window are not fetched -----------------------------------------------------------------

def test_first_page():
    assert [int(first_page(p, w, 64)) for p, w in ((0, 1), (63, 1), (64, 1), (126, 64), (127, 64), (191, 64),
                                                   (300, 50), (-5, 3), (10, 2**40), (2**31 - 1, 1))] == \
        [0, 0, 1, 0, 1, 2, 3, 0, 0, (2**31 - 1) // 64]


def _count_dmas(monkeypatch, fn, *args, **kw) -> tuple[np.ndarray, int]:
    """Run ``fn`` (traced afresh) counting the DMAs the interpreter starts."""
    count = [0]
    real = tpu_interpret.dma_start

    def counting(*a, **k):
        count[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(tpu_interpret, "dma_start", counting)
    out = np.asarray(jax.jit(lambda *a: fn(*a, **kw))(*args))
    return out, count[0]


def test_windowed_rows_fetch_only_their_window(monkeypatch):
    """The DMAs of a ragged round (BF16, 2 planes, 1 KV head): each program fetches the pages from its first
    query's first visible page up to its key frontier; without a window, every page below the frontier."""
    kv_lens = np.array([300, 130, 65, 10], np.int32)
    lengths = np.array([1, 1, 5, 1], np.int32)
    positions = np.array([299, 129, 60, 100], np.int32)  # decodes at 299, 129, 100 (10 keys), a chunk at [60, 65)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    view, _, rng = _pool(KVProfile.BF16, "page-major", 1, kv_lens, seed=7)
    q = jnp.asarray(rng.standard_normal((int(starts[-1]), 1, D)).astype(np.float32))
    args = (q, view, _i32(np.arange(4)), _i32(positions), _i32(kv_lens), _i32(starts))
    planes = 2
    _, full = _count_dmas(monkeypatch, paged_attention_ragged, *args)
    assert full == planes * (5 + 3 + 2 + 1)  # pages below ceil(hi / 64): 300 -> 5, 130 -> 3, 65 -> 2, 10 -> 1
    # window 66: decode 299 sees [234, 299] (pages 3, 4), decode 129 [64, 129] (1, 2), the chunk from 60 on
    # (0, 1), decode 100 [35, 100] but holds keys [0, 10) only: no page
    window = 66
    want = paged_attention_ragged_reference(*args, window=window)
    got, windowed = _count_dmas(monkeypatch, paged_attention_ragged, *args, window=window)
    assert windowed == planes * (2 + 2 + 2 + 0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert not got[starts[3]].any() and got[starts[2]].any()
    # the rectangular kernel, two decode rows: 50 keys back from 299 and 129 -> pages 3..4 and 1..2
    rq = jnp.asarray(rng.standard_normal((2, 1, 1, D)).astype(np.float32))
    rargs = (rq, view, _i32([0, 1]), _i32([299, 129]), _i32([300, 130]))
    got, windowed = _count_dmas(monkeypatch, paged_attention, *rargs, window=50)
    assert windowed == planes * (2 + 2)
    np.testing.assert_allclose(got, paged_attention_reference(*rargs, window=50), rtol=1e-4, atol=1e-4)
