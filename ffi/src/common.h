// Shared definitions of the ninfer_kv CPU kernels: codec ids, plane addressing, float bit helpers
// and the denormal mode the kernels run under.
//
// Invariants every kernel relies on:
//  * A plane of a paged pool is stacked (num_layers, N, H, P, X) (page-major) or
//    (num_layers, H, N, P, X) (head-major); one (layer, page, head) tile is P * X contiguous
//    elements, token-major.  A cyclic plane is (num_layers, rows, H, slots, X).
//  * Codec ids are the rows of NINFER_KV_CODECS below (ninfer_kv.schema.profiles.CODEC_SPECS' ffi_id).
//  * All arithmetic runs with denormals flushed to zero (FTZ + DAZ), exactly as XLA's CPU
//    executables do, so the codes written here are bit-identical to the jnp codecs compiled by XLA.
#ifndef NINFER_KV_FFI_COMMON_H_
#define NINFER_KV_FFI_COMMON_H_

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>

#include "isa.h"

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

// For small hot helpers whose locals must stay in registers across the call.
#define NINFER_KV_ALWAYS_INLINE inline __attribute__((always_inline))

NINFER_KV_NAMESPACE_BEGIN

// Bumped whenever a handler's operands, attributes or semantics change; ffi_ops.py refuses a
// library whose version differs from its own (a stale build).
constexpr int kAbiVersion = 7;

// The codec table of the kernels, one row per codec:
//   X(enumerator, id, name, label, data dtype, data bytes, pack, scale dtype, scale bytes, group,
//     head-dim multiple)
// The id, name (KVCodec value), label and the storage facts are the codec's CodecSpec row in
// ninfer_kv/schema/profiles.py (CODEC_SPECS; tests/test_spec_tables.py holds the two tables equal).  The
// dtypes name xla::ffi::DataType members (INVALID: no scale plane); pack is the logical elements
// per data element (2: two e2m1 nibbles a byte); group the elements sharing one scale (0: one
// scale per row of D); scale bytes 0 means no scale plane.  Ids run 0, 1, ... in row order.
//
// Every codec dispatch of the kernels is generated from this table: the enum, validation, the
// plane facts below, the plane checks (planes.cc), and every per-codec call through VisitCodec,
// which hands the codec to generic code as a compile-time constant so that it picks the codec's
// Encoder<C> (quantize.cc) or Decoder<C> (row_decoders.h).  A new codec is a new row here plus
// its Encoder and Decoder specializations; no switch is edited.
#define NINFER_KV_CODECS(X)                                                          \
  X(kBF16, 0, "bf16", "BF16", BF16, 2, 1, INVALID, 0, 1, 1)                           \
  X(kInt8G64, 1, "int8-g64", "INT8-G64", S8, 1, 1, BF16, 2, 64, 64)                   \
  X(kFp8Row, 2, "fp8-e4m3fn-row", "FP8-E4M3FN-row", F8E4M3FN, 1, 1, BF16, 2, 0, 1)    \
  X(kNvfp4G16, 3, "nvfp4-g16", "NVFP4-G16", U8, 1, 2, U8, 1, 16, 16)

#define NINFER_KV_CODEC_ENUMERATOR(e, id, ...) e = id,
enum class Codec : int32_t { NINFER_KV_CODECS(NINFER_KV_CODEC_ENUMERATOR) };
#undef NINFER_KV_CODEC_ENUMERATOR

// One codec's row of the table, without its dtypes (planes.cc maps those).
struct CodecInfo {
  Codec codec;
  const char* name;        // "int8-g64"
  const char* label;       // "INT8-G64" (messages)
  int data_bytes;          // bytes per data element
  int pack;                // logical elements per data element
  int scale_bytes;         // bytes per scale (0: no scale plane)
  int group;               // elements per scale (0: the whole row)
  int head_dim_multiple;   // D must be a multiple of it
};

#define NINFER_KV_CODEC_INFO(e, id, name, label, data, data_bytes, pack, scale, scale_bytes, group, multiple) \
  CodecInfo{Codec::e, name, label, data_bytes, pack, scale_bytes, group, multiple},
constexpr CodecInfo kCodecInfo[] = {NINFER_KV_CODECS(NINFER_KV_CODEC_INFO)};
#undef NINFER_KV_CODEC_INFO

constexpr int32_t kNumCodecs = static_cast<int32_t>(sizeof(kCodecInfo) / sizeof(kCodecInfo[0]));

constexpr bool CodecIdsInRowOrder() {
  for (int32_t i = 0; i < kNumCodecs; ++i) {
    if (static_cast<int32_t>(kCodecInfo[i].codec) != i) return false;
  }
  return true;
}
static_assert(CodecIdsInRowOrder(), "NINFER_KV_CODECS: the ids must be 0, 1, ... in row order");

inline bool ValidCodec(int32_t c) { return c >= 0 && c < kNumCodecs; }

// The row of a valid codec.
inline const CodecInfo& InfoOf(Codec c) { return kCodecInfo[static_cast<int32_t>(c)]; }

// A codec as a type: what VisitCodec hands its function (CodecConstant<C>::value is C).
template <Codec C>
using CodecConstant = std::integral_constant<Codec, C>;

// Calls f(CodecConstant<c>{}) for codec c through a switch generated from the table (nothing for
// a value that is no codec), so that f, a generic lambda, can name the codec's Encoder / Decoder:
//   VisitCodec(c, [&](auto codec) { Decoder<decltype(codec)::value>::...; });
template <class F>
NINFER_KV_ALWAYS_INLINE void VisitCodec(Codec c, F&& f) {
#define NINFER_KV_CODEC_CASE(e, ...) \
  case Codec::e:                     \
    f(CodecConstant<Codec::e>{});    \
    return;
  switch (c) { NINFER_KV_CODECS(NINFER_KV_CODEC_CASE) }
#undef NINFER_KV_CODEC_CASE
}

// Storage facts of one codec for head dim D.
struct CodecPlanes {
  Codec codec;
  int data_extent;    // X of the data plane (elements)
  int data_itemsize;  // bytes per data element
  int scale_extent;   // X of the scale plane (0: no scale plane)
  int scale_itemsize;
};

inline CodecPlanes PlanesOf(Codec c, int d) {
  if (!ValidCodec(static_cast<int32_t>(c))) return {c, 0, 0, 0, 0};
  const CodecInfo& info = InfoOf(c);
  const int scale_extent = info.scale_bytes == 0 ? 0 : (info.group == 0 ? 1 : d / info.group);
  return {c, d / info.pack, info.data_bytes, scale_extent, info.scale_bytes};
}

inline bool HeadDimSupported(Codec c, int d) { return d > 0 && d % InfoOf(c).head_dim_multiple == 0; }

inline int NumPlanes(Codec c) { return InfoOf(c).scale_bytes == 0 ? 1 : 2; }

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
