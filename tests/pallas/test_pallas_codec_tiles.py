"""The in-kernel codec tiles produce exactly the codes and scales of ninfer_kv.ops.codecs (CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ninfer_kv.ops import codecs
from ninfer_kv.schema.profiles import KVCodec
from pallas_kernels.common import codec_tiles as ct
from pallas_kernels.triton.config import lanes

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
    for codec in KVCodec:
        for d in (64, 128, 256):
            covered = np.concatenate([np.asarray(c.index())[0] for c in ct.codec_tile(codec).columns(lanes(d))])
            assert sorted(covered.tolist()) == list(range(d)), (codec, d)


def test_padded_columns_mask_the_padding():
    for codec, d in ((KVCodec.BF16, 80), (KVCodec.FP8_E4M3FN_ROW, 8), (KVCodec.NVFP4_G16, 160), (KVCodec.INT8_G64, 192)):
        covered = []
        for c in ct.codec_tile(codec).columns(lanes(d)):
            assert c.n >= 16 and c.n & (c.n - 1) == 0  # the Triton rule: powers of two, product operands >= 16
            mask = np.ones((1, c.n), bool) if c.mask() is None else np.asarray(c.mask())
            idx = np.asarray(c.index())
            covered += idx[mask].tolist()
            assert np.all(idx[~mask] >= d)  # padding names no real lane
        assert sorted(covered) == list(range(d)), (codec, d)


_TILE_DEFAULTS = (KVCodec.NVFP4_G16,)  # padded tiles, two columns, div=8 scale lanes (the others: -m slow)


def _lanes_of(cols) -> np.ndarray:
    """The real lanes a ``Cols`` names, in tile order."""
    return np.asarray(cols.index())[0][: cols.real]


def _tile_of(plane: np.ndarray, where) -> jax.Array:
    """What a kernel loads: the tile of ``plane (n, X)`` at ``where`` (a Cols: padding 0; an int: one lane)."""
    plane = jnp.asarray(plane)
    if isinstance(where, int):
        return plane[:, where]
    tile = plane[:, jnp.minimum(where.index()[0], plane.shape[1] - 1)]
    return jnp.where(jnp.arange(where.n) < where.real, tile, jnp.zeros((), plane.dtype))


@pytest.mark.parametrize("codec", [pytest.param(c, id=c.value, marks=() if c in _TILE_DEFAULTS else pytest.mark.slow)
                                   for c in KVCodec])
def test_each_tile_encodes_and_decodes_like_the_codecs(codec):
    """Through the table, as a kernel calls it (Triton tile rule, padded head dim where the codec allows one):
    ``encode`` returns the reference codes and scales at the lanes it names; ``decode_keys`` of
    one-hot queries and ``decode_values`` of one-hot probabilities return the reference dequantization."""
    d = 96 if codec in (KVCodec.BF16, KVCodec.FP8_E4M3FN_ROW) else 192 if codec is KVCodec.INT8_G64 else 80
    x = np.random.RandomState(5).standard_normal((_ROWS, d)).astype(np.float32) * 3
    tile, tl = ct.CODEC_TILES[codec], lanes(d)
    cols = tile.columns(tl)
    # Query i reads lane i (d one-hot query rows per column tile); probability row r takes key r.
    onehot = [np.pad((np.arange(d)[:, None] == _lanes_of(c)[None, :]).astype(np.float32), ((0, 0), (0, c.n - c.real)))
              for c in cols]
    puts = []  # (plane, lanes) of each Put, recorded while tracing

    @jax.jit
    def run(x):
        codes, scale = codecs.quantize(codec, x)
        planes = {"k": codes, "v": codes, "k_scale": scale, "v_scale": scale}
        encoded = tile.encode("k", lambda c: _tile_of(x, c).astype(jnp.float32), tl)
        puts[:] = [(p.plane, p.where) for p in encoded]
        load = lambda plane, where: _tile_of(planes[plane], where)  # noqa: E731
        scores = tile.decode_keys([jnp.asarray(q) for q in onehot], load, tl, jnp.float32)
        accs = [jnp.zeros((_ROWS, c.n), jnp.float32) for c in cols]
        values = tile.decode_values(accs, jnp.eye(_ROWS, dtype=jnp.float32), load, tl, jnp.float32)
        return planes, [p.value for p in encoded], scores, values, codecs.dequantize(codec, codes, scale)

    planes, encoded, scores, values, want = jax.tree.map(np.asarray, run(x))
    assert [plane for plane, _ in puts] == ["k"] + (["k_scale"] if planes["k_scale"] is not None else [])
    for (plane, where), value in zip(puts, encoded):
        ref = planes[plane].reshape(_ROWS, -1)
        if isinstance(where, int):
            _same(value, ref[:, where])
        else:
            assert _lanes_of(where).tolist() == list(range(ref.shape[1]))
            _same(value[:, : where.real], ref)
    np.testing.assert_array_equal(scores, want.T)
    got = np.zeros((_ROWS, d), np.float32)
    for acc, c in zip(values, cols):
        got[:, _lanes_of(c)] = acc[:, : c.real]
    np.testing.assert_array_equal(got, want)


_NAN_BF16, _INF_BF16, _NAN_E4M3 = codecs.BF16_NAN_BITS, 0x7F80, codecs.E4M3FN_NAN_BITS


def _poisoned_rows(d, group, rs):
    """Rows of normals with NaN (various payloads and signs) and +-inf planted in some groups."""
    x = rs.standard_normal((_ROWS, d)).astype(np.float32) * 3
    odd_nan = np.array([0xFFC00001, 0x7F800001, 0x7FFFFFFF], np.uint32).view(np.float32)
    x[0, 3] = odd_nan[0]
    x[1, group + 1] = odd_nan[1]
    x[2, :] = np.nan
    x[3, 2 * group - 1] = np.inf
    x[4, 0] = -np.inf
    x[4, group] = odd_nan[2]
    x[5, group + 2] = np.inf
    x[5, group + 3] = np.nan
    x[6, 1] = 1e-40  # a subnormal element (flushed by the quantizers)
    x[7, :group] = 1e-39
    return x


def _bits16(a):
    return np.asarray(a).view(np.uint16)


def test_non_finite_int8_groups_store_nan_or_inf_scales_and_zero_codes():
    x = _poisoned_rows(128, 64, np.random.RandomState(0))
    codes, scales = (np.asarray(a) for a in _int8(x))
    groups = x.reshape(_ROWS, 2, 64)
    nan, inf = np.isnan(groups).any(-1), np.isinf(groups).any(-1)
    finite = ~(nan | inf)
    s_bits = _bits16(scales)
    assert np.all(s_bits[nan] == _NAN_BF16) and np.all(s_bits[inf & ~nan] == _INF_BF16)
    assert np.all(codes.reshape(_ROWS, 2, 64)[~finite] == 0)
    want_codes, want_scales = _ref_int8(x)
    _same(codes, want_codes)
    _same(scales, want_scales)


def test_non_finite_fp8_rows_store_nan_or_inf_scales_and_zero_codes():
    x = _poisoned_rows(64, 16, np.random.RandomState(1))
    codes, scale = (np.asarray(a) for a in _fp8(x))
    nan, inf = np.isnan(x).any(-1), np.isinf(x).any(-1)
    s_bits = _bits16(scale)
    assert np.all(s_bits[nan] == _NAN_BF16) and np.all(s_bits[inf & ~nan] == _INF_BF16)
    assert np.all(codes.view(np.uint8)[nan | inf] == 0)
    want_codes, want_scale = _ref_fp8(x)
    _same(codes, want_codes)
    _same(scale, np.asarray(want_scale)[:, 0])


def test_non_finite_nvfp4_groups_store_nan_scale_bytes_and_zero_codes():
    x = _poisoned_rows(64, 16, np.random.RandomState(2))
    packed, bits = (np.asarray(a) for a in _nvfp4(x[:, 0::2], x[:, 1::2]))
    nan = np.isnan(x.reshape(_ROWS, 4, 16)).any(-1)
    assert np.all(bits[nan] == _NAN_E4M3)
    assert np.all(packed.reshape(_ROWS, 4, 8)[nan] == 0)
    # Infinity is not special for NVFP4 (scale min(inf / 6, 448) = 448, codes clipped to +-6).
    inf = np.isinf(x.reshape(_ROWS, 4, 16)).any(-1) & ~nan
    assert np.any(inf) and np.all(bits[inf] == 0x7E)
    want_packed, want_bits = _ref_nvfp4(x)
    _same(bits, want_bits)
    _same(packed, want_packed)


def test_bf16_nan_is_canonical():
    x = _poisoned_rows(64, 16, np.random.RandomState(3))
    got = _bits16(jax.jit(ct.quantize_bf16_tile)(x))
    nan = np.isnan(x)
    assert np.all(got[nan] == _NAN_BF16)
    _same(got, jax.jit(codecs.quantize_bf16)(x)[0])


def test_padded_tiles_quantize_the_real_lanes_like_the_codecs():
    rs = np.random.RandomState(4)
    x = rs.standard_normal((_ROWS, 192)).astype(np.float32)
    padded = np.concatenate([x, np.zeros((_ROWS, 64), np.float32)], axis=1)
    codes, scales = jax.jit(ct.quantize_int8_tile, static_argnums=1)(padded, 192)
    want_codes, want_scales = _ref_int8(x)
    _same(np.asarray(codes)[:, :192], want_codes)
    _same(np.asarray(scales)[:, :3], want_scales)
    y = rs.standard_normal((_ROWS, 80)).astype(np.float32)
    halves = [np.concatenate([y[:, i::2], np.zeros((_ROWS, 24), np.float32)], axis=1) for i in (0, 1)]
    packed, bits = jax.jit(ct.quantize_nvfp4_tile, static_argnums=2)(*halves, 80)
    want_packed, want_bits = _ref_nvfp4(y)
    _same(np.asarray(packed)[:, :40], want_packed)
    _same(np.asarray(bits)[:, :5], want_bits)
