"""PagedKVStorageLayout and page geometry: stacked plane shapes, dtypes, inventory and PageBytes."""

import chex
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer_kv.schema.geometry import PAGE_SIZE, KVPageGeometry, PlaneOrder
from ninfer_kv.schema.profiles import KVProfile
from ninfer_kv.schema.layout import PagedKVStorageLayout
from ninfer_kv.schema.geometry import ceil_div
from ninfer_kv.ops.views import allocate_planes

LAYERS, HEADS, PAGES, D = 2, 3, 5, 64


def _expected_shape(order, extent, layers=LAYERS, pages=PAGES, heads=HEADS):
    if order is PlaneOrder.PAGE_MAJOR:
        return (layers, pages, heads, PAGE_SIZE, extent)
    return (layers, heads, pages, PAGE_SIZE, extent)


@pytest.mark.parametrize("order", list(PlaneOrder), ids=lambda o: o.value)
@pytest.mark.parametrize("profile", list(KVProfile), ids=lambda p: p.value)
def test_allocate_shapes_and_dtypes(profile, order):
    layout = PagedKVStorageLayout(profile, LAYERS, HEADS, D, order=order)
    planes = allocate_planes(layout, PAGES)
    assert tuple(planes) == profile.plane_names()
    for spec in profile.planes(D):
        arr = planes[spec.name]
        chex.assert_shape(arr, _expected_shape(order, spec.extent))
        chex.assert_type(arr, spec.dtype)
        assert arr.shape == layout.plane_shape(spec.name, PAGES)
        assert arr.shape[order.page_axis] == PAGES
        assert arr.shape[order.head_axis] == HEADS
        assert not np.any(np.asarray(arr).view(np.uint8))  # zero-filled
    assert sum(a.nbytes for a in planes.values()) == layout.buffer_bytes(PAGES)
    assert layout.buffer_bytes(PAGES) == layout.page_bytes * PAGES
    assert layout.memory_summary(PAGES).bytes == layout.buffer_bytes(PAGES)


def test_k8v4_extents_per_plane():
    layout = PagedKVStorageLayout("k8v4", 1, 2, 256)
    assert layout.plane_shapes(4) == {
        "k": (1, 4, 2, 64, 256),
        "k_scale": (1, 4, 2, 64, 1),
        "v": (1, 4, 2, 64, 128),
        "v_scale": (1, 4, 2, 64, 16),
    }
    head_major = PagedKVStorageLayout("k8v4", 1, 2, 256, order="head-major")
    assert head_major.plane_shapes(4)["v_scale"] == (1, 2, 4, 64, 16)


@pytest.mark.parametrize("profile", list(KVProfile), ids=lambda p: p.value)
def test_page_bytes_is_sum_of_plane_bytes_per_token_times_p(profile):
    layers, heads, d = 3, 2, 256
    layout = PagedKVStorageLayout(profile, layers, heads, d)
    per_token_head = profile.token_head_bytes(d)
    assert layout.bytes_per_token == per_token_head * heads * layers
    assert layout.page_bytes == per_token_head * heads * layers * PAGE_SIZE
    assert layout.page_bytes == sum(layout.plane_page_bytes(n) for n in layout.plane_names)
    assert layout.page_bytes == layout.memory_summary(1).page_bytes


def test_k8v4_page_bytes_are_not_twice_k():
    layout = PagedKVStorageLayout("k8v4", 4, 2, 256)
    k_page = layout.plane_page_bytes("k") + layout.plane_page_bytes("k_scale")
    v_page = layout.plane_page_bytes("v") + layout.plane_page_bytes("v_scale")
    assert k_page == 258 * 2 * 4 * 64
    assert v_page == 144 * 2 * 4 * 64
    assert layout.page_bytes == k_page + v_page == 402 * 2 * 4 * 64
    assert layout.page_bytes != 2 * k_page


def test_inventory_ordinals_run_layer_major():
    layout = PagedKVStorageLayout("int8-g64", 3, 2, 128)
    names = layout.plane_names
    assert names == ("k", "k_scale", "v", "v_scale")
    assert [e.ordinal for e in layout.inventory] == list(range(3 * len(names)))
    assert [(e.layer, e.name) for e in layout.inventory] == [(layer, n) for layer in range(3) for n in names]
    for e in layout.inventory:
        assert e.bytes_per_token == e.plane.token_head_bytes * 2


