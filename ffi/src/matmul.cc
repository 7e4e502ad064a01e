// XLA FFI handler of the model's weight products: out = x @ w.T for bfloat16 x and w, float32 out.
//
//   NinferKvMatmulBf16(x bf16 (M, K), w_0 bf16 (N_0, K), w_1, ...) -> out_0 f32 (M, N_0), out_1, ...
//   (one call for several weights of the same input, e.g. q, k and v: x is split once and the
//   weights stream one after another in one pool dispatch)
//
// Batch invariance by construction: every output element out[m, n] is computed by one thread with
// one instruction sequence, whatever M is, whichever block the row falls in and however the work
// is split across threads:
//   * K is read in chunks of 32 (a tail chunk zero-padded); float32 lane j (of 16) accumulates,
//     chunk after chunk, x[m, 2j + 1] * w[n, 2j + 1] and then x[m, 2j] * w[n, 2j] (the chunk's odd
//     and even elements: a pair of bfloat16 is one 32-bit word, its high half the odd element as a
//     float32 once the low half is masked off, its low half the even element once shifted up; the
//     order of VDPBF16PS, so an AVX-512 BF16 form could keep the numerics);
//   * then one fixed reduction tree over the 16 lanes (j with j + 8, then + 4, + 2, + 1).
// The product of two bfloat16 values is exact in float32 (8-bit significands), so a fused and an
// unfused multiply-add give the same sum: the result is the same at every instruction-set level
// (the compiler may fuse; nothing is reassociated: no -ffast-math), on every machine.
//
// Speed: x is split once per call into float32 even and odd lanes.  One row of x (M = 1) reads each
// row of w front to back, one sequential stream at the DRAM rate; more rows work in register blocks
// of 4 rows of x by 4 rows of w (the w rows stay in L1 while the x rows pass), 32 multiply-adds per
// 12 loads.  Either way each weight is read once per 64 rows of x; the work is split over the
// thread pool by blocks of 512 output columns.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "handler_args.h"
#include "kernel_table.h"
#include "planes.h"
#include "thread_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

