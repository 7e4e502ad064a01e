// Instruction-set levels of the kernels.
//
// The kernel sources are compiled once per level (ffi/CMakeLists.txt) with that level's compiler
// flags and with NINFER_KV_ISA_ID set to the level's name (baseline, avx2, avx512, neon, native).
// Everything they define lives in the inline namespace ninfer_kv_ffi::isa_<level>, so the copies
// of one function compiled for different levels never share a symbol (inline functions and
// templates included) and the linker cannot mix them.  Code shared by every level (the thread
// pool, CPU feature detection, the dispatch table) lives in ninfer_kv_ffi itself and is compiled
// once, for the baseline.
#ifndef NINFER_KV_FFI_ISA_H_
#define NINFER_KV_FFI_ISA_H_

#ifndef NINFER_KV_ISA_ID
#define NINFER_KV_ISA_ID baseline
#endif

#define NINFER_KV_CAT_(a, b) a##b
#define NINFER_KV_CAT(a, b) NINFER_KV_CAT_(a, b)
#define NINFER_KV_STR_(a) #a
#define NINFER_KV_STR(a) NINFER_KV_STR_(a)

#define NINFER_KV_ISA_NS NINFER_KV_CAT(isa_, NINFER_KV_ISA_ID)
#define NINFER_KV_NAMESPACE_BEGIN \
  namespace ninfer_kv_ffi {       \
  inline namespace NINFER_KV_ISA_NS {
#define NINFER_KV_NAMESPACE_END \
  }                             \
  }

#endif  // NINFER_KV_FFI_ISA_H_
