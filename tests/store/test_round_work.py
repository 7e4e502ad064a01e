"""Round work: the store is host-only, ``apply_work`` is a pure function of the caller's state, works
apply in order (a skip or a repeat is detected), page writes equal their sequential history, and the
offload plan -> gather -> complete / cancel split keeps the publication protocol."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv.device import KVDeviceState, apply_work, apply_work_jit, gather_pages
from ninfer_kv.schema.kinds import PoolKind
from ninfer_kv.store import KVStore
from ninfer_kv.schema.round_work import POISONED
from ninfer_kv.schema.errors import LifecycleError, StaleReplicaError, WorkOrderError
from ninfer_kv.device import take_step_work
from ninfer_kv.store.page_writes import PageWrites

from .helpers import P, assert_same, content_ok, device, random_fill, sync, tiny_plan, write_tokens
from ninfer_kv.device import allocate_state, offload_checkpoint

MAIN = PoolKind.MAIN


def _held_arrays(obj, seen=None) -> list:
    """Every jax.Array reachable from ``obj``'s attributes (the store must hold none)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, jax.Array):
        return [obj]
    if isinstance(obj, (str, bytes, int, float, bool, type(None), np.ndarray, np.generic)):
        return []
    if isinstance(obj, dict):
        items = list(obj.keys()) + list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("ninfer_kv"):
        items = list(vars(obj).values())
    else:
        return []
    out = []
    for x in items:
        out += _held_arrays(x, seen)
    return out


def test_store_holds_no_device_array_and_has_no_planes():
    store = KVStore(tiny_plan("mtp", pages=12), host_bytes=1 << 16)
    state = allocate_state(store)
    assert not hasattr(store, "planes") and not hasattr(store, "set_planes") and not hasattr(store, "publish")
    h = store.activate(100, 20)
    store.map(h, 100)
    store.commit(h, 100)
    ck = store.finish(h, retain=True)
    store.activate(110, 5, source=ck)
    state = apply_work_jit(state, store.take_work())
    offload_checkpoint(store, ck, state)
    assert _held_arrays(store) == []
    assert isinstance(state, KVDeviceState) and set(state.planes) == set(state.tables) == set(store.pool_kinds)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    assert all(isinstance(x, jax.Array) for x in leaves)
    assert jax.tree_util.tree_unflatten(treedef, leaves).layouts == state.layouts
    blank = allocate_state(store)  # after takes: holds none of their content, so it starts poisoned
    with pytest.raises(WorkOrderError, match="blank: it was allocated after 1 round work were taken"):
        store.require_synced(blank)


