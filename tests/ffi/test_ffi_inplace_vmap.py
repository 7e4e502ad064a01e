"""In-place appends under donation, functional semantics without it, and jax.vmap over the ops."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv import ffi_ops
from ninfer_kv.views import CyclicKVCacheLayerView, PagedKVBatchLayerView

from .ffi_cases import (
    assert_close_to_reference,
    assert_planes_identical,
    cyclic_state,
    empty_paged_pool,
    paged_state,
    raw_bytes,
)

pytestmark = pytest.mark.skipif(not ffi_ops.is_available(), reason=f"FFI library unavailable: {ffi_ops.load_error()}")


def _pointers(planes: dict) -> dict:
    return {name: p.unsafe_buffer_pointer() for name, p in planes.items()}


@pytest.mark.parametrize("order", ["page-major", "head-major"])
def test_paged_append_writes_in_place_when_donated(order):
    rng = np.random.default_rng(0)
    lay, planes, bt, rows = empty_paged_pool("k8v4", order, batch=2, logical_pages=2, rng=rng)
    table = jnp.asarray(bt)

    def step(planes, rows, pos, k, v, valid):
        view = PagedKVBatchLayerView(planes, table, 1, lay, validate=False)
        return ffi_ops.paged_append(view, rows, pos, k, v, valid).planes

    step = jax.jit(step, donate_argnums=0)
    planes = {k: jnp.asarray(v) for k, v in planes.items()}
    k = jnp.asarray(rng.standard_normal((2, 3, 2, 64)).astype(np.float32))
    args = (jnp.asarray(rows), jnp.asarray([0, 5], jnp.int32), k, -k, jnp.asarray([3, 2], jnp.int32))
    before = _pointers(planes)
    out = step(planes, *args)
    jax.block_until_ready(out)
    assert _pointers(out) == before
    out2 = step(out, *args)  # and again: the chain of donated steps stays in one buffer
    assert _pointers(out2) == before


def test_cyclic_append_writes_in_place_when_donated():
    rng = np.random.default_rng(1)
    lay, planes = cyclic_state("nvfp4-g16", rows=2, window=4, slots=4, rng=rng)

    def step(planes, rows, pos, k, v, valid):
        view = CyclicKVCacheLayerView(planes, 0, lay, validate=False)
        return ffi_ops.cyclic_append(view, rows, pos, k, v, valid).planes

    step = jax.jit(step, donate_argnums=0)
    planes = {k: jnp.asarray(v) for k, v in planes.items()}
    before = _pointers(planes)
    k = jnp.ones((2, 1, 2, 64), jnp.float32)
    out = step(planes, jnp.asarray([1, 0], jnp.int32), jnp.asarray([7, 2], jnp.int32), k, k, jnp.asarray([1, 1], jnp.int32))
    jax.block_until_ready(out)
    assert _pointers(out) == before


def test_append_without_donation_leaves_the_input_planes_unchanged():
    rng = np.random.default_rng(2)
    lay, planes, bt, rows = empty_paged_pool("int8-g64", "page-major", batch=1, logical_pages=1, rng=rng)
    view = PagedKVBatchLayerView({k: jnp.asarray(v) for k, v in planes.items()}, jnp.asarray(bt), 0, lay)
    snapshot = {k: raw_bytes(v).copy() for k, v in view.planes.items()}
    k = jnp.ones((1, 2, 2, 64), jnp.float32)
    out = jax.jit(ffi_ops.paged_append)(view, jnp.asarray(rows), jnp.zeros((1,), jnp.int32), k, k, jnp.full((1,), 2, jnp.int32))
    for name in snapshot:
        assert np.array_equal(raw_bytes(view.planes[name]), snapshot[name])
        assert not np.array_equal(raw_bytes(out.planes[name]), snapshot[name])


def test_vmap_attention_over_queries_matches_per_element_calls():
    rng = np.random.default_rng(3)
    state = paged_state("fp8-e4m3fn-row256", "page-major", kv_lens=[70, 5], rng=rng)
    view = state.view()
    qs = jnp.asarray(rng.standard_normal((3, 2, 1, 4, 64)).astype(np.float32))  # 3 mapped query sets
    rows, pos, lens = jnp.asarray(state.table_rows), jnp.asarray([69, 4], jnp.int32), jnp.asarray(state.kv_lens)

    def attend(q):
        return ffi_ops.paged_attention(q, view, rows, pos, lens)

    mapped = jax.jit(jax.vmap(attend))(qs)
    for i in range(qs.shape[0]):
        np.testing.assert_array_equal(np.asarray(mapped[i]), np.asarray(attend(qs[i])))
    assert_close_to_reference(mapped[0], jax.jit(attend)(qs[0]))


def test_vmap_append_over_stacked_pools_matches_separate_appends():
    rng = np.random.default_rng(4)
    lay, planes, bt, rows = empty_paged_pool("k8v4", "head-major", batch=2, logical_pages=2, rng=rng)
    table = jnp.asarray(bt)
    stacked = {name: jnp.stack([jnp.asarray(p), jnp.asarray(p)]) for name, p in planes.items()}
    k = jnp.asarray(rng.standard_normal((2, 2, 3, 2, 64)).astype(np.float32))  # different tokens per pool
    pos, valid = jnp.asarray([60, 0], jnp.int32), jnp.asarray([3, 1], jnp.int32)

    def append(planes, k):
        view = PagedKVBatchLayerView(planes, table, 1, lay, validate=False)
        return ffi_ops.paged_append(view, jnp.asarray(rows), pos, k, -k, valid).planes

    mapped = jax.jit(jax.vmap(append))(stacked, k)
    for i in range(2):
        single = append({name: jnp.asarray(p) for name, p in planes.items()}, k[i])
        assert_planes_identical({n: m[i] for n, m in mapped.items()}, single)
