"""A ragged round against its rectangular parts, side by side in one run.

Qwen3-0.6B shapes (random bfloat16 weights, packed once as the engine packs them), the FFI ops: ``D`` sequences decoding at ``--context``
tokens and one new prompt of ``--chunk`` tokens.  Times (median of ``--iters`` after a warm-up):

* the decodes alone (the decode step, a batch of ``D``);
* the chunk alone (the prefill step, one row of ``--chunk`` tokens);
* the ragged round: the ragged step, ``D`` one-token rows and the chunk in one call, padded to the
  token bucket the engine would take (``ninfer_kv.schema.buckets.token_ladder``) and to
  the batch bucket of ``D + 1`` rows;
* the same ragged step at the exact token count (no padding tokens), for reference;

and the ratio of the ragged round to (decodes alone + chunk alone).  Run:
``python bench/bench_ragged.py [--decodes 8] [--chunk 256] [--context 512]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_products import median_time, qwen3_0_6b  # noqa: E402

from ninfer_kv.models.decoder import StepConfig, init_params, make_steps  # noqa: E402
from ninfer_kv.models.decoder.padding import pad_ragged  # noqa: E402
from ninfer_kv.schema.buckets import bucket_for, bucket_ladder, token_ladder  # noqa: E402
from ninfer_kv.ops.views import allocate_planes  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--decodes", type=int, default=8, help="decoding sequences (default 8)")
    p.add_argument("--chunk", type=int, default=256, help="prompt tokens of the new sequence (default 256)")
    p.add_argument("--context", type=int, default=512, help="tokens each decoding sequence holds (default 512)")
    p.add_argument("--iters", type=int, default=5, help="timed repetitions per case (default 5)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="the engine's round budget")
    args = p.parse_args(argv)
    d, chunk, ctx = args.decodes, args.chunk, args.context
    if chunk % 64:
        p.error(f"--chunk {chunk} must be a multiple of 64 (the prefill step's chunk)")
    cfg = qwen3_0_6b()
    rows = d + 1
    batch = bucket_ladder(max(rows, 2), 2)
    tokens_total = d + chunk
    ladder = token_ladder(args.max_num_batched_tokens)
    bucket = bucket_for(tokens_total, ladder)
    exact = tuple(sorted({bucket, tokens_total}))
    steps = make_steps(StepConfig(model=cfg, impl="ffi", prefill_chunk=chunk, batch_buckets=batch, token_buckets=exact))
    params = steps.prepare_params(init_params(cfg, seed=0))  # as the engine runs them (packed weights)
    blocks = -(-(ctx + 1) // 64) + -(-chunk // 64)
    tables = jnp.asarray(np.arange(rows * blocks, dtype=np.int32).reshape(rows, blocks))
    planes = allocate_planes(steps.config.main_layout, rows * blocks)
    i32 = lambda x: jnp.asarray(np.asarray(x, np.int32))  # noqa: E731
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, chunk).astype(np.int32)
    dec_tokens = rng.integers(0, cfg.vocab_size, d).astype(np.int32)
    state = {"planes": planes, "tables": tables}

    def run(step, *a):  # planes and tables are donated: each call takes the previous call's
        out = step(params, state["planes"], state["tables"], *a)
        state["planes"], state["tables"] = out.planes, out.block_tables
        return out.logits

    b_dec = bucket_for(d, batch)
    dec_tok = np.zeros((b_dec, 1), np.int32)
    dec_tok[:d, 0] = dec_tokens
    dec_args = (i32(dec_tok), i32([ctx] * d + [0] * (b_dec - d)), i32([1] * d + [0] * (b_dec - d)),
                i32(list(range(d)) + [0] * (b_dec - d)))
    pre_args = (i32(prompt[None]), i32([0]), i32([chunk]), i32([d]))
    flat = np.concatenate([dec_tokens, prompt])

    def ragged_args(token_bucket):
        pk = pad_ragged(flat, [1] * d + [chunk], [ctx] * d + [0], list(range(rows)), bucket=bucket_for(rows, batch),
                        token_bucket=token_bucket)
        return (i32(pk.tokens), i32(pk.positions), i32(pk.query_starts), i32(pk.table_rows))

    t0 = time.perf_counter()
    jax.block_until_ready(run(steps.ragged, *ragged_args(bucket)))
    t_compile = time.perf_counter() - t0
    t_dec = median_time(lambda: run(steps.decode, *dec_args), args.iters)
    t_pre = median_time(lambda: run(steps.prefill, *pre_args), args.iters)
    t_pk = median_time(lambda: run(steps.ragged, *ragged_args(bucket)), args.iters)
    t_exact = median_time(lambda: run(steps.ragged, *ragged_args(tokens_total)), args.iters) \
        if tokens_total != bucket else t_pk
    parts = t_dec + t_pre
    print(f"  (the ragged step's first call at a new shape, its compile included: {t_compile:.1f} s)")
    print(f"Qwen3-0.6B shapes, FFI ops, {jax.devices()[0].device_kind}; {d} decodes at {ctx} tokens + one "
          f"{chunk}-token prompt ({rows} rows, batch bucket {bucket_for(rows, batch)})")
    print(f"  decodes alone (decode step, batch {b_dec}):        {t_dec * 1e3:8.1f} ms")
    print(f"  chunk alone (prefill step, 1 x {chunk}):            {t_pre * 1e3:8.1f} ms")
    print(f"  sum of the parts:                                  {parts * 1e3:8.1f} ms")
    print(f"  ragged round, token bucket {bucket:5d} (engine's):  {t_pk * 1e3:8.1f} ms   {t_pk / parts:5.3f}x the parts")
    print(f"  ragged round, exact {tokens_total:5d} tokens:          {t_exact * 1e3:8.1f} ms   "
          f"{t_exact / parts:5.3f}x the parts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
