"""Attention accuracy of each KV profile: quantized cache vs unquantized float32 attention.

For every profile and head dim, Gaussian q, k, v (standard normal, float32) are appended to a
paged cache through ``ninfer_kv.ops.paged_append`` (pages in random physical order) and attended
with ``ninfer_kv.ops.paged_attention``; the output is compared with float32 attention over the
original, unquantized k and v:

    rel_l2 = ||out_profile - out_f32|| / ||out_f32||      (over all rows, queries, heads, dims)

Two cases per head dim, both at the end of a ``--context``-token history:

* decode: T = 1 query at position ``context - 1``;
* chunk: T = ``--chunk`` queries at positions ``context - chunk .. context - 1`` (causal).

The per-tensor codec errors ``||k' - k|| / ||k||`` and ``||v' - v|| / ||v||`` are printed beside
them.  The table is Markdown, ready for docs/ACCURACY.md.

``--query-bits 16 8`` adds a second table: what reduced-precision products would add on top of
the codec.  The query is rounded to a symmetric fixed point of that many bits with one scale per
query row (``round(q / s) * s``, ``s = max|q| / (2^(bits-1) - 1)``), as an integer-product kernel
(int16 ``vpmaddwd``, 8-bit ``vpmaddubsw``) would see it, and attended over the same quantized
cache.  Printed: its rel L2 against the float32-query output, and its worst element error in units
of the FFI tests' tolerance (``1e-5 * |ref| + 1e-5 * max|ref|``; above 1 fails them).  Rounding
the probabilities as well would add to this: it is a lower bound on such a kernel's error.

Usage::

    PYTHONPATH=. python bench/accuracy.py                    # impl="reference", 3 head dims
    PYTHONPATH=. python bench/accuracy.py --impl ffi --context 4096
    PYTHONPATH=. python bench/accuracy.py --head-dims 128 --query-bits 16 8
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ninfer_kv import KVProfile, PagedKVStorageLayout, ops  # noqa: E402
from ninfer_kv.ops.reference import attention_over_keys  # noqa: E402
from ninfer_kv.views import PagedKVBatchLayerView  # noqa: E402

P = 64


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def fixed_point(q: np.ndarray, bits: int) -> np.ndarray:
    """q rounded to a symmetric ``bits``-bit fixed point, one scale per row (the last axis)."""
    top = np.abs(q).max(-1, keepdims=True)
    step = np.where(top > 0, top / (2 ** (bits - 1) - 1), 1.0)
    return (np.round(q / step) * step).astype(np.float32)


def tolerance_units(got, ref) -> float:
    """Worst |got - ref| / (1e-5 * |ref| + 1e-5 * max|ref|): the FFI tests' float32 tolerance."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float((np.abs(got - ref) / (1e-5 * np.abs(ref) + 1e-5 * np.abs(ref).max())).max())


def measure(profile: KVProfile, head_dim: int, *, impl: str, context: int, chunk: int, batch: int, kv_heads: int,
            group: int, seed: int, query_bits: tuple[int, ...] = ()) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    layout = PagedKVStorageLayout(profile, num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim)
    blocks = -(-context // P)
    num_pages = batch * blocks
    tables = rng.permutation(num_pages).reshape(batch, blocks).astype(np.int32)
    k = rng.standard_normal((batch, context, kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((batch, context, kv_heads, head_dim)).astype(np.float32)
    view = PagedKVBatchLayerView(layout.allocate(num_pages), jnp.asarray(tables), 0, layout)
    rows = jnp.arange(batch, dtype=jnp.int32)
    zeros = jnp.zeros((batch,), jnp.int32)
    full = jnp.full((batch,), context, jnp.int32)

    append = jax.jit(lambda view, k, v: ops.paged_append(view, rows, zeros, k, v, full, impl=impl), donate_argnums=0)
    view = append(view, jnp.asarray(k), jnp.asarray(v))

    out = {}
    for case, t in (("decode", 1), ("chunk", chunk)):
        q = rng.standard_normal((batch, t, kv_heads * group, head_dim)).astype(np.float32)
        positions = jnp.full((batch,), context - t, jnp.int32)
        attend = jax.jit(lambda q, view, pos: ops.paged_attention(q, view, rows, pos, full, impl=impl))
        got = attend(jnp.asarray(q), view, positions)
        qpos = (context - t) + np.arange(t)
        visible = np.broadcast_to(np.arange(context)[None, None, :] <= qpos[None, :, None], (batch, t, context))
        want = attention_over_keys(
            jnp.asarray(q), jnp.asarray(k.transpose(0, 2, 1, 3)), jnp.asarray(v.transpose(0, 2, 1, 3)),
            jnp.asarray(visible), 1.0 / head_dim**0.5,
        )
        out[case] = _rel(got, want)
        for bits in query_bits:
            rounded = attend(jnp.asarray(fixed_point(q, bits)), view, positions)
            out[f"{case}/q{bits}"] = _rel(rounded, got)
            out[f"{case}/q{bits}/tol"] = tolerance_units(rounded, got)

    # codec error of the stored K and V (read back through the reference's dequantization)
    from ninfer_kv import codecs

    kq, vq = jax.jit(lambda a, b: codecs.codec_roundtrip(profile, a, b))(jnp.asarray(k), jnp.asarray(v))
    out["k"], out["v"] = _rel(kq, k), _rel(vq, v)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", default="reference", help="auto | pallas | ffi | reference")
    parser.add_argument("--context", type=int, default=1024, help="history length in tokens")
    parser.add_argument("--chunk", type=int, default=64, help="queries of the chunk case")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--group", type=int, default=4, help="query heads per KV head (GQA)")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--query-bits", type=int, nargs="*", default=[], choices=range(2, 25), metavar="BITS",
                        help="also attend with the query rounded to BITS-bit fixed point (e.g. 16 8); 2..24")
    args = parser.parse_args()

    start = time.perf_counter()
    print(
        f"impl={args.impl} (resolved: {ops.resolve_impl(args.impl).name}), backend={jax.default_backend()}, "
        f"context={args.context}, chunk T={args.chunk}, B={args.batch}, H={args.kv_heads}, "
        f"Hq={args.kv_heads * args.group}, q/k/v ~ N(0, 1) float32, seed={args.seed}\n"
    )
    print("| profile | D | decode rel L2 | chunk rel L2 | K codec rel L2 | V codec rel L2 |")
    print("|---|---:|---:|---:|---:|---:|")
    bits = tuple(args.query_bits)
    results = []
    for profile in KVProfile:
        for d in args.head_dims:
            r = measure(profile, d, impl=args.impl, context=args.context, chunk=args.chunk, batch=args.batch,
                        kv_heads=args.kv_heads, group=args.group, seed=args.seed, query_bits=bits)
            results.append((profile, d, r))
            print(f"| {profile.value} | {d} | {r['decode']:.2e} | {r['chunk']:.2e} | {r['k']:.2e} | {r['v']:.2e} |",
                  flush=True)
    if bits:
        print("\nquery rounded to fixed point (one scale per row), against the float32-query output of the same cache:\n")
        print("| profile | D | query bits | decode rel L2 | decode x test tolerance | chunk rel L2 "
              "| chunk x test tolerance | codec's own decode rel L2 |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for profile, d, r in results:
            for b in bits:
                print(f"| {profile.value} | {d} | {b} | {r[f'decode/q{b}']:.2e} | {r[f'decode/q{b}/tol']:.1f} "
                      f"| {r[f'chunk/q{b}']:.2e} | {r[f'chunk/q{b}/tol']:.1f} | {r['decode']:.2e} |")
    print(f"\n({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
