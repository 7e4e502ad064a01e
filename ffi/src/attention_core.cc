#include "attention_core.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "int_scores.h"
#include "row_decoders.h"
#include "simd.h"

#if defined(__x86_64__) && defined(__AVX512F__) && (defined(__clang__) || __GNUC__ >= 10)
#include <immintrin.h>
#define NINFER_KV_BF16_SCORES 1
namespace ninfer_kv_ffi {
bool Bf16DotsEnabled();  // dispatch.h (not included: these sources build without the XLA headers)
}  // namespace ninfer_kv_ffi
#endif

NINFER_KV_NAMESPACE_BEGIN

// Software prefetch of the next run, spread over the work of the current one so that the fill
// buffers are never flooded.
class Prefetcher {
 public:
  void Add(const uint8_t* p, int64_t bytes) {
    if (p != nullptr && bytes > 0 && n_ < 4) {
      ptr_[n_] = p;
      bytes_[n_] = bytes;
      total_lines_ += (bytes + 63) / 64;
      ++n_;
    }
  }
  int64_t total_lines() const { return total_lines_; }
  // Issues up to `lines` more cache-line prefetches (into L2).
  void Issue(int64_t lines) {
    // The cursor lives in locals while issuing: kept in the object, every line would wait on
    // the store and reload of the previous one.
    int idx = idx_;
    int64_t off = off_;
    while (lines > 0 && idx < n_) {
      const uint8_t* p = ptr_[idx];
      const int64_t end = std::min(bytes_[idx], off + 64 * lines);
      lines -= (end - off + 63) / 64;
      for (; off < end; off += 64) __builtin_prefetch(p + off, 0, 2);
      if (off >= bytes_[idx]) {
        ++idx;
        off = 0;
      }
    }
    idx_ = idx;
    off_ = off;
  }
  void IssueAll() { Issue(total_lines_); }

 private:
  const uint8_t* ptr_[4] = {nullptr, nullptr, nullptr, nullptr};
  int64_t bytes_[4] = {0, 0, 0, 0};
  int n_ = 0, idx_ = 0;
  int64_t off_ = 0, total_lines_ = 0;
};

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#if defined(__AVX512F__)
constexpr int kAccRegs = 16;  // vector accumulators a kernel keeps in registers (of 32)
#else
constexpr int kAccRegs = 8;  // (of 16)
#endif

// s[mm * lds + jj] = q_mm . k_(j0 + jj) for MB query rows and JB keys (MB * JB == kVL
// accumulators, kept in registers), reduced with one transposed reduction tree.  Key slots past
// cnt repeat the last key (never read past the run).
template <class KDec, int MB, int JB>
NINFER_KV_ALWAYS_INLINE void ScoreTile(const float* q, int ld, const PreparedRows& k, int j0, int cnt, int nchunks,
                                       float* s, int lds) {
  static_assert(MB * JB == kVL, "a score tile has exactly kVL accumulators");
  typename KDec::TokenCodes kcodes[JB];
  for (int jj = 0; jj < JB; ++jj) kcodes[jj] = k.template At<KDec>(std::min(j0 + jj, cnt - 1));
  VFloat acc[MB * JB];
  for (int i = 0; i < MB * JB; ++i) acc[i] = VFloat{};
  int c = 0;
  if constexpr (KDec::TokenCodes::kPairs) {
    for (; c + 2 <= nchunks; c += 2) {  // chunk pairs, decoded together
      VFloat kv[JB][2];
      for (int jj = 0; jj < JB; ++jj) kcodes[jj].KeyChunk2(c, kv[jj]);
      for (int h = 0; h < 2; ++h) {
        for (int mm = 0; mm < MB; ++mm) {
          const VFloat qv = Load(q + mm * ld + (c + h) * kVL);  // each q chunk loaded once per tile
          for (int jj = 0; jj < JB; ++jj) acc[mm * JB + jj] += qv * kv[jj][h];
        }
      }
    }
  }
  // One chunk at a time: JB decoded chunks and one q chunk live next to the MB * JB
  // accumulators, so every load feeds JB or MB FMAs.
  for (; c < nchunks; ++c) {
    VFloat kv[JB];
    for (int jj = 0; jj < JB; ++jj) kv[jj] = kcodes[jj].KeyChunk(c);
    for (int mm = 0; mm < MB; ++mm) {
      const VFloat qv = Load(q + mm * ld + c * kVL);
      for (int jj = 0; jj < JB; ++jj) acc[mm * JB + jj] += qv * kv[jj];
    }
  }
  VFloat r = ReduceTranspose(acc);
  if (KDec::TokenCodes::kKeyScaled) {
    VFloat f;
    for (int i = 0; i < kVL; ++i) f[i] = kcodes[i % JB].KeyScale();
    r *= f;
  }
  for (int mm = 0; mm < MB; ++mm) {
    for (int jj = 0; jj < JB; ++jj) s[mm * lds + jj] = r[mm * JB + jj];
  }
}

