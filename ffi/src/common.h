// Shared definitions of the ninfer_kv CPU kernels: codec ids, plane addressing, float bit helpers
// and the denormal mode the kernels run under.
//
// Invariants every kernel relies on:
//  * A plane of a paged pool is stacked (num_layers, N, H, P, X) (page-major) or
//    (num_layers, H, N, P, X) (head-major); one (layer, page, head) tile is P * X contiguous
//    elements, token-major.  A cyclic plane is (num_layers, rows, H, slots, X).
//  * Codec ids match ninfer_kv.ffi_ops: 0 BF16, 1 INT8-G64, 2 FP8-E4M3FN-row, 3 NVFP4-G16.
//  * All arithmetic runs with denormals flushed to zero (FTZ + DAZ), exactly as XLA's CPU
//    executables do, so the codes written here are bit-identical to the jnp codecs compiled by XLA.
#ifndef NINFER_KV_FFI_COMMON_H_
#define NINFER_KV_FFI_COMMON_H_

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#include "isa.h"

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

// For small hot helpers whose locals must stay in registers across the call.
#define NINFER_KV_ALWAYS_INLINE inline __attribute__((always_inline))

NINFER_KV_NAMESPACE_BEGIN

// Bumped whenever a handler's operands, attributes or semantics change; ffi_ops.py refuses a
// library whose version differs from its own (a stale build).
constexpr int kAbiVersion = 4;

// The codec table of the kernels, one row per codec: X(enumerator, id, name, data dtype, scale dtype).
// The id is the codec's `ffi_id` in ninfer_kv/profiles.py (CODEC_SPECS); the dtypes name
// xla::ffi::DataType members (INVALID: no scale plane).  Everything that only names a codec's
// storage (the enum, validation, plane checks) is generated from it.
#define NINFER_KV_CODECS(X)                       \
  X(kBF16, 0, "bf16", BF16, INVALID)              \
  X(kInt8G64, 1, "int8-g64", S8, BF16)            \
  X(kFp8Row, 2, "fp8-e4m3fn-row", F8E4M3FN, BF16) \
  X(kNvfp4G16, 3, "nvfp4-g16", U8, U8)

#define NINFER_KV_CODEC_ENUMERATOR(e, id, name, data, scale) e = id,
enum class Codec : int32_t { NINFER_KV_CODECS(NINFER_KV_CODEC_ENUMERATOR) };
#undef NINFER_KV_CODEC_ENUMERATOR

#define NINFER_KV_CODEC_COUNT(e, id, name, data, scale) +1
constexpr int32_t kNumCodecs = 0 NINFER_KV_CODECS(NINFER_KV_CODEC_COUNT);
#undef NINFER_KV_CODEC_COUNT

inline bool ValidCodec(int32_t c) { return c >= 0 && c < kNumCodecs; }

// Storage facts of one codec for head dim D.
struct CodecPlanes {
  Codec codec;
  int data_extent;    // X of the data plane (elements)
  int data_itemsize;  // bytes per data element
  int scale_extent;   // X of the scale plane (0: no scale plane)
  int scale_itemsize;
};

inline CodecPlanes PlanesOf(Codec c, int d) {
  switch (c) {
    case Codec::kBF16: return {c, d, 2, 0, 0};
    case Codec::kInt8G64: return {c, d, 1, d / 64, 2};
    case Codec::kFp8Row: return {c, d, 1, 1, 2};
    case Codec::kNvfp4G16: return {c, d / 2, 1, d / 16, 1};
  }
  return {c, 0, 0, 0, 0};
}

inline bool HeadDimSupported(Codec c, int d) {
  if (d <= 0) return false;
  if (c == Codec::kInt8G64) return d % 64 == 0;
  if (c == Codec::kNvfp4G16) return d % 16 == 0;
  return true;
}

inline int NumPlanes(Codec c) { return c == Codec::kBF16 ? 1 : 2; }

// Pointers to the first token of a run of tokens of one (layer, page/row, head) in the K and V
// planes, plus the per-token byte strides.
struct TokenRun {
  const uint8_t* k_data;
  const uint8_t* k_scale;
  const uint8_t* v_data;
  const uint8_t* v_scale;
};

struct PlaneStrides {
  int64_t k_data, k_scale, v_data, v_scale;  // bytes per token
};

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float Bf16ToFloat(uint16_t b) { return BitsFloat(uint32_t(b) << 16); }

inline int64_t Clamp64(int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : (v > hi ? hi : v); }

inline int64_t RoundUp(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// Flush denormals to zero (inputs and results) for the lifetime of the object, restoring the
// caller's mode afterwards.  XLA's CPU runtime executes with the same mode.
class ScopedFlushDenormal {
 public:
  ScopedFlushDenormal() {
#if defined(__x86_64__) || defined(__i386__)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ | 0x8040u);  // FTZ (bit 15) | DAZ (bit 6)
#elif defined(__aarch64__)
    uint64_t fpcr;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(fpcr));
    saved_ = fpcr;
    fpcr |= (uint64_t(1) << 24);  // FZ
    __asm__ __volatile__("msr fpcr, %0" : : "r"(fpcr));
#endif
  }
  ~ScopedFlushDenormal() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_setcsr(static_cast<unsigned>(saved_));
#elif defined(__aarch64__)
    uint64_t fpcr = saved_;
    __asm__ __volatile__("msr fpcr, %0" : : "r"(fpcr));
#endif
  }
  ScopedFlushDenormal(const ScopedFlushDenormal&) = delete;
  ScopedFlushDenormal& operator=(const ScopedFlushDenormal&) = delete;

 private:
  uint64_t saved_ = 0;
};

// A 64-byte aligned, growable float buffer (per-thread scratch; never shrinks).
class AlignedFloats {
 public:
  AlignedFloats() = default;
  ~AlignedFloats() { std::free(ptr_); }
  AlignedFloats(const AlignedFloats&) = delete;
  AlignedFloats& operator=(const AlignedFloats&) = delete;

  // Returns a buffer of at least n floats; contents are unspecified (zero on first growth).
  float* Get(size_t n) {
    if (n > cap_) {
      std::free(ptr_);
      size_t bytes = RoundUp(static_cast<int64_t>(n * sizeof(float)), 64);
      ptr_ = static_cast<float*>(std::aligned_alloc(64, bytes));
      if (ptr_ == nullptr) throw std::bad_alloc();
      std::memset(ptr_, 0, bytes);
      cap_ = bytes / sizeof(float);
    }
    return ptr_;
  }

 private:
  float* ptr_ = nullptr;
  size_t cap_ = 0;
};

NINFER_KV_NAMESPACE_END

#endif  // NINFER_KV_FFI_COMMON_H_
