// The KernelTable of the level this file is compiled for (one copy per level, see isa.h).
#include "attention_core.h"
#include "kernel_table.h"
#include "simd.h"

NINFER_KV_NAMESPACE_BEGIN
int32_t AttentionArithmetic(int32_t k_codec, int32_t v_codec, int32_t head_dim) {
  if (!ValidCodec(k_codec) || !ValidCodec(v_codec) || head_dim <= 0) return -1;
  const ArithmeticChoice a = ArithmeticOf(static_cast<Codec>(k_codec), static_cast<Codec>(v_codec), head_dim);
  return static_cast<int32_t>(a.scores) | (static_cast<int32_t>(a.values) << 8);
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
    &ninfer_kv_ffi::CyclicAppendHandler,
    &ninfer_kv_ffi::CyclicAttentionHandler,
    &ninfer_kv_ffi::AttentionArithmetic,
};
}  // extern "C"
