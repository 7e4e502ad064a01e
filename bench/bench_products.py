"""Weight products of a decode step: the FFI kernels against XLA's dots, side by side, one run.

For each weight shape of a Qwen3-0.6B layer and its LM head (bfloat16, ``x @ w.T``) and each row
count M, prints the median time of :func:`ninfer_kv.ops.ffi.products.matmul_bf16` (the row kernel), of
:func:`ninfer_kv.ops.ffi.products.matmul_bf16_packed` (weights packed once) and of XLA's two spellings, the
packed kernel's rate (GMAC/s, its fraction of the machine's BF16 matrix peak measured in the same
run, and GB/s of weights and their fraction of the read bandwidth measured in the same run) and the
ratios.  Run: ``python bench/bench_products.py [--rows 1 8 32 128 512] [--repeats 5]``.

``--roofline [T ...]`` times the engine's own steps against the machine instead (decode against the
read bandwidth, ragged prefill against the BF16 peak); ``--breakdown`` adds where each prefill
step's time goes.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402

from ninfer_kv.ops.ffi import products as ffi_products  # noqa: E402
from ninfer_kv.ops.ffi.packed_weight import pack_bf16_weight  # noqa: E402

SHAPES = {"q/k/v (4096 x 1024)": (4096, 1024), "o (1024 x 2048)": (1024, 2048),
          "gate+up (6144 x 1024)": (6144, 1024), "down (1024 x 3072)": (1024, 3072),
          "lm head (151936 x 1024)": (151936, 1024)}


def timed(fn, *args, iters: int, repeats: int = 1, budget_s: float = 0.2) -> float:
    """Median over ``repeats`` of the mean time of up to ``iters`` calls (fewer for slow calls:
    about ``budget_s`` per repeat)."""
    import statistics

    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    n = max(1, min(iters, int(budget_s / max(time.perf_counter() - t0, 1e-6))))
    means = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        means.append((time.perf_counter() - t0) / n)
    return statistics.median(means)


def median_time(fn, iters: int) -> float:
    """Median wall time of ``iters`` calls of ``fn()`` (each waited for), after one untimed call."""
    import statistics

    jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def qwen3_0_6b():
    from ninfer_kv.models.decoder import ModelConfig

    return ModelConfig(vocab_size=151936, d_model=1024, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                       mlp_dim=3072, rope_theta=1e6, rms_eps=1e-6, dtype="bfloat16", qk_norm=True,
                       tie_embeddings=True)


def steps_section(batches, iters: int, context: int = 512) -> None:
    import statistics

    import numpy as np

    from ninfer_kv.models.decoder import StepConfig, init_params, make_steps, pack_params
    from ninfer_kv.ops.views import allocate_planes

    cfg = qwen3_0_6b()
    plain = init_params(cfg, seed=0)
    packed = pack_params(plain, cfg)
    # (label, products mode, params): the packed weights (pack_params) take the packed products
    modes = (("xla", "xla", plain), ("auto", "auto", plain), ("batch_invariant", "batch_invariant", plain),
             ("auto, packed", "auto", packed), ("batch_invariant, packed", "batch_invariant", packed))
    steps = {label: make_steps(StepConfig(model=cfg, impl="ffi", products=m, batch_buckets=tuple(batches)))
             for label, m, _ in modes}
    print(f"decode step, Qwen3-0.6B shapes, {context} tokens of context per row, median of {iters}")
    print("| batch | " + " | ".join(f"{label} (ms)" for label, _, _ in modes) + " | xla / auto, packed |")
    print("|---" * (len(modes) + 2) + "|")
    for b in batches:
        blocks = context // 64 + 1
        state = {}
        for label, _, _ in modes:
            lay = steps[label].config.main_layout
            state[label] = allocate_planes(lay, b * blocks + 1), np.arange(b * blocks, dtype=np.int32).reshape(b, blocks)
        tokens = np.ones((b, 1), np.int32)
        pos, one, rows = (np.full((b,), context, np.int32), np.ones((b,), np.int32), np.arange(b, dtype=np.int32))
        times = {label: [] for label, _, _ in modes}
        for i in range(iters + 1):
            for label, _, params in modes:
                planes, tables = state[label]
                t0 = time.perf_counter()
                out = steps[label].decode(params, planes, jnp.asarray(tables), tokens, pos, one, rows)
                jax.block_until_ready(out.next_tokens)
                if i:  # the first call compiles
                    times[label].append(time.perf_counter() - t0)
                state[label] = out.planes, np.asarray(out.block_tables)
        med = {label: statistics.median(times[label]) for label, _, _ in modes}
        print(f"| {b} | " + " | ".join(f"{med[label] * 1e3:.1f}" for label, _, _ in modes) + " | "
              + f"{med['xla'] / med['auto, packed']:.2f} |")


def layer_weights(cfg) -> int:
    """Weight elements of one decoder layer's projections (q, k, v, o, gate, up, down)."""
    d, q, kv, mlp = cfg.d_model, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.mlp_dim
    return d * q + 2 * d * kv + q * d + 3 * d * mlp


