"""Host tier through the KV store: offload, drop and restore-through-activation of a retained checkpoint.

Default shape: a 32K-token checkpoint of a K8V4 Main pool with 16 layers, 2 KV heads, D = 256
(512 pages of 823,296 B = 421.5 MB).  For contiguous and for scattered physical page IDs, each
repetition runs the store verbs an engine under memory pressure runs::

    offload_checkpoint(store, ck, state)   # plan -> gather from the state -> complete: device -> both
    store.drop_device_replica(ck)         # both -> host: the Device pages go back to the pool
    h = store.activate(T, 64, source=ck)  # restore_host stage: the payload goes into the round work
    state = apply_work_jit(state, store.take_work())  # ... which writes it on the device, then Fork
    store.finish(h); store.release_host_replica(ck)   # back to the starting state

and times each verb (the activation until its copies completed) next to ``np.copyto`` of the same
bytes between two host buffers, timed in every repetition right before the verbs (the machine's
load varies); every figure is printed as a throughput ratio to that copy (median numpy time /
median verb time of the same case), with the transfer runs (adjacent physical IDs coalesced) of
the offload and of the restore.  "Scattered" interleaves the checkpoint with another
sequence page by page (every other physical ID) and keeps that sequence alive, so the restored
pages land on scattered IDs too.  The restored bytes are checked against the originals before
timing.

    PYTHONPATH=. python bench/bench_host_store.py              # default shape
    PYTHONPATH=. python bench/bench_host_store.py --tokens 8192 --repeat 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from ninfer_kv.schema.layout import PagedKVStorageLayout
from ninfer_kv.schema.geometry import PAGE_SIZE, ceil_div
from ninfer_kv.host import coalesce_runs
from ninfer_kv.planning import ExplicitCapacity, ModelKVConfig, plan_kv_cache
from ninfer_kv.device import apply_work_jit
from ninfer_kv.store import KVStore
from ninfer_kv.device import allocate_state, offload_checkpoint

BUDGET = 64  # output budget of the restoring activation


def _median(samples) -> float:
    return statistics.median(samples)


class _Device:
    """The caller's device state of one store, advanced by the store's round works."""

    def __init__(self, store: KVStore):
        self.store = store
        self.state = allocate_state(store)

    def sync(self):
        self.state = apply_work_jit(self.state, self.store.take_work())
        return self.state


def _build(args, pages: int) -> tuple[KVStore, _Device]:
    """A store whose Main pool holds ``pages`` pages, planes filled with random bytes."""
    model = ModelKVConfig(args.layers, args.heads, args.head_dim, args.profile)
    plan = plan_kv_cache(
        model,
        max_context=args.tokens + BUDGET,
        max_concurrency=3,
        policy=ExplicitCapacity(pages * PAGE_SIZE),
    )
    n = ceil_div(args.tokens, PAGE_SIZE)
    host_bytes = n * plan.pools[next(iter(plan.pools))].layout.page_bytes
    store = KVStore(plan, host_bytes=host_bytes)
    dev = _Device(store)
    rng = np.random.default_rng(0)
    planes = {}
    for name, x in dev.state.planes["main"].items():
        raw = rng.integers(0, 256, size=x.size * x.dtype.itemsize, dtype=np.uint8)
        planes[name] = jnp.asarray(raw.view(x.dtype).reshape(x.shape))
    dev.state = dev.state.replace_planes("main", planes)
    return store, dev


def _checkpoint(store: KVStore, tokens: int, scattered: bool):
    """A retained checkpoint of ``tokens`` tokens; scattered: its pages alternate with another
    sequence's (which stays active and is returned)."""
    a = store.activate(tokens, 0)
    other = None
    if scattered:
        other = store.activate(tokens, 0)
        for n in range(1, ceil_div(tokens, PAGE_SIZE) + 1):
            for h in (a, other):
                store.map(h, min(n * PAGE_SIZE, tokens))
    else:
        store.map(a, tokens)
    store.commit(a, tokens)
    return store.finish(a, retain=True), other


