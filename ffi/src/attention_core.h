// Single-pass online-softmax attention over runs of quantized keys and values.
//
// One AttentionAccumulator serves one task: a set of `rows` query rows that share one KV head
// (the query heads of a GQA group, for one or more query positions).  Keys are folded in runs of
// at most `run_capacity` consecutive key indices (a page, or a contiguous stretch of a ring).
// K and V codes are dequantized in registers right where the dot products consume them, for
// blocks of up to 8 query rows at a time, so a run's bytes are read from memory once per task
// (head dims that are not a multiple of the SIMD width go through a float32 tile instead).
// Row m sees exactly the keys j with lo[m] <= j <= hi[m]; keys outside every row's interval are
// never read (poisoned or unwritten memory is never touched), and a probability outside a row's
// interval is exactly zero.
//
// Arithmetic (ArithmeticOf below): float32 throughout, except NVFP4 keys on the levels with
// AVX-512 VNNI, whose scores are exact integer sums against the query rounded to 15 bits
// (int_scores.h).  BF16 keys against queries that are bfloat16 values (a model's, in bfloat16)
// take VDPBF16PS on CPUs with AVX512_BF16 (the AVX-512 levels, unless NINFER_KV_FFI_BF16=0):
// the same exact products and float32 sums, half the instructions.  Runs whose K scales are not all finite, and query rows that are not finite,
// take the float32 path.  Scores sm_scale * (q . k); per row the running maximum, the running
// denominator and the unnormalized output are rescaled when the maximum grows.  A row with no
// visible key produces zeros.
//
// Variants (off by default; Begin turns them off, and with both off every path is the code it
// always was):
// * a logit soft cap c > 0 (SetSoftCap): each float32 score s = sm_scale * (q . k), whichever
//   products formed it, becomes c * tanh(s / c) before the running maximum and the exponentials;
// * a sink per row (SetSink): a logit whose value vector is zero.  The running maximum starts at
//   the sink and the denominator at exp(sink - sink) = 1, so the sink folds into every rescale; a
//   row that sees no key still outputs zeros (zero numerator).
// A sliding window is no concern of the accumulator: it narrows the rows' visible intervals
// (SetVisible), so the runs before the earliest row's window are never folded, nor read.
#ifndef NINFER_KV_FFI_ATTENTION_CORE_H_
#define NINFER_KV_FFI_ATTENTION_CORE_H_

#include <cstdint>
#include <vector>

#include "common.h"
#include "dequantize.h"
#include "row_decoders.h"

NINFER_KV_NAMESPACE_BEGIN

class Prefetcher;

// The products a task uses for the scores (q . k) and for the value sums (p . v).
enum class Arithmetic : int32_t {
  kFloat32 = 0,  // float32 multiply-adds
  kInt8x2 = 1,   // the query rounded to 15 bits and split into two signed bytes, vpdpbusd against
                 // the key codes as unsigned bytes, exact int32 sums (two byte products per
                 // multiply-add of q . k)
};
struct ArithmeticChoice {
  Arithmetic scores, values;
};

// What a task of head dim d over codecs (k, v) uses, on the level this file is compiled for, for
// runs whose scales are finite.
ArithmeticChoice ArithmeticOf(Codec k, Codec v, int d);

class AttentionAccumulator {
 public:
  // Starts a task of `rows` query rows of head dim d; runs hold at most run_capacity keys.
  // Every query row is zero and every row sees no key until set.
  void Begin(int rows, int d, int run_capacity, float sm_scale);

  // Row m's query (float32, d values; the padding after d is kept zero).
  float* QueryRow(int m) { return q_ + static_cast<int64_t>(m) * ld_; }

  // Row m sees keys lo..hi (inclusive); lo > hi means none.
  void SetVisible(int m, int64_t lo, int64_t hi);

  // Row m's scores are capped at +-cap (cap * tanh(s / cap)); cap <= 0 (Begin's) means no cap.
  void SetSoftCap(float cap) { soft_cap_ = cap > 0.0f ? cap : 0.0f; }

  // Row m has a sink logit `sink` (call before the first Fold of the task, at most once per row;
  // a sink of -inf is no sink).  With context splits only one split of a row may carry it.
  void SetSink(int m, float sink);

  // Smallest lo and largest hi over the rows that see at least one key (lo > hi when none).
  int64_t MinVisible() const { return min_lo_; }
  int64_t MaxVisible() const { return max_hi_; }

  // Folds keys [j0, j0 + n) (n <= run_capacity); `src` points at key j0.  Only the keys some row
  // sees are read.  `prefetch` (nullable) names the next run, which is prefetched meanwhile.
  void Fold(const KVRunSource& src, int64_t j0, int n, const KVRunSource* prefetch);