def step_breakdown(lowered, call) -> None:
    """Where one call of a jitted step spends its time, from JAX's profiler trace: each FFI call
    target (the packed products by their operand and result shapes, with their multiply-add rate)
    and XLA's own operations between them.  ``lowered``: the step's ``jax.jit(...).lower(...)``;
    ``call()`` runs the step once and blocks."""
    import collections
    import glob
    import gzip
    import json
    import math
    import re
    import tempfile

    calls = {}  # HLO instruction name -> (target, result shapes, operand shapes)
    dims = lambda text: [tuple(int(v) for v in d.split(",") if v) for d in re.findall(r"\w+\[([\d,]*)\]", text)]  # noqa: E731
    for line in lowered.compile().as_text().splitlines():
        m = re.match(r'\s*%(ffi_call[.\w]*) = (.*?) custom-call\(.*custom_call_target="(\w+)"(.*)', line)
        if m:
            operands = re.search(r"operand_layout_constraints=\{(.*?)\}[,}]", m.group(4))
            calls[m.group(1)] = (m.group(3).removeprefix("ninfer_kv_"), dims(m.group(2)), dims(operands.group(1)) if operands else [])
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        call()
        jax.profiler.stop_trace()
        with gzip.open(glob.glob(f"{d}/plugins/profile/*/*.trace.json.gz")[0]) as f:
            trace = json.load(f)
    busy, count, macs = collections.Counter(), collections.Counter(), collections.Counter()
    skip = ("ThunkExecutor", "$", "end:", "Pjit", "Common", "Parse", "Handle")
    for e in trace["traceEvents"]:
        name = e.get("name", "")
        if e.get("ph") != "X" or name.startswith(skip):
            continue
        target, results, operands = calls.get(name, ("XLA's own operations", [], []))
        key = target if target != "matmul_bf16_packed" else f"{target} {operands[0]} -> {', '.join(map(str, results))}"
        busy[key] += e["dur"] / 1e6
        count[key] += 1
        if target == "matmul_bf16_packed":
            macs[key] += math.prod(operands[0]) * sum(r[-1] for r in results)
    total = sum(busy.values())
    print("| part | calls | ms | share | GMAC/s |")
    print("|---|---:|---:|---:|---:|")
    for key, t in busy.most_common():
        rate = f"{macs[key] / t / 1e9:.0f}" if macs[key] else ""
        print(f"| {key} | {count[key]} | {t * 1e3:.1f} | {t / total:.2f} | {rate} |")


