// Exact scalar conversions of the closed codecs (bit-identical to the jnp codecs under XLA).
//
//  * float32 -> bfloat16: round to nearest even on the bit pattern; every NaN becomes 0x7FC0.
//  * float32 -> float8_e4m3fn: round to nearest even, e4m3fn subnormals (multiples of 2^-9)
//    exact, magnitudes that round above 448 become NaN (the format has no infinity).
//  * float32 -> e2m1 code: the comparison ladder of codecs.e2m1_encode (ties to the even code).
//  * Decoders are exact and never touch denormal arithmetic.
#ifndef NINFER_KV_FFI_SCALAR_CODEC_H_
#define NINFER_KV_FFI_SCALAR_CODEC_H_

#include <cstdint>

#include "common.h"

NINFER_KV_NAMESPACE_BEGIN

// Canonical quiet NaN of the bf16 planes (sign and payload of a NaN input are not kept).
constexpr uint16_t kBf16CanonicalNan = 0x7FC0u;

inline uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return kBf16CanonicalNan;
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Shift right by `sh` (1..31) rounding to nearest, ties to even.
inline uint32_t ShiftRne(uint32_t m, int sh) {
  uint32_t q = m >> sh;
  uint32_t rem = m & ((1u << sh) - 1u);
  uint32_t half = 1u << (sh - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return q;
}

inline uint8_t FloatToE4m3fn(float f) {
  uint32_t u = FloatBits(f);
  uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  uint32_t a = u & 0x7FFFFFFFu;
  if (a >= 0x7F800000u) return sign | 0x7Fu;  // inf or NaN -> NaN
  int e = static_cast<int>(a >> 23);        // biased float32 exponent
  if (e == 0) return sign;                   // zero or float32 subnormal: far below 2^-10
  uint32_t m24 = (a & 0x7FFFFFu) | 0x800000u;
  if (e < 121) {                             // below 2^-6: e4m3fn subnormal, unit 2^-9
    int sh = 141 - e;
    if (sh > 25) return sign;
    uint32_t q = ShiftRne(m24, sh);          // 0..8; 8 is the smallest normal (code 0x08)
    return sign | static_cast<uint8_t>(q);
  }
  uint32_t q = ShiftRne(m24, 20);            // 8..16 (1.mmm with 3 mantissa bits)
  int e8 = e - 120;
  if (q == 16) {
    q = 8;
    ++e8;
  }
  if (e8 > 15 || (e8 == 15 && (q & 7u) == 7u)) return sign | 0x7Fu;  // above 448 -> NaN
  return sign | static_cast<uint8_t>((e8 << 3) | (q & 7u));
}

inline float E4m3fnToFloat(uint8_t b) {
  uint32_t sign = uint32_t(b & 0x80u) << 24;
  uint32_t em = b & 0x7Fu;
  if (em == 0x7Fu) return BitsFloat(sign | 0x7FC00000u);
  if ((em >> 3) == 0) {
    float mag = static_cast<float>(em) * 0.001953125f;  // m * 2^-9 (a normal float32)
    return BitsFloat(FloatBits(mag) | sign);
  }
  return BitsFloat(sign | ((em << 20) + (120u << 23)));
}

// e2m1 code (sign in bit 3) of a float already clipped to [-6, 6].
inline uint8_t FloatToE2m1(float y) {
  float a = BitsFloat(FloatBits(y) & 0x7FFFFFFFu);  // |y|; the sign comes from the bits below
  uint8_t m = static_cast<uint8_t>((a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                                   (a >= 3.5f) + (a > 5.0f));
  uint8_t sign = static_cast<uint8_t>(FloatBits(y) >> 31);
  return static_cast<uint8_t>(m | (sign << 3));
}

inline float E2m1ToFloat(uint8_t c) {
  uint32_t e = (c >> 1) & 3u, m = c & 1u;
  uint32_t bits = e == 0 ? (m ? 0x3F000000u : 0u) : (((e + 126u) << 23) | (m << 22));
  return BitsFloat(bits | (uint32_t(c & 8u) << 28));
}

inline bool IsFinite(float f) { return (FloatBits(f) & 0x7F800000u) != 0x7F800000u; }

// NaN-propagating clip, as jnp.clip (= minimum(maximum(x, lo), hi)) under XLA.
inline float ClipNan(float x, float lo, float hi) {
  if (x != x) return x;
  return x < lo ? lo : (x > hi ? hi : x);
}

NINFER_KV_NAMESPACE_END

#endif  // NINFER_KV_FFI_SCALAR_CODEC_H_
