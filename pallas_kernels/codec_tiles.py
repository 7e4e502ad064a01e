"""Codec arithmetic on kernel tiles, without reshapes (Triton-lowerable).

:mod:`ninfer_kv.codecs` states the codecs on ``(..., D)`` vectors and finds group maxima with a
reshape, which Triton kernels cannot do on loaded tiles.  The quantizers here take whole
``(tokens, lanes)`` tiles, find each group's maximum with a masked reduction, spread the group
scales back over the lanes with a select chain, and otherwise repeat the float32 operation
sequence of :mod:`ninfer_kv.codecs` (same amax, same correctly rounded divisions
``codecs.div_rn``, same scale rounding, same clip and rounding), so the codes are bit-identical
to the reference on a CPU.  The elementwise helpers ``div_rn``, ``round_half_even``,
``e2m1_encode`` and ``e2m1_decode`` are reused as they are.  NVFP4 tiles come as their even and
odd lanes (the low and high nibbles of each byte), so packing is a shift and an or.

Column specifications (:class:`Cols`) describe which D-lanes of a vector a tile covers (all lanes,
one group, the even or the odd lanes, or each lane's group index), so that a kernel loads exactly
the lanes it needs.  A tile is a power of two wide; when the lanes are fewer (head dims such as
80, 96, 160 or 192) the tile is padded and ``Cols.mask`` marks the real lanes: loads fill the
padding with zeros and stores skip it.

Non-finite and subnormal inputs follow the rules of :mod:`ninfer_kv.codecs` (whose elementwise
helpers are used as they are): subnormals are flushed in the quantizers, a group holding a NaN gets
a NaN scale (bf16 ``0x7FC0``; NVFP4 scale byte ``0x7F``) and all its codes 0, a group whose scale
is not finite or zero stores codes 0, a BF16 NaN element stores ``0x7FC0``.  NaN is detected on the
bits and propagated explicitly, never through ``max`` (the Triton lowering of ``max`` ignores NaN
operands), and no NaN is ever converted to an integer.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ninfer_kv import codecs
from ninfer_kv.profiles import KVCodec

from .config import next_pow2

__all__ = [
    "Cols",
    "and_masks",
    "pow2_at_least",
    "quantize_bf16_tile",
    "quantize_int8_tile",
    "quantize_fp8_row_tile",
    "quantize_nvfp4_tile",
    "fp8_bits_to_f32",
    "nvfp4_dequantize_halves",
    "value_columns",
]

_F32 = jnp.float32


def pow2_at_least(n: int, floor: int = 1) -> int:
    """The smallest power of two >= ``max(n, floor)``."""
    return next_pow2(max(int(n), int(floor)))


@dataclasses.dataclass(frozen=True)
class Cols:
    """Lanes ``(start + stride * i) // div`` for ``i < n`` (``n`` a power of two).

    Only ``i < count`` are real lanes (``count`` defaults to ``n``); the others pad the tile to a
    power of two.
    """

    start: int
    stride: int
    n: int
    div: int = 1
    count: int | None = None

    @classmethod
    def padded(cls, start: int, stride: int, count: int, *, div: int = 1, floor: int = 1) -> "Cols":
        """``count`` real lanes in a tile of ``pow2_at_least(count, floor)`` lanes."""
        return cls(start, stride, pow2_at_least(count, floor), div, count)

    @property
    def real(self) -> int:
        return self.n if self.count is None else self.count

    def index(self) -> jax.Array:
        """The lane indices as an int32 ``(1, n)`` row (built from an iota inside a kernel).

        Padding lanes all name the first lane past the real ones (``start + stride * count``):
        one past the end of the vector, never loaded or stored (masked), and outside the array,
        so that the interpreter's scatter drops them rather than racing with a real lane.
        """
        i = jax.lax.broadcasted_iota(jnp.int32, (1, self.n), 1)
        if self.real < self.n:
            i = jnp.minimum(i, self.real)
        lanes = self.start + self.stride * i
        if self.div != 1:
            lanes = jax.lax.div(lanes, jnp.int32(self.div))
        return lanes

    def mask(self) -> jax.Array | None:
        """bool ``(1, n)``: the real lanes; ``None`` when every lane is real."""
        if self.real == self.n:
            return None
        return jax.lax.broadcasted_iota(jnp.int32, (1, self.n), 1) < self.real


def and_masks(a: jax.Array | None, b: jax.Array | None) -> jax.Array | None:
    """``a & b`` (broadcasting), where ``None`` means all true."""
    if a is None:
        return b
    if b is None:
        return a
    return a & b


def _div_where(x: jax.Array, s: jax.Array, ok: jax.Array) -> jax.Array:
    """Correctly rounded ``x / s`` where ``ok`` (the scale is usable), 0 elsewhere.

    :func:`ninfer_kv.codecs.div_rn` returns the IEEE quotient whatever the compiler does to a
    division (XLA rewrites ``x / broadcast(s)`` into ``x * (1 / s)``; Triton may divide
    approximately), so the codes are the same in the interpreter, on a GPU and in the reference.
    Lanes outside ``ok`` divide 0 by 1, so no NaN or infinity reaches a later integer conversion.
    """
    return jnp.where(ok, codecs.div_rn(jnp.where(ok, x, 0.0), jnp.where(ok, s, 1.0)), 0.0)


def quantize_bf16_tile(x: jax.Array) -> jax.Array:
    """BF16 codes of a tile (:func:`ninfer_kv.codecs.bf16_code`: round to nearest even, NaN -> 0x7FC0)."""
    return codecs.bf16_code(x)


def _group_amax(x: jax.Array, group: int, groups: int) -> list[jax.Array]:
    """``max |x|`` per group of ``group`` consecutive lanes of ``x (n, m)``, NaN propagated; ``(n,)`` each.

    The first ``groups`` groups only.  Each group is a masked reduction over the whole tile (no
    reshape); NaN lanes enter the maximum as 0 and a group holding one gets NaN afterwards (the
    Triton lowering of ``max`` ignores NaN operands, XLA's CPU one does not always propagate them).
    """
    gid = jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (1, x.shape[1]), 1), jnp.int32(group))
    nan = codecs.is_nan_bits(x)
    a = jnp.where(nan, 0.0, jnp.abs(x))
    nan_f = nan.astype(_F32)
    out = []
    for g in range(groups):
        in_g = gid == g
        amax = jnp.max(jnp.where(in_g, a, 0.0), axis=1)
        out.append(codecs.propagate_nan(amax, jnp.max(jnp.where(in_g, nan_f, 0.0), axis=1) > 0))
    return out


def _spread(values: list[jax.Array], group: int, lanes: int, dtype) -> jax.Array:
    """``(n, lanes)`` tile whose lane ``i`` holds ``values[i // group]`` (a select chain, no reshape).

    Lanes past ``len(values) * group`` hold 0.
    """
    gid = jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (1, lanes), 1), jnp.int32(group))
    out = jnp.zeros((values[0].shape[0], lanes), dtype)
    for g, v in enumerate(values):
        out = jnp.where(gid == g, v.astype(dtype)[:, None], out)
    return out


def quantize_int8_tile(x: jax.Array, head_dim: int | None = None) -> tuple[jax.Array, jax.Array]:
    """INT8-G64 rows: ``x (n, Dp)`` -> codes int8 ``(n, Dp)``, scales bf16 ``(n, pow2(D / 64))``.

    ``head_dim`` (default ``Dp``) is the number of real lanes; lanes past it are padding (zeros).
    """
    x = codecs.flush_subnormal(x.astype(_F32))
    d = x.shape[1] if head_dim is None else head_dim
    scales = [codecs.bf16_scale(amax, codecs.INT8_QMAX) for amax in _group_amax(x, 64, d // 64)]
    s = _spread(scales, 64, x.shape[1], _F32)
    y = _div_where(x, s, codecs.scale_usable(s))
    q = codecs.round_half_even(jnp.clip(y, -codecs.INT8_QMAX, codecs.INT8_QMAX))
    return q.astype(jnp.int8), _spread(scales, 1, pow2_at_least(d // 64), jnp.bfloat16)


def quantize_fp8_row_tile(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """FP8-E4M3FN rows: ``x (n, Dp)`` -> codes e4m3fn ``(n, Dp)``, scale bf16 ``(n,)`` (padding: zeros)."""
    x = codecs.flush_subnormal(x.astype(_F32))
    (amax,) = _group_amax(x, x.shape[1], 1)
    s = codecs.bf16_scale(amax, codecs.FP8_MAX)
    sf = s.astype(_F32)[:, None]
    y = jnp.clip(_div_where(x, sf, codecs.scale_usable(sf)), -codecs.FP8_MAX, codecs.FP8_MAX)
    return y.astype(jnp.float8_e4m3fn), s


def quantize_nvfp4_tile(x_even: jax.Array, x_odd: jax.Array, head_dim: int | None = None) -> tuple[jax.Array, jax.Array]:
    """NVFP4-G16 rows given their even and odd lanes ``(n, Dp / 2)`` each.

    Returns the packed bytes uint8 ``(n, Dp / 2)`` (lane ``2j`` in the low nibble of byte ``j``)
    and the raw e4m3fn bits of the group scales, uint8 ``(n, pow2(D / 16))``.  Byte ``j`` belongs
    to group ``j // 8``.  ``head_dim`` (default ``Dp``) is the number of real lanes.
    """
    x_even = codecs.flush_subnormal(x_even.astype(_F32))
    x_odd = codecs.flush_subnormal(x_odd.astype(_F32))
    half = x_even.shape[1]
    groups = (2 * half if head_dim is None else head_dim) // 16
    bits = []
    for a_even, a_odd in zip(_group_amax(x_even, 8, groups), _group_amax(x_odd, 8, groups)):
        nan = codecs.is_nan_bits(a_even) | codecs.is_nan_bits(a_odd)
        bits.append(codecs.nvfp4_scale_bits(codecs.propagate_nan(jnp.maximum(a_even, a_odd), nan)))
    s = _spread([fp8_bits_to_f32(v) for v in bits], 8, half, _F32)
    ok = codecs.scale_usable(s)

    def nibbles(x):
        c = codecs.e2m1_encode(jnp.clip(_div_where(x, s, ok), -codecs.E2M1_MAX, codecs.E2M1_MAX))
        return jnp.where(ok, c, jnp.uint8(0)).astype(jnp.uint8) & jnp.uint8(0xF)

    return nibbles(x_even) | (nibbles(x_odd) << jnp.uint8(4)), _spread(bits, 1, pow2_at_least(groups), jnp.uint8)


def fp8_bits_to_f32(bits: jax.Array) -> jax.Array:
    """Raw e4m3fn bits (uint8) -> float32."""
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint8), jnp.float8_e4m3fn).astype(_F32)


def nvfp4_dequantize_halves(packed: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Packed bytes ``(n, D/2)`` and their expanded float32 scales -> (even lanes, odd lanes) f32."""
    lo = codecs.e2m1_decode(packed & jnp.uint8(0xF)) * scale
    hi = codecs.e2m1_decode(packed >> jnp.uint8(4)) * scale
    return lo, hi


def value_columns(codec: KVCodec, head_dim: int) -> tuple[Cols, ...]:
    """How a kernel splits the D lanes of a vector for ``codec``'s products.

    BF16 and FP8 rows use all D lanes at once; INT8-G64 one group of 64 lanes per product (the
    scale differs per group); NVFP4 the even and the odd lanes (the two nibbles of each byte).
    Tiles are padded to a power of two of at least 16 lanes (the tensor-core minimum).
    """
    if codec is KVCodec.INT8_G64:
        return tuple(Cols(64 * g, 1, 64) for g in range(head_dim // 64))
    if codec is KVCodec.NVFP4_G16:
        return (Cols.padded(0, 2, head_dim // 2, floor=16), Cols.padded(1, 2, head_dim // 2, floor=16))
    return (Cols.padded(0, 1, head_dim, floor=16),)
