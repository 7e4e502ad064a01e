"""A caller's slip costs that caller's tokens, never another sequence's pages.

Unmapped block-table entries (unmapped blocks, a finished sequence's row, idle rows) hold the
sentinel page, which every op implementation drops under ``jit``; a state that was given a work out
of order is poisoned: nothing of that or any later work is applied and every table entry becomes the
sentinel.  So after a skipped, repeated or reordered work, a step's appends and attention touch no
page at all, for every implementation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv import ops
from ninfer_kv.schema.geometry import SENTINEL_PAGE
from ninfer_kv.schema.errors import DonatedStateError, WorkOrderError
from ninfer_kv.ops.views import PagedKVBatchLayerView
from ninfer_kv.device import apply_work, apply_work_jit
from ninfer_kv.schema.kinds import PoolKind
from ninfer_kv.store import KVStore

from .helpers import model_step, tiny_plan
from ninfer_kv.device import allocate_state

MAIN = PoolKind.MAIN
T = 8
IMPLS = ["reference", "ffi", "pallas"]


def _setup(profile: str = "bf16"):
    """A store with sequence A (70 tokens written and committed, then finished and retained) and an
    active sequence B, its state having applied every work; the planes outside A's pages hold NaN."""
    store = KVStore(tiny_plan(profile=profile, head_dim=16, pages=8, max_concurrency=3, layers=1))
    state = allocate_state(store, fill=float("nan"))
    layout = store.layout(MAIN)
    a = store.activate(70, 10)
    store.map(a, 70)
    state = apply_work_jit(state, store.take_work())
    k = jnp.asarray(np.random.default_rng(0).standard_normal((1, 70, 1, 16)), jnp.float32)
    view = PagedKVBatchLayerView(state.planes[MAIN], state.tables[MAIN], 0, layout)
    view = ops.paged_append(view, [store.row(a)], [0], k, k, [70], impl="reference")
    state = state.replace_planes(MAIN, view.planes)
    store.commit(a, 70)
    row_a = store.row(a)
    ck = store.finish(a, retain=True)
    b = store.activate(10, 40)
    store.map(b, 10)
    state = apply_work_jit(state, store.take_work())
    store.require_synced(state)
    return store, state, ck, b, row_a


def _planes_bytes(state) -> dict:
    return {n: np.asarray(x).view(np.uint8).copy() for n, x in state.planes[MAIN].items()}


def _slip(store, state, kind: str):
    """Give ``state`` works out of order (``kind``); returns the state and the works it missed."""
    store.map(store.sequences()[-1], 50)  # a work that maps pages
    w1 = store.take_work()
    w2 = store.take_work()
    if kind == "skip":
        return w2, state  # the step applies w2: w1 was skipped
    if kind == "repeat":
        state = apply_work_jit(state, w1)
        return w1, state  # the step applies w1 again
    assert kind == "reorder"
    state = apply_work_jit(state, w2)
    return w1, state


def _run_step(store, state, impl, work, rows, positions, valid, value=3.0):
    step = model_step(store.layout(MAIN), impl, attend=True)
    k = jnp.full((len(rows), T, 1, 16), value, jnp.float32)
    return step(
        state,
        work.pad_to(64, 8, 8),
        np.asarray(rows, np.int32),
        np.asarray(positions, np.int32),
        np.asarray(valid, np.int32),
        k,
    )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["skip", "repeat", "reorder"])
def test_a_slip_touches_no_page(impl, kind):
    store, state, ck, b, row_a = _setup()
    rows = [store.row(b), row_a]  # b and the row A left behind (now idle)
    work, state = _slip(store, state, kind)
    before = _planes_bytes(state)
    state, out = _run_step(store, state, impl, work, rows, [10, 0], [T, T])
    after = _planes_bytes(state)
    for name in before:  # every page, not only A's: a poisoned state writes nothing at all
        assert np.array_equal(before[name], after[name]), name
    assert not np.asarray(out).any()  # no key is visible through sentinel tables
    assert (np.asarray(state.tables[MAIN]) == SENTINEL_PAGE).all()
    with pytest.raises(WorkOrderError, match="poisoned"):
        store.require_synced(state)
    # it stays poisoned: the next work in line changes nothing either
    state, out = _run_step(store, state, impl, store.take_work(), rows, [10, 0], [T, T])
    assert all(np.array_equal(before[n], x) for n, x in _planes_bytes(state).items())
    assert store.checkpoint(ck).frontiers[MAIN] == 70


@pytest.mark.parametrize("impl", IMPLS)
def test_a_forgotten_work_drops_the_new_rows_tokens(impl):
    """The original slip: a work mapping B's first page is never applied and the next step runs over
    the stale tables, where B's entries are sentinels (they used to be page 0, A's page)."""
    store = KVStore(tiny_plan(head_dim=16, pages=8, max_concurrency=3, layers=1))
    state = allocate_state(store, fill=float("nan"))
    a = store.activate(64, 0)
    store.map(a, 64)
    state = apply_work_jit(state, store.take_work())
    assert store.address_space(a).physical_pages.tolist() == [0]
    before = _planes_bytes(state)
    b = store.activate(4, 4)
    store.map(b, 4)
    store.take_work()  # forgotten
    table = np.asarray(state.tables[MAIN])
    assert (table[store.row(b)] == SENTINEL_PAGE).all()
    step = model_step(store.layout(MAIN), impl, attend=True)
    empty = store.take_work()
    # the step applies the next work: out of order, so it poisons the state and drops everything
    state, out = step(
        state,
        empty.pad_to(64, 8, 8),
        np.array([store.row(b)], np.int32),
        np.zeros(1, np.int32),
        np.array([4], np.int32),
        jnp.full((1, T, 1, 16), 7.0, jnp.float32),
    )
    assert all(np.array_equal(before[n], x) for n, x in _planes_bytes(state).items())


def test_finished_rows_and_trimmed_blocks_hold_the_sentinel():
    store = KVStore(tiny_plan(head_dim=16, pages=8, max_concurrency=3, layers=1))
    state = allocate_state(store)
    assert (np.asarray(state.tables[MAIN]) == SENTINEL_PAGE).all()
    h = store.activate(130, 0)
    store.map(h, 130)
    row = store.row(h)
    store.commit(h, 65)
    store.trim(h)  # keeps 2 pages, the third block is unmapped again
    state = apply_work_jit(state, store.take_work())
    table = np.asarray(state.tables[MAIN])
    assert (table[row, :2] >= 0).all() and (table[row, 2:] == SENTINEL_PAGE).all()
    store.finish(h)
    state = apply_work_jit(state, store.take_work())
    assert (np.asarray(state.tables[MAIN]) == SENTINEL_PAGE).all()
    assert (store.host_block_table() == SENTINEL_PAGE).all()


def test_a_donated_state_names_the_fix():
    store = KVStore(tiny_plan(pages=8))
    state = allocate_state(store)
    step = jax.jit(lambda s, w: apply_work(s, w), donate_argnums=0)
    new = step(state, store.take_work())
    for use in (
        lambda: step(state, store.take_work()),  # the caller's own jitted step
        lambda: apply_work_jit(state, store.take_work()),
        lambda: store.require_synced(state),
        lambda: state.table("main"),
        lambda: jax.tree.leaves(state),
    ):
        with pytest.raises(
            DonatedStateError, match="use the state that step returned|Use the state that step returned"
        ):
            use()
    assert new.host_serial() == 1
