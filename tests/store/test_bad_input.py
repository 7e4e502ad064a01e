"""Bad input gives a clear error and changes nothing (full snapshot comparison)."""

import numpy as np
import pytest

from ninfer_kv.schema.kinds import PoolKind
from ninfer_kv.store import CheckpointHandle, KVStore, SequenceHandle
from ninfer_kv.schema.errors import (
    EntitlementError,
    IncompleteContinuationError,
    LifecycleError,
    PoolCapacityError,
    RowError,
    StaleHandleError,
)

from .helpers import assert_same, sync, tiny_plan


def _unchanged(store, fn, exc, match=None):
    before = store.snapshot()
    with pytest.raises(exc, match=match):
        fn()
    assert_same(before, store.snapshot())
    store.audit_invariants()


@pytest.fixture()
def store():
    s = KVStore(tiny_plan("mtp", pages=12))
    h = s.activate(100, 50)
    s.map(h, 100)
    s.commit(h, 100)
    sync(s)
    return s


def test_frontier_beyond_entitlement(store):
    h = store.sequences()[0]
    ent = store.bundle(h).main.entitlement_tokens
    assert ent == 192  # ceil(150 / 64) pages
    _unchanged(store, lambda: store.map(h, ent + 1), EntitlementError, "entitlement covers 192")
    _unchanged(store, lambda: store.map([store.row(h)], [ent + 1]), EntitlementError)
    _unchanged(store, lambda: store.commit(h, 130), EntitlementError, "mapped extent")
    _unchanged(store, lambda: store.commit(h, 99), LifecycleError, "backwards")
    _unchanged(store, lambda: store.truncate(h, 101), LifecycleError, r"outside \[0, 100\]")
    _unchanged(store, lambda: store.map(h, -1), ValueError)
    _unchanged(store, lambda: store.commit([store.row(h), 7], [100, 100]), RowError, "row 7 is outside")
    _unchanged(store, lambda: store.activate(200, 57), EntitlementError, "exceeds max_context=256")
    _unchanged(store, lambda: store.map([1], [10]), RowError, "row 1 is not leased")


def test_unknown_and_stale_handles(store):
    h = store.sequences()[0]
    ck = store.finish(h, retain=True)
    _unchanged(store, lambda: store.finish(h), StaleHandleError, "already finished")
    _unchanged(store, lambda: store.commit(h, 1), StaleHandleError)
    _unchanged(store, lambda: store.map(h, 1), StaleHandleError)
    _unchanged(store, lambda: store.finish(SequenceHandle(99, 0, h.store)), StaleHandleError, "unknown")
    other = KVStore(tiny_plan())
    foreign = other.activate(1, 1)
    _unchanged(store, lambda: store.finish(foreign), StaleHandleError, "does not belong")
    _unchanged(store, lambda: store.finish(ck), TypeError)
    store.release_checkpoint(ck)
    _unchanged(store, lambda: store.release_checkpoint(ck), StaleHandleError, "released")
    _unchanged(store, lambda: store.activate(10, 1, source=ck), StaleHandleError)
    _unchanged(store, lambda: store.release_checkpoint(CheckpointHandle(0, 5, ck.store)), StaleHandleError)
    # a recycled id with a new generation does not revive the old handle
    h2 = store.activate(10, 1)
    if h2.id == h.id:
        assert h2.generation != h.generation
    _unchanged(store, lambda: store.finish(h), StaleHandleError)


def test_activation_beyond_capacity(store):
    # main has 12 pages; the live sequence holds ceil(150/64) = 3 of them (leased + reserved)
    a = store.activate(256, 0)
    store.map(a, 256)
    store.commit(a, 256)
    store.finish(a, retain=True)  # a checkpoint keeps 4 pages
    store.activate(256, 0)  # 4 more reserved: 1 of 12 left
    _unchanged(store, lambda: store.activate(256, 0), PoolCapacityError, "only 1 of 12 are available")
    store.activate(10, 0)
    _unchanged(store, lambda: store.activate(1, 0), PoolCapacityError, "all 3 execution rows")


def test_retain_needs_a_complete_continuation():
    store = KVStore(tiny_plan("mtp", pages=12), requires_state_image=True)
    h = store.activate(70, 10)
    for kind in store.pool_kinds:
        store.map(h, 70, pool=kind)
    store.commit(h, 70)
    store.commit(h, 60, pool="mtp")
    _unchanged(store, lambda: store.finish(h, retain=True), IncompleteContinuationError, "state image")
    _unchanged(
        store,
        lambda: store.finish(h, retain=True, state_image="s", frontiers={"main": 70}),
        IncompleteContinuationError,
        "every enabled pool",
    )
    _unchanged(
        store,
        lambda: store.finish(h, retain=True, state_image="s", frontiers={"main": 70, "mtp": 70}),
        IncompleteContinuationError,
        "mtp: checkpoint frontier 70 != committed frontier 60",
    )
    _unchanged(store, lambda: store.finish(h, state_image="s"), ValueError)
    ck = store.finish(h, retain=True, state_image="s", frontiers={PoolKind.MAIN: 70, PoolKind.MTP: 60})
    info = store.checkpoint(ck)
    assert info.reusable and info.state_image == "s" and info.frontiers == {PoolKind.MAIN: 70, PoolKind.MTP: 60}


def test_checkpoint_without_state_image_is_not_a_hit():
    plan = tiny_plan(pages=12)
    lenient = KVStore(plan)
    h = lenient.activate(10, 0)
    lenient.map(h, 10)
    lenient.commit(h, 10)
    ck = lenient.finish(h, retain=True)
    assert lenient.checkpoint(ck).reusable  # a model without recurrent state needs no image
    strict = KVStore(plan, requires_state_image=True)
    h = strict.activate(10, 0)
    _unchanged(strict, lambda: strict.finish(h, retain=True), IncompleteContinuationError)
    # and an image-less record (e.g. restored by a caller) is refused as an activation source
    ck = strict.finish(h, retain=True, state_image=object())
    strict._registry._records[ck.id].state_image = None
    assert not strict.checkpoint(ck).reusable
    _unchanged(strict, lambda: strict.activate(10, 1, source=ck), IncompleteContinuationError, "not a reusable")


def test_prompt_below_checkpoint_frontier_and_bad_pools(store):
    h = store.sequences()[0]
    ck = store.finish(h, retain=True)
    _unchanged(store, lambda: store.activate(99, 1, source=ck), ValueError, "below the checkpoint frontier 100")
    _unchanged(store, lambda: store.activate(10, 1, release_source=True), ValueError)
    h = store.activate(10, 10)
    _unchanged(store, lambda: store.map(h, 10, pool="draft_full"), ValueError, "not enabled")
    _unchanged(store, lambda: store.map(h, 10, pool="nope"), ValueError, "unknown pool")
    _unchanged(store, lambda: store.map(np.zeros((2, 2)), np.zeros((2, 2))), ValueError)
