"""Window rings: the per-row KV of sliding-window layers (ninfer_kv.planning.rings).

* the ring size is exact: every step of at most ``T`` tokens touches at most ``k`` blocks, no two of
  them the same ring page (checked over every window, step size and start offset of a range);
* the plan counts the rings in every ``B(M)``, and the bytes really allocated equal the curve;
* through the step API a ring layer gives the bits of the same layer kept whole in the Main pool
  (with the same window), over steps that wrap the ring many times, on two rows at once;
* the ring table follows Main's: a poisoned state (sentinel tables) writes no ring page;
* slips are refused with nothing changed.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ninfer_kv import KVStore, allocate_state, apply_work, attention, begin_step, end_step
from ninfer_kv.device.allocation import allocated_pool_bytes
from ninfer_kv.ops.views import ring_table
from ninfer_kv.planning import ExplicitCapacity, ModelKVConfig, PlanBoundError, WindowRings, plan_kv_cache
from ninfer_kv.schema.geometry import PAGE_SIZE as P

from .helpers import assert_same

H, D, HQ = 1, 8, 2
WINDOW, STEP = 70, 40


def _touched_blocks(c: int, w: int, t: int) -> range:
    """Blocks a step writing ``t`` tokens at ``c ..`` reads or writes with window ``w``."""
    return range(max(c - w + 1, 0) // P, (c + t - 1) // P + 1)


@pytest.mark.parametrize("w", [1, 2, 63, 64, 65, 70, 128, 200])
@pytest.mark.parametrize("t", [1, 2, 40, 64, 65, 128])
def test_a_ring_holds_every_step_without_aliasing(w, t):
    rings = WindowRings(1, w, t)
    k = rings.pages_per_row
    most = 0
    for c in range(0, 4 * P + 1):
        blocks = list(_touched_blocks(c + 5 * P, w, t))
        most = max(most, len(blocks))
        assert len({b % k for b in blocks}) == len(blocks)
    assert most == k  # exact: some step needs every ring page


def _plan(rings: WindowRings | None, layers: int, *, rows=2, context=512):
    model = ModelKVConfig(num_layers=layers, num_kv_heads=H, head_dim=D, rings=rings)
    return plan_kv_cache(model, max_context=context, max_concurrency=rows, policy=ExplicitCapacity(rows * context))


def test_the_plan_counts_the_rings_in_every_bytes_figure():
    rings = WindowRings(3, WINDOW, STEP)
    plan = _plan(rings, 1)
    base = _plan(None, 1)
    ring_bytes = plan.rings.bytes
    assert ring_bytes == 2 * rings.pages_per_row * plan.rings.layout.page_bytes
    assert plan.curve.b_min == base.curve.b_min + ring_bytes and plan.curve.b_step == base.curve.b_step
    assert plan.device_bytes == allocated_pool_bytes(plan.pool_set, plan.m)
    assert plan.to_json()["rings"]["pages_per_row"] == rings.pages_per_row
    assert KVStore(plan).memory_summary().ring_bytes == ring_bytes


def test_bad_ring_values_are_refused_by_name():
    for kwargs, name in [(dict(num_layers=0, window=4), "window layers"), (dict(num_layers=1, window=0), "window"),
                         (dict(num_layers=1, window=4, step_tokens=0), "step_tokens")]:
        with pytest.raises(PlanBoundError, match=name):
            WindowRings(**kwargs)
    with pytest.raises(TypeError, match="rings"):
        ModelKVConfig(1, 1, 8, rings=(1, 4))
    with pytest.raises(ValueError, match="speculative"):
        from ninfer_kv.planning import SpeculativeConfig

        plan_kv_cache(ModelKVConfig(1, 1, 8, rings=WindowRings(1, 4)), max_context=128, max_concurrency=1,
                      policy=ExplicitCapacity(128), speculative=SpeculativeConfig("mtp", draft_window=2))


def test_the_ring_table_follows_mains_table():
    main = jnp.asarray([[5, 9, -1, -1], [-1, -1, -1, -1]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(ring_table(main, 3)), [[0, 1, -1, -1], [-1, -1, -1, -1]])
    full = jnp.zeros((2, 5), jnp.int32)
    np.testing.assert_array_equal(np.asarray(ring_table(full, 3)), [[0, 1, 2, 0, 1], [3, 4, 5, 3, 4]])


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("ring", "impl"))
def _step(state, batch, q, k, v, *, ring, impl):
    state, full = attention(state, batch, 0, q, k, v, impl=impl)
    state, windowed = attention(state, batch, 0 if ring else 1, q, k, v, window=WINDOW, ring=ring, impl=impl)
    return state, jnp.stack([full, windowed])


def _kv(seed, b, t):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal((b, t, h, D), np.float32)) for h in (HQ, H, H))


def test_a_ring_layer_gives_the_bits_of_the_same_layer_kept_whole(impl="ffi"):
    ringed = KVStore(_plan(WindowRings(1, WINDOW, STEP), 1))
    whole = KVStore(_plan(None, 2))
    runs = []
    for store in (ringed, whole):
        state = allocate_state(store, fill=float("nan") if store is ringed else None)
        handles = [store.activate(400, 100), store.activate(380, 100)]
        runs.append([store, state, handles, []])
    schedule = [np.array([40, 17]), np.array([1, 40]), np.array([33, 0])] + [np.array([s % 41, (s * 7) % 41])
                                                                               for s in range(3, 26)]
    for unit, counts in enumerate(schedule):
        q, k, v = _kv(unit, 2, STEP)  # one token shape: one compile (rows past their count are padding)
        for run in runs:
            store, state, handles, outs = run
            state, batch = begin_step(store, state, handles, counts)
            state, out = _step(state, batch, q, k, v, ring=store is ringed, impl=impl)
            end_step(store, batch)
            run[1] = state
            mask = np.arange(q.shape[1])[None, :] < counts[:, None]
            outs.append(np.where(mask[None, :, :, None, None], np.asarray(out), 0.0))
    ring_tokens = ringed.pool_set.rings.spec.ring_tokens
    assert ringed.committed_frontiers([0, 1]).min() > 2 * ring_tokens  # every ring wrapped twice
    for a, b in zip(runs[0][3], runs[1][3]):
        np.testing.assert_array_equal(a, b)


def test_a_poisoned_state_writes_no_ring_page():
    store = KVStore(_plan(WindowRings(1, WINDOW, STEP), 1))
    state = allocate_state(store)
    h = store.activate(64, 10)
    state, batch = begin_step(store, state, [h], 8)
    state = apply_work(state, batch.work)
    poisoned = state.replace(tables={k: jnp.full_like(t, -1) for k, t in state.tables.items()})
    q, k, v = _kv(0, 1, 8)
    run = jax.jit(lambda st, b, q, k, v: attention(st, b, 0, q, k, v, window=WINDOW, ring=True, impl="reference"))
    out_state, _ = run(poisoned, batch, q, k, v)  # under jit a sentinel entry drops its tokens
    assert not np.asarray(out_state.rings["k"]).any()


def test_ring_slips_are_refused_with_nothing_changed():
    store = KVStore(_plan(WindowRings(1, WINDOW, STEP), 1))
    state = allocate_state(store)
    h = store.activate(200, 10)
    before = store.snapshot()
    with pytest.raises(ValueError, match="step_tokens=40"):
        begin_step(store, state, [h], STEP + 1)
    assert_same(store.snapshot(), before)
    state, batch = begin_step(store, state, [h], 8)
    q, k, v = _kv(1, 1, 8)
    with pytest.raises(ValueError, match=r"window=None.*\[1, 70\]"):
        attention(state, batch, 0, q, k, v, ring=True, impl="reference")
    with pytest.raises(ValueError, match=r"window=71"):
        attention(state, batch, 0, q, k, v, window=71, ring=True, impl="reference")
    plain = KVStore(_plan(None, 1))
    pstate, pbatch = begin_step(plain, allocate_state(plain), [plain.activate(64, 8)], 8)
    with pytest.raises(ValueError, match="no window rings|needs a state with window rings"):
        attention(pstate, pbatch, 0, q, k, v, window=8, ring=True, impl="reference")


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _both(st_ring, st_whole, batch_ring, batch_whole, q, k, v):
    st_ring, a = attention(st_ring, batch_ring, 0, q, k, v, window=WINDOW, ring=True, impl="ffi")
    st_whole, b = attention(st_whole, batch_whole, 0, q, k, v, window=WINDOW, impl="ffi")
    return st_ring, st_whole, a, b


def _step_both(stores, states: list, handles, count: int, seed: int):
    """One step of ``count`` tokens for the sequence ``handles[i]`` of each store (the ringed one
    first), ``states`` updated in place; the two ring-or-whole layer outputs of the real tokens."""
    q, k, v = _kv(seed, 1, STEP)
    batches = []
    for i, (store, h) in enumerate(zip(stores, handles)):
        states[i], batch = begin_step(store, states[i], [h], count)
        batches.append(batch)
    states[0], states[1], a, b = _both(states[0], states[1], *batches, q, k, v)
    for store, batch in zip(stores, batches):
        end_step(store, batch)
    return np.asarray(a)[:, :count], np.asarray(b)[:, :count]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops_=st.lists(st.tuples(st.sampled_from(["step", "step", "step", "finish"]), st.integers(0, 2),
                               st.integers(0, STEP), st.integers(0, 2**16)), min_size=4, max_size=40))
def test_random_schedules_rows_reused_give_the_whole_layers_bits(ops_):
    """Sequences start, step by random counts and finish on random rows (a finished row's ring is
    reused by the next sequence): every output of the ring layer equals the whole layer's."""
    rows = 3
    stores = [KVStore(_plan(WindowRings(1, WINDOW, STEP), 1, rows=rows)), KVStore(_plan(None, 1, rows=rows))]
    states = [allocate_state(stores[0], fill=float("nan")), allocate_state(stores[1])]
    live: dict[int, list] = {}
    for op, slot, count, seed in ops_:
        if op == "finish":
            if slot in live:
                for store, h in zip(stores, live.pop(slot)):
                    store.finish(h)
            continue
        if slot not in live:
            live[slot] = [store.activate(8, 500) for store in stores]
        handles = live[slot]
        if stores[0].committed_frontiers([stores[0].row(handles[0])])[0] + count > 500:
            continue
        a, b = _step_both(stores, states, handles, count, seed)
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("w, t", [(70, 40), (64, 64), (1, 1), (200, 17)])
def test_the_resume_rule_is_exactly_what_a_snapshot_holds(w, t):
    rings = WindowRings(1, w, t)
    k = rings.pages_per_row
    for c in range(0, 6 * P, 7):
        last = -(-c // P) - 1  # the last block the sequence wrote (-1: none)
        held = {p for p in range(c) if p // P > last - k}  # the blocks the ring still holds at c
        for m in range(0, c + 1):
            needed = set(range(max(0, m - w + 1), m)) if m < c else set()
            assert rings.resumable(c, m) == needed.issubset(held), (c, m)
        assert not rings.resumable(c, c + 1)


def test_a_snapshot_resumes_a_fork_on_another_row_with_the_whole_layers_bits():
    """A sequence retained with its ring copied to a snapshot slot; forks at its frontier and at an
    earlier resumable token, on other rows (after a stranger wrote those rows' rings), give the bits
    of the same forks in a store keeping the layer whole."""
    from ninfer_kv.device.ring_snapshots import copy_ring

    rows = 3
    ringed = KVStore(_plan(WindowRings(1, WINDOW, STEP, snapshots=1), 1, rows=rows))
    whole = KVStore(_plan(None, 1, rows=rows))
    stores = (ringed, whole)
    states = [allocate_state(ringed, fill=float("nan")), allocate_state(whole)]

    def run(handles, counts, seed):
        return _step_both(stores, states, handles, counts, seed)

    first = [store.activate(300, 0) for store in stores]
    for i in range(8):
        run(first, 37, i)
    frontier = 8 * 37
    row = ringed.row(first[0])
    ckpts = [store.finish(h, retain=True) for store, h in zip(stores, first)]
    states[0] = copy_ring(states[0], row, rows + 0)
    stranger = [store.activate(120, 0) for store in stores]  # overwrites a ring on some row
    for i in range(3):
        run(stranger, 40, 100 + i)
    spec = ringed.pool_set.rings.spec
    forks_at = [frontier, frontier - 20]
    assert all(spec.resumable(frontier, m) for m in forks_at) and not spec.resumable(frontier, 60)
    for j, m in enumerate(forks_at):
        forks = [store.activate(m + 80, 0, source=ck, source_tokens=m) for store, ck in zip(stores, ckpts)]
        states[0] = copy_ring(states[0], rows + 0, ringed.row(forks[0]))
        for i in range(2):
            a, b = run(forks, 40, 200 + 10 * j + i)
            np.testing.assert_array_equal(a, b)
        for store, h in zip(stores, forks):
            store.finish(h)
    with pytest.raises(ValueError, match=r"dst ring=4"):
        copy_ring(states[0], 0, rows + 1)


def test_snapshot_slots_are_handed_out_once_and_given_back():
    from ninfer_kv.device.ring_snapshots import RingImage, RingSnapshots

    plan = _plan(WindowRings(1, WINDOW, STEP, snapshots=2), 1, rows=3).rings
    copies = []
    slots = RingSnapshots(plan, lambda src, dst: copies.append((src, dst)))
    a, b = slots.capture(1, 100), slots.capture(2, 50)
    assert (a, b) == (RingImage(0, 100), RingImage(1, 50)) and slots.capture(0, 10) is None
    assert copies == [(1, 3), (2, 4)] and slots.free_slots == 0
    slots.restore(a, 0)
    assert copies[-1] == (3, 0)
    assert slots.resumable(a, 100) and not slots.resumable(None, 100) and not slots.resumable(a, 101)
    slots.free(a)
    with pytest.raises(RuntimeError, match="freed twice"):
        slots.free(a)
    assert slots.capture(0, 7) == RingImage(0, 7)
