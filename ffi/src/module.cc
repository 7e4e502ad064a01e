// Library-level entry points: the exported handler symbols (forwarded to the instruction-set
// level chosen at load, dispatch.h) and the functions ninfer_kv/ffi_ops.py reads through ctypes.
#include <cstdint>
#include <string>
#include <vector>

#include "common.h"
#include "dispatch.h"
#include "thread_pool.h"
#include "xla/ffi/api/c_api.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

// The error a handler returns when no level could be selected (the Python side refuses to
// register the targets in that case, so this is a safety net).
XLA_FFI_Error* Refused(XLA_FFI_CallFrame* call_frame) {
  static const std::string message = "ninfer_kv FFI: " + ninfer_kv_ffi::Selected().error;
  XLA_FFI_Error_Create_Args args;
  args.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
  args.extension_start = nullptr;
  args.message = message.c_str();
  args.errc = XLA_FFI_Error_Code_FAILED_PRECONDITION;
  return call_frame->api->XLA_FFI_Error_Create(&args);
}

const ninfer_kv_ffi::KernelTable* Table() { return ninfer_kv_ffi::Selected().table; }

// The read-bandwidth probe: the sum of words [lo, hi), with the widest loads this CPU supports
// and four independent accumulators.
using ReadFn = uint64_t (*)(const uint64_t*, int64_t, int64_t);

uint64_t ReadPortable(const uint64_t* w, int64_t lo, int64_t hi) {
  uint64_t acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = lo;
  for (; j + 8 <= hi; j += 8) {
    for (int k = 0; k < 8; ++k) acc[k] += w[j + k];
  }
  for (; j < hi; ++j) acc[0] += w[j];
  uint64_t total = 0;
  for (uint64_t a : acc) total += a;
  return total;
}

#if defined(__x86_64__)
__attribute__((target("avx512f"))) uint64_t ReadAvx512(const uint64_t* w, int64_t lo, int64_t hi) {
  __m512i a = _mm512_setzero_si512(), b = a, c = a, d = a;
  int64_t j = lo;
  for (; j + 32 <= hi; j += 32) {
    a = _mm512_add_epi64(a, _mm512_loadu_si512(w + j));
    b = _mm512_add_epi64(b, _mm512_loadu_si512(w + j + 8));
    c = _mm512_add_epi64(c, _mm512_loadu_si512(w + j + 16));
    d = _mm512_add_epi64(d, _mm512_loadu_si512(w + j + 24));
  }
  return _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(a, b), _mm512_add_epi64(c, d))) +
         ReadPortable(w, j, hi);
}

__attribute__((target("avx2"))) uint64_t ReadAvx2(const uint64_t* w, int64_t lo, int64_t hi) {
  __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
  int64_t j = lo;
  for (; j + 16 <= hi; j += 16) {
    a = _mm256_add_epi64(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j)));
    b = _mm256_add_epi64(b, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j + 4)));
    c = _mm256_add_epi64(c, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j + 8)));
    d = _mm256_add_epi64(d, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j + 12)));
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi64(_mm256_add_epi64(a, b), _mm256_add_epi64(c, d)));
  return lanes[0] + lanes[1] + lanes[2] + lanes[3] + ReadPortable(w, j, hi);
}
#endif

ReadFn WidestRead() {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512f")) return ReadAvx512;
  if (__builtin_cpu_supports("avx2")) return ReadAvx2;
#endif
  return ReadPortable;
}


}  // namespace

extern "C" {

#define NINFER_KV_EXPORT __attribute__((visibility("default")))

// An exported handler symbol that forwards to the level in use.
#define NINFER_KV_FORWARD(symbol, field)                                \
  NINFER_KV_EXPORT XLA_FFI_Error* symbol(XLA_FFI_CallFrame* f) {        \
    const auto* t = Table();                                            \
    return t ? t->field(f) : Refused(f);                                \
  }
NINFER_KV_FORWARD(NinferKvPagedAppend, paged_append)
NINFER_KV_FORWARD(NinferKvPagedAttention, paged_attention)
NINFER_KV_FORWARD(NinferKvCyclicAppend, cyclic_append)
NINFER_KV_FORWARD(NinferKvCyclicAttention, cyclic_attention)
#undef NINFER_KV_FORWARD

// The operand/attribute contract version of the handlers (see kAbiVersion).
NINFER_KV_EXPORT int NinferKvFfiAbiVersion() { return ninfer_kv_ffi::kAbiVersion; }

// Threads the kernels use (the caller included); starts the pool on first use.
NINFER_KV_EXPORT int NinferKvFfiNumThreads() { return ninfer_kv_ffi::PoolThreads(); }

// The instruction-set level in use ("" when the requested level was refused).
NINFER_KV_EXPORT const char* NinferKvFfiIsa() {
  const auto* t = Table();
  return t ? t->level : "";
}

// Why no level is in use ("" when one is).
NINFER_KV_EXPORT const char* NinferKvFfiIsaError() { return ninfer_kv_ffi::Selected().error.c_str(); }

// Compiled-in levels, best first, and those this CPU can run (comma separated).
NINFER_KV_EXPORT const char* NinferKvFfiIsaCompiled() { return ninfer_kv_ffi::Selected().compiled.c_str(); }
NINFER_KV_EXPORT const char* NinferKvFfiIsaSupported() { return ninfer_kv_ffi::Selected().supported.c_str(); }

// The CPU features detected (comma separated).
NINFER_KV_EXPORT const char* NinferKvFfiCpuFeatures() { return ninfer_kv_ffi::Selected().cpu_features.c_str(); }

// The products the level in use takes for attention over codecs (k, v) at head dim d (the codec
// ids of ninfer_kv.ffi_ops): scores | values << 8, each 0 (float32) or 1 (int8x2: the query rounded
// to 15 bits as two signed bytes, vpdpbusd); -1 for invalid arguments or no level in use.
NINFER_KV_EXPORT int32_t NinferKvFfiArithmetic(int32_t k_codec, int32_t v_codec, int32_t head_dim) {
  const auto* t = Table();
  return t ? t->arithmetic(k_codec, v_codec, head_dim) : -1;
}

// Float lanes per SIMD vector of the level in use (0 when none is).
NINFER_KV_EXPORT int NinferKvFfiVectorWidth() {
  const auto* t = Table();
  return t ? t->vector_width : 0;
}

// Reads `bytes` bytes at `data` once, in `slices` contiguous slices on the pool (<= 0: one per
// pool thread; 1: the calling thread alone), and returns a checksum of them (for the
// read-bandwidth figure of bench/bench_ffi.py).  The machine's bandwidth, not a level's: the
// widest loads this CPU supports, four independent accumulators (a narrower loop measures 20-35%
// less on an AVX-512 Xeon).
NINFER_KV_EXPORT uint64_t NinferKvFfiStreamRead(const void* data, int64_t bytes, int32_t slice_count) {
  const uint64_t* words = static_cast<const uint64_t*>(data);
  const int64_t n = bytes / 8;
  const int64_t slices = slice_count > 0 ? slice_count : ninfer_kv_ffi::PoolThreads();
  const ReadFn read = WidestRead();
  std::vector<uint64_t> sums(static_cast<size_t>(slices), 0);
  ninfer_kv_ffi::ParallelFor(slices, [&](int64_t i) {
    sums[static_cast<size_t>(i)] = read(words, n * i / slices, n * (i + 1) / slices);
  });
  uint64_t total = 0;
  for (uint64_t x : sums) total += x;
  return total;
}

}  // extern "C"
