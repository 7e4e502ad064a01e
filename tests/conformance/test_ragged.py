"""The ragged (ragged) forms: each row of a ragged call is its rectangular call, padding is inert.

A ragged call holds rows of different query lengths on one token axis (a decode of one token, a
prefill chunk, an empty row) with padding tokens before the first and after the last row.  Every
backend is held to the numpy model per row (attention within the stated tolerance, appends bit for
bit, every other byte untouched), with NaN or random-byte poison on unused pages as in the other
conformance tests.  The FFI's native ragged kernels must also give, bit for bit, what its
rectangular kernels give for each row alone when neither splits its context.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv import ops
from ninfer_kv.ops.ffi import kv as ffi_kv
from ninfer_kv.ops.ffi import handlers as ffi_handlers

from . import backends, np_ops
from .cases import PAGE, PROFILES, append_case, append_geometry, attention_case, attention_geometry, random_kv
from .checks import assert_attention_close, assert_same_bits, assert_same_planes

# (query length, key frontier) of the four rows: a prefill chunk ending mid-page, an empty row, a
# decode of one token, a chunk crossing a page boundary that ends at the last readable key.
_LENGTHS = np.array([5, 0, 1, 3])
_LEAD, _TAIL = 1, 2  # padding tokens before the first and after the last row


def _starts(lengths) -> np.ndarray:
    return (_LEAD + np.concatenate([[0], np.cumsum(lengths)])).astype(np.int32)


def _jitted(backend: str, op: str):
    fn = getattr(ops, op)
    if op.startswith("paged_attention"):
        return jax.jit(lambda *a, sm_scale=None: fn(*a, sm_scale=sm_scale, impl=backend), static_argnames=("sm_scale",))
    return jax.jit(lambda *a: fn(*a, impl=backend))


def _i32(x):
    return jnp.asarray(np.asarray(x, np.int32))


def _attention_rows(profile, seed: int):
    """The profile's attention geometry, a pool whose four rows hold 70, 0, 41 and L*P keys, the
    rows' positions (each row's queries end at its last key), query_starts and the queries."""
    g = attention_geometry(profile)
    kv_lens = np.array([70, 0, 41, g.logical_pages * PAGE])
    case = attention_case(g, kv_lens, seed=seed)
    starts = _starts(_LENGTHS)
    n = int(starts[-1]) + _TAIL
    q = np.random.default_rng(seed).standard_normal((n, g.heads * g.group, g.head_dim)).astype(np.float32)
    return g, case, kv_lens - _LENGTHS, kv_lens, starts, q.astype(jnp.dtype(g.q_dtype))


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.value)
def test_ragged_attention_is_each_rows_attention(backend, profile):
    backends.require(backend)
    g, case, positions, kv_lens, starts, q = _attention_rows(profile, seed=3)
    n = q.shape[0]
    got = np.asarray(_jitted(backend, "paged_attention_ragged")(
        jnp.asarray(q), case.view(), _i32(case.table_rows), _i32(positions), _i32(kv_lens), _i32(starts),
        sm_scale=g.sm_scale))
    assert got.shape == q.shape and got.dtype == q.dtype
    seen = backends.queries_as_seen(backend, case.layout.profile, q)
    for r, length in enumerate(_LENGTHS):
        if not length:
            continue
        rows = slice(int(starts[r]), int(starts[r + 1]))
        want = np_ops.paged_attention(seen[None, rows], case.planes, case.layout, case.layer, case.block_tables,
                                      case.table_rows[r:r + 1], positions[r:r + 1], kv_lens[r:r + 1], g.sm_scale)
        assert_attention_close(got[None, rows], want, backend=backend, q_dtype=g.q_dtype, what=f"{g} row {r}")
    pad = np.r_[0:_LEAD, n - _TAIL:n]
    assert not np.asarray(got[pad], np.float32).any(), "padding tokens must return exact zeros"


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.value)
def test_ragged_append_is_each_rows_append(backend, profile):
    backends.require(backend)
    g = append_geometry(profile)
    case = append_case(g, seed=5)
    rng = np.random.default_rng(5)
    # a chunk crossing a page boundary, an empty row, a decode at a page start, a chunk of more
    # than a page ending at capacity
    lengths = np.array([7, 0, 1, 66])
    positions = np.minimum(np.array([60, 3, 64, 125]), g.logical_pages * PAGE - lengths)
    starts = _starts(lengths)
    n = int(starts[-1]) + _TAIL
    k, v = random_kv(rng, (n, g.heads, g.head_dim), dtype=g.kv_dtype, spread=True)
    out = _jitted(backend, "paged_append_ragged")(case.view(), _i32(case.table_rows), _i32(positions),
                                                  jnp.asarray(k), jnp.asarray(v), _i32(starts))
    got = {name: np.asarray(x) for name, x in out.planes.items()}
    kr, vr = np_ops.ragged_rows(k, starts, lengths), np_ops.ragged_rows(v, starts, lengths)
    want = np_ops.paged_append(case.planes, case.layout, case.layer, case.block_tables, case.table_rows, positions,
                               kr, vr, lengths)
    assert_same_planes(got, want, f"{backend} {profile.value} ragged append")


def test_ragged_starts_out_of_order_under_jit_are_clamped(backend):
    """Under jax.jit nothing is checked: ``query_starts`` is clamped into [0, N] and made
    non-decreasing, so a decreasing entry gives an empty row and an entry past N ends at N."""
    backends.require(backend)
    profile = PROFILES[0]
    g = attention_geometry(profile)
    kv_lens = np.array([70, 0, 41, 9])
    case = attention_case(g, kv_lens, seed=4)
    rng = np.random.default_rng(4)
    n = 8
    q = rng.standard_normal((n, g.heads * g.group, g.head_dim)).astype(np.float32).astype(jnp.dtype(g.q_dtype))
    positions = np.array([66, 0, 40, 5])
    call = _jitted(backend, "paged_attention_ragged")
    args = (case.view(), _i32(case.table_rows), _i32(positions), _i32(kv_lens))
    odd = np.asarray(call(jnp.asarray(q), *args, _i32([-3, 4, 2, 5, 99]), sm_scale=g.sm_scale))
    fair = np.asarray(call(jnp.asarray(q), *args, _i32([0, 4, 4, 5, 8]), sm_scale=g.sm_scale))
    assert_same_bits(odd, fair, f"{backend} clamped query_starts")


@pytest.mark.skipif(not ffi_handlers.is_available(), reason="the FFI library is not built")
@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.value)
def test_ffi_ragged_rows_are_bit_identical_to_rectangular_rows(profile):
    """Without context splits, a ragged row walks the blocks a rectangular row of its length walks."""
    g, case, positions, kv_lens, starts, q = _attention_rows(profile, seed=6)
    view = case.view()
    with ffi_handlers.fixed_splits():
        ragged = np.asarray(jax.jit(lambda q: ffi_kv.paged_attention_ragged(
            q, view, _i32(case.table_rows), _i32(positions), _i32(kv_lens), _i32(starts), sm_scale=g.sm_scale))(
                jnp.asarray(q)))
        for r, length in enumerate(_LENGTHS):
            if not length:
                continue
            rows = slice(int(starts[r]), int(starts[r + 1]))
            alone = np.asarray(jax.jit(lambda q: ffi_kv.paged_attention(
                q, view, _i32(case.table_rows[r:r + 1]), _i32(positions[r:r + 1]), _i32(kv_lens[r:r + 1]),
                sm_scale=g.sm_scale))(jnp.asarray(q[None, rows])))
            assert_same_bits(ragged[rows], alone[0], f"{profile.value} row {r}")
