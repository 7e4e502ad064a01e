"""DevicePagePool: capacity identity, reservations, generation-checked leases, ID preference."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer_kv.store import DevicePagePool
from ninfer_kv.schema.errors import PoolCapacityError, StaleHandleError


def _identity(pool):
    assert pool.allocated + pool.reserved + pool.available == pool.capacity
    pool.audit_invariants()


def test_reserve_materialize_dematerialize_release():
    pool = DevicePagePool(10, owners=3, name="main")
    pool.reserve(0, 4)
    pool.reserve(1, 2)
    assert (pool.allocated, pool.reserved, pool.available) == (0, 6, 4)
    ids, gens = pool.materialize(0, 3)
    assert ids.tolist() == [0, 1, 2] and gens.tolist() == [0, 0, 0]
    assert (pool.allocated, pool.reserved, pool.available) == (3, 3, 4)
    # dematerialize returns to the same reservation, not to the global count
    pool.dematerialize(ids[:1], gens[:1], owner=0)
    assert pool.reservation(0) == 2 and pool.available == 4 and pool.allocated == 2
    _identity(pool)
    with pytest.raises(PoolCapacityError, match="reservation holds 2"):
        pool.materialize(0, 3)
    with pytest.raises(PoolCapacityError, match="only 4 of 10"):
        pool.reserve(2, 5)
    pool.release(ids[1:], gens[1:])
    assert pool.available == 6 and pool.release_reservation(0) == 2 and pool.available == 8
    _identity(pool)


def test_stale_lease_is_rejected_after_reuse():
    pool = DevicePagePool(4, owners=1)
    pool.reserve(0, 4)
    ids, gens = pool.materialize(0, 1)
    lease = pool.lease(int(ids[0]))
    pool.dematerialize(ids, gens, owner=0)
    with pytest.raises(StaleHandleError, match="page 0 .*free"):
        pool.release([lease.page], [lease.generation])
    ids2, gens2 = pool.materialize(0, 1)
    assert ids2[0] == lease.page and gens2[0] == lease.generation + 1
    with pytest.raises(StaleHandleError, match="leased at generation 1"):
        pool.check_leases([lease.page], [lease.generation])
    before = pool.snapshot()
    with pytest.raises(StaleHandleError):
        pool.dematerialize([lease.page], [lease.generation], owner=0)
    for k, v in before.items():
        assert np.array_equal(v, pool.snapshot()[k])


def test_prefers_contiguous_runs():
    pool = DevicePagePool(32, owners=2)
    pool.reserve(0, 32)
    ids, gens = pool.materialize(0, 20)
    # free 3..5 and 10..19: a request of 8 takes the lowest run that fits (10..17)
    pool.dematerialize(ids[[3, 4, 5]], gens[[3, 4, 5]], owner=0)
    pool.dematerialize(ids[10:20], gens[10:20], owner=0)
    run, _ = pool.materialize(0, 8)
    assert run.tolist() == list(range(10, 18))
    small, _ = pool.materialize(0, 2)
    assert small.tolist() == [3, 4]  # small requests take the lowest IDs
    _identity(pool)


def test_vectorized_variants_match():
    pool = DevicePagePool(16, owners=4)
    owners = np.array([0, 2, 3])
    pool.reserve_many(owners, np.array([3, 2, 4]))
    ids, gens = pool.materialize_many(owners, np.array([1, 2, 3]))
    assert ids.tolist() == list(range(6))
    assert pool.reservations().tolist() == [2, 0, 0, 1]
    pool.dematerialize_many(ids, gens, np.array([0, 2, 2, 3, 3, 3]))
    assert pool.reservations().tolist() == [3, 0, 2, 4]
    _identity(pool)


def test_bad_owner_and_counts():
    pool = DevicePagePool(4, owners=2)
    with pytest.raises(ValueError, match=r"owner=5 is outside \[0, 2\)"):
        pool.reserve(5, 1)
    with pytest.raises(ValueError):
        pool.reserve(0, -1)
    with pytest.raises(ValueError, match="capacity"):
        DevicePagePool(0, owners=1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["reserve", "mat", "demat", "release", "unres"]), st.integers(0, 2), st.integers(0, 5)), max_size=60))
def test_random_operations_keep_the_identity(ops):
    pool = DevicePagePool(12, owners=3)
    held = {0: [], 1: [], 2: []}
    for op, owner, k in ops:
        try:
            if op == "reserve":
                pool.reserve(owner, k)
            elif op == "unres":
                pool.unreserve(owner, min(k, pool.reservation(owner)))
            elif op == "mat":
                ids, gens = pool.materialize(owner, k)
                held[owner] += list(zip(ids.tolist(), gens.tolist()))
            elif held[owner]:
                take, held[owner] = held[owner][:k], held[owner][k:]
                ids = np.array([t[0] for t in take], np.int64)
                gens = np.array([t[1] for t in take], np.int64)
                if op == "demat":
                    pool.dematerialize(ids, gens, owner)
                else:
                    pool.release(ids, gens)
        except PoolCapacityError:
            pass
        _identity(pool)
        assert pool.allocated == sum(len(v) for v in held.values())
