"""Step-work shapes: what padding page writes into the step costs, and what the alone ladder bounds.

C = 256 lanes decoding one token each (``paged_append`` over the caller's state, the round's work
applied inside the step), measured side by side in one run:

* the decode step with its work padded to the default step shape ``(tables, 0, 0)`` against the
  same step with room for 8 and 64 COW copies and Host restores in every round (the padding
  entries write nothing, but the step carries the page-write program);
* a fork's work (one COW copy) applied alone at each rung of the default alone ladder;
* a serving loop that moves Host-only checkpoints of random lengths back into service every few
  rounds: the work-applying programs it compiled with ``take_step_work`` (step shape + alone
  ladder) against applying every oversized work at its natural bucketed size (one program per
  bucket combination met).

    PYTHONPATH=. python bench/bench_step_shapes.py [--lanes 256] [--rounds 200]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_store import _lanes, _median_us, build_store  # noqa: E402

from ninfer_kv import ops  # noqa: E402
from ninfer_kv.schema.kinds import PoolKind  # noqa: E402
from ninfer_kv.device import apply_work, apply_work_jit, take_step_work  # noqa: E402
from ninfer_kv.schema.buckets import step_work_shapes  # noqa: E402
from ninfer_kv.ops.views import PagedKVBatchLayerView  # noqa: E402
from ninfer_kv.device import allocate_state, offload_checkpoint

MAIN = PoolKind.MAIN


def decode_step_times(store, state, lanes: int, rounds: int, rng, shapes: list) -> tuple:
    layout = store.layout(MAIN)

    @jax.jit
    def _step(state, work, rows, pos, k):
        state = apply_work(state, work)
        view = ops.paged_append(PagedKVBatchLayerView(state.planes[MAIN], state.tables[MAIN], 0, layout),
                                rows, pos, k, k, jnp.ones_like(pos))
        return state.replace_planes(MAIN, view.planes)

    step = jax.jit(_step, donate_argnums=(0,))
    kv = jnp.asarray(rng.standard_normal((lanes, 1, layout.num_kv_heads, layout.head_dim)), jnp.float32)
    times = {}
    for shape in shapes:  # one run of rounds per shape (each compiles its own step once)
        handles, rows, c = _lanes(store, lanes, rounds, rng)
        state = apply_work_jit(state, store.take_work())
        rows32 = rows.astype(np.int32)
        ts = []
        for _ in range(rounds):
            nxt = c + 1
            store.map(rows, nxt)
            work = store.take_work().pad_to(*shape)
            t0 = time.perf_counter()
            state = step(state, work, rows32, c.astype(np.int32), kv)
            jax.block_until_ready(state)
            ts.append(time.perf_counter() - t0)
            store.commit(rows, nxt)
            c = nxt
        for h in handles:
            store.finish(h)
        state = apply_work_jit(state, store.take_work())
        times[shape] = ts
    return state, {s: _median_us(t[5:]) for s, t in times.items()}


def alone_times(store, state, reps: int) -> tuple:
    h = store.activate(1000, 0)
    store.map(h, 1000)
    store.commit(h, 1000)
    ck = store.finish(h, retain=True)
    state = apply_work_jit(state, store.take_work())
    out = {}
    for shape in step_work_shapes(store).alone:
        ts = []
        for _ in range(reps + 1):
            f = store.activate(1000, 1, source=ck)  # one COW copy of the 40-column tail
            work = store.take_work().pad_to(*shape)
            jax.block_until_ready(state)
            t0 = time.perf_counter()
            state = apply_work_jit(state, work)
            jax.block_until_ready(state)
            ts.append(time.perf_counter() - t0)
            store.finish(f)
            state = apply_work_jit(state, store.take_work())
        out[shape] = _median_us(ts[1:])
    store.release_checkpoint(ck)
    state = apply_work_jit(state, store.take_work())
    return state, out


def serving_programs(rounds: int, rng, padded: bool, head_dim: int) -> int:
    """Work-applying programs compiled by a loop (C = 64) that, every few rounds, moves a Host-only
    checkpoint of random length back into service (restores of 1 to 46 pages, a COW tail)."""
    from ninfer_kv.ops.page_copy import compiled_variants
    from ninfer_kv.device.work import _apply_work_jit
    from ninfer_kv.planning import ExplicitCapacity, ModelKVConfig, plan_kv_cache
    from ninfer_kv.store import KVStore

    jax.clear_caches()
    plan = plan_kv_cache(ModelKVConfig(num_layers=1, num_kv_heads=1, head_dim=head_dim), max_context=4096,
                         max_concurrency=64, policy=ExplicitCapacity(64 * 4096))
    store = KVStore(plan, host_bytes=64 << 20)
    state = allocate_state(store)
    shapes = step_work_shapes(store)
    ckpts = []
    for frontier in rng.integers(40, 2990, size=rounds // 3 + 1).tolist():
        h = store.activate(frontier, 0)
        store.map(h, frontier)
        store.commit(h, frontier)
        ckpts.append((frontier, store.finish(h, retain=True)))
    state = apply_work_jit(state, store.take_work())
    for _, ck in ckpts:
        offload_checkpoint(store, ck, state)
        store.drop_device_replica(ck)
    _apply_work_jit.clear_cache()
    before = compiled_variants()
    live = []
    for r in range(rounds):
        if r % 3 == 0 and ckpts:
            frontier, ck = ckpts.pop()
            live.append(store.activate(frontier + 1, 8, source=ck, release_source=True))
            if len(live) > 8:
                store.finish(live.pop(0))
        if padded:
            state, work = take_step_work(store, state, shapes)
            state = apply_work_jit(state, work)
        else:
            work = store.take_work()
            if not work.fits(*shapes.step):
                state = apply_work_jit(state, work)
                work = store.take_work()
            state = apply_work_jit(state, work.pad_to(*shapes.step))
    jax.block_until_ready(state)
    return _apply_work_jit._cache_size() + compiled_variants() - before


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lanes", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--max-context", type=int, default=32768)
    ap.add_argument("--head-dim", type=int, default=16)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    store = build_store(args.lanes, args.max_context, args.head_dim)
    state = allocate_state(store)
    shapes = step_work_shapes(store)
    t = shapes.step[0]
    step_shapes = [shapes.step, (t, 8, 8), (t, 64, 64)]
    state, steps = decode_step_times(store, state, args.lanes, args.rounds, rng, step_shapes)
    state, alone = alone_times(store, state, 10)
    base = steps[shapes.step]
    print(f"device: {jax.devices()[0].platform}; lanes C={args.lanes}, L={store.logical_pages}, "
          f"N={store.pool().capacity}, head dim {args.head_dim}; step shapes {shapes}")
    print(f"{'measure':<58}{'median us':>11}{'x default step':>16}")
    for shape, us in steps.items():
        print(f"{'decode step, work padded to ' + str(shape):<58}{us:>11.1f}{us / base:>16.2f}")
    for shape, us in alone.items():
        print(f"{'fork work (1 COW copy) applied alone at ' + str(shape):<58}{us:>11.1f}{us / base:>16.2f}")
    ladder = serving_programs(120, np.random.default_rng(1), True, args.head_dim)
    natural = serving_programs(120, np.random.default_rng(1), False, args.head_dim)
    print(f"serving loop, 120 rounds, 40 Host-only checkpoints of random lengths moved back (C=64): {ladder} "
          f"work-applying programs compiled with the step shape + alone ladder, {natural} at natural bucket sizes")


if __name__ == "__main__":
    main()