// Scores of `rows` query rows (q padded to a multiple of MB with zero rows) against keys
// [0, cnt) of `k`.
template <class KDec, int MB, int JB>
void ScoreRun(const float* q, int rows, int ld, const PreparedRows& k, int cnt, float* s, int lds, Prefetcher* pf) {
  const int nchunks = ld / kVL;
  const int64_t tiles = (cnt + JB - 1) / JB;
  const int64_t per_tile = (pf->total_lines() + tiles - 1) / std::max<int64_t>(tiles, 1);
  for (int j0 = 0; j0 < cnt; j0 += JB) {
    pf->Issue(per_tile);
    for (int m0 = 0; m0 < rows; m0 += MB) {
      ScoreTile<KDec, MB, JB>(q + static_cast<int64_t>(m0) * ld, ld, k, j0, cnt, nchunks,
                              s + static_cast<int64_t>(m0) * lds + j0, lds);
    }
  }
}

template <class KDec>
void Scores(const float* q, int rows, int ld, const PreparedRows& k, int cnt, float* s, int lds, Prefetcher* pf) {
  if (rows >= 8) {
    ScoreRun<KDec, 8, kVL / 8>(q, rows, ld, k, cnt, s, lds, pf);
  } else if (rows >= 3) {
    ScoreRun<KDec, 4, kVL / 4>(q, rows, ld, k, cnt, s, lds, pf);
  } else if (rows == 2) {
    ScoreRun<KDec, 2, kVL / 2>(q, rows, ld, k, cnt, s, lds, pf);
  } else {
    ScoreRun<KDec, 1, kVL>(q, rows, ld, k, cnt, s, lds, pf);
  }
}

#if defined(NINFER_KV_BF16_SCORES)
// The scores of BF16 keys against bfloat16-exact queries with VDPBF16PS: q as 32-bit pair words
// (qw, ldw words per row), the keys' codes as they are stored.  Each accumulator holds one
// (row, key) pair: lane l sums dims 2l and 2l + 1 of each 32-dim chunk (exact products, float32
// sums), then one transposed reduction tree, as ScoreTile.  Key slots past cnt repeat the last key.
template <int MB, int JB>
__attribute__((target("avx512bf16"))) NINFER_KV_ALWAYS_INLINE void ScoreTileBf16(const uint32_t* qw, int ldw,
                                                                                  const PreparedRows& k, int j0,
                                                                                  int cnt, int nchunks, float* s,
                                                                                  int lds) {
  static_assert(MB * JB == kVL, "a score tile has exactly kVL accumulators");
  const uint8_t* krow[JB];
  for (int jj = 0; jj < JB; ++jj) krow[jj] = k.data + std::min(j0 + jj, cnt - 1) * k.stride;
  __m512 acc[MB * JB];
  for (int i = 0; i < MB * JB; ++i) acc[i] = _mm512_setzero_ps();
  for (int c = 0; c < nchunks; ++c) {  // chunks of 32 dims
    __m512i kv[JB];
    for (int jj = 0; jj < JB; ++jj) kv[jj] = _mm512_loadu_si512(krow[jj] + c * 64);
    for (int mm = 0; mm < MB; ++mm) {
      const __m512i qv = _mm512_loadu_si512(qw + mm * ldw + c * 16);
      for (int jj = 0; jj < JB; ++jj) acc[mm * JB + jj] = _mm512_dpbf16_ps(acc[mm * JB + jj], (__m512bh)qv, (__m512bh)kv[jj]);
    }
  }
  VFloat a[MB * JB];
  std::memcpy(a, acc, sizeof a);
  const VFloat r = ReduceTranspose(a);
  for (int mm = 0; mm < MB; ++mm) {
    for (int jj = 0; jj < JB; ++jj) s[mm * lds + jj] = r[mm * JB + jj];
  }
}

template <int MB, int JB>
__attribute__((target("avx512bf16"))) void ScoreRunBf16(const uint32_t* qw, int rows, int ldw, const PreparedRows& k,
                                                       int cnt, int nchunks, float* s, int lds, Prefetcher* pf) {
  const int64_t tiles = (cnt + JB - 1) / JB;
  const int64_t per_tile = (pf->total_lines() + tiles - 1) / std::max<int64_t>(tiles, 1);
  for (int j0 = 0; j0 < cnt; j0 += JB) {
    pf->Issue(per_tile);
    for (int m0 = 0; m0 < rows; m0 += MB) {
      ScoreTileBf16<MB, JB>(qw + static_cast<int64_t>(m0) * ldw, ldw, k, j0, cnt, nchunks,
                            s + static_cast<int64_t>(m0) * lds + j0, lds);
    }
  }
}

