"""Host bookkeeping cost of the KV store, side by side with a trivial jitted dispatch, and a decode
step that applies the round work inside it versus a separate table publication.

Decode rounds over C = 256 lanes (P = 64, mixed context lengths, so ~1/64 of the lanes cross a page
boundary per round): the median host time of ``map`` + ``commit`` (the bookkeeping of one
round) and of ``take_step_work`` (the round work: table entries in a fixed-shape buffer; of it, the
slip checks it adds: the state live, no work pending, and the work-pending mark set), each as a
ratio to the dispatch time of a trivial jitted function measured in the same rounds (each round
also dispatches it; the back-to-back figure, which a CPU client serves faster, is shown too).

Decode step: one ``paged_append`` of a token per lane over the caller's state.  "work inside" runs
``apply_work`` in the step (one dispatch per round); "separate publication" first scatters the
table entries with their own donated jitted dispatch and then runs the step — the shape of the
store-owned tables before the state moved to the caller; "bare" is that scatter and the step in one
program over bare arrays (no state, no work record, no order check); "apply, then step" is the
same state and work as "work inside", applied by ``apply_work_jit`` and then stepped: the two-
dispatch form of the caller-owned state.  All four run the same
rounds; whichever runs first after the round's host work pays for cold caches, so they take turns
at each position and each figure is the mean of its positions' medians.

Also: an activation that forks a 32K-token checkpoint (shares 511 full pages, records a 63-column
COW tail: host time, and time until the copy completed on the device), finish + retain of a
32K-token sequence, and fork + finish + release.

    PYTHONPATH=. python bench/bench_store.py [--rounds 3000] [--lanes 256]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from ninfer_kv import ops
from ninfer_kv.planning import ExplicitCapacity, ModelKVConfig, plan_kv_cache
from ninfer_kv.schema.kinds import PoolKind
from ninfer_kv.device.rounds import _check_step_state
from ninfer_kv.device import apply_work, apply_work_jit, take_step_work
from ninfer_kv.store import KVStore
from ninfer_kv.ops.views import PagedKVBatchLayerView
from ninfer_kv.device import allocate_state

MAIN = PoolKind.MAIN

P = 64


def _median_us(samples) -> float:
    return float(np.median(samples) * 1e6)


def trivial_dispatch_us(n: int = 3000) -> float:
    f = jax.jit(lambda x: x + 1)
    x = jnp.zeros((8,), jnp.int32)
    f(x).block_until_ready()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        y = f(x)
        ts.append(time.perf_counter() - t)
    y.block_until_ready()
    return _median_us(ts)


def build_store(lanes: int, max_context: int, head_dim: int) -> KVStore:
    model = ModelKVConfig(num_layers=1, num_kv_heads=1, head_dim=head_dim)
    pages = lanes * (4096 // P + 2) + 2 * (max_context // P) + 64
    plan = plan_kv_cache(model, max_context=max_context, max_concurrency=lanes, policy=ExplicitCapacity(pages * P))
    return KVStore(plan)


def _lanes(store: KVStore, lanes: int, rounds: int, rng):
    lengths = rng.integers(64, 4096 - rounds // 2, size=lanes)
    handles = [store.activate(int(n), rounds + 8) for n in lengths]
    rows = np.array([store.row(h) for h in handles], np.int64)
    store.map(rows, lengths)
    store.commit(rows, lengths)
    return handles, rows, lengths.astype(np.int64)


def decode_rounds(store: KVStore, state, lanes: int, rounds: int, rng):
    """Decode rounds; each round also dispatches a trivial jitted function, timed under the same
    conditions (a CPU client dispatches faster back-to-back than after host work)."""
    handles, rows, c = _lanes(store, lanes, rounds, rng)
    state = apply_work_jit(state, store.take_work())
    trivial = jax.jit(lambda x: x + 1)
    x = trivial(jnp.zeros((8,), jnp.int32))
    book, take, disp, checks, crossings = [], [], [], [], []
    for _ in range(rounds):
        nxt = c + 1
        t0 = time.perf_counter()
        new_pages = store.map(rows, nxt)
        store.commit(rows, nxt)
        t1 = time.perf_counter()
        state, work = take_step_work(store, state)
        t2 = time.perf_counter()
        x = trivial(x)
        t3 = time.perf_counter()
        state = apply_work_jit(state, work)
        t4 = time.perf_counter()
        _check_step_state(state)  # what take_step_work adds to catch slips, on an unmarked state
        state.replace(work_pending=True)
        t5 = time.perf_counter()
        book.append(t1 - t0)
        take.append(t2 - t1)
        disp.append(t3 - t2)
        checks.append(t5 - t4)
        crossings.append(new_pages)
        c = nxt
    jax.block_until_ready((state, x))
    for h in handles:
        store.finish(h)
    state = apply_work_jit(state, store.take_work())
    return state, {
        "book_us": _median_us(book),
        "book_p90_us": float(np.percentile(book, 90) * 1e6),
        "take_us": _median_us(take),
        "checks_us": _median_us(checks),
        "dispatch_us": _median_us(disp),
        "crossings": float(np.mean(crossings)),
    }


def step_comparison(store: KVStore, state, lanes: int, rounds: int, rng):
    """Seconds per decode round: the work applied inside the step vs a separate publication dispatch."""
    layout = store.layout(MAIN)
    h_, d_ = layout.num_kv_heads, layout.head_dim

    def append(planes, tables, rows, pos, k, v):
        view = ops.paged_append(PagedKVBatchLayerView(planes, tables, 0, layout), rows, pos, k, v,
                                jnp.ones_like(pos))
        return view.planes

    @jax.jit
    def _inside(state, work, rows, pos, k, v):
        state = apply_work(state, work)
        planes = append(state.planes[MAIN], state.tables[MAIN], rows, pos, k, v)
        return state.replace(planes={**state.planes, MAIN: planes})

    @jax.jit
    def _publish(tables, updates):
        return tables.at[updates[0], updates[1]].set(updates[2], mode="drop")

    @jax.jit
    def _step(planes, tables, rows, pos, k, v):
        return append(planes, tables, rows, pos, k, v), tables

    @jax.jit
    def _bare(planes, tables, updates, rows, pos, k, v):
        return _step(planes, _publish(tables, updates), rows, pos, k, v)

    @jax.jit
    def _after(state, rows, pos, k, v):
        planes = append(state.planes[MAIN], state.tables[MAIN], rows, pos, k, v)
        return state.replace(planes={**state.planes, MAIN: planes})

    inside = jax.jit(_inside, donate_argnums=(0,))
    after = jax.jit(_after, donate_argnums=(0,))
    publish = jax.jit(_publish, donate_argnums=(0,))
    step = jax.jit(_step, donate_argnums=(0, 1))
    bare = jax.jit(_bare, donate_argnums=(0, 1))
    handles, rows, c = _lanes(store, lanes, rounds, rng)
    state = apply_work_jit(state, store.take_work())
    twin = jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), state)  # the "apply, then step" form's
    own = {}  # the separate and bare forms' own planes and tables
    for form in ("separate", "bare"):
        own[form] = ({n: jnp.array(x, copy=True) for n, x in state.planes[MAIN].items()},
                     jnp.array(state.tables[MAIN], copy=True))
    rows32 = rows.astype(np.int32)
    kv = jnp.asarray(rng.standard_normal((lanes, 1, h_, d_)), jnp.float32)
    # Whichever form runs first after the round's host work pays for cold caches (20-30 us here),
    # so the forms take turns at each position and each figure is the mean of its positions' medians.
    forms = ("inside", "separate", "bare", "apply_then_step")
    times = {(f, p): [] for f in forms for p in range(len(forms))}
    for i in range(rounds):
        nxt = c + 1
        store.map(rows, nxt)
        state, work = take_step_work(store, state)
        pos = c.astype(np.int32)
        upd = work.pools[MAIN].tables
        order = forms[i % len(forms):] + forms[: i % len(forms)]
        for position, form in enumerate(order):
            t0 = time.perf_counter()
            if form == "inside":
                state = inside(state, work, rows32, pos, kv, kv)
                jax.block_until_ready(state.sync)
            elif form == "apply_then_step":
                twin = after(apply_work_jit(twin, work), rows32, pos, kv, kv)
                jax.block_until_ready(twin.sync)
            elif form == "separate":
                planes, tables = own[form]
                tables = publish(tables, upd)
                own[form] = planes, tables = step(planes, tables, rows32, pos, kv, kv)
                jax.block_until_ready(tables)
            else:
                planes, tables = own[form]
                own[form] = planes, tables = bare(planes, tables, upd, rows32, pos, kv, kv)
                jax.block_until_ready(tables)
            times[(form, position)].append(time.perf_counter() - t0)
        store.commit(rows, nxt)
        c = nxt
    for h in handles:
        store.finish(h)
    state = apply_work_jit(state, store.take_work())
    out = {}
    for form in forms:
        medians = [_median_us(times[(form, p)][5:]) for p in range(len(forms))]
        out[f"{form}_us"] = float(np.mean(medians))
        out[f"{form}_first_us"] = medians[0]
    return state, out


def fork_and_finish(store: KVStore, state, max_context: int, reps: int) -> dict:
    frontier = max_context - 1  # 511 full pages + a 63-column tail
    h = store.activate(frontier, 0)
    store.map(h, frontier)
    store.commit(h, frontier)
    ck = store.finish(h, retain=True)
    state = apply_work_jit(state, store.take_work())
    fork, retain, release, sync = [], [], [], []
    for _ in range(reps + 1):
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        f = store.activate(frontier, 1, source=ck)
        state = apply_work_jit(state, store.take_work())  # the COW copy on the device
        jax.block_until_ready(state)
        sync.append(time.perf_counter() - t0)
        store.finish(f)
        t0 = time.perf_counter()
        f = store.activate(frontier, 1, source=ck)
        t1 = time.perf_counter()
        store.map(f, frontier + 1)
        store.commit(f, frontier + 1)
        t2 = time.perf_counter()
        ck2 = store.finish(f, retain=True)
        t3 = time.perf_counter()
        store.release_checkpoint(ck2)
        g = store.activate(frontier, 1, source=ck)
        t4 = time.perf_counter()
        store.finish(g)
        t5 = time.perf_counter()
        state = apply_work_jit(state, store.take_work())
        fork.append(t1 - t0)
        retain.append(t3 - t2)
        release.append(t5 - t4)
    jax.block_until_ready(state)
    store.release_checkpoint(ck)
    store.require_synced(state)
    return state, {
        "fork_us": _median_us(fork[1:]),
        "fork_sync_us": _median_us(sync[1:]),
        "retain_us": _median_us(retain[1:]),
        "release_us": _median_us(release[1:]),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lanes", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3000)
    ap.add_argument("--max-context", type=int, default=32768)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    store = build_store(args.lanes, args.max_context, args.head_dim)
    state = allocate_state(store)
    state, _ = decode_rounds(store, state, args.lanes, 200, rng)  # warm-up (compiles the work buckets)
    state, r = decode_rounds(store, state, args.lanes, args.rounds, rng)
    back_to_back = trivial_dispatch_us()
    d = r["dispatch_us"]
    state, sc = step_comparison(store, state, args.lanes, min(args.rounds, 1000), rng)
    state, fk = fork_and_finish(store, state, args.max_context, args.reps)
    print(
        f"device: {jax.devices()[0].platform}; lanes C={args.lanes}, P={P}, rounds={args.rounds}, "
        f"mean pages materialized per round={r['crossings']:.2f} (lanes/64={args.lanes / 64:.2f})"
    )
    print(f"{'measure':<50}{'median us':>11}{'x dispatch':>12}")
    rows = [
        ("trivial jitted dispatch (in the decode loop)", d),
        ("trivial jitted dispatch (back-to-back)", back_to_back),
        ("decode round bookkeeping (map+commit)", r["book_us"]),
        ("  p90", r["book_p90_us"]),
        ("decode round take_step_work (host)", r["take_us"]),
        ("  of which the slip checks and the pending mark", r["checks_us"]),
        ("decode step, work applied inside (1 dispatch)", sc["inside_us"]),
        ("decode step + separate table publication (2)", sc["separate_us"]),
        ("decode step, scatter + step as one bare program", sc["bare_us"]),
        ("decode step after apply_work_jit (2 dispatches, same state)", sc["apply_then_step_us"]),
        ("  work inside, run first after the host work", sc["inside_first_us"]),
        ("  separate, run first after the host work", sc["separate_first_us"]),
        (f"activate: fork {args.max_context - 1}-token ckpt + COW (host)", fk["fork_us"]),
        ("activate: fork + COW, apply_work completed", fk["fork_sync_us"]),
        (f"finish + retain ({args.max_context}-token sequence)", fk["retain_us"]),
        ("fork + finish + release", fk["release_us"]),
    ]
    for name, us in rows:
        print(f"{name:<50}{us:>11.1f}{us / d:>12.2f}")
    print(f"decode step: separate publication / work inside = {sc['separate_us'] / sc['inside_us']:.2f}x")
    print(f"decode step: separate publication / bare one-program step = {sc['separate_us'] / sc['bare_us']:.2f}x")
    print(f"decode step: apply_work_jit then step / work inside = {sc['apply_then_step_us'] / sc['inside_us']:.2f}x")


if __name__ == "__main__":
    main()
