"""Consumer views: pytree structure, jit arguments, traced layers and construction-time validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv.schema.layout import PagedKVStorageLayout
from ninfer_kv.ops.views import CyclicKVCacheLayerView, CyclicKVLayout, PagedKVBatchLayerView, PagedKVLayerView
from ninfer_kv.ops.views import allocate_planes

LAYOUT = PagedKVStorageLayout("int8-g64", num_layers=3, num_kv_heads=2, head_dim=64, order="head-major")
N, C, L = 5, 3, 4


def _batch_view(layer=1):
    planes = allocate_planes(LAYOUT, N)
    tables = jnp.arange(C * L, dtype=jnp.int32).reshape(C, L) % N
    return PagedKVBatchLayerView(planes, tables, layer, LAYOUT)


def _cyclic_view(layer=0):
    lay = CyclicKVLayout("k8v4", num_layers=2, rows=3, num_kv_heads=2, head_dim=64, window=8, slots=10)
    return CyclicKVCacheLayerView(lay.allocate(), layer, lay)


def _views():
    batch = _batch_view()
    single = PagedKVLayerView(batch.planes, batch.block_tables[2], 2, LAYOUT)
    return [batch, single, _cyclic_view()]


@pytest.mark.parametrize("view", _views(), ids=lambda v: type(v).__name__)
def test_pytree_round_trip(view):
    leaves, treedef = jax.tree_util.tree_flatten(view)
    # arrays (and the layer) are leaves; the layout is static metadata in the treedef
    assert all(hasattr(x, "shape") or isinstance(x, int) for x in leaves)
    assert len(leaves) == len(view.planes) + (1 if isinstance(view, CyclicKVCacheLayerView) else 2)
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    assert type(again) is type(view) and again.layout == view.layout
    for a, b in zip(jax.tree_util.tree_leaves(again), leaves):
        assert a is b
    # tree_map keeps the structure (e.g. device_put / donation of a whole view)
    mapped = jax.tree_util.tree_map(lambda x: x, view)
    assert type(mapped) is type(view)


def test_jit_with_view_argument_does_not_retrace_on_data():
    traces = []

    @jax.jit
    def total(view):
        traces.append(1)
        return view.block_tables.sum() + view.planes["k"][view.layer].astype(jnp.int32).sum()

    v = _batch_view(layer=0)
    first = int(total(v))
    assert first == int(v.block_tables.sum())
    # new table contents and a new layer are data: no new trace
    v2 = v.replace(block_tables=v.block_tables[::-1], layer=2)
    assert int(total(v2)) == int(v.block_tables.sum())
    assert len(traces) == 1
    # a different layout is a different graph key
    other = PagedKVStorageLayout("bf16", num_layers=3, num_kv_heads=2, head_dim=64, order="head-major")
    total(PagedKVBatchLayerView(allocate_planes(other, N), v.block_tables, 0, other))
    assert len(traces) == 2


def test_traced_layer_selects_the_layer():
    v = _batch_view(layer=0)
    planes = dict(v.planes)
    planes["k"] = planes["k"].at[2].set(7)  # layer 2 of the head-major stacked plane

    @jax.jit
    def layer_sum(view, layer):
        view = view.with_layer(layer)  # the layer is a traced int32 scalar here
        assert isinstance(view.layer, jax.core.Tracer)
        return jax.lax.dynamic_index_in_dim(view.planes["k"], view.layer, 0, keepdims=False).astype(jnp.int32).sum()

    vv = v.replace(planes=planes)
    assert int(layer_sum(vv, jnp.int32(2))) == 7 * planes["k"][2].size
    assert int(layer_sum(vv, jnp.int32(1))) == 0


def test_single_view_as_batch():
    batch = _batch_view()
    single = PagedKVLayerView(batch.planes, batch.block_tables[1], 1, LAYOUT)
    as_batch = single.as_batch()
    assert isinstance(as_batch, PagedKVBatchLayerView)
    assert as_batch.block_tables.shape == (1, L)
    np.testing.assert_array_equal(np.asarray(as_batch.block_tables[0]), np.asarray(batch.block_tables[1]))


def test_paged_view_validation_errors():
    planes = allocate_planes(LAYOUT, N)
    tables = jnp.zeros((C, L), jnp.int32)
    with pytest.raises(ValueError, match=r"planes keyed \['k', 'k_scale', 'v'\]"):
        PagedKVBatchLayerView({k: v for k, v in planes.items() if k != "v_scale"}, tables, 0, LAYOUT)
    bad = dict(planes, k=jnp.zeros((3, 2, N, 64, 32), jnp.int8))
    with pytest.raises(ValueError, match=r"plane 'k' has shape \(3, 2, 5, 64, 32\), expected \(3, 2, 5, 64, 64\)"):
        PagedKVBatchLayerView(bad, tables, 0, LAYOUT)
    bad = dict(planes, k_scale=planes["k_scale"].astype(jnp.float32))
    with pytest.raises(ValueError, match="plane 'k_scale' has dtype float32, expected bfloat16"):
        PagedKVBatchLayerView(bad, tables, 0, LAYOUT)
    with pytest.raises(ValueError, match="block_tables must be int32, got int64|block_tables must be int32, got uint32"):
        PagedKVBatchLayerView(planes, np.zeros((C, L), np.uint32), 0, LAYOUT)
    with pytest.raises(ValueError, match=r"block_tables must be int32 \(C, L\)"):
        PagedKVBatchLayerView(planes, jnp.zeros((L,), jnp.int32), 0, LAYOUT)
    for layer in (3, -1, jnp.int32(5)):
        with pytest.raises(ValueError, match=r"layer=(3|-1|5) is out of range \[0, 3\)"):
            PagedKVBatchLayerView(planes, tables, layer, LAYOUT)
    with pytest.raises(TypeError, match="layer must be a Python int"):
        PagedKVBatchLayerView(planes, tables, 1.0, LAYOUT)
    with pytest.raises(TypeError, match="layout must be a PagedKVStorageLayout"):
        PagedKVBatchLayerView(planes, tables, 0, "int8-g64")
    with pytest.raises(ValueError, match=r"block_table must be int32 \(L,\)"):
        PagedKVLayerView(planes, tables, 0, LAYOUT)


def test_cyclic_view_validation_errors():
    v = _cyclic_view()
    with pytest.raises(ValueError, match="plane 'v' has shape"):
        CyclicKVCacheLayerView(dict(v.planes, v=v.planes["v"][:, :2]), 0, v.layout)
    with pytest.raises(ValueError, match=r"layer=2 is out of range \[0, 2\)"):
        CyclicKVCacheLayerView(v.planes, 2, v.layout)
    with pytest.raises(ValueError, match="slots=4 is invalid; it must be an integer >= window=8"):
        CyclicKVLayout("bf16", num_layers=1, rows=1, num_kv_heads=1, head_dim=64, window=8, slots=4)
    with pytest.raises(ValueError, match="profile int8-g64: head_dim=48"):
        CyclicKVLayout("int8-g64", num_layers=1, rows=1, num_kv_heads=1, head_dim=48, window=8)
