"""Mapping, commit, trim, speculative settlement, vectorized decode rounds and lease growth."""

import numpy as np
import pytest

from ninfer_kv.schema.kinds import PoolKind
from ninfer_kv.store import EntitlementPolicy, KVStore
from ninfer_kv.schema.errors import TargetError

from .helpers import P, tables_of, tiny_plan

MAIN, MTP, DRAFT = PoolKind.MAIN, PoolKind.MTP, PoolKind.DRAFT_FULL


def test_ensure_mapped_is_a_lower_bound():
    store = KVStore(tiny_plan(pages=12))
    h = store.activate(100, 100)
    space = store.bundle(h).main
    assert space.entitlement_pages == 4 and space.reserved_pages == 4 and space.num_blocks == 0
    assert store.map(h, 130) == 3
    assert (space.num_blocks, space.reserved_pages, space.committed_frontier) == (3, 1, 0)
    # covered already (even a smaller request): no-op, never trims, never moves anything
    assert store.map(h, 10) == 0
    assert store.map(h, 192) == 0
    assert (space.num_blocks, space.entitlement_pages) == (3, 4)
    with pytest.raises(TargetError, match="= 257 for row 0 is out of range"):
        store.map(h, 257)  # beyond L * P = 256
    # the entitlement is whole pages: 256 > 200 tokens is still inside it
    assert store.map(h, 256) == 1
    pool = store.pool()
    assert (pool.allocated, pool.reserved, pool.available) == (4, 0, 8)


def test_trim_returns_leases_to_the_active_reservation():
    store = KVStore(tiny_plan(pages=12))
    h = store.activate(64, 190)
    store.map(h, 250)
    store.commit(h, 70)
    pool = store.pool()
    available = pool.available
    assert store.trim(h, keep_tokens=100) == 2  # keep ceil(max(70, 100) / 64) = 2 pages
    assert store.bundle(h).main.num_blocks == 2
    assert pool.available == available and pool.reservation(store.row(h)) == 2
    # a unit that wrote but did not commit leaves the old frontier
    assert store.bundle(h).main.committed_frontier == 70
    store.finish(h)
    assert pool.available == pool.capacity


def test_mtp_leads_and_settles_independently():
    plan = tiny_plan("mtp", pages=12)
    store = KVStore(plan)
    assert store.pool(MTP).capacity == 12 + 3 * 1
    h = store.activate(60, 68)  # Main: 128 tokens -> 2 pages; MTP: 128 + (3 - 1) -> 3 pages
    b = store.bundle(h)
    assert b.main.entitlement_pages == 2 and b.speculative.entitlement_pages == 3
    row = np.array([store.row(h)])
    store.map(row, [61], pool=MAIN)
    store.map(row, [63], pool=MTP)  # the draft window leads Main
    store.commit(row, [61], pool=MAIN)
    store.commit(row, [60], pool=MTP)
    # speculative verify across a page boundary, then settle each pool on its accepted frontier
    store.map(row, [66], pool=MAIN)
    store.map(row, [68], pool=MTP)
    assert (b.main.num_blocks, b.speculative.num_blocks) == (2, 2)
    store.settle(row, [63], pool=MAIN)  # rejected tail pages trimmed
    store.settle(row, [62], [66], pool=MTP)  # keeps the next round's provisional window
    assert (b.main.committed_frontier, b.main.num_blocks) == (63, 1)
    assert (b.speculative.committed_frontier, b.speculative.num_blocks) == (62, 2)
    ck = store.finish(h, retain=True)  # provisional lead is never checkpoint coverage
    info = store.checkpoint(ck)
    assert info.frontiers == {MAIN: 63, MTP: 62}
    assert info.spaces[MTP].num_blocks == 1
    store.audit_invariants()


def test_draft_full_lags_main():
    store = KVStore(tiny_plan("dflash", pages=12))
    assert store.layout(DRAFT).order.value == "head-major"
    h = store.activate(100, 50)
    store.map(h, 130)
    store.commit(h, 130)
    store.map(h, 120, pool=DRAFT)
    store.commit(h, 120, pool=DRAFT)
    b = store.bundle(h)
    assert (b.main.num_blocks, b.speculative.num_blocks) == (3, 2)
    assert store.pool(MAIN).allocated == 3 and store.pool(DRAFT).allocated == 2
    store.audit_invariants()


