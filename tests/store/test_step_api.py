"""The step API (``begin_step`` / ``attention`` / ``end_step``): the same bits as the full protocol,
and every slip loud, with nothing changed."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv import (AttentionBatch, KVStore, allocate_state, apply_work, attention, begin_step, end_step, ops,
                       take_step_work)
from ninfer_kv.schema.errors import DonatedStateError, EntitlementError, PendingWorkError, RowError, WorkOrderError

from .helpers import assert_same, tiny_plan

H, D, HQ = 1, 8, 2  # tiny_plan's KV heads and head dim; two query heads per KV head


def _kv(seed, b, t):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, HQ, D), np.float32)
    k = rng.standard_normal((b, t, H, D), np.float32)
    v = rng.standard_normal((b, t, H, D), np.float32)
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)


@functools.partial(jax.jit, donate_argnums=0)
def _short_step(state, batch, q, k, v):
    outs = []
    for layer in range(2):
        state, out = attention(state, batch, layer, q, k, v, impl="reference")
        outs.append(out)
    return state, jnp.stack(outs)


@functools.partial(jax.jit, donate_argnums=0)
def _full_step(state, work, rows, positions, valid, q, k, v):
    state = apply_work(state, work)
    outs = []
    for layer in range(2):
        view = state.view("main", layer)
        view = ops.paged_append(view, rows, positions, k, v, valid, impl="reference")
        outs.append(ops.paged_attention(q, view, rows, positions, positions + valid, impl="reference"))
        state = state.replace_planes("main", view.planes)
    return state, jnp.stack(outs)


def _pair():
    """Two stores with the same sequences: one for the short way, one for the full protocol."""
    out = []
    for _ in range(2):
        store = KVStore(tiny_plan(pages=12))
        handles = [store.activate(40, 60), store.activate(70, 30)]
        out.append((store, allocate_state(store), handles))
    return out


def test_the_short_way_gives_the_full_protocols_bits():
    (s1, st1, h1), (s2, st2, h2) = _pair()
    for unit, counts in enumerate([np.array([16, 16]), np.array([16, 0]), np.array([1, 1])]):
        t = int(counts.max())
        q, k, v = _kv(unit, 2, t)
        st1, batch = begin_step(s1, st1, h1, counts)
        assert isinstance(batch, AttentionBatch) and batch.rows.dtype == np.int32
        st1, out1 = _short_step(st1, batch, q, k, v)
        end_step(s1, batch)

        rows = np.array([s2.row(h) for h in h2])
        pos = np.array([s2.address_space(h).committed_frontier for h in h2])
        s2.map(rows, pos + counts)
        st2, work = take_step_work(s2, st2)
        st2, out2 = _full_step(st2, work, rows.astype(np.int32), pos.astype(np.int32), counts.astype(np.int32),
                               q, k, v)
        s2.commit(rows, pos + counts)
        np.testing.assert_array_equal(np.asarray(out1), np.asarray(out2))
        np.testing.assert_array_equal(batch.positions, pos)
    for a, b in zip(jax.tree.leaves((st1.planes, st1.tables)), jax.tree.leaves((st2.planes, st2.tables))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert st1.host_serial() == st2.host_serial() == 3
    s1.require_synced(st1)
    assert [s1.address_space(h).committed_frontier for h in h1] == [33, 17]


def test_bad_batches_are_refused_before_anything_changes():
    store = KVStore(tiny_plan(pages=12))
    h = [store.activate(40, 10), store.activate(40, 10)]
    state = allocate_state(store)
    before = store.snapshot()
    for sequences, counts, err, match in [
        ([], 1, ValueError, "at least one sequence"),
        (h, [1, 2, 3], ValueError, "one integer or 2 integers"),
        (h, [-1, 2], ValueError, ">= 0"),
        (h, [1.5, 2], ValueError, "one integer or 2 integers"),
        ([h[0], h[0]], 1, RowError, "twice|more than once|repeated|duplicate"),
        (h, [1, 200], EntitlementError, None),
    ]:
        with pytest.raises(err, match=match):
            begin_step(store, state, sequences, counts)
        assert_same(store.snapshot(), before)
        assert not state.work_pending
    with pytest.raises(TypeError, match="KVDeviceState"):
        begin_step(store, object(), h, 1)
    assert_same(store.snapshot(), before)


def test_slips_are_loud():
    store = KVStore(tiny_plan(pages=12))
    h = [store.activate(40, 10)]
    state = allocate_state(store)
    q, k, v = _kv(0, 1, 4)
    state, batch = begin_step(store, state, h, 4)
    with pytest.raises(PendingWorkError):  # a second begin before the step ran: the first work would be skipped
        begin_step(store, state, h, 4)
    old = state
    state, _ = _short_step(state, batch, q, k, v)
    with pytest.raises(DonatedStateError):  # the donated state is gone
        _short_step(old, batch, q, k, v)
    end_step(store, batch)
    committed = store.snapshot()
    with pytest.raises(WorkOrderError, match="already committed"):  # a repeated end commits nothing
        end_step(store, batch)
    assert_same(store.snapshot(), committed)
    with pytest.raises(TypeError, match="AttentionBatch"):
        end_step(store, (batch.rows, batch.positions))
    store.require_synced(state)
