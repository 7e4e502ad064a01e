// Compute-only benchmark of the CPU attention kernel (AttentionAccumulator::Fold), next to the
// machine's measured multiply-add peak.  Built and run by bench/bench_ffi_compute.py, once per
// instruction-set level, from the same sources and flags as the library.
//
// One task of `rows` query rows (a GQA group) folds `keys` keys of head dim 128, cycling over 8
// pages of 64 tokens that stay in L2, so memory bandwidth plays no part: what is left is the
// arithmetic and the instructions around it.  Decode attention needs 2 * rows * 128 multiply-adds
// per key (scores and values); "of FMA peak" is that count over the peak measured here by a loop
// of independent multiply-adds of the same vector width.  The other peaks measure integer
// products, with the adds that accumulate them: `int16` vpmaddwd + vpaddd (int16 x int16 into
// int32), `int8` vpmaddubsw + vpmaddwd-by-one + vpaddd (8-bit x 8-bit into int32, as 8-bit
// dot-product kernels chain them), and on levels with AVX-512 VNNI `vnni16` vpdpwssd and `vnni8`
// vpdpbusd (the product and the add in one instruction); `int8x2` is half the vnni8 rate: the
// multiply-adds of the kernels' int8x2 arithmetic, two byte products each (int_scores.h).
// `bf16` is VDPBF16PS (bfloat16 pair products into float32: the packed weight products' form on
// AVX512_BF16) and `amx` TDPBF16PS on 16 x 32 by 32 x 16 tiles (CPUs with AMX-BF16): the BF16
// matrix peaks, measured where the CPU has the instruction, at any AVX-512 level.
// Times are the thread's CPU time (a share of the machine taken by other work does not count).
//
// Usage: ffi_compute <k codec> <v codec> [rows] [repeats]    (codecs: 0 BF16, 1 INT8-G64,
//        ffi_compute peak [float32 | int16 | int8 | vnni16 | vnni8 | int8x2 | bf16 | amx]
//                                                                       (2 FP8-row, 3 NVFP4-G16)
#include <immintrin.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "attention_core.h"
#include "common.h"
#include "simd.h"

using namespace ninfer_kv_ffi;

namespace ninfer_kv_ffi {
// The library decides this once in dispatch.cc (CPU and NINFER_KV_FFI_BF16); this harness builds the
// attention sources without the dispatcher and asks the CPU.
bool Bf16DotsEnabled() { return __builtin_cpu_supports("avx512bf16"); }
}  // namespace ninfer_kv_ffi

namespace {

double Seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

#if defined(__AVX512F__)
using IntVec = __m512i;
#define NINFER_KV_BENCH_OPS(x) _mm512_##x
#define NINFER_KV_BENCH_KEEP "+v"
#elif defined(__AVX__)
using IntVec = __m256i;
#define NINFER_KV_BENCH_OPS(x) _mm256_##x
#define NINFER_KV_BENCH_KEEP "+x"
#else
#error "ffi_compute measures the AVX levels"
#endif

// Steps per second of one thread through 10 independent chains a_i = step(a_i), all starting at
// `init` (the asm statement keeps the chains in registers and stops the compiler from folding
// steps).
template <class V, class Step>
double ChainStepsPerSecond(V init, Step step) {
  V a0 = init, a1 = init, a2 = init, a3 = init, a4 = init, a5 = init, a6 = init, a7 = init, a8 = init, a9 = init;
  const long steps = 20000000;
  double best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    const double t0 = Seconds();
    for (long s = 0; s < steps; ++s) {
      a0 = step(a0), a1 = step(a1), a2 = step(a2), a3 = step(a3), a4 = step(a4);
      a5 = step(a5), a6 = step(a6), a7 = step(a7), a8 = step(a8), a9 = step(a9);
      __asm__ volatile("" : NINFER_KV_BENCH_KEEP(a0), NINFER_KV_BENCH_KEEP(a1), NINFER_KV_BENCH_KEEP(a2),
                       NINFER_KV_BENCH_KEEP(a3), NINFER_KV_BENCH_KEEP(a4), NINFER_KV_BENCH_KEEP(a5),
                       NINFER_KV_BENCH_KEEP(a6), NINFER_KV_BENCH_KEEP(a7), NINFER_KV_BENCH_KEEP(a8),
                       NINFER_KV_BENCH_KEEP(a9));
    }
    best = std::min(best, Seconds() - t0);
  }
  int keep = 0;
  for (const V& a : {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9}) {
    int x;
    std::memcpy(&x, &a, sizeof x);
    keep ^= x;
  }
  if (keep == 12345) std::puts("");  // keeps the chains alive
  return 10.0 * steps / best;
}

// Multiply-add lanes per second of one thread: a fused multiply-add of kVL lanes per step.
double PeakFmaLanesPerSecond() {
  const VFloat m = Splat(0.999999f), c = Splat(1e-7f);
  return kVL * ChainStepsPerSecond(Splat(1.0f), [=](VFloat a) { return a * m + c; });
}

