"""The jnp codecs are bit-identical to the independent numpy oracle (tests/conformance/np_codecs.py)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ninfer_kv.ops import codecs
from ninfer_kv.schema.profiles import KVCodec, KVProfile

from tests.conformance import np_codecs

HEAD_DIMS = (64, 128, 256)
CODECS = list(KVCodec)


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def assert_bits_equal(actual, expected, what=""):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    bad = _bits(actual) != _bits(expected)
    if np.issubdtype(actual.dtype, np.floating) or actual.dtype in (np_codecs.BF16, np_codecs.E4M3):
        both_nan = np.isnan(actual.astype(np.float32)) & np.isnan(expected.astype(np.float32))
        bad &= ~both_nan
    if bad.any():
        i = tuple(int(j) for j in np.argwhere(bad)[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} elements differ; first at {i}: "
            f"{actual[i]!r} (bits {_bits(actual)[i]:#x}) != {expected[i]!r} (bits {_bits(expected)[i]:#x})"
        )


# -- inputs --------------------------------------------------------------------------------------


def _many_magnitudes(rng, rows, d, group):
    """Gaussian groups, each scaled by 10**e for e in [-20, 20], some groups zero, some -0.0."""
    x = rng.standard_normal((rows, d)).astype(np.float32)
    ng = d // group
    mag = (10.0 ** rng.integers(-20, 21, size=(rows, ng))).astype(np.float32)
    x = (x.reshape(rows, ng, group) * mag[..., None]).reshape(rows, d)
    g = x.reshape(rows, ng, group)
    g[0] = 0.0  # an all-zero row
    g[1, :] = -0.0  # all negative zero
    g[2, ::2] = 0.0  # zero groups inside a row
    x = g.reshape(rows, d)
    x[3, ::3] = -0.0  # scattered negative zeros
    return x


def _e2m1_ties(d):
    """Groups of 16 with amax = 6 * 2**e (exact e4m3 scale 2**e) holding every e2m1 tie."""
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    base = np.concatenate([[6.0], ties, -ties, [-0.0]]).astype(np.float32)  # 16 values
    rows = []
    for e in range(-9, 7):  # 2**-9 .. 2**-7: subnormal e4m3 scales; up to 2**6
        rows.append(np.tile(base * np.float32(2.0**e), d // 16))
    return np.stack(rows).astype(np.float32)


def _int8_ties(d):
    """amax = 127 * 2**e gives s = 2**e exactly; x / s = k + 0.5 are exact rint ties."""
    rows = []
    for e in (-6, 0, 5):
        vals = np.resize(np.arange(-126.5, 127.0, 1.0, dtype=np.float32), d)
        vals[0] = 127.0
        rows.append(vals * np.float32(2.0**e))
    return np.stack(rows).astype(np.float32)


def _pre_clip_overflow(rng, d, codec):
    """Rows whose scale rounds down, so that max |x / s| exceeds the code range before the clip."""
    limit = {KVCodec.FP8_E4M3FN_ROW: 448.0, KVCodec.NVFP4_G16: 6.0, KVCodec.INT8_G64: 127.0}[codec]
    group = {KVCodec.FP8_E4M3FN_ROW: d, KVCodec.NVFP4_G16: 16, KVCodec.INT8_G64: 64}[codec]
    out = []
    while len(out) < 8:
        row = rng.standard_normal(d).astype(np.float32) * np.float32(10.0 ** rng.integers(-3, 4))
        code, scale = np_codecs.encode(codec.value, row)
        s = scale.view(np_codecs.E4M3).astype(np.float32) if codec is KVCodec.NVFP4_G16 else scale.astype(np.float32)
        y = np.abs(row.reshape(-1, group)) / np.where(s == 0, 1, s).reshape(-1, 1)
        if (y.max(axis=1) > limit).any():
            out.append(row)
    if codec is KVCodec.NVFP4_G16:  # amax / 6 above 448: the scale saturates at 448
        out.append(np.full(d, 5000.0, np.float32) * np.where(np.arange(d) % 2, 1, -1).astype(np.float32))
    return np.stack(out)


def _cases(codec, d, seed):
    rng = np.random.default_rng(seed)
    group = {KVCodec.BF16: 16, KVCodec.INT8_G64: 64, KVCodec.FP8_E4M3FN_ROW: d, KVCodec.NVFP4_G16: 16}[codec]
    parts = [_many_magnitudes(rng, 16, d, group), _e2m1_ties(d), _int8_ties(d)]
    if codec is not KVCodec.BF16:
        parts.append(_pre_clip_overflow(rng, d, codec))
    return np.concatenate(parts).astype(np.float32)


# -- tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec,d", [
    pytest.param(c, d, id=f"{c.value}-{d}", marks=() if d == 64 or (c is KVCodec.FP8_E4M3FN_ROW and d == 256) else (pytest.mark.slow,))
    for c in CODECS for d in HEAD_DIMS
])  # D = 64 for every codec and the FP8 row of 256 by default; the other head dims are marked slow
def test_quantize_bit_identical_to_numpy(codec, d):
    x = _cases(codec, d, seed=d)
    want_code, want_scale = np_codecs.encode(codec.value, x)
    code, scale = jax.jit(lambda a: codecs.quantize(codec, a))(jnp.asarray(x))
    assert_bits_equal(code, want_code, f"{codec.value} D={d} codes")
    if want_scale is None:
        assert scale is None
    else:
        assert_bits_equal(scale, want_scale, f"{codec.value} D={d} scales")
    # codes have the plane dtypes of the profile schema
    assert np.dtype(code.dtype) == codec.code_dtype


@pytest.mark.slow
@pytest.mark.parametrize("codec", [KVCodec.BF16, KVCodec.FP8_E4M3FN_ROW], ids=lambda c: c.value)
def test_quantize_eager_equals_jit(codec):
    """Op-by-op execution (no fusion, no algebraic rewrites across ops) gives the same bits."""
    x = _cases(codec, 64, seed=64)
    want_code, want_scale = np_codecs.encode(codec.value, x)
    ecode, escale = codecs.quantize(codec, jnp.asarray(x))
    assert_bits_equal(ecode, want_code, f"{codec.value} eager codes")
    if want_scale is not None:
        assert_bits_equal(escale, want_scale, f"{codec.value} eager scales")


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.value)
def test_quantize_bf16_inputs(codec):
    x = _cases(codec, 128, seed=7).astype(ml_dtypes.bfloat16)
    want_code, want_scale = np_codecs.encode(codec.value, x)
    code, scale = jax.jit(lambda a: codecs.quantize(codec, a))(jnp.asarray(x))
    assert_bits_equal(code, want_code, f"{codec.value} bf16-input codes")
    if want_scale is not None:
        assert_bits_equal(scale, want_scale, f"{codec.value} bf16-input scales")


def test_cases_exercise_the_edges():
    """The generated inputs really contain the edge cases the bit tests claim to cover."""
    d = 64
    # e2m1 ties land on the even code: 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    code, scale = np_codecs.encode("nvfp4-g16", _e2m1_ties(d))
    dec = np_codecs.decode("nvfp4-g16", code, scale)
    s = scale.view(np_codecs.E4M3).astype(np.float32)
    assert (s[:3] < 2.0**-6).all() and (s[:3] > 0).all()  # subnormal e4m3 scales present
    np.testing.assert_array_equal(dec[9, 1:8], [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])  # e = 0 row, s = 1
    assert np.signbit(dec[9, 15])  # -0.0 keeps its sign bit
    # FP8 and NVFP4 inputs overflow the code range before the clip
    for codec in (KVCodec.FP8_E4M3FN_ROW, KVCodec.NVFP4_G16):
        rows = _pre_clip_overflow(np.random.default_rng(0), d, codec)
        assert len(rows) >= 8
    # int8 ties round half to even
    code, _ = np_codecs.encode("int8-g64", _int8_ties(d))
    assert code[1, 1] == -126 and code[1, 2] == -124  # -125.5 -> -126, -124.5 -> -124


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.value)
def test_dequantize_matches_numpy(codec):
    rng = np.random.default_rng(3)
    d = 128
    code, scale = np_codecs.encode(codec.value, _cases(codec, d, seed=11))
    dequantize = jax.jit(lambda c, s: codecs.dequantize(codec, c, s))
    got = dequantize(jnp.asarray(code), None if scale is None else jnp.asarray(scale))
    assert_bits_equal(got, np_codecs.decode(codec.value, code, scale), f"{codec.value} dequantize")
    # arbitrary stored bytes (what a poisoned page holds) decode identically too, NaN codes included
    raw_code = rng.integers(0, 256, size=code.shape, dtype=np.uint8).view(code.dtype)
    raw_scale = None if scale is None else rng.integers(0, 256, size=scale.shape).astype(np.uint8).view(np.uint8)
    if scale is not None and scale.dtype == np_codecs.BF16:
        bits = rng.integers(0, 2**16, size=scale.shape, dtype=np.uint16)
        bits[(bits & 0x7F80) == 0] |= 0x0080  # no subnormal scales: XLA's CPU backend treats them as 0
        raw_scale = bits.view(np_codecs.BF16)
    elif scale is not None:
        raw_scale = raw_scale.astype(np.uint8)
    got = dequantize(jnp.asarray(raw_code), None if raw_scale is None else jnp.asarray(raw_scale))
    with np.errstate(over="ignore", invalid="ignore"):
        want = np_codecs.decode(codec.value, raw_code, raw_scale)
    # XLA's CPU backend flushes float32 subnormal products to zero; random scales reach them
    tiny = (codec is not KVCodec.BF16) & (want != 0) & (np.abs(want) < np.finfo(np.float32).tiny)
    want = np.where(tiny, np.copysign(np.float32(0), want), want).astype(np.float32)
    assert_bits_equal(got, want, f"{codec.value} raw dequantize")


@pytest.mark.parametrize("profile", [
    pytest.param(p, id=p.value, marks=(pytest.mark.slow,) if p in (KVProfile.FP8_E4M3FN_ROW256, KVProfile.NVFP4_G16) else ())
    for p in KVProfile
])  # K8V4 covers the FP8 and NVFP4 planes by default
def test_encode_kv_planes_match_numpy(profile):
    rng = np.random.default_rng(5)
    k = rng.standard_normal((2, 3, 2, 64)).astype(np.float32)
    v = rng.standard_normal((2, 3, 2, 64)).astype(np.float32) * 30
    @jax.jit
    def run(a, b):
        planes = codecs.encode_kv(profile, a, b)
        return planes, codecs.decode_kv(profile, planes), codecs.codec_roundtrip(profile, a, b)

    got, (gk, gv), (rk, rv) = run(jnp.asarray(k), jnp.asarray(v))
    want = np_codecs.encode_kv(profile.value, k, v)
    assert tuple(got) == profile.plane_names() == tuple(want)
    for name in want:
        assert_bits_equal(got[name], want[name], f"{profile.value} plane {name}")
    wk, wv = np_codecs.decode_kv(profile.value, want)
    assert_bits_equal(gk, wk, "decoded k")
    assert_bits_equal(gv, wv, "decoded v")
    assert_bits_equal(rk, wk, "roundtrip k")
    assert_bits_equal(rv, wv, "roundtrip v")


def test_round_half_even_matches_rint():
    rng = np.random.default_rng(0)
    ties = np.arange(-1000.5, 1000.0, 1.0, dtype=np.float32)
    near = np.array([2.0**22 + 0.5, 2.0**22 + 1.5, 2.0**23 - 0.5, 2.0**23, 2.0**23 + 1, 2.0**24 + 2], np.float32)
    rand = (rng.standard_normal(4096) * 10.0 ** rng.integers(-4, 7, 4096)).astype(np.float32)
    frac = np.float32(0.5) - np.float32(2.0**-24)  # just below a tie
    y = np.concatenate([ties, -ties, near, -near, rand, [frac, -frac, 0.0, -0.0, 1.5, 2.5, -1.5, -2.5]]).astype(np.float32)
    got = np.asarray(codecs.round_half_even(jnp.asarray(y)))
    np.testing.assert_array_equal(got, np.rint(y))  # value equality (-0.0 == 0.0)
    np.testing.assert_array_equal(np.asarray(jax.jit(codecs.round_half_even)(jnp.asarray(y))), np.rint(y))


def test_e2m1_encode_decode_against_ml_dtypes():
    grid = np.linspace(-6.0, 6.0, 12 * 64 + 1, dtype=np.float32)  # every tie is on this grid
    grid = np.concatenate([grid, np.array([-0.0, 0.0], np.float32)])
    want = grid.astype(np_codecs.E2M1).view(np.uint8) & 0xF
    got = np.asarray(codecs.e2m1_encode(jnp.asarray(grid)))
    np.testing.assert_array_equal(got, want)
    allcodes = np.arange(16, dtype=np.uint8)
    np.testing.assert_array_equal(
        np.asarray(codecs.e2m1_decode(jnp.asarray(allcodes))), allcodes.view(np_codecs.E2M1).astype(np.float32)
    )


def test_pack_unpack_nibbles_order():
    nib = jnp.asarray(np.arange(16, dtype=np.uint8))
    packed = np.asarray(codecs.pack_nibbles(nib))
    assert packed[0] == 0x10 and packed[7] == 0xFE  # element 2j low nibble, 2j+1 high nibble
    np.testing.assert_array_equal(np.asarray(codecs.unpack_nibbles(jnp.asarray(packed))), np.arange(16))


@pytest.mark.parametrize("d", [32, 100])
def test_unsupported_head_dim_is_a_clear_error(d):
    with pytest.raises(ValueError, match=f"head_dim={d}"):
        codecs.quantize(KVCodec.INT8_G64, jnp.zeros((2, d)))


def _reciprocal_traps(c: float, n: int, rng) -> np.ndarray:
    """amax values where bf16(a * (1/c)) != bf16(a / c): what a reciprocal rewrite gets wrong."""
    # a / c close to a bf16 rounding midpoint: where one ulp of quotient error flips the rounding
    v = (rng.random(400_000, dtype=np.float32) + np.float32(0.5)).astype(np_codecs.BF16).astype(np.float32)
    mid = v + np.ldexp(np.float32(1), np.frexp(v)[1] - 9).astype(np.float32)  # v + half a bf16 ulp
    a = (mid.astype(np.float64) * c).astype(np.float32)
    a = np.concatenate([a, np.nextafter(a, np.float32(0)), np.nextafter(a, np.float32(np.inf))])
    bad = (a / np.float32(c)).astype(np_codecs.BF16) != (a * (np.float32(1) / np.float32(c))).astype(np_codecs.BF16)
    assert bad.sum() >= n, "no trap values found; widen the search"
    return a[bad][:n]


def test_div_rn_is_ieee_division():
    rng = np.random.default_rng(0)
    a = (rng.standard_normal(200_000) * 10.0 ** rng.integers(-30, 30, 200_000)).astype(np.float32)
    b_bf16 = (rng.standard_normal(200_000) * 10.0 ** rng.integers(-30, 30, 200_000)).astype(np_codecs.BF16).astype(np.float32)
    b_e4m3 = rng.standard_normal(200_000).astype(np_codecs.E4M3).astype(np.float32)
    b_e4m3[b_e4m3 == 0] = 1.0
    f = jax.jit(codecs.div_rn)
    with np.errstate(over="ignore", under="ignore"):
        for b in (b_bf16, b_e4m3, np.float32(127.0), np.float32(448.0), np.float32(6.0)):
            want = (a / b).astype(np.float32)
            got = np.asarray(f(jnp.asarray(a), jnp.asarray(b)))
            normal = (np.abs(want) >= np.finfo(np.float32).tiny) & np.isfinite(want)
            np.testing.assert_array_equal(got.view(np.uint32)[normal], want.view(np.uint32)[normal])


def test_scales_where_a_reciprocal_multiply_would_round_differently():
    """amax / 127 and amax / 448 are true divisions, even where XLA would rewrite them."""
    rng = np.random.default_rng(1)
    for codec, c, group in ((KVCodec.INT8_G64, 127.0, 64), (KVCodec.FP8_E4M3FN_ROW, 448.0, 128)):
        amax = _reciprocal_traps(c, 16, rng)
        x = rng.uniform(-1, 1, (amax.size, group)).astype(np.float32) * amax[:, None] * np.float32(0.5)
        x[:, 3] = amax
        want_code, want_scale = np_codecs.encode(codec.value, x)
        code, scale = jax.jit(lambda a: codecs.quantize(codec, a))(jnp.asarray(x))
        assert_bits_equal(scale, want_scale, f"{codec.value} trap scales")
        assert_bits_equal(code, want_code, f"{codec.value} trap codes")


def test_fp8_bf16_inputs_on_exact_e4m3_ties():
    """bf16 inputs divided by a bf16 scale often land exactly between two e4m3 codes."""
    s = np.float32(0.0546875)  # bf16(amax / 448) for amax = 24.5
    ties = np.array([232.0, 200.0, 116.0, 27.0, 9.5, -232.0, -200.0], np.float32)  # e4m3 midpoints
    row = np.zeros(64, np.float32)
    row[0] = 24.5
    row[1 : 1 + ties.size] = ties * s
    x = row.astype(np_codecs.BF16)
    assert (x.astype(np.float32)[1 : 1 + ties.size] / s == ties).all()
    want_code, want_scale = np_codecs.encode("fp8-e4m3fn-row", x)
    assert want_scale.astype(np.float32)[0] == s
    for shape in ((64,), (3, 64)):
        xs = np.broadcast_to(x, shape)
        code, _ = jax.jit(lambda a: codecs.quantize(KVCodec.FP8_E4M3FN_ROW, a))(jnp.asarray(xs))
        assert_bits_equal(code, np.broadcast_to(want_code, shape), f"e4m3 ties {shape}")


def _strict_bits(a, b, what):
    a, b = np.asarray(a), np.asarray(b)
    bad = _bits(a) != _bits(b)
    assert not bad.any(), f"{what}: {int(bad.sum())} elements differ, first at {tuple(np.argwhere(bad)[0])}"


def test_nan_in_any_lane_propagates_explicitly():
    """A NaN at any lane makes its group's scale NaN and its codes 0, NaN bits compared exactly.

    XLA's CPU ``reduce_max`` drops NaN for shapes like (16, 256) in groups of 16, so a codec that
    relied on it would store finite scales here.
    """
    rng = np.random.default_rng(4)
    x = rng.standard_normal((16, 256)).astype(np.float32)
    lanes = rng.permutation(256)[:16]
    x[np.arange(16), lanes] = np.where(np.arange(16) % 2, np.nan, -np.nan).astype(np.float32)
    x[3, (lanes[3] + 100) % 256] = np.inf
    got = jax.jit(lambda a: {c.value: codecs.quantize(c, a) for c in CODECS})(jnp.asarray(x))
    for codec in CODECS:
        want_code, want_scale = np_codecs.encode(codec.value, x)
        code, scale = got[codec.value]
        _strict_bits(code, want_code, f"{codec.value} codes")
        if want_scale is None:
            continue
        _strict_bits(scale, want_scale, f"{codec.value} scales")
        group = {KVCodec.INT8_G64: 64, KVCodec.FP8_E4M3FN_ROW: 256, KVCodec.NVFP4_G16: 16}[codec]
        s = _bits(scale)[np.arange(16), lanes // group]
        assert (s == (0x7F if codec is KVCodec.NVFP4_G16 else 0x7FC0)).all()


def test_subnormals_are_flushed_by_the_quantizers_and_kept_by_bf16():
    x = np.zeros((3, 64), np.float32)
    x[0] = np.float32(1e-39) * np.arange(1, 65, dtype=np.float32)  # all subnormal
    x[1] = np.float32(2e-38)  # normal amax; amax / 127 and amax / 448 are subnormal
    x[2, :32] = 1.0
    x[2, 32:] = -np.float32(3e-40)  # subnormals beside normal values: codes of -0.0

    @jax.jit
    def run(a):
        return {c.value: codecs.quantize(c, a) for c in CODECS}, codecs.flush_subnormal(a[2])

    got, flushed = run(jnp.asarray(x))
    for codec in CODECS:
        want_code, want_scale = np_codecs.encode(codec.value, x)
        code, scale = got[codec.value]
        _strict_bits(code, want_code, f"{codec.value} codes")
        if scale is not None:
            _strict_bits(scale, want_scale, f"{codec.value} scales")
    code, scale = got[KVCodec.INT8_G64.value]
    assert not np.asarray(scale)[:2].astype(np.float32).any() and not np.asarray(code)[:2].any()
    assert (_bits(got[KVCodec.BF16.value][0])[0] != 0).all()  # bf16 codes keep subnormals
    assert (_bits(flushed)[32:] == 0x80000000).all() and (np.asarray(flushed)[:32] == 1).all()
