"""Integrity of the split verbs: payloads, works and states that prove where they belong.

* an offload payload names its plan (token, store, pages, state serial): a payload of another plan
  is refused with nothing published and the plan still in flight;
* works and states carry their store's identity: another store's work poisons a state, and
  ``require_synced`` says which store a state belongs to;
* ``audit_invariants`` holds with offload plans in flight;
* one rule for bad targets in every row and handle verb, and the same exception for the same mistake
  on ``KVStore`` and ``ShardedKVStore``;
* ``snapshot()`` describes state, not counters: equal after every rolled-back Host transfer;
* ``pending_work()`` counts what the next work holds;
* ``take_step_work`` compiles a bounded number of work-applying programs.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from ninfer_kv.schema.mesh_spec import MeshSpec
from ninfer_kv.planning import plan_kv_cache_mesh
from ninfer_kv.device import rounds as device_rounds
from ninfer_kv.device import work as device_work
from ninfer_kv.planning import ExplicitCapacity, ModelKVConfig, plan_kv_cache
from ninfer_kv.schema.kinds import PoolKind
from ninfer_kv.store import OFFLOAD_STAGES, RESTORE_STAGES, KVStore
from ninfer_kv.schema.errors import PayloadError, RowError, StaleHandleError, TargetError, WorkOrderError
from ninfer_kv.schema.buckets import step_work_shapes
from ninfer_kv.device import KVDeviceState, apply_work_jit, gather_pages, take_step_work
from ninfer_kv.store.sharded import ShardedKVStore

from .helpers import P, assert_same, sync, tiny_plan, write_tokens
from ninfer_kv.device import allocate_state, gather_offload, offload_checkpoint

MAIN = PoolKind.MAIN


def _store(host_bytes=1 << 20, **kw) -> KVStore:
    return KVStore(tiny_plan(pages=12, **kw), host_bytes=host_bytes)


def _checkpoint(store, tokens, first=1.0):
    h = store.activate(tokens, 0)
    store.map(h, tokens)
    write_tokens(store, MAIN, store.row(h), 0, np.arange(first, first + tokens, dtype=np.float32))
    store.commit(h, tokens)
    return store.finish(h, retain=True)


# -- offload payloads ---------------------------------------------------------------------------------------


def test_a_payload_of_another_plan_is_refused_and_nothing_is_published():
    store = _store()
    a, b = _checkpoint(store, 100), _checkpoint(store, 70, first=300.0)
    state = sync(store)
    plan_a, plan_b = store.plan_offload(a), store.plan_offload(b)
    store.audit_invariants()  # two plans in flight: their extents and pins are accounted for
    payload_a = gather_offload(store, plan_a, state)
    before = store.snapshot()
    with pytest.raises(
        PayloadError,
        match=f"gathered for offload plan {plan_a.token} of store {store.identity}; this is plan {plan_b.token}",
    ):
        store.complete_offload(plan_b, payload_a)
    assert_same(before, store.snapshot())
    assert plan_b.status == "planned" and store.checkpoint(b).placement == "device"
    # same plan, other pages (a payload edited by hand): refused too
    forged = dataclasses.replace(gather_offload(store, plan_b, state), pages=payload_a.pages)
    with pytest.raises(PayloadError, match="holds pages"):
        store.complete_offload(plan_b, forged)
    # a bare gather carries no identity: refused with the way to make a payload
    with pytest.raises(TypeError, match=r"gather_pages\(state, plan.request\)"):
        store.complete_offload(plan_b, gather_pages(state, plan_b.pages))
    assert_same(before, store.snapshot())
    # the right payloads complete; jitted gathers keep the identity
    store.complete_offload(plan_b, jax.jit(gather_pages)(state, plan_b.request))
    store.complete_offload(plan_a, payload_a)
    assert store.checkpoint(a).placement == store.checkpoint(b).placement == "both"
    store.audit_invariants()


def test_a_plan_or_payload_of_another_store_is_refused():
    one, two = _store(), _store()
    ck1, ck2 = _checkpoint(one, 100), _checkpoint(two, 100)
    plan1, plan2 = one.plan_offload(ck1), two.plan_offload(ck2)
    assert plan1.token == plan2.token and plan1.store != plan2.store
    with pytest.raises(StaleHandleError, match=f"belongs to store {two.identity}"):
        one.cancel_offload(plan2)
    with pytest.raises(PayloadError, match=f"of store {two.identity}"):
        one.complete_offload(plan1, gather_offload(two, plan2, sync(two)))
    with pytest.raises(TypeError, match="expected an OffloadPlan"):
        one.cancel_offload("plan")
    one.cancel_offload(plan1)
    two.cancel_offload(plan2)


def test_invariants_hold_with_a_plan_in_flight():
    """The case that failed: a retained checkpoint's offload planned and not completed."""
    store = KVStore(
        plan_kv_cache(
            ModelKVConfig(1, 1, 16, "bf16"), max_context=256, max_concurrency=2, policy=ExplicitCapacity(512)
        ),
        host_bytes=1 << 20,
    )
    h = store.activate(100, 0)
    store.map(h, 100)
    store.commit(h, 100)
    ck = store.finish(h, retain=True)
    plan = store.plan_offload(ck)
    store.audit_invariants()
    assert store.host_occupancy().arena.extent_count == 1
    store.cancel_offload(plan)
    store.audit_invariants()
    # a pin no plan accounts for is caught
    store._rt[MAIN].pages.pins[store.address_space(ck).page_slots[0]] += 1
    with pytest.raises(AssertionError, match="offload plans in flight account for 0"):
        store.audit_invariants()


