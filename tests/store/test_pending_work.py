"""Slips in the step protocol are loud where they happen, at no device cost.

``take_step_work`` returns the state with a static work-pending mark (part of the pytree's
structure): a step that reads the planes or tables before ``apply_work`` fails when it is traced,
``apply_work`` clears the mark, a second take over a marked state is refused, and a donated or
deleted state is refused before anything is taken.  A step that skips ``map_rows`` cannot commit
(the commit is past the mapped extent).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from ninfer_kv import ops
from ninfer_kv.schema.errors import DonatedStateError, EntitlementError, PendingWorkError, WorkOrderError
from ninfer_kv.device import KVDeviceState, apply_work, apply_work_jit, take_step_work
from ninfer_kv.ops.views import PagedKVBatchLayerView
from ninfer_kv.device import work as device_work
from ninfer_kv.schema.kinds import PoolKind
from ninfer_kv.store import KVStore

from .helpers import assert_same, model_step, tiny_plan
from ninfer_kv.device import allocate_state

MAIN = PoolKind.MAIN
T = 8


def _store():
    store = KVStore(tiny_plan(head_dim=16, pages=8, max_concurrency=2, layers=1))
    return store, allocate_state(store)


def _forgetful_step(layout):
    """A step that appends without applying the round's work first."""

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, work, table_rows, positions, valid, k):
        view = PagedKVBatchLayerView(state.planes[MAIN], state.tables[MAIN], 0, layout)
        view = ops.paged_append(view, table_rows, positions, k, k, valid, impl="reference")
        return state.replace_planes(MAIN, view.planes)

    return step


def _args(store, h, n=T):
    return (np.array([store.row(h)], np.int32), np.zeros(1, np.int32), np.array([n], np.int32),
            np.ones((1, n, 1, 16), np.float32))


def test_a_step_that_forgets_apply_work_fails_when_traced_and_changes_nothing():
    store, state = _store()
    h = store.activate(T, 4)
    store.map(np.array([store.row(h)]), np.array([T]))
    state, work = take_step_work(store, state)
    assert state.work_pending
    serial = store.work_serial
    with pytest.raises(PendingWorkError, match=r"apply_work\(state, work\)") as err:
        _forgetful_step(store.layout(MAIN))(state, work, *_args(store, h))
    assert isinstance(err.value, WorkOrderError)
    # nothing ran: the state is live and can still apply the work it was given
    assert store.work_serial == serial
    state = apply_work_jit(state, work)
    assert not state.work_pending
    store.require_synced(state)
    # the same step with apply_work runs, and its commit is accepted
    state = model_step(store.layout(MAIN))(*take_step_work(store, state), *_args(store, h))
    store.commit(np.array([store.row(h)]), np.array([T]))
    store.require_synced(state)


@pytest.mark.parametrize("field", ["planes", "tables"])
def test_a_marked_state_refuses_its_planes_and_tables_on_the_host_too(field):
    store, state = _store()
    state, _ = take_step_work(store, state)
    with pytest.raises(PendingWorkError, match=field):
        getattr(state, field)
    with pytest.raises(PendingWorkError):
        state.pool_planes(MAIN)
    with pytest.raises(PendingWorkError):
        state.replace(**{field: {}})  # a step cannot swap in planes or tables without applying the work
    # the mark is static: it survives flattening and the jit boundary, and costs no leaf
    leaves, treedef = jax.tree_util.tree_flatten(state)
    assert jax.tree_util.tree_unflatten(treedef, leaves).work_pending
    assert len(leaves) == len(jax.tree_util.tree_leaves(state.replace(work_pending=False)))


def test_a_second_take_over_a_marked_state_is_refused_before_taking():
    store, state = _store()
    h = store.activate(T, 4)
    store.map(np.array([store.row(h)]), np.array([T]))
    marked, work = take_step_work(store, state)
    serial = store.work_serial
    with pytest.raises(PendingWorkError, match="never applied"):
        take_step_work(store, marked)
    assert store.work_serial == serial  # nothing was taken
    # a step that returns the state without touching it keeps the mark, so the next take says so
    passthrough = jax.jit(lambda s, w: s)
    with pytest.raises(PendingWorkError):
        take_step_work(store, passthrough(marked, work))
    state = apply_work_jit(marked, work)
    state, _ = take_step_work(store, state)
    assert state.work_pending


def test_take_step_work_refuses_a_donated_or_deleted_state_before_taking():
    store, state = _store()
    h = store.activate(T, 4)
    store.map(np.array([store.row(h)]), np.array([T]))
    state, work = take_step_work(store, state)
    step = model_step(store.layout(MAIN))
    donated = state
    state = step(state, work, *_args(store, h))
    serial = store.work_serial
    with pytest.raises(DonatedStateError, match="use the state that step returned|Use the state"):
        take_step_work(store, donated)
    jax.tree.map(lambda x: x.delete(), state)
    with pytest.raises(DonatedStateError):
        take_step_work(store, state)
    assert store.work_serial == serial
    with pytest.raises(TypeError, match="KVDeviceState"):
        take_step_work(store, {"planes": {}})
    assert store.work_serial == serial


def test_a_step_without_map_rows_cannot_commit():
    """The step runs (its appends reach no page: the row's entries are sentinels), and the commit
    past the mapped extent is refused, changing nothing."""
    store, state = _store()
    h = store.activate(T, 4)
    row = np.array([store.row(h)])
    state = model_step(store.layout(MAIN))(*take_step_work(store, state), *_args(store, h))
    before = store.snapshot()
    with pytest.raises(EntitlementError, match="exceeds its mapped extent 0 tokens; map first"):
        store.commit(row, np.array([T]))
    assert_same(before, store.snapshot())
    assert store.address_space(h).committed_frontier == 0


def test_the_mark_does_not_add_a_work_program():
    """``apply_work_jit`` clears the mark on the host, so marked and unmarked states share one program."""
    store, state = _store()
    state = apply_work_jit(state, store.take_work().pad_to(64, 8, 8))
    before = device_work._apply_work_jit._cache_size()
    marked, work = take_step_work(store, state, (64, 8, 8))
    state = apply_work_jit(marked, work)
    assert device_work._apply_work_jit._cache_size() == before
    assert isinstance(state, KVDeviceState) and not state.work_pending
    # apply_work under jit returns an unmarked state whatever the input's mark
    state, work = take_step_work(store, state, (64, 8, 8))
    out = jax.jit(apply_work)(state, work)
    assert not out.work_pending