def test_work_applies_table_rows_and_cow_in_one_pure_call():
    store = KVStore(tiny_plan(pages=12))
    h = store.activate(100, 20)
    store.map(h, 100)
    write_tokens(store, MAIN, store.row(h), 0, np.arange(1, 101))  # through helpers' own state
    store.commit(h, 100)
    ck = store.finish(h, retain=True)
    f = store.activate(120, 5, source=ck)  # 1 shared page + a COW tail of 36 columns
    work = store.take_work()
    assert work.counts()[MAIN][1] > 0  # one copy (padded to its bucket)
    assert all(isinstance(x, np.ndarray) for x in jax.tree_util.tree_leaves(work))
    state = device(store).state
    jitted = jax.jit(apply_work)(state, work)  # pure: same result jitted and not
    eager = apply_work(state, work)
    for a, b in zip(jax.tree_util.tree_leaves(jitted), jax.tree_util.tree_leaves(eager)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    device(store).state = jitted
    device(store).works += 1
    phys = store.address_space(f).physical_pages
    assert np.array_equal(np.asarray(jitted.tables[MAIN])[store.row(f), : phys.size], phys)
    assert content_ok(store, MAIN, f, list(range(1, 101)))
    store.require_synced(jitted)


def test_skipped_and_repeated_works_are_detected():
    store = KVStore(tiny_plan(pages=12))
    state = allocate_state(store)
    h = store.activate(10, 100)
    store.map(h, 10)
    w0 = store.take_work()
    state = apply_work_jit(state, w0)
    store.require_synced(state)
    store.map(h, 70)
    w1 = store.take_work()
    w2 = store.take_work()
    skipped = apply_work_jit(state, w2)  # w1 skipped
    assert skipped.host_serial() == POISONED
    with pytest.raises(WorkOrderError, match="poisoned"):
        store.require_synced(skipped)
    # poisoned stays poisoned even when the next work lines up
    assert apply_work_jit(skipped, store.take_work()).host_serial() == POISONED
    # a state that has not applied the latest works is behind
    state2 = KVDeviceState.zeros(store.pool_plans)
    state2 = apply_work_jit(state2, w0)
    with pytest.raises(WorkOrderError, match="applied 1 round work; the store handed out 4"):
        store.require_synced(state2)
    repeated = apply_work_jit(apply_work_jit(state2, w1), w1)
    assert repeated.host_serial() == POISONED


def test_step_work_has_one_shape_and_oversized_work_is_applied_first():
    store = KVStore(tiny_plan(pages=12, max_concurrency=3))
    state = allocate_state(store)
    shape = (16, 0, 0)
    calls = []

    @jax.jit
    def step(state, work):
        calls.append(1)
        return apply_work(state, work)

    h = store.activate(200, 0)
    store.map(h, 200)
    store.commit(h, 200)
    ck = store.finish(h, retain=True)
    for _ in range(3):
        f = store.activate(250, 0, source=ck)  # a COW copy: applied alone before the step
        state, work = take_step_work(store, state, shape)
        assert work.counts() == {MAIN: shape}
        state = step(state, work)
        store.finish(f)
    store.require_synced(state)
    assert len(calls) == 1


def test_page_writes_resolve_to_pre_work_sources():
    """Copy of a copy, restore then copy, and a freed destination rewritten: one parallel batch
    equals the sequential history (checked against a numpy model of the page bytes)."""
    store = KVStore(tiny_plan(pages=12))
    layout = store.layout(MAIN)
    n = store.pool(MAIN).capacity
    state = KVDeviceState.zeros(store.pool_plans)
    rng = np.random.default_rng(0)
    planes = {}
    for name, x in state.planes[MAIN].items():
        raw = rng.integers(0, 256, size=x.size * x.dtype.itemsize, dtype=np.uint8)
        planes[name] = raw.view(x.dtype).reshape(x.shape)
    state = state.replace_planes(MAIN, {k: jnp.asarray(v) for k, v in planes.items()})
    model = {k: v.copy() for k, v in planes.items()}  # sequential reference
    axis = layout.order.page_axis

    def page(arrs, name, p):
        return np.take(arrs[name], p, axis=axis)

    def set_cols(arrs, name, dst, src_page, cols):
        idx = [slice(None)] * 5
        idx[axis] = dst
        idx[3] = slice(0, cols)
        arrs[name][tuple(idx)] = src_page[..., :cols, :]

    writes = PageWrites(layout, n)
    host = {name: rng.integers(0, 256, size=(1,) + page(model, name, 0).shape, dtype=np.uint8).view(
        model[name].dtype).reshape((1,) + page(model, name, 0).shape) if model[name].dtype.itemsize == 1 else
        rng.integers(0, 2**16, size=(1,) + page(model, name, 0).shape, dtype=np.uint16).view(model[name].dtype)
        for name in model}
    history = [("copy", 1, 2, 40), ("copy", 2, 3, 30), ("restore", 4), ("copy", 4, 5, 64), ("copy", 6, 2, 10)]
    for op in history:
        if op[0] == "copy":
            _, s, d, c = op
            writes.copy(s, d, c)
            for name in model:
                set_cols(model, name, d, page(model, name, s).copy(), c)
        else:
            writes.restore(np.array([op[1]]), host)
            for name in model:
                set_cols(model, name, op[1], host[name][0], P)
    copies, restores, payload = writes.take()
    from ninfer_kv.schema.round_work import PoolWork, RoundWork

    pw = PoolWork(np.zeros((3, 0), np.int32), copies, restores, payload, store.max_concurrency, n)
    state = apply_work_jit(state, RoundWork(np.asarray(0, np.int32), {MAIN: pw}))
    got = {k: np.asarray(v) for k, v in state.planes[MAIN].items()}
    valid_cols = {2: 10, 3: 30, 4: P, 5: P}  # columns the history defines on each written page
    for name in model:
        for p in range(n):
            a, b = page(got, name, p), page(model, name, p)
            cols = valid_cols.get(p, P)
            assert a[..., :cols, :].tobytes() == b[..., :cols, :].tobytes(), f"{name} page {p}"


def test_offload_plan_gather_complete_and_cancel():
    store = KVStore(tiny_plan(pages=12), host_bytes=1 << 16)
    random_fill(store, seed=2)
    h = store.activate(150, 0)
    store.map(h, 150)
    write_tokens(store, MAIN, store.row(h), 0, np.arange(1, 151))
    store.commit(h, 150)
    ck = store.finish(h, retain=True)
    state = sync(store)
    before = store.snapshot()
    plan = store.plan_offload(ck)
    assert plan.page_counts == {MAIN: 3} and plan.pages[MAIN].shape == (4,)
    assert all(p.pins == 1 for p in store.address_space(ck).pages())
    with pytest.raises(LifecycleError, match="pinned"):
        store.release_checkpoint(ck)
    store.cancel_offload(plan)
    assert_same(before, store.snapshot())
    with pytest.raises(LifecycleError, match="already cancelled"):
        store.complete_offload(plan, gather_pages(state, plan.request))

    # a payload gathered from a state that missed the works the pages need is refused, rolled back
    plan = store.plan_offload(ck)
    stale = KVDeviceState.zeros(store.pool_plans)
    with pytest.raises(WorkOrderError, match="work serial 0"):
        store.complete_offload(plan, jax.jit(gather_pages)(stale, plan.request))
    assert_same(before, store.snapshot())

    # the real thing: gather inside any jitted function, complete, the bytes round-trip
    plan = store.plan_offload(ck)
    payload = jax.jit(gather_pages)(state, plan.request)
    report = store.complete_offload(plan, payload)
    assert report.pages == 3 and store.checkpoint(ck).placement == "both"
    store.drop_device_replica(ck)
    random_fill(store, seed=9)
    f = store.activate(160, 0, source=ck)  # restores travel in the next work
    assert store.pending_work()[MAIN][1:] == (0, 4)  # 3 restored pages + the 22-column tail copied from one
    sync(store)
    assert content_ok(store, MAIN, f, list(range(1, 151)))
    store.audit_invariants()


def test_complete_offload_verifies_epoch():
    store = KVStore(tiny_plan(pages=12), host_bytes=1 << 16)
    h = store.activate(100, 0)
    store.map(h, 100)
    store.commit(h, 100)
    ck = store.finish(h, retain=True)
    state = sync(store)
    before = store.snapshot()
    plan = store.plan_offload(ck)
    payload = gather_pages(state, plan.request)
    slot = int(store.address_space(ck).page_slots[0])
    store._rt[MAIN].pages.epoch[slot] += 1  # the content moved on between gather and completion
    with pytest.raises(StaleReplicaError):
        store.complete_offload(plan, payload)
    store._rt[MAIN].pages.epoch[slot] -= 1
    assert_same(before, store.snapshot())
    store.audit_invariants()


def test_work_pytree_structure_is_fixed_per_store():
    store = KVStore(tiny_plan("mtp", pages=12))
    a = store.take_work()
    h = store.activate(100, 0)
    store.map(h, 100)
    b = store.take_work()
    cap = store.max_concurrency * store.logical_pages
    assert jax.tree_util.tree_structure(a.pad_to(cap)) == jax.tree_util.tree_structure(b.pad_to(cap))
    assert dataclasses.is_dataclass(a) and set(a.pools) == {MAIN, PoolKind.MTP}
    # a decode round's work transfers its stamp (serial and store identity in one array) and each
    # pool's table updates, nothing else
    leaves = jax.tree_util.tree_leaves(b.pad_to(cap))
    assert len(leaves) == 1 + 2 and leaves[0].shape == (2,)
    # ahead-of-time lowering and compilation see the same structure
    state = KVDeviceState.zeros(store.pool_plans)
    state = apply_work_jit(state, a)
    compiled = jax.jit(apply_work).lower(state, b).compile()
    assert compiled(state, b).host_serial() == 2
