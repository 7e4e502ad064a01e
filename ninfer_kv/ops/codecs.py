"""The closed KV codecs as jnp functions (usable inside ``jax.jit`` and inside Pallas kernels).

Every function works on the last axis (``D`` for inputs, the plane extent ``X`` for codes and
scales) and broadcasts over leading axes.  All arithmetic is float32; the rules (also tabulated in
docs/LAYOUT.md, "Codec rules") are:

* BF16: ``code = bf16(x)`` (round to nearest even).
* INT8-G64: per group of 64, ``s = bf16(amax / 127)``; ``code = int8(clip(rint(x / s), -127, 127))``.
* FP8-E4M3FN-row: per (token, head) row, ``s = bf16(amax / 448)``; ``code = e4m3fn(clip(x / s, ±448))``.
* NVFP4-G16: per group of 16, ``sb = e4m3fn(min(amax / 6, 448))`` stored as raw uint8 bits,
  ``s = float(sb)``; ``code = e2m1(clip(x / s, ±6))`` (ties to the even code), element ``2j`` in the
  low nibble of byte ``j``.
* A zero scale stores codes 0.  Dequantize: ``x' = float(code) * s``.

Odd values have one answer on every path (reference, FFI, Pallas interpret, GPU), decided by bit
tests and selects rather than by how a platform's float unit treats them:

* **Subnormals are flushed in the quantizers' arithmetic**: in INT8-G64, FP8-row and NVFP4-G16 a
  float32 input element (after the bf16 -> float32 widening) whose exponent field is zero reads as
  zero of the same sign, and a scale quotient (``amax / 127``, ``amax / 448``, ``amax / 6``) that
  is subnormal becomes +0.  This is what XLA's CPU compiler does implicitly (FTZ + DAZ); doing it
  explicitly makes a GPU (which keeps subnormals) produce the same bits.  e4m3fn and e2m1
  subnormal *codes* are regular values of those formats and are unaffected.  The BF16 codec does
  no arithmetic: its rounding works on the bit pattern, so a subnormal input gives the correctly
  rounded (possibly subnormal) bf16 code on every path.
* **NaN propagates through amax** explicitly (a per-group NaN test, never ``reduce_max``'s NaN
  behaviour, which XLA's CPU compiler does not guarantee): the group's bf16 scale is the canonical
  quiet NaN ``0x7FC0``, the NVFP4 scale byte is ``0x7F``.
* **A scale that is zero or not finite stores codes 0** (int8 0, e4m3fn 0x00, e2m1 nibble 0), so
  no float -> int conversion of a NaN or an infinity is ever executed; an infinite amax gives the
  bf16 scale +inf (``0x7F80``).  NVFP4 clamps its scale to 448, so an infinite element there
  gives the finite scale 448 and clips to the code +-6.
* BF16 codes of NaN inputs are the canonical quiet NaN ``0x7FC0`` (sign and payload dropped);
  infinities and values that round above the bf16 range give +-inf.

Only operations that the Pallas Triton lowering accepts are used on the element path (no
``round``/``rint``, no 4-bit dtypes, no slicing of loaded values): rounding to nearest even is
exact floor/fraction arithmetic, e2m1 encoding is a sum of comparisons, and every division of the
rules goes through :func:`div_rn`, which returns the IEEE quotient even where XLA rewrites
``x / s`` into ``x * (1 / s)``.  A kernel that calls these helpers on its tiles produces codes
bit-identical to the reference (and to a numpy implementation of the rules) on CPU.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from ..schema.profiles import KVCodec, KVProfile

__all__ = [
    "div_rn",
    "flush_subnormal",
    "is_nan_bits",
    "propagate_nan",
    "bf16_scale",
    "nvfp4_scale_bits",
    "scale_usable",
    "bf16_code",
    "round_half_even",
    "e2m1_encode",
    "e2m1_decode",
    "quantize_bf16",
    "quantize_int8_g64",
    "quantize_fp8_row",
    "quantize_nvfp4_g16",
    "dequantize_bf16",
    "dequantize_int8_g64",
    "dequantize_fp8_row",
    "dequantize_nvfp4_g16",
    "pack_nibbles",
    "unpack_nibbles",
    "CodecReference",
    "CODEC_REFERENCES",
    "quantize",
    "dequantize",
    "encode_kv",
    "decode_kv",
    "codec_roundtrip",
]

_F32 = jnp.float32
INT8_QMAX = 127.0
FP8_MAX = 448.0
E2M1_MAX = 6.0
BF16_NAN_BITS = 0x7FC0
"""The canonical quiet NaN of the bf16 planes (scales of NaN groups, BF16 codes of NaN inputs)."""
E4M3FN_NAN_BITS = 0x7F
"""The NVFP4 scale byte of a NaN group (e4m3fn NaN)."""

_U32 = jnp.uint32
_EXP_MASK = 0x7F800000
_SIGN_MASK = 0x80000000


def _bits32(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(jnp.asarray(x, _F32), _U32)


def flush_subnormal(x: jax.Array) -> jax.Array:
    """float32 ``x`` with every subnormal replaced by zero of the same sign (bit test, no arithmetic)."""
    b = _bits32(x)
    sub = (b & _U32(_EXP_MASK)) == 0
    return jax.lax.bitcast_convert_type(jnp.where(sub, b & _U32(_SIGN_MASK), b), _F32)


def is_nan_bits(x: jax.Array) -> jax.Array:
    """``isnan`` of float32 ``x`` decided on its bits (immune to fast-math and DAZ rewrites)."""
    return (_bits32(x) & _U32(0x7FFFFFFF)) > _U32(_EXP_MASK)


def propagate_nan(amax: jax.Array, has_nan: jax.Array) -> jax.Array:
    """``amax`` where ``has_nan`` is false, NaN where it is true (explicit amax NaN propagation)."""
    return jnp.where(has_nan, jnp.float32(jnp.nan), amax)


def bf16_scale(amax: jax.Array, qmax: float) -> jax.Array:
    """The bf16 scale ``bf16(amax / qmax)`` of INT8-G64 / FP8 rows (float32 ``amax``, NaN propagated).

    The quotient is the IEEE one (:func:`div_rn`), a subnormal quotient becomes +0, and a NaN
    ``amax`` gives the canonical quiet NaN ``0x7FC0``.
    """
    amax = jnp.asarray(amax, _F32)
    s = flush_subnormal(div_rn(amax, jnp.full(amax.shape, qmax, _F32))).astype(jnp.bfloat16)
    bits = jax.lax.bitcast_convert_type(s, jnp.uint16)
    bits = jnp.where(is_nan_bits(amax), jnp.uint16(BF16_NAN_BITS), bits)
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


def nvfp4_scale_bits(amax: jax.Array) -> jax.Array:
    """Raw uint8 bits of the NVFP4 scale ``e4m3fn(min(amax / 6, 448))``; a NaN ``amax`` gives 0x7F."""
    amax = jnp.asarray(amax, _F32)
    q = flush_subnormal(div_rn(amax, jnp.full(amax.shape, E2M1_MAX, _F32)))
    nan = is_nan_bits(amax)
    sb = jnp.minimum(jnp.where(nan, 0.0, q), FP8_MAX).astype(jnp.float8_e4m3fn)
    bits = jax.lax.bitcast_convert_type(sb, jnp.uint8)
    return jnp.where(nan, jnp.uint8(E4M3FN_NAN_BITS), bits)


def scale_usable(s: jax.Array) -> jax.Array:
    """Whether a (float32-widened) scale is finite and nonzero: only then are codes computed."""
    a = _bits32(s) & _U32(0x7FFFFFFF)
    return (a != 0) & (a < _U32(_EXP_MASK))


def bf16_code(x: jax.Array) -> jax.Array:
    """BF16 codes: ``bf16(x)``, round to nearest even on the float32 bit pattern; NaN -> 0x7FC0.

    Integer arithmetic only, so the result never depends on how a platform converts (a hardware
    bf16 conversion may flush subnormals); subnormal inputs round like any other value.
    """
    b = _bits32(jnp.asarray(x).astype(_F32))
    rounded = (b + _U32(0x7FFF) + ((b >> 16) & _U32(1))) >> 16
    bits = jnp.where(is_nan_bits(jax.lax.bitcast_convert_type(b, _F32)), _U32(BF16_NAN_BITS), rounded)
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)


def round_half_even(y: jax.Array) -> jax.Array:
    """Round float32 ``y`` (|y| < 2**31) to the nearest integer, ties to even, without ``rint``.

    ``floor`` and the exact fraction ``y - floor(y)`` decide the rounding, so the result equals
    ``numpy.rint`` in value (a negative input that rounds to zero gives +0.0) and cannot be folded
    away by an algebraic simplifier (the usual ``(y + 1.5 * 2**23) - 1.5 * 2**23`` trick can).
    """
    y = y.astype(_F32)
    t = jnp.floor(y)
    f = y - t
    odd = (t.astype(jnp.int32) & 1) == 1
    up = (f > 0.5) | ((f == 0.5) & odd)
    return t + up.astype(_F32)


def _group_amax(x: jax.Array, group: int) -> jax.Array:
    """``max |x|`` over groups of ``group`` along the last axis: ``(..., D) -> (..., D // group)``.

    NaN propagates explicitly: NaN elements enter the maximum as 0 and a group holding one gets
    NaN afterwards (XLA's CPU ``reduce_max`` drops NaN for some shapes).
    """
    d = x.shape[-1]
    shape = x.shape[:-1] + (d // group, group)
    nan = is_nan_bits(x)
    g = jnp.where(nan, 0.0, jnp.abs(x)).reshape(shape)
    return propagate_nan(jnp.max(g, axis=-1), jnp.any(nan.reshape(shape), axis=-1))


def _expand(s: jax.Array, group: int) -> jax.Array:
    """Repeat each scale ``group`` times along the last axis: ``(..., G) -> (..., G * group)``."""
    return jnp.repeat(s, group, axis=-1, total_repeat_length=s.shape[-1] * group)


def _div_rn_normalized(am: jax.Array, bm: jax.Array) -> jax.Array:
    """Correctly rounded ``am / bm`` for ``am, bm`` in ``[1, 2)``, ``bm`` with <= 12 significant bits."""
    u32 = jnp.uint32
    q = am / bm  # the compiler may turn this into am * (1 / bm): within about one ulp
    qbits = jax.lax.bitcast_convert_type(q, u32)

    def residual(cbits):
        c = jax.lax.bitcast_convert_type(cbits, _F32)
        hi = jax.lax.bitcast_convert_type(cbits & u32(0xFFFFF000), _F32)
        lo = c - hi  # exact: the low 12 significand bits
        # hi * bm and lo * bm are exact (<= 24 bits); both subtractions are exact (Sterbenz)
        return jnp.abs((am - hi * bm) - lo * bm)

    best_bits, best_r = qbits, residual(qbits)
    for cand in (qbits + u32(1), qbits - u32(1)):
        r = residual(cand)
        better = (r < best_r) | ((r == best_r) & ((cand & u32(1)) == 0))
        best_bits = jnp.where(better, cand, best_bits)
        best_r = jnp.where(better, r, best_r)
    return best_bits


def div_rn(a: ArrayLike, b: ArrayLike) -> jax.Array:
    """Correctly rounded float32 ``a / b`` (IEEE round to nearest even), whatever the compiler does.

    XLA's algebraic simplifier rewrites ``a / constant`` and ``a / broadcast(s)`` into
    ``a * (1 / s)``, which is off by one ulp often enough to change a bf16 scale or an e4m3 /
    e2m1 / int8 code at a rounding boundary (bf16 inputs hit exact e4m3 ties regularly).  Here the
    significands of ``a`` and ``b`` are divided (the compiler's quotient is within about one ulp),
    the IEEE quotient is picked among that value and its two neighbours by the smallest exact
    residual ``a - c * b`` (ties to the even significand), and the exponents are put back exactly.

    Precondition: ``b`` has at most 12 significant bits (bf16 and e4m3 scales, the constants 127,
    448 and 6), which makes the residual exact.  Zero, subnormal, infinite or NaN operands and
    quotients outside the normal range are returned as the compiler's ``a / b``.  Only float
    arithmetic, bitcasts, integer bit operations and selects are used (Pallas Triton lowers them).
    """
    a = jnp.asarray(a, _F32)
    b = jnp.asarray(b, _F32)
    u32, i32 = jnp.uint32, jnp.int32
    plain = a / b
    abits = jax.lax.bitcast_convert_type(a, u32)
    bbits = jax.lax.bitcast_convert_type(b, u32)
    ea = ((abits >> 23) & u32(0xFF)).astype(i32)
    eb = ((bbits >> 23) & u32(0xFF)).astype(i32)
    one = u32(0x3F800000)
    am = jax.lax.bitcast_convert_type((abits & u32(0x007FFFFF)) | one, _F32)
    bm = jax.lax.bitcast_convert_type((bbits & u32(0x007FFFFF)) | one, _F32)
    qbits = _div_rn_normalized(am, bm)  # quotient of significands, in (0.5, 2)
    e = ((qbits >> 23) & u32(0xFF)).astype(i32) + ea - eb
    sign = (abits ^ bbits) & u32(0x80000000)
    exact = jax.lax.bitcast_convert_type((qbits & u32(0x007FFFFF)) | (e.astype(u32) << 23) | sign, _F32)
    regular = (ea > 0) & (ea < 255) & (eb > 0) & (eb < 255) & (e >= 1) & (e <= 254)
    return jnp.where(regular, exact, plain)


def _safe_div(x: jax.Array, s_full: jax.Array) -> jax.Array:
    """``x / s`` (correctly rounded) where the scale is usable; 0 where it is zero or not finite."""
    ok = scale_usable(s_full)
    return jnp.where(ok, div_rn(x, jnp.where(ok, s_full, 1.0)), 0.0)


# -- e2m1 ------------------------------------------------------------------------------------------


def e2m1_encode(y: jax.Array) -> jax.Array:
    """float32 (already clipped to [-6, 6]) -> 4-bit e2m1 code in a uint8 (sign bit 8).

    Round to nearest, ties to the even code, exactly as ``ml_dtypes.float4_e2m1fn`` converts:
    magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 are codes 0..7.  Negative zero keeps its sign bit.
    """
    y = y.astype(_F32)
    a = jnp.abs(y)
    m = (
        (a > 0.25).astype(jnp.uint8)
        + (a >= 0.75).astype(jnp.uint8)
        + (a > 1.25).astype(jnp.uint8)
        + (a >= 1.75).astype(jnp.uint8)
        + (a > 2.5).astype(jnp.uint8)
        + (a >= 3.5).astype(jnp.uint8)
        + (a > 5.0).astype(jnp.uint8)
    )
    sign = (jax.lax.bitcast_convert_type(y, jnp.uint32) >> 31).astype(jnp.uint8)
    return m | (sign << 3)


def e2m1_decode(code: jax.Array) -> jax.Array:
    """4-bit e2m1 code (in the low nibble of a uint8/int) -> float32 value."""
    c = code.astype(jnp.int32)
    e = (c >> 1) & 3
    mant = (c & 1).astype(_F32)
    normal = (1.0 + 0.5 * mant) * jnp.left_shift(1, jnp.maximum(e - 1, 0)).astype(_F32)
    mag = jnp.where(e == 0, 0.5 * mant, normal)
    return jnp.where((c & 8) != 0, -mag, mag)


def pack_nibbles(codes: jax.Array) -> jax.Array:
    """(..., D) uint8 nibbles -> (..., D // 2) bytes: element 2j low nibble, 2j+1 high nibble."""
    pairs = codes.reshape(codes.shape[:-1] + (codes.shape[-1] // 2, 2))
    return (pairs[..., 0] & 0xF) | ((pairs[..., 1] & 0xF) << 4)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """(..., D // 2) bytes -> (..., D) uint8 nibbles."""
    p = packed.astype(jnp.uint8)
    both = jnp.stack([p & 0xF, p >> 4], axis=-1)
    return both.reshape(p.shape[:-1] + (p.shape[-1] * 2,))


# -- quantize --------------------------------------------------------------------------------------


def quantize_bf16(x: jax.Array) -> tuple[jax.Array, None]:
    """BF16 codes of ``x (..., D)``: ``(bfloat16 (..., D), None)`` (no scale; see :func:`bf16_code`)."""
    return bf16_code(x), None


def quantize_int8_g64(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """INT8-G64 codes of ``x (..., D)``, ``D`` a multiple of 64 (not checked here; :func:`quantize` checks).

    Returns ``(int8 (..., D), bfloat16 (..., D // 64))``: per group of 64 elements the scale
    ``s = bf16(amax / 127)`` and codes ``rint(x / s)`` clipped to ``[-127, 127]`` (0 where ``s`` is
    zero or not finite).
    """
    x = flush_subnormal(x.astype(_F32))
    s = bf16_scale(_group_amax(x, 64), INT8_QMAX)
    y = _safe_div(x, _expand(s.astype(_F32), 64))
    q = round_half_even(jnp.clip(y, -INT8_QMAX, INT8_QMAX))
    return q.astype(jnp.int8), s


def quantize_fp8_row(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """FP8-E4M3FN-row codes of ``x (..., D)``, any ``D``.

    Returns ``(float8_e4m3fn (..., D), bfloat16 (..., 1))``: one scale ``s = bf16(amax / 448)`` per
    row of ``D`` elements and codes ``e4m3fn(x / s)`` clipped to ``[-448, 448]`` (0 where ``s`` is
    zero or not finite).
    """
    x = flush_subnormal(x.astype(_F32))
    s = bf16_scale(_group_amax(x, x.shape[-1]), FP8_MAX)
    y = _safe_div(x, s.astype(_F32))
    return jnp.clip(y, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn), s


def quantize_nvfp4_g16(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """NVFP4-G16 codes of ``x (..., D)``, ``D`` a multiple of 16 (not checked here; :func:`quantize` checks).

    Returns ``(uint8 (..., D // 2), uint8 (..., D // 16))``: e2m1 codes packed two per byte
    (element ``2j`` in the low nibble of byte ``j``) and, per group of 16, the raw bits of the
    e4m3fn scale ``min(amax / 6, 448)`` (codes 0 where the scale is zero or not finite).
    """
    x = flush_subnormal(x.astype(_F32))
    s_bits = nvfp4_scale_bits(_group_amax(x, 16))
    s = _expand(jax.lax.bitcast_convert_type(s_bits, jnp.float8_e4m3fn).astype(_F32), 16)
    codes = e2m1_encode(jnp.clip(_safe_div(x, s), -E2M1_MAX, E2M1_MAX))
    codes = jnp.where(scale_usable(s), codes, 0).astype(jnp.uint8)
    return pack_nibbles(codes), s_bits


# -- dequantize ------------------------------------------------------------------------------------


def dequantize_bf16(code: jax.Array, scale: jax.Array | None = None) -> jax.Array:
    """float32 ``(..., D)`` of bfloat16 codes ``(..., D)``; ``scale`` is ignored (BF16 has none)."""
    return code.astype(_F32)


def dequantize_int8_g64(code: jax.Array, scale: jax.Array) -> jax.Array:
    """float32 ``(..., D)`` of int8 codes ``(..., D)`` and bfloat16 scales ``(..., D // 64)``: ``code * s``."""
    return code.astype(_F32) * _expand(scale.astype(_F32), 64)


def dequantize_fp8_row(code: jax.Array, scale: jax.Array) -> jax.Array:
    """float32 ``(..., D)`` of float8_e4m3fn codes ``(..., D)`` and bfloat16 row scales ``(..., 1)``: ``code * s``."""
    return code.astype(_F32) * scale.astype(_F32)


def dequantize_nvfp4_g16(code: jax.Array, scale: jax.Array) -> jax.Array:
    """float32 ``(..., D)`` of packed e2m1 codes ``uint8 (..., D // 2)`` and e4m3fn scale bits
    ``uint8 (..., D // 16)``: ``e2m1(code) * s``."""
    s = jax.lax.bitcast_convert_type(scale.astype(jnp.uint8), jnp.float8_e4m3fn).astype(_F32)
    return e2m1_decode(unpack_nibbles(code)) * _expand(s, 16)


# -- the reference table ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class CodecReference:
    """One codec's float32 reference functions: the semantics every kernel is tested against.

    Attributes:
      quantize: ``x (..., D) -> (code (..., X), scale (..., Xs) or None)``, without the head-dim
        check (:func:`quantize` checks).
      dequantize: ``(code, scale or None) -> float32 (..., D)``.
    """

    quantize: Callable[[jax.Array], tuple[jax.Array, jax.Array | None]]
    dequantize: Callable[[jax.Array, jax.Array | None], jax.Array]


CODEC_REFERENCES: Mapping[KVCodec, CodecReference] = types.MappingProxyType({
    KVCodec.BF16: CodecReference(quantize=quantize_bf16, dequantize=dequantize_bf16),
    KVCodec.INT8_G64: CodecReference(quantize=quantize_int8_g64, dequantize=dequantize_int8_g64),
    KVCodec.FP8_E4M3FN_ROW: CodecReference(quantize=quantize_fp8_row, dequantize=dequantize_fp8_row),
    KVCodec.NVFP4_G16: CodecReference(quantize=quantize_nvfp4_g16, dequantize=dequantize_nvfp4_g16),
})
"""The reference table: one :class:`CodecReference` per :class:`~ninfer_kv.schema.profiles.KVCodec` (the
JAX half of a codec's row; its storage facts are its row of :data:`ninfer_kv.schema.profiles.CODEC_SPECS`)."""

if list(CODEC_REFERENCES) != list(KVCodec):  # checked at import: exactly one row per codec, in KVCodec's order
    raise RuntimeError(f"CODEC_REFERENCES must have one row per KVCodec, in its order; rows {list(CODEC_REFERENCES)}, "
                       f"codecs {list(KVCodec)}")


def quantize(codec: KVCodec, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """Quantize ``x`` (..., D) with ``codec`` -> (code (..., X), scale (..., Xs) or None)."""
    codec.check_head_dim(x.shape[-1])
    return CODEC_REFERENCES[codec].quantize(x)


def dequantize(codec: KVCodec, code: jax.Array, scale: jax.Array | None) -> jax.Array:
    """Dequantize codes (and scales) of ``codec`` to float32 (..., D)."""
    return CODEC_REFERENCES[codec].dequantize(code, scale)


def encode_kv(profile: KVProfile, k: jax.Array, v: jax.Array) -> dict[str, jax.Array]:
    """Quantize K and V (..., D) with ``profile`` into plane values keyed like the layout's planes."""
    profile = KVProfile.parse(profile)
    out = {}
    for tensor, x in (("k", k), ("v", v)):
        code, scale = quantize(profile.codec(tensor), x)
        out[tensor] = code
        if scale is not None:
            out[f"{tensor}_scale"] = scale
    return out


def decode_kv(profile: KVProfile, planes: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Dequantize plane values (as produced by :func:`encode_kv`) to float32 K and V."""
    profile = KVProfile.parse(profile)
    k = dequantize(profile.k_codec, planes["k"], planes.get("k_scale"))
    v = dequantize(profile.v_codec, planes["v"], planes.get("v_scale"))
    return k, v


def codec_roundtrip(profile: KVProfile, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """float32 K, V after the profile's quantize + dequantize (what a consumer of the cache sees)."""
    return decode_kv(profile, encode_kv(profile, k, v))
