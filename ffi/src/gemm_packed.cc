// XLA FFI handler of the model's weight products on weights packed once at load:
// out = x @ w.T for bfloat16 x and w, float32 out (or bfloat16: the float32 result rounded once,
// to nearest even, as the tile is written; each result chooses by its dtype).
//
//   NinferKvMatmulBf16Packed(x bf16 (M, K), packed_0 bf16 (T_0, P, 128), packed_1, ...)
//       -> out_0 f32|bf16 (M, N_0), out_1, ...      with P = ceil(K / 2), T_i = ceil(N_i / 64)
//
// Packed layout (ninfer_kv/ops/ffi/packed_weight.py writes it): tiles of 64 output columns, each tile one
// contiguous run over K, the bfloat16 pairs of a column side by side:
//   packed[t][p][c][e] = w[64 t + c, 2 p + e]      (t < T, p < P, c < 64, e < 2)
// zero past N and K, bfloat16 denormals flushed to zero (sign kept).  One pair step of a tile is
// 256 bytes: four vectors of 16 columns x (even, odd), the operand layout of VDPBF16PS.
//
// Arithmetic (the definition; the same for every M, row block, thread split and level): output
// (m, n) starts from +0 and, for p = 0 .. P-1 in order, takes two fused multiply-adds
//   acc = fma(x[m, 2p+1], w[n, 2p+1], acc);  acc = fma(x[m, 2p], w[n, 2p], acc)
// with denormal inputs read as zero and results flushed to zero when tiny after rounding (sign
// kept), x's pair past an odd K being zero.  This is what VDPBF16PS computes lane by lane (checked
// on AMD Zen 4 against the definition, denormals and underflowing products included), so:
//   * CPUs with AVX512_BF16 (cpuid 7.1:EAX[5]) use VDPBF16PS at the AVX-512 levels (unless
//     NINFER_KV_FFI_BF16=0, read once);
//   * every other level emulates it with float32 FMAs on the pairs split to float32 (exact), under
//     FTZ/DAZ (set on every thread for the kernel's duration); the baseline level, which has no
//     FMA, adds the exact double product in double precision (exactly rounded sums of two 24-bit
//     significands: no double-rounding error) and flushes tiny results explicitly.
// Every row's result is therefore bit-identical whatever the batch (batch invariance), and the
// same at every level on every x86 machine without AMX.  (AArch64's flush-to-zero detects tininess
// before rounding: a result that rounds up to the smallest normal float is flushed there.)
//
// AMX (CPUs with AMX-BF16, the AVX-512 levels): the AMX form multiplies 16-row tiles of x by
// 16-pair x 16-column tiles of the packed weight with TDPBF16PS, whose arithmetic is its own: one
// of the two orders of packed_order.h ("amx-chunks", "amx-pairs"; K padded with zeros to a
// multiple of 32).  It is used only after a check, once per process, that the hardware reproduces
// one of them bit for bit (on data with denormals and underflowing products); that order then
// holds for every M on this machine, single rows included (batch invariance), and differs from the
// pairs order above in the last bits.  Otherwise, or with NINFER_KV_FFI_AMX=0, the machine runs
// VDPBF16PS or the FMA form as above.  The weights need no other packing: a pair step of a tile
// holds four B tiles' rows side by side (stride 256 bytes).
//
// Blocking: the work is split over the thread pool by row blocks (about 512 KiB of x, kept in L2;
// outermost) and tiles (64 columns of one weight).  A task runs its tile over K blocks of
// kPairsPerBlock pairs (64 KiB of the tile, kept in L1/L2 while the rows pass), each K block over
// register blocks of MR rows x NG groups of 16 columns (6 x 4 with VDPBF16PS: 24 accumulators,
// four weight vectors loaded per pair step and one broadcast pair of x per row); partial sums go
// to the float32 output between K blocks (which keeps the order).  One row of x reads each tile
// front to back: one sequential stream per tile.  (The AMX form keeps its accumulators in tiles
// across all of K.)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "dispatch.h"
#include "handler_args.h"
#include "kernel_table.h"
#include "packed_order.h"
#include "thread_pool.h"
#include "vector_codec.h"
#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) && defined(__AVX512F__) && (defined(__clang__) || __GNUC__ >= 10)
#include <immintrin.h>
#define NINFER_KV_PACKED_BF16 1
#if defined(__linux__) && (defined(__clang__) || __GNUC__ >= 11)
#define NINFER_KV_PACKED_AMX 1
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#endif

