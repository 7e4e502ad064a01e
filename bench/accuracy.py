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

With ``--impl ffi`` (or ``auto`` on a CPU) a further table reports the error the kernel's own
arithmetic adds (``ninfer_kv.ops.ffi.handlers.arithmetic``: float32, or the ``int8x2`` products of NVFP4 keys
at the ``avx512vnni`` level): the relative L2 of the FFI output against a float64 oracle over the
same quantized cache, next to the codec's own error (that oracle against float64 attention over the
unquantized k and v) and their ratio, which the kernels keep at or below 0.1.

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
    PYTHONPATH=. python bench/accuracy.py --impl ffi --head-dims 128     # + the kernel's added error
    NINFER_KV_FFI_ISA=avx2 PYTHONPATH=. python bench/accuracy.py --impl ffi --head-dims 128   # one level
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ninfer_kv import ops  # noqa: E402
from ninfer_kv.schema.profiles import KVProfile  # noqa: E402
from ninfer_kv.schema.layout import PagedKVStorageLayout  # noqa: E402
from ninfer_kv.ops.reference import attention_over_keys  # noqa: E402
from ninfer_kv.ops.views import PagedKVBatchLayerView  # noqa: E402
from ninfer_kv.ops.views import allocate_planes

P = 64


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def fixed_point(q: np.ndarray, bits: int) -> np.ndarray:
    """q rounded to a symmetric ``bits``-bit fixed point, one scale per row (the last axis)."""
    top = np.abs(q).max(-1, keepdims=True)
    step = np.where(top > 0, top / (2 ** (bits - 1) - 1), 1.0)
    return (np.round(q / step) * step).astype(np.float32)


def oracle64(q: np.ndarray, k: np.ndarray, v: np.ndarray, visible: np.ndarray, sm_scale: float) -> np.ndarray:
    """float64 GQA attention: q ``(B, T, Hq, D)``, k, v ``(B, S, H, D)``, visible ``(B, T, S)``."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    kh = np.repeat(k, g, axis=2)  # (B, S, Hq, D)
    vh = np.repeat(v, g, axis=2)
    s = np.einsum("bthd,bshd->bhts", q, kh) * sm_scale
    s = np.where(visible[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", p, vh)


def tolerance_units(got, ref) -> float:
    """Worst |got - ref| / (1e-5 * |ref| + 1e-5 * max|ref|): the FFI tests' float32 tolerance."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float((np.abs(got - ref) / (1e-5 * np.abs(ref) + 1e-5 * np.abs(ref).max())).max())


def measure(profile: KVProfile, head_dim: int, *, impl: str, context: int, chunk: int, batch: int, kv_heads: int,
            group: int, seed: int, query_bits: tuple[int, ...] = (), added: bool = False) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    layout = PagedKVStorageLayout(profile, num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim)
    blocks = -(-context // P)
    num_pages = batch * blocks
    tables = rng.permutation(num_pages).reshape(batch, blocks).astype(np.int32)
    k = rng.standard_normal((batch, context, kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((batch, context, kv_heads, head_dim)).astype(np.float32)
    view = PagedKVBatchLayerView(allocate_planes(layout, num_pages), jnp.asarray(tables), 0, layout)
    rows = jnp.arange(batch, dtype=jnp.int32)
    zeros = jnp.zeros((batch,), jnp.int32)
    full = jnp.full((batch,), context, jnp.int32)

    append = jax.jit(lambda view, k, v: ops.paged_append(view, rows, zeros, k, v, full, impl=impl), donate_argnums=0)
    view = append(view, jnp.asarray(k), jnp.asarray(v))

    out = {}
    if added:  # the exactly dequantized cache (the planes' values), for the float64 oracles
        from ninfer_kv.ops import codecs

        kq64, vq64 = (np.asarray(x, np.float64) for x in
                      jax.jit(lambda a, b: codecs.codec_roundtrip(profile, a, b))(jnp.asarray(k), jnp.asarray(v)))
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
        if added:
            scale = 1.0 / head_dim**0.5
            quantized = oracle64(q, kq64, vq64, visible, scale)
            out[f"{case}/added"] = _rel(got, quantized)
            out[f"{case}/codec64"] = _rel(quantized, oracle64(q, k, v, visible, scale))
        for bits in query_bits:
            rounded = attend(jnp.asarray(fixed_point(q, bits)), view, positions)
            out[f"{case}/q{bits}"] = _rel(rounded, got)
            out[f"{case}/q{bits}/tol"] = tolerance_units(rounded, got)

    # codec error of the stored K and V (read back through the reference's dequantization)
    from ninfer_kv.ops import codecs

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
    added = ops.resolve_impl(args.impl).name == "ffi"
    results = []
    for profile in KVProfile:
        for d in args.head_dims:
            r = measure(profile, d, impl=args.impl, context=args.context, chunk=args.chunk, batch=args.batch,
                        kv_heads=args.kv_heads, group=args.group, seed=args.seed, query_bits=bits, added=added)
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
    if added:
        from ninfer_kv.ops.ffi import handlers as ffi_handlers

        print(f"\nerror the FFI kernel's arithmetic adds ({ffi_handlers.info().summary()}): relative L2 against a "
              "float64 oracle over the same quantized cache, and the codec's own error (that oracle against "
              "float64 attention over the unquantized k, v):\n")
        print("| profile | D | arithmetic (scores / values) | decode added | chunk added | codec decode rel L2 "
              "| codec chunk rel L2 | added / codec (worst) |")
        print("|---|---:|---|---:|---:|---:|---:|---:|")
        for profile, d, r in results:
            ar = ffi_handlers.arithmetic(profile, d)
            worst = max(r["decode/added"] / r["decode/codec64"], r["chunk/added"] / r["chunk/codec64"])
            print(f"| {profile.value} | {d} | {ar.scores} / {ar.values} | {r['decode/added']:.2e} | {r['chunk/added']:.2e} "
                  f"| {r['decode/codec64']:.2e} | {r['chunk/codec64']:.2e} | {worst:.1e} |")
    print(f"\n({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
