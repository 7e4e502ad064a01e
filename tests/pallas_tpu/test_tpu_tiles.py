"""The Mosaic backend's int32 decoders and encoders agree with ml_dtypes and the shared codec tiles."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels.common.codec_tiles import quantize_int8_tile, quantize_nvfp4_tile
from pallas_kernels.mosaic_tpu.tpu_tiles import (e2m1_to_f32, e4m3_bits_to_f32, quantize_int8_tile_i32,
                                                 quantize_nvfp4_tile_i32)


def test_e4m3_and_e2m1_decoders_are_exact():
    bits = np.arange(256, dtype=np.int32)
    want = bits.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(e4m3_bits_to_f32(jnp.asarray(bits))), want)
    codes = np.arange(16, dtype=np.int32)
    want4 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], np.float32)
    np.testing.assert_array_equal(np.asarray(e2m1_to_f32(jnp.asarray(codes))), np.concatenate([want4, -want4]))


def test_int32_quantizers_match_the_shared_tiles_bit_for_bit():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((9, 128)).astype(np.float32) * np.float32(3)
    x[1] = 0.0
    x[2, 5] = np.nan
    x[3, :16] = 1e-40
    codes, scales = quantize_int8_tile(jnp.asarray(x), 128, 2)
    c32, s32 = quantize_int8_tile_i32(jnp.asarray(x), 128, 2)
    np.testing.assert_array_equal(np.asarray(c32), np.asarray(codes).astype(np.int32))
    np.testing.assert_array_equal(np.asarray(s32), np.asarray(scales).view(np.uint16).astype(np.int32))
    packed, sbits = quantize_nvfp4_tile(jnp.asarray(x[:, 0::2]), jnp.asarray(x[:, 1::2]), 128, 8)
    p32, b32 = quantize_nvfp4_tile_i32(jnp.asarray(x[:, 0::2]), jnp.asarray(x[:, 1::2]), 128, 8)
    np.testing.assert_array_equal(np.asarray(p32), np.asarray(packed).astype(np.int32))
    np.testing.assert_array_equal(np.asarray(b32), np.asarray(sbits).astype(np.int32))


def test_every_shared_codec_tile_has_one_tpu_tile():
    import dataclasses

    import pytest

    from ninfer_kv.schema.profiles import KVCodec
    from pallas_kernels.common.codec_tiles import CODEC_TILES
    from pallas_kernels.mosaic_tpu.tpu_tiles import TPU_TILES, tpu_tile

    assert set(TPU_TILES) == {type(t) for t in CODEC_TILES.values()}
    for codec in KVCodec:
        tile = tpu_tile(codec)
        assert tile is TPU_TILES[type(CODEC_TILES[codec])] and tile.base is CODEC_TILES[codec]
        with pytest.raises(dataclasses.FrozenInstanceError):
            tile.base = None  # noqa: B010 - frozen: one TPU tile per shared tile
    assert [c for c in KVCodec if tpu_tile(c).permutes_lanes] == [KVCodec.NVFP4_G16]
    with pytest.raises(ValueError, match="no tile for codec"):
        tpu_tile("not-a-codec")
