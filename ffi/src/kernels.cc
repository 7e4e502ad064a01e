// The KernelTable of the level this file is compiled for (one copy per level, see isa.h).
#include <cstring>

#include "attention_core.h"
#include "kernel_table.h"
#include "simd.h"

NINFER_KV_NAMESPACE_BEGIN
int32_t AttentionArithmetic(int32_t k_codec, int32_t v_codec, int32_t head_dim) {
  if (!ValidCodec(k_codec) || !ValidCodec(v_codec) || head_dim <= 0) return -1;
  const ArithmeticChoice a = ArithmeticOf(static_cast<Codec>(k_codec), static_cast<Codec>(v_codec), head_dim);
  return static_cast<int32_t>(a.scores) | (static_cast<int32_t>(a.values) << 8);
}

// Four independent 64-byte accumulators (one zmm each at the AVX-512 levels, two ymm at avx2,
// four xmm at the baseline), so that the loop is bound by the loads, not by the adds.
uint64_t ReadWords(const uint64_t* w, int64_t lo, int64_t hi) {
  typedef uint64_t Words __attribute__((vector_size(64)));
  Words a = {}, b = {}, c = {}, d = {};
  int64_t j = lo;
  for (; j + 32 <= hi; j += 32) {
    Words x, y, z, u;
    std::memcpy(&x, w + j, sizeof(Words));
    std::memcpy(&y, w + j + 8, sizeof(Words));
    std::memcpy(&z, w + j + 16, sizeof(Words));
    std::memcpy(&u, w + j + 24, sizeof(Words));
    a += x, b += y, c += z, d += u;
  }
  a += b + c + d;
  uint64_t total = 0;
  for (int k = 0; k < 8; ++k) total += a[k];
  for (; j < hi; ++j) total += w[j];
  return total;
}
NINFER_KV_NAMESPACE_END

extern "C" {
__attribute__((visibility("hidden"))) extern const ninfer_kv_ffi::KernelTable NINFER_KV_KERNEL_TABLE(NINFER_KV_ISA_ID);
const ninfer_kv_ffi::KernelTable NINFER_KV_KERNEL_TABLE(NINFER_KV_ISA_ID) = {
    NINFER_KV_STR(NINFER_KV_ISA_ID),
    ninfer_kv_ffi::kVL,
    ninfer_kv_ffi::CompiledFeatures(),
    &ninfer_kv_ffi::PagedAppendHandler,
    &ninfer_kv_ffi::PagedAttentionHandler,
    &ninfer_kv_ffi::PagedAppendRaggedHandler,
    &ninfer_kv_ffi::PagedAttentionRaggedHandler,
    &ninfer_kv_ffi::CyclicAppendHandler,
    &ninfer_kv_ffi::CyclicAttentionHandler,
    &ninfer_kv_ffi::MatmulBf16Handler,
    &ninfer_kv_ffi::MatmulBf16PackedHandler,
    &ninfer_kv_ffi::AttentionArithmetic,
    &ninfer_kv_ffi::ReadWords,
    &ninfer_kv_ffi::PackedKernel,
    &ninfer_kv_ffi::PackedAmxStatus,
    &ninfer_kv_ffi::PagedAttentionVariantsHandler,
    &ninfer_kv_ffi::PagedAttentionRaggedVariantsHandler,
};
}  // extern "C"
