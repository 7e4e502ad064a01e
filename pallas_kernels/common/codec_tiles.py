"""Codec arithmetic on kernel tiles: one tile object per codec, in one table keyed by ``KVCodec``.

:mod:`ninfer_kv.ops.codecs` states the codecs on ``(..., D)`` vectors and finds group maxima with a
reshape, which kernels cannot do on loaded tiles.  The quantizers here take whole ``(tokens,
lanes)`` tiles, find each group's maximum with a masked reduction, spread the group scales back
over the lanes with a select chain (:mod:`pallas_kernels.common.tiles`), and otherwise repeat the
float32 operation sequence of :mod:`ninfer_kv.ops.codecs` (same amax, same correctly rounded divisions
``codecs.div_rn``, same scale rounding, same clip and rounding), so the codes are bit-identical to
the reference on a CPU.  The elementwise helpers ``div_rn``, ``round_half_even``, ``e2m1_encode``
and ``e2m1_decode`` are reused as they are.  NVFP4 tiles come as their even and odd lanes (the low
and high nibbles of each byte), so packing is a shift and an or.

Non-finite and subnormal inputs follow the rules of :mod:`ninfer_kv.ops.codecs`: subnormals are flushed
in the quantizers, a group holding a NaN gets a NaN scale (bf16 ``0x7FC0``; NVFP4 scale byte
``0x7F``) and all its codes 0, a group whose scale is not finite or zero stores codes 0, a BF16 NaN
element stores ``0x7FC0``; no NaN is ever converted to an integer.

Tile objects
------------
A kernel never branches on the codec: it looks the codec's tile up in :data:`CODEC_TILES`
(:func:`codec_tile`) and calls its operations, which name the lanes they need (:class:`Cols`,
padded by the backend's :class:`Lanes`) and leave memory to the kernel:

* ``columns(lanes)``: how the D lanes split into product operands (the query tiles of the K codec,
  the output accumulators of the V codec);
* ``encode(tensor, x, lanes)``: quantize the tile ``x(cols)`` (float32 ``(tokens, cols.n)``, the
  tokens' input lanes) into :class:`Put` records: the plane (``tensor`` or ``tensor + "_scale"``),
  the value and its lanes (a :class:`Cols`, or an int: one lane per token);
* ``decode_keys(qs, load, lanes, cdt)``: the scores ``q . k`` (float32 ``(rows, keys)``) of the
  query tiles ``qs`` (one per column) against the keys ``load`` reads, dequantization folded into
  the products (compute dtype ``cdt``);
* ``decode_values(accs, p, load, lanes, cdt)``: the accumulators (one per column) plus ``p @ v``.

``load(plane, cols_or_lane)`` returns the masked tile ``(keys, cols.n)`` of a plane (``(keys,)`` for
one lane) for the kernel's current keys.  A sixth codec is one more tile class here and its row in
:data:`CODEC_TILES`.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Callable, ClassVar, Mapping, NamedTuple, Protocol

import jax
import jax.numpy as jnp

import ninfer_kv.ops.codecs as codecs
from ninfer_kv.schema.profiles import KVCodec

from .tiles import F32, Cols, Lanes, div_where, dot, group_amax, spread

__all__ = [
    "Put",
    "CodecTile",
    "CODEC_TILES",
    "codec_tile",
    "Bf16Tile",
    "Fp8RowTile",
    "Int8G64Tile",
    "Nvfp4G16Tile",
    "quantize_bf16_tile",
    "quantize_int8_tile",
    "quantize_fp8_row_tile",
    "quantize_nvfp4_tile",
    "fp8_bits_to_f32",
    "nvfp4_dequantize_halves",
]

TileSource = Callable[[Cols], jax.Array]
"""``x(cols)``: the float32 ``(tokens, cols.n)`` tile of the input vectors' lanes ``cols``."""

TileLoader = Callable[[str, "Cols | int"], jax.Array]
"""``load(plane, cols_or_lane)``: the masked tile of ``plane`` for the kernel's current keys."""


class Put(NamedTuple):
    """One store of an encoded tile: ``value`` into ``plane`` at lanes ``where`` (an int: one lane per token)."""

    plane: str
    value: jax.Array
    where: Cols | int


