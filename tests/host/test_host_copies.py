"""Device <-> Host page copies: byte-exact round trips, scattered IDs, runs, attention equivalence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv.schema.profiles import KVProfile
from ninfer_kv.schema.layout import PagedKVStorageLayout
from ninfer_kv.schema.geometry import PlaneOrder
from ninfer_kv.device import offload_pages, restore_pages
from ninfer_kv.host import HostKVArena, HostKVPageLayout, StaleExtentError
from ninfer_kv.device import host_copies as copies_mod
from ninfer_kv.ops.reference import paged_append_reference, paged_attention_reference
from ninfer_kv.ops.views import PagedKVBatchLayerView
from ninfer_kv.ops.views import allocate_planes

N = 12
PATHS = ["packed", "host"]
_append = jax.jit(paged_append_reference)
_attention = jax.jit(paged_attention_reference)


# By default every profile once per path, in one plane order on the packed path and the other on the Host
# path (both orders on each path, every profile in both orders); the other half under -m slow.
@pytest.mark.parametrize("profile, order, path", [
    pytest.param(p, o, path, id=f"{p.value}-{o.value}-{path}",
                 marks=() if (i + j + PATHS.index(path)) % 2 == 0 else (pytest.mark.slow,))
    for i, p in enumerate(KVProfile) for j, o in enumerate(PlaneOrder) for path in PATHS])
def test_round_trip_scattered_ids_is_byte_exact(profile, order, path, make_planes, pages_of):
    layout = PagedKVStorageLayout(profile, 2, 2, 64, order=order)
    host = HostKVPageLayout(layout)
    planes = make_planes(layout, N, seed=3)
    src = [7, 8, 9, 3, 4, 11, 0]  # runs [7..9], [3..4], [11], [0]
    arena = HostKVArena(host.extent_bytes(len(src)) + 4096)
    extent = arena.allocate(host.extent_bytes(len(src)), "main")
    expected = pages_of(planes, layout, src)

    report = offload_pages(planes, layout, src, arena, extent, path=path)
    assert (report.pages, report.runs, report.bytes, report.path) == (7, 4, 7 * host.stride, path)
    # packed copies: 7..9 splits into [7, 8] + [9]; [3, 4]; single pages 11 and 0 batched -> 4
    assert report.chunks == 4
    # the extent holds the pages in logical order, in the packed Host layout
    packed = host.page_planes(arena.view(extent))
    for name, want in expected.items():
        got = np.moveaxis(packed[name], 0, order.page_axis)
        assert np.array_equal(np.ascontiguousarray(got).view(np.uint8), want)

    # restore into a fresh pool at a different permutation of scattered IDs
    dst = [5, 1, 10, 2, 6, 9, 3]
    target = make_planes(layout, N, seed=4)
    untouched = [p for p in range(N) if p not in dst]
    before_other = pages_of(target, layout, untouched)
    restored, rep = restore_pages(target, layout, dst, arena, extent, path=path)
    assert (rep.pages, rep.runs, rep.chunks) == (7, 7, 7)  # restore writes one run per call
    got = pages_of(restored, layout, dst)
    for name in expected:
        assert np.array_equal(got[name], expected[name]), name
    other = pages_of(restored, layout, untouched)
    for name in before_other:
        assert np.array_equal(other[name], before_other[name]), name
    # and the page bytes per plane and layer
    axis = order.page_axis
    for name in expected:
        for layer in range(2):
            a = np.take(np.asarray(restored[name])[layer], dst, axis=axis - 1).view(np.uint8)
            b = np.take(np.asarray(planes[name])[layer], src, axis=axis - 1).view(np.uint8)
            assert np.array_equal(a, b)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("order", list(PlaneOrder), ids=lambda o: o.value)
def test_partial_tail_page_is_copied_whole(order, path, make_planes, pages_of):
    """A page with 40 committed columns: columns 40..63 (stale bytes) travel too."""
    layout = PagedKVStorageLayout("k8v4", 2, 2, 64, order=order)
    planes = make_planes(layout, N, seed=5)  # garbage everywhere, NaN patterns included
    tables = jnp.asarray([[4, 9, 0, 0]], jnp.int32)
    k = jax.random.normal(jax.random.key(0), (1, 104, 2, 64), jnp.float32)
    v = jax.random.normal(jax.random.key(1), (1, 104, 2, 64), jnp.float32)
    for layer in range(2):
        view = PagedKVBatchLayerView(planes, tables, layer, layout)
        planes = _append(view, jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), k, v,
                         jnp.asarray([104], jnp.int32)).planes
    host = HostKVPageLayout(layout)
    arena = HostKVArena(host.extent_bytes(2))
    extent = arena.allocate(host.extent_bytes(2), "main")
    want = pages_of(planes, layout, [4, 9])
    offload_pages(planes, layout, [4, 9], arena, extent, path=path)
    restored, _ = restore_pages(make_planes(layout, N, seed=6), layout, [2, 3], arena, extent, path=path)
    got = pages_of(restored, layout, [2, 3])
    for name in want:
        assert np.array_equal(got[name], want[name]), name


@pytest.mark.parametrize("path", PATHS)
def test_first_page_fills_an_extent_incrementally(path, make_planes, pages_of):
    layout = PagedKVStorageLayout("nvfp4-g16", 1, 2, 64)
    host = HostKVPageLayout(layout)
    planes = make_planes(layout, N, seed=7)
    arena = HostKVArena(host.extent_bytes(5))
    extent = arena.allocate(host.extent_bytes(5), "main")
    offload_pages(planes, layout, [6, 7], arena, extent, path=path)
    offload_pages(planes, layout, [1, 2, 3], arena, extent, first_page=2, path=path)
    restored, rep = restore_pages(make_planes(layout, N, seed=8), layout, [0, 1, 2], arena, extent, first_page=2,
                                  path=path)
    assert rep.runs == 1
    restored, _ = restore_pages(restored, layout, [10, 11], arena, extent, path=path)
    want = pages_of(planes, layout, [1, 2, 3, 6, 7])
    got = pages_of(restored, layout, [0, 1, 2, 10, 11])
    for name in want:
        assert np.array_equal(got[name], want[name])


@pytest.mark.parametrize("path", PATHS)
def test_chunking_bounds_compilations(path, make_planes, pages_of):
    layout = PagedKVStorageLayout("fp8-e4m3fn-row256", 3, 1, 64)  # a layout no other test uses
    host = HostKVPageLayout(layout)
    planes = make_planes(layout, 40, seed=9)
    arena = HostKVArena(host.extent_bytes(40))
    extent = arena.allocate(host.extent_bytes(40), "main")
    if path == "packed":
        jitted = {copies_mod._gather_packed: 7, copies_mod._scatter_packed: 4}
    else:
        jitted = {copies_mod._scatter_words: 4}
    sizes0 = [f._cache_size() for f in jitted]
    cap_bytes = 8 * host.stride  # bucket cap 8 pages
    kw = dict(path=path, max_chunk_bytes=cap_bytes)
    ids = list(range(0, 13)) + list(range(20, 27)) + [30] + list(range(32, 40))  # runs 13, 7, 1, 8
    rep = offload_pages(planes, layout, ids, arena, extent, **kw)
    # packed offload: 13 = 8+4+1, 7 = 4+2+1, 1, 8 where the single pages ending 7 and run 1 are
    # gathered together; the host path copies whole runs without jit
    assert rep.runs == 4 and rep.chunks == (3 + 2 + 1 + 1 if path == "packed" else 4)
    restored, rep2 = restore_pages(make_planes(layout, 40, seed=10), layout, ids[::-1], arena, extent, **kw)
    assert rep2.runs == 29 and rep2.chunks == 29  # restore writes one run per call
    perm = np.random.default_rng(0).permutation(40)[:29]
    rep_p = offload_pages(planes, layout, perm, arena, extent, max_inflight_bytes=1, **kw)
    if path == "packed":
        assert rep_p.chunks < rep_p.runs  # scattered single pages are gathered in batches
    _, rep3 = restore_pages(make_planes(layout, 40, seed=11), layout, ids, arena, extent, **kw)
    assert rep3.chunks == 3 + 3 + 1 + 1
    # chunk shapes: gathers (1|2|4|8 pages, 1 run) and (1 page, 2|4|8 runs); scatters one run of
    # 1|2|4|8 pages: bounded compilations whatever the IDs
    sizes1 = [f._cache_size() for f in jitted]
    assert all(s1 - s0 <= bound for s0, s1, bound in zip(sizes0, sizes1, jitted.values())), (sizes0, sizes1)
    moved = list(range(1, 14)) + list(range(19, 26)) + [29] + list(range(31, 39))  # same run lengths, other IDs
    offload_pages(planes, layout, moved, arena, extent, **kw)
    restore_pages(make_planes(layout, 40, seed=12), layout, moved, arena, extent, **kw)
    assert [f._cache_size() for f in jitted] == sizes1
    want = pages_of(planes, layout, ids)
    got = pages_of(restored, layout, ids[::-1])
    for name in want:
        assert np.array_equal(got[name], want[name])


@pytest.mark.parametrize("path", PATHS)
def test_extent_can_be_reused_right_after_restore(path, make_planes, pages_of):
    layout = PagedKVStorageLayout("int8-g64", 1, 1, 64)
    host = HostKVPageLayout(layout)
    planes = make_planes(layout, N, seed=11)
    arena = HostKVArena(host.extent_bytes(3))
    extent = arena.allocate(host.extent_bytes(3), "main")
    offload_pages(planes, layout, [1, 2, 3], arena, extent, path=path)
    restored, _ = restore_pages(make_planes(layout, N, seed=12), layout, [4, 5, 6], arena, extent, path=path)
    arena.view(extent)[:] = 0xAB  # the restore must not read the extent any more
    arena.free(extent)
    want = pages_of(planes, layout, [1, 2, 3])
    got = pages_of(restored, layout, [4, 5, 6])
    for name in want:
        assert np.array_equal(got[name], want[name])


def test_errors_leave_arena_and_planes_unchanged(make_planes):
    layout = PagedKVStorageLayout("bf16", 1, 1, 64)
    other = PagedKVStorageLayout("k8v4", 1, 1, 64)
    host = HostKVPageLayout(layout)
    planes = make_planes(layout, N, seed=13)
    arena = HostKVArena(host.extent_bytes(4) * 3)
    extent = arena.allocate(host.extent_bytes(2), "main")
    snap, data = arena.snapshot(), arena.buffer.copy()
    with pytest.raises(ValueError, match=r"pages \[0, 3\) do not fit the extent of 2 pages"):
        offload_pages(planes, layout, [1, 2, 3], arena, extent)
    with pytest.raises(ValueError, match=r"first_page must be in \[0, 1\]"):
        offload_pages(planes, layout, [1], arena, extent, first_page=2)
    with pytest.raises(ValueError, match=r"page ID 12 is out of range \[0, 12\)"):
        offload_pages(planes, layout, [12], arena, extent)
    with pytest.raises(ValueError, match="appears more than once"):
        restore_pages(planes, layout, [3, 3], arena, extent)
    with pytest.raises(ValueError, match="different pool layout"):
        offload_pages(make_planes(other, N, seed=1), other, [0], arena, extent)
    with pytest.raises(ValueError, match="plane 'v' has shape .* for 3 pages"):
        offload_pages({**planes, "k": planes["k"][:, :3]}, layout, [0], arena, extent)
    with pytest.raises(ValueError, match="keyed exactly"):
        offload_pages({"k": planes["k"]}, layout, [0], arena, extent)
    stale = arena.allocate(host.extent_bytes(1), "main")
    arena.free(stale)
    snap = arena.snapshot()
    with pytest.raises(StaleExtentError):
        offload_pages(planes, layout, [0], arena, stale)
    with pytest.raises(StaleExtentError):
        restore_pages(planes, layout, [0], arena, stale)
    assert arena.snapshot() == snap and np.array_equal(arena.buffer, data)
    assert not any(p.is_deleted() for p in planes.values())  # nothing was donated
    with pytest.raises(ValueError, match="path='fast' is invalid"):
        offload_pages(planes, layout, [0], arena, extent, path="fast")
    same, rep = restore_pages(planes, layout, [], arena, extent)
    assert same is planes and (rep.pages, rep.runs, rep.chunks) == (0, 0, 0)


@pytest.mark.parametrize("order", list(PlaneOrder), ids=lambda o: o.value)
def test_attention_over_restored_pages_is_identical(order):
    """Offload a sequence's pages, restore them at other IDs, remap the table: same attention output."""
    layout = PagedKVStorageLayout("k8v4", 2, 2, 64, order=order)
    host = HostKVPageLayout(layout)
    n_tok, pages_src, pages_dst = 150, [5, 2, 9], [0, 7, 3]
    planes = allocate_planes(layout, N, fill=float("nan"))
    tables = jnp.asarray([[5, 2, 9, 0]], jnp.int32)
    keys = jax.random.split(jax.random.key(42), 3)
    k = jax.random.normal(keys[0], (1, n_tok, 2, 64), jnp.float32)
    v = jax.random.normal(keys[1], (1, n_tok, 2, 64), jnp.float32)
    rows = jnp.zeros(1, jnp.int32)
    for layer in range(2):
        view = PagedKVBatchLayerView(planes, tables, layer, layout)
        planes = _append(view, rows, jnp.zeros(1, jnp.int32), k, v, jnp.asarray([n_tok], jnp.int32)).planes
    q = jax.random.normal(keys[2], (1, 5, 4, 64), jnp.float32)
    positions, kv_lens = jnp.asarray([n_tok - 5], jnp.int32), jnp.asarray([n_tok], jnp.int32)
    original = [
        _attention(q, PagedKVBatchLayerView(planes, tables, layer, layout), rows, positions, kv_lens)
        for layer in range(2)
    ]

    arena = HostKVArena(host.extent_bytes(3))
    extent = arena.allocate(host.extent_bytes(3), "main")
    offload_pages(planes, layout, pages_src, arena, extent)
    fresh = allocate_planes(layout, N, fill=float("nan"))
    restored, _ = restore_pages(fresh, layout, pages_dst, arena, extent)
    remapped = jnp.asarray([pages_dst + [0]], jnp.int32)
    for layer in range(2):
        out = _attention(
            q, PagedKVBatchLayerView(restored, remapped, layer, layout), rows, positions, kv_lens
        )
        assert np.all(np.isfinite(np.asarray(out)))
        np.testing.assert_array_equal(np.asarray(out), np.asarray(original[layer]))
