"""TPU check of the Mosaic TPU Pallas kernels: correctness against the reference, then decode and append speed.

The first run on a real TPU chip (``impl="pallas_tpu"``, ``pallas_kernels/mosaic_tpu``), in the
shape of ``bench/gpu_check.py`` and with its helpers (pools whose bytes hash the page ID, pages in
random physical order, the append comparison token by token, the float32 reference).  Results
print as they come, as markdown; every section has its own time budget (``--budget SECTION=SECONDS``).
Sections, in order:

``setup``
    ``impl="pallas_tpu"`` is registered and loads, and an op call through ``ninfer_kv.ops`` gives the
    bits of the direct kernel call; the chip's nominal HBM bandwidth (:data:`HBM_GBPS`, by
    generation) and two measured baselines: an elementwise copy (``x + 1``, read + write) and a
    read-only reduction (``sum(x)``).
``correctness``
    Small shapes, every profile and both plane orders, against :mod:`ninfer_kv.ops.reference`
    (float32): paged append with bfloat16 and float32 K/V (written tokens within one code step of
    the CPU reference encoding, scales exact, every other byte unchanged), decode (T = 1) and chunk
    attention with bfloat16 and float32 queries, GQA G = 8 at D = 64 and D = 256.  Comes before
    any timing: a fast wrong kernel is not a result.
``decode``
    Decode attention, B = 32 rows, H = 8 KV heads, Hq = 32, D = 128, contexts 8K then 2K, BF16 and
    K8V4 in both plane orders; N back-to-back calls timed with one wait; the timed output checked
    against the float32 reference on three rows; bytes of K/V read per second against the measured
    read bandwidth and the chip's nominal HBM bandwidth.
``append``
    Decode (B = 32, T = 1) and chunk (B = 8, T = 256) appends, bfloat16 K/V, planes donated, timed
    the same way; the written tokens checked after the run.
``ragged``
    The mixed rounds of ``bench/gpu_check.py``'s ``ragged`` section (8 decodes at 4K beside one
    1024-token prefill chunk; 64 decodes at 2K; H = 8, Hq = 32, D = 128, BF16 and K8V4,
    page-major) through ``ninfer_kv.ops.paged_append_ragged`` / ``paged_attention_ragged`` with
    ``impl="pallas_tpu"`` (whether its ragged kernels are native is printed: without them the ops
    run one query per row): correctness against the float32 reference ragged ops first, then the
    median single-call time against the roofline (each row's live pages once per KV head per query
    block) as a fraction of the measured read bandwidth and of the nominal HBM bandwidth.  On the
    BF16 rounds JAX's own ``jax.experimental.pallas.ops.tpu.ragged_paged_attention`` runs beside
    it on the same pages (:func:`peer_kv_pages`: K and V interleaved per head, its tuned block
    sizes), its output compared with ours, and the time ratio printed.  (On the CPU rehearsal
    JAX's kernel does not run in TPU interpret mode; its jnp reference
    ``ref_ragged_paged_attention`` stands in, which still checks the layout translation.)
``engine``
    A small random bf16 decoder served by ``ninfer_kv.LLM`` with ``impl="pallas_tpu"``
    (``bench/gpu_check.py``'s ``engine`` section): generated tokens/s, prompt tokens/s, the units
    run and whether the rounds were ragged (exactly when ``pallas_tpu`` has native ragged kernels).

Attention outputs are compared with ``max |out - ref| / (1 + |ref|) <= 2e-2``.  The exit status is
1 when any check failed, 2 when there is no TPU (without ``--cpu-smoke``) or no ``pallas_tpu``.

``--cpu-smoke`` runs every section with tiny shapes in TPU interpret mode on the CPU (codes must
then be bit-identical; the timings and bandwidths are meaningless).

Usage::

    PYTHONPATH=. python bench/tpu_check.py                      # on a TPU VM
    PYTHONPATH=. python bench/tpu_check.py --cpu-smoke          # CPU rehearsal of every section
    PYTHONPATH=. python bench/tpu_check.py --sections decode --budget decode=60
    PYTHONPATH=. python bench/tpu_check.py --sections ragged engine     # the ragged rounds and the engine
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import pathlib
import sys
import time
import traceback

if "--cpu-smoke" in sys.argv:
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ninfer_kv import ops  # noqa: E402
from ninfer_kv.ops import registry  # noqa: E402
from ninfer_kv.ops.reference import paged_attention_reference  # noqa: E402
from ninfer_kv.schema.profiles import KVProfile  # noqa: E402


def _load_gpu_check():
    """bench/gpu_check.py as a module: its pools, comparisons, timing and table helpers."""
    path = pathlib.Path(__file__).resolve().parent / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("ninfer_kv_bench_gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gc = _load_gpu_check()
log, short_error, Checks, Section = gc.log, gc.short_error, gc.Checks, gc.Section
PAGE, ATTN_TOL, ORDERS = gc.PAGE, gc.ATTN_TOL, gc.ORDERS
PROFILES = [p.value for p in KVProfile]
IMPL = "pallas_tpu"
SECTIONS = ("setup", "correctness", "decode", "append", "ragged", "engine")
DEFAULT_BUDGET = {"setup": 30, "correctness": 150, "decode": 150, "append": 60, "ragged": 120, "engine": 150}

# Nominal HBM bandwidth per chip, GB/s (1e9 bytes/s), from Google Cloud's TPU documentation
# (cloud.google.com/tpu/docs: "TPU v4", "TPU v5e", "TPU v5p", "TPU v6e" system-architecture pages,
# "HBM bandwidth" per chip) and, for Ironwood, Google's announcement (blog.google, "Ironwood",
# April 2025: 7.37 TB/s per chip).  Matched against ``device.device_kind`` in this order.
HBM_GBPS = (
    ("v5 lite", "TPU v5e", 819),
    ("v5e", "TPU v5e", 819),
    ("v6 lite", "TPU v6e (Trillium)", 1640),
    ("v6e", "TPU v6e (Trillium)", 1640),
    ("v5p", "TPU v5p", 2765),
    ("v5", "TPU v5p", 2765),
    ("v4", "TPU v4", 1200),
    ("v3", "TPU v3", 900),
    ("7", "TPU7x (Ironwood)", 7370),
)


def nominal_hbm(device_kind: str) -> tuple[str, float]:
    """``(generation, GB/s)`` of a ``device_kind`` (``("unknown", nan)`` when not in :data:`HBM_GBPS`)."""
    kind = device_kind.lower()
    for key, name, gbps in HBM_GBPS:
        if key in kind:
            return name, float(gbps)
    return "unknown", float("nan")


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Problem sizes of one run (the TPU run, or the tiny CPU rehearsal)."""

    bandwidth_elems: int = 1 << 28  # float32 elements of the bandwidth probes (1 GiB)
    batch: int = 32
    kv_heads: int = 8
    q_heads: int = 32
    head_dim: int = 128
    contexts: tuple = (8192, 2048)
    decode_cases: tuple = tuple((p, o) for p in ("bf16", "k8v4") for o in ORDERS)
    append_shapes: tuple = ((32, 1), (8, 256))
    append_cases: tuple = tuple((p, o) for p in ("bf16", "k8v4") for o in ORDERS)
    append_context: int = 4096
    iters: int = 50
    small_head_dim: int = 128
    small_gqa: tuple = ((8, 64), (8, 256))
    ragged_rounds: tuple = ()  # gpu_check.RaggedRound; default gpu_check.RAGGED_ROUNDS
    ragged_profiles: tuple = ("bf16", "k8v4")
    ragged_iters: int = 20
    ragged_warmup: int = 2
    ragged_check_queries: int = 16
    engine_model: dict | None = None  # default gpu_check.ENGINE_MODEL
    engine_workload: tuple = (16, 512, 256)  # (requests, prompt tokens, generated tokens each)
    engine_max_model_len: int = 1024
    smoke: bool = False

    def rounds(self) -> tuple:
        """The ragged section's rounds."""
        return self.ragged_rounds or gc.RAGGED_ROUNDS


