"""The Triton ragged kernels (pallas_kernels/triton/ragged.py) in the Pallas interpreter: rows cut into
several blocks, context splits, both plane orders, explicit configs.

The conformance suite (tests/conformance/test_ragged.py) holds every backend to the per-row model
with the default configs; here the native kernels' own machinery is pushed: a chunk of many query
blocks, blocks split over programs along the context, keys past a row's queries (causality inside a
block), decodes beside chunks, padding on both sides, pages in random physical order with NaN or
random-byte poison on every unused page.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from tests.conformance import np_ops
from tests.conformance.cases import make_paged_case
from tests.conformance.checks import assert_attention_close, assert_same_planes

_LEAD, _TAIL = 2, 3


def _i32(x):
    return jnp.asarray(np.asarray(x, np.int32))


def _starts(lengths):
    return (_LEAD + np.concatenate([[0], np.cumsum(lengths)])).astype(np.int32)


_SPLIT = pk.PagedAttentionConfig(block_q=4, k_splits=3)


@pytest.mark.parametrize("order, config", [
    pytest.param("page-major", _SPLIT, id="q4-s3-page-major"),
    pytest.param("head-major", None, id="default-head-major"),
    pytest.param("head-major", _SPLIT, id="q4-s3-head-major", marks=pytest.mark.slow),
    pytest.param("page-major", None, id="default-page-major", marks=pytest.mark.slow),
])
def test_ragged_attention_over_many_blocks_and_splits(order, config):
    # rows: a 20-token chunk crossing pages (5 blocks of 4), an empty row, a decode, a 9-token chunk
    # whose row holds keys past its last query (they stay invisible), a decode at a page's first key
    kv_lens = np.array([150, 0, 40, 129, 65])
    lengths = np.array([20, 0, 1, 9, 1])
    positions = np.array([130, 0, 39, 100, 64])
    case = make_paged_case("k8v4", order, kv_lens=kv_lens, heads=2, head_dim=64, logical_pages=3, seed=11)
    starts = _starts(lengths)
    n = int(starts[-1]) + _TAIL
    rng = np.random.default_rng(11)
    q = rng.standard_normal((n, 4, 64)).astype(np.float32)
    call = jax.jit(lambda q, view, *a: pk.paged_attention_ragged(q, view, *a, sm_scale=0.2, config=config,
                                                                  interpret=True))
    got = np.asarray(call(jnp.asarray(q), case.view(), _i32(case.table_rows), _i32(positions), _i32(kv_lens),
                          _i32(starts)))
    for r, length in enumerate(lengths):
        if not length:
            continue
        rows = slice(int(starts[r]), int(starts[r + 1]))
        want = np_ops.paged_attention(q[None, rows], case.planes, case.layout, case.layer, case.block_tables,
                                      case.table_rows[r:r + 1], positions[r:r + 1], kv_lens[r:r + 1], 0.2)
        assert_attention_close(got[None, rows], want, backend="pallas", q_dtype="float32", what=f"{order} row {r}")
    assert not got[np.r_[0:_LEAD, n - _TAIL:n]].any(), "padding tokens must return exact zeros"


@pytest.mark.parametrize("order", [pytest.param("page-major", marks=pytest.mark.slow), "head-major"])
def test_ragged_append_in_page_blocks_is_each_rows_append(order):
    # a chunk of 130 tokens from mid-page (three page blocks), a decode at a page's last column, an
    # empty row, a decode at a page's first column, a two-token chunk crossing a page boundary
    lengths = np.array([130, 1, 0, 1, 2])
    positions = np.array([30, 63, 5, 64, 127])
    case = make_paged_case("nvfp4-g16", order, kv_lens=[0] * 5, mapped_tokens=[192] * 5, heads=2, head_dim=64,
                           logical_pages=3, seed=12, poison="bytes")
    starts = _starts(lengths)
    n = int(starts[-1]) + _TAIL
    rng = np.random.default_rng(12)
    k = (rng.standard_normal((n, 2, 64)) * 3).astype(np.float32)
    v = rng.standard_normal((n, 2, 64)).astype(np.float32)
    call = jax.jit(lambda view, *a: pk.paged_append_ragged(view, *a, config=pk.PagedAppendConfig(block_t=8),
                                                           interpret=True))
    out = call(case.view(), _i32(case.table_rows), _i32(positions), jnp.asarray(k), jnp.asarray(v), _i32(starts))
    got = {name: np.asarray(x) for name, x in out.planes.items()}
    kr, vr = np_ops.ragged_rows(k, starts, lengths), np_ops.ragged_rows(v, starts, lengths)
    want = np_ops.paged_append(case.planes, case.layout, case.layer, case.block_tables, case.table_rows, positions,
                               kr, vr, lengths)
    assert_same_planes(got, want, f"{order} ragged append in page blocks")


def test_the_ragged_ops_are_registered_natively():
    from ninfer_kv.ops.registry import load_impl

    impl = load_impl("pallas")
    assert impl.paged_attention_ragged is pk.paged_attention_ragged
    assert impl.paged_append_ragged is pk.paged_append_ragged