namespace ffi = xla::ffi;

NINFER_KV_NAMESPACE_BEGIN
namespace {
namespace packed_products {  // named: the sources also build as one translation unit (the NEON check)

typedef float V16 __attribute__((vector_size(64)));
typedef uint32_t U16 __attribute__((vector_size(64)));
typedef double D8 __attribute__((vector_size(64)));
typedef float F8 __attribute__((vector_size(32)));

constexpr int64_t kTileCols = 64;         // output columns per tile
constexpr int64_t kTileWords = kTileCols;  // 32-bit words (bfloat16 pairs) per pair step of a tile
constexpr int kGroups = 4;                 // vectors of 16 columns per tile
constexpr int64_t kPairsPerBlock = 256;    // pairs of K per block (64 KiB of a tile)
constexpr int64_t kRowBlockBytes = 512 << 10;  // bytes of prepared x per row block (kept in L2)
constexpr int64_t kRowBlockUnit = 48;          // row blocks are a multiple of this (6-row and 16-row blocks)

#if defined(__AVX512F__)
constexpr int kFmaRows = 4, kFmaGroups = 4;
#elif defined(__AVX2__) || (defined(__aarch64__) && defined(__ARM_NEON))
constexpr int kFmaRows = 4, kFmaGroups = 1;
#else
constexpr int kFmaRows = 2, kFmaGroups = 1;
#endif

// acc + a * b rounded once (see the header); tiny results flushed by FTZ or explicitly.
inline V16 Fma(V16 a, V16 b, V16 acc) {
#if defined(__AVX512F__)
  return (V16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc);
#elif defined(__AVX2__) && defined(__FMA__)
  V16 r;
  for (int h = 0; h < 2; ++h) {
    __m256 x, y, z;
    std::memcpy(&x, reinterpret_cast<const float*>(&a) + 8 * h, 32);
    std::memcpy(&y, reinterpret_cast<const float*>(&b) + 8 * h, 32);
    std::memcpy(&z, reinterpret_cast<const float*>(&acc) + 8 * h, 32);
    const __m256 s = _mm256_fmadd_ps(x, y, z);
    std::memcpy(reinterpret_cast<float*>(&r) + 8 * h, &s, 32);
  }
  return r;
#elif defined(__aarch64__) && defined(__ARM_NEON)
  V16 r;
  for (int q = 0; q < 4; ++q) {
    float32x4_t x, y, z;
    std::memcpy(&x, reinterpret_cast<const float*>(&a) + 4 * q, 16);
    std::memcpy(&y, reinterpret_cast<const float*>(&b) + 4 * q, 16);
    std::memcpy(&z, reinterpret_cast<const float*>(&acc) + 4 * q, 16);
    const float32x4_t s = vfmaq_f32(z, x, y);
    std::memcpy(reinterpret_cast<float*>(&r) + 4 * q, &s, 16);
  }
  return r;
#else
  // The product of two bfloat16 values is exact in double, and so is the double sum rounded to
  // float (53 >= 2 * 24 + 2); tiny results flushed as x86's FTZ does (packed_order.h).
  V16 r;
  for (int h = 0; h < 2; ++h) {
    F8 x, y, z;
    std::memcpy(&x, reinterpret_cast<const float*>(&a) + 8 * h, 32);
    std::memcpy(&y, reinterpret_cast<const float*>(&b) + 8 * h, 32);
    std::memcpy(&z, reinterpret_cast<const float*>(&acc) + 8 * h, 32);
    const D8 d = __builtin_convertvector(z, D8) + __builtin_convertvector(x, D8) * __builtin_convertvector(y, D8);
    for (int i = 0; i < 8; ++i) r[8 * h + i] = packed_order::RoundFtz(d[i]);
  }
  return r;
#endif
}

inline V16 AsFloat(U16 u) {
  V16 f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// One weight and its result: float32, or bfloat16 (the float32 sums rounded once, to nearest even).
struct Product {
  const uint16_t* packed;  // (T, P, 128)
  float* out;              // (M, N) float32, or nullptr
  uint16_t* out_bf16;      // (M, N) bfloat16, or nullptr
  int64_t n_len, tiles;
};

// Where a task's register blocks write: the output itself, or a tile-wide scratch for the last,
// partial tile (copied out at the end).
struct Dest {
  float* data;
  int64_t ld;
};

using packed_order::FlushBf16;

// ---- the float32 FMA path: x as (odd, even) float32 per pair, x_f[(m * P + p) * 2 + {0, 1}] ----

template <int MR, int NG>
void FmaBlock(const float* xf, int64_t pairs, const uint16_t* tile, int64_t p0, int64_t p1, int64_t m, int g0,
              Dest d) {
  V16 acc[MR][NG];
  for (int i = 0; i < MR; ++i)
    for (int g = 0; g < NG; ++g) {
      if (p0 == 0) {
        acc[i][g] = V16{};
      } else {
        std::memcpy(&acc[i][g], d.data + (m + i) * d.ld + 16 * (g0 + g), sizeof(V16));
      }
    }
  for (int64_t p = p0; p < p1; ++p) {
    V16 we[NG], wo[NG];
    for (int g = 0; g < NG; ++g) {
      U16 bits;
      std::memcpy(&bits, tile + (p * kTileWords + 16 * (g0 + g)) * 2, sizeof bits);
      we[g] = AsFloat(bits << 16);
      wo[g] = AsFloat(bits & 0xFFFF0000u);
    }
    for (int i = 0; i < MR; ++i) {
      const float* xp = xf + ((m + i) * pairs + p) * 2;
      const V16 xo = xp[0] - V16{}, xe = xp[1] - V16{};
      for (int g = 0; g < NG; ++g) {
        acc[i][g] = Fma(xo, wo[g], acc[i][g]);
        acc[i][g] = Fma(xe, we[g], acc[i][g]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int g = 0; g < NG; ++g) std::memcpy(d.data + (m + i) * d.ld + 16 * (g0 + g), &acc[i][g], sizeof(V16));
}

template <int MR>
void FmaRows(const float* xf, int64_t pairs, const uint16_t* tile, int64_t p0, int64_t p1, int64_t m, Dest d) {
  for (int g0 = 0; g0 < kGroups; g0 += kFmaGroups) FmaBlock<MR, kFmaGroups>(xf, pairs, tile, p0, p1, m, g0, d);
}

void FmaTile(const float* xf, int64_t m_len, int64_t pairs, const uint16_t* tile, Dest d) {
  for (int64_t p0 = 0; p0 < pairs; p0 += kPairsPerBlock) {
    const int64_t p1 = std::min(pairs, p0 + kPairsPerBlock);
    int64_t m = 0;
    for (; m + kFmaRows <= m_len; m += kFmaRows) FmaRows<kFmaRows>(xf, pairs, tile, p0, p1, m, d);
    switch (m_len - m) {
      case 3: FmaRows<3>(xf, pairs, tile, p0, p1, m, d); break;
      case 2: FmaRows<2>(xf, pairs, tile, p0, p1, m, d); break;
      case 1: FmaRows<1>(xf, pairs, tile, p0, p1, m, d); break;
      default: break;
    }
  }
}

// ---- the VDPBF16PS path: x as one 32-bit word per pair, x_w[m * P + p] ----

#if defined(NINFER_KV_PACKED_BF16)
constexpr int kBf16Rows = 6;

template <int MR>
__attribute__((target("avx512bf16"))) void Bf16Block(const uint32_t* xw, int64_t pairs, const uint16_t* tile,
                                                      int64_t p0, int64_t p1, int64_t m, Dest d) {
  __m512 acc[MR][kGroups];
  for (int i = 0; i < MR; ++i)
    for (int g = 0; g < kGroups; ++g)
      acc[i][g] = p0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(d.data + (m + i) * d.ld + 16 * g);
  const uint32_t* xr = xw + m * pairs;
  for (int64_t p = p0; p < p1; ++p) {
    __m512i w[kGroups];
    for (int g = 0; g < kGroups; ++g) w[g] = _mm512_loadu_si512(tile + (p * kTileWords + 16 * g) * 2);
    for (int i = 0; i < MR; ++i) {
      const __m512i b = _mm512_set1_epi32(static_cast<int>(xr[i * pairs + p]));
      for (int g = 0; g < kGroups; ++g) acc[i][g] = _mm512_dpbf16_ps(acc[i][g], (__m512bh)b, (__m512bh)w[g]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int g = 0; g < kGroups; ++g) _mm512_storeu_ps(d.data + (m + i) * d.ld + 16 * g, acc[i][g]);
}

void Bf16Tile(const uint32_t* xw, int64_t m_len, int64_t pairs, const uint16_t* tile, Dest d) {
  for (int64_t p0 = 0; p0 < pairs; p0 += kPairsPerBlock) {
    const int64_t p1 = std::min(pairs, p0 + kPairsPerBlock);
    int64_t m = 0;
    for (; m + kBf16Rows <= m_len; m += kBf16Rows) Bf16Block<kBf16Rows>(xw, pairs, tile, p0, p1, m, d);
    switch (m_len - m) {
      case 5: Bf16Block<5>(xw, pairs, tile, p0, p1, m, d); break;
      case 4: Bf16Block<4>(xw, pairs, tile, p0, p1, m, d); break;
      case 3: Bf16Block<3>(xw, pairs, tile, p0, p1, m, d); break;
      case 2: Bf16Block<2>(xw, pairs, tile, p0, p1, m, d); break;
      case 1: Bf16Block<1>(xw, pairs, tile, p0, p1, m, d); break;
      default: break;
    }
  }
}
#endif

// ---- the AMX path: x as 32-bit pair words, x_w[m * P16 + p], P16 = P rounded up to 16 (zeros) ----

#if defined(NINFER_KV_PACKED_AMX)
constexpr int64_t kChunkPairs = packed_order::kAmxChunk / 2;  // pairs per TDPBF16PS (one A tile row)

// The 64-byte tile configuration (palette 1): tiles 0-3 accumulate 16 columns each of `rows` rows,
// tile 4 holds `rows` rows of x (16 pairs), tiles 5 and 6 take turns with 16 pairs x 16 columns of
// the weight.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "the AMX tile configuration is 64 bytes");

TileConfig MakeTileConfig(int rows) {
  TileConfig c;
  for (int t = 0; t < 7; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = static_cast<uint8_t>(t < 5 ? rows : static_cast<int>(kChunkPairs));
  }
  return c;
}

// One tile (64 columns) for all rows: row blocks of 16 (the last one shorter, its own
// configuration), each over every chunk of 16 pairs, the accumulators kept in tiles 0-3 from +0.
// `b_tail` is a scratch chunk for a tile whose pairs are not a multiple of 16.
__attribute__((target("amx-tile,amx-bf16"))) void AmxTile(const uint32_t* xw, int64_t m_len, int64_t pairs,
                                                         const uint16_t* tile, uint16_t* b_tail, Dest d) {
  const int64_t chunks = (pairs + kChunkPairs - 1) / kChunkPairs, full = pairs / kChunkPairs;
  const int64_t x_stride = chunks * kChunkPairs * 4;                  // bytes per row of x_w
  const int64_t b_stride = kTileWords * 4;                            // bytes per pair step of the tile
  if (full != chunks) {
    const int64_t tail = pairs - full * kChunkPairs;
    std::memset(b_tail, 0, static_cast<size_t>(kChunkPairs * b_stride));
    std::memcpy(b_tail, tile + full * kChunkPairs * kTileWords * 2, static_cast<size_t>(tail * b_stride));
  }
  int loaded = 0;
  for (int64_t m0 = 0; m0 < m_len; m0 += 16) {
    const int rows = static_cast<int>(std::min<int64_t>(16, m_len - m0));
    if (rows != loaded) {
      const TileConfig cfg = MakeTileConfig(rows);
      _tile_loadconfig(&cfg);
      loaded = rows;
    }
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint32_t* a = xw + m0 * (x_stride / 4);
    for (int64_t c = 0; c < chunks; ++c) {
      const uint16_t* b = c < full ? tile + c * kChunkPairs * kTileWords * 2 : b_tail;
      _tile_loadd(4, a + c * kChunkPairs, x_stride);
      _tile_loadd(5, b, b_stride);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, b + 32, b_stride);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, b + 64, b_stride);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(6, b + 96, b_stride);
      _tile_dpbf16ps(3, 4, 6);
    }
    float* out = d.data + m0 * d.ld;
    const int64_t ld = d.ld * 4;
    _tile_stored(0, out, ld);
    _tile_stored(1, out + 16, ld);
    _tile_stored(2, out + 32, ld);
    _tile_stored(3, out + 48, ld);
  }
  _tile_release();
}
#endif

// The three forms of the packed products (see the header).
enum class Form { kFma, kBf16, kAmx };

const char* FormName(Form f) { return f == Form::kBf16 ? "vdpbf16ps" : "fma"; }  // AMX: by its order

// Per-thread scratch (reused across calls; grown, never shrunk).
template <typename T>
T* Scratch(std::vector<T>& buffer, int64_t n) {
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(static_cast<size_t>(n));
  return buffer.data();
}

// out_i = x @ w_i.T for x bfloat16 (M, K), M, K >= 1, in form `form`.
void PackedProducts(const uint16_t* xp, int64_t m_len, int64_t k_len, const std::vector<Product>& products, Form form) {
  const int64_t pairs = (k_len + 1) / 2;
  // x once per call: 32-bit pair words (VDPBF16PS, AMX: rows padded to whole chunks with zeros) or
  // (odd, even) float32 pairs, denormals flushed, the pair past an odd K zero.
  const bool words = form != Form::kFma;
  const int64_t x_pairs = form == Form::kAmx ? (pairs + 15) / 16 * 16 : pairs;
  thread_local std::vector<uint32_t> x_words;
  thread_local std::vector<float> x_floats;
  uint32_t* xw = words ? Scratch(x_words, m_len * x_pairs) : nullptr;
  float* xf = words ? nullptr : Scratch(x_floats, m_len * pairs * 2);
  ParallelFor(m_len, [&](int64_t m) {
    const uint16_t* row = xp + m * k_len;
    for (int64_t p = 0; p < pairs; ++p) {
      const uint32_t even = FlushBf16(row[2 * p]);
      const uint32_t odd = 2 * p + 1 < k_len ? FlushBf16(row[2 * p + 1]) : 0u;
      if (words) {
        xw[m * x_pairs + p] = even | (odd << 16);
      } else {
        const uint32_t bits[2] = {odd << 16, even << 16};
        std::memcpy(xf + (m * pairs + p) * 2, bits, sizeof bits);
      }
    }
    if (words) std::fill(xw + m * x_pairs + pairs, xw + (m + 1) * x_pairs, 0u);
  });
  // Tasks: (row block, product, tile), row blocks outermost.  A row block's x (about kRowBlockBytes)
  // stays in L2 while the tiles stream past it; each tile is read once per row block.
  const int64_t x_row_bytes = words ? x_pairs * 4 : pairs * 8;
  const int64_t block_rows = std::max<int64_t>(kRowBlockUnit, kRowBlockBytes / x_row_bytes / kRowBlockUnit * kRowBlockUnit);
  struct Task {
    int product;
    int64_t tile, m0, m1;
  };
  std::vector<Task> tasks;
  for (int64_t m0 = 0; m0 < m_len; m0 += block_rows) {
    for (size_t i = 0; i < products.size(); ++i) {
      for (int64_t t = 0; t < products[i].tiles; ++t) {
        tasks.push_back({static_cast<int>(i), t, m0, std::min(m_len, m0 + block_rows)});
      }
    }
  }
  ParallelFor(static_cast<int64_t>(tasks.size()), [&](int64_t task) {
    ScopedFlushDenormal flush;
    const Task& job = tasks[static_cast<size_t>(task)];
    const Product& p = products[job.product];
    const int64_t rows = job.m1 - job.m0;
    const uint16_t* tile = p.packed + job.tile * pairs * kTileWords * 2;
    const int64_t n0 = job.tile * kTileCols, cols = std::min(kTileCols, p.n_len - n0);
    thread_local std::vector<float> partial;  // a partial tile, or a tile for a bfloat16 result
    const bool direct = cols == kTileCols && p.out != nullptr;
    const Dest d = direct ? Dest{p.out + job.m0 * p.n_len + n0, p.n_len} : Dest{Scratch(partial, rows * kTileCols), kTileCols};
    switch (form) {
#if defined(NINFER_KV_PACKED_AMX)
      case Form::kAmx: {
        thread_local std::vector<uint16_t> b_tail;
        AmxTile(xw + job.m0 * x_pairs, rows, pairs, tile, Scratch(b_tail, 16 * kTileWords * 2), d);
        break;
      }
#endif
#if defined(NINFER_KV_PACKED_BF16)
      case Form::kBf16: Bf16Tile(xw + job.m0 * x_pairs, rows, pairs, tile, d); break;
#endif
      default: FmaTile(xf + job.m0 * pairs * 2, rows, pairs, tile, d); break;
    }
    if (!direct) {
      for (int64_t m = 0; m < rows; ++m) {
        const int64_t at = (job.m0 + m) * p.n_len + n0;
        if (p.out != nullptr) {
          std::memcpy(p.out + at, d.data + m * kTileCols, cols * sizeof(float));
        } else {
          FloatsToBf16(d.data + m * kTileCols, cols, reinterpret_cast<uint8_t*>(p.out_bf16 + at));
        }
      }
    }
  });
}

// Whether AMX is in use here, in which order, and why not.
struct AmxChoice {
  bool use = false;
  int order = packed_order::kAmxChunks;
  std::string why;
};

#if defined(NINFER_KV_PACKED_AMX)
// w (N, K) bfloat16 bits in the packed layout (ninfer_kv/ops/ffi/packed_weight.py's, for the AMX check).
std::vector<uint16_t> PackWeight(const std::vector<uint16_t>& w, int64_t n_len, int64_t k_len) {
  const int64_t tiles = (n_len + kTileCols - 1) / kTileCols, pairs = (k_len + 1) / 2;
  std::vector<uint16_t> packed(static_cast<size_t>(tiles * pairs * kTileWords * 2), 0);
  for (int64_t n = 0; n < n_len; ++n) {
    for (int64_t k = 0; k < k_len; ++k) {
      packed[static_cast<size_t>(((n / kTileCols * pairs + k / 2) * kTileCols + n % kTileCols) * 2 + k % 2)] =
          FlushBf16(w[static_cast<size_t>(n * k_len + k)]);
    }
  }
  return packed;
}

// The AMX form against both orders of packed_order.h on data that tells them apart: products
// across 17 rows (a full row block and a short one), 80 columns (a full tile and a partial one)
// and K = 93 (a partial chunk, an odd K), with signed zeros, denormal inputs, magnitudes from 1e-20
// to 1e15 and underflowing products.
AmxChoice CheckAmx() {
  AmxChoice choice;
  constexpr int64_t m_len = 17, n_len = 80, k_len = 93;
  uint64_t state = 0x9E3779B97F4A7C15ull;
  auto value = [&state]() -> uint16_t {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const uint32_t r = static_cast<uint32_t>(state >> 33);
    static const float kScales[] = {1.0f, 1.0f, 1e-20f, 1e-39f, 1e15f, 1e-19f, 0.0f, -0.0f};
    const float unit = static_cast<float>(r & 0xFFFFu) / 32768.0f - 1.0f;
    const float v = kScales[(r >> 16) & 7u] * unit;
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    return static_cast<uint16_t>(bits >> 16);
  };
  std::vector<uint16_t> x(m_len * k_len), w(n_len * k_len);
  for (auto& v : x) v = value();
  for (auto& v : w) v = value();
  const std::vector<uint16_t> packed = PackWeight(w, n_len, k_len);
  std::vector<float> got(m_len * n_len), want(m_len * n_len);
  PackedProducts(x.data(), m_len, k_len,
                 {Product{packed.data(), got.data(), nullptr, n_len, (n_len + kTileCols - 1) / kTileCols}},
                 Form::kAmx);
  for (int order : {packed_order::kAmxChunks, packed_order::kAmxPairs}) {
    packed_order::AmxReference(x.data(), w.data(), want.data(), m_len, n_len, k_len, order);
    if (std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) == 0) {
      choice.use = true;
      choice.order = order;
      return choice;
    }
  }
  for (int64_t i = 0; i < m_len * n_len; ++i) {
    uint32_t g, e;
    std::memcpy(&g, &got[i], 4);
    std::memcpy(&e, &want[i], 4);  // the last order tried
    if (g != e) {
      char buf[160];
      std::snprintf(buf, sizeof buf, "TDPBF16PS matches neither AMX order (row %lld, column %lld: 0x%08x, amx-pairs 0x%08x)",
                    static_cast<long long>(i / n_len), static_cast<long long>(i % n_len), g, e);
      choice.why = buf;
      break;
    }
  }
  return choice;
}
#endif

const AmxChoice& Amx() {
  static const AmxChoice choice = []() {
    AmxChoice c;
#if defined(NINFER_KV_PACKED_AMX)
    c.why = AmxTileDataRefusal();
    if (c.why.empty()) c = CheckAmx();
#else
    c.why = "the instruction-set level in use has no AMX code";
#endif
    return c;
  }();
  return choice;
}

Form UseForm() {
#if defined(NINFER_KV_PACKED_BF16)
  if (Amx().use) return Form::kAmx;
  if (Bf16DotsEnabled()) return Form::kBf16;
#endif
  return Form::kFma;
}

ffi::Error CheckPacked(const ffi::AnyBuffer& x, const std::vector<ffi::AnyBuffer>& ws,
                       const std::vector<ffi::AnyBuffer>& outs, std::vector<Product>* products) {
  const auto xd = x.dimensions();
  if (x.element_type() != ffi::DataType::BF16 || xd.size() != 2) {
    return ffi::Error::InvalidArgument("matmul_bf16_packed: x must be bfloat16 (M, K), got " + DimsString(xd));
  }
  if (ws.empty() || ws.size() != outs.size()) {
    return ffi::Error::InvalidArgument("matmul_bf16_packed: " + std::to_string(ws.size()) + " weights and " +
                                       std::to_string(outs.size()) + " results (at least one of each, as many)");
  }
  const int64_t pairs = (xd[1] + 1) / 2;
  for (size_t i = 0; i < ws.size(); ++i) {
    const auto wd = ws[i].dimensions();
    const auto od = outs[i].dimensions();
    const ffi::DataType ot = outs[i].element_type();
    const bool ok = ws[i].element_type() == ffi::DataType::BF16 && (ot == ffi::DataType::F32 || ot == ffi::DataType::BF16) &&
                    wd.size() == 3 && od.size() == 2 && od[0] == xd[0] && wd[0] == (od[1] + kTileCols - 1) / kTileCols &&
                    wd[1] == pairs && wd[2] == 2 * kTileCols;
    if (!ok) {
      return ffi::Error::InvalidArgument(
          "matmul_bf16_packed: packed weight " + std::to_string(i) + " " + DimsString(wd) + " and its result " +
          DimsString(od) + " are not bfloat16 (ceil(N/64), ceil(K/2), 128) and float32 or bfloat16 (M, N) for x " +
          DimsString(xd));
    }
    const bool f32 = ot == ffi::DataType::F32;
    void* out = outs[i].untyped_data();
    products->push_back({static_cast<const uint16_t*>(ws[i].untyped_data()), f32 ? static_cast<float*>(out) : nullptr,
                         f32 ? nullptr : static_cast<uint16_t*>(out), od[1], wd[0]});
  }
  return ffi::Error::Success();
}

ffi::Error MatmulBf16PackedImpl(ffi::AnyBuffer x, ffi::RemainingArgs ws_in, ffi::RemainingRets outs_in) {
  std::vector<ffi::AnyBuffer> ws, outs;
  if (auto err = CollectArgs(ws_in, &ws); err.failure()) return err;
  if (auto err = CollectRets(outs_in, &outs); err.failure()) return err;
  std::vector<Product> products;
  if (auto err = CheckPacked(x, ws, outs, &products); err.failure()) return err;
  const int64_t m_len = x.dimensions()[0], k_len = x.dimensions()[1];
  if (m_len == 0) return ffi::Error::Success();
  if (k_len == 0) {
    for (const Product& p : products) {  // +0 in either dtype
      if (p.out != nullptr) std::fill(p.out, p.out + m_len * p.n_len, 0.0f);
      if (p.out_bf16 != nullptr) std::fill(p.out_bf16, p.out_bf16 + m_len * p.n_len, uint16_t{0});
    }
    return ffi::Error::Success();
  }
  PackedProducts(static_cast<const uint16_t*>(x.untyped_data()), m_len, k_len, products, UseForm());
  return ffi::Error::Success();
}

}  // namespace packed_products
}  // namespace

XLA_FFI_DEFINE_HANDLER(kMatmulBf16PackedHandler, packed_products::MatmulBf16PackedImpl,
                       ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().RemainingArgs().RemainingRets());

XLA_FFI_Error* MatmulBf16PackedHandler(XLA_FFI_CallFrame* call_frame) { return kMatmulBf16PackedHandler(call_frame); }

// The form this level's packed products run on this CPU ("amx-chunks" or "amx-pairs": AMX in that
// order; "vdpbf16ps"; "fma"), and why it is not AMX.
const char* PackedKernel() {
  const packed_products::Form form = packed_products::UseForm();
  return form == packed_products::Form::kAmx ? packed_order::AmxOrderName(packed_products::Amx().order)
                                             : packed_products::FormName(form);
}
const char* PackedAmxStatus() { return packed_products::Amx().why.c_str(); }

NINFER_KV_NAMESPACE_END
