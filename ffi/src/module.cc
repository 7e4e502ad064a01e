// Library-level entry points: the exported handler symbols (forwarded to the instruction-set
// level chosen at load, dispatch.h) and the functions ninfer_kv/ops/ffi/ reads through ctypes.
#include <cstdint>
#include <string>
#include <vector>

#include "common.h"
#include "dispatch.h"
#include "packed_order.h"
#include "thread_pool.h"
#include "xla/ffi/api/c_api.h"

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
NINFER_KV_FORWARD(NinferKvMatmulBf16, matmul_bf16)
NINFER_KV_FORWARD(NinferKvMatmulBf16Packed, matmul_bf16_packed)
NINFER_KV_FORWARD(NinferKvPagedAppendRagged, paged_append_ragged)
NINFER_KV_FORWARD(NinferKvPagedAttentionRagged, paged_attention_ragged)
NINFER_KV_FORWARD(NinferKvPagedAttentionVariants, paged_attention_variants)
NINFER_KV_FORWARD(NinferKvPagedAttentionRaggedVariants, paged_attention_ragged_variants)
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
// ids of ninfer_kv.ops.ffi): scores | values << 8, each 0 (float32) or 1 (int8x2: the query rounded
// to 15 bits as two signed bytes, vpdpbusd); -1 for invalid arguments or no level in use.
NINFER_KV_EXPORT int32_t NinferKvFfiArithmetic(int32_t k_codec, int32_t v_codec, int32_t head_dim) {
  const auto* t = Table();
  return t ? t->arithmetic(k_codec, v_codec, head_dim) : -1;
}

// The form the packed weight products of the level in use run on this CPU: "amx-chunks" or
// "amx-pairs" (AMX tiles, in that order of packed_order.h), "vdpbf16ps" (AVX512_BF16) or "fma"
// (float32 FMAs, VDPBF16PS's arithmetic); "" when no level is in use.
NINFER_KV_EXPORT const char* NinferKvFfiPackedKernel() {
  const auto* t = Table();
  return t ? t->packed_kernel() : "";
}

// Why the packed products do not use AMX tiles here ("" when they do, or when no level is in use).
NINFER_KV_EXPORT const char* NinferKvFfiPackedAmxStatus() {
  const auto* t = Table();
  return t ? t->packed_amx_status() : "";
}

// The AMX orders of packed_order.h in scalar code, for the tests: out (M, N) = x (M, K) @ w (N, K).T
// over bfloat16 bits; order 0 "amx-chunks", 1 "amx-pairs".  Returns 0, or -1 for a bad argument.
NINFER_KV_EXPORT int NinferKvFfiPackedAmxReference(const uint16_t* x, const uint16_t* w, float* out, int64_t m,
                                                   int64_t n, int64_t k, int32_t order) {
  if (x == nullptr || w == nullptr || out == nullptr || m < 0 || n < 0 || k < 0 || (order != 0 && order != 1)) return -1;
  ninfer_kv_ffi::packed_order::AmxReference(x, w, out, m, n, k, order);
  return 0;
}

// Float lanes per SIMD vector of the level in use (0 when none is).
NINFER_KV_EXPORT int NinferKvFfiVectorWidth() {
  const auto* t = Table();
  return t ? t->vector_width : 0;
}

// Reads `bytes` bytes at `data` once, in `slices` contiguous slices on the pool (<= 0: one per
// pool thread; 1: the calling thread alone), and returns a checksum of them (for the
// read-bandwidth figure of bench/bench_ffi.py), with the vector loads of the level in use (a
// baseline loop measures 20-35% less than AVX-512 loads on an AVX-512 Xeon).
NINFER_KV_EXPORT uint64_t NinferKvFfiStreamRead(const void* data, int64_t bytes, int32_t slice_count) {
  const uint64_t* words = static_cast<const uint64_t*>(data);
  const int64_t n = bytes / 8;
  const int64_t slices = slice_count > 0 ? slice_count : ninfer_kv_ffi::PoolThreads();
  const auto* t = Table();
  if (t == nullptr) return 0;
  const auto read = t->read_words;
  std::vector<uint64_t> sums(static_cast<size_t>(slices), 0);
  ninfer_kv_ffi::ParallelFor(slices, [&](int64_t i) {
    sums[static_cast<size_t>(i)] = read(words, n * i / slices, n * (i + 1) / slices);
  });
  uint64_t total = 0;
  for (uint64_t x : sums) total += x;
  return total;
}

}  // extern "C"
