"""Host bookkeeping cost of the KV store, side by side with a trivial jitted dispatch.

Decode rounds over C = 256 lanes (P = 64, mixed context lengths, so ~1/64 of the lanes cross a page
boundary per round): the median host time of ``map_rows`` + ``commit_rows`` (the bookkeeping of one
round) and of ``publish`` (the batched, donated table publication, itself one dispatch), each as a
ratio to the dispatch time of a trivial jitted function measured in the same rounds (each round
also dispatches it; the back-to-back figure, which a CPU client serves faster, is shown too).
Also: an activation that forks a 32K-token checkpoint (shares 511 full pages, COW-copies a
63-column tail: host time, and time until the copy completed), finish + retain of a 32K-token
sequence, and fork + finish + release.

    PYTHONPATH=. python bench/bench_store.py [--rounds 3000] [--lanes 256]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from ninfer_kv.planning import ExplicitCapacity, ModelKVConfig, plan_kv_cache
from ninfer_kv.store import KVStore

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


def decode_rounds(store: KVStore, lanes: int, rounds: int, rng) -> dict:
    """Decode rounds; each round also dispatches a trivial jitted function, timed under the same
    conditions (a CPU client dispatches faster back-to-back than after host work)."""
    lengths = rng.integers(64, 4096 - rounds // 2, size=lanes)
    handles = [store.activate(int(n), rounds + 8) for n in lengths]
    rows = np.array([store.row(h) for h in handles], np.int64)
    store.map_rows(rows, lengths)
    store.commit_rows(rows, lengths)
    store.publish()
    trivial = jax.jit(lambda x: x + 1)
    x = trivial(jnp.zeros((8,), jnp.int32))
    c = lengths.astype(np.int64)
    book, pub, disp, crossings = [], [], [], []
    for _ in range(rounds):
        nxt = c + 1
        t0 = time.perf_counter()
        new_pages = store.map_rows(rows, nxt)
        store.commit_rows(rows, nxt)
        t1 = time.perf_counter()
        tables = store.publish()
        t2 = time.perf_counter()
        x = trivial(x)
        t3 = time.perf_counter()
        book.append(t1 - t0)
        pub.append(t2 - t1)
        disp.append(t3 - t2)
        crossings.append(new_pages)
        c = nxt
    jax.block_until_ready((tables, x))
    for h in handles:
        store.finish(h)
    return {
        "book_us": _median_us(book),
        "book_p90_us": float(np.percentile(book, 90) * 1e6),
        "publish_us": _median_us(pub),
        "dispatch_us": _median_us(disp),
        "crossings": float(np.mean(crossings)),
    }


def fork_and_finish(store: KVStore, max_context: int, reps: int) -> dict:
    frontier = max_context - 1  # 511 full pages + a 63-column tail
    h = store.activate(frontier, 0)
    store.ensure_mapped_to_tokens(h, frontier)
    store.commit(h, frontier)
    ck = store.finish(h, retain=True)
    store.publish()
    fork, retain, release, sync = [], [], [], []
    for _ in range(reps + 1):
        jax.block_until_ready(store.planes())
        t0 = time.perf_counter()
        f = store.activate(frontier, 1, source=ck)
        jax.block_until_ready(store.planes())
        sync.append(time.perf_counter() - t0)
        store.finish(f)
        t0 = time.perf_counter()
        f = store.activate(frontier, 1, source=ck)
        t1 = time.perf_counter()
        store.ensure_mapped_to_tokens(f, frontier + 1)
        store.commit(f, frontier + 1)
        t2 = time.perf_counter()
        ck2 = store.finish(f, retain=True)
        t3 = time.perf_counter()
        store.release_checkpoint(ck2)
        g = store.activate(frontier, 1, source=ck)
        t4 = time.perf_counter()
        store.finish(g)
        t5 = time.perf_counter()
        store.publish()
        fork.append(t1 - t0)
        retain.append(t3 - t2)
        release.append(t5 - t4)
    jax.block_until_ready(store.planes())
    store.release_checkpoint(ck)
    return {
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
    decode_rounds(store, args.lanes, 200, rng)  # warm-up (compiles publication buckets)
    r = decode_rounds(store, args.lanes, args.rounds, rng)
    back_to_back = trivial_dispatch_us()
    d = r["dispatch_us"]
    fk = fork_and_finish(store, args.max_context, args.reps)
    print(
        f"device: {jax.devices()[0].platform}; lanes C={args.lanes}, P={P}, rounds={args.rounds}, "
        f"mean pages materialized per round={r['crossings']:.2f} (lanes/64={args.lanes / 64:.2f})"
    )
    print(f"{'measure':<50}{'median us':>11}{'x dispatch':>12}")
    rows = [
        ("trivial jitted dispatch (in the decode loop)", d),
        ("trivial jitted dispatch (back-to-back)", back_to_back),
        ("decode round bookkeeping (map_rows+commit_rows)", r["book_us"]),
        ("  p90", r["book_p90_us"]),
        ("decode round table publication (1 dispatch)", r["publish_us"]),
        (f"activate: fork {args.max_context - 1}-token ckpt + COW (host)", fk["fork_us"]),
        (f"activate: fork + COW, copy completed", fk["fork_sync_us"]),
        (f"finish + retain ({args.max_context}-token sequence)", fk["retain_us"]),
        ("fork + finish + release", fk["release_us"]),
    ]
    for name, us in rows:
        print(f"{name:<50}{us:>11.1f}{us / d:>12.2f}")


if __name__ == "__main__":
    main()
