// Run-time choice of the instruction-set level (isa.h): CPU feature detection and the table of
// the level in use.
//
// The level is chosen once, on first use: the best compiled-in level whose features the CPU (and
// the operating system, for the AVX register state) supports, or the level named by the
// environment variable NINFER_KV_FFI_ISA (baseline, avx2, avx512, neon, native; "auto" or empty
// means the best).  A named level that is not compiled in, or that this CPU cannot run, is
// refused: no level is selected and Selection::error says why.
#ifndef NINFER_KV_FFI_DISPATCH_H_
#define NINFER_KV_FFI_DISPATCH_H_

#include <cstdint>
#include <string>

#include "kernel_table.h"

namespace ninfer_kv_ffi {

// Feature bits (kernel_table.h) this CPU and OS support.
uint64_t CpuFeatures();

// Names of the features in `bits`, comma separated ("avx2,fma,f16c").
std::string FeatureNames(uint64_t bits);

struct Selection {
  const KernelTable* table = nullptr;  // null when refused
  std::string error;                   // why nothing was selected (empty on success)
  std::string compiled;                // compiled-in levels, best first, comma separated
  std::string supported;               // those this CPU can run
  std::string cpu_features;            // FeatureNames(CpuFeatures())
};

// Whether the kernels may use VDPBF16PS (the packed weight products, gemm_packed.cc; the scores of
// BF16 keys, attention_core.cc): the CPU has AVX512_BF16 and NINFER_KV_FFI_BF16 is not "0" (read
// once; "0" keeps the float32 FMA forms, for tests and comparisons).
bool Bf16DotsEnabled();

// Why the packed products may not use AMX tiles here ("" when they may): the CPU lacks AMX-BF16
// (or the OS its tile state), NINFER_KV_FFI_AMX or NINFER_KV_FFI_BF16 is "0", or the kernel refused
// the tile data permission (Linux's arch_prctl, requested once, here).  Read once.
const char* AmxTileDataRefusal();

// The selection of this process (made on the first call; thread safe).
const Selection& Selected();

}  // namespace ninfer_kv_ffi

#endif  // NINFER_KV_FFI_DISPATCH_H_