# -- store identity of works and states ---------------------------------------------------------------------


def test_another_stores_work_poisons_the_state_and_check_state_names_the_store():
    a, b = _store(), _store()
    state_a = allocate_state(a)
    ha, hb = a.activate(10, 10), b.activate(10, 10)
    a.map(ha, 10)
    b.map(hb, 10)
    work_b = b.take_work()  # serial 0, like a's first work
    assert int(work_b.serial) == 0 and int(work_b.store) == b.identity
    state_a = apply_work_jit(state_a, work_b)
    status = state_a.sync_status()
    assert status.poisoned and status.offending_store == b.identity and status.owner == a.identity
    with pytest.raises(WorkOrderError, match=f"given work 0 of store {b.identity}, another store"):
        a.require_synced(state_a)
    # a state is checked against the store that allocated it
    state_b = apply_work_jit(allocate_state(b), b.take_work())
    with pytest.raises(WorkOrderError, match=f"belongs to store {b.identity}, not to this store \\({a.identity}\\)"):
        a.require_synced(state_b)
    # a state built without a store binds to the store of its first work
    free = apply_work_jit(KVDeviceState.zeros(a.pool_plans), a.take_work())
    assert free.sync_status().owner == a.identity and not free.sync_status().poisoned


# -- one rule for bad targets, one exception per mistake on both stores ---------------------------------


def _one_sequence_stores():
    """A single store and a bookkeeping-only sharded store (2 data shards), one sequence at row 0."""
    single = KVStore(tiny_plan(pages=12))
    plan = plan_kv_cache_mesh(
        ModelKVConfig(1, 2, 8, "bf16"),
        MeshSpec.parse("data=2,model=1"),
        max_context=256,
        max_concurrency=6,
        policy=ExplicitCapacity(2 * 12 * P),
    )
    sharded = ShardedKVStore(plan)
    out = []
    for store, h in ((single, single.activate(100, 20)), (sharded, sharded.activate(100, 20, shard=0))):
        store.map(h, 100)
        store.commit(h, 50)
        out.append((store, h))
    return out


VERBS = {
    "map": lambda s, h, r, v: s.map([r], [v]),
    "commit": lambda s, h, r, v: s.commit([r], [v]),
    "trim": lambda s, h, r, v: s.trim([r], [v]),
    "settle": lambda s, h, r, v: s.settle([r], [v]),
    "settle_provisional": lambda s, h, r, v: s.settle([r], [60], [v]),
    "map_handle": lambda s, h, r, v: s.map(h, v),
    "commit_handle": lambda s, h, r, v: s.commit(h, v),
    "trim_handle": lambda s, h, r, v: s.trim(h, keep_tokens=v),
    "truncate": lambda s, h, r, v: s.truncate(h, v),
    "settle_handle": lambda s, h, r, v: s.settle(h, v),
}


@pytest.mark.parametrize("verb", sorted(VERBS))
@pytest.mark.parametrize("value", [-1, -64, 257, 10**6])
def test_bad_targets_are_one_error_naming_row_and_value_on_both_stores(verb, value):
    for store, h in _one_sequence_stores():
        row = store.row(h)
        before = store.snapshot()
        with pytest.raises(
            TargetError, match=f"= {value} for row 0 is out of range; token targets lie in \\[0, 256\\]"
        ):
            VERBS[verb](store, h, row, value)
        assert_same(before, store.snapshot())