def roofline_section(prefill_tokens, iters: int, peak, breakdown: bool = False) -> None:
    """The engine's own steps against the machine: a decode step at batch 1 (512 tokens of context)
    against the read bandwidth (every weight byte read once, the LM head included), and a ragged step
    holding one prompt of T tokens against the BF16 matrix peak (the products' and the causal
    attention's multiply-adds)."""
    import statistics

    import numpy as np

    from ninfer_kv.models.decoder import StepConfig, init_params, make_steps
    from ninfer_kv.models.decoder.padding import pad_ragged
    from ninfer_kv.ops.views import allocate_planes

    cfg = qwen3_0_6b()
    longest = max(prefill_tokens)
    steps = make_steps(StepConfig(model=cfg, impl="ffi", batch_buckets=(1, 2), token_buckets=tuple(sorted(set(prefill_tokens)))))
    params = steps.prepare_params(init_params(cfg, seed=0))  # as the engine runs them
    weight_bytes = 2 * (cfg.num_layers * layer_weights(cfg) + cfg.vocab_size * cfg.d_model)
    blocks = -(-(longest + 512 + 1) // 64)
    state = {"planes": allocate_planes(steps.config.main_layout, blocks),
             "tables": jnp.asarray(np.arange(blocks, dtype=np.int32)[None])}
    i32 = lambda x: jnp.asarray(np.asarray(x, np.int32))  # noqa: E731

    def run(step, *a):  # planes and tables are donated: each call takes the previous call's
        out = step(params, state["planes"], state["tables"], *a)
        state["planes"], state["tables"] = out.planes, out.block_tables
        return out.next_tokens

    def median(fn) -> float:
        return median_time(fn, iters)

    from ninfer_kv.ops.ffi.packed_weight import PackedWeight

    packed = isinstance(params.get("lm_head"), PackedWeight)
    print(f"\nthe engine's steps (Qwen3-0.6B shapes, params as the engine prepares them: "
          f"{'packed' if packed else 'plain'}), median of {iters}")
    # The read bandwidth of a shared machine moves from minute to minute: each decode step is timed
    # right after a read-bandwidth sample, and the step's rate is compared with the samples' median.
    dec = (i32([[1]]), i32([512]), i32([1]), i32([0]))
    jax.block_until_ready(run(steps.decode, *dec))
    steps_s, samples = [], []
    for _ in range(max(iters, 5)):
        samples.append(machine.read_bandwidth(repeats=1))
        t0 = time.perf_counter()
        jax.block_until_ready(run(steps.decode, *dec))
        steps_s.append(time.perf_counter() - t0)
    t, bw = statistics.median(steps_s), statistics.median(samples)
    print(f"| decode, batch 1, 512 tokens of context | {t * 1e3:.1f} ms | {weight_bytes / t / 1e9:.1f} GB/s of weights "
          f"| {weight_bytes / t / bw:.2f} of the read bandwidth ({bw / 1e9:.1f} GB/s, median of samples taken "
          f"between the steps) |")
    rng = np.random.default_rng(0)
    for n in prefill_tokens:
        pk = pad_ragged(rng.integers(0, cfg.vocab_size, n).astype(np.int32), [n], [0], [0], bucket=1, token_bucket=n)
        args = (i32(pk.tokens), i32(pk.positions), i32(pk.query_starts), i32(pk.table_rows))
        t = median(lambda a=args: run(steps.ragged, *a))
        macs = (n * cfg.num_layers * layer_weights(cfg) + cfg.vocab_size * cfg.d_model
                + cfg.num_layers * 2 * (n * (n + 1) // 2) * cfg.num_heads * cfg.head_dim)
        share = f"{macs / t / peak[1]:.2f} of the BF16 peak ({peak[0]})" if peak else "no peak measured"
        print(f"| prefill, one prompt of {n} tokens (ragged step) | {t * 1e3:.1f} ms | {macs / t / 1e9:.1f} GMAC/s "
              f"| {share} |")
        if breakdown:
            print(f"\nwhere the {n}-token prefill step's time goes (one step under JAX's profiler):")
            step_breakdown(steps.ragged.lower(params, state["planes"], state["tables"], *args),
                           lambda a=args: jax.block_until_ready(run(steps.ragged, *a)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    p.add_argument("--repeats", type=int, default=5, help="medians of this many timings")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--steps", action="store_true", help="time whole decode steps instead of the products")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--roofline", type=int, nargs="*", default=None, metavar="T",
                   help="time the engine's decode step (batch 1) against the read bandwidth and ragged prefill "
                        "steps of T tokens (default 512) against the BF16 peak, both measured in this run")
    p.add_argument("--breakdown", action="store_true",
                   help="with --roofline: where each prefill step's time goes (JAX's profiler, one step)")
    args = p.parse_args(argv)
    if args.steps:
        steps_section(args.batches, args.iters)
        return 0
    if args.roofline is not None:
        read_bw, peak = machine.read_bandwidth(), machine.bf16_peak()
        print(f"machine: {machine.describe(read_bw)}")
        print(f"BF16 matrix peak: {f'{peak[1] / 1e9:.0f} GMAC/s ({peak[0]}, every FFI thread)' if peak else 'not measured'}")
        roofline_section(args.roofline or [512], args.iters, peak, args.breakdown)
        return 0
    row = jax.jit(ffi_products.matmul_bf16)
    packed = jax.jit(ffi_products.matmul_bf16_packed)
    mm = jax.jit(lambda x, w: jnp.matmul(x, w.T, preferred_element_type=jnp.float32))
    dg = jax.jit(lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32))
    read_bw = machine.read_bandwidth()
    peak = machine.bf16_peak()
    print(f"machine: {machine.describe(read_bw)}")
    print(f"BF16 matrix peak: {f'{peak[1] / 1e9:.0f} GMAC/s ({peak[0]}, every FFI thread)' if peak else 'not measured'}")
    print("(each implementation timed over every case before the next one runs: XLA's CPU thread pool keeps "
          "spinning after its own calls and would slow a kernel timed right after them)")
    cases = [(name, n, k, m) for name, (n, k) in SHAPES.items() for m in args.rows]
    weights = {name: jax.random.normal(jax.random.key(0), (n, k), jnp.bfloat16) for name, (n, k) in SHAPES.items()}
    xs = {(k, m): jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16) for _, _, k, m in cases}
    packs = {name: pack_bf16_weight(w) for name, w in weights.items()}
    operands = {"row": weights, "packed": packs, "mm": weights, "dg": weights}
    times = {label: [timed(f, xs[(k, m)], operands[label][name], iters=args.iters, repeats=args.repeats)
                     for name, n, k, m in cases]
             for label, f in (("row", row), ("packed", packed), ("mm", mm), ("dg", dg))}
    print("| weight | M | row kernel (us) | packed (us) | packed GMAC/s | of BF16 peak | packed GB/s of weights "
          "| of read BW | XLA x @ w.T (us) | XLA dot_general (us) | XLA best / packed | row kernel / packed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for i, (name, n, k, m) in enumerate(cases):
        a, q, b, c = times["row"][i], times["packed"][i], times["mm"][i], times["dg"][i]
        rate, gbs = m * n * k / q, n * k * 2 / q
        of_peak = f"{rate / peak[1]:.2f}" if peak else "-"
        print(f"| {name} | {m} | {a * 1e6:.0f} | {q * 1e6:.0f} | {rate / 1e9:.1f} | {of_peak} | {gbs / 1e9:.1f} "
              f"| {gbs / read_bw:.2f} | {b * 1e6:.0f} | {c * 1e6:.0f} | {min(b, c) / q:.2f} | {a / q:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
