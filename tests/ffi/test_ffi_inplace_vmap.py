"""In-place appends under donation, functional semantics without it, and jax.vmap over the ops."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv.ops.ffi import kv as ffi_kv

from ninfer_kv.ops.ffi import handlers as ffi_handlers
from ninfer_kv.schema.profiles import KVProfile
from ninfer_kv.ops.views import CyclicKVCacheLayerView, PagedKVBatchLayerView
from tests.conformance import np_ops
from tests.conformance.cases import CyclicGeometry, append_case, append_geometry, make_cyclic_case, make_paged_case
from tests.conformance.checks import assert_attention_close, assert_same_planes, raw_bits

pytestmark = pytest.mark.skipif(not ffi_handlers.is_available(), reason=f"FFI library unavailable: {ffi_handlers.load_error()}")


def _pointers(planes: dict) -> dict:
    return {name: p.unsafe_buffer_pointer() for name, p in planes.items()}


def _pool(profile, order):
    """The profile's empty append pool (random-byte poison, layer 1), its block table and two batch rows' table rows."""
    g = append_geometry(KVProfile(profile), order)
    case = append_case(g, seed=0)
    return case, jnp.asarray(case.block_tables), jnp.asarray(case.table_rows[:2])


@pytest.mark.parametrize("order", ["page-major", "head-major"])
def test_paged_append_writes_in_place_when_donated(order):
    """Donated planes keep their buffers through a chain of jitted appends, in both plane orders."""
    case, table, rows = _pool("k8v4", order)
    lay = case.layout

    def step(planes, rows, pos, k, v, valid):
        view = PagedKVBatchLayerView(planes, table, 1, lay, validate=False)
        return ffi_kv.paged_append(view, rows, pos, k, v, valid).planes

    step = jax.jit(step, donate_argnums=0)
    planes = {k: jnp.asarray(v) for k, v in case.planes.items()}
    k = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 2, lay.head_dim)).astype(np.float32))
    args = (rows, jnp.asarray([0, 5], jnp.int32), k, -k, jnp.asarray([3, 2], jnp.int32))
    before = _pointers(planes)
    out = step(planes, *args)
    jax.block_until_ready(out)
    assert _pointers(out) == before
    out2 = step(out, *args)  # and again: the chain of donated steps stays in one buffer
    assert _pointers(out2) == before


def test_cyclic_append_writes_in_place_when_donated():
    """Donated ring planes keep their buffers through a jitted cyclic append."""
    case = make_cyclic_case(CyclicGeometry(KVProfile("nvfp4-g16"), 64, 4, 4, rows=2), seed=1)
    lay = case.layout

    def step(planes, rows, pos, k, v, valid):
        view = CyclicKVCacheLayerView(planes, 0, lay, validate=False)
        return ffi_kv.cyclic_append(view, rows, pos, k, v, valid).planes

    step = jax.jit(step, donate_argnums=0)
    planes = {k: jnp.asarray(v) for k, v in case.planes.items()}
    before = _pointers(planes)
    k = jnp.ones((2, 1, 2, 64), jnp.float32)
    out = step(planes, jnp.asarray([1, 0], jnp.int32), jnp.asarray([7, 2], jnp.int32), k, k, jnp.asarray([1, 1], jnp.int32))
    jax.block_until_ready(out)
    assert _pointers(out) == before


def test_append_without_donation_leaves_the_input_planes_unchanged():
    """Without donation the append returns new planes and the caller's keep their bytes."""
    case, table, rows = _pool("int8-g64", "page-major")
    view = case.view()
    snapshot = {k: raw_bits(v).copy() for k, v in view.planes.items()}
    k = jnp.ones((1, 2, 2, case.layout.head_dim), jnp.float32)
    out = jax.jit(ffi_kv.paged_append)(view, rows[:1], jnp.zeros((1,), jnp.int32), k, k, jnp.full((1,), 2, jnp.int32))
    for name in snapshot:
        assert np.array_equal(raw_bits(view.planes[name]), snapshot[name])
        assert not np.array_equal(raw_bits(out.planes[name]), snapshot[name])


def test_vmap_attention_over_queries_matches_per_element_calls():
    """jax.vmap over query sets gives exactly the per-set calls, and those agree with the oracle."""
    rng = np.random.default_rng(3)
    case = make_paged_case("fp8-e4m3fn-row256", "page-major", kv_lens=[70, 5], seed=3)
    view = case.view()
    qs = jnp.asarray(rng.standard_normal((3, 2, 1, 4, 64)).astype(np.float32))  # 3 mapped query sets
    rows, pos, lens = jnp.asarray(case.table_rows), jnp.asarray([69, 4], jnp.int32), jnp.asarray(case.kv_lens)

    def attend(q):
        return ffi_kv.paged_attention(q, view, rows, pos, lens)

    mapped = jax.jit(jax.vmap(attend))(qs)
    for i in range(qs.shape[0]):
        np.testing.assert_array_equal(np.asarray(mapped[i]), np.asarray(attend(qs[i])))
    want = np_ops.paged_attention(qs[0], case.planes, case.layout, case.layer, case.block_tables, case.table_rows,
                                  [69, 4], case.kv_lens)
    assert_attention_close(mapped[0], want, backend="ffi", q_dtype=np.float32)


def test_vmap_append_over_stacked_pools_matches_separate_appends():
    """jax.vmap over stacked pools writes each pool exactly as a separate append does."""
    case, table, rows = _pool("k8v4", "head-major")
    lay = case.layout
    stacked = {name: jnp.stack([jnp.asarray(p), jnp.asarray(p)]) for name, p in case.planes.items()}
    k = jnp.asarray(np.random.default_rng(4).standard_normal((2, 2, 3, 2, lay.head_dim)).astype(np.float32))
    pos, valid = jnp.asarray([60, 0], jnp.int32), jnp.asarray([3, 1], jnp.int32)

    def append(planes, k):
        view = PagedKVBatchLayerView(planes, table, 1, lay, validate=False)
        return ffi_kv.paged_append(view, rows, pos, k, -k, valid).planes

    mapped = jax.jit(jax.vmap(append))(stacked, k)
    for i in range(2):  # from the stacked bits (stacking may canonicalize a bfloat16 NaN payload)
        single = append({name: p[i] for name, p in stacked.items()}, k[i])
        assert_same_planes({n: np.asarray(m[i]) for n, m in mapped.items()}, {n: np.asarray(x) for n, x in single.items()},
                           f"pool {i}")