void ScoresBf16(const uint32_t* qw, int rows, int ldw, int d, const PreparedRows& k, int cnt, float* s, int lds,
                Prefetcher* pf) {
  const int nchunks = d / 32;
  if (rows >= 8) {
    ScoreRunBf16<8, kVL / 8>(qw, rows, ldw, k, cnt, nchunks, s, lds, pf);
  } else if (rows >= 3) {
    ScoreRunBf16<4, kVL / 4>(qw, rows, ldw, k, cnt, nchunks, s, lds, pf);
  } else if (rows == 2) {
    ScoreRunBf16<2, kVL / 2>(qw, rows, ldw, k, cnt, nchunks, s, lds, pf);
  } else {
    ScoreRunBf16<1, kVL>(qw, rows, ldw, k, cnt, nchunks, s, lds, pf);
  }
}
#endif

// o_r[chunks c0 .. c0 + W) += sum_{j in [a, b)} p_r[j] * v_j for R rows sharing each decoded V row.
// kSkipZero: skip keys whose probability is zero in every row (needed when the rows' visible
// ranges differ, so that a key one row sees never meets another row's zero probability
// arithmetically; rows with one common range have no such keys).
// kFold: p_r holds the probabilities times the V scale of the block's group (FoldScales), and the
// rows are decoded unscaled (RawChunk): one multiply per key and row instead of one per chunk.
template <class VDec, int W, int R, bool kSkipZero, bool kFold>
inline void AccumulateTile(const float* const* p, int a, int b, const PreparedRows& v, int c0, float* const* o) {
  const float* pr[R];
  VFloat acc[R][W];
  for (int r = 0; r < R; ++r) {
    pr[r] = p[r];
    for (int w = 0; w < W; ++w) acc[r][w] = Load(o[r] + (c0 + w) * kVL);
  }
  for (int j = a; j < b; ++j) {
    if (kSkipZero) {
      bool any = false;
      for (int r = 0; r < R; ++r) any |= pr[r][j] != 0.0f;
      if (!any) continue;
    }
    const typename VDec::TokenCodes vcodes = v.template At<VDec>(j);
    VFloat vv[W];
    int w0 = 0;
    if ((c0 & 1) == 0) {
      for (; w0 + 2 <= W; w0 += 2) {
        if constexpr (kFold) {
          vcodes.RawChunk2(c0 + w0, vv + w0);
        } else {
          vcodes.Chunk2(c0 + w0, vv + w0);
        }
      }
    }
    for (int w = w0; w < W; ++w) {
      if constexpr (kFold) {
        vv[w] = vcodes.RawChunk(c0 + w);
      } else {
        vv[w] = vcodes.Chunk(c0 + w);
      }
    }
    for (int r = 0; r < R; ++r) {
      const VFloat pj = Splat(pr[r][j]);
      for (int w = 0; w < W; ++w) acc[r][w] += pj * vv[w];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int w = 0; w < W; ++w) Store(o[r] + (c0 + w) * kVL, acc[r][w]);
}

// Chunks of V accumulated per pass for R rows (their accumulators fill the register file).
template <int R>
constexpr int PassChunks() {
  return std::min(8, std::max(1, kAccRegs / R));
}

// Whether R rows take the folded form for VDec: every pass's chunks lie in one scale group.
template <class VDec, int R>
constexpr bool Folds() {
  return VDec::TokenCodes::kScaleGroup > 0 && VDec::TokenCodes::kScaleGroup % (PassChunks<R>() * kVL) == 0;
}

// w: when Folds<VDec, R>(), the folded weights of the R rows for scale group 0, group g's at
// w[r] + g * wstride.
template <class VDec, int R, bool kSkipZero>
void AccumulateRowsW(const float* const* p, const float* const* w, int64_t wstride, int a, int b, const PreparedRows& v,
                     int nchunks, float* const* o) {
  constexpr int kW = PassChunks<R>();
  constexpr bool kFold = Folds<VDec, R>();
  for (int c0 = 0; c0 < nchunks; c0 += kW) {
    const float* pw[R];
    for (int r = 0; r < R; ++r) {
      pw[r] = kFold ? w[r] + (c0 * kVL / std::max(VDec::TokenCodes::kScaleGroup, 1)) * wstride : p[r];
    }
    switch (std::min(kW, nchunks - c0)) {
      case 1: AccumulateTile<VDec, 1, R, kSkipZero, kFold>(pw, a, b, v, c0, o); break;
      case 2: AccumulateTile<VDec, (kW >= 2 ? 2 : 1), R, kSkipZero, kFold>(pw, a, b, v, c0, o); break;
      case 3: AccumulateTile<VDec, (kW >= 3 ? 3 : 1), R, kSkipZero, kFold>(pw, a, b, v, c0, o); break;
      case 4: AccumulateTile<VDec, (kW >= 4 ? 4 : 1), R, kSkipZero, kFold>(pw, a, b, v, c0, o); break;
      case 5: AccumulateTile<VDec, (kW >= 5 ? 5 : 1), R, kSkipZero, kFold>(pw, a, b, v, c0, o); break;
      case 6: AccumulateTile<VDec, (kW >= 6 ? 6 : 1), R, kSkipZero, kFold>(pw, a, b, v, c0, o); break;
      case 7: AccumulateTile<VDec, (kW >= 7 ? 7 : 1), R, kSkipZero, kFold>(pw, a, b, v, c0, o); break;
      default: AccumulateTile<VDec, kW, R, kSkipZero, kFold>(pw, a, b, v, c0, o); break;
    }
  }
}

template <class VDec, int R>
void AccumulateRows(const float* const* p, const float* const* w, int64_t wstride, int a, int b, bool same_range,
                    const PreparedRows& v, int nchunks, float* const* o) {
  if (same_range) {
    AccumulateRowsW<VDec, R, false>(p, w, wstride, a, b, v, nchunks, o);
  } else {
    AccumulateRowsW<VDec, R, true>(p, w, wstride, a, b, v, nchunks, o);
  }
}

}  // namespace