def _page_bytes(store: KVStore, dev: _Device, ids: np.ndarray) -> dict:
    axis = store.layout().order.page_axis
    return {n: np.take(np.asarray(x), ids, axis=axis).view(np.uint8) for n, x in dev.sync().planes["main"].items()}


def run_case(args, scattered: bool, numpy_copy) -> dict:
    n = ceil_div(args.tokens, PAGE_SIZE)
    # scattered: 2n pages for the two interleaved sequences + a few, so that after the drop only the
    # checkpoint's old (alternate) IDs are free and the restore lands on scattered IDs as well
    pages = 2 * n + 2 + 2 if scattered else 2 * n + 2
    store, dev = _build(args, pages)
    ck, _other = _checkpoint(store, args.tokens, scattered)
    original_ids = store.address_space(ck).physical_pages
    want = _page_bytes(store, dev, original_ids)

    times = {"numpy": [], "offload": [], "drop": [], "restore_activation": []}
    runs = {}
    for i in range(args.repeat + 1):  # the first repetition warms up (compilation) and checks bytes
        t_numpy = _timed(numpy_copy)
        t0 = time.perf_counter()
        report = offload_checkpoint(store, ck, dev.sync())
        t1 = time.perf_counter()
        store.drop_device_replica(ck)
        t2 = time.perf_counter()
        h = store.activate(args.tokens, BUDGET, source=ck)
        jax.block_until_ready(dev.sync())
        t3 = time.perf_counter()
        restored_ids = store.address_space(ck).physical_pages
        runs = {"offload": report.runs, "restore": int(coalesce_runs(restored_ids)[0].size)}
        if i == 0:
            got = _page_bytes(store, dev, restored_ids)
            assert all(np.array_equal(got[k], want[k]) for k in want), "restore is not byte-exact"
            del got
        else:
            times["numpy"].append(t_numpy)
            times["offload"].append(t1 - t0)
            times["drop"].append(t2 - t1)
            times["restore_activation"].append(t3 - t2)
        store.finish(h)
        store.release_host_replica(ck)
        store.audit_invariants()
    return {
        "pages": n,
        "bytes": n * store.layout().page_bytes,
        "runs": runs,
        "path": report.pools["main"].path,
        "times": {k: _median(v) for k, v in times.items()},
        "stats": store.stats.to_json(),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="k8v4")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32768, help="checkpoint length in tokens")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)

    print(
        f"backend={jax.default_backend()} device={jax.devices()[0]} profile={args.profile} layers={args.layers} "
        f"heads={args.heads} D={args.head_dim} tokens={args.tokens} repeat={args.repeat} (median)"
    )
    n = ceil_div(args.tokens, PAGE_SIZE)
    nbytes = n * PagedKVStorageLayout(args.profile, args.layers, args.heads, args.head_dim).page_bytes
    src = np.random.default_rng(1).integers(0, 256, size=nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    results = {
        mode: run_case(args, mode == "scattered", lambda: np.copyto(dst, src)) for mode in ("contiguous", "scattered")
    }
    del src, dst

    gbps = lambda t: nbytes / t / 1e9  # noqa: E731
    print(f"checkpoint: {n} pages, {nbytes / 1e6:.1f} MB; transfer path {results['contiguous']['path']}")
    print()
    print("| page IDs | verb | transfer runs | time (ms) | GB/s | ratio to numpy copy |")
    print("|---|---|---:|---:|---:|---:|")
    for mode, r in results.items():
        t_numpy = r["times"]["numpy"]
        print(f"| {mode} | numpy copy of the same bytes | - | {t_numpy * 1e3:.1f} | {gbps(t_numpy):.2f} | 1.00 |")
        for verb, label, runs in (
            ("offload", "offload_checkpoint (D->H)", r["runs"]["offload"]),
            ("drop", "drop_device_replica", "-"),
            ("restore_activation", "activate from Host-only (H->D + Fork)", r["runs"]["restore"]),
        ):
            t = r["times"][verb]
            rate, ratio = (f"{gbps(t):.2f}", f"{t_numpy / t:.2f}") if verb != "drop" else ("-", "-")
            print(f"| {mode} | {label} | {runs} | {t * 1e3:.1f} | {rate} | {ratio} |")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