// Multiply lanes per second of one thread through `bits`-bit integer pair products (16 or 8),
// each step accumulating the pair products into int32 lanes.
template <int bits>
double PeakIntLanesPerSecond() {
  const IntVec m = NINFER_KV_BENCH_OPS(set1_epi16)(3), ones = NINFER_KV_BENCH_OPS(set1_epi16)(1);
  auto step = [=](IntVec acc) {
    if constexpr (bits == 16) {
      return NINFER_KV_BENCH_OPS(add_epi32)(acc, NINFER_KV_BENCH_OPS(madd_epi16)(acc, m));
    } else {
      const IntVec pairs = NINFER_KV_BENCH_OPS(maddubs_epi16)(acc, m);  // uint8 x int8 pairs into int16
      return NINFER_KV_BENCH_OPS(add_epi32)(acc, NINFER_KV_BENCH_OPS(madd_epi16)(pairs, ones));
    }
  };
  return (sizeof(IntVec) * 8 / bits) * ChainStepsPerSecond(NINFER_KV_BENCH_OPS(set1_epi32)(1), step);
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
// Multiply lanes per second of one thread through the VNNI dot products (the multiply and the
// accumulation in one instruction): vpdpwssd (16-bit pairs) or vpdpbusd (8-bit quadruples).
template <int bits>
double PeakVnniLanesPerSecond() {
  const __m512i m = _mm512_set1_epi16(3);
  auto step = [=](__m512i acc) {
    if constexpr (bits == 16) {
      return _mm512_dpwssd_epi32(acc, m, m);
    } else {
      return _mm512_dpbusd_epi32(acc, m, m);
    }
  };
  return (512 / bits) * ChainStepsPerSecond(_mm512_set1_epi32(1), step);
}
#endif

#if defined(__AVX512F__)
// Multiply-adds per second of one thread through VDPBF16PS (32 bfloat16 pair products per step).
// (Ten independent chains, as ChainStepsPerSecond; written out, since the instruction needs the
// target attribute, which a lambda does not inherit.)
__attribute__((target("avx512bf16"))) double PeakBf16MacsPerSecond() {
  const __m512bh m = (__m512bh)_mm512_set1_epi32(0x3F803F80);  // (1.0, 1.0)
  __m512 a[10];
  for (auto& v : a) v = _mm512_set1_ps(1.0f);
  const long steps = 20000000;
  double best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    const double t0 = Seconds();
    for (long s = 0; s < steps; ++s) {
      for (auto& v : a) v = _mm512_dpbf16_ps(v, m, m);
      for (auto& v : a) __asm__ volatile("" : : "v"(v));  // each step's results used (an in-out operand halves the rate)
    }
    best = std::min(best, Seconds() - t0);
  }
  float keep = 0;
  for (auto& v : a) keep += _mm512_reduce_add_ps(v);
  if (keep == 12345.0f) std::puts("");  // keeps the chains alive
  return 32.0 * 10.0 * steps / best;
}

// Multiply-adds per second of one thread through TDPBF16PS on full tiles (16 x 16 x 32 each): four
// independent accumulators over two A and two B tiles held in the tile registers.
__attribute__((target("amx-tile,amx-bf16"))) double PeakAmxMacsPerSecond() {
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 0.0;  // ARCH_REQ_XCOMP_PERM, XTILEDATA
  alignas(64) uint8_t cfg[64] = {1};
  for (int t = 0; t < 8; ++t) {
    const uint16_t colsb = 64;
    std::memcpy(cfg + 16 + 2 * t, &colsb, 2);
    cfg[48 + t] = 16;
  }
  _tile_loadconfig(cfg);
  alignas(64) static uint16_t ones[16 * 32];
  for (auto& v : ones) v = 0x3F80;
  _tile_loadd(4, ones, 64);
  _tile_loadd(5, ones, 64);
  _tile_loadd(6, ones, 64);
  _tile_loadd(7, ones, 64);
  const long steps = 2000000;
  double best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const double t0 = Seconds();
    for (long s = 0; s < steps; ++s) {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    best = std::min(best, Seconds() - t0);
  }
  _tile_release();
  return 4.0 * 16 * 16 * 32 * steps / best;
}
#endif

// Random valid codes and scales of `pages` pages of 64 tokens for codec c (head dim d).
RowSource MakePlane(int c, int d, int pages, std::mt19937& rng, std::vector<uint8_t>* data, std::vector<uint8_t>* sc) {
  const CodecPlanes cp = PlanesOf(static_cast<Codec>(c), d);
  data->resize(static_cast<size_t>(pages) * 64 * cp.data_extent * cp.data_itemsize);
  for (auto& x : *data) x = static_cast<uint8_t>(rng());
  if (c == 0) {  // bfloat16 of magnitude about 1
    for (size_t i = 1; i < data->size(); i += 2) (*data)[i] = static_cast<uint8_t>(0x3F | ((rng() & 1) << 7));
  }
  if (c == 2) {  // no e4m3fn NaN codes
    for (auto& x : *data) x = ((x & 0x7F) == 0x7F) ? 0x10 : x;
  }
  const int scale_bytes = cp.scale_extent * cp.scale_itemsize;
  sc->resize(static_cast<size_t>(pages) * 64 * std::max(scale_bytes, 1));
  for (size_t i = 0; i < sc->size(); ++i) {
    // NVFP4: e4m3fn scales in [2^-3, 2); bfloat16 scales: high byte 0x3C (about 2^-7)
    (*sc)[i] = static_cast<uint8_t>(c == 3 ? 0x20 + (rng() & 0x1F) : ((i & 1) ? 0x3C : rng()));
  }
  return RowSource{static_cast<Codec>(c), data->data(), scale_bytes ? sc->data() : nullptr,
                   static_cast<int64_t>(cp.data_extent) * cp.data_itemsize, scale_bytes};
}

