"""CPU FFI kernels: decode attention bandwidth and append throughput, side by side with XLA.

Decode attention (one layer, B rows of one context length, pages in random physical order):

* achieved bandwidth = bytes of K/V data and scales the visible keys occupy (plus q and out) /
  median time per call, reported as a fraction of two memory bandwidths measured in the same run:
* copy bandwidth = a large numpy copy (src -> dst, 2 x the size of L3-busting buffers), counted
  as bytes read + bytes written = 2 x the buffer size per copy (write-allocate traffic not
  counted), run on every FFI thread at once (each thread copies its own slice) and on one
  thread, at the start and again right before each profile's timing; the largest figure of the
  run is the denominator of "of copy BW" (on a machine shared with other work a copy timed in a busy
  moment would otherwise inflate every fraction);
* read bandwidth = the same buffer read once (summed) by the FFI library's own threads with their
  widest loads, one contiguous slice each, and by one thread; the larger figure is the denominator
  of "of read BW" and the roofline's memory term (decode attention only reads, so this is the
  ceiling it could reach);
* whether the planes can sit on transparent huge pages (numpy's baseline buffers do; XLA's only
  with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` when THP is in ``madvise`` mode);
* the instruction-set level in use (``NINFER_KV_FFI_ISA`` forces one, e.g. ``avx2`` on an
  AVX-512 machine) is printed in the header;
* the roofline (``bench/ffi_peaks.py``): the arithmetic the kernel uses for each profile
  (``ninfer_kv.ops.ffi.handlers.arithmetic``: ``float32`` FMAs, or ``int8x2`` byte products), its multiply-add
  peak measured in this run by ``bench/ffi_compute.cc`` built for the level in use (on every FFI
  thread at once, each timing its own CPU time), the compute ceiling (the K/V bytes per second
  those peaks allow: ``cores * bytes per key-head / (G * D / peak_scores + G * D / peak_values)``),
  the roofline ``min(read bandwidth, ceiling)``, the fractions of it and of the ceiling the kernel
  reaches (the
  peak is the larger of the all-threads sum and threads x the one-thread figure, so that a peak
  timed while other work shared a core cannot lower the ceiling);
* speed-up over the jnp reference (``ninfer_kv.ops.reference``, jitted, XLA CPU) on the same data;
* the FFI series is timed before and after the reference, and the faster median is reported;
* "cores used": CPU seconds the process consumed per wall second during the FFI calls (2.0 = both
  cores of a 2-core machine); below the thread count means other work on the machine took CPU.
  "GB per CPU-second" = achieved GB/s / cores used: the kernel's throughput per core it actually got.

Append throughput: tokens per second of a jitted, donated (in place) ``paged_append`` of
``B x T`` tokens per call, per profile, next to the jitted reference append.

Usage::

    PYTHONPATH=. python bench/bench_ffi.py                 # the full table (needs ~4 GiB free)
    PYTHONPATH=. python bench/bench_ffi.py --contexts 4096 --profiles bf16 --quick
    NINFER_KV_FFI_ISA=avx2 PYTHONPATH=. python bench/bench_ffi.py --contexts 32768   # the AVX2 level

Needs ``tabulate`` (``pip install .[bench]``) and, for the roofline columns, a C++ compiler (levels
that ``bench/ffi_compute.cc`` cannot measure print "-" there).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import threading
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from tabulate import tabulate  # noqa: E402

import ffi_peaks  # noqa: E402  (bench/ is the script's directory)
from machine import read_bandwidth  # noqa: E402

from ninfer_kv.ops.ffi import kv as ffi_kv  # noqa: E402
from ninfer_kv.ops.ffi import handlers as ffi_handlers  # noqa: E402
from ninfer_kv.schema.layout import PagedKVStorageLayout  # noqa: E402
from ninfer_kv.ops import reference  # noqa: E402
from ninfer_kv.ops.views import PagedKVBatchLayerView  # noqa: E402
from ninfer_kv.ops.views import allocate_planes

PAGE = 64


# -- memory bandwidth ------------------------------------------------------------------------------


def memory_bandwidth(nbytes: int, repeats: int, threads: int) -> float:
    """Best bytes/s of copying nbytes (read + write counted) split over `threads` threads."""
    src = np.ones(nbytes // 8, np.float64)
    dst = np.zeros_like(src)
    chunks = np.array_split(np.arange(src.size), threads)
    bounds = [(int(c[0]), int(c[-1]) + 1) for c in chunks if c.size]

    def copy(lo, hi):
        np.copyto(dst[lo:hi], src[lo:hi])

    best = float("inf")
    for _ in range(repeats):
        ts = [threading.Thread(target=copy, args=b) for b in bounds]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


def _anon_huge_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))


def huge_page_note() -> str:
    """Whether XLA's buffers (the planes) land on transparent huge pages in this process.

    With THP in ``madvise`` mode, numpy asks for huge pages for its large arrays (the bandwidth
    baselines above) but XLA's CPU allocator does not, so the planes use 4 KiB pages and every page
    of a run costs a TLB walk, unless glibc is told to ask (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``).
    Checked by allocating a 64 MiB XLA buffer and reading the process's huge-page total.
    """
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read().split("[")[1].split("]")[0]
        before = _anon_huge_kib()
        probe = jax.block_until_ready(jnp.ones((16 << 20,), jnp.float32))
        on_huge = _anon_huge_kib() - before >= 32 << 10
        del probe
    except (OSError, IndexError, ValueError):
        return "transparent huge pages: unknown on this system"
    tunables = os.environ.get("GLIBC_TUNABLES", "") or "(unset)"
    return (f"transparent huge pages: {mode}; GLIBC_TUNABLES={tunables}; "
            f"XLA buffers (the planes) on huge pages: {'yes' if on_huge else 'no'}")


# -- pool contents ---------------------------------------------------------------------------------


def random_planes(layout: PagedKVStorageLayout, num_pages: int, rng) -> dict:
    """Planes filled with valid random codes and scales (a random block tiled over the pool)."""
    planes = {}
    for spec in layout.planes:
        shape = layout.plane_shape(spec.name, num_pages)
        total = int(np.prod(shape))
        block = min(total, 1 << 22)
        if spec.dtype == np.dtype(ml_dtypes.bfloat16):
            base = rng.uniform(0.5, 1.0, block) if spec.role == "scale" else rng.standard_normal(block)
            vals = base.astype(ml_dtypes.bfloat16)
        elif spec.dtype == np.dtype(ml_dtypes.float8_e4m3fn):
            vals = rng.uniform(-400, 400, block).astype(ml_dtypes.float8_e4m3fn)
        elif spec.dtype == np.dtype(np.int8):
            vals = rng.integers(-127, 128, block).astype(np.int8)
        elif spec.role == "scale":  # nvfp4 scale: e4m3 bits of values in [2^-3, 2]
            vals = rng.integers(0x20, 0x40, block).astype(np.uint8)
        else:  # packed e2m1 nibbles: every byte is valid
            vals = rng.integers(0, 256, block).astype(np.uint8)
        planes[spec.name] = jnp.asarray(np.resize(vals, total).reshape(shape))
    return planes


def bytes_read(layout: PagedKVStorageLayout, batch: int, context: int, q_heads: int) -> int:
    kv = batch * context * layout.num_kv_heads * layout.profile.token_head_bytes(layout.head_dim)
    q_and_out = 2 * batch * q_heads * layout.head_dim * 4
    return kv + q_and_out


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return r.ru_utime + r.ru_stime


def timed(fn, args, repeats: int) -> tuple[float, float]:
    """(median seconds per call, CPU seconds this process used per wall second over the calls)."""
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    c0, w0 = _cpu_seconds(), time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), (_cpu_seconds() - c0) / (time.perf_counter() - w0)


# -- decode attention ------------------------------------------------------------------------------


def bench_attention(profile: str, context: int, args, rng, bandwidth: float, read_bw: float) -> dict:
    b, h, g, d = args.batch, args.kv_heads, args.gqa, args.head_dim
    lay = PagedKVStorageLayout(profile, 1, h, d, "page-major")
    pages_per_row = context // PAGE
    n = b * pages_per_row
    planes = random_planes(lay, n, rng)
    table = jnp.asarray(rng.permutation(n).astype(np.int32).reshape(b, pages_per_row))
    q = jnp.asarray(rng.standard_normal((b, 1, h * g, d)).astype(np.float32))
    rows = jnp.asarray(rng.permutation(b).astype(np.int32))
    pos = jnp.full((b,), context - 1, jnp.int32)
    lens = jnp.full((b,), context, jnp.int32)

    def make(fn):
        def step(q, planes, table, rows, pos, lens):
            view = PagedKVBatchLayerView(planes, table, 0, lay, validate=False)
            return fn(q, view, rows, pos, lens)

        return jax.jit(step)

    call_args = (q, planes, table, rows, pos, lens)
    ffi_step = make(ffi_kv.paged_attention)
    t_ffi, cores = timed(ffi_step, call_args, args.repeats)
    t_ref = None
    if not args.skip_reference:
        t_ref, _ = timed(make(reference.paged_attention_reference), call_args, max(1, args.repeats // 4))
        # XLA's worker threads stay busy for a moment after the reference; the FFI series is
        # timed once more afterwards and the faster of its two medians is reported.
        time.sleep(0.5)
        t_again, cores_again = timed(ffi_step, call_args, args.repeats)
        if t_again < t_ffi:
            t_ffi, cores = t_again, cores_again
    moved = bytes_read(lay, b, context, h * g)
    return {
        "profile": profile,
        "context": context,
        "ms": t_ffi * 1e3,
        "gbps": moved / t_ffi / 1e9,
        "frac": moved / t_ffi / bandwidth,
        "read_frac": moved / t_ffi / read_bw,
        "cores": cores,
        "ref_ms": None if t_ref is None else t_ref * 1e3,
        "speedup": None if t_ref is None else t_ref / t_ffi,
    }


# -- append ----------------------------------------------------------------------------------------


def bench_append(profile: str, args, rng) -> dict:
    b, t, h, d = args.batch, args.append_tokens, args.kv_heads, args.head_dim
    lay = PagedKVStorageLayout(profile, 1, h, d, "page-major")
    pages_per_row = -(-t // PAGE)
    n = b * pages_per_row
    table = jnp.asarray(rng.permutation(n).astype(np.int32).reshape(b, pages_per_row))
    k = jnp.asarray(rng.standard_normal((b, t, h, d)).astype(np.float32))
    v = jnp.asarray(rng.standard_normal((b, t, h, d)).astype(np.float32))
    rows = jnp.arange(b, dtype=jnp.int32)
    pos = jnp.zeros((b,), jnp.int32)
    valid = jnp.full((b,), t, jnp.int32)

    def make(fn):
        def step(planes, table, rows, pos, k, v, valid):
            view = PagedKVBatchLayerView(planes, table, 0, lay, validate=False)
            return fn(view, rows, pos, k, v, valid).planes

        return jax.jit(step, donate_argnums=0)

    out = {"profile": profile, "tokens": b * t}
    for name, fn in (("ffi", ffi_kv.paged_append), ("ref", reference.paged_append_reference)):
        if name == "ref" and args.skip_reference:
            out["ref_tps"] = None
            continue
        step = make(fn)
        planes = allocate_planes(lay, n)
        planes = jax.block_until_ready(step(planes, table, rows, pos, k, v, valid))
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            planes = jax.block_until_ready(step(planes, table, rows, pos, k, v, valid))
            times.append(time.perf_counter() - t0)
        out[f"{name}_tps"] = b * t / statistics.median(times)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--profiles", nargs="+", default=["bf16", "int8-g64", "fp8-e4m3fn-row256", "nvfp4-g16", "k8v4"])
    p.add_argument("--append-profiles", nargs="*", default=["bf16", "int8-g64", "fp8-e4m3fn-row256", "nvfp4-g16", "k8v4"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--gqa", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--append-tokens", type=int, default=512, help="tokens per row per append call")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--copy-mib", type=int, default=2048, help="size of the bandwidth copy buffer")
    p.add_argument("--skip-reference", action="store_true")
    p.add_argument("--quick", action="store_true", help="fewer repeats and a smaller copy buffer")
    args = p.parse_args()
    if args.quick:
        args.repeats, args.copy_mib = 3, 512
    if not ffi_handlers.is_available():
        raise SystemExit(f"FFI library unavailable: {ffi_handlers.load_error()}")
    rng = np.random.default_rng(0)
    threads = ffi_handlers.num_threads()
    bw_all = memory_bandwidth(args.copy_mib << 20, 5, threads)
    bw_one = memory_bandwidth(args.copy_mib << 20, 5, 1)
    bandwidth = max(bw_all, bw_one)
    rd_all = read_bandwidth(args.copy_mib << 20, 5, threads)
    rd_one = read_bandwidth(args.copy_mib << 20, 5, 1)
    read_bw = max(rd_all, rd_one)
    print(f"jax {jax.__version__}, {os.cpu_count()} CPUs, FFI threads {threads}, library {ffi_handlers.library_path()}")
    print(ffi_handlers.info().summary())
    print(f"load average before the run: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(huge_page_note())
    print(
        f"copy bandwidth (numpy copy of {args.copy_mib} MiB, read + write): {bw_all / 1e9:.1f} GB/s on "
        f"{threads} threads, {bw_one / 1e9:.1f} GB/s on 1 thread; denominator {bandwidth / 1e9:.1f} GB/s"
    )
    print(
        f"read bandwidth (one pass over {args.copy_mib} MiB): {rd_all / 1e9:.1f} GB/s on {threads} threads, "
        f"{rd_one / 1e9:.1f} GB/s on 1 thread; denominator {read_bw / 1e9:.1f} GB/s"
    )
    info = ffi_handlers.info()
    peaks = None
    if ffi_peaks.measurable(info.isa):
        peaks = ffi_peaks.measure_peaks(info.isa, threads, tuple(sorted(set(ffi_peaks.ARITHMETIC_PEAK.values()) &
                                                                        set(ffi_peaks.PEAK_KINDS[info.isa]))))
        print(f"multiply-add peaks of level {info.isa} (bench/ffi_compute.cc, this run), G per second: " + ", ".join(
            f"{k} {peaks.one[k] / 1e9:.1f} on 1 thread, {peaks.all[k] / 1e9:.1f} on {threads}" for k in peaks.one))
    else:
        print(f"multiply-add peaks: bench/ffi_compute.cc cannot measure level {info.isa} here (no roofline columns)")
    print()
    print(
        f"decode attention: B={args.batch}, H={args.kv_heads}, GQA {args.gqa}, D={args.head_dim}, T=1, "
        f"one layer, pages in random physical order"
    )
    measured = []
    for ctx in args.contexts:
        for prof in args.profiles:
            # the copy once more, right before the timing: the run's best copy is the denominator
            bandwidth = max(bandwidth, memory_bandwidth(args.copy_mib << 20, 3, threads))
            r = bench_attention(prof, ctx, args, rng, bandwidth, read_bw)
            measured.append((prof, ctx, r))
            print(f"  {prof} {ctx}: {r['ms']:.2f} ms, {r['gbps']:.1f} GB/s, {r['cores']:.2f} cores used", flush=True)
    print(f"copy bandwidth, best of the run (the denominator below): {bandwidth / 1e9:.1f} GB/s")
    def peak(arithmetic: str) -> float:
        kind = ffi_peaks.ARITHMETIC_PEAK[arithmetic]
        return max(peaks.all[kind], peaks.threads * peaks.one[kind])

    table = []
    for prof, ctx, r in measured:
        ar = ffi_handlers.arithmetic(prof, args.head_dim)
        gbps = r["gbps"] * 1e9
        if peaks is not None and ar.scores in ffi_peaks.ARITHMETIC_PEAK and ar.values in ffi_peaks.ARITHMETIC_PEAK:
            sp, vp = peak(ar.scores), peak(ar.values)
            ceil = ffi_peaks.ceiling(prof, args.head_dim, args.gqa, sp, vp)
            roof = min(read_bw, ceil)
            peak_txt = f"{sp / 1e9:.0f} / {vp / 1e9:.0f}"
            ceil_txt, roof_txt, frac_roof = f"{ceil / 1e9:.1f}", f"{roof / 1e9:.1f}", f"{100 * gbps / roof:.0f}%"
            frac_ceil = f"{100 * gbps / ceil:.0f}%"
        else:
            peak_txt = ceil_txt = roof_txt = frac_roof = frac_ceil = "-"
        table.append([
            prof, ctx, f"{r['ms']:.2f}", f"{r['gbps']:.1f}", f"{ar.scores} / {ar.values}", peak_txt, ceil_txt,
            f"{bandwidth / 1e9:.1f}", f"{read_bw / 1e9:.1f}", roof_txt, frac_roof, frac_ceil,
            f"{100 * gbps / bandwidth:.0f}%", f"{100 * r['read_frac']:.0f}%", f"{r['cores']:.2f}", "-" if r["ref_ms"] is None else f"{r['ref_ms']:.2f}",
            "-" if r["speedup"] is None else f"{r['speedup']:.1f}x",
        ])
    print()
    print(tabulate(table, headers=[
        "profile", "context", "FFI ms", "FFI GB/s", "arithmetic (scores / values)", "peak G MAC/s (scores / values)",
        "compute ceiling GB/s", "copy BW GB/s", "read BW GB/s", "roofline GB/s", "of roofline",
        "of compute ceiling", "of copy BW", "of read BW",
        "cores used", "jnp ref ms", "speed-up"], tablefmt="github"))
    if not args.append_profiles:
        return
    print()
    print(
        f"append (jitted, planes donated): B={args.batch} rows x T={args.append_tokens} tokens per call, "
        f"H={args.kv_heads}, D={args.head_dim}, float32 input"
    )
    rows = []
    for prof in args.append_profiles:
        r = bench_append(prof, args, rng)
        ref = "-" if r["ref_tps"] is None else f"{r['ref_tps']:.3g}"
        spd = "-" if r["ref_tps"] is None else f"{r['ffi_tps'] / r['ref_tps']:.1f}x"
        rows.append([prof, f"{r['ffi_tps']:.3g}", ref, spd])
    print(tabulate(rows, headers=["profile", "FFI tokens/s", "jnp ref tokens/s", "speed-up"], tablefmt="github"))


if __name__ == "__main__":
    main()
