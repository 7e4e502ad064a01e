"""Sliding windows, logit soft caps and attention sinks in the Triton attention kernels (Pallas interpreter).

``pk.paged_attention`` (decode and chunk programs, context splits) and the native
``pk.paged_attention_ragged`` (decode rows and chunk blocks) against the float32 reference with the
same options, on pools whose pages come in random physical order, whose unused pages are NaN
poison, and whose pages (and table entries) wholly before every query's window are poisoned too.
Also: the pages before a window are never visited (a key source that returns NaN values there
would turn the output into NaN), the plain kernel traces exactly as without the options, and the
traffic bench counts a windowed row's pages only.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
import pallas_kernels.triton.paged_attention as tpa
import pallas_kernels.triton.ragged as tragged
from ninfer_kv.ops.reference import paged_attention_ragged_reference, paged_attention_reference
from tests.conformance.cases import make_paged_case, plane_index
from tests.conformance.checks import assert_attention_close

PAGE = 64
D = 64
KV_HEADS = 2


def _i32(x):
    return jnp.asarray(np.asarray(x, np.int32))


def _poison_before(case, first_keys):
    """NaN (float planes) or 0xFF bytes (integer planes) in every page of row ``b`` wholly before
    ``first_keys[b]``, and junk in those table entries: nothing there may reach an output."""
    planes = {k: v.copy() for k, v in case.planes.items()}
    tables = case.block_tables.copy()
    for b, first in enumerate(first_keys):
        for blk in range(int(first) // PAGE):
            page = int(tables[case.table_rows[b], blk])  # a page of the row's own
            idx = plane_index(case.layout.order, case.layer, page, np.arange(PAGE))
            for x in planes.values():
                if np.issubdtype(x.dtype, np.integer):
                    x.view(np.uint8)[idx] = 0xFF
                else:
                    x[idx] = np.nan
            tables[case.table_rows[b], blk] = -1 if blk % 2 else 2**31 - 1
    return planes, tables


def _queries(rng, shape, dtype):
    return jnp.asarray((rng.standard_normal(shape) * 4).astype(np.float32)).astype(dtype)


def _sinks(rng, hq, use):
    # random normal, spread to the scores' range so that the sink's share of the softmax matters
    return jnp.asarray((rng.standard_normal(hq) * 3).astype(np.float32)) if use else None


def _check_paged(profile, order, group, t, window, soft_cap, use_sinks, q_dtype, config=None, seed=0):
    kv_lens = np.array([150, 90, 0])
    positions = np.array([149, 89, 5]) if t == 1 else np.array([150 - t, 90 - t, 0])
    case = make_paged_case(profile, order, kv_lens=kv_lens, heads=KV_HEADS, head_dim=D, logical_pages=3, seed=seed)
    hq = KV_HEADS * group
    rng = np.random.default_rng(seed)
    q = _queries(rng, (3, t, hq, D), q_dtype)
    sinks = _sinks(rng, hq, use_sinks)
    first = np.zeros(3, np.int64) if window is None else np.maximum(positions - window + 1, 0)
    planes, tables = _poison_before(case, first)
    view = case.view(planes, tables)
    call = jax.jit(lambda q, view, r, p, n, s: pk.paged_attention(
        q, view, r, p, n, sm_scale=0.125, window=window, soft_cap=soft_cap, sinks=s, config=config, interpret=True))
    got = call(q, view, _i32(case.table_rows), _i32(positions), _i32(kv_lens), sinks)
    want = paged_attention_reference(q.astype(jnp.float32), case.view(), _i32(case.table_rows), _i32(positions),
                                     _i32(kv_lens), sm_scale=0.125, window=window, soft_cap=soft_cap, sinks=sinks)
    what = f"{profile} {order} G{group} T{t} w{window} cap{soft_cap} sinks{use_sinks}"
    g = assert_attention_close(got, np.asarray(want), backend="pallas", q_dtype=q_dtype, what=what)
    assert not g[2].any(), "a row with no visible key returns exact zeros (a sink adds no numerator)"


_SPLIT = pk.PagedAttentionConfig(block_q=16, k_splits=3)

PAGED = [  # profile, order, group, T, window, soft_cap, sinks, q dtype, config
    # -m slow: by default the conformance suite's cases and the unvisited-pages test (3 splits) below
    pytest.param("bf16", "page-major", 4, 1, 100, 20.0, True, jnp.bfloat16, _SPLIT, id="bf16-pm-g4-decode-split",
                 marks=pytest.mark.slow),
    # -m slow: the conformance suite holds K8V4 windows, soft caps and sinks to the oracle by default
    pytest.param("k8v4", "head-major", 1, 70, 64, 5.0, True, jnp.float32, _SPLIT, id="k8v4-hm-g1-chunk",
                 marks=pytest.mark.slow),
    pytest.param("bf16", "head-major", 4, 70, 1000, None, True, jnp.float32, None, id="bf16-hm-g4-chunk-wide",
                 marks=pytest.mark.slow),
    pytest.param("k8v4", "page-major", 1, 1, 1, 50.0, False, jnp.bfloat16, None, id="k8v4-pm-g1-decode-w1",
                 marks=pytest.mark.slow),
    pytest.param("bf16", "page-major", 1, 1, None, 5.0, True, jnp.float32, None, id="bf16-pm-g1-cap-sinks",
                 marks=pytest.mark.slow),
    pytest.param("k8v4", "page-major", 4, 70, 64, None, None, jnp.bfloat16, _SPLIT, id="k8v4-pm-g4-chunk-window",
                 marks=pytest.mark.slow),
    pytest.param("k8v4", "head-major", 4, 1, 100, 30.0, True, jnp.float32, None, id="k8v4-hm-g4-decode",
                 marks=pytest.mark.slow),
    pytest.param("bf16", "head-major", 1, 70, 30, 10.0, False, jnp.bfloat16, _SPLIT, id="bf16-hm-g1-chunk",
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("profile, order, group, t, window, soft_cap, sinks, q_dtype, config", PAGED)
def test_paged_attention_variants_match_the_reference(profile, order, group, t, window, soft_cap, sinks, q_dtype,
                                                      config):
    _check_paged(profile, order, group, t, window, soft_cap, bool(sinks), q_dtype, config)


def _starts(lengths, lead=2):
    return (lead + np.concatenate([[0], np.cumsum(lengths)])).astype(np.int32)


def _check_ragged(profile, order, group, window, soft_cap, use_sinks, q_dtype, config=None, seed=3):
    # a 70-token chunk crossing pages, an empty row, a decode, a decode with no key, a 9-token chunk
    kv_lens = np.array([160, 0, 150, 0, 129])
    lengths = np.array([70, 0, 1, 1, 9])
    positions = np.array([90, 0, 149, 7, 100])
    case = make_paged_case(profile, order, kv_lens=kv_lens, heads=KV_HEADS, head_dim=D, logical_pages=3, seed=seed)
    starts = _starts(lengths)
    n = int(starts[-1]) + 3
    hq = KV_HEADS * group
    rng = np.random.default_rng(seed)
    q = _queries(rng, (n, hq, D), q_dtype)
    sinks = _sinks(rng, hq, use_sinks)
    first = np.zeros(5, np.int64) if window is None else np.maximum(positions - window + 1, 0)
    planes, tables = _poison_before(case, first)
    call = jax.jit(lambda q, view, r, p, kv, s, sk: pk.paged_attention_ragged(
        q, view, r, p, kv, s, sm_scale=0.125, window=window, soft_cap=soft_cap, sinks=sk, config=config,
        interpret=True))
    args = (_i32(case.table_rows), _i32(positions), _i32(kv_lens), _i32(starts))
    got = call(q, case.view(planes, tables), *args, sinks)
    want = paged_attention_ragged_reference(q.astype(jnp.float32), case.view(), *args, sm_scale=0.125, window=window,
                                            soft_cap=soft_cap, sinks=sinks)
    what = f"ragged {profile} {order} G{group} w{window} cap{soft_cap} sinks{use_sinks}"
    g = assert_attention_close(got, np.asarray(want), backend="pallas", q_dtype=q_dtype, what=what)
    assert not g[np.r_[0:2, n - 3:n]].any(), "padding tokens return exact zeros"
    assert not g[starts[3]].any(), "a decode with no visible key returns exact zeros"


RAGGED = [  # profile, order, group, window, soft_cap, sinks, q dtype, config
    # -m slow: by default the conformance suite's ragged case and the unvisited-pages test below
    # (ragged decode and chunk blocks) run the native ragged kernels with every option
    pytest.param("bf16", "head-major", 4, 40, 8.0, True, jnp.bfloat16, pk.PagedAttentionConfig(block_q=16, k_splits=2),
                 id="bf16-hm-g4-q16-s2", marks=pytest.mark.slow),
    pytest.param("k8v4", "page-major", 1, 64, 30.0, True, jnp.float32, None, id="k8v4-pm-g1-default",
                 marks=pytest.mark.slow),
    pytest.param("k8v4", "head-major", 4, 5, None, True, jnp.float32, None, id="k8v4-hm-g4-w5",
                 marks=pytest.mark.slow),
    pytest.param("bf16", "page-major", 1, None, 5.0, False, jnp.bfloat16, pk.PagedAttentionConfig(block_q=8),
                 id="bf16-pm-g1-cap", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("profile, order, group, window, soft_cap, sinks, q_dtype, config", RAGGED)
def test_ragged_attention_variants_match_the_reference(profile, order, group, window, soft_cap, sinks, q_dtype,
                                                       config):
    _check_ragged(profile, order, group, window, soft_cap, sinks, q_dtype, config)


# -- pages before the window are not visited -----------------------------------------------------------------------


def _probe(monkeypatch, floor: int):
    """Make every key source return NaN values for keys below ``floor``: a program that visits a step
    holding such keys (loaded or masked) ends with NaN in its accumulators (``0 * NaN``)."""
    orig = tpa.paged_key_source

    def probing(backend, view, bk):
        make = orig(backend, view, bk)

        def make_key_source(*args):
            inner = make(*args)

            def key_source(step, j, key_ok):
                load, key_ok = inner(step, j, key_ok)
                below = j < floor

                def poisoned(name, cols):
                    tile = load(name, cols)
                    if not jnp.issubdtype(tile.dtype, jnp.floating):
                        return tile
                    mask = below if tile.ndim == 1 else below[:, None]
                    return jnp.where(mask, jnp.full(tile.shape, jnp.nan, tile.dtype), tile)

                return poisoned, key_ok

            return key_source

        return make_key_source

    monkeypatch.setattr(tpa, "paged_key_source", probing)
    monkeypatch.setattr(tragged, "paged_key_source", probing)


def test_pages_before_the_window_are_not_visited(monkeypatch):
    # Rows of 256 keys.  Paged: 12-token chunks at [218, 230) in tiles of 4 (split in 3); ragged: a
    # decode at 229 and a 12-token chunk at [218, 230) in blocks of 4.  Window 40: every program's
    # first visible key is >= 218 - 39 = 179, in page 2, so pages 0 and 1 are never visited.
    window, floor = 40, 2 * PAGE
    case = make_paged_case("bf16", "page-major", kv_lens=[256, 256], heads=KV_HEADS, head_dim=D, logical_pages=4,
                           seed=5)
    rng = np.random.default_rng(5)
    view, rows, lens = case.view(), _i32(case.table_rows), _i32([256, 256])
    _probe(monkeypatch, floor)
    config = pk.PagedAttentionConfig(block_q=4, k_splits=3)
    q = _queries(rng, (2, 12, 4, D), jnp.float32)
    for w in (window, None):
        out = np.asarray(pk.paged_attention(q, view, rows, _i32([218, 229 - 11]), lens, window=w, config=config,
                                            interpret=True))
        if w is None:  # the probe works: full attention visits pages 0 and 1
            assert np.isnan(out).any()
        else:
            assert np.isfinite(out).all(), "a page before the window was visited"
    q = _queries(rng, (13, 4, D), jnp.float32)
    args = (rows, _i32([229, 218]), lens, _i32([0, 1, 13]))
    for w in (window, None):
        out = np.asarray(pk.paged_attention_ragged(q, view, *args, window=w,
                                                   config=pk.PagedAttentionConfig(block_q=4), interpret=True))
        assert np.isnan(out).any() if w is None else np.isfinite(out).all()


# -- no cost when unused --------------------------------------------------------------------------------------------


def test_the_plain_kernels_trace_as_without_the_options():
    case = make_paged_case("k8v4", "head-major", kv_lens=[150, 40], heads=KV_HEADS, head_dim=D, seed=1)
    view, rows, pos, lens = case.view(), _i32(case.table_rows), _i32([149, 39]), _i32([150, 40])
    none = dict(window=None, soft_cap=None, sinks=None)
    for t, config in ((1, pk.PagedAttentionConfig(k_splits=2)), (20, pk.PagedAttentionConfig(block_q=4))):
        q = jnp.zeros((2, t, 8, D), jnp.bfloat16)
        plain = jax.make_jaxpr(lambda q, v: pk.paged_attention(q, v, rows, pos, lens, config=config,
                                                               interpret=True))(q, view)
        given = jax.make_jaxpr(lambda q, v: pk.paged_attention(q, v, rows, pos, lens, config=config, interpret=True,
                                                               **none))(q, view)
        assert str(plain) == str(given)
        windowed = jax.make_jaxpr(lambda q, v: pk.paged_attention(q, v, rows, pos, lens, config=config,
                                                                  interpret=True, window=8))(q, view)
        assert str(windowed) != str(plain)  # the comparison can tell programs apart
    q = jnp.zeros((13, 8, D), jnp.float32)
    starts = _i32([0, 12, 13])
    plain = jax.make_jaxpr(lambda q, v: pk.paged_attention_ragged(q, v, rows, pos, lens, starts,
                                                                  interpret=True))(q, view)
    given = jax.make_jaxpr(lambda q, v: pk.paged_attention_ragged(q, v, rows, pos, lens, starts, interpret=True,
                                                                  **none))(q, view)
    assert str(plain) == str(given)


def test_variant_options_are_checked():
    case = make_paged_case("bf16", "page-major", kv_lens=[10], heads=KV_HEADS, head_dim=D, seed=2)
    q = jnp.zeros((1, 1, 4, D), jnp.float32)
    args = (case.view(), _i32(case.table_rows), _i32([9]), _i32([10]))
    with pytest.raises(ValueError, match="window"):
        pk.paged_attention(q, *args, window=0, interpret=True)
    with pytest.raises(ValueError, match="soft_cap"):
        pk.paged_attention(q, *args, soft_cap=-1.0, interpret=True)
    with pytest.raises(ValueError, match="sinks"):
        pk.paged_attention(q, *args, sinks=jnp.zeros((3,), jnp.float32), interpret=True)


# -- the traffic bench ----------------------------------------------------------------------------------------------




def test_traffic_counts_only_the_pages_a_windowed_row_reads(bench):
    geo, h = bench.Geometry(max_model_len=8192), 8
    config = bench.PagedAttentionConfig()
    # 4 decodes at 4K keys (query at 4095), window 128: keys [3968, 4096) -> pages 62, 63 (2 pages, not 64).
    call = bench.decodes(4, 4096)
    rows, pages = bench.triton_native(geo, config, call, window=128)
    assert pages == 4 * 2 * h and rows == 4 * 128 * h
    assert bench.ideal_pages(geo, call, 1, window=128) == pages
    full_rows, full_pages = bench.triton_native(geo, config, call)
    assert full_pages == 4 * 64 * h and full_rows == 4 * 4096 * h
    # A window that starts mid-page: query 4095, window 100 -> keys [3996, 4096): pages 62 and 63 again.
    assert bench.triton_native(geo, config, call, window=100) == (4 * 100 * h, 4 * 2 * h)
    # Splits divide only the visible range (no step read twice): 3 splits over 2 steps read the same.
    split = bench.PagedAttentionConfig(k_splits=3)
    assert bench.triton_native(geo, split, call, window=100) == (4 * 100 * h, 4 * 2 * h)
    # A chunk [1000, 1032) with 1032 keys, window 64, one block of 32 (the default's cap at N = 32):
    # lo = 937 (page 14), hi 1032 (page 16): 3 pages, 95 key rows.
    chunk = bench.chunk(1000, 32, 1032)
    assert bench.native_block_q(geo, config, chunk, "triton") == 32
    assert bench.triton_native(geo, config, chunk, window=64) == (95 * h, 3 * h)
    assert bench.ideal_pages(geo, chunk, 32, window=64) == 3 * h
    # A window longer than the context reads what full attention reads.
    assert bench.triton_native(geo, config, chunk, window=5000) == bench.triton_native(geo, config, chunk)
    # Mosaic fetches whole pages from the one holding each program's first visible key.
    assert bench.mosaic_native(geo, config, call, window=128) == 4 * 2 * h
    assert bench.mosaic_native(geo, config, call) == 4 * 64 * h
    assert bench.mosaic_native(geo, config, chunk, window=5000) == bench.mosaic_native(geo, config, chunk)