void AttentionAccumulator::Begin(int rows, int d, int run_capacity, float sm_scale) {
  rows_ = rows;
  rows_padded_ = static_cast<int>(RoundUp(rows, 8));
  d_ = d;
  ld_ = static_cast<int>(RoundUp(d, kVL));
  cap_ = run_capacity;
  sld_ = static_cast<int>(RoundUp(run_capacity, kVL) + kVL);
  sm_scale_ = sm_scale;
  soft_cap_ = 0.0f;
  min_lo_ = std::numeric_limits<int64_t>::max();
  max_hi_ = std::numeric_limits<int64_t>::min();
  q_ = qbuf_.Get(static_cast<size_t>(rows_padded_) * ld_);
  std::memset(q_, 0, sizeof(float) * rows_padded_ * ld_);
  s_ = sbuf_.Get(static_cast<size_t>(rows_padded_) * sld_);
  o_ = obuf_.Get(static_cast<size_t>(rows_) * ld_);
  std::memset(o_, 0, sizeof(float) * rows_ * ld_);
  if (d_ % kVL != 0) {
    kf_ = kbuf_.Get(static_cast<size_t>(cap_) * ld_);
    vf_ = vbuf_.Get(static_cast<size_t>(cap_) * ld_);
  }
  max_.assign(rows_, kNegInf);
  den_.assign(rows_, 0.0f);
  lo_.assign(rows_, 0);
  hi_.assign(rows_, -1);
  seg_a_.assign(rows_, 0);
  seg_b_.assign(rows_, 0);
  srow_.assign(rows_, sm_scale);
  qscale_.assign(rows_, 1.0f);
  qbytes_ready_ = false;
  qbytes_ok_ = false;
  qpairs_ready_ = false;
  qpairs_ok_ = false;
}

void AttentionAccumulator::SetVisible(int m, int64_t lo, int64_t hi) {
  lo_[m] = lo;
  hi_[m] = hi;
  if (lo <= hi) {
    min_lo_ = std::min(min_lo_, lo);
    max_hi_ = std::max(max_hi_, hi);
  }
}

void AttentionAccumulator::SetSink(int m, float sink) {
  if (sink == kNegInf) return;  // exp(-inf) == 0: no sink
  max_[m] = sink;                // the running maximum starts at the sink ...
  den_[m] = 1.0f;                // ... whose exp(sink - max) starts the denominator
}

namespace {

// cap * tanh(x / cap) for every lane: tanh(|y|) = (1 - e) / (1 + e) with e = exp(-2|y|), the sign
// put back; NaN stays NaN, +-inf gives +-cap.
inline VFloat SoftCap(VFloat x, VFloat cap, VFloat inv_cap) {
  const VUInt bits = AsUInt(x);
  const VFloat y = AsFloat(bits & 0x7FFFFFFFu) * inv_cap;
  const VFloat e = Exp(Splat(-2.0f) * y);
  const VFloat t = (Splat(1.0f) - e) / (Splat(1.0f) + e);
  const VFloat capped = AsFloat(AsUInt(t * cap) | (bits & 0x80000000u));
  return x != x ? x : capped;
}

}  // namespace

// Turns the raw scores of keys [ja, ja + cnt) into probabilities under each row's running
// maximum, rescaling the row's denominator and output when the maximum grows.  Returns whether
// any row sees any of these keys.
bool AttentionAccumulator::UpdateSoftmax(int64_t ja, int cnt) {
  return soft_cap_ > 0.0f ? UpdateSoftmaxT<true>(ja, cnt) : UpdateSoftmaxT<false>(ja, cnt);
}

