// Integer scores of the levels with AVX-512 VNNI and VBMI (the avx512vnni level; a native build
// on such a CPU): NVFP4 keys against 15-bit queries, through vpdpbusd.
//
// Why these and no others: vpdpbusd multiplies 64 byte pairs per instruction (four times the
// float32 FMA's 16), while on levels without VNNI an integer product costs as many instructions
// per multiply-add as an FMA.  NVFP4 codes are 4-bit integers (2 * e2m1 is one of 0, +-1, +-2,
// +-3, +-4, +-6, +-8, +-12), so a key's codes are already the byte operand; one table lookup
// (vpshufb) per 64 codes replaces the float decode.  INT8 and FP8 keys gain nothing measurable
// this way (their float decode is cheap, or their codes are not integers), so they stay float32.
//
// The query: each row is rounded once per task to q16 = round(q / step), |q16| <= kNvfp4QueryMax,
// step = max|q| / kNvfp4QueryMax, and split exactly into two signed bytes q16 = 128 * hi + lo
// (hi in [-128, 127], lo in [0, 127]).  The keys enter as the unsigned byte u = 2 * e2m1 + 12, so
// a group's sums over its 16 dims (exact int32: at most 16 * 24 * 128 per byte half) give
//   128 * sum(u * hi) + sum(u * lo) = 2 * (q16 . e2m1) + 12 * sum(q16),
// and QueryBytes::corr (-12 * sum(q16) per group) starts the sum.  The score is that sum times the
// group's e4m3 scale, summed over groups in float32, times step / 2 (applied with the softmax
// scale).  Rounding q to 15 bits is the only approximation.
#ifndef NINFER_KV_FFI_INT_SCORES_H_
#define NINFER_KV_FFI_INT_SCORES_H_

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common.h"
#include "simd.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
#define NINFER_KV_INT_SCORES 1
#endif

NINFER_KV_NAMESPACE_BEGIN

// The bound of the rounded queries (15 bits: the exact split into two signed bytes).
constexpr int kNvfp4QueryMax = 16383;