SMOKE = Shapes(
    bandwidth_elems=1 << 12, batch=2, kv_heads=2, q_heads=8, head_dim=64, contexts=(256,),
    decode_cases=(("bf16", "page-major"),), append_shapes=((2, 3),), append_cases=(("bf16", "page-major"),),
    append_context=256, iters=2, small_head_dim=64, small_gqa=((8, 64),),
    ragged_rounds=gc.SMOKE.ragged_rounds, ragged_profiles=("bf16",), ragged_iters=1, ragged_warmup=1,
    ragged_check_queries=4,
    engine_model=gc.SMOKE.engine_model, engine_workload=gc.SMOKE.engine_workload,
    engine_max_model_len=gc.SMOKE.engine_max_model_len, smoke=True,
)


def _tpu_ops():
    return registry.load_impl(IMPL)


# -- sections --------------------------------------------------------------------------------------


def section_setup(sec: Section, shapes: Shapes, checks: Checks, state: dict) -> None:
    checks.header()
    names = registry.registered_impls()
    checks.row("impl registered", "-", "-", "registered_impls()", ", ".join(names), IMPL in names)
    impl = _tpu_ops()
    checks.row("impl loads", "-", "-", "load_impl", impl.name, True)
    view, rows = gc.reference_pool("k8v4", "page-major", head_dim=shapes.small_head_dim, kv_heads=2,
                                   kv_lens=[100, 200], seed=5)
    q = jax.random.normal(jax.random.key(3), (2, 1, 8, shapes.small_head_dim), jnp.bfloat16)
    args = (q, view, jnp.asarray(rows), jnp.array([99, 199], jnp.int32), jnp.array([100, 200], jnp.int32))
    through = jax.jit(lambda *a: ops.paged_attention(*a, impl=IMPL))(*args)
    direct = jax.jit(impl.paged_attention)(*args)
    same = bool(np.array_equal(np.asarray(through).view(np.uint16), np.asarray(direct).view(np.uint16)))
    checks.row("ninfer_kv.ops call", "k8v4", "page-major", "bits equal to the kernel", same, same)
    kind = jax.devices()[0].device_kind
    gen, gbps = nominal_hbm(kind)
    state["nominal_bw"] = gbps * 1e9
    n = shapes.bandwidth_elems
    x = jnp.ones((n,), jnp.float32)
    iters = max(2, shapes.iters // 5)
    t_copy, _ = gc.timed(jax.jit(lambda a: a + 1.0), x, iters=iters)
    t_read, _ = gc.timed(jax.jit(lambda a: jnp.sum(a)), x, iters=iters)
    del x
    state["copy_bw"] = 2 * n * 4 / t_copy
    state["read_bw"] = n * 4 / t_read
    log("")
    log(f"Chip {kind!r}: {gen}, nominal HBM bandwidth {gbps:.0f} GB/s.  Measured over {n * 4 / 2**30:.3g} GiB: "
        f"copy (x + 1, read + write) {state['copy_bw'] / 1e9:.0f} GB/s; read-only (sum) {state['read_bw'] / 1e9:.0f} GB/s"
        + (f" ({100 * state['read_bw'] / state['nominal_bw']:.0f}% of nominal)" if math.isfinite(gbps) else ""))


def section_correctness(sec: Section, shapes: Shapes, checks: Checks, state: dict, profiles, orders) -> None:
    impl = _tpu_ops()
    d, h, g = shapes.small_head_dim, 2, 4
    kv_lens = [70, 0, 130] if shapes.smoke else [100, 0, 200, 64]
    chunk = 16 if shapes.smoke else 64
    checks.header()
    append = jax.jit(impl.paged_append)
    attn = jax.jit(impl.paged_attention)
    attn_ref = jax.jit(paged_attention_reference)
    bsz = len(kv_lens)
    lens = jnp.asarray(kv_lens, jnp.int32)
    for i, profile in enumerate(profiles):
        for j, order in enumerate(orders):
            if not sec.has(5, f"{profile} {order}"):
                continue
            try:
                view, rows = gc.reference_pool(profile, order, head_dim=d, kv_heads=h, kv_lens=kv_lens, seed=i)
                for in_dtype in (jnp.bfloat16, jnp.float32):
                    k = jax.random.normal(jax.random.key(10 + i), (bsz, 5, h, d), in_dtype)
                    v = jax.random.normal(jax.random.key(20 + i), (bsz, 5, h, d), in_dtype)
                    valid = jnp.asarray([5, 0] + [3] * (bsz - 2), jnp.int32)
                    after = append(view, jnp.asarray(rows), lens, k, v, valid)
                    ok, desc = gc.compare_append(view, after, view.block_tables, rows, lens, valid, k, v,
                                                 exact=shapes.smoke)
                    checks.row(f"paged append ({jnp.dtype(in_dtype).name} K/V)", profile, order, "written tokens",
                               desc, ok)
                for q_dtype in (jnp.bfloat16, jnp.float32):
                    for name, t in (("decode", 1), (f"chunk T={chunk}", chunk)):
                        q = jax.random.normal(jax.random.key(30 + i + t), (bsz, t, h * g, d), q_dtype)
                        pos = jnp.maximum(lens - t, 0)
                        err = gc.max_rel_err(attn(q, view, jnp.asarray(rows), pos, lens),
                                             attn_ref(q, view, jnp.asarray(rows), pos, lens))
                        checks.row(f"{name}, {jnp.dtype(q_dtype).name} q", profile, order, "max rel err",
                                   f"{err:.2e}", err <= ATTN_TOL)
            except Exception as exc:
                checks.error("paged", profile, order, exc)
    gqa_profile = "k8v4" if "k8v4" in profiles else profiles[0]
    for gg, dd in shapes.small_gqa:
        if not sec.has(5, f"G={gg} D={dd}"):
            continue
        try:
            view, rows = gc.reference_pool(gqa_profile, "head-major", head_dim=dd, kv_heads=1, kv_lens=kv_lens, seed=9)
            q = jax.random.normal(jax.random.key(dd), (bsz, 1, gg, dd), jnp.bfloat16)
            err = gc.max_rel_err(attn(q, view, jnp.asarray(rows), lens - 1, lens),
                                 attn_ref(q, view, jnp.asarray(rows), lens - 1, lens))
            checks.row(f"decode G={gg} D={dd}, bfloat16 q", gqa_profile, "head-major", "max rel err", f"{err:.2e}",
                       err <= ATTN_TOL)
        except Exception as exc:
            checks.error(f"G={gg} D={dd}", gqa_profile, "head-major", exc)


def _bw_cols(nbytes: int, seconds: float, state: dict) -> str:
    bw = nbytes / seconds
    nominal = state.get("nominal_bw", float("nan"))
    pct_nominal = f"{100 * bw / nominal:.0f}%" if math.isfinite(nominal) else "n/a"
    return (f"{seconds * 1e6:.0f} | {nbytes / 1e9:.3g} | {bw / 1e9:.0f} | {100 * bw / state['read_bw']:.0f}% | "
            f"{pct_nominal}")


def section_decode(sec: Section, shapes: Shapes, checks: Checks, state: dict) -> None:
    impl = _tpu_ops()
    bsz, h, hq, d = shapes.batch, shapes.kv_heads, shapes.q_heads, shapes.head_dim
    log(f"B={bsz}, H={h}, Hq={hq}, D={d}, one query per row, {shapes.iters} back-to-back calls per timing.")
    log("")
    log("| profile | order | context | time (us) | K/V bytes read (GB) | GB/s | % of measured read BW | "
        "% of nominal HBM BW | max rel err | result |")
    log("|---|---|---|---|---|---|---|---|---|---|")
    rs = np.random.RandomState(0)
    fn = jax.jit(impl.paged_attention)
    for ctx in shapes.contexts:
        for profile, order in shapes.decode_cases:
            if not sec.has(10, f"{profile} {order} {ctx}"):
                continue
            try:
                n_pages = bsz * ctx // PAGE
                view, table, rows, q, pos, lens = gc._decode_problem(shapes, profile, order, ctx, n_pages, rs, bsz, ctx)
                nbytes = gc._planes_bytes_read(profile, bsz, ctx, h, d)
                seconds, out = gc.timed(fn, q, view, jnp.asarray(rows), pos, lens, iters=shapes.iters)
                sel = gc._check_rows(table, rows, bsz, n_pages, h * PAGE * d)
                err = gc.check_attention_rows(out, q, view, rows, pos, lens, sel)
                ok = err <= ATTN_TOL
                checks.failures += 0 if ok else 1
                checks.passed += 1 if ok else 0
                log(f"| {profile} | {order} | {ctx} | {_bw_cols(nbytes, seconds, state)} | {err:.1e} | "
                    f"{'PASS' if ok else 'FAIL'} |")
                del view
            except Exception as exc:
                checks.failed_row([profile, order, ctx], 5, exc)


def section_append(sec: Section, shapes: Shapes, checks: Checks, state: dict) -> None:
    impl = _tpu_ops()
    log(f"Quantize + write in place, planes donated, bfloat16 K/V, {shapes.iters} back-to-back calls per timing.")
    log("")
    log("| profile | order | B x T | time per call (us) | tokens/s | bytes written (GB/s) | written tokens | result |")
    log("|---|---|---|---|---|---|---|---|")
    rs = np.random.RandomState(1)
    fn = jax.jit(impl.paged_append, donate_argnums=(0,))
    for bsz, t in shapes.append_shapes:
        for profile, order in shapes.append_cases:
            if not sec.has(8, f"{profile} {order} {bsz}x{t}"):
                continue
            try:
                run = gc.run_append(fn, rs, shapes, profile, order, bsz, t, jnp.bfloat16)
                checks.failures += 0 if run.ok else 1
                checks.passed += 1 if run.ok else 0
                log(f"| {profile} | {order} | {bsz} x {t} | {run.seconds * 1e6:.1f} | {run.tokens / run.seconds:.3g} | "
                    f"{run.written / run.seconds / 1e9:.2f} | {run.desc} | {'PASS' if run.ok else 'FAIL'} |")
            except Exception as exc:
                checks.failed_row([profile, order, f"{bsz} x {t}"], 4, exc)


def peer_kv_pages(view) -> jax.Array:
    """The ``kv_pages (P, 64, 2H, D)`` of ``jax.experimental.pallas.ops.tpu.ragged_paged_attention``
    from a BF16 page-major view's layer: K of head ``h`` at ``2h``, its V at ``2h + 1``."""
    if view.layout.profile is not KVProfile.BF16 or view.layout.order.value != "page-major":
        raise ValueError(f"the JAX kernel's pages need a bf16 page-major view, got {view.layout.profile.value} "
                         f"{view.layout.order.value}")
    k = jnp.swapaxes(view.planes["k"][view.layer], 1, 2)  # (P, 64, H, D)
    v = jnp.swapaxes(view.planes["v"][view.layer], 1, 2)
    p, page, h, d = k.shape
    return jnp.stack([k, v], axis=3).reshape(p, page, 2 * h, d)


def jax_ragged_peer(shapes: Shapes, checks: Checks, state: dict):
    """The ``peer`` of :func:`gpu_check.run_ragged_section`: JAX's ``ragged_paged_attention`` on the
    same round (its tuned block sizes; on the CPU rehearsal its jnp reference), its output against
    ours, its time against the same roofline."""
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa

    def peer(prob, view, ours, ours_seconds: float, nbytes: int):
        rnd = prob.rnd
        d = view.layout.head_dim
        kv_lens, pages = np.asarray(rnd.kv_lens, np.int32), prob.table[prob.rows].astype(np.int32)
        num_seqs = np.array([rnd.rows], np.int32)
        if shapes.smoke:  # the kernel does not run in TPU interpret mode; its reference loops over concrete rows
            fn = jax.jit(lambda q, kv: rpa.ref_ragged_paged_attention(q, kv, kv_lens, pages, rnd.query_starts,
                                                                      num_seqs, sm_scale=d**-0.5))
            args, what = (prob.q, peer_kv_pages(view)), "JAX reference (CPU)"
        else:
            fn = jax.jit(lambda *a: rpa.ragged_paged_attention(*a, sm_scale=d**-0.5))
            args = (prob.q, peer_kv_pages(view), jnp.asarray(kv_lens), jnp.asarray(pages),
                    jnp.asarray(rnd.query_starts), jnp.asarray(num_seqs))
            what = "JAX ragged_paged_attention"
        cells = [what, "bf16", f"{rnd.rows} / {rnd.num_tokens}", "-", "-" if shapes.smoke else "tuned", "-", "-"]
        try:
            seconds, out = gc.median_time(fn, *args, iters=shapes.ragged_iters, warmup=shapes.ragged_warmup)
        except Exception as exc:  # counted: the JAX kernel is the yardstick of this section
            checks.failures += 1
            traceback.print_exc(file=sys.stdout)
            return ("| " + " | ".join(cells) + f" | {short_error(exc)} |" + "  |" * 5 + " FAIL |",
                    f"{rnd.name}: JAX's kernel failed ({short_error(exc)})")
        err = gc.max_rel_err(out[: rnd.num_tokens], ours)
        ok = err <= ATTN_TOL
        checks.failures += 0 if ok else 1
        checks.passed += 1 if ok else 0
        row = ("| " + " | ".join(cells) + f" | {seconds * 1e6:.0f} | {nbytes / 1e9:.3g} | "
               f"{_roofline(nbytes, seconds, state)} | {err:.1e} vs ours | {'PASS' if ok else 'FAIL'} |")
        note = (f"{rnd.name}, BF16: ours {ours_seconds * 1e6:.0f} us, {what} {seconds * 1e6:.0f} us: "
                f"ours / JAX = {ours_seconds / seconds:.2f}")
        return row, note

    return peer


def _roofline(nbytes: int, seconds: float, state: dict) -> str:
    """``GB/s | % of measured read BW | % of nominal HBM BW`` of ``nbytes`` in ``seconds``."""
    bw = nbytes / seconds
    nominal = state.get("nominal_bw", float("nan"))
    return (f"{bw / 1e9:.0f} | {100 * bw / state['read_bw']:.0f}% | "
            + (f"{100 * bw / nominal:.0f}%" if math.isfinite(nominal) else "n/a"))


def section_ragged(sec: Section, shapes: Shapes, checks: Checks, state: dict) -> None:
    peer = None
    try:
        peer = jax_ragged_peer(shapes, checks, state)
    except Exception as exc:  # a JAX without the kernel: ours still runs
        log(f"(JAX ragged_paged_attention unavailable: {short_error(exc)})")
        log("")
    gc.run_ragged_section(sec, shapes, checks, IMPL, lambda nbytes, seconds: _roofline(nbytes, seconds, state),
                          roof_header="% of measured read BW | % of nominal HBM BW", peer=peer)


def section_engine(sec: Section, shapes: Shapes, checks: Checks, state: dict) -> None:
    gc.run_engine_section(sec, shapes, checks, IMPL)


_TITLES = {
    "setup": "Setup: implementation and HBM bandwidth",
    "correctness": "Correctness against the float32 reference, small shapes",
    "decode": "Decode attention",
    "append": "Append",
    "ragged": "Ragged rounds: decodes beside a prefill chunk",
    "engine": "The engine: a small model through ninfer_kv.LLM",
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gc.add_common_arguments(parser, SECTIONS, "tiny shapes, TPU interpret mode, every section")
    args = parser.parse_args(argv)
    budget = gc.parse_budgets(args.budget, args.cpu_smoke, DEFAULT_BUDGET)
    shapes = SMOKE if args.cpu_smoke else Shapes()

    backend = jax.default_backend()
    start = time.perf_counter()
    log(f"# Mosaic TPU kernel check on {backend}: {jax.devices()[0].device_kind} (jax {jax.__version__})")
    if backend != "tpu" and not args.cpu_smoke:
        log("No TPU: run with --cpu-smoke for the interpret-mode rehearsal.")
        return 2
    if IMPL not in registry.registered_impls():
        log(f"impl={IMPL!r} is not registered (registered: {', '.join(registry.registered_impls())}).")
        return 2
    if args.cpu_smoke:
        log("(CPU rehearsal, TPU interpret mode, tiny shapes: the numbers are meaningless)")
    checks = Checks()
    state: dict = {"copy_bw": float("nan"), "read_bw": float("nan"), "nominal_bw": float("nan")}
    order = [s for s in SECTIONS if s in args.sections]
    if "setup" not in order and ("decode" in order or "ragged" in order):
        order.insert(0, "setup")  # the bandwidth baselines are the denominators
    gc.run_sections(order, budget, _TITLES, {
        "setup": lambda sec: section_setup(sec, shapes, checks, state),
        "correctness": lambda sec: section_correctness(sec, shapes, checks, state, args.profiles, args.orders),
        "decode": lambda sec: section_decode(sec, shapes, checks, state),
        "append": lambda sec: section_append(sec, shapes, checks, state),
        "ragged": lambda sec: section_ragged(sec, shapes, checks, state),
        "engine": lambda sec: section_engine(sec, shapes, checks, state),
    }, checks)
    log("")
    log(f"{checks.failures} failing checks, {checks.passed} passing table checks "
        f"({time.perf_counter() - start:.0f} s)")
    return 1 if checks.failures else 0


if __name__ == "__main__":
    sys.exit(main())
