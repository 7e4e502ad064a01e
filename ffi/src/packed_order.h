// The AMX orders of the packed weight products, in scalar C++: the definition the AMX form must
// reproduce bit for bit (gemm_packed.cc checks it once against the hardware before using AMX; the
// tests compare it with their numpy emulation through NinferKvFfiPackedAmxReference).
//
// Operands are bfloat16 bit patterns, x (M, K) and w (N, K) row-major, denormals read as zero; K is
// padded with zeros to a multiple of kAmxChunk (32: one A tile row, sixteen pairs).  Every
// operation is a float32 multiply-add or add rounded to nearest even, results that are tiny after
// rounding flushed to a zero of their sign (x86's FTZ).  Output (m, n) starts from +0 and, per chunk
// of 32 elements of K in order:
//
//   kAmxChunks ("amx-chunks", Intel's current description of TDPBF16PS): two float32 chains from +0,
//     one over the even elements of the chunk's pairs and one over the odd ones, each a fused
//     multiply-add per pair in order; then out += (even + odd).
//   kAmxPairs ("amx-pairs", Intel's earlier description): per pair in order, out = fma(x even,
//     w even, out), then out = fma(x odd, w odd, out).
//
// A product of two bfloat16 values is exact in double, and a double sum of float32 operands rounds
// to the float32 result without double-rounding error (53 >= 2 * 24 + 2), so double arithmetic
// emulates both exactly.
#ifndef NINFER_KV_FFI_PACKED_ORDER_H_
#define NINFER_KV_FFI_PACKED_ORDER_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"

NINFER_KV_NAMESPACE_BEGIN
namespace packed_order {

constexpr int64_t kAmxChunk = 32;  // elements of K per TDPBF16PS (16 pairs)
enum AmxOrder : int { kAmxChunks = 0, kAmxPairs = 1 };
inline const char* AmxOrderName(int order) { return order == kAmxPairs ? "amx-pairs" : "amx-chunks"; }

// bfloat16 bit pattern with a denormal flushed to a zero of its sign (what every form reads).
inline uint16_t FlushBf16(uint16_t b) { return (b & 0x7F80u) == 0 ? static_cast<uint16_t>(b & 0x8000u) : b; }

inline float Bf16Value(uint16_t bits) { return Bf16ToFloat(FlushBf16(bits)); }

// `d` rounded to float32, flushed to a signed zero when tiny after rounding (x86's FTZ detects
// tininess after rounding: below the midpoint between the largest denormal and the smallest normal).
inline float RoundFtz(double d) {
  const double kTiny = 1.1754942106924411e-38;  // 2^-126 - 2^-151
  const float f = static_cast<float>(d);
  return std::fabs(d) < kTiny ? std::copysign(0.0f, f) : f;
}

inline float FmaFtz(float a, float b, float acc) {
  return RoundFtz(static_cast<double>(acc) + static_cast<double>(a) * static_cast<double>(b));
}

inline float AddFtz(float a, float b) { return RoundFtz(static_cast<double>(a) + static_cast<double>(b)); }

// out (M, N) = x @ w.T in `order` (see the header).
inline void AmxReference(const uint16_t* x, const uint16_t* w, float* out, int64_t m_len, int64_t n_len, int64_t k_len,
                         int order) {
  const int64_t padded = (k_len + kAmxChunk - 1) / kAmxChunk * kAmxChunk;
  auto at = [](const uint16_t* row, int64_t k, int64_t k_len) { return k < k_len ? Bf16Value(row[k]) : 0.0f; };
  for (int64_t m = 0; m < m_len; ++m) {
    for (int64_t n = 0; n < n_len; ++n) {
      const uint16_t* xr = x + m * k_len;
      const uint16_t* wr = w + n * k_len;
      float acc = 0.0f;
      for (int64_t c = 0; c < padded; c += kAmxChunk) {
        if (order == kAmxPairs) {
          for (int64_t k = c; k < c + kAmxChunk; ++k) acc = FmaFtz(at(xr, k, k_len), at(wr, k, k_len), acc);
        } else {
          float even = 0.0f, odd = 0.0f;
          for (int64_t k = c; k < c + kAmxChunk; k += 2) {
            even = FmaFtz(at(xr, k, k_len), at(wr, k, k_len), even);
            odd = FmaFtz(at(xr, k + 1, k_len), at(wr, k + 1, k_len), odd);
          }
          acc = AddFtz(acc, AddFtz(even, odd));
        }
      }
      out[m * n_len + n] = acc;
    }
  }
}

}  // namespace packed_order
NINFER_KV_NAMESPACE_END

#endif  // NINFER_KV_FFI_PACKED_ORDER_H_
