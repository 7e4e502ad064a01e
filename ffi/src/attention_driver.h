// Work split of a batched GQA attention over the thread pool.
//
// A task is (batch row b, KV head h, block of query positions, context split).  All query heads
// of the GQA group of h (and every query position of the block) share one AttentionAccumulator,
// so each K/V run is dequantized once per task.  Context splits (flash-decoding style) are used
// only when (rows x heads x query blocks) is too small to occupy the pool; their partial states
// are combined afterwards.  Output rows are written by exactly one task (or one combine step).
//
// A key source describes where keys live and who sees them:
//   int run_capacity() const;                      // longest run of contiguous keys
//   int64_t split_align() const;                   // context splits start at multiples of this
//   int64_t RunEnd(int b, int64_t j) const;        // first key after the run holding key j
//   bool RunValid(int b, int64_t j) const;          // false: every key of the run holding j is masked
//   KVRunSource Run(int b, int h, int64_t j) const;  // sources positioned at key j (a valid run)
//   void Visible(int b, int t, int64_t* lo, int64_t* hi) const;  // keys of query (b, t), inclusive
// A sliding window is the source's business: it raises lo, so a task's page walk (and each of
// its context splits) covers only [min lo, max hi] of its queries and never reads a run before.
#ifndef NINFER_KV_FFI_ATTENTION_DRIVER_H_
#define NINFER_KV_FFI_ATTENTION_DRIVER_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention_core.h"
#include "common.h"
#include "scalar_codec.h"
#include "thread_pool.h"

NINFER_KV_NAMESPACE_BEGIN

struct AttentionShape {
  int64_t batch, queries, q_heads, kv_heads, head_dim;  // B, T, Hq, H, D
  float sm_scale;
  const void* q;  // (B, T, Hq, D)
  bool q_bf16;    // q and out dtype: bfloat16 (else float32)
  void* out;      // (B, T, Hq, D)
  // No context splits: each (row, KV head, query block) is one task whatever the batch, so a row's
  // output depends on that row alone (a batch-invariant step); costs parallelism only while the
  // batch has fewer row x head tasks than threads.
  bool no_splits = false;
  // Ragged rows (a ragged batch): when set, q and out are (1, T, Hq, D) with T tokens in all, and
  // row b (of `batch`) owns tokens [row_starts[b], row_starts[b + 1]) (a non-decreasing vector of
  // batch + 1 entries in [0, T], RaggedStarts); its query t is token row_starts[b] + t.  Tokens
  // of no row are padding: their output is zero.
  const int64_t* row_starts = nullptr;
  // Variants (attention_core.h); the defaults are plain attention.
  float soft_cap = 0.0f;          // > 0: scores become soft_cap * tanh(score / soft_cap)
  const float* sinks = nullptr;   // (q_heads,): query head hq's sink logit; null: no sinks

  int64_t RowQueries(int64_t b) const { return row_starts ? row_starts[b + 1] - row_starts[b] : queries; }
  int64_t RowFirst(int64_t b) const { return row_starts ? row_starts[b] : b * queries; }
};

// The effective starts of ragged rows from a caller's int32 vector of rows + 1 entries: each
// clamped into [0, tokens], then the running maximum (so rows never overlap; a decreasing entry
// makes an empty row).  Concrete inputs are checked on the Python side; this is what every
// implementation does under jax.jit.
inline std::vector<int64_t> RaggedStarts(const int32_t* starts, int64_t rows, int64_t tokens) {
  std::vector<int64_t> e(static_cast<size_t>(rows + 1));
  int64_t prev = 0;
  for (int64_t r = 0; r <= rows; ++r) {
    const int64_t s = std::min<int64_t>(std::max<int64_t>(starts[r], 0), tokens);
    prev = r == 0 ? s : std::max(prev, s);
    e[static_cast<size_t>(r)] = prev;
  }
  return e;
}

