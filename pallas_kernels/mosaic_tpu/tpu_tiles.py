"""The codecs in Mosaic's form: one TPU tile per shared codec tile, for the Mosaic append and attention.

:data:`TPU_TILES` maps each tile class of :data:`pallas_kernels.common.codec_tiles.CODEC_TILES` to
its :class:`TpuTile`; the kernels look a codec up with :func:`tpu_tile` and never branch on it.

Mosaic lowers 2-D vectors of 32-bit elements best: no 1-D <-> 2-D reshapes, no arithmetic on 8-bit
vectors, no strided loads of packed data.  So the decoders here widen every loaded plane to int32 or
float32 right after the load, decode 8-bit float codes from their bits with integer arithmetic,
and turn a per-key scale column ``(keys, 1)`` into a row ``(1, keys)`` with an exact one-hot
``A @ B.T`` product (one nonzero term per output), the form the score products already have.

NVFP4 keys are multiplied with the even and the odd query lanes separately; the kernel receives the
queries with their lanes permuted to ``[even | odd]`` and writes the NVFP4 value accumulators to
``[even | odd]`` output lanes (the wrapper undoes the permutation), so no strided access is needed.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Callable, ClassVar, Mapping

import jax
import jax.numpy as jnp

from ..common.codec_tiles import (CODEC_TILES, Bf16Tile, CodecTile, Fp8RowTile, Int8G64Tile, Nvfp4G16Tile, Put,
                                  TileSource, codec_tile)
from ..common.tiles import F32, Lanes, dot

__all__ = [
    "TpuTile",
    "TPU_TILES",
    "tpu_tile",
    "e4m3_bits_to_f32",
    "e2m1_to_f32",
    "column_to_row",
    "widen",
    "quantize_int8_tile_i32",
    "quantize_nvfp4_tile_i32",
]

I32 = jnp.int32


def _i32(x: jax.Array) -> jax.Array:
    """An integer tile widened to int32 (unsigned 8-bit bits stay 0..255)."""
    if x.dtype == jnp.uint8:
        return x.astype(jnp.int32) & 0xFF
    return x.astype(jnp.int32)


def e4m3_bits_to_f32(bits: jax.Array) -> jax.Array:
    """e4m3fn bits (int32 0..255) -> float32, exactly (NaN for 0x7F / 0xFF)."""
    sign = jax.lax.shift_left(bits & 0x80, I32(24))
    e = jax.lax.shift_right_logical(bits, I32(3)) & 0xF
    m = bits & 7
    normal = jax.lax.bitcast_convert_type(
        sign | jax.lax.shift_left(e + 120, I32(23)) | jax.lax.shift_left(m, I32(20)), F32)
    sub_mag = m.astype(F32) * F32(2.0**-9)
    sub = jnp.where(sign != 0, -sub_mag, sub_mag)
    val = jnp.where(e == 0, sub, normal)
    return jnp.where((bits & 0x7F) == 0x7F, F32(jnp.nan), val)


def e2m1_to_f32(code: jax.Array) -> jax.Array:
    """4-bit e2m1 codes (int32, low nibble) -> float32."""
    e = jax.lax.shift_right_logical(code, I32(1)) & 3
    mant = (code & 1).astype(F32)
    pow2 = jnp.where(e == 3, F32(4.0), jnp.where(e == 2, F32(2.0), F32(1.0)))
    mag = jnp.where(e == 0, 0.5 * mant, (1.0 + 0.5 * mant) * pow2)
    return jnp.where((code & 8) != 0, -mag, mag)


def column_to_row(col: jax.Array) -> jax.Array:
    """float32 ``(keys, 1)`` -> ``(1, keys)`` by a one-hot NT product (exact: one nonzero term)."""
    keys = col.shape[0]
    wide = jnp.broadcast_to(col, (keys, 128))
    onehot = (jax.lax.broadcasted_iota(I32, (8, 128), 1) == 0).astype(F32)
    return dot(onehot, wide, transpose_b=True)[0:1, :]


def _scale_row(tile: jax.Array, lane: int) -> jax.Array:
    """Lane ``lane`` of a widened ``(keys, X)`` scale tile as a ``(1, keys)`` row."""
    return column_to_row(tile[:, lane:lane + 1])


def _nvfp4_halves(codes: jax.Array, scales: jax.Array):
    """Packed bytes ``(keys, D/2)`` int32 and scale bits ``(keys, D/16)`` int32 -> (even, odd) float32."""
    half = codes.shape[1]
    sc = e4m3_bits_to_f32(scales)
    gid = jax.lax.div(jax.lax.broadcasted_iota(I32, (1, half), 1), I32(8))
    s = jnp.zeros(codes.shape, F32)
    for g in range(scales.shape[1]):
        s = jnp.where(gid == g, sc[:, g:g + 1], s)
    lo = e2m1_to_f32(codes & 0xF) * s
    hi = e2m1_to_f32(jax.lax.shift_right_logical(codes, I32(4)) & 0xF) * s
    return lo, hi


def widen(tile: jax.Array) -> jax.Array:
    """A loaded plane tile widened: floats (bf16) to float32, integers and raw bits to int32."""
    if jnp.issubdtype(tile.dtype, jnp.floating):
        return tile.astype(F32)
    return _i32(tile)


# -- encoding (append) -----------------------------------------------------------------------------


def _e2m1_encode_i32(y: jax.Array) -> jax.Array:
    """:func:`ninfer_kv.ops.codecs.e2m1_encode` in int32 (Mosaic has no 8-bit vector arithmetic)."""
    a = jnp.abs(y)
    m = ((a > 0.25).astype(I32) + (a >= 0.75).astype(I32) + (a > 1.25).astype(I32) + (a >= 1.75).astype(I32)
         + (a > 2.5).astype(I32) + (a >= 3.5).astype(I32) + (a > 5.0).astype(I32))
    sign = jax.lax.shift_right_logical(jax.lax.bitcast_convert_type(y, I32), I32(31))
    return m | jax.lax.shift_left(sign, I32(3))


def _nvfp4_scale_bits_i32(amax: jax.Array) -> jax.Array:
    """:func:`ninfer_kv.ops.codecs.nvfp4_scale_bits` as int32 bits (0..255)."""
    from ninfer_kv.ops import codecs

    q = codecs.flush_subnormal(codecs.div_rn(amax, jnp.full(amax.shape, codecs.E2M1_MAX, F32)))
    nan = codecs.is_nan_bits(amax)
    sb = jnp.minimum(jnp.where(nan, 0.0, q), codecs.FP8_MAX).astype(jnp.float8_e4m3fn)
    bits = _i32(jax.lax.bitcast_convert_type(sb, jnp.uint8))
    return jnp.where(nan, I32(codecs.E4M3FN_NAN_BITS), bits)


def quantize_nvfp4_tile_i32(x_even: jax.Array, x_odd: jax.Array, head_dim: int, scale_lanes: int):
    """:func:`pallas_kernels.common.codec_tiles.quantize_nvfp4_tile` with int32 results (bit-identical bytes).

    Returns the packed bytes ``(n, D/2)`` and the scale bits ``(n, scale_lanes)``, both int32 in 0..255.
    """
    from ninfer_kv.ops import codecs

    from ..common.tiles import div_where, group_amax

    x_even = codecs.flush_subnormal(x_even.astype(F32))
    x_odd = codecs.flush_subnormal(x_odd.astype(F32))
    half = x_even.shape[1]
    groups = head_dim // 16
    bits = []
    for a_even, a_odd in zip(group_amax(x_even, 8, groups), group_amax(x_odd, 8, groups)):
        nan = codecs.is_nan_bits(a_even) | codecs.is_nan_bits(a_odd)
        bits.append(_nvfp4_scale_bits_i32(codecs.propagate_nan(jnp.maximum(a_even, a_odd), nan)))
    bits = [v[:, None] if v.ndim == 1 else v for v in bits]
    gid = jax.lax.div(jax.lax.broadcasted_iota(I32, (1, half), 1), I32(8))
    s = jnp.zeros(x_even.shape, F32)
    for g, v in enumerate(bits):
        s = jnp.where(gid == g, e4m3_bits_to_f32(v), s)
    ok = codecs.scale_usable(s)

    def nibbles(x):
        c = _e2m1_encode_i32(jnp.clip(div_where(x, s, ok), -codecs.E2M1_MAX, codecs.E2M1_MAX))
        return jnp.where(ok, c, I32(0)) & 0xF

    sid = jax.lax.broadcasted_iota(I32, (1, scale_lanes), 1)
    sc = jnp.zeros((x_even.shape[0], scale_lanes), I32)
    for g, v in enumerate(bits):
        sc = jnp.where(sid == g, v, sc)
    return nibbles(x_even) | jax.lax.shift_left(nibbles(x_odd), I32(4)), sc


def quantize_int8_tile_i32(x: jax.Array, head_dim: int, scale_lanes: int):
    """:func:`pallas_kernels.common.codec_tiles.quantize_int8_tile` with int32 results (bit-identical).

    Returns the codes ``(n, D)`` as int32 (-127..127) and the bf16 bits of the scales ``(n,
    scale_lanes)`` as int32 (0..0xFFFF; lanes past ``D / 64`` hold 0).
    """
    from ninfer_kv.ops import codecs

    from ..common.tiles import div_where, group_amax

    x = codecs.flush_subnormal(x.astype(F32))
    scales = [codecs.bf16_scale(amax, codecs.INT8_QMAX).astype(F32) for amax in group_amax(x, 64, head_dim // 64)]
    scales = [v[:, None] if v.ndim == 1 else v for v in scales]
    gid = jax.lax.div(jax.lax.broadcasted_iota(I32, (1, x.shape[1]), 1), I32(64))
    s = jnp.zeros(x.shape, F32)
    for g, v in enumerate(scales):
        s = jnp.where(gid == g, v, s)
    y = div_where(x, s, codecs.scale_usable(s))
    q = codecs.round_half_even(jnp.clip(y, -codecs.INT8_QMAX, codecs.INT8_QMAX)).astype(I32)
    sid = jax.lax.broadcasted_iota(I32, (1, scale_lanes), 1)
    sc = jnp.zeros((x.shape[0], scale_lanes), I32)
    for g, v in enumerate(scales):
        bits = jax.lax.shift_right_logical(jax.lax.bitcast_convert_type(v, I32), I32(16))
        sc = jnp.where(sid == g, bits, sc)
    return q, sc


# -- the TPU tiles: one per codec tile ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TpuTile:
    """The Mosaic form of one codec's tile (the shared :class:`~pallas_kernels.common.codec_tiles.CodecTile`).

    The kernels never branch on the codec: they look its TPU tile up (:func:`tpu_tile`) and use

    * ``permutes_lanes``: whether the products use ``[even | odd]`` lanes (the queries for the K
      codec, the output accumulators for the V codec; the wrappers permute and restore them);
    * ``columns(d)``: the lanes ``(start, n)`` of each query tile (K) or accumulator (V);
    * ``encode(tensor, x, lanes)``: :class:`Put` records of int32 or 16/32-bit values (the shared
      tile's encoder where Mosaic lowers it, an int32 twin where it would need 8-bit arithmetic);
    * ``decode_keys(qs, codes, scales, cdt)`` and ``decode_values(accs, p, codes, scales, cdt)``
      over the masked tiles :func:`widen` made of one fetched page.
    """

    base: CodecTile
    quantizer: Callable | None = None
    """The int32 twin the shared tile's ``encode`` uses instead of its own quantizer (``None``: its own)."""
    permutes_lanes: ClassVar[bool] = False

    def columns(self, d: int) -> list[tuple[int, int]]:
        return [(0, d)]

    def encode(self, tensor: str, x: TileSource, lanes: Lanes) -> tuple[Put, ...]:
        if self.quantizer is None:
            return self.base.encode(tensor, x, lanes)
        return self.base.encode(tensor, x, lanes, quantizer=self.quantizer)

    def codes(self, tile: jax.Array) -> jax.Array:
        """A widened code tile as the operand of the products."""
        return tile

    def decode_keys(self, qs: list, codes, scales, cdt) -> jax.Array:
        return dot(qs[0], self.codes(codes).astype(cdt), transpose_b=True)

    def decode_values(self, accs: list, p: jax.Array, codes, scales, cdt) -> list:
        return [accs[0] + dot(p.astype(cdt), self.codes(codes).astype(cdt))]


@dataclasses.dataclass(frozen=True)
class TpuBf16Tile(TpuTile):
    """BF16: one product over all D lanes."""


@dataclasses.dataclass(frozen=True)
class TpuFp8RowTile(TpuTile):
    """FP8-E4M3FN rows: codes decoded from their bits, the row scale applied to the scores or the probabilities."""

    def codes(self, tile: jax.Array) -> jax.Array:
        return e4m3_bits_to_f32(tile)

    def decode_keys(self, qs: list, codes, scales, cdt) -> jax.Array:
        return super().decode_keys(qs, codes, scales, cdt) * _scale_row(scales, 0)

    def decode_values(self, accs: list, p: jax.Array, codes, scales, cdt) -> list:
        return super().decode_values(accs, p * _scale_row(scales, 0), codes, scales, cdt)


@dataclasses.dataclass(frozen=True)
class TpuInt8G64Tile(TpuTile):
    """INT8 in groups of 64 lanes: one product per group (encoded through the int32 quantizer twin)."""

    def columns(self, d: int) -> list[tuple[int, int]]:
        return [(64 * g, 64) for g in range(d // 64)]

    def codes(self, tile: jax.Array) -> jax.Array:
        return tile.astype(F32)

    def decode_keys(self, qs: list, codes, scales, cdt) -> jax.Array:
        c = self.codes(codes)
        total = None
        for g in range(len(qs)):
            part = dot(qs[g], c[:, 64 * g:64 * g + 64].astype(cdt), transpose_b=True) * _scale_row(scales, g)
            total = part if total is None else total + part
        return total

    def decode_values(self, accs: list, p: jax.Array, codes, scales, cdt) -> list:
        c = self.codes(codes)
        return [accs[g] + dot((p * _scale_row(scales, g)).astype(cdt), c[:, 64 * g:64 * g + 64].astype(cdt))
                for g in range(len(accs))]


@dataclasses.dataclass(frozen=True)
class TpuNvfp4G16Tile(TpuTile):
    """NVFP4: even and odd lanes in two products over ``[even | odd]`` lanes (encoded through the int32 twin)."""

    permutes_lanes: ClassVar[bool] = True

    def columns(self, d: int) -> list[tuple[int, int]]:
        return [(0, d // 2), (d // 2, d // 2)]

    def decode_keys(self, qs: list, codes, scales, cdt) -> jax.Array:
        lo, hi = _nvfp4_halves(codes, scales)
        return dot(qs[0], lo.astype(cdt), transpose_b=True) + dot(qs[1], hi.astype(cdt), transpose_b=True)

    def decode_values(self, accs: list, p: jax.Array, codes, scales, cdt) -> list:
        lo, hi = _nvfp4_halves(codes, scales)
        pc = p.astype(cdt)
        return [accs[0] + dot(pc, lo.astype(cdt)), accs[1] + dot(pc, hi.astype(cdt))]


_TPU_FORMS: dict[type, Callable[[CodecTile], TpuTile]] = {
    Bf16Tile: TpuBf16Tile,
    Fp8RowTile: TpuFp8RowTile,
    Int8G64Tile: lambda base: TpuInt8G64Tile(base, quantize_int8_tile_i32),
    Nvfp4G16Tile: lambda base: TpuNvfp4G16Tile(base, quantize_nvfp4_tile_i32),
}
TPU_TILES: Mapping[type, TpuTile] = types.MappingProxyType(
    {type(base): _TPU_FORMS[type(base)](base) for base in CODEC_TILES.values()}  # KeyError at import: a tile lacks its form
)
"""The TPU tile of every shared codec tile, keyed by the shared tile's class."""


def tpu_tile(codec) -> TpuTile:
    """The TPU tile of ``codec`` (``ValueError`` naming the codec when the shared table or this one lacks it)."""
    base = codec_tile(codec)
    tile = TPU_TILES.get(type(base))
    if tile is None:
        raise ValueError(f"the Mosaic TPU kernels have no tile for codec {codec}; add one to "
                         "pallas_kernels.mosaic_tpu.tpu_tiles.TPU_TILES")
    return tile
