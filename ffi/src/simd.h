// Portable SIMD over GCC/Clang vector extensions.
//
// kVL float lanes per vector: 16 when the target has AVX-512F, else 8 (one AVX register; on
// targets without 256-bit vectors the compiler splits each operation).  Loads and stores go
// through memcpy, so no pointer needs any alignment.
#ifndef NINFER_KV_FFI_SIMD_H_
#define NINFER_KV_FFI_SIMD_H_

#include <cstdint>
#include <cstring>

#include "common.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON) && !defined(__ARM_BIG_ENDIAN)
// AArch64 NEON intrinsics (little-endian only: memcpy between NEON and vector-extension types
// then keeps the lane order).  A VFloat (kVL = 8) is two q registers.
#include <arm_neon.h>
#define NINFER_KV_NEON 1
#endif

NINFER_KV_NAMESPACE_BEGIN

#if defined(__AVX512F__)
constexpr int kVL = 16;
#else
constexpr int kVL = 8;
#endif

typedef float VFloat __attribute__((vector_size(kVL * sizeof(float))));
typedef int32_t VInt __attribute__((vector_size(kVL * sizeof(int32_t))));
typedef uint32_t VUInt __attribute__((vector_size(kVL * sizeof(uint32_t))));
typedef uint16_t VU16 __attribute__((vector_size(kVL * sizeof(uint16_t))));
typedef uint8_t VU8 __attribute__((vector_size(kVL)));
typedef int8_t VI8 __attribute__((vector_size(kVL)));

inline VFloat Load(const float* p) {
  VFloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void Store(float* p, VFloat v) { std::memcpy(p, &v, sizeof v); }
inline VFloat Splat(float x) {
  // x - (+0) is x for every x (-0 included), so this folds to a plain broadcast.
  return x - VFloat{};
}

inline VInt Iota() {
  VInt v;
  for (int i = 0; i < kVL; ++i) v[i] = i;
  return v;
}

inline VFloat AsFloat(VUInt u) {
  VFloat f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline VUInt AsUInt(VFloat f) {
  VUInt u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline VFloat Select(VInt mask, VFloat a, VFloat b) { return mask ? a : b; }

// kVL bytes / 16-bit words widened to 32-bit lanes (zero- or sign-extended).  GCC does not turn
// __builtin_convertvector of narrow integer vectors into one widening instruction, so the x86
// targets use it explicitly.
inline VUInt LoadU8AsU32(const uint8_t* p) {
  VUInt r;
#if defined(__AVX512F__)
  const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&r, &w, sizeof r);
#elif defined(__AVX2__)
  const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&r, &w, sizeof r);
#elif defined(NINFER_KV_NEON)
  const uint16x8_t h = vmovl_u8(vld1_u8(p));
  const uint32x4_t w[2] = {vmovl_u16(vget_low_u16(h)), vmovl_high_u16(h)};
  std::memcpy(&r, w, sizeof r);
#else
  for (int i = 0; i < kVL; ++i) r[i] = p[i];
#endif
  return r;
}

inline VInt LoadI8AsI32(const uint8_t* p) {
  VInt r;
#if defined(__AVX512F__)
  const __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&r, &w, sizeof r);
#elif defined(__AVX2__)
  const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&r, &w, sizeof r);
#elif defined(NINFER_KV_NEON)
  const int16x8_t h = vmovl_s8(vld1_s8(reinterpret_cast<const int8_t*>(p)));
  const int32x4_t w[2] = {vmovl_s16(vget_low_s16(h)), vmovl_high_s16(h)};
  std::memcpy(&r, w, sizeof r);
#else
  for (int i = 0; i < kVL; ++i) r[i] = static_cast<int8_t>(p[i]);
#endif
  return r;
}

inline VUInt LoadU16AsU32(const uint8_t* p) {
  VUInt r;
#if defined(__AVX512F__)
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  std::memcpy(&r, &w, sizeof r);
#elif defined(__AVX2__)
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&r, &w, sizeof r);
#elif defined(NINFER_KV_NEON)
  // vld1q_u8 (no alignment, unlike a uint16_t pointer); the bytes are little-endian words.
  const uint16x8_t h = vreinterpretq_u16_u8(vld1q_u8(p));
  const uint32x4_t w[2] = {vmovl_u16(vget_low_u16(h)), vmovl_high_u16(h)};
  std::memcpy(&r, w, sizeof r);