namespace internal {

inline void LoadQueryRow(const AttentionShape& s, int64_t index, float* dst) {
  const int64_t d = s.head_dim;
  if (s.q_bf16) {
    const uint16_t* src = static_cast<const uint16_t*>(s.q) + index * d;
    for (int64_t i = 0; i < d; ++i) dst[i] = Bf16ToFloat(src[i]);
  } else {
    std::memcpy(dst, static_cast<const float*>(s.q) + index * d, sizeof(float) * d);
  }
}

inline void StoreOutputRow(const AttentionShape& s, int64_t index, const float* src) {
  const int64_t d = s.head_dim;
  if (s.q_bf16) {
    uint16_t* dst = static_cast<uint16_t*>(s.out) + index * d;
    for (int64_t i = 0; i < d; ++i) dst[i] = FloatToBf16(src[i]);
  } else {
    std::memcpy(static_cast<float*>(s.out) + index * d, src, sizeof(float) * d);
  }
}

}  // namespace internal

template <class Source>
void RunAttention(const AttentionShape& s, const Source& src) {
  const int64_t B = s.batch, H = s.kv_heads, D = s.head_dim;
  const int64_t G = s.q_heads / H;
  if (s.row_starts) {  // padding tokens (outside every row) return zeros
    const int64_t row_bytes = s.q_heads * D * (s.q_bf16 ? 2 : 4);
    char* out = static_cast<char*>(s.out);
    std::memset(out, 0, static_cast<size_t>(s.row_starts[0] * row_bytes));
    std::memset(out + s.row_starts[B] * row_bytes, 0, static_cast<size_t>((s.queries - s.row_starts[B]) * row_bytes));
  }
  if (B == 0 || s.queries == 0 || s.q_heads == 0) return;
  // Query blocks: at most 64 query rows (positions x group heads) per task; a block never spans
  // two batch rows, and a row's blocks are the same whether it is ragged or not.
  const int64_t tb = std::max<int64_t>(1, 64 / std::max<int64_t>(G, 1));
  struct QueryBlock {
    int64_t b, t0, t1;
  };
  std::vector<QueryBlock> blocks;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t T = s.RowQueries(b);
    for (int64_t t0 = 0; t0 < T; t0 += tb) blocks.push_back({b, t0, std::min(T, t0 + tb)});
  }
  const int64_t base = static_cast<int64_t>(blocks.size()) * H;
  if (base == 0) return;
  const int threads = PoolThreads();

  // Context splits when the base tasks cannot occupy the pool (long decode rows, few heads).
  const int64_t align = src.split_align();
  constexpr int64_t kMinRunsPerSplit = 4;
  int64_t splits = 1;
  if (threads > 1 && base < 4 * threads && !s.no_splits) {
    int64_t longest = 0;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t T = s.RowQueries(b);
      if (T == 0) continue;
      int64_t lo0, hi0, lo1, hi1;
      src.Visible(static_cast<int>(b), 0, &lo0, &hi0);
      src.Visible(static_cast<int>(b), static_cast<int>(T - 1), &lo1, &hi1);
      const int64_t lo = std::min(lo0, lo1), hi = std::max(hi0, hi1);
      if (hi >= lo) longest = std::max(longest, hi - lo + 1);
    }
    const int64_t by_pool = (4 * threads + base - 1) / base;
    const int64_t by_length = longest / (align * kMinRunsPerSplit);
    splits = std::max<int64_t>(1, std::min(by_pool, by_length));
  }
  int64_t block_max = 0;  // the most query positions in one block
  for (const QueryBlock& blk : blocks) block_max = std::max(block_max, blk.t1 - blk.t0);
  const int64_t rows_max = block_max * G;
  std::vector<float> partial;
  if (splits > 1) partial.resize(static_cast<size_t>(base * splits * rows_max * (D + 2)));
  // Index of query row (t, g) of block `blk` for KV head h in q / out.
  auto query_index = [&](const QueryBlock& blk, int64_t h, int64_t t, int64_t g) {
    return (s.RowFirst(blk.b) + t) * s.q_heads + h * G + g;
  };

  auto task = [&](int64_t i) {
    ScopedFlushDenormal flush;
    const int64_t split = i % splits;
    const int64_t bi = i / splits;
    const int64_t h = bi % H;
    const QueryBlock& blk = blocks[static_cast<size_t>(bi / H)];
    const int64_t b = blk.b, t0 = blk.t0, t1 = blk.t1;
    const int rows = static_cast<int>((t1 - t0) * G);
    AttentionAccumulator& acc = ThreadAccumulator();
    acc.Begin(rows, static_cast<int>(D), src.run_capacity(), s.sm_scale);
    if (s.soft_cap > 0.0f) acc.SetSoftCap(s.soft_cap);
    const bool sinks = s.sinks != nullptr && split == 0;  // one split carries a row's sink
    for (int64_t t = t0; t < t1; ++t) {
      int64_t lo, hi;
      src.Visible(static_cast<int>(b), static_cast<int>(t), &lo, &hi);
      for (int64_t g = 0; g < G; ++g) {
        const int m = static_cast<int>((t - t0) * G + g);
        internal::LoadQueryRow(s, query_index(blk, h, t, g), acc.QueryRow(m));
        acc.SetVisible(m, lo, hi);
        if (sinks) acc.SetSink(m, s.sinks[h * G + g]);
      }
    }
    const int64_t klo = acc.MinVisible(), khi = acc.MaxVisible();
    if (klo <= khi) {
      int64_t lo = klo, hi = khi + 1;
      if (splits > 1) {
        const int64_t a0 = klo / align * align;
        const int64_t nruns = (khi + 1 - a0 + align - 1) / align;
        const int64_t per = (nruns + splits - 1) / splits;
        lo = std::max(klo, a0 + split * per * align);
        hi = std::min(khi + 1, a0 + (split + 1) * per * align);
      }
      // The first key at or after j of a run whose keys are not masked (hi when none).
      auto next_valid = [&](int64_t j) {
        while (j < hi && !src.RunValid(static_cast<int>(b), j)) j = src.RunEnd(static_cast<int>(b), j);
        return std::min(j, hi);
      };
      int64_t j = next_valid(lo);
      if (j < hi) {
        KVRunSource run = src.Run(static_cast<int>(b), static_cast<int>(h), j);
        while (j < hi) {
          const int64_t e = std::min(src.RunEnd(static_cast<int>(b), j), hi);
          const int64_t nj = next_valid(e);
          KVRunSource next;
          const bool has_next = nj < hi;
          if (has_next) next = src.Run(static_cast<int>(b), static_cast<int>(h), nj);
          acc.Fold(run, j, static_cast<int>(e - j), has_next ? &next : nullptr);
          j = nj;
          if (has_next) run = next;
        }
      }
    }
    std::vector<float>& row = ThreadRowBuffer(D + 2);
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t g = 0; g < G; ++g) {
        const int m = static_cast<int>((t - t0) * G + g);
        if (splits > 1) {
          acc.ExportPartial(m, partial.data() + ((bi * splits + split) * rows_max + m) * (D + 2));
        } else {
          acc.Output(m, row.data());
          internal::StoreOutputRow(s, query_index(blk, h, t, g), row.data());
        }
      }
    }
  };
  ParallelFor(base * splits, task);
  if (splits == 1) return;

  ParallelFor(base, [&](int64_t bi) {
    ScopedFlushDenormal flush;
    const int64_t h = bi % H;
    const QueryBlock& blk = blocks[static_cast<size_t>(bi / H)];
    std::vector<float>& row = ThreadRowBuffer(D + 2);
    std::vector<const float*> parts(static_cast<size_t>(splits));
    for (int64_t t = blk.t0; t < blk.t1; ++t) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t m = (t - blk.t0) * G + g;
        for (int64_t sp = 0; sp < splits; ++sp) parts[sp] = partial.data() + ((bi * splits + sp) * rows_max + m) * (D + 2);
        CombinePartials(parts.data(), static_cast<int>(splits), static_cast<int>(D), row.data());
        internal::StoreOutputRow(s, query_index(blk, h, t, g), row.data());
      }
    }
  });
}

NINFER_KV_NAMESPACE_END

#endif  // NINFER_KV_FFI_ATTENTION_DRIVER_H_
