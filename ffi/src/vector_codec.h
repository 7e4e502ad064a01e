// Vector (kVL-lane) versions of the exact encoders in scalar_codec.h, lane for lane identical to
// them (and so to the jnp codecs): branch-free integer arithmetic and IEEE float32 operations.
#ifndef NINFER_KV_FFI_VECTOR_CODEC_H_
#define NINFER_KV_FFI_VECTOR_CODEC_H_

#include <cstdint>
#include <cstring>

#include "scalar_codec.h"
#include "simd.h"

NINFER_KV_NAMESPACE_BEGIN

inline VUInt SplatU(uint32_t x) { return VUInt{} + x; }

inline VFloat AbsV(VFloat x) { return AsFloat(AsUInt(x) & 0x7FFFFFFFu); }

// NaN-propagating clip (a NaN lane fails both comparisons and stays NaN).
inline VFloat ClipV(VFloat x, float lo, float hi) {
  x = x < Splat(lo) ? Splat(lo) : x;
  return x > Splat(hi) ? Splat(hi) : x;
}

// Round to nearest even for |y| < 2^22 (and NaN stays NaN): adding and removing 1.5 * 2^23 leaves
// the integer nearest y, ties to even.  Only the sign of a zero result may differ from rint
// (irrelevant once converted to an integer).
inline VFloat RoundHalfEvenV(VFloat y) {
  const VFloat magic = Splat(12582912.0f);
  return (y + magic) - magic;
}

// float32 -> bfloat16 bits (round to nearest even; every NaN -> 0x7FC0), in 32-bit lanes.
inline VUInt FloatToBf16V(VFloat f) {
  const VUInt u = AsUInt(f);
  const VUInt rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? SplatU(kBf16CanonicalNan) : rounded;
}

// float32 -> float8_e4m3fn bits, as FloatToE4m3fn.
inline VUInt FloatToE4m3fnV(VFloat f) {
  const VUInt u = AsUInt(f);
  const VUInt sign = (u >> 24) & 0x80u;
  const VUInt a = u & 0x7FFFFFFFu;
  const VUInt e = a >> 23;
  const VUInt m24 = (a & 0x7FFFFFu) | 0x800000u;
  // normal e4m3fn (float32 exponent >= 121): 3 mantissa bits, carry into the exponent is natural
  const VUInt qn = (m24 + 0x7FFFFu + ((m24 >> 20) & 1u)) >> 20;  // 8 .. 16
  VUInt code_n = ((e - 120u) << 3) + qn - 8u;
  code_n = code_n > 0x7Eu ? SplatU(0x7Fu) : code_n;  // above 448 -> NaN
  // subnormal e4m3fn: m24 * 2^(e - 150) in units of 2^-9 is m24 >> (141 - e), rounded to even
  VUInt sh = 141u - e;
  const VUInt far = sh > 25u;  // also float32 zero / subnormal (e == 0)
  sh = far ? SplatU(25u) : sh;
  const VUInt half_m1 = (SplatU(1u) << (sh - 1u)) - 1u;
  VUInt qs = (m24 + half_m1 + ((m24 >> sh) & 1u)) >> sh;
  qs = far ? SplatU(0u) : qs;
  VUInt code = e >= 121u ? code_n : qs;
  code = a >= 0x7F800000u ? SplatU(0x7Fu) : code;
  return sign | code;
}

// float32 (clipped to [-6, 6]) -> e2m1 code with the sign in bit 3, as FloatToE2m1.
inline VUInt FloatToE2m1V(VFloat y) {
  const VFloat a = AbsV(y);
  const VInt m = (a > Splat(0.25f)) + (a >= Splat(0.75f)) + (a > Splat(1.25f)) + (a >= Splat(1.75f)) +
                 (a > Splat(2.5f)) + (a >= Splat(3.5f)) + (a > Splat(5.0f));  // each true lane adds -1
  const VUInt mag = __builtin_convertvector(-m, VUInt);
  return mag | ((AsUInt(y) >> 31) << 3);
}

// max |x| over n values, NaN-propagating like jnp.max (n >= 1).
inline float AbsMaxV(const float* x, int n) {
  VFloat vmax = Splat(0.0f);
  VInt vnan = VInt{} + 0;
  int i = 0;
  for (; i + kVL <= n; i += kVL) {
    const VFloat a = AbsV(Load(x + i));
    vnan |= a != a;
    vmax = a > vmax ? a : vmax;
  }
  float amax = HorizontalMax(vmax);
  bool nan = false;
  for (int l = 0; l < kVL; ++l) nan |= vnan[l] != 0;
  for (; i < n; ++i) {
    const float a = BitsFloat(FloatBits(x[i]) & 0x7FFFFFFFu);
    nan |= a != a;
    amax = a > amax ? a : amax;
  }
  return nan ? BitsFloat(0x7FC00000u) : amax;
}

// Narrowing stores of 32-bit lanes (values already in range).
inline void StoreLanesU8(uint8_t* p, VUInt v) {
#if defined(__AVX512F__)
  __m512i w;
  std::memcpy(&w, &v, sizeof w);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(w));
#elif defined(NINFER_KV_NEON)
  uint32x4_t w[2];
  std::memcpy(w, &v, sizeof w);
  vst1_u8(p, vmovn_u16(vcombine_u16(vmovn_u32(w[0]), vmovn_u32(w[1]))));
#else
  for (int i = 0; i < kVL; ++i) p[i] = static_cast<uint8_t>(v[i]);
#endif
}

inline void StoreLanesU16(uint8_t* p, VUInt v) {
#if defined(__AVX512F__)
  __m512i w;
  std::memcpy(&w, &v, sizeof w);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(w));
#elif defined(NINFER_KV_NEON)
  uint32x4_t w[2];
  std::memcpy(w, &v, sizeof w);
  vst1q_u8(p, vreinterpretq_u8_u16(vcombine_u16(vmovn_u32(w[0]), vmovn_u32(w[1]))));
#else
  for (int i = 0; i < kVL; ++i) {
    const uint16_t h = static_cast<uint16_t>(v[i]);
    std::memcpy(p + 2 * i, &h, 2);
  }
#endif
}

// dst[0, n) = x[0, n) rounded to bfloat16 bits (FloatToBf16: to nearest even, every NaN 0x7FC0);
// dst need not be aligned.
inline void FloatsToBf16(const float* x, int64_t n, uint8_t* dst) {
  int64_t i = 0;
  for (; i + kVL <= n; i += kVL) StoreLanesU16(dst + 2 * i, FloatToBf16V(Load(x + i)));
  for (; i < n; ++i) {
    const uint16_t b = FloatToBf16(x[i]);
    std::memcpy(dst + 2 * i, &b, 2);
  }
}

NINFER_KV_NAMESPACE_END

#endif  // NINFER_KV_FFI_VECTOR_CODEC_H_
