"""ShardedKVStore bookkeeping without devices (mesh=None): routing, global rows and bad input."""

import numpy as np
import pytest

from ninfer_kv.schema.errors import LifecycleError, RowError
from ninfer_kv.planning import ExplicitCapacity, ModelKVConfig, plan_kv_cache_mesh
from ninfer_kv.schema.kinds import PoolKind
from ninfer_kv.store.sharded import CrossShardError, ShardedCheckpoint, ShardedKVStore, ShardedSequence
from ninfer_kv.device import allocate_state

PLAN = plan_kv_cache_mesh(ModelKVConfig(1, 4, 64, "bf16"), "data=4,model=2", max_context=256, max_concurrency=8,
                          policy=ExplicitCapacity(4 * 512))


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


def test_rows_and_page_ids_are_per_shard():
    store = ShardedKVStore(PLAN)
    assert (store.num_shards, store.rows_per_shard, store.max_concurrency) == (4, 2, 8)
    hs = [store.activate(70, 10, shard=d) for d in (3, 0, 3)]
    assert [store.row(h) for h in hs] == [6, 0, 7]
    store.map([store.row(h) for h in hs], [70, 70, 70])
    table = store.host_block_table()
    n_local = PLAN.shard.pools[PoolKind.MAIN].physical_pages
    assert table.shape == (8, PLAN.logical_pages)
    # shard 3's two sequences and shard 0's one draw from their own namespaces 0 .. N_local - 1
    assert sorted(table[6:8, :2].ravel().tolist()) == sorted(set(table[6:8, :2].ravel().tolist()))
    assert table[[0, 6, 7], :2].max() < n_local
    assert store.batch_rows([[hs[1]], [], [], [hs[0], hs[2]]], 2).tolist() == [0, 8, 8, 8, 8, 8, 6, 7]
    work = store.take_work()
    assert work.pools[PoolKind.MAIN].tables.shape[0] == 4 and int(work.serial) == 0
    assert [int((w.pools[PoolKind.MAIN].tables[0] != 2).sum()) for w in map(work.shard, range(4))] == [4, 0, 0, 8]  # every entry of an activated row
    store.audit_invariants()


def test_bad_input_changes_nothing():
    store = ShardedKVStore(PLAN)
    h = store.activate(70, 10, shard=1)
    ck_store = store.finish(store.activate(70, 0, shard=2), retain=True)
    before = store.snapshot()
    for shard in (-1, 4, True, 1.0, "1"):
        with pytest.raises(ValueError, match="shard="):
            store.activate(10, 1, shard=shard)
    with pytest.raises(CrossShardError, match="data shard 2"):
        store.activate(70, 10, shard=1, source=ck_store)
    with pytest.raises(TypeError):
        store.activate(70, 10, shard=2, source=h)
    with pytest.raises(RowError, match="row 8 is outside \\[0, 8\\)"):
        store.map([8], [10])
    with pytest.raises(ValueError):
        store.map([store.row(h), 0], [10, 10])  # row 0 (shard 0) is not active
    with pytest.raises(ValueError, match="must be 1-D of one length"):
        store.commit([store.row(h)], [10, 10])
    with pytest.raises(ValueError, match="more than batch_per_shard"):
        store.batch_rows([[], [h, h], [], []], 1)
    with pytest.raises(ValueError, match="listed under shard 0"):
        store.batch_rows([[h], [], [], []], 1)
    with pytest.raises(TypeError):
        store.row("h")
    assert _same(store.snapshot(), before)
    with pytest.raises(LifecycleError, match="without a mesh"):
        allocate_state(store)


def test_construction_errors():
    with pytest.raises(TypeError, match="MeshKVPlan"):
        ShardedKVStore(PLAN.device)

    class _Mesh:
        spec = PLAN.mesh.__class__(2, 4)

    with pytest.raises(ValueError, match="differs from the plan's mesh"):
        ShardedKVStore(PLAN, _Mesh())


def test_forks_stay_in_their_shard():
    store = ShardedKVStore(PLAN)
    h = store.activate(100, 0, shard=2)
    store.map([store.row(h)], [100])
    store.commit([store.row(h)], [100])
    ck = store.finish(h, retain=True)
    assert isinstance(ck, ShardedCheckpoint) and store.shard_of(ck) == 2
    fork = store.activate(100, 10, shard=store.shard_of(ck), source=ck)
    assert isinstance(fork, ShardedSequence) and store.row(fork) // store.rows_per_shard == 2
    work = store.take_work().shard(2)
    assert work.pools[PoolKind.MAIN].used()[1] == 1  # the partial tail's COW copy, inside shard 2
    assert all(store.store(d).sequences() == [] for d in (0, 1, 3))
    store.finish(fork)
    store.release_checkpoint(ck)
    store.audit_invariants()
    assert all(o.available == o.capacity for o in store.occupancy())
