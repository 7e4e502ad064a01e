"""Sliding-window layers: KV bytes per sequence, auto-capacity admission and decode at long context.

Three measurements, each side by side with the same model given full attention everywhere:

1. **KV bytes per sequence** at 4K, 32K and 128K tokens for Gemma-3-shaped models (their published
   layer counts, KV heads, head dims and windows; every sixth layer global): the windowed model keeps
   its global layers in the Main pool (``ceil(S / 64)`` pages) and its local layers in per-row window
   rings (``ceil((W + T - 2) / 64) + 1`` pages each, ``T`` = the rings' step tokens), read off the
   plan (``ninfer_kv.plan_kv_cache``), against the Main pool of the same model with every layer global.
2. **Admission**: how many concurrent 32K sequences ``kv_capacity="auto"`` admits with ``F`` free bytes
   (the engine's plan, ``ninfer_kv.engine.capacity.engine_plan``: ``M`` Main pages from the capacity
   curve, each 32K sequence reserving ``512`` of them; with rings, the rows sized so that each holds
   a 32K sequence, since a row's rings are paid whether it is busy or not).
3. **Decode at 32K** on the FFI (this CPU): one decode step of a 5:1 stack (one global layer, five
   local ones, Gemma-3-4B's attention shapes: 8 query heads, 4 KV heads, head dim 256, window 1024)
   through the step API (``begin_step`` / jitted ``attention`` per layer / ``end_step``), the sequence
   filled to 32K tokens first; against the same six layers all global.  The time is the whole step's
   wall time (host bookkeeping included), median of the repeats; only the attention's KV work differs
   between the two, so the figure is the attention part of a model step (products of a real model add
   the same time to both).

Usage::

    PYTHONPATH=. python bench/bench_windows.py            # all three (decode needs ~1.2 GiB)
    PYTHONPATH=. python bench/bench_windows.py --quick    # smaller decode context (8K)
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ninfer_kv import KVStore, allocate_state, attention, begin_step, end_step, ops  # noqa: E402
from ninfer_kv.engine.capacity import engine_plan  # noqa: E402
from ninfer_kv.planning import ExplicitCapacity, ModelKVConfig, WindowRings, plan_kv_cache  # noqa: E402
from ninfer_kv.schema.geometry import PAGE_SIZE as P  # noqa: E402

# (name, layers, KV heads, head dim, window): Gemma 3's published text configs, every sixth layer global
GEMMA3 = (("Gemma-3-1B", 26, 1, 256, 512), ("Gemma-3-4B", 34, 4, 256, 1024), ("Gemma-3-27B", 62, 16, 128, 1024))


def split(layers: int) -> tuple[int, int]:
    """(global, local) layers of a 5:1 pattern (layer i is global when (i + 1) % 6 == 0)."""
    glob = sum(1 for i in range(layers) if (i + 1) % 6 == 0)
    return glob, layers - glob


def windowed_config(layers, heads, dim, window, step_tokens) -> ModelKVConfig:
    glob, local = split(layers)
    return ModelKVConfig(glob, heads, dim, "bf16", rings=WindowRings(local, window, step_tokens))


def bytes_per_sequence(kv: ModelKVConfig, context: int) -> int:
    """Device bytes one sequence of ``context`` tokens holds: its Main pages and, with rings, its row's rings."""
    plan = plan_kv_cache(kv, max_context=context, max_concurrency=1, policy=ExplicitCapacity(context))
    main = plan.pools[next(iter(plan.pools))].page_bytes * -(-context // P)
    return main + (plan.rings.row_bytes if plan.rings is not None else 0)


def fmt(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def part_bytes(step_tokens: int) -> None:
    print(f"1. KV bytes per sequence (bf16; ring step tokens T = {step_tokens})")
    print(f"   {'model':<13}{'context':>8}{'windowed':>12}{'full':>12}{'ratio':>8}")
    for name, layers, heads, dim, window in GEMMA3:
        for context in (4096, 32768, 131072):
            win = bytes_per_sequence(windowed_config(layers, heads, dim, window, step_tokens), context)
            full = bytes_per_sequence(ModelKVConfig(layers, heads, dim, "bf16"), context)
            print(f"   {name:<13}{context:>8}{fmt(win):>12}{fmt(full):>12}{win / full:>8.3f}")


def part_admission(free: int, rows: int, step_tokens: int) -> None:
    context = 32768
    print(f"\n2. kv_capacity='auto' with F = {fmt(free)} free, max_num_seqs = {rows}, max_model_len = {context}")
    print("   windowed: rings only (prefix caching off), and with one ring snapshot slot per row (LLM's default)")
    print(f"   {'model':<13}{'plan':<12}{'rows':>6}{'Main pages M':>14}{'rings':>12}{'32K seqs admitted':>19}"
          f"{'vs full':>9}")
    for name, layers, heads, dim, window in GEMMA3:
        full = engine_plan(ModelKVConfig(layers, heads, dim, "bf16"), max_model_len=context, max_num_seqs=rows,
                           free_bytes=free)
        full_admitted = min(full.max_concurrency, full.m // (context // P))
        kv = windowed_config(layers, heads, dim, window, step_tokens)
        for label, snapshots in (("rings", False), ("+snapshots", True)):
            plan = engine_plan(kv, max_model_len=context, max_num_seqs=rows, free_bytes=free, ring_snapshots=snapshots)
            admitted = min(plan.max_concurrency, plan.m // (context // P))
            print(f"   {name:<13}{label:<12}{plan.max_concurrency:>6}{plan.m:>14}{fmt(plan.rings.bytes):>12}"
                  f"{admitted:>19}{admitted / full_admitted:>8.1f}x")
        print(f"   {name:<13}{'full':<12}{full.max_concurrency:>6}{full.m:>14}{'-':>12}{full_admitted:>19}{'1.0x':>9}")


def _fill(store, state, handle, context: int, step: int, layers_main: int, ring_layers: int, heads: int, dim: int):
    """Write ``context`` tokens of random K/V into every layer (appends only), committed."""
    rng = np.random.default_rng(0)
    kv = jnp.asarray(rng.standard_normal((1, step, heads, dim), np.float32).astype(jnp.bfloat16))

    @functools.partial(jax.jit, donate_argnums=0)
    def append(state, batch, k):
        from ninfer_kv import apply_work

        state = apply_work(state, batch.work)
        for layer in range(layers_main):
            view = ops.paged_append(state.view("main", layer), batch.rows, batch.positions, k, k, batch.num_tokens)
            state = state.replace_planes("main", view.planes)
        for layer in range(ring_layers):
            view = ops.paged_append(state.ring_view(layer), batch.rows, batch.positions, k, k, batch.num_tokens)
            state = state.replace_rings(view.planes)
        return state

    for _ in range(context // step):
        state, batch = begin_step(store, state, [handle], step)
        state = append(state, batch, kv)
        end_step(store, batch)
    return state


def decode_time(context: int, windowed: bool, repeats: int, *, heads=4, q_heads=8, dim=256, window=1024,
                step_tokens=512) -> float:
    """Median wall seconds of one decode step (six layers' append + attention) at ``context`` tokens."""
    ring_layers = 5 if windowed else 0
    main_layers = 1 if windowed else 6
    rings = WindowRings(ring_layers, window, step_tokens) if windowed else None
    kv = ModelKVConfig(main_layers, heads, dim, "bf16", rings=rings)
    total = context + repeats + 8
    plan = plan_kv_cache(kv, max_context=total, max_concurrency=1, policy=ExplicitCapacity(total))
    store = KVStore(plan)
    state = allocate_state(store)
    handle = store.activate(context, repeats + 8)
    state = _fill(store, state, handle, context, step_tokens, main_layers, ring_layers, heads, dim)
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((1, 1, q_heads, dim), np.float32).astype(jnp.bfloat16))
    k = jnp.asarray(rng.standard_normal((1, 1, heads, dim), np.float32).astype(jnp.bfloat16))

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, batch, q, k):
        # each layer's inputs depend on the layer before (as in a model): the in-place appends of a
        # stacked plane are then ordered after the attention that reads it, and XLA copies nothing
        for layer in range(6):
            if layer < ring_layers:
                state, out = attention(state, batch, layer, q, k, k, window=window, ring=True)
            else:
                state, out = attention(state, batch, layer - ring_layers, q, k, k)
            q = out.astype(q.dtype)
            k = q[:, :, :heads]
        return state, q

    times = []
    for i in range(repeats + 3):
        t0 = time.perf_counter()
        state, batch = begin_step(store, state, [handle], 1)
        state, out = step(state, batch, q, k)
        out.block_until_ready()
        end_step(store, batch)
        if i >= 3:  # the first steps compile and warm up
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def part_decode(context: int, repeats: int) -> None:
    print(f"\n3. decode step at {context} tokens, FFI (impl auto on this CPU), 5:1 stack "
          f"(8 query heads, 4 KV heads, head dim 256, window 1024), median of {repeats}")
    win = decode_time(context, True, repeats)
    full = decode_time(context, False, repeats)
    print(f"   windowed {win * 1e3:8.2f} ms   full {full * 1e3:8.2f} ms   speed-up {full / win:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="decode at 8K instead of 32K")
    p.add_argument("--free", default=16 * 2**30, type=int, help="free bytes F of part 2 (default 16 GiB)")
    p.add_argument("--rows", default=64, type=int, help="max_num_seqs of part 2 (default 64)")
    p.add_argument("--step-tokens", default=512, type=int, help="the rings' step tokens T (default 512)")
    p.add_argument("--repeats", default=20, type=int)
    args = p.parse_args()
    from machine import describe  # noqa: E402  (bench/machine.py)

    print(describe())
    part_bytes(args.step_tokens)
    part_admission(args.free, args.rows, args.step_tokens)
    part_decode(8192 if args.quick else 32768, args.repeats)


if __name__ == "__main__":
    main()