class CodecTile(Protocol):
    """The tile operations of one codec (see the module docstring)."""

    codec: ClassVar[KVCodec]

    def columns(self, lanes: Lanes) -> tuple[Cols, ...]:
        """The product operands' lanes: one query tile (K codec) or accumulator (V codec) per entry."""

    def encode(self, tensor: str, x: TileSource, lanes: Lanes) -> tuple[Put, ...]:
        """The codes and scales of the tokens whose input lanes ``x`` loads, as stores into ``tensor``'s planes."""

    def decode_keys(self, qs: list, load: TileLoader, lanes: Lanes, cdt) -> jax.Array:
        """Scores ``q . k``, float32 ``(rows, keys)``, of the query tiles ``qs`` (one per column)."""

    def decode_values(self, accs: list, p: jax.Array, load: TileLoader, lanes: Lanes, cdt) -> list:
        """``accs[i] + p @ v`` over column ``i`` of the values, for the probabilities ``p (rows, keys)``."""


# -- quantizers and decoders on tiles ---------------------------------------------------------------


def quantize_bf16_tile(x: jax.Array) -> jax.Array:
    """BF16 codes of a tile (:func:`ninfer_kv.ops.codecs.bf16_code`: round to nearest even, NaN -> 0x7FC0)."""
    return codecs.bf16_code(x)