@pytest.mark.parametrize("rows", [[0.0], [True], ["0"]])
def test_non_integer_rows_are_a_type_error_on_both_stores(rows):
    for store, _ in _one_sequence_stores():
        for call in (
            lambda: store.map(rows, [60]),
            lambda: store.commit(rows, [60]),
            lambda: store.trim(rows),
            lambda: store.round_boundary(rows),
        ):
            with pytest.raises(TypeError):
                call()


def test_out_of_range_and_non_integer_targets_on_both_stores():
    for store, h in _one_sequence_stores():
        with pytest.raises(RowError, match="row -1"):
            store.map([-1], [60])
        with pytest.raises(RowError, match="row 99"):
            store.commit([99], [60])
        with pytest.raises(TypeError):
            store.map([store.row(h)], [60.5])
        with pytest.raises(TypeError):
            store.commit(h, 60.0)
        with pytest.raises(ValueError, match="one length"):
            store.commit([store.row(h)], [60, 61])


# -- snapshots describe state ---------------------------------------------------------------------------------


class Fault(RuntimeError):
    pass


@pytest.mark.parametrize("stage", OFFLOAD_STAGES + RESTORE_STAGES)
def test_a_rolled_back_host_transfer_leaves_an_equal_snapshot(stage):
    store = _store()
    ck = _checkpoint(store, 150)
    state = sync(store)
    if stage.startswith("restore"):
        offload_checkpoint(store, ck, state)
        store.drop_device_replica(ck)
    store.fault_injector = lambda s, pool: (_ for _ in ()).throw(Fault(s)) if s == stage else None
    before = store.snapshot()
    with pytest.raises(Fault):
        if stage.startswith("offload"):
            offload_checkpoint(store, ck, state)
        else:
            store.restore_checkpoint(ck)
    assert_same(before, store.snapshot())
    store.fault_injector = None
    store.audit_invariants()


# -- pending work -----------------------------------------------------------------------------------------


def test_pending_work_counts_what_the_next_work_holds():
    store = KVStore(tiny_plan(pages=12))
    h = store.activate(100, 0)
    store.map(h, 100)
    store.commit(h, 100)
    ck = store.finish(h, retain=True)  # its row's 4 entries written twice (map, then clear)
    assert store.pending_work()[MAIN] == (4, 0, 0)
    f = store.activate(100, 20, source=ck)  # row published again, one COW copy of the 36-column tail
    pending = store.pending_work()[MAIN]
    assert pending == (4, 1, 0) and not pending.empty
    work = store.take_work()
    assert work.pools[MAIN].used() == tuple(pending)  # the entries carrying work, as promised
    assert work.counts()[MAIN] != tuple(pending)  # the buffers are padded to their buckets
    assert store.pending_work()[MAIN].empty
    store.finish(f)


# -- step-work shapes ------------------------------------------------------------------------------------------


def test_take_step_work_compiles_a_bounded_number_of_programs(monkeypatch):
    store = KVStore(tiny_plan(pages=12, max_concurrency=3), host_bytes=1 << 20)
    shapes = step_work_shapes(store)
    assert shapes.step == (12, 0, 0) and shapes.alone[-1] == (12, 12, 12) and shapes.programs == 1 + len(shapes.alone)
    applied = set()
    real = device_work.apply_work_jit

    def recording(state, work):
        applied.add(tuple(sorted(work.counts().values())))
        return real(state, work)

    monkeypatch.setattr(device_rounds, "apply_work_jit", recording)  # the name take_step_work calls
    state = allocate_state(store)
    rng = np.random.default_rng(0)
    ckpts = []
    for n in (10, 70, 150):
        ckpts.append(_checkpoint(store, n))
    state = sync(store)
    for _ in range(30):  # forks of every kind, finishes, offloads and restores
        ck = ckpts[int(rng.integers(len(ckpts)))]
        front = store.checkpoint(ck).frontiers[MAIN]
        try:
            f = store.activate(front + int(rng.integers(0, 8)), 4, source=ck)
        except Exception:
            f = None
        state, work = take_step_work(store, state, shapes)
        assert work.counts()[MAIN] == shapes.step
        state = real(state, work)
        if f is not None:
            store.finish(f)
    assert applied  # some works were applied alone
    assert len(applied) <= len(shapes.alone)  # every work applied alone used one of the alone shapes
    assert all(c[0] in shapes.alone for c in applied)
