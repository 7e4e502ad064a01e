"""HostKVPageLayout: plane-major packed page bytes, stride == PageBytes, numpy pack/unpack."""

import numpy as np
import pytest

from ninfer_kv.schema.profiles import KVProfile
from ninfer_kv.schema.layout import PagedKVStorageLayout
from ninfer_kv.schema.geometry import PlaneOrder
from ninfer_kv.host import HostKVPageLayout


@pytest.mark.parametrize("order", list(PlaneOrder), ids=lambda o: o.value)
@pytest.mark.parametrize("profile", list(KVProfile), ids=lambda p: p.value)
def test_stride_equals_page_bytes_and_segments_are_plane_major(profile, order):
    layout = PagedKVStorageLayout(profile, 3, 2, 64, order=order)
    host = HostKVPageLayout(layout)
    assert host.stride == layout.page_bytes
    assert host.extent_bytes(7) == 7 * layout.page_bytes
    offset = 0
    expected = []
    for spec in layout.planes:
        assert host.plane_offset(spec.name) == offset
        for layer in range(3):
            expected.append((spec.name, layer, offset))
            offset += 2 * 64 * spec.extent * spec.dtype.itemsize
        assert host.plane_block_bytes(spec.name) == layout.plane_page_bytes(spec.name)
    assert [(s.plane, s.layer, s.offset) for s in host.segments] == expected
    assert offset == host.stride
    seg = host.segment(layout.plane_names[-1], 2)
    assert seg.offset + seg.nbytes == host.stride and seg.shape[:2] == (2, 64)


def test_k8v4_d256_stride_from_inventory():
    layout = PagedKVStorageLayout("k8v4", 16, 2, 256)
    host = HostKVPageLayout(layout)
    assert host.stride == 402 * 2 * 16 * 64  # contract table: 402 B per token-head
    assert host.extent_bytes(512) == 512 * 402 * 2 * 16 * 64


@pytest.mark.parametrize("order", list(PlaneOrder), ids=lambda o: o.value)
def test_pack_matches_byte_definition_and_unpack_inverts(order, make_planes):
    layout = PagedKVStorageLayout("int8-g64", 2, 3, 64, order=order)
    host = HostKVPageLayout(layout)
    planes = {n: np.asarray(p) for n, p in make_planes(layout, 4, seed=1).items()}
    buf = np.zeros(host.extent_bytes(4), np.uint8)
    host.pack(planes, buf)
    rows = buf.reshape(4, host.stride)
    axis = order.page_axis
    for seg in host.segments:
        for page in range(4):
            src = np.take(planes[seg.plane][seg.layer], page, axis=axis - 1)  # (H, P, X)
            got = rows[page, seg.offset : seg.offset + seg.nbytes]
            assert np.array_equal(got, np.ascontiguousarray(src).view(np.uint8).reshape(-1))
    back = host.unpack(buf)
    for name in planes:
        assert back[name].shape == planes[name].shape
        assert np.array_equal(back[name].view(np.uint8), planes[name].view(np.uint8))


def test_errors():
    layout = PagedKVStorageLayout("bf16", 1, 1, 64)
    host = HostKVPageLayout(layout)
    with pytest.raises(ValueError, match="num_pages=0"):
        host.extent_bytes(0)
    with pytest.raises(ValueError, match="different pool layout"):
        host.pages_in(host.stride + 1)
    with pytest.raises(ValueError, match="multiple of the page stride"):
        host.page_planes(np.zeros(host.stride - 2, np.uint8))
    with pytest.raises(KeyError, match="no plane 'k_scale'"):
        host.plane_offset("k_scale")
    with pytest.raises(TypeError, match="PagedKVStorageLayout"):
        HostKVPageLayout("bf16")
    assert HostKVPageLayout(PagedKVStorageLayout("bf16", 1, 1, 64)) == host
    assert hash(HostKVPageLayout(PagedKVStorageLayout("bf16", 1, 1, 64))) == hash(host)