#else
  for (int i = 0; i < kVL; ++i) {
    uint16_t x;
    std::memcpy(&x, p + 2 * i, 2);
    r[i] = x;
  }
#endif
  return r;
}

inline VFloat ToFloat(VInt x) { return __builtin_convertvector(x, VFloat); }

// Lane reductions by halving (log2(kVL) shuffle steps).
#if defined(__AVX512F__)
inline VFloat SwapHalves(VFloat v, int step) {
  switch (step) {
    case 8: return __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    case 4: return __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    case 2: return __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    default: return __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  }
}
#else
inline VFloat SwapHalves(VFloat v, int step) {
  switch (step) {
    case 4: return __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    case 2: return __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    default: return __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
  }
}
#endif

inline float HorizontalSum(VFloat v) {
  for (int step = kVL / 2; step >= 1; step /= 2) v += SwapHalves(v, step);
  return v[0];
}

// Whether any lane of v is nonzero.
inline bool AnyLane(VInt v) {
  uint64_t w[kVL / 2];
  std::memcpy(w, &v, sizeof w);
  uint64_t x = 0;
  for (int i = 0; i < kVL / 2; ++i) x |= w[i];
  return x != 0;
}

// Largest lane; NaN lanes are ignored (callers track NaN separately).
inline float HorizontalMax(VFloat v) {
  for (int step = kVL / 2; step >= 1; step /= 2) {
    const VFloat w = SwapHalves(v, step);
    v = w > v ? w : v;
  }
  return v[0];
}

// r[i] = sum of the lanes of a[i], for i in [0, kVL): a transposed reduction tree of
// kVL - 1 pairwise shuffle-and-add steps.
NINFER_KV_ALWAYS_INLINE VFloat ReduceTranspose(const VFloat* a) {
#if defined(__AVX512F__)
  VFloat c[8], e[4], f[2];
  for (int i = 0; i < 8; ++i) {
    VFloat x = a[2 * i], y = a[2 * i + 1];
    c[i] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i) {
    VFloat x = c[2 * i], y = c[2 * i + 1];
    e[i] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {
    VFloat x = e[2 * i], y = e[2 * i + 1];
    f[i] = __builtin_shufflevector(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  }
  return __builtin_shufflevector(f[0], f[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(f[0], f[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
  VFloat c[4], e[2];
  for (int i = 0; i < 4; ++i) {
    VFloat x = a[2 * i], y = a[2 * i + 1];
    c[i] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15);
  }
  for (int i = 0; i < 2; ++i) {
    VFloat x = c[2 * i], y = c[2 * i + 1];
    e[i] = __builtin_shufflevector(x, y, 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(x, y, 2, 3, 6, 7, 10, 11, 14, 15);
  }
  return __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

// exp(x) for every lane, relative error below 2 ulp for x in [-87, 88]; x below -87 gives a
// tiny positive value (callers mask such lanes), NaN stays NaN.
inline VFloat Exp(VFloat x) {
  const VFloat hi = Splat(88.0f), lo = Splat(-87.33654f);
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  const VFloat magic = Splat(12582912.0f);  // 1.5 * 2^23: round-to-nearest of n
  VFloat t = x * Splat(1.44269504088896341f) + magic;
  VFloat n = t - magic;
  VInt ti, mi;
  std::memcpy(&ti, &t, sizeof ti);
  std::memcpy(&mi, &magic, sizeof mi);
  VInt ni = ti - mi;
  VFloat r = x - n * Splat(0.693359375f);
  r = r - n * Splat(-2.12194440e-4f);
  // exp(r) on [-ln2/2, ln2/2]: degree-6 minimax polynomial.
  VFloat p = Splat(1.9875691500e-4f);
  p = p * r + Splat(1.3981999507e-3f);
  p = p * r + Splat(8.3334519073e-3f);
  p = p * r + Splat(4.1665795894e-2f);
  p = p * r + Splat(1.6666665459e-1f);
  p = p * r + Splat(5.0000001201e-1f);
  p = p * r * r + r + Splat(1.0f);
  VInt scale_bits = (ni + 127) << 23;
  VFloat scale;
  std::memcpy(&scale, &scale_bits, sizeof scale);
  return p * scale;
}

NINFER_KV_NAMESPACE_END

#endif  // NINFER_KV_FFI_SIMD_H_