def test_memory_summary_matches_allocation():
    layout = PagedKVStorageLayout("nvfp4-g16", 2, 2, 32, order="head-major")
    summary = layout.memory_summary(3, pool="draft")
    planes = allocate_planes(layout, 3)
    assert summary.pool == "draft" and summary.order == "head-major" and summary.num_pages == 3
    for mem in summary.planes:
        assert mem.shape == planes[mem.name].shape
        assert mem.bytes == planes[mem.name].nbytes
        assert mem.dtype == planes[mem.name].dtype.name
    js = summary.to_json()
    assert js["bytes"] == sum(a.nbytes for a in planes.values())
    assert [p["name"] for p in js["planes"]] == list(planes)


def test_fill_applies_to_float_planes_only():
    planes = allocate_planes(PagedKVStorageLayout("k8v4", 1, 1, 16), 2, fill=np.nan)
    assert np.all(np.isnan(np.asarray(planes["k"], np.float32)))
    assert np.all(np.isnan(np.asarray(planes["k_scale"], np.float32)))
    assert not np.any(np.asarray(planes["v"])) and not np.any(np.asarray(planes["v_scale"]))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(profile="int8-g64", num_layers=1, num_kv_heads=1, head_dim=96), "int8-g64: head_dim=96"),
        (dict(profile="nvfp4-g16", num_layers=1, num_kv_heads=1, head_dim=40), "nvfp4-g16: head_dim=40"),
        (dict(profile="fp16", num_layers=1, num_kv_heads=1, head_dim=64), "unknown KV profile 'fp16'"),
        (dict(profile="bf16", num_layers=0, num_kv_heads=1, head_dim=64), "num_layers=0"),
        (dict(profile="bf16", num_layers=1, num_kv_heads=0, head_dim=64), "num_kv_heads=0"),
        (dict(profile="bf16", num_layers=1, num_kv_heads=1, head_dim=0), "head_dim=0"),
        (dict(profile="bf16", num_layers=1, num_kv_heads=1, head_dim=64, order="row-major"), "plane order"),
        (dict(profile="bf16", num_layers=1, num_kv_heads=1, head_dim=64, page_size=32), "page_size=32"),
    ],
)
def test_bad_layout_arguments_are_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PagedKVStorageLayout(**kwargs)


def test_bad_page_counts_and_plane_names():
    layout = PagedKVStorageLayout("bf16", 1, 1, 64)
    for bad in (0, -1, 2.0):
        with pytest.raises(ValueError, match="num_pages"):
            allocate_planes(layout, bad)
        with pytest.raises(ValueError, match="num_pages"):
            layout.buffer_bytes(bad)
    with pytest.raises(KeyError, match="k_scale"):
        layout.plane("k_scale")


def test_layout_equality_is_by_geometry():
    a = PagedKVStorageLayout("k8v4", 2, 2, 128)
    assert a == PagedKVStorageLayout(KVProfile.K8V4, 2, 2, 128, order=PlaneOrder.PAGE_MAJOR)
    assert a != PagedKVStorageLayout("k8v4", 2, 2, 128, order="head-major")
    assert len({a, PagedKVStorageLayout("k8v4", 2, 2, 128)}) == 1


def test_plane_order_parse():
    assert PlaneOrder.parse("page_major") is PlaneOrder.PAGE_MAJOR
    assert PlaneOrder.parse(" Head-Major ") is PlaneOrder.HEAD_MAJOR
    with pytest.raises(ValueError, match="allowed: page-major, head-major"):
        PlaneOrder.parse("column-major")


@given(pos=st.integers(0, 1 << 24))
def test_address_translation(pos):
    geo = KVPageGeometry(num_kv_heads=1, head_dim=64)
    assert geo.block_of(pos) == pos >> 6
    assert geo.offset_of(pos) == pos & 63
    assert geo.block_of(pos) * PAGE_SIZE + geo.offset_of(pos) == pos


@given(s=st.integers(1, 1 << 20))
def test_logical_pages_is_ceil(s):
    geo = KVPageGeometry(num_kv_heads=1, head_dim=64)
    assert geo.logical_pages(s) == ceil_div(s, 64)
    assert (geo.logical_pages(s) - 1) * 64 < s <= geo.logical_pages(s) * 64


@settings(max_examples=30, deadline=None)
@given(
    profile=st.sampled_from(list(KVProfile)),
    order=st.sampled_from(list(PlaneOrder)),
    layers=st.integers(1, 4),
    heads=st.integers(1, 8),
    groups=st.integers(1, 8),
    pages=st.integers(1, 100),
)
def test_buffer_bytes_equals_shapes_times_itemsize(profile, order, layers, heads, groups, pages):
    layout = PagedKVStorageLayout(profile, layers, heads, 64 * groups, order=order)
    from_shapes = sum(
        int(np.prod(layout.plane_shape(p.name, pages))) * p.dtype.itemsize for p in layout.planes
    )
    assert layout.buffer_bytes(pages) == from_shapes == layout.page_bytes * pages