def quantize_int8_tile(x: jax.Array, head_dim: int | None = None, scale_lanes: int | None = None
                       ) -> tuple[jax.Array, jax.Array]:
    """INT8-G64 rows: ``x (n, Dp)`` -> codes int8 ``(n, Dp)``, scales bf16 ``(n, scale_lanes)``.

    ``head_dim`` (default ``Dp``) is the number of real lanes; lanes past it are padding (zeros).
    ``scale_lanes`` (default ``D / 64``) is the width of the scale tile; lanes past ``D / 64`` hold 0.
    """
    x = codecs.flush_subnormal(x.astype(F32))
    d = x.shape[1] if head_dim is None else head_dim
    scales = [codecs.bf16_scale(amax, codecs.INT8_QMAX) for amax in group_amax(x, 64, d // 64)]
    s = spread(scales, 64, x.shape[1], F32)
    y = div_where(x, s, codecs.scale_usable(s))
    q = codecs.round_half_even(jnp.clip(y, -codecs.INT8_QMAX, codecs.INT8_QMAX))
    return q.astype(jnp.int8), spread(scales, 1, scale_lanes or d // 64, jnp.bfloat16)


def quantize_fp8_row_tile(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """FP8-E4M3FN rows: ``x (n, Dp)`` -> codes e4m3fn ``(n, Dp)``, scale bf16 ``(n,)`` (padding: zeros)."""
    x = codecs.flush_subnormal(x.astype(F32))
    (amax,) = group_amax(x, x.shape[1], 1)
    s = codecs.bf16_scale(amax, codecs.FP8_MAX)
    sf = s.astype(F32)[:, None]
    y = jnp.clip(div_where(x, sf, codecs.scale_usable(sf)), -codecs.FP8_MAX, codecs.FP8_MAX)
    return y.astype(jnp.float8_e4m3fn), s


def quantize_nvfp4_tile(x_even: jax.Array, x_odd: jax.Array, head_dim: int | None = None,
                        scale_lanes: int | None = None) -> tuple[jax.Array, jax.Array]:
    """NVFP4-G16 rows given their even and odd lanes ``(n, Dp / 2)`` each.

    Returns the packed bytes uint8 ``(n, Dp / 2)`` (lane ``2j`` in the low nibble of byte ``j``)
    and the raw e4m3fn bits of the group scales, uint8 ``(n, scale_lanes)`` (default ``D / 16``;
    lanes past ``D / 16`` hold 0).  Byte ``j`` belongs to group ``j // 8``.  ``head_dim`` (default
    ``Dp``) is the number of real lanes.
    """
    x_even = codecs.flush_subnormal(x_even.astype(F32))
    x_odd = codecs.flush_subnormal(x_odd.astype(F32))
    half = x_even.shape[1]
    groups = (2 * half if head_dim is None else head_dim) // 16
    bits = []
    for a_even, a_odd in zip(group_amax(x_even, 8, groups), group_amax(x_odd, 8, groups)):
        nan = codecs.is_nan_bits(a_even) | codecs.is_nan_bits(a_odd)
        bits.append(codecs.nvfp4_scale_bits(codecs.propagate_nan(jnp.maximum(a_even, a_odd), nan)))
    s = spread([fp8_bits_to_f32(v) for v in bits], 8, half, F32)
    ok = codecs.scale_usable(s)

    def nibbles(x):
        c = codecs.e2m1_encode(jnp.clip(div_where(x, s, ok), -codecs.E2M1_MAX, codecs.E2M1_MAX))
        return jnp.where(ok, c, jnp.uint8(0)).astype(jnp.uint8) & jnp.uint8(0xF)

    return nibbles(x_even) | (nibbles(x_odd) << jnp.uint8(4)), spread(bits, 1, scale_lanes or groups, jnp.uint8)


def fp8_bits_to_f32(bits: jax.Array) -> jax.Array:
    """Raw e4m3fn bits (uint8) -> float32."""
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint8), jnp.float8_e4m3fn).astype(F32)


def nvfp4_dequantize_halves(packed: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Packed bytes ``(n, D/2)`` and their expanded float32 scales -> (even lanes, odd lanes) f32."""
    lo = codecs.e2m1_decode(packed & jnp.uint8(0xF)) * scale
    hi = codecs.e2m1_decode(packed >> jnp.uint8(4)) * scale
    return lo, hi


def _row_scale(load: TileLoader, plane: str, lane: int) -> jax.Array:
    """One scale per key, float32 ``(1, keys)``: lane ``lane`` of ``plane``, to scale a product's columns."""
    return load(plane, lane).astype(F32)[None, :]


# -- the tiles -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Bf16Tile:
    """BF16: the codes are the values rounded to bfloat16; all D lanes in one product."""

    codec: ClassVar[KVCodec] = KVCodec.BF16

    def columns(self, lanes: Lanes) -> tuple[Cols, ...]:
        return (lanes.cols(0, 1, lanes.head_dim, operand=True),)

    def encode(self, tensor: str, x: TileSource, lanes: Lanes) -> tuple[Put, ...]:
        cols = lanes.cols(0, 1, lanes.head_dim)
        return (Put(tensor, quantize_bf16_tile(x(cols)), cols),)

    def decode_keys(self, qs: list, load: TileLoader, lanes: Lanes, cdt) -> jax.Array:
        (cols,) = self.columns(lanes)
        return dot(qs[0], load("k", cols).astype(cdt), transpose_b=True)

    def decode_values(self, accs: list, p: jax.Array, load: TileLoader, lanes: Lanes, cdt) -> list:
        (cols,) = self.columns(lanes)
        return [accs[0] + dot(p.astype(cdt), load("v", cols).astype(cdt))]


@dataclasses.dataclass(frozen=True)
class Fp8RowTile:
    """FP8-E4M3FN with one bf16 scale per vector: all D lanes in one product, the scale applied to
    the scores (K) or folded into the probabilities (V)."""

    codec: ClassVar[KVCodec] = KVCodec.FP8_E4M3FN_ROW

    def columns(self, lanes: Lanes) -> tuple[Cols, ...]:
        return (lanes.cols(0, 1, lanes.head_dim, operand=True),)

    def encode(self, tensor: str, x: TileSource, lanes: Lanes) -> tuple[Put, ...]:
        cols = lanes.cols(0, 1, lanes.head_dim)
        codes, scale = quantize_fp8_row_tile(x(cols))
        return (Put(tensor, codes, cols), Put(f"{tensor}_scale", scale, 0))

    def decode_keys(self, qs: list, load: TileLoader, lanes: Lanes, cdt) -> jax.Array:
        (cols,) = self.columns(lanes)
        return dot(qs[0], load("k", cols).astype(cdt), transpose_b=True) * _row_scale(load, "k_scale", 0)

    def decode_values(self, accs: list, p: jax.Array, load: TileLoader, lanes: Lanes, cdt) -> list:
        (cols,) = self.columns(lanes)
        ps = (p * _row_scale(load, "v_scale", 0)).astype(cdt)
        return [accs[0] + dot(ps, load("v", cols).astype(cdt))]


@dataclasses.dataclass(frozen=True)
class Int8G64Tile:
    """INT8 with one bf16 scale per group of 64 lanes: one product per group, each scaled by its group scale."""

    codec: ClassVar[KVCodec] = KVCodec.INT8_G64

    def columns(self, lanes: Lanes) -> tuple[Cols, ...]:
        return tuple(lanes.cols(64 * g, 1, 64, operand=True) for g in range(lanes.head_dim // 64))

    def encode(self, tensor: str, x: TileSource, lanes: Lanes, quantizer=quantize_int8_tile) -> tuple[Put, ...]:
        """``quantizer``: :func:`quantize_int8_tile` or a bit-identical twin of it (a backend's int32 form)."""
        d = lanes.head_dim
        cols, scale_cols = lanes.cols(0, 1, d), lanes.cols(0, 1, d // 64)
        codes, scales = quantizer(x(cols), d, scale_cols.n)
        return (Put(tensor, codes, cols), Put(f"{tensor}_scale", scales, scale_cols))

    def decode_keys(self, qs: list, load: TileLoader, lanes: Lanes, cdt) -> jax.Array:
        total = None
        for g, cols in enumerate(self.columns(lanes)):
            part = dot(qs[g], load("k", cols).astype(cdt), transpose_b=True) * _row_scale(load, "k_scale", g)
            total = part if total is None else total + part
        return total

    def decode_values(self, accs: list, p: jax.Array, load: TileLoader, lanes: Lanes, cdt) -> list:
        out = []
        for g, cols in enumerate(self.columns(lanes)):
            ps = (p * _row_scale(load, "v_scale", g)).astype(cdt)
            out.append(accs[g] + dot(ps, load("v", cols).astype(cdt)))
        return out


@dataclasses.dataclass(frozen=True)
class Nvfp4G16Tile:
    """NVFP4 (E2M1 nibbles, two per byte) with one e4m3fn scale per group of 16 lanes.

    The even and the odd lanes (the low and the high nibbles) go through two products
    (``q_even . lo + q_odd . hi``), so no interleaved tile is ever built; code * scale is exact in
    bfloat16.
    """

    codec: ClassVar[KVCodec] = KVCodec.NVFP4_G16

    def columns(self, lanes: Lanes) -> tuple[Cols, ...]:
        half = lanes.head_dim // 2
        return (lanes.cols(0, 2, half, operand=True), lanes.cols(1, 2, half, operand=True))

    def encode(self, tensor: str, x: TileSource, lanes: Lanes, quantizer=quantize_nvfp4_tile) -> tuple[Put, ...]:
        """``quantizer``: :func:`quantize_nvfp4_tile` or a bit-identical twin of it (a backend's int32 form)."""
        d = lanes.head_dim
        even, odd = lanes.cols(0, 2, d // 2), lanes.cols(1, 2, d // 2)
        packed_cols, scale_cols = lanes.cols(0, 1, d // 2), lanes.cols(0, 1, d // 16)
        packed, scales = quantizer(x(even), x(odd), d, scale_cols.n)
        return (Put(tensor, packed, packed_cols), Put(f"{tensor}_scale", scales, scale_cols))

    @staticmethod
    def _halves(load: TileLoader, plane: str, lanes: Lanes, cdt) -> tuple[jax.Array, jax.Array]:
        """The dequantized even and odd lanes of the keys, each ``(keys, D/2)`` in ``cdt``."""
        half = lanes.head_dim // 2
        packed = load(plane, lanes.cols(0, 1, half, operand=True))
        scale = fp8_bits_to_f32(load(f"{plane}_scale", lanes.cols(0, 1, half, div=8, operand=True)))
        lo, hi = nvfp4_dequantize_halves(packed, scale)
        return lo.astype(cdt), hi.astype(cdt)

    def decode_keys(self, qs: list, load: TileLoader, lanes: Lanes, cdt) -> jax.Array:
        lo, hi = self._halves(load, "k", lanes, cdt)
        return dot(qs[0], lo, transpose_b=True) + dot(qs[1], hi, transpose_b=True)

    def decode_values(self, accs: list, p: jax.Array, load: TileLoader, lanes: Lanes, cdt) -> list:
        lo, hi = self._halves(load, "v", lanes, cdt)
        pc = p.astype(cdt)
        return [accs[0] + dot(pc, lo), accs[1] + dot(pc, hi)]


CODEC_TILES: Mapping[KVCodec, CodecTile] = types.MappingProxyType(
    {tile.codec: tile for tile in (Bf16Tile(), Fp8RowTile(), Int8G64Tile(), Nvfp4G16Tile())}
)
"""The tile object of every codec the Pallas kernels run."""


def codec_tile(codec: KVCodec) -> CodecTile:
    """The tile object of ``codec`` (``ValueError`` naming the codec when it has none)."""
    tile = CODEC_TILES.get(codec)
    if tile is None:
        raise ValueError(f"the Pallas kernels have no tile for codec {codec}; add one to pallas_kernels.common.codec_tiles")
    return tile