NINFER_KV_NAMESPACE_BEGIN
namespace {

typedef float V16 __attribute__((vector_size(64)));
typedef uint32_t U16 __attribute__((vector_size(64)));

constexpr int64_t kChunk = 32;       // bfloat16 elements of K per step: 16 lanes x (even, odd)
constexpr int kRowsPerBlock = 4;     // rows of x per register block
constexpr int kColsPerBlock = 4;     // rows of w (output columns) per register block
constexpr int64_t kColsPerTask = 512;  // output columns per thread-pool task
constexpr int64_t kRowsPerChunk = 64;  // rows of x per pass over a task's columns
constexpr int64_t kPrefetchAhead = 2048;  // weights are prefetched this many elements (4 KiB) ahead

inline V16 AsFloat(U16 u) {
  V16 f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// 32 bfloat16 values as their even and odd elements in float32 (exact).
inline void Split(const uint16_t* p, V16& even, V16& odd) {
  U16 bits;
  std::memcpy(&bits, p, sizeof bits);
  even = AsFloat(bits << 16);
  odd = AsFloat(bits & 0xFFFF0000u);
}

// The fixed reduction tree of the 16 partial sums.
inline float Reduce(V16 a) {
  float s8[8], s4[4], s2[2];
  for (int i = 0; i < 8; ++i) s8[i] = a[i] + a[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  for (int i = 0; i < 2; ++i) s2[i] = s4[i] + s4[i + 2];
  return s2[0] + s2[1];
}

// x split once: row m's chunk c is 16 even then 16 odd float32 at xs + (m * chunks + c) * 32.
struct SplitRows {
  const float* data;
  int64_t chunks;
};

// Chunk c of x's row m: its even and odd float32 lanes.
inline void LoadX(const SplitRows& x, int64_t m, int64_t c, V16& even, V16& odd) {
  const float* p = x.data + (m * x.chunks + c) * kChunk;
  std::memcpy(&even, p, sizeof even);
  std::memcpy(&odd, p + 16, sizeof odd);
}

// Chunk c of a row of w (zero-padded past k_len), prefetching the row 4 KiB ahead.
inline void LoadW(const uint16_t* row, int64_t c, int64_t k_len, V16& even, V16& odd) {
  if ((c + 1) * kChunk <= k_len) {
    __builtin_prefetch(row + c * kChunk + kPrefetchAhead);
    Split(row + c * kChunk, even, odd);
    return;
  }
  uint16_t buf[kChunk] = {};
  std::memcpy(buf, row + c * kChunk, static_cast<size_t>(k_len - c * kChunk) * sizeof(uint16_t));
  Split(buf, even, odd);
}

// out[m + i, n + j] for i < MR, j < NR (MR, NR <= 4); the same per-element sequence for every MR, NR.
template <int MR, int NR>
void Block(const SplitRows& x, const uint16_t* w, float* out, int64_t k_len, int64_t n_len, int64_t m, int64_t n) {
  V16 acc[MR][NR] = {};
  const uint16_t* wr[NR];
  for (int j = 0; j < NR; ++j) wr[j] = w + (n + j) * k_len;
  for (int64_t c = 0; c < x.chunks; ++c) {
    V16 we[NR], wo[NR];
    for (int j = 0; j < NR; ++j) LoadW(wr[j], c, k_len, we[j], wo[j]);
    for (int i = 0; i < MR; ++i) {
      V16 xe, xo;
      LoadX(x, m + i, c, xe, xo);
      for (int j = 0; j < NR; ++j) {
        acc[i][j] += xo * wo[j];
        acc[i][j] += xe * we[j];
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) out[(m + i) * n_len + n + j] = Reduce(acc[i][j]);
}

template <int NR>
void RowBlock(int mr, const SplitRows& x, const uint16_t* w, float* out, int64_t k_len, int64_t n_len, int64_t m,
              int64_t n) {
  switch (mr) {
    case 4: return Block<4, NR>(x, w, out, k_len, n_len, m, n);
    case 3: return Block<3, NR>(x, w, out, k_len, n_len, m, n);
    case 2: return Block<2, NR>(x, w, out, k_len, n_len, m, n);
    default: return Block<1, NR>(x, w, out, k_len, n_len, m, n);
  }
}

void AnyBlock(int mr, int nr, const SplitRows& x, const uint16_t* w, float* out, int64_t k_len, int64_t n_len,
              int64_t m, int64_t n) {
  switch (nr) {
    case 4: return RowBlock<4>(mr, x, w, out, k_len, n_len, m, n);
    case 3: return RowBlock<3>(mr, x, w, out, k_len, n_len, m, n);
    case 2: return RowBlock<2>(mr, x, w, out, k_len, n_len, m, n);
    default: return RowBlock<1>(mr, x, w, out, k_len, n_len, m, n);
  }
}

// Output columns [n0, n1) for every row: by chunks of 64 rows of x (kept in L2 with the task's
// rows of w), 4 columns at a time, all rows of the chunk over them 4 at a time; one row of x takes
// the rows of w one at a time.
void Columns(const SplitRows& x, const uint16_t* w, float* out, int64_t m_len, int64_t k_len, int64_t n_len,
             int64_t n0, int64_t n1) {
  if (m_len == 1) {
    // One row of w at a time, front to back: one sequential stream (4 rows read side by side, with
    // nothing to reuse them for, reach half the DRAM rate).
    for (int64_t n = n0; n < n1; ++n) Block<1, 1>(x, w, out, k_len, n_len, 0, n);
    return;
  }
  for (int64_t m0 = 0; m0 < m_len; m0 += kRowsPerChunk) {
    const int64_t m1 = std::min(m_len, m0 + kRowsPerChunk);
    for (int64_t n = n0; n < n1; n += kColsPerBlock) {
      const int nr = static_cast<int>(std::min<int64_t>(kColsPerBlock, n1 - n));
      for (int64_t m = m0; m < m1; m += kRowsPerBlock) {
        const int mr = static_cast<int>(std::min<int64_t>(kRowsPerBlock, m1 - m));
        AnyBlock(mr, nr, x, w, out, k_len, n_len, m, n);
      }
    }
  }
}

// The calling thread's buffer for the split x (reused across calls; grown, never shrunk).
std::vector<float>& SplitBuffer(int64_t n) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(static_cast<size_t>(n));
  return buffer;
}

// One weight and its result, checked: w (N, K) bfloat16, out (M, N) float32.
struct Product {
  const uint16_t* w;
  float* out;
  int64_t n_len;
};

ffi::Error CheckProducts(const ffi::AnyBuffer& x, const std::vector<ffi::AnyBuffer>& ws,
                         const std::vector<ffi::AnyBuffer>& outs, std::vector<Product>* products) {
  const auto xd = x.dimensions();
  if (x.element_type() != ffi::DataType::BF16 || xd.size() != 2) {
    return ffi::Error::InvalidArgument("matmul_bf16: x must be bfloat16 (M, K), got " + DimsString(xd));
  }
  if (ws.empty() || ws.size() != outs.size()) {
    return ffi::Error::InvalidArgument("matmul_bf16: " + std::to_string(ws.size()) + " weights and " +
                                       std::to_string(outs.size()) + " results (at least one of each, as many)");
  }
  for (size_t i = 0; i < ws.size(); ++i) {
    const auto wd = ws[i].dimensions();
    const auto od = outs[i].dimensions();
    if (ws[i].element_type() != ffi::DataType::BF16 || outs[i].element_type() != ffi::DataType::F32 ||
        wd.size() != 2 || od.size() != 2 || wd[1] != xd[1] || od[0] != xd[0] || od[1] != wd[0]) {
      return ffi::Error::InvalidArgument("matmul_bf16: weight " + std::to_string(i) + " " + DimsString(wd) +
                                         " and its result " + DimsString(od) + " are not bfloat16 (N, K) and float32 "
                                         "(M, N) for x " + DimsString(xd));
    }
    products->push_back({static_cast<const uint16_t*>(ws[i].untyped_data()),
                         static_cast<float*>(outs[i].untyped_data()), wd[0]});
  }
  return ffi::Error::Success();
}

// x @ w_i.T for every weight w_i: x split once, one pool dispatch for all of them (the column
// blocks of one weight after another, so the weights stream as one run).
ffi::Error MatmulBf16Impl(ffi::AnyBuffer x, ffi::RemainingArgs ws_in, ffi::RemainingRets outs_in) {
  std::vector<ffi::AnyBuffer> ws, outs;
  if (auto err = CollectArgs(ws_in, &ws); err.failure()) return err;
  if (auto err = CollectRets(outs_in, &outs); err.failure()) return err;
  std::vector<Product> products;
  if (auto err = CheckProducts(x, ws, outs, &products); err.failure()) return err;
  const int64_t m_len = x.dimensions()[0], k_len = x.dimensions()[1];
  const auto* xp = static_cast<const uint16_t*>(x.untyped_data());
  if (m_len == 0) return ffi::Error::Success();
  if (k_len == 0) {
    for (const Product& p : products) std::fill(p.out, p.out + m_len * p.n_len, 0.0f);
    return ffi::Error::Success();
  }
  // Split x into float32 even and odd lanes per 32-element chunk (the tail chunk zero-padded).
  const int64_t chunks = (k_len + kChunk - 1) / kChunk;
  std::vector<float>& split = SplitBuffer(m_len * chunks * kChunk);
  ParallelFor(m_len, [&](int64_t m) {
    for (int64_t c = 0; c < chunks; ++c) {
      uint16_t buf[kChunk] = {};
      const int64_t n = std::min(kChunk, k_len - c * kChunk);
      std::memcpy(buf, xp + m * k_len + c * kChunk, static_cast<size_t>(n) * sizeof(uint16_t));
      V16 even, odd;
      Split(buf, even, odd);
      float* dst = split.data() + (m * chunks + c) * kChunk;
      std::memcpy(dst, &even, sizeof even);
      std::memcpy(dst + 16, &odd, sizeof odd);
    }
  });
  const SplitRows x_rows{split.data(), chunks};
  std::vector<std::pair<int, int64_t>> tasks;  // (product, first column)
  for (size_t i = 0; i < products.size(); ++i) {
    for (int64_t n0 = 0; n0 < products[i].n_len; n0 += kColsPerTask) tasks.emplace_back(static_cast<int>(i), n0);
  }
  ParallelFor(static_cast<int64_t>(tasks.size()), [&](int64_t t) {
    const Product& p = products[tasks[t].first];
    const int64_t n0 = tasks[t].second;
    Columns(x_rows, p.w, p.out, m_len, k_len, p.n_len, n0, std::min(p.n_len, n0 + kColsPerTask));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kMatmulBf16Handler, MatmulBf16Impl,
                       ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().RemainingArgs().RemainingRets());

XLA_FFI_Error* MatmulBf16Handler(XLA_FFI_CallFrame* call_frame) { return kMatmulBf16Handler(call_frame); }

NINFER_KV_NAMESPACE_END
