"""Host replica tier of the KV store: offload / drop / restore / release through the store's verbs.

Covers byte-exact Device -> Host -> Device round trips (every profile, page-major and head-major
pools, partial tails, contiguous and scattered physical IDs), attention equivalence after a restore
through activation, the publication protocol (a stale replica is never published or used, pinned
pages cannot be released mid-copy), arena exhaustion / invalid plans / fragmentation with nothing
changed, activation rollback around the ``restore_host`` stage, the drop rules and extent lifetime.
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv.host import ffi_library
from ninfer_kv import ops
from ninfer_kv.schema.profiles import KVProfile
from ninfer_kv.host import block_copy
from ninfer_kv.host import HostKVArena, InvalidPlanError, coalesce_runs, host_layout_of
from ninfer_kv.schema.kinds import PoolKind
from ninfer_kv.store import ACTIVATION_STAGES, KVStore
from ninfer_kv.schema.errors import HostCapacityError, LifecycleError, PoolCapacityError, StaleReplicaError
from ninfer_kv.ops.views import PagedKVBatchLayerView

from .helpers import (
    CONFIGS,
    device,
    planes_of,
    set_planes,
    sync,
    tables_of,
    P,
    assert_same,
    content_ok,
    logical_page_bytes,
    logical_page_planes,
    random_fill,
    tiny_plan,
    write_tokens,
)
from ninfer_kv.device import offload_checkpoint

MAIN = PoolKind.MAIN
MiB = 1 << 20


class InjectedFault(RuntimeError):
    pass


def _unchanged(store, fn, exc, match=None):
    before = store.snapshot()
    with pytest.raises(exc, match=match) as info:
        fn()
    assert_same(before, store.snapshot())
    store.audit_invariants()
    return info.value


def _checkpoint(store, tokens, values=None, budget=0):
    """A retained checkpoint at ``tokens`` in every pool holding ``values`` (default 1..tokens)."""
    values = np.arange(1, tokens + 1, dtype=np.float32) if values is None else values
    h = store.activate(tokens, budget)
    for kind in store.pool_kinds:
        store.map(h, tokens, pool=kind)
        write_tokens(store, kind, store.row(h), 0, values)
        store.commit(h, tokens, pool=kind)
    return store.finish(h, retain=True)


def _scattered_checkpoint(store, tokens):
    """Two sequences mapped one page at a time in turn: the checkpoint's physical IDs alternate."""
    a, b = store.activate(tokens, 0), store.activate(tokens, 0)
    for kind in store.pool_kinds:
        for n in range(1, -(-tokens // P) + 1):
            for h in (a, b):
                store.map(h, min(n * P, tokens), pool=kind)
        store.commit(a, tokens, pool=kind)
    return store.finish(a, retain=True), b


def _host_bytes(store, kind, page):
    """A page's bytes per plane as held by its Host replica (whatever its Device replica holds)."""
    r = page.host_replica
    views = host_layout_of(store.layout(kind)).page_planes(store.host_arena.view(r.extent))
    return [v[r.page].tobytes() for v in views.values()]


def _pages(store, ck):
    return {k: store.address_space(ck, k).pages() for k in store.pool_kinds}


def _arena_empty(store):
    occ = store.host_occupancy()
    assert occ.extent_count == 0 and occ.free_extent_count == 1 and occ.free_bytes == occ.capacity
    assert occ.used_bytes == 0 and all(p.extents == 0 for p in occ.pools.values())


# -- byte-exact round trips ------------------------------------------------------------------------------------


@pytest.fixture(params=["numpy-copy", "streaming-copy"])
def host_copy(request, monkeypatch):
    """The Host tier's copies through numpy, or through the library's streaming block copy even for
    these small pages (below its size thresholds)."""
    if request.param == "streaming-copy":
        if ffi_library.LIBRARY.lib is None:
            pytest.skip("the FFI library is not built")
        monkeypatch.setattr(block_copy, "MIN_BYTES", 0)
        monkeypatch.setattr(block_copy, "MIN_BLOCK_BYTES", 1)
    else:
        monkeypatch.setattr(block_copy, "LIBRARY", ffi_library.Library())  # never loaded: numpy
    return request.param


@pytest.mark.parametrize("ids", ["contiguous", "scattered"])
@pytest.mark.parametrize("profile", list(KVProfile), ids=lambda p: p.value)
def test_round_trip_through_store_is_byte_exact(profile, ids, host_copy):
    """Main (page-major, ``profile``) + Draft Full (head-major, BF16): 5 pages with a 44-column tail."""
    plan = tiny_plan("dflash", profile=profile, head_dim=64, pages=16, max_concurrency=4, max_context=512)
    store = KVStore(plan, host_bytes=MiB)
    assert store.layout(PoolKind.DRAFT_FULL).order.value == "head-major"
    assert store.layout(MAIN).order.value == "page-major"
    random_fill(store, seed=7)  # every byte random (NaN patterns included), also beyond the frontier
    tokens = 300
    if ids == "scattered":
        ck, _other = _scattered_checkpoint(store, tokens)
    else:
        ck = _checkpoint(store, tokens)
    pages = _pages(store, ck)
    phys = {k: store.address_space(ck, k).physical_pages for k in store.pool_kinds}
    original = {k: [logical_page_bytes(store, k, p) for p in pages[k]] for k in store.pool_kinds}
    original_tail = {k: {n: x.copy() for n, x in logical_page_planes(store, k, pages[k][4]).items()} for k in pages}
    if ids == "scattered":
        assert all(coalesce_runs(p)[0].size == p.size == 5 for p in phys.values())
    assert store.checkpoint(ck).placement == "device"

    report = offload_checkpoint(store, ck, sync(store))
    assert report.pages == 10 and report.direction == "offload"
    for k in store.pool_kinds:
        r = report.pools[k.value]
        assert (r.pages, r.runs) == (5, coalesce_runs(phys[k])[0].size)
        assert r.bytes == 5 * store.layout(k).page_bytes
        assert [_host_bytes(store, k, p) for p in pages[k]] == original[k]
        assert [p.placement for p in pages[k]] == ["both"] * 5
    assert report.runs == (10 if ids == "scattered" else 2)
    assert store.checkpoint(ck).placement == "both"
    assert store.stats.offloaded_pages == 10

    allocated = {k: store.pool(k).allocated for k in store.pool_kinds}
    assert store.drop_device_replica(ck) == 10
    info = store.checkpoint(ck)
    assert info.placement == "host" and info.page_placement == {"device": 0, "host": 10, "both": 0}
    for k in store.pool_kinds:
        assert store.pool(k).allocated == allocated[k] - 5
        assert (store.address_space(ck, k).physical_pages == -1).all()
    store.audit_invariants()

    random_fill(store, seed=8)  # every Device byte changes: what comes back can only come from Host
    blocker = store.activate(64, 0)
    for k in store.pool_kinds:
        store.map(blocker, 64, pool=k)  # restores land on other IDs than before
    f = store.activate(tokens + 10, 20, source=ck)
    assert store.checkpoint(ck).placement == "both"
    assert store.stats.restored_pages == 10
    for k in store.pool_kinds:
        new = store.address_space(ck, k).physical_pages
        assert (new >= 0).all() and not np.array_equal(new, phys[k])
        if ids == "scattered":
            assert coalesce_runs(new)[0].size > 1
        assert [logical_page_bytes(store, k, p) for p in _pages(store, ck)[k]] == original[k]
        # the fork shares the 4 full pages and COW-copied the 44 committed columns of the tail
        fork = store.address_space(f, k)
        assert np.array_equal(fork.physical_pages[:4], new[:4])
        tail = logical_page_planes(store, k, fork.pages()[4])  # per plane (layers, H, P, X)
        for name, x in tail.items():
            assert x[:, :, :44].tobytes() == original_tail[k][name][:, :, :44].tobytes(), name
    store.audit_invariants()


# -- attention equivalence -------------------------------------------------------------------------------------


_paged_append = jax.jit(functools.partial(ops.paged_append, impl="reference"))
_paged_attention = jax.jit(functools.partial(ops.paged_attention, impl="reference"))


def _append(store, kind, row, k, v):
    """Write ``k, v (1, n, H, D)`` at positions 0.. of ``row`` in every layer with ops.paged_append."""
    tables = tables_of(store)[kind]
    layout = store.layout(kind)
    planes = planes_of(store, kind)
    n = k.shape[1]
    for layer in range(layout.num_layers):
        view = PagedKVBatchLayerView(planes, tables, layer, layout)
        view = _paged_append(
            view, jnp.asarray([row], jnp.int32), jnp.zeros(1, jnp.int32), k, v, jnp.asarray([n], jnp.int32)
        )
        planes = view.planes
    set_planes(store, kind, planes)


def _attend(store, kind, row, q, n):
    tables = tables_of(store)[kind]
    layout = store.layout(kind)
    t = q.shape[1]
    rows, pos, lens = jnp.asarray([row], jnp.int32), jnp.asarray([n - t], jnp.int32), jnp.asarray([n], jnp.int32)
    return [
        np.asarray(
            _paged_attention(q, PagedKVBatchLayerView(planes_of(store, kind), tables, layer, layout), rows, pos, lens)
        )
        for layer in range(layout.num_layers)
    ]


@pytest.mark.parametrize("backend", ["ordinary", "dflash"])
def test_restored_checkpoint_attends_identically(backend):
    """Attention over a sequence before offload == attention over a fork restored from Host-only pages."""
    store = KVStore(tiny_plan(backend, profile="k8v4", head_dim=64, pages=16, max_concurrency=4), host_bytes=MiB)
    random_fill(store, seed=3)
    n = 150
    h = store.activate(n, 10)
    keys = iter(jax.random.split(jax.random.key(0), 8))
    queries = {}
    for kind in store.pool_kinds:
        lay = store.layout(kind)
        store.map(h, n, pool=kind)
        shape = (1, n, lay.num_kv_heads, lay.head_dim)
        _append(store, kind, store.row(h), jax.random.normal(next(keys), shape), jax.random.normal(next(keys), shape))
        store.commit(h, n, pool=kind)
        queries[kind] = jax.random.normal(next(keys), (1, 5, 2 * lay.num_kv_heads, lay.head_dim))
    before = {k: _attend(store, k, store.row(h), queries[k], n) for k in store.pool_kinds}
    ck = store.finish(h, retain=True)

    offload_checkpoint(store, ck, sync(store))
    store.drop_device_replica(ck)
    random_fill(store, seed=4)  # destroy every Device byte
    f = store.activate(n, 10, source=ck)  # restores Host-only pages in the restore_host stage
    for kind in store.pool_kinds:
        after = _attend(store, kind, store.row(f), queries[kind], n)
        for a, b in zip(before[kind], after):
            assert np.all(np.isfinite(a))
            np.testing.assert_array_equal(a, b)
    store.audit_invariants()


# -- publication protocol ----------------------------------------------------------------------------------------


def _ordinary(pages=12, host_bytes=MiB, backend="ordinary"):
    return KVStore(tiny_plan(backend, pages=pages, max_concurrency=4 if pages > 12 else 3), host_bytes=host_bytes)


def test_stale_replica_is_never_published():
    store = _ordinary()
    ck = _checkpoint(store, 200)
    rt = store._rt[MAIN]  # the hook below simulates a concurrent content change (epoch advance)
    slot = int(store.address_space(ck).page_slots[1])
    sync(store)
    before = store.snapshot()
    free_before = store.host_arena.allocator.free_extents()

    def bump(stage, pool):
        if (stage, pool) == ("offload_verify", MAIN):
            rt.pages.epoch[slot] += 1

    store.fault_injector = bump
    with pytest.raises(StaleReplicaError, match="logical block 1 changed during the copy"):
        offload_checkpoint(store, ck, sync(store))
    store.fault_injector = None
    rt.pages.epoch[slot] -= 1
    assert_same(before, store.snapshot())  # no replica published, pins released, extent freed
    assert store.host_arena.allocator.free_extents() == free_before  # the reserved extent was freed
    _arena_empty(store)
    assert store.checkpoint(ck).placement == "device"
    store.audit_invariants()

    # a replica that went stale after publication is never used: not a valid placement, no drop
    offload_checkpoint(store, ck, sync(store))
    first_extent = store.address_space(ck).pages()[0].host_extent
    rt.pages.epoch[slot] += 1
    info = store.checkpoint(ck)
    assert info.placement == "device" and info.page_placement == {"device": 1, "host": 0, "both": 3}
    assert store.address_space(ck).pages()[1].placement == "device"
    _unchanged(store, lambda: store.drop_device_replica(ck), LifecycleError, r"logical blocks \[1\].*no valid Host")
    # offloading again copies exactly the stale page and replaces its replica
    report = offload_checkpoint(store, ck, sync(store))
    assert report.pages == 1
    pages = store.address_space(ck).pages()
    assert pages[1].host_extent != first_extent and pages[0].host_extent == first_extent
    assert pages[1].host_replica.epoch == pages[1].epoch
    assert store.host_occupancy().extent_count == 2 and store.checkpoint(ck).placement == "both"
    store.audit_invariants()
    store.drop_device_replica(ck)
    random_fill(store, seed=5)
    f = store.activate(210, 10, source=ck)  # restores from two extents (three stretches)
    sync(store)
    assert content_ok(store, MAIN, f, list(range(1, 201)))
    store.finish(f)

    # a Host replica going stale during a restore is not published either
    store.drop_device_replica(ck)

    def bump_restore(stage, pool):
        if (stage, pool) == ("restore_verify", MAIN):
            rt.pages.epoch[slot] += 1

    before = store.snapshot()
    store.fault_injector = bump_restore
    with pytest.raises(StaleReplicaError):
        store.restore_checkpoint(ck)
    store.fault_injector = None
    rt.pages.epoch[slot] -= 1
    assert_same(before, store.snapshot())
    store.audit_invariants()
    assert store.checkpoint(ck).placement == "host"


def test_pinned_pages_cannot_be_released_mid_copy():
    store = _ordinary(backend="mtp")
    ck = _checkpoint(store, 150)
    refused = []

    def attempt(name, fn):
        before = store.snapshot()
        with pytest.raises(LifecycleError, match="pinned by an in-flight copy"):
            fn()
        assert_same(before, store.snapshot())
        refused.append(name)

    def during_offload(stage, pool):
        if (stage, pool) == ("offload_verify", MAIN):
            assert all(p.pins == 1 for p in store.address_space(ck).pages())
            attempt("release_checkpoint", lambda: store.release_checkpoint(ck))
            attempt("drop_device_replica", lambda: store.drop_device_replica(ck))
            attempt("offload_checkpoint", lambda: offload_checkpoint(store, ck, device(store).state))
            attempt("move", lambda: store.activate(150, 10, source=ck, release_source=True))

    store.fault_injector = during_offload
    report = offload_checkpoint(store, ck, sync(store))
    assert refused == ["release_checkpoint", "drop_device_replica", "offload_checkpoint", "move"]
    assert report.pages == 6 and store.checkpoint(ck).placement == "both"
    assert all(p.pins == 0 for k in store.pool_kinds for p in store.address_space(ck, k).pages())
    store.audit_invariants()

    store.drop_device_replica(ck)
    refused.clear()

    def during_restore(stage, pool):
        if (stage, pool) == ("restore_verify", PoolKind.MTP):
            attempt("release_checkpoint", lambda: store.release_checkpoint(ck))
            attempt("restore_checkpoint", lambda: store.restore_checkpoint(ck))
            attempt("release_host_replica", lambda: store.release_host_replica(ck))

    store.fault_injector = during_restore
    f = store.activate(150, 10, source=ck)
    assert refused == ["release_checkpoint", "restore_checkpoint", "release_host_replica"]
    store.fault_injector = None
    sync(store)
    for kind in store.pool_kinds:
        assert content_ok(store, kind, f, list(range(1, 151)))
    store.audit_invariants()


# -- capacity --------------------------------------------------------------------------------------------------


def test_arena_exhaustion_changes_nothing():
    stride = KVStore(tiny_plan(), host_bytes=MiB).layout().page_bytes
    store = _ordinary(host_bytes=4 * stride)
    offload_checkpoint(store, _checkpoint(store, 100), sync(store))  # 2 of 4 pages used
    ck = _checkpoint(store, 150)  # 3 pages
    err = _unchanged(store, lambda: offload_checkpoint(store, ck, device(store).state), HostCapacityError, "not enough free bytes")
    assert isinstance(err, PoolCapacityError) and "nothing was changed" in str(err)
    assert err.__cause__.requested_bytes == 3 * stride
    assert store.checkpoint(ck).placement == "device"


def test_invalid_multi_pool_plan_changes_nothing():
    probe = KVStore(tiny_plan("dflash"), host_bytes=MiB)
    main_bytes = 2 * probe.layout(MAIN).page_bytes
    store = KVStore(tiny_plan("dflash"), host_bytes=main_bytes)  # Main's extent fits, Draft Full's not
    ck = _checkpoint(store, 100)
    err = _unchanged(store, lambda: offload_checkpoint(store, ck, device(store).state), HostCapacityError, "draft_full: 2 pages")
    assert isinstance(err.__cause__, InvalidPlanError) and err.__cause__.step == 1
    _arena_empty(store)


def test_fragmented_arena_refuses_with_clear_error():
    stride = KVStore(tiny_plan(), host_bytes=MiB).layout().page_bytes
    store = _ordinary(pages=16, host_bytes=3 * 2 * stride)  # exactly three 2-page extents
    cks = [_checkpoint(store, 100) for _ in range(3)]
    for ck in cks:
        offload_checkpoint(store, ck, sync(store))
    store.release_checkpoint(cks[0])
    store.release_checkpoint(cks[2])
    occ = store.host_occupancy()
    assert occ.free_bytes == 4 * stride and occ.largest_free_extent == 2 * stride
    big = _checkpoint(store, 150)  # 3 pages: fewer bytes than are free, but no hole holds them
    _unchanged(store, lambda: offload_checkpoint(store, big, device(store).state), HostCapacityError, "fragmentation")


def test_restore_needs_available_device_pages():
    store = _ordinary(pages=9)
    ck = _checkpoint(store, 150)
    offload_checkpoint(store, ck, sync(store))
    store.drop_device_replica(ck)
    hog = store.activate(256, 0)  # reserves 4 of the 9 pages; 5 left
    hog2 = store.activate(130, 0)  # 3 more: 2 left, the checkpoint needs 3
    _unchanged(store, lambda: store.restore_checkpoint(ck), PoolCapacityError, "restoring 3 Host-only pages")
    _unchanged(store, lambda: store.activate(150, 0, source=ck), PoolCapacityError)
    store.finish(hog2)
    report = store.restore_checkpoint(ck)
    assert report.pages == 3 and store.checkpoint(ck).placement == "both"
    store.finish(hog)
    store.audit_invariants()


# -- activation rollback around restore_host -----------------------------------------------------------------------


class FaultAt:
    def __init__(self, stage, pool):
        self.stage, self.pool, self.seen = stage, pool, []

    def __call__(self, stage, pool):
        self.seen.append((stage, pool))
        if stage == self.stage and pool == self.pool:
            raise InjectedFault(f"{stage}/{pool}")


def _host_only_store(backend):
    store = KVStore(tiny_plan(backend, pages=12), host_bytes=MiB)
    ck = _checkpoint(store, 100, budget=20)
    offload_checkpoint(store, ck, sync(store))
    store.drop_device_replica(ck)
    other = store.activate(30, 10)
    store.map(other, 40)
    store.commit(other, 30)
    sync(store)
    return store, ck


def _points(store):
    pts = []
    for stage in ACTIVATION_STAGES:
        if stage in ("lease_rows", "publish_active"):
            pts.append((stage, None))
        else:
            pts.extend((stage, kind) for kind in store.pool_kinds)
        if stage == "restore_host":
            pts.extend((s, kind) for kind in store.pool_kinds for s in ("restore_copy", "restore_verify"))
    return pts


@pytest.mark.parametrize("backend", sorted(CONFIGS))
@pytest.mark.parametrize("scenario", ["fork", "move"])
def test_activation_restore_rolls_back_at_every_stage(backend, scenario):
    store, ck = _host_only_store(backend)
    move = scenario == "move"
    prompt = 100 if move else 110
    restored_before = store.stats.restored_pages
    for stage, pool in _points(store):
        before = store.snapshot()
        store.fault_injector = FaultAt(stage, pool)
        with pytest.raises(InjectedFault):
            store.activate(prompt, 30, source=ck, release_source=move)
        assert (stage, pool) in store.fault_injector.seen
        store.fault_injector = None
        assert_same(before, store.snapshot(), f"after fault at {stage}/{pool}")  # arena and replicas too
        store.audit_invariants()
        assert store.checkpoint(ck).placement == "host"
        assert store.stats.restored_pages == restored_before
    for kind in store.pool_kinds:
        assert content_ok(store, kind, ck, list(range(1, 101)))

    seen = []
    store.fault_injector = lambda stage, pool: seen.append((stage, pool))
    h = store.activate(prompt, 30, source=ck, release_source=move)
    store.fault_injector = None
    sub = ("restore_host", "restore_copy", "restore_verify")
    assert [x for x in seen if x[0] in sub] == [(s, k) for k in store.pool_kinds for s in sub]
    store.audit_invariants()
    sync(store)
    for kind in store.pool_kinds:
        assert content_ok(store, kind, h, list(range(1, 101)))
    assert store.stats.restored_pages == restored_before + 2 * len(store.pool_kinds)
    if move:  # the moved pages became writable: their Host replicas (and extents) are gone
        assert store.checkpoints() == []
        _arena_empty(store)
    else:
        assert store.checkpoint(ck).placement == "both"


# -- drop rules, extent lifetime, placements -----------------------------------------------------------------------


def test_drop_rules_and_extent_lifetime():
    store = _ordinary(pages=16)
    a = _checkpoint(store, 200)  # 3 full pages + 8-column tail
    f = store.activate(200, 30, source=a)  # Fork: shares the 3 full pages
    offload_checkpoint(store, a, sync(store))
    _unchanged(store, lambda: store.drop_device_replica(a), LifecycleError, r"blocks \[0, 1, 2\].*active address space")
    store.map(f, 230)
    write_tokens(store, MAIN, store.row(f), 200, np.arange(201, 231, dtype=np.float32))
    store.commit(f, 230)
    b = store.finish(f, retain=True)  # shares pages 0..2 with a, holds its own tail
    assert store.checkpoint(b).page_placement == {"device": 1, "host": 0, "both": 3}

    assert store.drop_device_replica(a) == 4  # shared only among inactive checkpoints: allowed
    info = store.checkpoint(b)
    assert info.placement == "device" and info.page_placement == {"device": 1, "host": 3, "both": 0}
    _unchanged(store, lambda: store.drop_device_replica(b), LifecycleError, r"blocks \[3\].*no valid Host replica")
    assert offload_checkpoint(store, b, device(store).state).pages == 1  # only the page without a Host replica
    assert store.checkpoint(b).placement == "host"
    assert store.host_occupancy().extent_count == 2

    g = store.activate(240, 10, source=b)  # restores the 3 shared pages (b's tail is on Device)
    sync(store)
    assert content_ok(store, MAIN, g, list(range(1, 231)))
    assert store.checkpoint(a).page_placement == {"device": 0, "host": 1, "both": 3}
    store.finish(g)
    store.audit_invariants()

    store.release_checkpoint(a)  # a's extent still holds b's three shared pages
    occ = store.host_occupancy()
    assert occ.extent_count == 2 and occ.pools["main"].host_pages == 4 and occ.pools["main"].extent_pages == 5
    store.audit_invariants()
    store.release_checkpoint(b)  # last references: both extents freed
    _arena_empty(store)
    assert store.pool().allocated == 0
    store.audit_invariants()


def test_release_host_replica_and_restore_drop_host():
    store = _ordinary()
    ck = _checkpoint(store, 150)
    assert store.release_host_replica(ck) == 0
    offload_checkpoint(store, ck, sync(store))
    assert store.release_host_replica(ck) == 3
    assert store.checkpoint(ck).placement == "device"
    _arena_empty(store)
    offload_checkpoint(store, ck, sync(store))
    store.drop_device_replica(ck)
    _unchanged(store, lambda: store.release_host_replica(ck), LifecycleError, "only copy")
    report = store.restore_checkpoint(ck, drop_host=True)
    assert report.pages == 3 and report.direction == "restore"
    assert store.checkpoint(ck).placement == "device"
    _arena_empty(store)
    assert store.restore_checkpoint(ck).pages == 0  # nothing Host-only
    sync(store)
    assert content_ok(store, MAIN, ck, list(range(1, 151)))
    assert store.stats.restored_pages == 3 and store.stats.released_host_pages == 6
    store.audit_invariants()


def test_move_from_both_drops_host_replicas_of_writable_pages():
    store = _ordinary()
    ck = _checkpoint(store, 100)
    offload_checkpoint(store, ck, sync(store))
    h = store.activate(100, 20, source=ck, release_source=True)  # Move: pages become writable
    assert all(p.host_replica is None and p.writer_row == store.row(h) for p in store.bundle(h).main.pages())
    _arena_empty(store)
    store.map(h, 110)
    write_tokens(store, MAIN, store.row(h), 100, np.full(10, 7.0))
    store.commit(h, 110)
    store.truncate(h, 90)
    store.audit_invariants()


def test_summaries_and_counters():
    store = _ordinary(backend="mtp")
    ck = _checkpoint(store, 100)
    offload_checkpoint(store, ck, sync(store))
    store.drop_device_replica(ck)
    summary = store.memory_summary()
    assert summary.offloaded_pages == 4 and summary.restored_pages == 0
    assert summary.pools["main"].host_pages == 2 and summary.pools["main"].host_only_pages == 2
    occ = store.host_occupancy()
    main_stride, mtp_stride = store.layout("main").page_bytes, store.layout("mtp").page_bytes
    assert main_stride != mtp_stride  # one arena, two strides
    assert occ.pools["main"].stride == main_stride and occ.pools["mtp"].stride == mtp_stride
    assert occ.used_bytes == 2 * main_stride + 2 * mtp_stride and occ.extent_count == 2
    assert set(occ.arena.tags) == {"main", "mtp"}
    json.dumps(summary.to_json())
    assert "host arena" in summary.table()
    assert store.host_counters()["offloaded_pages"] == 4
    assert store.stats.dropped_device_pages == 4


def test_store_without_host_tier():
    store = KVStore(tiny_plan())
    ck = _checkpoint(store, 100)
    assert store.host_occupancy() is None and store.host_arena is None
    assert store.checkpoint(ck).placement == "device"
    for verb in ("plan_offload", "drop_device_replica", "restore_checkpoint", "release_host_replica"):
        _unchanged(store, lambda: getattr(store, verb)(ck), LifecycleError, "needs a Host tier")
    assert store.memory_summary().host is None
    with pytest.raises(ValueError, match="either host_arena or host_bytes"):
        KVStore(tiny_plan(), host_arena=HostKVArena(4096), host_bytes=4096)
    with pytest.raises(ValueError, match="host_bytes=0"):
        KVStore(tiny_plan(), host_bytes=0)
    used = HostKVArena(8192)
    used.allocate(100, "main")
    with pytest.raises(ValueError, match="must start empty"):
        KVStore(tiny_plan(), host_arena=used)
    with pytest.raises(TypeError, match="HostKVArena"):
        KVStore(tiny_plan(), host_arena=object())