template <bool kSoftCap>
bool AttentionAccumulator::UpdateSoftmaxT(int64_t ja, int cnt) {
  const VFloat cap = Splat(soft_cap_), inv_cap = Splat(kSoftCap ? 1.0f / soft_cap_ : 1.0f);
  (void)cap, (void)inv_cap;
  bool any = false;
  const VInt lane = Iota();
  for (int m = 0; m < rows_; ++m) {
    const VFloat scale = Splat(srow_[m]);
    const int a = static_cast<int>(std::max<int64_t>(lo_[m] - ja, 0));
    const int b = static_cast<int>(std::min<int64_t>(hi_[m] - ja + 1, cnt));
    seg_a_[m] = a;
    seg_b_[m] = b;
    if (a >= b) continue;
    any = true;
    float* s = s_ + static_cast<int64_t>(m) * sld_;
    const int va = a / kVL * kVL;  // vector-aligned span covering [a, b)
    const int vb = static_cast<int>(RoundUp(b, kVL));
    const bool whole = va == a && vb == b;  // [a, b) is whole vectors: no lane masks
    VFloat vmax = Splat(kNegInf);
    VInt vnan = VInt{};
    if (whole) {
      for (int j = va; j < vb; j += kVL) {
        VFloat x = Load(s + j) * scale;
        if constexpr (kSoftCap) x = SoftCap(x, cap, inv_cap);
        Store(s + j, x);
        vmax = x > vmax ? x : vmax;
        vnan |= x != x;
      }
    } else {
      for (int j = va; j < vb; j += kVL) {
        const VInt idx = lane + j;
        VFloat x = Load(s + j) * scale;
        if constexpr (kSoftCap) x = SoftCap(x, cap, inv_cap);
        Store(s + j, x);
        const VInt in = (idx >= a) & (idx < b);
        vmax = in & (x > vmax) ? x : vmax;
        vnan |= in & (x != x);
      }
    }
    float row_max = HorizontalMax(vmax);
    if (AnyLane(vnan)) row_max = std::numeric_limits<float>::quiet_NaN();  // NaN propagates, as in the reference
    const float new_max = row_max != row_max ? row_max : std::max(max_[m], row_max);
    // exp(0) == 1 exactly: the common case of an unchanged maximum needs no exp.
    const float alpha = (max_[m] == kNegInf) ? 0.0f : (new_max == max_[m] ? 1.0f : std::exp(max_[m] - new_max));
    VFloat vsum = Splat(0.0f);
    const VFloat shift = Splat(new_max);
    if (whole) {
      for (int j = va; j < vb; j += kVL) {
        const VFloat e = Exp(Load(s + j) - shift);
        Store(s + j, e);
        vsum += e;
      }
    } else {
      for (int j = va; j < vb; j += kVL) {
        const VInt idx = lane + j;
        const VFloat e = Exp(Load(s + j) - shift);
        const VFloat pv = (idx >= a) & (idx < b) ? e : Splat(0.0f);
        Store(s + j, pv);
        vsum += pv;
      }
    }
    // Probabilities outside [a, b) that a grouped V pass may read are zero.
    for (int j = 0; j < va; ++j) s[j] = 0.0f;
    for (int j = vb; j < cnt; ++j) s[j] = 0.0f;
    den_[m] = den_[m] * alpha + HorizontalSum(vsum);
    if (alpha != 1.0f) {
      float* o = o_ + static_cast<int64_t>(m) * ld_;
      const VFloat av = Splat(alpha);
      for (int c = 0; c < ld_; c += kVL) Store(o + c, Load(o + c) * av);
    }
    max_[m] = new_max;
  }
  return any;
}

// w_[(g * rows_padded_ + m) * sld_ + j] = p_m[j] * (scale of V group g of key j), for every row
// that sees a key and every group, when a pass of some row count folds VDec's scales.
template <class VDec>
void AttentionAccumulator::FoldScales(const PreparedRows& v, int cnt) {
  if constexpr (Folds<VDec, 1>() || Folds<VDec, 2>() || Folds<VDec, 3>() || Folds<VDec, 4>()) {
    const int groups = std::max(v.groups, 1);
    const int span = static_cast<int>(RoundUp(cnt, kVL));
    w_ = wbuf_.Get(static_cast<size_t>(groups) * rows_padded_ * sld_);
    float* scale = fold_scale_.Get(static_cast<size_t>(sld_));
    for (int g = 0; g < groups; ++g) {
      for (int j = 0; j < cnt; ++j) scale[j] = VDec::TokenCodes::GroupScale(v.scales + static_cast<int64_t>(j) * v.groups, g);
      for (int j = cnt; j < span; ++j) scale[j] = 0.0f;
      for (int m = 0; m < rows_; ++m) {
        if (seg_a_[m] >= seg_b_[m]) continue;
        const float* p = s_ + static_cast<int64_t>(m) * sld_;
        float* w = w_ + (static_cast<int64_t>(g) * rows_padded_ + m) * sld_;
        for (int j = 0; j < span; j += kVL) Store(w + j, Load(p + j) * Load(scale + j));
      }
    }
  }
}

