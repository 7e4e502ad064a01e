"""Row verbs accept only rows leased to an active sequence; index vectors accept any integer array-like."""

import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv.schema.kinds import PoolKind
from ninfer_kv.store import KVStore
from ninfer_kv.schema.errors import RowError

from .helpers import assert_same, tiny_plan

MAIN, MTP = PoolKind.MAIN, PoolKind.MTP


@pytest.fixture()
def store():
    s = KVStore(tiny_plan("mtp", pages=12, max_concurrency=3))
    a = s.activate(100, 50)
    s.map(a, 100)
    s.commit(a, 100)
    h = s.activate(70, 10)
    s.map(h, 70)
    s.commit(h, 70)
    s.finish(h, retain=True)  # a checkpoint: its inactive slot index is >= C
    return s


def _unchanged(store, fn, match):
    before = store.snapshot()
    with pytest.raises(RowError, match=match) as info:
        fn()
    assert isinstance(info.value, ValueError)
    assert_same(before, store.snapshot())
    store.audit_invariants()


VERBS = {
    "map": lambda s, rows, pool: s.map(rows, [1] * len(rows), pool=pool),
    "commit": lambda s, rows, pool: s.commit(rows, [200] * len(rows), pool=pool),
    "trim": lambda s, rows, pool: s.trim(rows, pool=pool),
    "settle": lambda s, rows, pool: s.settle(rows, [200] * len(rows), pool=pool),
    "round_boundary": lambda s, rows, pool: s.round_boundary(rows),
}


@pytest.mark.parametrize("verb", sorted(VERBS))
@pytest.mark.parametrize("pool", [MAIN, "mtp"])
def test_rows_must_be_leased_to_an_active_sequence(store, verb, pool):
    fn = VERBS[verb]
    active = int(store.active_rows()[0])
    assert active == 0
    # C = 3: row 3 would be the first checkpoint slot of the address-space tables
    _unchanged(store, lambda: fn(store, np.array([3]), pool), r"row 3 is outside \[0, 3\)")
    _unchanged(store, lambda: fn(store, [active, 2], pool), r"row 2 is not leased")
    _unchanged(store, lambda: fn(store, [1], pool), r"row 1 is not leased")
    _unchanged(store, lambda: fn(store, [-1], pool), r"row -1 is outside")
    _unchanged(store, lambda: fn(store, [active, active], pool), r"row 0 is named more than once")


def test_checkpoint_frontier_is_not_reachable_through_row_verbs(store):
    ck = store.checkpoints()[0]
    frontier = store.checkpoint(ck).frontiers[MAIN]
    _unchanged(store, lambda: store.commit(np.array([store.max_concurrency]), [frontier + 1]), "outside")
    _unchanged(store, lambda: store.trim([2]), "not leased")
    assert store.checkpoint(ck).frontiers[MAIN] == frontier


@pytest.mark.parametrize(
    "rows",
    [np.array([0], np.int64), np.array([0], np.uint8), np.array([0], np.int32), [0], (0,), jnp.array([0], jnp.int32)],
    ids=["int64", "uint8", "int32", "list", "tuple", "jax"],
)
def test_any_integer_array_like(store, rows):
    store.map(rows, jnp.array([120]))
    store.commit(rows, [110])
    assert store.settle(rows, np.array([110], np.uint16)) == 0
    assert store.address_space(store.sequences()[0]).committed_frontier == 110
    grant = store.round_boundary(rows)
    assert grant.rows.tolist() == [0]


def test_bad_index_vectors(store):
    before = store.snapshot()
    with pytest.raises(ValueError, match="overflows int64"):
        store.commit([0], [2**70])
    with pytest.raises(ValueError, match="overflows int64"):
        store.commit([0], np.array([2**63], np.uint64))
    with pytest.raises(TypeError, match="integer"):
        store.map([0.0], [10])
    with pytest.raises(TypeError, match="integer"):
        store.map([0], [True])
    with pytest.raises(ValueError, match="1-D"):
        store.map([[0]], [[10]])
    with pytest.raises(ValueError, match="one length"):
        store.map([0], [10, 20])
    assert_same(before, store.snapshot())


def test_handle_verbs_share_the_row_validation(store):
    h = store.sequences()[0]
    row = store.row(h)
    store._rows.unlease(row)  # a corrupted lease is caught by the same check
    try:
        with pytest.raises(RowError, match=f"row {row} is not leased"):
            store.commit(h, 100)
    finally:
        store._rows.lease(row, h.id)
    store.audit_invariants()
