// Library-level entry points used by ninfer_kv/ffi_ops.py (through ctypes) besides the handlers.
#include "common.h"
#include "simd.h"
#include "thread_pool.h"

extern "C" {

// The operand/attribute contract version of the handlers (see kAbiVersion).
__attribute__((visibility("default"))) int NinferKvFfiAbiVersion() { return ninfer_kv_ffi::kAbiVersion; }

// Threads the kernels use (the caller included); starts the pool on first use.
__attribute__((visibility("default"))) int NinferKvFfiNumThreads() { return ninfer_kv_ffi::PoolThreads(); }

// Float lanes per SIMD vector the library was compiled for (16 with AVX-512, else 8).
__attribute__((visibility("default"))) int NinferKvFfiVectorWidth() { return ninfer_kv_ffi::kVL; }

}  // extern "C"
