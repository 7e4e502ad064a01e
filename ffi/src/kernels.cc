// The KernelTable of the level this file is compiled for (one copy per level, see isa.h).
#include "kernel_table.h"
#include "simd.h"

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
};
}  // extern "C"