template <class KDec>
void AttentionAccumulator::FloatScores(const PreparedRows& k, int cnt, Prefetcher* pf) {
  for (int m = 0; m < rows_; ++m) srow_[m] = sm_scale_;
  Scores<KDec>(q_, rows_, ld_, k, cnt, s_, sld_, pf);
}

template <class VDec, class ScoresFn>
void AttentionAccumulator::FoldRun(ScoresFn scores, const PreparedRows& v, int64_t ja, int cnt, Prefetcher* pf) {
  scores();
  pf->IssueAll();
  if (!UpdateSoftmax(ja, cnt)) return;
  ValuesFloat<VDec>(v, cnt);
}

template <class VDec>
void AttentionAccumulator::ValuesFloat(const PreparedRows& v, int cnt) {
  FoldScales<VDec>(v, cnt);
  const int64_t wstride = static_cast<int64_t>(rows_padded_) * sld_;
  const int nchunks = ld_ / kVL;
  int group[4];
  int ng = 0;
  auto flush = [&]() {
    if (ng == 0) return;
    const float* p[4];
    const float* w[4];
    float* o[4];
    int a = cnt, b = 0;
    bool same = true;
    for (int i = 0; i < ng; ++i) {
      p[i] = s_ + static_cast<int64_t>(group[i]) * sld_;
      w[i] = w_ + static_cast<int64_t>(group[i]) * sld_;  // read only when the pass folds
      o[i] = o_ + static_cast<int64_t>(group[i]) * ld_;
      a = std::min(a, seg_a_[group[i]]);
      b = std::max(b, seg_b_[group[i]]);
      same &= seg_a_[group[i]] == seg_a_[group[0]] && seg_b_[group[i]] == seg_b_[group[0]];
    }
    switch (ng) {
      case 1: AccumulateRows<VDec, 1>(p, w, wstride, a, b, same, v, nchunks, o); break;
      case 2: AccumulateRows<VDec, 2>(p, w, wstride, a, b, same, v, nchunks, o); break;
      case 3: AccumulateRows<VDec, 3>(p, w, wstride, a, b, same, v, nchunks, o); break;
      default: AccumulateRows<VDec, 4>(p, w, wstride, a, b, same, v, nchunks, o); break;
    }
    ng = 0;
  };
  for (int m = 0; m < rows_; ++m) {
    if (seg_a_[m] >= seg_b_[m]) continue;
    group[ng++] = m;
    if (ng == 4) flush();
  }
  flush();
}

bool AttentionAccumulator::PrepareQueryBytes() {
  if (qbytes_ready_) return qbytes_ok_;
  qbytes_ready_ = true;
  qbytes_ok_ = false;
#if defined(NINFER_KV_INT_SCORES)
  const int groups = ld_ / 16;
  qhi_ = reinterpret_cast<uint8_t*>(qbytes_.Get(static_cast<size_t>(rows_padded_) * ld_ / 2));
  qlo_ = qhi_ + static_cast<int64_t>(rows_padded_) * ld_;
  std::memset(qhi_, 0, static_cast<size_t>(rows_padded_) * ld_ * 2);
  qcorr_.assign(static_cast<size_t>(rows_padded_) * groups, 0);
  for (int m = 0; m < rows_; ++m) {
    const float* q = q_ + static_cast<int64_t>(m) * ld_;
    VFloat top = Splat(0.0f);
    VInt bad = VInt{};
    for (int c = 0; c < ld_; c += kVL) {
      const VFloat a = AsFloat(AsUInt(Load(q + c)) & 0x7FFFFFFFu);
      bad |= !(a <= Splat(3.4028235e38f));  // NaN or infinite: that query keeps float32 scores
      top = a > top ? a : top;
    }
    if (AnyLane(bad)) return false;
    const float amax = HorizontalMax(top);
    // q ~ q16 * step with |q16| <= kNvfp4QueryMax; an all-zero row keeps zeros.
    const float step = amax > 0.0f ? amax / static_cast<float>(kNvfp4QueryMax) : 1.0f;
    const float inv = amax > 0.0f ? static_cast<float>(kNvfp4QueryMax) / amax : 1.0f;
    uint8_t* hi = qhi_ + static_cast<int64_t>(m) * ld_;
    uint8_t* lo = qlo_ + static_cast<int64_t>(m) * ld_;
    for (int i = 0; i < d_; ++i) {
      const int q16 = std::max(-kNvfp4QueryMax, std::min(kNvfp4QueryMax, static_cast<int>(std::nearbyint(q[i] * inv))));
      const int dst = (i & ~7) + (i & 1) * 4 + (i & 7) / 2;  // the key columns' order (int_scores.h)
      hi[dst] = static_cast<uint8_t>(q16 >> 7);               // arithmetic shift: q16 = 128 * hi + lo
      lo[dst] = static_cast<uint8_t>(q16 & 127);
      qcorr_[m * groups + i / 16] -= 12 * q16;
    }
    qscale_[m] = step;
  }
  qbytes_ok_ = true;
#endif
  return qbytes_ok_;
}

