"""GPU check of the Pallas kernels: correctness against the reference, then decode and append speed.

On a CUDA device (one run of a few minutes; results are printed as they come, as markdown):

1. Correctness, small shapes, every profile and both plane orders: paged append (planes compared
   byte for byte with the reference append; the design allows a GPU one code step at rounding
   boundaries, so the share of identical bytes is printed and must be >= 99.9%), decode attention
   with a context split, chunk attention, cyclic append and attention, each against the float32
   reference (bfloat16 queries: atol = rtol = 2e-2).
2. Memory bandwidth of the device: a large jnp elementwise copy (``x + 1``), bytes read + written.
3. Decode attention, B = 64 rows, H = 8 KV heads, Hq = 32, D = 128, contexts 8K and 32K, pages in
   a random physical order, BF16 and K8V4, both orders: median time, bytes of K/V planes read
   (codes and scales of every visible key), achieved GB/s and its share of the copy bandwidth,
   side by side with the JAX peer kernel (``jax.experimental.pallas.ops.gpu.paged_attention``,
   BF16, head-major pages, default tuning) on the same data; plus a few tuning variants.
4. Append: decode (B = 64, T = 1) and chunk (B = 8, T = 256) appends, donated and in place.

``--cpu-smoke`` runs section 1 only, with tiny shapes, in Pallas interpret mode on the CPU.

Usage::

    PYTHONPATH=. python bench/gpu_check.py                    # CUDA device
    PYTHONPATH=. python bench/gpu_check.py --cpu-smoke        # CPU, interpret mode, correctness only
    PYTHONPATH=. python bench/gpu_check.py --cpu-smoke --profiles k8v4 --orders head-major
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
import traceback

if "--cpu-smoke" in sys.argv:
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from ninfer_kv.layout import PagedKVStorageLayout  # noqa: E402
from ninfer_kv.ops.reference import (  # noqa: E402
    cyclic_append_reference,
    cyclic_attention_reference,
    paged_append_reference,
    paged_attention_reference,
)
from ninfer_kv.profiles import KVProfile  # noqa: E402
from ninfer_kv.views import CyclicKVCacheLayerView, CyclicKVLayout, PagedKVBatchLayerView  # noqa: E402

PAGE = 64
PROFILES = [p.value for p in KVProfile]
ORDERS = ["page-major", "head-major"]
ATTN_TOL = 2e-2
APPEND_MIN_IDENTICAL = 0.999


def log(line: str = "") -> None:
    print(line, flush=True)


def short_error(exc: BaseException) -> str:
    """One table-safe line describing an exception."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"ERROR {type(exc).__name__}: {first[:150]}".replace("|", "/")


class Deadline:
    def __init__(self, seconds: float):
        self.start = time.perf_counter()
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)


# -- pools -----------------------------------------------------------------------------------------


