// Library-level entry points: the exported handler symbols (forwarded to the instruction-set
// level chosen at load, dispatch.h) and the functions ninfer_kv/ffi_ops.py reads through ctypes.
#include <string>

#include "common.h"
#include "dispatch.h"
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

NINFER_KV_EXPORT XLA_FFI_Error* NinferKvPagedAppend(XLA_FFI_CallFrame* f) {
  const auto* t = Table();
  return t ? t->paged_append(f) : Refused(f);
}
NINFER_KV_EXPORT XLA_FFI_Error* NinferKvPagedAttention(XLA_FFI_CallFrame* f) {
  const auto* t = Table();
  return t ? t->paged_attention(f) : Refused(f);
}
NINFER_KV_EXPORT XLA_FFI_Error* NinferKvCyclicAppend(XLA_FFI_CallFrame* f) {
  const auto* t = Table();
  return t ? t->cyclic_append(f) : Refused(f);
}
NINFER_KV_EXPORT XLA_FFI_Error* NinferKvCyclicAttention(XLA_FFI_CallFrame* f) {
  const auto* t = Table();
  return t ? t->cyclic_attention(f) : Refused(f);
}

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

// Float lanes per SIMD vector of the level in use (0 when none is).
NINFER_KV_EXPORT int NinferKvFfiVectorWidth() {
  const auto* t = Table();
  return t ? t->vector_width : 0;
}

}  // extern "C"
