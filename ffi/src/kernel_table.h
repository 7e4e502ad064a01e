// The function table of one compiled instruction-set level, and the CPU features it needs.
//
// Every level (isa.h) defines one KernelTable as constant data: the six handlers compiled for
// that level, its vector width and the set of CPU features its code may use, derived from the
// compiler's predefined macros (so a -march=native build declares exactly what it was built
// for).  The dispatcher (dispatch.cc) reads the tables as data, without running any level's code,
// picks one level at load and forwards every handler call to it.
#ifndef NINFER_KV_FFI_KERNEL_TABLE_H_
#define NINFER_KV_FFI_KERNEL_TABLE_H_

#include <cstdint>

#include "isa.h"
#include "xla/ffi/api/c_api.h"

namespace ninfer_kv_ffi {

using HandlerFn = XLA_FFI_Error* (*)(XLA_FFI_CallFrame*);
// The products a level's attention uses for codecs (k, v) at head dim d: scores | values << 8, each
// an Arithmetic (attention_core.h: 0 float32, 1 int8x2).
using ArithmeticFn = int32_t (*)(int32_t k_codec, int32_t v_codec, int32_t head_dim);
// The sum of words [lo, hi) of w, read once with the level's vector loads (the read-bandwidth probe).
using ReadWordsFn = uint64_t (*)(const uint64_t* w, int64_t lo, int64_t hi);

// CPU features a level's code may use (bit i = Feature(i)); names in dispatch.cc.
enum Feature : uint64_t {
  kSse3 = 1ull << 0,
  kSsse3 = 1ull << 1,
  kSse41 = 1ull << 2,
  kSse42 = 1ull << 3,
  kPopcnt = 1ull << 4,
  kCx16 = 1ull << 5,
  kAvx = 1ull << 6,
  kAvx2 = 1ull << 7,
  kFma = 1ull << 8,
  kF16c = 1ull << 9,
  kBmi1 = 1ull << 10,
  kBmi2 = 1ull << 11,
  kLzcnt = 1ull << 12,
  kMovbe = 1ull << 13,
  kAvx512f = 1ull << 14,
  kAvx512bw = 1ull << 15,
  kAvx512cd = 1ull << 16,
  kAvx512dq = 1ull << 17,
  kAvx512vl = 1ull << 18,
  kAvx512vbmi = 1ull << 19,
  kNeon = 1ull << 20,
  kAvx512vnni = 1ull << 21,
  kAvx512bf16 = 1ull << 22,  // detected only: the packed products choose VDPBF16PS at run time
  kAmxBf16 = 1ull << 23,     // detected only (AMX-TILE, AMX-BF16 and the OS's tile state): the packed products' AMX form
  kNumFeatures = 24,
};

struct KernelTable {
  const char* level;      // "baseline", "avx2", "avx512", "avx512vnni", "neon" or "native"
  int vector_width;       // float lanes per vector
  uint64_t features;      // Feature bits the level's code may use
  HandlerFn paged_append, paged_attention, paged_append_ragged, paged_attention_ragged;  // paged_ops.cc
  HandlerFn cyclic_append, cyclic_attention, matmul_bf16, matmul_bf16_packed;
  ArithmeticFn arithmetic;
  ReadWordsFn read_words;
  const char* (*packed_kernel)();  // the form matmul_bf16_packed runs here: "amx-chunks", "amx-pairs", "vdpbf16ps", "fma"
  const char* (*packed_amx_status)();  // why the AMX form is not in use ("" when it is)
  HandlerFn paged_attention_variants, paged_attention_ragged_variants;  // paged_ops.cc
};

// The CPU features a translation unit is compiled to use, from the predefined macros.
constexpr uint64_t CompiledFeatures() {
  return 0
#if defined(__SSE3__)
         | kSse3
#endif
#if defined(__SSSE3__)
         | kSsse3
#endif
#if defined(__SSE4_1__)
         | kSse41
#endif
#if defined(__SSE4_2__)
         | kSse42
#endif
#if defined(__POPCNT__)
         | kPopcnt
#endif
#if defined(__GCC_HAVE_SYNC_COMPARE_AND_SWAP_16) && (defined(__x86_64__) || defined(__i386__))
         | kCx16
#endif
#if defined(__AVX__)
         | kAvx
#endif
#if defined(__AVX2__)
         | kAvx2
#endif
#if defined(__FMA__)
         | kFma
#endif
#if defined(__F16C__)
         | kF16c
#endif
#if defined(__BMI__)
         | kBmi1
#endif
#if defined(__BMI2__)
         | kBmi2
#endif
#if defined(__LZCNT__)
         | kLzcnt
#endif
#if defined(__MOVBE__)
         | kMovbe
#endif
#if defined(__AVX512F__)
         | kAvx512f
#endif
#if defined(__AVX512BW__)
         | kAvx512bw
#endif
#if defined(__AVX512CD__)
         | kAvx512cd
#endif
#if defined(__AVX512DQ__)
         | kAvx512dq
#endif
#if defined(__AVX512VL__)
         | kAvx512vl
#endif
#if defined(__AVX512VBMI__)
         | kAvx512vbmi
#endif
#if defined(__AVX512VNNI__)
         | kAvx512vnni
#endif
#if defined(__ARM_NEON)
         | kNeon
#endif
      ;
}

}  // namespace ninfer_kv_ffi

// The table of level `id` (a plain identifier), defined by that level's kernels.cc.
#define NINFER_KV_KERNEL_TABLE(id) NINFER_KV_CAT(NinferKvKernels_, id)

NINFER_KV_NAMESPACE_BEGIN
// The handlers of the level this translation unit is compiled for (paged_ops.cc, cyclic_ops.cc).
XLA_FFI_Error* PagedAppendHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* PagedAttentionHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* PagedAppendRaggedHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* PagedAttentionRaggedHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* PagedAttentionVariantsHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* PagedAttentionRaggedVariantsHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* CyclicAppendHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* CyclicAttentionHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* MatmulBf16Handler(XLA_FFI_CallFrame* call_frame);  // matmul.cc
XLA_FFI_Error* MatmulBf16PackedHandler(XLA_FFI_CallFrame* call_frame);  // gemm_packed.cc
const char* PackedKernel();                                           // gemm_packed.cc
const char* PackedAmxStatus();                                        // gemm_packed.cc
int32_t AttentionArithmetic(int32_t k_codec, int32_t v_codec, int32_t head_dim);
NINFER_KV_NAMESPACE_END

#endif  // NINFER_KV_FFI_KERNEL_TABLE_H_
