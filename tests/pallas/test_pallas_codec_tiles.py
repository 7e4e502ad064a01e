"""The in-kernel codec tiles produce exactly the codes and scales of ninfer_kv.codecs (CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ninfer_kv import codecs
from pallas_kernels import codec_tiles as ct

_ROWS = 8

# Values that sit on rounding ties once divided by their group scale, zeros, negative zeros,
# huge and tiny magnitudes, next to ordinary normals.
_SPECIAL = [0.0, -0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -6.0, 127.0, 63.5, -0.5, 448.0, 1e-30, 3e4, -7e-3]


def _tiles(d):
    elems = st.one_of(st.sampled_from(_SPECIAL), st.floats(-50, 50, width=32, allow_nan=False))
    return st.lists(elems, min_size=_ROWS * d, max_size=_ROWS * d).map(
        lambda xs: np.asarray(xs, np.float32).reshape(_ROWS, d)
    )


def _tie_tiles(d, group, qmax, ties):
    """Rows whose groups have amax = qmax * s exactly and other lanes on rounding ties ``s * tie``.

    With a true division ``x / s`` lands exactly on the tie; a multiplication by a rounded ``1 / s``
    may not, so these rows tell the two apart.  Hypothesis draws the seed of the generator.
    """

    def build(seed):
        rs = np.random.RandomState(seed)
        n_groups = _ROWS * d // group
        s = (rs.randint(8, 16, n_groups) / 8.0 * 2.0 ** rs.randint(-6, 7, n_groups)).astype(np.float32)
        lanes = rs.choice(np.asarray(ties, np.float32), (n_groups, group)) * rs.choice([-1, 1], (n_groups, group))
        lanes[np.arange(n_groups), rs.randint(0, group, n_groups)] = qmax
        return (lanes * s[:, None]).astype(np.float32).reshape(_ROWS, d)

    return st.integers(0, 2**31 - 1).map(build)


def _same(a, b):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


_int8 = jax.jit(ct.quantize_int8_tile)
_fp8 = jax.jit(ct.quantize_fp8_row_tile)
_nvfp4 = jax.jit(ct.quantize_nvfp4_tile)
_ref_int8 = jax.jit(codecs.quantize_int8_g64)
_ref_fp8 = jax.jit(codecs.quantize_fp8_row)
_ref_nvfp4 = jax.jit(codecs.quantize_nvfp4_g16)
_SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(_tiles(128))
def test_int8_tile_matches_codecs(x):
    codes, scales = _int8(x)
    want_codes, want_scales = _ref_int8(x)
    _same(codes, want_codes)
    _same(scales, want_scales)


@_SETTINGS
@given(_tie_tiles(128, 64, 127.0, [k + 0.5 for k in range(-126, 126)]))
def test_int8_tile_rounding_ties_match_codecs(x):
    codes, scales = _int8(x)
    want_codes, want_scales = _ref_int8(x)
    _same(scales, want_scales)
    _same(codes, want_codes)


@_SETTINGS
@given(_tie_tiles(64, 16, 6.0, [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]))
def test_nvfp4_tile_rounding_ties_match_codecs(x):
    packed, bits = _nvfp4(x[:, 0::2], x[:, 1::2])
    want_packed, want_bits = _ref_nvfp4(x)
    _same(bits, want_bits)
    _same(packed, want_packed)


@_SETTINGS
@given(_tiles(64))
def test_fp8_row_tile_matches_codecs(x):
    codes, scale = _fp8(x)
    want_codes, want_scale = _ref_fp8(x)
    _same(codes, want_codes)
    _same(scale, want_scale[:, 0])


@_SETTINGS
@given(_tiles(64))
def test_nvfp4_tile_matches_codecs(x):
    packed, bits = _nvfp4(x[:, 0::2], x[:, 1::2])
    want_packed, want_bits = _ref_nvfp4(x)
    _same(packed, want_packed)
    _same(bits, want_bits)


def test_nvfp4_dequantize_halves_matches_codecs():
    x = np.random.RandomState(0).standard_normal((_ROWS, 64)).astype(np.float32) * 3
    packed, bits = _ref_nvfp4(x)

    @jax.jit
    def halves(packed, bits):
        scale = ct.fp8_bits_to_f32(jnp.repeat(bits, 8, axis=1))  # expanded per byte, as a kernel loads it
        return ct.nvfp4_dequantize_halves(packed, scale)

    lo, hi = halves(packed, bits)
    want = np.asarray(jax.jit(codecs.dequantize_nvfp4_g16)(packed, bits))
    np.testing.assert_array_equal(np.asarray(lo), want[:, 0::2])
    np.testing.assert_array_equal(np.asarray(hi), want[:, 1::2])


def test_columns_cover_every_lane_once():
    from ninfer_kv.profiles import KVCodec

    for codec in KVCodec:
        for d in (64, 128, 256):
            lanes = np.concatenate([np.asarray(c.index())[0] for c in ct.value_columns(codec, d)])
            assert sorted(lanes.tolist()) == list(range(d)), (codec, d)
