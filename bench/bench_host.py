"""Host replica transfer throughput: offload / restore of one checkpoint vs a plain numpy copy.

Default shape: a 32K-token checkpoint of a K8V4 Main pool with 16 layers, 2 KV heads, D = 256:
512 pages of ``PageBytes`` each (402 B per token-head -> 823,296 B per page, 421.5 MB in total).
For contiguous and for scattered physical page IDs, the script measures

* offload: Device planes -> Host extent (``offload_pages``),
* restore: Host extent -> Device planes (``restore_pages``),
* the reference: ``np.copyto`` of the same number of bytes between two host buffers,

all in the same run, and prints each transfer's throughput as a ratio to the numpy copy together
with the number of transfer runs (adjacent physical IDs coalesced) and chunks (copies issued) per
checkpoint, for each transfer path (``packed``: packing on the device, one transfer per chunk;
``host``: CPU planes read in place and packed by numpy).  Every round trip is checked byte for byte
before timing.

    PYTHONPATH=. python bench/bench_host.py            # default shape
    PYTHONPATH=. python bench/bench_host.py --tokens 8192 --repeat 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from ninfer_kv.schema.layout import PagedKVStorageLayout
from ninfer_kv.schema.geometry import ceil_div
from ninfer_kv.device import offload_pages, restore_pages
from ninfer_kv.device.host_staging import staging_of
from ninfer_kv.host import HostKVArena, HostKVPageLayout


def _timed(fn, repeat: int) -> float:
    """Median wall time of ``fn()`` over ``repeat`` runs (after one warm-up run)."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _random_planes(layout: PagedKVStorageLayout, num_pages: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in layout.plane_shapes(num_pages).items():
        dtype = layout.plane(name).dtype
        raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
        out[name] = jax.device_put(raw.view(dtype).reshape(shape))
    return out


def _pages(planes: dict, layout: PagedKVStorageLayout, ids) -> dict:
    axis = layout.order.page_axis
    return {n: np.take(np.asarray(p), ids, axis=axis).view(np.uint8) for n, p in planes.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="k8v4")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--order", default="page-major")
    ap.add_argument("--tokens", type=int, default=32768, help="checkpoint length in tokens")
    ap.add_argument("--pool-pages", type=int, default=0, help="physical pages of the pool (default 2x checkpoint)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument(
        "--paths", default="", help="comma-separated transfer paths (default: packed, plus host on a CPU backend)"
    )
    args = ap.parse_args(argv)

    layout = PagedKVStorageLayout(args.profile, args.layers, args.heads, args.head_dim, order=args.order)
    host = HostKVPageLayout(layout)
    n = ceil_div(args.tokens, layout.page_size)
    pool = args.pool_pages or 2 * n
    nbytes = host.extent_bytes(n)
    print(
        f"backend={jax.default_backend()} device={jax.devices()[0]} profile={layout.profile.value} "
        f"layers={args.layers} heads={args.heads} D={args.head_dim} order={layout.order.value}"
    )
    print(
        f"checkpoint: {args.tokens} tokens = {n} pages x {host.stride} B = {nbytes / 1e6:.1f} MB; "
        f"pool {pool} pages; repeat {args.repeat} (median)"
    )

    planes = _random_planes(layout, pool, seed=0)
    arena = HostKVArena(nbytes)
    extent = arena.allocate(nbytes, "main")
    print(f"arena: {arena.capacity / 1e6:.1f} MB, memory_kind={staging_of(arena).memory_kind}")

    src_host = np.random.default_rng(1).integers(0, 256, size=nbytes, dtype=np.uint8)
    dst_host = np.empty_like(src_host)
    t_numpy = _timed(lambda: np.copyto(dst_host, src_host), args.repeat)

    paths = [p for p in args.paths.split(",") if p] or (
        ["host", "packed"] if jax.default_backend() == "cpu" else ["packed"]
    )
    rng = np.random.default_rng(2)
    id_sets = {
        "contiguous": np.arange(n, dtype=np.int64),
        "scattered": rng.permutation(pool)[:n].astype(np.int64),
    }
    rows = []
    for path, (mode, ids) in [(p, m) for p in paths for m in id_sets.items()]:
        restore_ids = ids[::-1].copy() if mode == "scattered" else ids + (pool - n)
        want = _pages(planes, layout, ids)
        rep = offload_pages(planes, layout, ids, arena, extent, path=path)
        planes, rep_r = restore_pages(planes, layout, restore_ids, arena, extent, path=path)
        got = _pages(planes, layout, restore_ids)
        assert all(np.array_equal(got[k], want[k]) for k in want), f"{path}/{mode}: round trip is not byte-exact"
        del want, got

        t_off = _timed(lambda: offload_pages(planes, layout, ids, arena, extent, path=path), args.repeat)
        state = {"planes": planes}

        def restore():
            state["planes"], _ = restore_pages(state["planes"], layout, restore_ids, arena, extent, path=path)
            jax.block_until_ready(state["planes"])

        t_res = _timed(restore, args.repeat)
        planes = state["planes"]
        rows.append((path, mode, "offload D->H", rep.runs, rep.chunks, t_off))
        rows.append((path, mode, "restore H->D", rep_r.runs, rep_r.chunks, t_res))

    gbps = lambda t: nbytes / t / 1e9  # noqa: E731
    print()
    print(f"numpy copy of the same {nbytes / 1e6:.1f} MB: {t_numpy * 1e3:.1f} ms, {gbps(t_numpy):.2f} GB/s")
    print()
    print("| path | page IDs | direction | runs | chunks | time (ms) | GB/s | ratio to numpy copy |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for path, mode, direction, runs, chunks, t in rows:
        print(
            f"| {path} | {mode} | {direction} | {runs} | {chunks} | {t * 1e3:.1f} | {gbps(t):.2f} | "
            f"{t_numpy / t:.2f} |"
        )


if __name__ == "__main__":
    main()