void AttentionAccumulator::ScoresNvfp4Int(const PreparedRows& k, int cnt, Prefetcher* pf) {
#if defined(NINFER_KV_INT_SCORES)
  const int groups = d_ / 16;
  const int fld = static_cast<int>(RoundUp(cnt, 16));
  float* sk = facbuf_.Get(static_cast<size_t>(groups) * fld);
  GroupMajor(k.scales, cnt, groups, sk, fld);
  // the block sums are 2 * (q16 . e2m1) (int_scores.h)
  for (int m = 0; m < rows_; ++m) srow_[m] = 0.5f * sm_scale_ * qscale_[m];
  const QueryBytes qb{qhi_, qlo_, ld_, qcorr_.data(), groups};
  const int64_t blocks = (cnt + 15) / 16;
  const int64_t per_block = (pf->total_lines() + blocks - 1) / std::max<int64_t>(blocks, 1);
  for (int j0 = 0; j0 < cnt; j0 += 16) {
    pf->Issue(per_block);
    const uint8_t* rows16[16];
    for (int jj = 0; jj < 16; ++jj) rows16[jj] = k.data + static_cast<int64_t>(std::min(j0 + jj, cnt - 1)) * k.stride;
    ScoreBlockNvfp4(rows16, d_, qb, rows_, sk + j0, fld, s_ + j0, sld_);
  }
#else
  (void)k, (void)cnt, (void)pf;
#endif
}

namespace {

// Whether every scale of run p is finite (the integer scores have no NaN or infinity to carry).
bool ScalesFinite(const PreparedRows& p, int cnt) {
  const int n = cnt * p.groups;
  VInt bad = VInt{};
  int i = 0;
  for (; i + kVL <= n; i += kVL) bad |= !(AsFloat(AsUInt(Load(p.scales + i)) & 0x7FFFFFFFu) <= Splat(3.4028235e38f));
  if (AnyLane(bad)) return false;
  for (; i < n; ++i) {
    if (!(std::fabs(p.scales[i]) <= 3.4028235e38f)) return false;
  }
  return true;
}

}  // namespace

ArithmeticChoice ArithmeticOf(Codec k, Codec v, int d) {
  (void)v;
  ArithmeticChoice a{Arithmetic::kFloat32, Arithmetic::kFloat32};
  VisitCodec(k, [&](auto codec) {
    if (Decoder<decltype(codec)::value>::IntScores(d)) a.scores = Arithmetic::kInt8x2;
  });
  return a;
}

bool AttentionAccumulator::PrepareQueryPairs() {
  if (qpairs_ready_) return qpairs_ok_;
  qpairs_ready_ = true;
  qpairs_ok_ = false;
#if defined(NINFER_KV_BF16_SCORES)
  if (d_ % 32 != 0 || !Bf16DotsEnabled()) return false;
  qw_ = reinterpret_cast<uint32_t*>(qpairs_.Get(static_cast<size_t>(rows_padded_) * ld_ / 2));
  for (int m = 0; m < rows_padded_; ++m) {
    const float* q = q_ + static_cast<int64_t>(m) * ld_;
    uint32_t low = 0;
    for (int i = 0; i < ld_; ++i) {
      uint32_t b;
      std::memcpy(&b, q + i, 4);
      low |= b & 0xFFFFu;
    }
    if (low != 0) return false;  // not bfloat16 values: the float32 scores
    uint32_t* w = qw_ + static_cast<int64_t>(m) * ld_ / 2;
    for (int i = 0; i < ld_; i += 2) {
      uint32_t even, odd;
      std::memcpy(&even, q + i, 4);
      std::memcpy(&odd, q + i + 1, 4);
      w[i / 2] = (even >> 16) | (odd & 0xFFFF0000u);
    }
  }
  qpairs_ok_ = true;
#endif
  return qpairs_ok_;
}

