"""Zero recompilation: over many rounds with churn, forks (COW), moves, offloads and restores,
``apply_work`` compiles once per work bucket and a step applying fixed-shape works compiles once.

The default run covers 400 rounds; ``-m soak`` runs 10,000."""

import jax
import numpy as np
import pytest

from ninfer_kv.store import KVStore
from ninfer_kv.schema.errors import HostCapacityError, LifecycleError, PoolCapacityError
from ninfer_kv.device import apply_work

from .helpers import tiny_plan
from ninfer_kv.device import allocate_state, offload_checkpoint

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _signature(work) -> tuple:
    return tuple((x.shape, str(x.dtype)) for x in jax.tree_util.tree_leaves(work))


class _Compiles:
    def __init__(self):
        self.count = 0

    def __call__(self, event, duration, **kw):
        if event == BACKEND_COMPILE_EVENT:
            self.count += 1


def _churn(rounds: int, seed: int = 0):
    store = KVStore(tiny_plan("mtp", max_context=512, max_concurrency=4, pages=32), host_bytes=64 << 10)
    rng = np.random.default_rng(seed)
    apply = jax.jit(lambda state, work: apply_work(state, work), donate_argnums=(0,))  # a cache of its own
    step_calls = []

    @jax.jit
    def step(state, work, rows):
        step_calls.append(1)
        state = apply_work(state, work)
        return state, state.tables["main"][rows].sum()

    shape = (64, 0, 0)
    state = allocate_state(store)
    sigs: set = set()  # signatures of the works applied alone
    counter = _Compiles()
    recompiled = [0]

    def apply_alone(state, work):
        sig = _signature(work)
        known, before = sig in sigs, counter.count
        sigs.add(sig)
        state = apply(state, work)
        recompiled[0] += int(known and counter.count != before)
        return state

    jax.monitoring.register_event_duration_secs_listener(counter)
    live, ckpts = [], []
    events = dict(forks=0, restores=0, offloads=0)
    try:
        for i in range(rounds):
            if len(live) < store.max_concurrency and rng.random() < 0.3:
                try:
                    if ckpts and rng.random() < 0.6:
                        j = int(rng.integers(len(ckpts)))
                        move = rng.random() < 0.3
                        ck = ckpts.pop(j) if move else ckpts[j]
                        restoring = store.checkpoint(ck).page_placement["host"] > 0
                        h = store.activate(store.checkpoint(ck).frontiers["main"] + int(rng.integers(0, 40)), 60,
                                           source=ck, release_source=move)
                        events["forks"] += 1
                        events["restores"] += int(restoring)
                    else:
                        h = store.activate(int(rng.integers(1, 100)), 60)
                    live.append(h)
                except PoolCapacityError:
                    pass
            if ckpts and rng.random() < 0.05:
                ck = ckpts[int(rng.integers(len(ckpts)))]
                if store.checkpoint(ck).placement == "device":
                    state = apply_alone(state, store.take_work())
                    try:
                        offload_checkpoint(store, ck, state)
                        store.drop_device_replica(ck)
                        events["offloads"] += 1
                    except (HostCapacityError, LifecycleError):
                        pass
            if live:
                rows = np.array([store.row(h) for h in live])
                c = np.array([store.bundle(h).main.committed_frontier for h in live])
                ent = np.array([store.bundle(h).main.entitlement_tokens for h in live])
                nxt = np.minimum(c + 1 + rng.integers(0, 3, size=c.size), ent)
                store.map(rows, nxt)
                work = store.take_work()
                if not work.fits(*shape):
                    state = apply_alone(state, work)
                    work = store.take_work()
                state, _ = step(state, work.pad_to(*shape), np.pad(rows, (0, 4 - rows.size)).astype(np.int32))
                store.settle(rows, np.minimum(c + 1, nxt))
                done = [h for h, s, e in zip(live, nxt, ent) if s >= e or rng.random() < 0.02]
                for h in done:
                    live.remove(h)
                    if rng.random() < 0.6 and len(ckpts) < 6:
                        ckpts.append(store.finish(h, retain=True))
                    else:
                        store.finish(h)
            if ckpts and rng.random() < 0.03:
                ck = ckpts.pop(0)
                store.release_checkpoint(ck)
        state = apply_alone(state, store.take_work())
    finally:
        jax.monitoring.unregister_event_duration_listener(counter)
    store.audit_invariants()
    store.require_synced(state)
    return apply._cache_size(), sigs, len(step_calls), recompiled[0], events


def _check(rounds):
    compiled, sigs, step_traces, recompiled, events = _churn(rounds)
    assert events["forks"] > 5 and events["offloads"] > 0 and events["restores"] > 0, events
    assert compiled == len(sigs)  # one compilation per work bucket combination, never another
    assert len(sigs) <= 12, sorted(sigs)
    assert step_traces == 1  # the step applying fixed-shape works compiled once
    assert recompiled == 0


def test_apply_work_compiles_once_per_bucket():
    _check(400)


@pytest.mark.soak
def test_apply_work_compiles_once_per_bucket_10000_rounds():
    _check(10_000)