def test_vectorized_decode_round_matches_per_lane_calls():
    store = KVStore(tiny_plan(max_context=1024, max_concurrency=4, pages=40))
    hs = [store.activate(p, 200) for p in (10, 63, 64, 127)]
    rows = np.array([store.row(h) for h in hs])
    c = np.array([10, 63, 64, 127])
    store.map(rows, c)
    store.commit(rows, c)
    tables = tables_of(store)
    for _ in range(70):
        store.map(rows, c + 1)
        store.commit(rows, c + 1)
        c = c + 1
        tables = tables_of(store)
    t = np.asarray(tables[MAIN])
    for h, ci in zip(hs, c):
        space = store.bundle(h).main
        assert space.committed_frontier == ci and space.num_blocks == -(-ci // P)
        assert np.array_equal(t[store.row(h), : space.num_blocks], space.physical_pages)
    store.audit_invariants()


def test_lease_growth_and_bounded_completion():
    policy = EntitlementPolicy(kv_lease_growth=True, window_tokens=128, cushion_tokens=64)
    store = KVStore(tiny_plan(max_context=1024, max_concurrency=2, pages=16), entitlement=policy)
    a = store.activate(64, 900)
    space = store.bundle(a).main
    assert space.entitlement_pages == 4  # 64 + 128 + 64 tokens, not the whole budget (15 pages)
    b = store.activate(64, 900)
    row_a, row_b = store.row(a), store.row(b)
    rows = np.array([row_a, row_b])
    c = np.array([64, 64])
    store.map(rows, c)
    store.commit(rows, c)
    limited_at = None
    for step in range(1000):
        grant = store.round_boundary(rows)
        if grant.length_limited.any():
            limited_at = (step, grant)
            break
        assert (grant.covered_tokens >= c + 1).all()
        store.map(rows, c + 1)
        store.commit(rows, c + 1)
        c = c + 1
    assert limited_at is not None
    step, grant = limited_at
    # 16 pages shared by two lanes: growth stops when the pool is exhausted, never mid-step
    pool = store.pool()
    assert pool.available == 0
    lim = grant.rows[grant.length_limited]
    for r in lim:
        i = int(np.flatnonzero(rows == r)[0])
        assert grant.covered_tokens[i] == c[i]  # bounded completion at the covered frontier
    store.audit_invariants()
    total = sum(store.bundle(h).main.entitlement_pages for h in (a, b))
    assert total == 16
    store.finish(a)
    grant = store.round_boundary(rows[1:])
    assert not grant.length_limited.any() and grant.granted_pages[MAIN].sum() > 0


def test_full_entitlement_never_grows():
    store = KVStore(tiny_plan(pages=12))
    h = store.activate(10, 100)
    grant = store.round_boundary()
    assert grant.granted_pages[MAIN].tolist() == [0]
    assert grant.covered_tokens.tolist() == [110] and not grant.length_limited.any()
    assert store.bundle(h).main.entitlement_pages == 2


def test_memory_summary_bills_shared_pages_once():
    store = KVStore(tiny_plan(max_context=1024, max_concurrency=3, pages=40))
    h = store.activate(300, 0)
    store.map(h, 300)
    store.commit(h, 300)
    ck = store.finish(h, retain=True)
    f1 = store.activate(300, 10, source=ck)
    f2 = store.activate(300, 10, source=ck)
    occ = store.occupancy()
    # 4 shared full pages + source tail + 2 private tails; 2 active reservations of 1 spare page each
    assert occ.logical_pages == 7 and occ.shared_pages == 4
    assert occ.allocated == 7 and occ.reserved == 0
    assert occ.mapped_blocks == 15 and occ.aliased_blocks == 8
    assert occ.retained_checkpoints == 1 and occ.active_spaces == 2
    summary = store.memory_summary()
    assert summary.pools["main"].allocated_bytes == 7 * store.layout().page_bytes
    assert "main" in summary.table() and summary.to_json()["active_sequences"] == 2
    store.finish(f1)
    store.finish(f2)
    store.release_checkpoint(ck)
    assert store.occupancy().allocated == 0


def test_truncate_advances_the_content_epoch_and_invalidates_replicas():
    from ninfer_kv.store.logical_page import ReplicaRef
    from ninfer_kv.schema.errors import StaleHandleError

    store = KVStore(tiny_plan(pages=12))
    h = store.activate(100, 50)
    store.map(h, 130)
    store.commit(h, 100)
    space = store.bundle(h).main
    tail, beyond = space.pages()[1], space.pages()[2]
    assert (tail.committed_columns, tail.epoch) == (36, 0)
    replica = tail.canonical
    assert tail.replica_valid(replica, 36) and not tail.replica_valid(replica, 37)
    lease = tail.device_lease
    store.pool().check_leases([lease.page], [lease.generation])
    store.truncate(h, 90)
    assert (tail.committed_columns, tail.epoch) == (26, 1)
    assert not tail.replica_valid(replica, 10)  # same column count later is different content
    assert tail.replica_valid(ReplicaRef(1, 26), 26)
    with pytest.raises(StaleHandleError):  # trimmed: the descriptor was reclaimed
        beyond.epoch
    store.commit(h, 100)
    assert (tail.committed_columns, tail.epoch) == (36, 1)
    store.finish(h)
    with pytest.raises(StaleHandleError):
        tail.references
    with pytest.raises(StaleHandleError):
        store.pool().check_leases([lease.page], [lease.generation])