  // The normalized output of row m (d floats; zeros when the row saw no key).
  void Output(int m, float* dst) const;

  // The unnormalized state of row m: dst[0] = running max, dst[1] = denominator,
  // dst[2 .. 2 + d) = sum of p_j v_j.  Combine partial states with CombinePartials.
  void ExportPartial(int m, float* dst) const;

  int rows() const { return rows_; }
  int head_dim() const { return d_; }

 private:
  template <class VDec>
  void FoldScales(const PreparedRows& v, int cnt);
  // The float32 scores of keys KDec (s_, srow_ = sm_scale_).
  template <class KDec>
  void FloatScores(const PreparedRows& k, int cnt, Prefetcher* pf);
  // One run: `scores()` fills s_ (and srow_), then the softmax update and the value sums of VDec.
  template <class VDec, class ScoresFn>
  void FoldRun(ScoresFn scores, const PreparedRows& v, int64_t ja, int cnt, Prefetcher* pf);
  template <class VDec>
  void ValuesFloat(const PreparedRows& v, int cnt);
  // The query rows as bfloat16 pair words (qw_), once per task; false when a row holds a value
  // that is not a bfloat16 value, the head dim is not a multiple of 32, or the CPU (or
  // NINFER_KV_FFI_BF16=0) rules VDPBF16PS out (the task's scores then stay float32).
  bool PrepareQueryPairs();
  void ScoresNvfp4Int(const PreparedRows& k, int cnt, Prefetcher* pf);
  // Rounds the query rows to 15 bits and splits them into bytes (int_scores.h), once per task;
  // false when a row is not finite (the task's scores then stay float32).
  bool PrepareQueryBytes();
  bool UpdateSoftmax(int64_t ja, int cnt);
  template <bool kSoftCap>
  bool UpdateSoftmaxT(int64_t ja, int cnt);

  int rows_ = 0, rows_padded_ = 0, d_ = 0, ld_ = 0, cap_ = 0, sld_ = 0;
  float sm_scale_ = 1.0f;
  float soft_cap_ = 0.0f;  // 0: no soft cap
  int64_t min_lo_ = 0, max_hi_ = -1;
  float* q_ = nullptr;   // rows_padded_ x ld_
  float* s_ = nullptr;   // rows_padded_ x sld_ (scores, then probabilities)
  float* o_ = nullptr;   // rows_ x ld_
  float* kf_ = nullptr;  // cap_ x ld_ (dequantized K, only when d_ % kVL != 0)
  float* vf_ = nullptr;  // cap_ x ld_
  std::vector<float> max_, den_;
  std::vector<int64_t> lo_, hi_;
  std::vector<int> seg_a_, seg_b_;
  std::vector<uint8_t> knan_, vnan_;
  float* w_ = nullptr;   // groups x rows_padded_ x sld_ (probabilities times V scales)
  std::vector<float> srow_;     // per row: the factor UpdateSoftmax applies to the raw scores
  std::vector<float> qscale_;   // per row: the step of the rounded query (q ~ q16 * qscale)
  bool qbytes_ready_ = false;   // whether PrepareQueryBytes ran for this task
  bool qbytes_ok_ = false;      // its result
  bool qpairs_ready_ = false;   // whether PrepareQueryPairs ran for this task
  bool qpairs_ok_ = false;      // its result
  uint32_t* qw_ = nullptr;      // rows_padded_ x ld_ / 2: the queries' bfloat16 pairs
  uint8_t* qhi_ = nullptr;      // rows_padded_ x ld_: the high bytes of the rounded queries
  uint8_t* qlo_ = nullptr;      // rows_padded_ x ld_: the low bytes
  std::vector<int32_t> qcorr_;  // per row and 16-dim group: the sums' starting values (int_scores.h)
  AlignedFloats qbuf_, sbuf_, obuf_, kbuf_, vbuf_, kscale_, vscale_, wbuf_, fold_scale_, facbuf_, qbytes_, qpairs_;
};

// Combines `parts` partial states (each d + 2 floats, as ExportPartial writes them) into the
// normalized output dst[0, d).
void CombinePartials(const float* const* parts, int nparts, int d, float* dst);

// The accumulator of the calling thread (reused across tasks and calls).
AttentionAccumulator& ThreadAccumulator();

// A float buffer of at least n elements owned by the calling thread.
std::vector<float>& ThreadRowBuffer(size_t n);

NINFER_KV_NAMESPACE_END

#endif  // NINFER_KV_FFI_ATTENTION_CORE_H_