// dst[g * ld + j] = src[j * groups + g] for j < n (and 0 for n <= j < ld): per-token group values
// made group-major.
inline void GroupMajor(const float* src, int n, int groups, float* dst, int ld) {
  int j = 0;
#if defined(__AVX512F__)
  if (groups == 8) {  // 16 keys x 8 groups -> 8 groups x 16 keys in three rounds of two-source permutes
    const __m512i s1a = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    const __m512i s1b = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    const __m512i s2a = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
    const __m512i s2b = _mm512_setr_epi32(2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    const __m512i s3a = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i s3b = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (; j + 16 <= n; j += 16) {
      __m512 a[8], b[8], c[8];
      for (int i = 0; i < 8; ++i) a[i] = _mm512_loadu_ps(src + 8 * j + 16 * i);  // keys 2i, 2i + 1
      // b[2p] / b[2p + 1]: keys 4p .. 4p + 3 (lane 4 kk + gg), groups 0-3 / 4-7
      for (int p = 0; p < 4; ++p) {
        b[2 * p] = _mm512_permutex2var_ps(a[2 * p], s1a, a[2 * p + 1]);
        b[2 * p + 1] = _mm512_permutex2var_ps(a[2 * p], s1b, a[2 * p + 1]);
      }
      // c[4h + 2t + u]: keys 8h .. 8h + 7 (lane 2 kk + gg), groups 4t + 2u, + 1
      for (int h = 0; h < 2; ++h) {
        for (int t = 0; t < 2; ++t) {
          const __m512 x = b[4 * h + t], y = b[4 * h + 2 + t];
          c[4 * h + 2 * t] = _mm512_permutex2var_ps(x, s2a, y);
          c[4 * h + 2 * t + 1] = _mm512_permutex2var_ps(x, s2b, y);
        }
      }
      for (int q = 0; q < 4; ++q) {  // groups 2q, 2q + 1
        _mm512_storeu_ps(dst + static_cast<int64_t>(2 * q) * ld + j, _mm512_permutex2var_ps(c[q], s3a, c[4 + q]));
        _mm512_storeu_ps(dst + static_cast<int64_t>(2 * q + 1) * ld + j, _mm512_permutex2var_ps(c[q], s3b, c[4 + q]));
      }
    }
  }
#endif
  for (; j < n; ++j) {
    for (int g = 0; g < groups; ++g) dst[static_cast<int64_t>(g) * ld + j] = src[j * groups + g];
  }
  for (int g = 0; g < groups; ++g) {
    for (int jj = n; jj < ld; ++jj) dst[static_cast<int64_t>(g) * ld + jj] = 0.0f;
  }
}


#if defined(NINFER_KV_INT_SCORES)
// The query rows as the byte operands (see the top of this file), each 8-dim block in the order of
// the key columns: its 4 even dims, then its 4 odd dims.  corr[m * groups + g] = -12 * the sum of
// q16 over group g of row m.
struct QueryBytes {
  const uint8_t* hi;
  const uint8_t* lo;
  int ld;  // bytes per row
  const int32_t* corr;
  int groups;
};

// acc + vpdpbusd(u, the 4 signed bytes at p in every 32-bit lane), the bytes read by the
// instruction's own broadcast (GCC would keep a separate broadcast).
NINFER_KV_ALWAYS_INLINE __m512i DotBytesBroadcast(__m512i acc, __m512i u, const uint8_t* p) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// cols[c] lane jj = the 32-bit word c of rows16[jj] + off (16 x 16 transpose of 32-bit words).
// Only the first `bytes` bytes (32 or 64) of each row are read; the other columns are zero.
NINFER_KV_ALWAYS_INLINE void TransposeWords16(const uint8_t* const* rows16, int64_t off, int bytes, __m512i* cols) {
  const __mmask64 keep = bytes >= 64 ? ~__mmask64{0} : (__mmask64{1} << bytes) - 1;
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    const __m512i a = _mm512_maskz_loadu_epi8(keep, rows16[i] + off);
    const __m512i b = _mm512_maskz_loadu_epi8(keep, rows16[i + 1] + off);
    t[i] = _mm512_unpacklo_epi32(a, b);
    t[i + 1] = _mm512_unpackhi_epi32(a, b);
  }
  // u[4k + c], 128-bit lane L: keys 4k .. 4k + 3 of column 4L + c
  for (int k = 0; k < 16; k += 4) {
    u[k] = _mm512_unpacklo_epi64(t[k], t[k + 2]);
    u[k + 1] = _mm512_unpackhi_epi64(t[k], t[k + 2]);
    u[k + 2] = _mm512_unpacklo_epi64(t[k + 1], t[k + 3]);
    u[k + 3] = _mm512_unpackhi_epi64(t[k + 1], t[k + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i v = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), w = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
    const __m512i w2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
    cols[c] = _mm512_shuffle_i32x4(v, v2, 0x88);
    cols[8 + c] = _mm512_shuffle_i32x4(v, v2, 0xDD);
    cols[4 + c] = _mm512_shuffle_i32x4(w, w2, 0x88);
    cols[12 + c] = _mm512_shuffle_i32x4(w, w2, 0xDD);
  }
}

// NVFP4 keys, R query rows, the groups [g0, g0 + ng) of 16 keys whose packed codes are the
// transposed columns `cols` (column 2 gl + h: bytes 8 gl + 4 h .. + 3 of each key, i.e. dims
// 16 (g0 + gl) + 8 h .. + 7): facc[r] += K scale(jj, g) * (128 * hi_sum + lo_sum) of group g, for
// the keys jj of the lanes.  sk[g * fld + jj]: the K scales, group-major.
template <int R>
NINFER_KV_ALWAYS_INLINE void ScoreGroupsNvfp4(const __m512i* cols, int g0, int ng, const QueryBytes& q, int m0,
                                              const float* sk, int fld, __m512* facc) {
  // 2 * e2m1 + 12 for the 16 codes (sign in bit 3): unsigned, 0 .. 24
  const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int gl = 0; gl < ng; ++gl) {
    const int g = g0 + gl;
    __m512i u[4];
    for (int h = 0; h < 2; ++h) {
      const __m512i c = cols[2 * gl + h];
      u[2 * h] = _mm512_shuffle_epi8(lut, _mm512_and_si512(c, low));                          // even dims
      u[2 * h + 1] = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(c, 4), low));  // odd dims
    }
    const __m512 f = _mm512_loadu_ps(sk + static_cast<int64_t>(g) * fld);
    for (int r = 0; r < R; ++r) {
      const uint8_t* qh = q.hi + static_cast<int64_t>(m0 + r) * q.ld + 16 * g;
      const uint8_t* ql = q.lo + static_cast<int64_t>(m0 + r) * q.ld + 16 * g;
      __m512i lo = _mm512_set1_epi32(q.corr[(m0 + r) * q.groups + g]), hi = _mm512_setzero_si512();
      for (int i = 0; i < 4; ++i) {
        lo = DotBytesBroadcast(lo, u[i], ql + 4 * i);
        hi = DotBytesBroadcast(hi, u[i], qh + 4 * i);
      }
      const __m512 x = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(hi, 7), lo));
      facc[r] = _mm512_fmadd_ps(x, f, facc[r]);
    }
  }
}

// Scores of 16 NVFP4 keys (key jj at rows16[jj]) against query rows [0, rows), head dim d:
// s[m * lds + jj] = sum over the groups g of K scale(jj, g) * 2 * (q16_m . e2m1_jj over g).
NINFER_KV_ALWAYS_INLINE void ScoreBlockNvfp4(const uint8_t* const* rows16, int d, const QueryBytes& q, int rows,
                                             const float* sk, int fld, float* s, int lds) {
  alignas(64) __m512i cols[2][16];
  const int chunks = (d / 2 + 63) / 64;
  for (int ch = 0; ch < chunks; ++ch) TransposeWords16(rows16, 64 * ch, std::min(64, d / 2 - 64 * ch), cols[ch]);
  auto rows_block = [&](auto rtag, int m0) {
    constexpr int R = decltype(rtag)::value;
    __m512 facc[R];
    for (int r = 0; r < R; ++r) facc[r] = _mm512_setzero_ps();
    for (int ch = 0; ch < chunks; ++ch) {
      const int ng = std::min(8, d / 16 - 8 * ch);
      ScoreGroupsNvfp4<R>(cols[ch], 8 * ch, ng, q, m0, sk, fld, facc);
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(s + static_cast<int64_t>(m0 + r) * lds, facc[r]);
  };
  int m0 = 0;
  for (; m0 + 4 <= rows; m0 += 4) rows_block(std::integral_constant<int, 4>{}, m0);
  switch (rows - m0) {
    case 3: rows_block(std::integral_constant<int, 3>{}, m0); break;
    case 2: rows_block(std::integral_constant<int, 2>{}, m0); break;
    case 1: rows_block(std::integral_constant<int, 1>{}, m0); break;
    default: break;
  }
}
#endif  // NINFER_KV_INT_SCORES

NINFER_KV_NAMESPACE_END

#endif  // NINFER_KV_FFI_INT_SCORES_H_
