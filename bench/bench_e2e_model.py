"""End-to-end decode throughput of the example model: paged KV cache vs a dense contiguous cache.

For each batch size B the same model (default ModelConfig: vocab 512, d_model 256, 4 layers,
8 query heads, 2 KV heads, head dim 128) decodes greedily from a ``--context``-token prompt:

* paged: ``ninfer_kv.models.decoder`` decode step over the Main pool through ``ninfer_kv.ops`` with
  ``--impl`` (default ``auto``: FFI on CPU when built, else the reference with a warning); every
  row's logical blocks map to a random permutation of physical pages; B * ceil(S / 64) pages.
* dense: the usual contiguous cache, one bfloat16 ``(B, H, S, D)`` array per layer, written at
  each row's position and read whole under a causal mask (same capacity S per row).

Both run side by side in one process, in alternating timing rounds (best round of each is
reported, so both see the same machine load); the script prints tokens/s of each, the ratio, the
bytes of each cache and whether both produced the same greedy tokens (expected for ``bf16``;
quantized profiles legitimately diverge from the bfloat16 dense cache).

    PYTHONPATH=. python bench/bench_e2e_model.py --batches 1,8,32 --context 512 --max-context 1024
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ninfer_kv.schema.geometry import PAGE_SIZE, ceil_div  # noqa: E402
from ninfer_kv.models.decoder import (  # noqa: E402
    ModelConfig,
    StepConfig,
    init_dense_cache,
    init_params,
    make_dense_cache_steps,
    make_steps,
    prompt_chunks,
)
from ninfer_kv.ops import resolve_impl  # noqa: E402
from ninfer_kv.ops.views import allocate_planes


def _i32(x) -> np.ndarray:
    return np.asarray(x, np.int32)


def resolved_impl_name(impl: str) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return resolve_impl(impl).name


class PagedRunner:
    """Prefilled paged state of B rows; ``run(n)`` decodes n greedy steps and returns seconds."""

    def __init__(self, steps, params, prompt: np.ndarray, max_context: int, rng):
        b, s0 = prompt.shape
        self.steps, self.params, self.b = steps, params, b
        layout = steps.config.main_layout
        blocks = ceil_div(max_context, PAGE_SIZE)
        self.num_pages = b * blocks
        self.nbytes = layout.buffer_bytes(self.num_pages)
        self.tables = rng.permutation(self.num_pages).reshape(b, blocks).astype(np.int32)  # scattered pages
        self.rows = _i32(np.arange(b))
        planes = allocate_planes(layout, self.num_pages)
        chunk = steps.config.prefill_chunk
        for offset, valid in prompt_chunks(s0, chunk):
            tok = np.zeros((b, chunk), np.int32)
            tok[:, :valid] = prompt[:, offset : offset + valid]
            out = steps.prefill(params, planes, jnp.asarray(self.tables), tok, _i32([offset] * b), _i32([valid] * b), self.rows)
            planes = out.planes
        self.planes, self.tok, self.pos = planes, out.next_tokens, s0
        self.history = [np.asarray(self.tok)]

    def run(self, n: int) -> float:
        jax.block_until_ready(self.tok)
        ones = _i32([1] * self.b)
        t0 = time.perf_counter()
        for _ in range(n):
            out = self.steps.decode(
                self.params, self.planes, jnp.asarray(self.tables), self.tok[:, None], _i32([self.pos] * self.b), ones, self.rows
            )
            self.planes, self.tok, self.pos = out.planes, out.next_tokens, self.pos + 1
        jax.block_until_ready(self.tok)
        dt = time.perf_counter() - t0
        self.history.append(np.asarray(self.tok))
        return dt


class DenseRunner:
    """Prefilled dense contiguous cache of B rows; same ``run(n)`` contract as :class:`PagedRunner`."""

    def __init__(self, dsteps, params, cfg, prompt: np.ndarray, max_context: int):
        b, s0 = prompt.shape
        self.dsteps, self.params, self.b = dsteps, params, b
        cache = init_dense_cache(cfg, b, max_context)
        self.nbytes = cache.nbytes
        self.cache, self.tok = dsteps.prefill(params, cache, jnp.asarray(prompt), jnp.zeros((b,), jnp.int32))
        self.pos = s0
        self.history = [np.asarray(self.tok)]

    def run(self, n: int) -> float:
        jax.block_until_ready(self.tok)
        t0 = time.perf_counter()
        for _ in range(n):
            self.cache, _, self.tok = self.dsteps.decode(
                self.params, self.cache, self.tok[:, None], jnp.full((self.b,), self.pos, jnp.int32)
            )
            self.pos += 1
        jax.block_until_ready(self.tok)
        dt = time.perf_counter() - t0
        self.history.append(np.asarray(self.tok))
        return dt


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens prefilled before timing")
    ap.add_argument("--max-context", type=int, default=1024, help="per-row capacity S of both caches")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps (split over --rounds)")
    ap.add_argument("--rounds", type=int, default=4, help="alternating paged/dense timing rounds")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--impl", default="auto")
    ap.add_argument("--profile", default="bf16")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.context + args.warmup + args.steps > args.max_context:
        ap.error("context + warmup + steps must not exceed max-context")

    cfg = ModelConfig()
    params = init_params(cfg, args.seed)
    steps = make_steps(StepConfig(model=cfg, profile=args.profile, impl=args.impl))
    dsteps = make_dense_cache_steps(cfg)
    rng = np.random.default_rng(args.seed)
    print(
        f"model: {cfg}\nbackend: {jax.default_backend()}  impl={args.impl} -> ran {resolved_impl_name(args.impl)!r}  "
        f"profile={args.profile}  context={args.context}  capacity={args.max_context}  steps={args.steps}"
    )
    print(f"{'B':>4} {'paged tok/s':>12} {'dense tok/s':>12} {'paged/dense':>12} {'paged MiB':>10} {'dense MiB':>10} {'same tokens':>12}")
    for b in (int(x) for x in args.batches.split(",")):
        prompt = rng.integers(0, cfg.vocab_size, (b, args.context)).astype(np.int32)
        paged = PagedRunner(steps, params, prompt, args.max_context, rng)
        dense = DenseRunner(dsteps, params, cfg, prompt, args.max_context)
        paged.run(args.warmup)
        dense.run(args.warmup)
        # Alternate rounds so both variants see the same machine load; keep each one's best round.
        per_round = max(1, args.steps // args.rounds)
        p_best = d_best = float("inf")
        for _ in range(args.rounds):
            p_best = min(p_best, paged.run(per_round))
            d_best = min(d_best, dense.run(per_round))
        p_tps, d_tps = b * per_round / p_best, b * per_round / d_best
        same = all(np.array_equal(x, y) for x, y in zip(paged.history, dense.history))
        print(
            f"{b:>4} {p_tps:>12.1f} {d_tps:>12.1f} {p_tps / d_tps:>12.2f} {paged.nbytes / 2**20:>10.1f} "
            f"{dense.nbytes / 2**20:>10.1f} {'yes' if same else 'no':>12}"
        )
    print(f"compiles: {steps.compiles()}")


if __name__ == "__main__":
    main()
