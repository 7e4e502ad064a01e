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
the lanes it needs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ninfer_kv import codecs
from ninfer_kv.profiles import KVCodec

__all__ = [
    "Cols",
    "quantize_bf16_tile",
    "quantize_int8_tile",
    "quantize_fp8_row_tile",
    "quantize_nvfp4_tile",
    "fp8_bits_to_f32",
    "nvfp4_dequantize_halves",
    "value_columns",
]

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Cols:
    """Lanes ``(start + stride * i) // div`` for ``i < n`` (``n`` a power of two)."""

    start: int
    stride: int
    n: int
    div: int = 1

    def index(self) -> jax.Array:
        """The lane indices as an int32 ``(1, n)`` row (built from an iota inside a kernel)."""
        i = jax.lax.broadcasted_iota(jnp.int32, (1, self.n), 1)
        lanes = self.start + self.stride * i
        if self.div != 1:
            lanes = jax.lax.div(lanes, jnp.int32(self.div))
        return lanes


def _safe_div(x: jax.Array, s: jax.Array) -> jax.Array:
    """Correctly rounded ``x / s`` where ``s != 0``, 0 where ``s == 0`` (as :mod:`ninfer_kv.codecs`).

    :func:`ninfer_kv.codecs.div_rn` returns the IEEE quotient whatever the compiler does to a
    division (XLA rewrites ``x / broadcast(s)`` into ``x * (1 / s)``; Triton may divide
    approximately), so the codes are the same in the interpreter, on a GPU and in the reference.
    """
    nz = s != 0
    return jnp.where(nz, codecs.div_rn(x, jnp.where(nz, s, 1.0)), 0.0)


def quantize_bf16_tile(x: jax.Array) -> jax.Array:
    """BF16 codes of a tile (round to nearest even)."""
    return x.astype(jnp.bfloat16)


def _const_like(a: jax.Array, value: float) -> jax.Array:
    """``value`` as a float32 array shaped like ``a`` (a scalar constant cannot be bitcast in Triton)."""
    return jnp.full(a.shape, value, _F32)


def _group_max(a: jax.Array, group: int) -> list[jax.Array]:
    """Per-group maxima of ``a (n, m)`` over consecutive lanes, one ``(n,)`` vector per group.

    Each group is a masked reduction over the whole tile (no reshape); ``a`` must be >= 0.
    """
    gid = jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (1, a.shape[1]), 1), jnp.int32(group))
    return [jnp.max(jnp.where(gid == g, a, 0.0), axis=1) for g in range(a.shape[1] // group)]


def _spread(values: list[jax.Array], group: int, lanes: int, dtype) -> jax.Array:
    """``(n, lanes)`` tile whose lane ``i`` holds ``values[i // group]`` (a select chain, no reshape)."""
    gid = jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (1, lanes), 1), jnp.int32(group))
    out = jnp.zeros((values[0].shape[0], lanes), dtype)
    for g, v in enumerate(values):
        out = jnp.where(gid == g, v.astype(dtype)[:, None], out)
    return out


def quantize_int8_tile(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """INT8-G64 rows: ``x (n, D)`` -> codes int8 ``(n, D)``, scales bf16 ``(n, D / 64)``."""
    x = x.astype(_F32)
    d = x.shape[1]
    scales = [
        codecs.div_rn(amax, _const_like(amax, codecs.INT8_QMAX)).astype(jnp.bfloat16)
        for amax in _group_max(jnp.abs(x), 64)
    ]
    y = _safe_div(x, _spread(scales, 64, d, _F32))
    q = codecs.round_half_even(jnp.clip(y, -codecs.INT8_QMAX, codecs.INT8_QMAX))
    return q.astype(jnp.int8), _spread(scales, 1, d // 64, jnp.bfloat16)


def quantize_fp8_row_tile(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """FP8-E4M3FN rows: ``x (n, D)`` -> codes e4m3fn ``(n, D)``, scale bf16 ``(n,)``."""
    x = x.astype(_F32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    s = codecs.div_rn(amax, _const_like(amax, codecs.FP8_MAX)).astype(jnp.bfloat16)
    y = _safe_div(x, s.astype(_F32)[:, None])
    return jnp.clip(y, -codecs.FP8_MAX, codecs.FP8_MAX).astype(jnp.float8_e4m3fn), s


def quantize_nvfp4_tile(x_even: jax.Array, x_odd: jax.Array) -> tuple[jax.Array, jax.Array]:
    """NVFP4-G16 rows given their even and odd lanes ``(n, D / 2)`` each.

    Returns the packed bytes uint8 ``(n, D / 2)`` (lane ``2j`` in the low nibble of byte ``j``) and
    the raw e4m3fn bits of the group scales, uint8 ``(n, D / 16)``.  Byte ``j`` belongs to group
    ``j // 8``.
    """
    x_even = x_even.astype(_F32)
    x_odd = x_odd.astype(_F32)
    half = x_even.shape[1]
    amax = [jnp.maximum(a, b) for a, b in zip(_group_max(jnp.abs(x_even), 8), _group_max(jnp.abs(x_odd), 8))]
    sb = [
        jnp.minimum(codecs.div_rn(a, _const_like(a, codecs.E2M1_MAX)), codecs.FP8_MAX).astype(jnp.float8_e4m3fn)
        for a in amax
    ]
    bits = [jax.lax.bitcast_convert_type(v, jnp.uint8) for v in sb]
    s = _spread([v.astype(_F32) for v in sb], 8, half, _F32)

    def nibbles(x):
        c = codecs.e2m1_encode(jnp.clip(_safe_div(x, s), -codecs.E2M1_MAX, codecs.E2M1_MAX))
        return jnp.where(s != 0, c, jnp.uint8(0)).astype(jnp.uint8) & jnp.uint8(0xF)

    return nibbles(x_even) | (nibbles(x_odd) << jnp.uint8(4)), _spread(bits, 1, half // 8, jnp.uint8)


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
    """
    if codec is KVCodec.INT8_G64:
        return tuple(Cols(64 * g, 1, 64) for g in range(head_dim // 64))
    if codec is KVCodec.NVFP4_G16:
        return (Cols(0, 2, head_dim // 2), Cols(1, 2, head_dim // 2))
    return (Cols(0, 1, head_dim),)