void AttentionAccumulator::Fold(const KVRunSource& src, int64_t j0, int n, const KVRunSource* prefetch) {
  const int64_t ja = std::max(j0, min_lo_);
  const int64_t jb = std::min(j0 + n, max_hi_ + 1);
  if (ja >= jb) return;
  const int cnt = static_cast<int>(jb - ja);
  const int64_t off = ja - j0;
  RowSource k = src.k, v = src.v;
  k.data += off * k.data_stride;
  v.data += off * v.data_stride;
  if (k.scale) k.scale += off * k.scale_stride;
  if (v.scale) v.scale += off * v.scale_stride;

  Prefetcher pf;
  if (prefetch != nullptr) {
    const RowSource* next[2] = {&prefetch->k, &prefetch->v};
    for (const RowSource* r : next) {
      pf.Add(r->data, r->data_stride * cap_);
      pf.Add(r->scale, r->scale_stride * cap_);
    }
  }

  if (d_ % kVL != 0) {  // dequantize into float32 tiles padded to ld_
    DequantizeRows(k, cnt, d_, ld_, kf_, nullptr);
    DequantizeRows(v, cnt, d_, ld_, vf_, nullptr);
    PreparedRows kt, vt;
    kt.data = reinterpret_cast<const uint8_t*>(kf_);
    vt.data = reinterpret_cast<const uint8_t*>(vf_);
    kt.stride = vt.stride = static_cast<int64_t>(ld_) * sizeof(float);
    FoldRun<F32Decoder>([&] { FloatScores<F32Decoder>(kt, cnt, &pf); }, vt, ja, cnt, &pf);
    return;
  }
  const PreparedRows kp = PrepareRows(k, cnt, d_, &kscale_, &knan_);
  const PreparedRows vp = PrepareRows(v, cnt, d_, &vscale_, &vnan_);
  if (ArithmeticOf(k.codec, v.codec, d_).scores == Arithmetic::kInt8x2 && ScalesFinite(kp, cnt) &&
      PrepareQueryBytes()) {
    VisitValueDecoder(v.codec, vp, [&](auto vdec) {
      FoldRun<typename decltype(vdec)::type>([&] { ScoresNvfp4Int(kp, cnt, &pf); }, vp, ja, cnt, &pf);
    });
    return;
  }
#if defined(NINFER_KV_BF16_SCORES)
  if (k.codec == Codec::kBF16 && PrepareQueryPairs()) {
    VisitValueDecoder(v.codec, vp, [&](auto vdec) {
      FoldRun<typename decltype(vdec)::type>(
          [&] {
            for (int m = 0; m < rows_; ++m) srow_[m] = sm_scale_;
            ScoresBf16(qw_, rows_, ld_ / 2, d_, kp, cnt, s_, sld_, &pf);
          },
          vp, ja, cnt, &pf);
    });
    return;
  }
#endif
  VisitCodec(k.codec, [&](auto codec) {
    VisitValueDecoder(v.codec, vp, [&](auto vdec) {
      FoldRun<typename decltype(vdec)::type>([&] { FloatScores<Decoder<decltype(codec)::value>>(kp, cnt, &pf); },
                                             vp, ja, cnt, &pf);
    });
  });
}

void AttentionAccumulator::Output(int m, float* dst) const {
  const float l = den_[m];
  const float* o = o_ + static_cast<int64_t>(m) * ld_;
  if (!(l > 0.0f)) {
    if (l != l) {
      for (int i = 0; i < d_; ++i) dst[i] = l;
    } else {
      std::memset(dst, 0, sizeof(float) * d_);
    }
    return;
  }
  for (int i = 0; i < d_; ++i) dst[i] = o[i] / l;
}

void AttentionAccumulator::ExportPartial(int m, float* dst) const {
  dst[0] = max_[m];
  dst[1] = den_[m];
  std::memcpy(dst + 2, o_ + static_cast<int64_t>(m) * ld_, sizeof(float) * d_);
}

void CombinePartials(const float* const* parts, int nparts, int d, float* dst) {
  float gmax = kNegInf;
  bool nan = false;
  for (int i = 0; i < nparts; ++i) {
    nan |= parts[i][0] != parts[i][0];
    if (parts[i][1] > 0.0f) gmax = std::max(gmax, parts[i][0]);
  }
  std::memset(dst, 0, sizeof(float) * d);
  if (nan) {
    for (int c = 0; c < d; ++c) dst[c] = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  if (gmax == kNegInf) return;  // no visible key in any part
  float den = 0.0f;
  for (int i = 0; i < nparts; ++i) {
    if (!(parts[i][1] > 0.0f)) continue;
    const float w = std::exp(parts[i][0] - gmax);
    den += parts[i][1] * w;
    const float* o = parts[i] + 2;
    for (int c = 0; c < d; ++c) dst[c] += o[c] * w;
  }
  for (int c = 0; c < d; ++c) dst[c] /= den;
}

AttentionAccumulator& ThreadAccumulator() {
  static thread_local AttentionAccumulator acc;
  return acc;
}

std::vector<float>& ThreadRowBuffer(size_t n) {
  static thread_local std::vector<float> row;
  if (row.size() < n) row.resize(n);
  return row;
}

NINFER_KV_NAMESPACE_END