def _random_bits(key, shape, dtype):
    """Finite random values of any plane dtype, made from integer bits (no float32 temporaries)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bfloat16:  # sign | exponent in [120, 127] | mantissa: |x| in [2^-7, 2)
        r = jax.random.bits(key, shape, jnp.uint16)
        bits = (r & jnp.uint16(0x807F)) | ((jnp.uint16(120) + ((r >> 7) & jnp.uint16(7))) << 7)
        return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)
    r = jax.random.bits(key, shape, jnp.uint8)
    if dtype == jnp.float8_e4m3fn:  # clear the top exponent bit: never NaN
        return jax.lax.bitcast_convert_type(r & jnp.uint8(0xBF), jnp.float8_e4m3fn)
    return jax.lax.bitcast_convert_type(r, dtype)


def random_planes(layout: PagedKVStorageLayout, num_pages: int, seed: int) -> dict:
    """Finite random planes: at most 256 random pages, repeated along the page axis (cheap to make)."""
    axis = layout.order.page_axis
    base_pages = min(num_pages, 256)
    out = {}
    for i, (name, shape) in enumerate(layout.plane_shapes(num_pages).items()):
        dtype = layout.plane_dtypes()[name]
        base_shape = shape[:axis] + (base_pages,) + shape[axis + 1:]
        reps = -(-num_pages // base_pages)

        @jax.jit
        def make(key, base_shape=base_shape, dtype=dtype, reps=reps, shape=shape, name=name):
            base = _random_bits(key, base_shape, dtype)
            if name.endswith("_scale") and jnp.dtype(dtype) == jnp.uint8:  # NVFP4 scales: moderate e4m3
                base = (base & jnp.uint8(0x0F)) | jnp.uint8(0x30)
            full = jnp.concatenate([base] * reps, axis=axis) if reps > 1 else base
            return jax.lax.slice_in_dim(full, 0, shape[axis], axis=axis)

        out[name] = make(jax.random.key(seed * 16 + i))
    return out


def shuffled_tables(rs, bsz: int, blocks: int, spare_rows: int = 2):
    """Block tables (B + spare, blocks) over a random permutation of B * blocks pages, rows shuffled."""
    n_pages = bsz * blocks
    phys = rs.permutation(n_pages).astype(np.int32)
    table = np.zeros((bsz + spare_rows, blocks), np.int32)
    rows = rs.permutation(bsz + spare_rows)[:bsz].astype(np.int32)
    for b in range(bsz):
        table[rows[b]] = phys[b * blocks : (b + 1) * blocks]
    return jnp.asarray(table), jnp.asarray(rows), n_pages


def small_pool(profile, order, *, head_dim, kv_heads, kv_lens, seed):
    """A small pool holding kv_lens[b] reference-encoded tokens per row (one layer of two is used)."""
    rs = np.random.RandomState(seed)
    bsz = len(kv_lens)
    blocks = -(-max(kv_lens) // PAGE) + 2
    table, rows, n_pages = shuffled_tables(rs, bsz, blocks)
    lay = PagedKVStorageLayout(profile, 2, kv_heads, head_dim, order)
    view = PagedKVBatchLayerView(lay.allocate(n_pages + 2, fill=float("nan")), table, 1, lay)
    t = max(kv_lens)
    k = jax.random.normal(jax.random.key(seed + 1), (bsz, t, kv_heads, head_dim), jnp.float32)
    v = jax.random.normal(jax.random.key(seed + 2), (bsz, t, kv_heads, head_dim), jnp.float32)
    zeros = jnp.zeros((bsz,), jnp.int32)
    view = jax.jit(paged_append_reference)(view, rows, zeros, k, v, jnp.asarray(kv_lens, jnp.int32))
    return view, rows


# -- section 1: correctness ------------------------------------------------------------------------


def _identical_share(got: dict, want: dict) -> float:
    same = total = 0
    for name in want:
        g = np.asarray(got[name]).view(np.uint8)
        w = np.asarray(want[name]).view(np.uint8)
        same += int((g == w).sum())
        total += g.size
    return same / total


def _max_err(got, want) -> float:
    g = np.asarray(jnp.asarray(got, jnp.float32))
    w = np.asarray(jnp.asarray(want, jnp.float32))
    if not np.isfinite(g).all():
        return float("inf")
    return float(np.max(np.abs(g - w) / (1.0 + np.abs(w))))


def correctness(profiles, orders, *, smoke: bool) -> int:
    """Print one markdown row per check; return the number of failures."""
    d, h, g = (64, 2, 4) if smoke else (128, 2, 4)
    kv_lens = [70, 0, 130] if smoke else [100, 0, 200, 64]
    chunk = 16 if smoke else 64
    exact_append = smoke  # on a CPU every path must produce the same bytes
    failures = 0
    log("| check | profile | order | metric | value | result |")
    log("|---|---|---|---|---|---|")

    def row(check, profile, order, metric, value, ok):
        nonlocal failures
        failures += 0 if ok else 1
        log(f"| {check} | {profile} | {order} | {metric} | {value} | {'PASS' if ok else 'FAIL'} |")

    append = jax.jit(pk.paged_append)
    append_ref = jax.jit(paged_append_reference)
    attn = jax.jit(pk.paged_attention, static_argnames=("config",))
    attn_ref = jax.jit(paged_attention_reference)
    bsz = len(kv_lens)
    lens = jnp.asarray(kv_lens, jnp.int32)
    for i, profile in enumerate(profiles):
        for order in orders:
            try:
                view, rows = small_pool(profile, order, head_dim=d, kv_heads=h, kv_lens=kv_lens, seed=i)
                k = jax.random.normal(jax.random.key(10 + i), (bsz, 5, h, d), jnp.bfloat16)
                v = jax.random.normal(jax.random.key(20 + i), (bsz, 5, h, d), jnp.bfloat16)
                valid = jnp.asarray([5, 0] + [3] * (bsz - 2), jnp.int32)
                args = (view, rows, lens, k, v, valid)
                share = _identical_share(append(*args).planes, append_ref(*args).planes)
                need = 1.0 if exact_append else APPEND_MIN_IDENTICAL
                row("paged append", profile, order, "identical bytes", f"{share:.6f}", share >= need)

                for name, t, cfg in (
                    ("decode (2 splits)", 1, pk.PagedAttentionConfig(k_splits=2)),
                    (f"chunk T={chunk}", chunk, pk.PagedAttentionConfig()),
                ):
                    q = jax.random.normal(jax.random.key(30 + i + t), (bsz, t, h * g, d), jnp.bfloat16)
                    pos = jnp.maximum(lens - t, 0)
                    err = _max_err(attn(q, view, rows, pos, lens, config=cfg), attn_ref(q, view, rows, pos, lens))
                    row(name, profile, order, "max abs err / (1 + abs ref)", f"{err:.2e}", err <= ATTN_TOL)
            except Exception as exc:  # keep going: report and count
                row("paged", profile, order, "exception", short_error(exc), False)
                traceback.print_exc(file=sys.stdout)
        try:
            _cyclic_check(profile, d, h, g, i, row)
        except Exception as exc:
            row("cyclic", profile, "-", "exception", short_error(exc), False)
            traceback.print_exc(file=sys.stdout)
    return failures


def _cyclic_check(profile, d, h, g, seed, row) -> None:
    lay = CyclicKVLayout(profile, 2, 4, h, d, window=32, slots=40)
    view = CyclicKVCacheLayerView(lay.allocate(fill=float("nan")), 1, lay)
    rows = jnp.array([3, 0, 1], jnp.int32)
    k = jax.random.normal(jax.random.key(40 + seed), (3, 50, h, d), jnp.float32)
    v = jax.random.normal(jax.random.key(50 + seed), (3, 50, h, d), jnp.float32)
    zeros = jnp.zeros((3,), jnp.int32)
    lens = jnp.array([50, 0, 37], jnp.int32)
    got = jax.jit(pk.cyclic_append)(view, rows, zeros, k, v, lens)
    want = jax.jit(cyclic_append_reference)(view, rows, zeros, k, v, lens)
    share = _identical_share(got.planes, want.planes)
    row("cyclic append", profile, "-", "identical bytes", f"{share:.6f}", share >= APPEND_MIN_IDENTICAL)
    q = jax.random.normal(jax.random.key(60 + seed), (3, 4, h * g, d), jnp.bfloat16)
    pos = jnp.maximum(lens - 4, 0)
    err = _max_err(
        jax.jit(pk.cyclic_attention)(q, want, rows, pos, lens),
        jax.jit(cyclic_attention_reference)(q, want, rows, pos, lens),
    )
    row("cyclic attention T=4", profile, "-", "max abs err / (1 + abs ref)", f"{err:.2e}", err <= ATTN_TOL)


# -- sections 2-4: timing --------------------------------------------------------------------------


def timed(fn, *args, iters: int = 20, warmup: int = 2) -> float:
    """Median seconds per call (each call waited for)."""
    out = None
    for _ in range(warmup):
        out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclasses.dataclass(frozen=True)
class TimingShapes:
    """Problem sizes of the timing sections (the GPU run, or a tiny CPU rehearsal of the code)."""

    copy_elems: int = 1 << 30  # float32 elements of the bandwidth probe (4 GiB)
    batch: int = 64
    kv_heads: int = 8
    q_heads: int = 32
    head_dim: int = 128
    contexts: tuple = (8192, 32768)
    sweep_context: int = 32768
    append_shapes: tuple = ((64, 1), (8, 256))
    append_context: int = 8192
    iters: int = 20


REHEARSAL = TimingShapes(
    copy_elems=1 << 16, batch=2, kv_heads=2, q_heads=8, head_dim=64, contexts=(128, 256), sweep_context=256,
    append_shapes=((2, 1), (1, 16)), append_context=128, iters=2,
)


def copy_bandwidth(shapes: TimingShapes) -> float:
    """Bytes/s of a large elementwise copy (read + write counted)."""
    x = jnp.ones((shapes.copy_elems,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    t = timed(f, x, iters=10)
    del x
    return 2 * shapes.copy_elems * 4 / t


def decode_timing(copy_bw: float, deadline: Deadline, shapes: TimingShapes) -> None:
    bsz, h, hq, d = shapes.batch, shapes.kv_heads, shapes.q_heads, shapes.head_dim
    log("")
    log(f"Decode attention: B={bsz}, H={h}, Hq={hq}, D={d}, one query per row, pages in random physical order.")
    log(f"Copy bandwidth (x + 1 over {shapes.copy_elems * 4 / 2**30:.3g} GiB, read + write): {copy_bw / 1e9:.0f} GB/s")
    log("")
    log("| kernel | profile | order | context | config | time (us) | K/V bytes read (GB) | GB/s | % of copy BW |")
    log("|---|---|---|---|---|---|---|---|---|")
    try:
        from jax.experimental.pallas.ops.gpu import paged_attention as peer
    except Exception as exc:  # the Triton peer may be gone in newer JAX
        peer = None
        log(f"(JAX peer unavailable: {type(exc).__name__}: {exc})")

    def report(kernel, profile, order, ctx, cfg, seconds, nbytes):
        gbs = nbytes / seconds / 1e9
        log(f"| {kernel} | {profile} | {order} | {ctx} | {cfg} | {seconds * 1e6:.0f} | {nbytes / 1e9:.2f} | "
            f"{gbs:.0f} | {100 * gbs * 1e9 / copy_bw:.0f}% |")

    rs = np.random.RandomState(0)
    notes = []
    try:
        _decode_rows(shapes, rs, peer, report, notes, deadline)
    finally:
        log("")
        for note in notes:
            log(note)


def _decode_rows(shapes, rs, peer, report, notes, deadline) -> None:
    bsz, h, hq, d = shapes.batch, shapes.kv_heads, shapes.q_heads, shapes.head_dim
    interpret = jax.default_backend() == "cpu"
    for ctx in shapes.contexts:
        for profile in ("bf16", "k8v4"):
            for order in ORDERS:
                if deadline.left() < 20:
                    log(f"(time budget spent: skipped {profile} {order} {ctx} and later)")
                    return
                try:
                    blocks = ctx // PAGE
                    table, rows, n_pages = shuffled_tables(rs, bsz, blocks)
                    lay = PagedKVStorageLayout(profile, 1, h, d, order)
                    view = PagedKVBatchLayerView(random_planes(lay, n_pages, seed=ctx), table, 0, lay)
                    q = jax.random.normal(jax.random.key(1), (bsz, 1, hq, d), jnp.bfloat16) * 0.1
                    lens = jnp.full((bsz,), ctx, jnp.int32)
                    pos = lens - 1
                    nbytes = bsz * ctx * h * KVProfile.parse(profile).token_head_bytes(d)
                    configs = [("default", None)]
                    if profile == "bf16" and order == "page-major" and ctx == shapes.sweep_context:
                        configs += [
                            ("block_k=128", pk.PagedAttentionConfig(block_k=128)),
                            ("k_splits=2", pk.PagedAttentionConfig(k_splits=2)),
                            ("k_splits=4", pk.PagedAttentionConfig(k_splits=4)),
                            ("num_warps=8", pk.PagedAttentionConfig(num_warps=8)),
                            ("num_stages=3", pk.PagedAttentionConfig(num_stages=3)),
                        ]
                    ours_out = None
                    for label, cfg in configs:
                        fn = jax.jit(lambda q, v, r, p, n, cfg=cfg: pk.paged_attention(q, v, r, p, n, config=cfg))
                        seconds = timed(fn, q, view, rows, pos, lens, iters=shapes.iters)
                        resolved = (cfg or pk.PagedAttentionConfig()).resolve(
                            num_queries=1, group=hq // h, head_dim=d, batch=bsz, kv_heads=h, max_keys=blocks * PAGE
                        )
                        r = resolved
                        desc = f"{label} (q{r.block_q} k{r.block_k} s{r.k_splits} w{r.num_warps})"
                        report("ours", profile, order, ctx, desc, seconds, nbytes)
                        if ours_out is None:
                            ours_out = fn(q, view, rows, pos, lens)
                    if peer is not None and profile == "bf16" and order == "head-major":
                        k_pages = view.planes["k"].reshape(h, n_pages, PAGE, d)
                        v_pages = view.planes["v"].reshape(h, n_pages, PAGE, d)
                        per_row = table[rows]
                        splits = math.gcd(16, blocks)  # its default, where the table width allows it
                        fn = jax.jit(lambda q, k, v, t, n: peer.paged_attention(
                            q, k, v, t, n, k_splits=splits, pages_per_compute_block=min(8, blocks // splits),
                            interpret=interpret))
                        seconds = timed(fn, q[:, 0], k_pages, v_pages, per_row, lens, iters=shapes.iters)
                        report("JAX peer", profile, order, ctx, f"block_h16 ppcb{min(8, blocks // splits)} "
                               f"k_splits{splits}", seconds, nbytes)
                        peer_out = fn(q[:, 0], k_pages, v_pages, per_row, lens)
                        ours_scaled = jax.jit(
                            lambda q, v, r, p, n: pk.paged_attention(q, v, r, p, n, sm_scale=1.0)
                        )(q, view, rows, pos, lens)
                        notes.append(f"ours vs JAX peer, {ctx} context, same inputs (sm_scale=1): max |diff| / "
                                     f"(1 + |peer|) = {_max_err(ours_scaled[:, 0], peer_out):.2e}")
                        del k_pages, v_pages
                    del view
                except Exception as exc:
                    log(f"| ours | {profile} | {order} | {ctx} | {short_error(exc)} |  |  |  |  |")
                    traceback.print_exc(file=sys.stdout)


def append_timing(deadline: Deadline, shapes: TimingShapes) -> None:
    h, d = shapes.kv_heads, shapes.head_dim
    log("")
    log("Append (quantize + write in place, planes donated), pages in random physical order.")
    log("")
    log("| profile | order | B x T | time per call (us) | tokens/s | bytes written/s (GB/s) |")
    log("|---|---|---|---|---|---|")
    rs = np.random.RandomState(1)
    for profile in ("bf16", "k8v4"):
        for order in ORDERS:
            for bsz, t in shapes.append_shapes:
                if deadline.left() < 10:
                    log("(time budget spent: skipped the remaining appends)")
                    return
                try:
                    blocks = shapes.append_context // PAGE
                    table, rows, n_pages = shuffled_tables(rs, bsz, blocks)
                    lay = PagedKVStorageLayout(profile, 1, h, d, order)
                    view = PagedKVBatchLayerView(random_planes(lay, n_pages, seed=7), table, 0, lay)
                    k = jax.random.normal(jax.random.key(2), (bsz, t, h, d), jnp.bfloat16)
                    pos = jnp.full((bsz,), 1000, jnp.int32)
                    valid = jnp.full((bsz,), t, jnp.int32)
                    fn = jax.jit(pk.paged_append, donate_argnums=(0,))
                    for _ in range(2):
                        view = fn(view, rows, pos, k, k, valid)
                    jax.block_until_ready(view.planes)
                    iters = 25 * shapes.iters // 10
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        view = fn(view, rows, pos, k, k, valid)
                    jax.block_until_ready(view.planes)
                    seconds = (time.perf_counter() - t0) / iters
                    tokens = bsz * t
                    written = tokens * h * KVProfile.parse(profile).token_head_bytes(d)
                    log(f"| {profile} | {order} | {bsz} x {t} | {seconds * 1e6:.1f} | {tokens / seconds:.3g} | "
                        f"{written / seconds / 1e9:.2f} |")
                    del view
                except Exception as exc:
                    log(f"| {profile} | {order} | {bsz} x {t} | {short_error(exc)} |  |  |")
                    traceback.print_exc(file=sys.stdout)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, correctness only, interpret mode")
    parser.add_argument("--profiles", nargs="+", default=PROFILES, choices=PROFILES)
    parser.add_argument("--orders", nargs="+", default=ORDERS, choices=ORDERS)
    parser.add_argument("--budget-s", type=float, default=230.0, help="stop starting timing work after this")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--rehearse-timing", action="store_true",
                        help="with --cpu-smoke: also run the timing code with tiny shapes (numbers meaningless)")
    args = parser.parse_args(argv)
    deadline = Deadline(args.budget_s)

    backend = jax.default_backend()
    log(f"# Pallas kernel check on {backend}: {jax.devices()[0].device_kind} (jax {jax.__version__})")
    if backend == "cpu" and not args.cpu_smoke:
        log("No GPU: run with --cpu-smoke for the interpret-mode correctness check.")
        return 2
    log("")
    log("## Correctness against the reference" + (" (interpret mode)" if backend == "cpu" else ""))
    log("")
    t0 = time.perf_counter()
    failures = correctness(args.profiles, args.orders, smoke=args.cpu_smoke)
    log("")
    log(f"{failures} failing checks ({time.perf_counter() - t0:.0f} s)")
    if args.skip_timing or (args.cpu_smoke and not args.rehearse_timing):
        return 1 if failures else 0
    shapes = REHEARSAL if args.cpu_smoke else TimingShapes()
    log("")
    log("## Timing" + (" (rehearsal with tiny shapes: numbers are meaningless)" if args.cpu_smoke else ""))
    try:
        bw = copy_bandwidth(shapes)
        decode_timing(bw, deadline, shapes)
    except Exception:
        traceback.print_exc(file=sys.stdout)
    try:
        append_timing(deadline, shapes)
    except Exception:
        traceback.print_exc(file=sys.stdout)
    log("")
    log(f"total {time.perf_counter() - deadline.start:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