RowSource AtPage(RowSource r, int page) {
  r.data += static_cast<int64_t>(page) * 64 * r.data_stride;
  if (r.scale) r.scale += static_cast<int64_t>(page) * 64 * r.scale_stride;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2 && std::strcmp(argv[1], "peak") == 0) {
    const char* kind = argc >= 3 ? argv[2] : "float32";
    if (std::strcmp(kind, "float32") == 0) {
      std::printf("%.4g\n", PeakFmaLanesPerSecond());
    } else if (std::strcmp(kind, "int16") == 0) {
      std::printf("%.4g\n", PeakIntLanesPerSecond<16>());
    } else if (std::strcmp(kind, "int8") == 0) {
      std::printf("%.4g\n", PeakIntLanesPerSecond<8>());
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
    } else if (std::strcmp(kind, "vnni16") == 0) {
      std::printf("%.4g\n", PeakVnniLanesPerSecond<16>());
    } else if (std::strcmp(kind, "vnni8") == 0) {
      std::printf("%.4g\n", PeakVnniLanesPerSecond<8>());
    } else if (std::strcmp(kind, "int8x2") == 0) {
      std::printf("%.4g\n", 0.5 * PeakVnniLanesPerSecond<8>());
#endif
#if defined(__AVX512F__)
    } else if (std::strcmp(kind, "bf16") == 0 && __builtin_cpu_supports("avx512bf16")) {
      std::printf("%.4g\n", PeakBf16MacsPerSecond());
    } else if (std::strcmp(kind, "amx") == 0 && __builtin_cpu_supports("amx-bf16")) {
      std::printf("%.4g\n", PeakAmxMacsPerSecond());
#endif
    } else {
      std::fprintf(stderr, "peak kind %s: not measured at this level or on this CPU (float32, int16, int8; "
                   "vnni16, vnni8, int8x2 with AVX-512 VNNI; bf16 with AVX512_BF16, amx with AMX-BF16)\n", kind);
      return 2;
    }
    return 0;
  }
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s <k codec> <v codec> [rows] [repeats] | %s peak [float32|int16|int8]\n", argv[0],
                 argv[0]);
    return 2;
  }
  const int kc = std::atoi(argv[1]), vc = std::atoi(argv[2]);
  const int rows = argc > 3 ? std::atoi(argv[3]) : 4;
  const int repeats = argc > 4 ? std::atoi(argv[4]) : 30;
  if (!ValidCodec(kc) || !ValidCodec(vc) || rows < 1 || rows > 64 || repeats < 1) {
    std::fprintf(stderr, "codecs must be 0..3, rows 1..64, repeats >= 1\n");
    return 2;
  }
  constexpr int kD = 128, kPages = 8;
  constexpr int64_t kKeys = 32768;
  std::mt19937 rng(1);
  std::vector<uint8_t> kd, ks, vd, vs;
  const RowSource k = MakePlane(kc, kD, kPages, rng, &kd, &ks);
  const RowSource v = MakePlane(vc, kD, kPages, rng, &vd, &vs);
  ScopedFlushDenormal flush;
  AttentionAccumulator acc;
  double best = 1e30;
  float check = 0.0f;
  for (int rep = 0; rep < repeats; ++rep) {
    acc.Begin(rows, kD, 64, 0.088f);
    for (int m = 0; m < rows; ++m) {
      float* q = acc.QueryRow(m);
      for (int i = 0; i < kD; ++i) q[i] = static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 1000.0f;
      acc.SetVisible(m, 0, kKeys - 1);
    }
    const double t0 = Seconds();
    for (int64_t j = 0; j < kKeys; j += 64) {
      const int page = static_cast<int>((j / 64) % kPages), next = static_cast<int>((j / 64 + 1) % kPages);
      const KVRunSource run{AtPage(k, page), AtPage(v, page)}, pf{AtPage(k, next), AtPage(v, next)};
      acc.Fold(run, j, 64, &pf);
    }
    best = std::min(best, Seconds() - t0);
    float out[kD];
    acc.Output(0, out);
    check += out[0];
  }
  const double lanes = 2.0 * rows * kD * kKeys;  // multiply-add lanes of the task
  const ArithmeticChoice ar = ArithmeticOf(static_cast<Codec>(kc), static_cast<Codec>(vc), kD);
  auto name = [](Arithmetic a) { return a == Arithmetic::kInt8x2 ? "int8x2" : "float32"; };
  std::printf("%.3f %.4g %g %s %s\n", best / kKeys * 1e9, lanes / best, check, name(ar.scores), name(ar.values));
  return 0;
}
