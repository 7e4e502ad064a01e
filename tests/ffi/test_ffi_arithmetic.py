"""The products of the FFI attention kernels: which arithmetic each profile uses, its tolerance, its error.

The kernels multiply in float32, except NVFP4 keys on the levels with AVX-512 VNNI (``avx512vnni``),
whose scores use ``int8x2``: each query row rounded to 15 bits (``|q16| <= 16383``, one step per
row) and split into two signed bytes for ``vpdpbusd`` (``ffi/src/int_scores.h``).  These tests run
at the level this process loaded (``tests/ffi/test_ffi_levels.py`` runs every level):

* float32 paths keep the float32 tolerance: ``|got - oracle| <= 2e-5 + 2e-5 * |oracle|``
  elementwise against a float64 oracle over the same quantized cache;
* int8x2 paths are held to a bound derived from the rounding itself: a query element moves by at
  most ``step / 2 = max|q_row| / 32766``, so a score moves by at most
  ``ds = sm_scale * max|q_row| / 32766 * max_j sum_i |k_ji|``, and a softmax-weighted average of
  values moves by at most ``2 * ds * max|v|`` (first order; ``ds`` is ~1e-4 here, so the second
  order is far below the float32 tolerance added on top).  Their relative L2 error must also stay
  below 2e-4 (the rounding gives about 5e-5, docs/ACCURACY.md);
* whatever the arithmetic, the error it adds (relative L2 against the float64 oracle over the
  quantized cache) is at most a tenth of the codec's own error (relative L2 of that oracle against
  float64 attention over the unquantized K and V), on a small case of docs/ACCURACY.md's kind.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ninfer_kv.ops import codecs
from ninfer_kv.ops.ffi import kv as ffi_kv
from ninfer_kv.ops.ffi import handlers as ffi_handlers
from ninfer_kv.schema.profiles import KVProfile
from ninfer_kv.schema.layout import PagedKVStorageLayout
from ninfer_kv.ops.views import PagedKVBatchLayerView
from ninfer_kv.ops.views import allocate_planes

pytestmark = pytest.mark.skipif(not ffi_handlers.is_available(), reason=f"FFI library unavailable: {ffi_handlers.load_error()}")

P = 64
PROFILES = tuple(p.value for p in KVProfile)
FLOAT32_TOL = 2e-5  # float32 products: only the summation order differs from the float64 oracle
INT8X2_REL_L2 = 2e-4  # the int8x2 rounding gives ~5e-5 relative L2 on Gaussian data (docs/ACCURACY.md)
QUERY_MAX = 16383  # |q16| bound of the int8x2 queries (ffi/src/int_scores.h)

_append = jax.jit(ffi_kv.paged_append)
_attend = jax.jit(ffi_kv.paged_attention, static_argnames="sm_scale")
_roundtrip = jax.jit(codecs.codec_roundtrip, static_argnums=0)


def _int8x2_level() -> bool:
    """Whether the level in use takes int8x2 products for NVFP4 keys (AVX-512 VNNI and VBMI)."""
    info = ffi_handlers.info()
    if info.isa == "avx512vnni":
        return True
    return info.isa == "native" and {"avx512vnni", "avx512vbmi", "avx512bw"} <= set(info.cpu_features)


def _cache(profile: str, k: np.ndarray, v: np.ndarray, rng):
    """k, v ``(B, S, H, D)`` appended by the FFI into shuffled pages; the view and the dequantized
    K and V (float64, exactly what the planes hold)."""
    b, s, h, d = k.shape
    blocks = -(-s // P)
    lay = PagedKVStorageLayout(profile, 1, h, d, "page-major")
    tables = rng.permutation(b * blocks).reshape(b, blocks).astype(np.int32)
    view = PagedKVBatchLayerView(allocate_planes(lay, b * blocks), jnp.asarray(tables), 0, lay)
    rows = jnp.arange(b, dtype=jnp.int32)
    view = _append(view, rows, jnp.zeros((b,), jnp.int32), jnp.asarray(k), jnp.asarray(v), jnp.full((b,), s, jnp.int32))
    kq, vq = _roundtrip(KVProfile(profile), jnp.asarray(k), jnp.asarray(v))
    return view, np.asarray(kq, np.float64), np.asarray(vq, np.float64)


def _oracle(q, k, v, positions, kv_lens, sm_scale):
    """float64 causal GQA attention: query t of row b sees keys j <= min(positions[b] + t, kv_lens[b] - 1)."""
    q = np.asarray(q, np.float64)
    b_, t_, hq, d = q.shape
    g = hq // k.shape[2]
    out = np.zeros(q.shape)
    for b in range(b_):
        for t in range(t_):
            hi = min(int(positions[b]) + t, int(kv_lens[b]) - 1)
            if hi < 0:
                continue
            for h in range(hq):
                s = sm_scale * (k[b, : hi + 1, h // g] @ q[b, t, h])
                p = np.exp(s - s.max())
                out[b, t, h] = p @ v[b, : hi + 1, h // g] / p.sum()
    return out


def _run(profile: str, *, batch=2, context=200, heads=2, group=4, t=1, head_dim=64, seed=0, scale_q=1.0,
         q_dtype=np.float32):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((batch, context, heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((batch, context, heads, head_dim)).astype(np.float32)
    view, kq, vq = _cache(profile, k, v, rng)
    q = (scale_q * rng.standard_normal((batch, t, heads * group, head_dim))).astype(q_dtype).astype(np.float32)
    positions = np.array([context - t - 3 * i for i in range(batch)], np.int32)
    kv_lens = np.full((batch,), context, np.int32)
    sm_scale = 1.0 / np.sqrt(head_dim)
    got = np.asarray(_attend(jnp.asarray(q), view, jnp.arange(batch, dtype=jnp.int32), jnp.asarray(positions),
                             jnp.asarray(kv_lens)), np.float64)
    return dict(q=q, k=k, v=v, kq=kq, vq=vq, got=got, want=_oracle(q, kq, vq, positions, kv_lens, sm_scale),
                exact=_oracle(q, k, v, positions, kv_lens, sm_scale), sm_scale=sm_scale, group=group)


def _rel_l2(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def int8x2_bound(q, k, v, sm_scale: float) -> np.ndarray:
    """Per (row, query, head) bound of what the int8x2 rounding of q can move the attention output
    (module docstring): q ``(B, T, Hq, D)``, the dequantized k, v ``(B, S, H, D)`` (all keys, a
    superset of those any query sees); broadcastable against the output."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    out = np.zeros(q.shape[:3] + (1,))
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            ksum = np.abs(k[b, :, h // g]).sum(-1).max()
            vmax = np.abs(v[b, :, h // g]).max()
            step = np.abs(q[b, :, h]).max(-1) / (2 * QUERY_MAX)  # per query position t
            out[b, :, h, 0] = 2 * sm_scale * step * ksum * vmax
    return out


def _check_tolerance(profile: str, r, head_dim: int) -> None:
    got, want = r["got"], r["want"]
    assert np.isfinite(got).all()
    ar = ffi_handlers.arithmetic(profile, head_dim)
    if ar.reduced:
        assert ar == ffi_handlers.Arithmetic("int8x2", "float32"), ar
        bound = int8x2_bound(r["q"], r["kq"], r["vq"], r["sm_scale"]) + FLOAT32_TOL * (1 + np.abs(want))
        worst = float((np.abs(got - want) / bound).max())
        assert worst <= 1.0, f"{profile} D={head_dim}: error {worst:.2f} x the int8x2 rounding bound"
        assert _rel_l2(got, want) <= INT8X2_REL_L2, _rel_l2(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=FLOAT32_TOL, atol=FLOAT32_TOL, err_msg=f"{profile} D={head_dim}")


def test_each_profile_reports_its_arithmetic():
    """float32 everywhere, except NVFP4 keys' scores at the VNNI level (head dims up to 256)."""
    vnni = _int8x2_level()
    for profile in PROFILES:
        for d in (64, 128, 256, 512):
            ar = ffi_handlers.arithmetic(profile, d)
            nvfp4_keys = KVProfile(profile).k_codec.value == "nvfp4-g16"
            want_scores = "int8x2" if (vnni and nvfp4_keys and d <= 256) else "float32"
            assert ar == ffi_handlers.Arithmetic(want_scores, "float32"), (profile, d, ar)
            assert ar.reduced == (want_scores != "float32")
    with pytest.raises(ValueError):
        ffi_handlers.arithmetic("bf16", 0)


@pytest.mark.parametrize("profile", PROFILES)
def test_attention_within_the_tolerance_of_its_arithmetic(profile):
    r = _run(profile, t=3, seed=1)
    _check_tolerance(profile, r, 64)


@pytest.mark.parametrize(("head_dim", "group", "t"), [(64, 4, 1), (128, 2, 9), (128, 1, 2), (256, 8, 3), (48, 2, 4)])
def test_bfloat16_queries_on_bf16_keys_keep_the_float32_tolerance(head_dim, group, t):
    """Queries holding bfloat16 values (a model's) against BF16 keys take VDPBF16PS where the CPU has
    AVX512_BF16 (head dims a multiple of 32): exact products and float32 sums, so the float32
    tolerance; 1 to 18 query rows per task, and a head dim that keeps the float32 path."""
    r = _run("bf16", batch=2, context=131, heads=2, group=group, t=t, head_dim=head_dim, seed=head_dim + t,
             q_dtype=ml_dtypes.bfloat16)
    _check_tolerance("bf16", r, head_dim)


@pytest.mark.parametrize(("head_dim", "group", "t"), [(16, 1, 1), (48, 3, 2), (128, 8, 1), (256, 2, 5)])
def test_nvfp4_shapes_within_the_tolerance_of_their_arithmetic(head_dim, group, t):
    """Head dims of one to sixteen 16-dim groups, partial 16-key blocks, 1 to 16 query rows per task."""
    r = _run("nvfp4-g16", batch=2, context=83, heads=1, group=group, t=t, head_dim=head_dim, seed=head_dim)
    _check_tolerance("nvfp4-g16", r, head_dim)


def test_nvfp4_large_and_zero_queries():
    """Query rows of magnitude 1e4 and of zeros: the per-row step follows the row (zeros stay exact)."""
    r = _run("nvfp4-g16", t=2, scale_q=1e4, seed=5)
    _check_tolerance("nvfp4-g16", r, 64)
    rng = np.random.default_rng(6)
    k = rng.standard_normal((1, 70, 1, 64)).astype(np.float32)
    view, kq, vq = _cache("nvfp4-g16", k, k, rng)
    q = np.zeros((1, 1, 4, 64), np.float32)
    got = np.asarray(_attend(jnp.asarray(q), view, jnp.zeros((1,), jnp.int32), jnp.asarray([69], jnp.int32),
                             jnp.asarray([70], jnp.int32)))
    np.testing.assert_allclose(got[0, 0], np.broadcast_to(vq[0, :, 0].mean(0), (4, 64)), rtol=1e-5, atol=1e-6)


def test_nvfp4_nan_scales_and_queries_follow_the_reference():
    """A NaN K scale (e4m3 0x7F) reaches exactly the rows that see its key (that run takes float32),
    and a query with an infinite element turns its own output into NaN, as in the reference."""
    from ninfer_kv.ops import reference

    rng = np.random.default_rng(7)
    k = rng.standard_normal((2, 130, 1, 64)).astype(np.float32)
    view, _, _ = _cache("nvfp4-g16", k, k, rng)
    scale = np.asarray(view.planes["k_scale"]).copy()
    page = int(np.asarray(view.block_tables)[0, 1])
    scale[0, page, 0, 10, 2] = 0x7F  # batch row 0, key 74, group 2
    view = view.replace(planes={**view.planes, "k_scale": jnp.asarray(scale)})
    q = rng.standard_normal((2, 2, 4, 64)).astype(np.float32)
    q[1, 1, 2, 7] = np.inf
    args = (jnp.asarray(q), view, jnp.arange(2, dtype=jnp.int32), jnp.asarray([73, 120], jnp.int32),
            jnp.asarray([130, 130], jnp.int32))
    got = np.asarray(_attend(*args))
    want = np.asarray(jax.jit(reference.paged_attention_reference)(*args))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(got[0, 1]).all() and not np.isnan(got[0, 0]).any()  # only position 74 sees key 74
    assert np.isnan(got[1, 1, 2]).all() and not np.isnan(got[1, 1, 3]).any()
    finite = ~np.isnan(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("profile", PROFILES)
def test_added_error_is_at_most_a_tenth_of_the_codec_error(profile):
    """docs/ACCURACY.md's kind of case, smaller: Gaussian q, k, v; decode and a 16-query chunk at the
    end of a 512-token history, D = 128, GQA 4."""
    for t in (1, 16):
        r = _run(profile, batch=2, context=512, heads=2, group=4, t=t, head_dim=128, seed=11 + t)
        codec = _rel_l2(r["want"], r["exact"])
        added = _rel_l2(r["got"], r["want"])
        assert added <= 0.1 * codec, f"{profile} T={t}: added {added:.2e} > a tenth of the codec's {codec:.2e}"
