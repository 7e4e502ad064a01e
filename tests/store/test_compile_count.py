"""Table publication and COW copy compile once: 1,000 decode rounds with page churn, forks (COW),
Moves, trims, retains and releases trigger no further compilation."""

import jax
import numpy as np

from ninfer_kv.page_copy import compiled_variants
from ninfer_kv.store import KVStore, PoolCapacityError, publish_table_updates

from .helpers import tiny_plan

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _churn(store, rng, rounds):
    live = []
    ckpts = []
    for i in range(rounds):
        if len(live) < store.max_concurrency and rng.random() < 0.3:
            try:
                if ckpts and rng.random() < 0.6:
                    ck = ckpts.pop(rng.integers(len(ckpts))) if rng.random() < 0.3 else ckpts[rng.integers(len(ckpts))]
                    frontier = store.checkpoint(ck).frontiers[next(iter(store.pool_kinds))]
                    h = store.activate(frontier + 5, 60, source=ck, release_source=ck not in ckpts)
                else:
                    h = store.activate(int(rng.integers(1, 100)), 60)
                live.append(h)
            except PoolCapacityError:
                pass
        if live:
            rows = np.array([store.row(h) for h in live])
            c = np.array([store.bundle(h).main.committed_frontier for h in live])
            ent = np.array([store.bundle(h).main.entitlement_tokens for h in live])
            step = np.minimum(c + 1 + rng.integers(0, 3, size=c.size), ent)
            store.map_rows(rows, step)
            store.settle_rows(rows, np.minimum(c + 1, step))
            store.publish()
            done = [h for h, s, e in zip(live, step, ent) if s >= e or rng.random() < 0.02]
            for h in done:
                live.remove(h)
                if rng.random() < 0.6 and len(ckpts) < 6:
                    ckpts.append(store.finish(h, retain=True))
                else:
                    store.finish(h)
        if ckpts and rng.random() < 0.03:
            store.release_checkpoint(ckpts.pop(0))
    return live, ckpts


def test_publication_and_cow_compile_once_over_1000_rounds():
    store = KVStore(tiny_plan("mtp", max_context=512, max_concurrency=4, pages=32))
    rng = np.random.default_rng(0)
    _churn(store, rng, 60)  # warm up: every bucket and the COW copy get used
    pub, cow = publish_table_updates._cache_size(), compiled_variants()
    compiles = []

    def listener(event, duration, **kw):
        if event == BACKEND_COMPILE_EVENT:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        _churn(store, rng, 1000)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
    assert publish_table_updates._cache_size() == pub
    assert compiled_variants() == cow
    store.check_invariants()
