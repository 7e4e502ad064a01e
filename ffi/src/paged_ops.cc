// XLA FFI handlers of the paged ops: append (in place) and attention.
//
// Operands (in order) and attributes are fixed by ninfer_kv/ops/ffi/:
//   NinferKvPagedAppend(block_tables s32 (C, L), layer s32 (), table_rows s32 (B,),
//                       positions s32 (B,), valid s32 (B,), k (B, T, H, D), v (B, T, H, D),
//                       planes...) -> planes... (each result aliases its plane operand)
//   NinferKvPagedAttention(q (B, T, Hq, D), block_tables, layer, table_rows, positions,
//                          kv_lens s32 (B,), planes...) -> out (B, T, Hq, D), q's dtype
//   NinferKvPagedAppendRagged(block_tables, layer, table_rows s32 (R,), positions s32 (R,),
//                             query_starts s32 (R + 1,), k (1, T, H, D), v, planes...) -> planes...
//   NinferKvPagedAttentionRagged(q (1, T, Hq, D), block_tables, layer, table_rows s32 (R,),
//                                positions s32 (R,), kv_lens s32 (R,), query_starts s32 (R + 1,),
//                                planes...) -> out (1, T, Hq, D)
//   attributes: k_codec, v_codec (s32 codec ids), head_major (s32 0/1), sm_scale (f32, attention),
//   no_splits (s32 0/1, attention: no context splits, attention_driver.h).
//   NinferKvPagedAttentionVariants, NinferKvPagedAttentionRaggedVariants: the two attention forms
//   with one more operand after their last s32 vector, sinks f32 (Hq,) (or (0,): no sinks), and
//   two more attributes: window (s32; 0: none, else query position p sees keys j > p - window)
//   and soft_cap (f32; 0: none, else scores become soft_cap * tanh(score / soft_cap)).  The plain
//   forms are these with all three off, and run the same code.
//
// The ragged forms take a ragged batch: R rows of different query lengths in one token axis; row
// r owns tokens [query_starts[r], query_starts[r + 1]) (RaggedStarts: clamped into [0, T], then a
// running maximum), its token t at position positions[r] + t.  Tokens of no row are padding:
// append writes nothing for them, attention returns zeros.  Each row is what the rectangular
// form computes for a batch row of that many tokens (the same query blocks, bit for bit when
// neither splits its context).
//
// Odd indices (the rules every implementation follows): a table row outside [0, C) is inert
// (append writes nothing for it, attention returns zeros for its queries); attention reads only
// keys j <= min(position + t, kv_len - 1, L * P - 1) and masks every key of a block whose page ID
// is outside [0, N) (negative included), never forming a pointer from such an ID; append drops a
// token whose position is negative, whose block is >= L, whose page ID is outside [0, N), or whose
// layer is outside [0, num_layers).
#if defined(__GNUC__) && !defined(__clang__)
// The XLA handler templates instantiated here (their metadata code above all) are named by types
// of no level, so GCC's partial-inlining and IPA-SRA clones of them would carry no level in their
// names either while using the level's registers; keep them whole (no clones: the levels' copies
// stay COMDAT functions of one name, and tests/ffi/test_ffi_build.py can tell them apart).
#pragma GCC optimize("no-partial-inlining", "no-ipa-sra")
#endif
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "append_common.h"
#include "attention_driver.h"
#include "common.h"
#include "handler_args.h"
#include "kernel_table.h"
#include "planes.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

NINFER_KV_NAMESPACE_BEGIN
namespace {

// Geometry of a stacked paged plane: (layers, N, H, P, X) or (layers, H, N, P, X).
struct PagedGeometry {
  int64_t layers, pages, heads, page_size;
  bool head_major;

  static PagedGeometry Of(const PlaneSet& p, bool head_major) {
    PagedGeometry g;
    g.layers = p.dims[0];
    g.pages = head_major ? p.dims[2] : p.dims[1];
    g.heads = head_major ? p.dims[1] : p.dims[2];
    g.page_size = p.dims[3];
    g.head_major = head_major;
    return g;
  }

  // Flat token index of (layer, page, head, column) over the leading four dims.
  int64_t Token(int64_t layer, int64_t page, int64_t head, int64_t column) const {
    const int64_t tile = head_major ? (layer * heads + head) * pages + page : (layer * pages + page) * heads + head;
    return tile * page_size + column;
  }
};

struct BlockTables {
  const int32_t* data;
  int64_t rows, blocks;  // C, L

  static BlockTables Of(const ffi::Buffer<ffi::S32, 2>& t) { return {t.typed_data(), t.dimensions()[0], t.dimensions()[1]}; }
};

class PagedSource {
 public:
  PagedSource(const PlaneSet& planes, const PagedGeometry& geo, const BlockTables& bt, int64_t layer,
              const int32_t* table_rows, const int32_t* positions, const int32_t* kv_lens, int64_t window = 0)
      : planes_(planes),
        geo_(geo),
        bt_(bt),
        layer_(layer),
        rows_(table_rows),
        pos_(positions),
        lens_(kv_lens),
        window_(window) {}

  int run_capacity() const { return static_cast<int>(geo_.page_size); }
  int64_t split_align() const { return geo_.page_size; }
  int64_t RunEnd(int, int64_t j) const { return (j / geo_.page_size + 1) * geo_.page_size; }

  void Visible(int b, int t, int64_t* lo, int64_t* hi) const {
    *lo = 0;
    if (bt_.blocks == 0 || rows_[b] < 0 || rows_[b] >= bt_.rows) {  // an inert row sees no key
      *hi = -1;
      return;
    }
    const int64_t qpos = static_cast<int64_t>(pos_[b]) + t;
    *hi = std::min({qpos, static_cast<int64_t>(lens_[b]) - 1, bt_.blocks * geo_.page_size - 1});
    if (window_ > 0) *lo = std::max<int64_t>(0, qpos - window_ + 1);  // keys j > qpos - window
  }

  // Whether the block holding key j maps a page in [0, N) (the keys of other blocks are masked).
  // Only called for rows that see keys, i.e. whose table row is in range.
  bool RunValid(int b, int64_t j) const {
    const int64_t page = bt_.data[static_cast<int64_t>(rows_[b]) * bt_.blocks + j / geo_.page_size];
    return page >= 0 && page < geo_.pages;
  }

  KVRunSource Run(int b, int h, int64_t j) const {
    const int64_t row = Clamp64(rows_[b], 0, bt_.rows - 1);  // in range when RunValid held; clamps stay safe
    const int64_t page = Clamp64(bt_.data[row * bt_.blocks + j / geo_.page_size], 0, geo_.pages - 1);
    return planes_.Run(geo_.Token(layer_, page, h, j % geo_.page_size));
  }

 private:
  const PlaneSet& planes_;
  PagedGeometry geo_;
  BlockTables bt_;
  int64_t layer_;
  const int32_t* rows_;
  const int32_t* pos_;
  const int32_t* lens_;
  int64_t window_;  // 0: no sliding window
};

// Writes token t of batch row b (at position positions[b] + t of table row table_rows[b]) from
// k / v row (kb, kt), dropping it where the rules of the header say.
struct TokenWriter {
  const AppendInputs& in;
  const PlaneSet& planes;
  PagedGeometry geo;
  BlockTables bt;
  int64_t layer;
  const int32_t* rows;
  const int32_t* pos;

  // False when nothing can be written: the layer is outside [0, layers) or the tables are empty.
  bool active() const { return layer >= 0 && layer < geo.layers && bt.rows > 0 && bt.blocks > 0; }

  void operator()(int64_t b, int64_t t, int64_t kb, int64_t kt) const {
    const int64_t p = static_cast<int64_t>(pos[b]) + t;
    if (p < 0) return;
    const int64_t blk = p / geo.page_size;
    if (blk >= bt.blocks) return;
    const int64_t row = rows[b];
    if (row < 0 || row >= bt.rows) return;  // an inert row writes nothing
    const int64_t page = bt.data[row * bt.blocks + blk];
    if (page < 0 || page >= geo.pages) return;
    for (int64_t h = 0; h < in.heads; ++h) WriteToken(in, planes, kb, kt, h, geo.Token(layer, page, h, p % geo.page_size));
  }
};

ffi::Error PagedAppendImpl(ffi::Buffer<ffi::S32, 2> block_tables, ffi::Buffer<ffi::S32, 0> layer,
                           ffi::Buffer<ffi::S32, 1> table_rows, ffi::Buffer<ffi::S32, 1> positions,
                           ffi::Buffer<ffi::S32, 1> valid, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::RemainingArgs planes_in, ffi::RemainingRets planes_out, int32_t k_codec,
                           int32_t v_codec, int32_t head_major) {
  constexpr const char* kOp = "paged append";
  AppendInputs in;
  PlaneSet planes;
  if (auto err = ParseAppendOperands(kOp, k, v, planes_in, planes_out, k_codec, v_codec, &in, &planes); err.failure()) {
    return err;
  }
  const PagedGeometry geo = PagedGeometry::Of(planes, head_major != 0);
  if (auto err = CheckAppendBatch(kOp, in, geo.heads, {&table_rows, &positions, &valid}, "table_rows/positions/valid");
      err.failure()) {
    return err;
  }
  const TokenWriter write{in, planes, geo, BlockTables::Of(block_tables), layer.typed_data()[0],
                         table_rows.typed_data(), positions.typed_data()};
  if (!write.active()) return ffi::Error::Success();
  const int32_t* val = valid.typed_data();
  const int64_t T = in.queries;
  ForEachItem(in.batch * T, in.heads * in.head_dim, [&](int64_t item) {
    const int64_t b = item / T, t = item % T;
    if (t < val[b]) write(b, t, b, t);
  });
  return ffi::Error::Success();
}

ffi::Error PagedAppendRaggedImpl(ffi::Buffer<ffi::S32, 2> block_tables, ffi::Buffer<ffi::S32, 0> layer,
                                 ffi::Buffer<ffi::S32, 1> table_rows, ffi::Buffer<ffi::S32, 1> positions,
                                 ffi::Buffer<ffi::S32, 1> query_starts, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                 ffi::RemainingArgs planes_in, ffi::RemainingRets planes_out, int32_t k_codec,
                                 int32_t v_codec, int32_t head_major) {
  constexpr const char* kOp = "ragged paged append";
  AppendInputs in;
  PlaneSet planes;
  if (auto err = ParseAppendOperands(kOp, k, v, planes_in, planes_out, k_codec, v_codec, &in, &planes); err.failure()) {
    return err;
  }
  const PagedGeometry geo = PagedGeometry::Of(planes, head_major != 0);
  if (auto err = CheckRaggedRows(kOp, in.batch, in.heads, geo.heads, query_starts, {&table_rows, &positions},
                                 "table_rows/positions");
      err.failure()) {
    return err;
  }
  const TokenWriter write{in, planes, geo, BlockTables::Of(block_tables), layer.typed_data()[0],
                         table_rows.typed_data(), positions.typed_data()};
  if (!write.active()) return ffi::Error::Success();
  const int64_t R = table_rows.dimensions()[0], T = in.queries;
  const std::vector<int64_t> e = RaggedStarts(query_starts.typed_data(), R, T);
  ForEachItem(e[R] - e[0], in.heads * in.head_dim, [&](int64_t item) {
    const int64_t i = e[0] + item;
    const int64_t b = std::upper_bound(e.begin() + 1, e.end(), i) - (e.begin() + 1);  // e[b] <= i < e[b + 1]
    write(b, i - e[b], 0, i);
  });
  return ffi::Error::Success();
}

// The options of the variant handlers (all off for the plain ones).
struct Variants {
  int64_t window = 0;       // 0: none
  float soft_cap = 0.0f;    // 0: none
  const float* sinks = nullptr;

  void Apply(AttentionShape* s) const {
    s->soft_cap = soft_cap;
    s->sinks = sinks;
  }
};

// Checks the variant operands and attributes against q (B, T, Hq, D) and decodes them.
ffi::Error ParseVariants(const char* op, const ffi::AnyBuffer& q, const ffi::Buffer<ffi::F32, 1>& sinks,
                         int32_t window, float soft_cap, Variants* var) {
  if (window < 0) {
    return ffi::Error::InvalidArgument(std::string(op) + ": window must be >= 1 (0: none), got " +
                                       std::to_string(window));
  }
  if (!(soft_cap >= 0.0f) || soft_cap > 3.4028235e38f) {
    return ffi::Error::InvalidArgument(std::string(op) + ": soft_cap must be finite and > 0 (0: none)");
  }
  const int64_t n = sinks.dimensions()[0];
  if (n != 0 && n != q.dimensions()[2]) {
    return ffi::Error::InvalidArgument(std::string(op) + ": sinks must have shape (Hq,) with Hq=" +
                                       std::to_string(q.dimensions()[2]) + " (or (0,): none), got " +
                                       DimsString(sinks.dimensions()));
  }
  var->window = window;
  var->soft_cap = soft_cap;
  var->sinks = n != 0 ? sinks.typed_data() : nullptr;
  return ffi::Error::Success();
}

ffi::Error PagedAttentionRun(ffi::AnyBuffer q, ffi::Buffer<ffi::S32, 2> block_tables, ffi::Buffer<ffi::S32, 0> layer,
                              ffi::Buffer<ffi::S32, 1> table_rows, ffi::Buffer<ffi::S32, 1> positions,
                              ffi::Buffer<ffi::S32, 1> kv_lens, ffi::RemainingArgs planes_in,
                              ffi::Result<ffi::AnyBuffer> out, int32_t k_codec, int32_t v_codec, int32_t head_major,
                              float sm_scale, int32_t no_splits, const Variants& var) {
  constexpr const char* kOp = "paged attention";
  if (auto err = CheckQueryAndOutput(kOp, q, *out); err.failure()) return err;
  PlaneSet planes;
  if (auto err = ParseAttentionPlanes(q, planes_in, k_codec, v_codec, &planes); err.failure()) return err;
  const PagedGeometry geo = PagedGeometry::Of(planes, head_major != 0);
  if (auto err = CheckAttentionBatch(kOp, q, geo.heads, {&table_rows, &positions, &kv_lens},
                                     "table_rows/positions/kv_lens");
      err.failure()) {
    return err;
  }
  const BlockTables bt = BlockTables::Of(block_tables);
  const int64_t lay = Clamp64(layer.typed_data()[0], 0, geo.layers - 1);
  PagedSource src(planes, geo, bt, lay, table_rows.typed_data(), positions.typed_data(), kv_lens.typed_data(),
                  var.window);
  AttentionShape shape = QueryShape(q, *out, geo.heads, sm_scale, no_splits);
  var.Apply(&shape);
  RunAttention(shape, src);
  return ffi::Error::Success();
}

ffi::Error PagedAttentionRaggedRun(ffi::AnyBuffer q, ffi::Buffer<ffi::S32, 2> block_tables,
                                    ffi::Buffer<ffi::S32, 0> layer, ffi::Buffer<ffi::S32, 1> table_rows,
                                    ffi::Buffer<ffi::S32, 1> positions, ffi::Buffer<ffi::S32, 1> kv_lens,
                                    ffi::Buffer<ffi::S32, 1> query_starts, ffi::RemainingArgs planes_in,
                                    ffi::Result<ffi::AnyBuffer> out, int32_t k_codec, int32_t v_codec,
                                    int32_t head_major, float sm_scale, int32_t no_splits,
                                    const Variants& var) {
  constexpr const char* kOp = "ragged paged attention";
  if (auto err = CheckQueryAndOutput(kOp, q, *out); err.failure()) return err;
  PlaneSet planes;
  if (auto err = ParseAttentionPlanes(q, planes_in, k_codec, v_codec, &planes); err.failure()) return err;
  const PagedGeometry geo = PagedGeometry::Of(planes, head_major != 0);
  const int64_t q_heads = q.dimensions()[2];
  if (q_heads % geo.heads != 0) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": q heads (" + std::to_string(q_heads) +
                                       ") must be a multiple of the KV heads (" + std::to_string(geo.heads) + ")");
  }
  if (auto err = CheckRaggedRows(kOp, q.dimensions()[0], geo.heads, geo.heads, query_starts,
                                 {&table_rows, &positions, &kv_lens}, "table_rows/positions/kv_lens");
      err.failure()) {
    return err;
  }
  const BlockTables bt = BlockTables::Of(block_tables);
  const int64_t lay = Clamp64(layer.typed_data()[0], 0, geo.layers - 1);
  const int64_t R = table_rows.dimensions()[0];
  AttentionShape shape = QueryShape(q, *out, geo.heads, sm_scale, no_splits);
  const std::vector<int64_t> e = RaggedStarts(query_starts.typed_data(), R, shape.queries);
  shape.batch = R;
  shape.row_starts = e.data();
  var.Apply(&shape);
  PagedSource src(planes, geo, bt, lay, table_rows.typed_data(), positions.typed_data(), kv_lens.typed_data(),
                  var.window);
  RunAttention(shape, src);
  return ffi::Error::Success();
}

ffi::Error PagedAttentionImpl(ffi::AnyBuffer q, ffi::Buffer<ffi::S32, 2> block_tables, ffi::Buffer<ffi::S32, 0> layer,
                              ffi::Buffer<ffi::S32, 1> table_rows, ffi::Buffer<ffi::S32, 1> positions,
                              ffi::Buffer<ffi::S32, 1> kv_lens, ffi::RemainingArgs planes_in,
                              ffi::Result<ffi::AnyBuffer> out, int32_t k_codec, int32_t v_codec, int32_t head_major,
                              float sm_scale, int32_t no_splits) {
  return PagedAttentionRun(q, block_tables, layer, table_rows, positions, kv_lens, planes_in, out, k_codec, v_codec,
                           head_major, sm_scale, no_splits, Variants());
}

ffi::Error PagedAttentionRaggedImpl(ffi::AnyBuffer q, ffi::Buffer<ffi::S32, 2> block_tables,
                                    ffi::Buffer<ffi::S32, 0> layer, ffi::Buffer<ffi::S32, 1> table_rows,
                                    ffi::Buffer<ffi::S32, 1> positions, ffi::Buffer<ffi::S32, 1> kv_lens,
                                    ffi::Buffer<ffi::S32, 1> query_starts, ffi::RemainingArgs planes_in,
                                    ffi::Result<ffi::AnyBuffer> out, int32_t k_codec, int32_t v_codec,
                                    int32_t head_major, float sm_scale, int32_t no_splits) {
  return PagedAttentionRaggedRun(q, block_tables, layer, table_rows, positions, kv_lens, query_starts, planes_in, out,
                                 k_codec, v_codec, head_major, sm_scale, no_splits, Variants());
}

ffi::Error PagedAttentionVariantsImpl(ffi::AnyBuffer q, ffi::Buffer<ffi::S32, 2> block_tables,
                                      ffi::Buffer<ffi::S32, 0> layer, ffi::Buffer<ffi::S32, 1> table_rows,
                                      ffi::Buffer<ffi::S32, 1> positions, ffi::Buffer<ffi::S32, 1> kv_lens,
                                      ffi::Buffer<ffi::F32, 1> sinks, ffi::RemainingArgs planes_in,
                                      ffi::Result<ffi::AnyBuffer> out, int32_t k_codec, int32_t v_codec,
                                      int32_t head_major, float sm_scale, int32_t no_splits, int32_t window,
                                      float soft_cap) {
  Variants var;
  if (auto err = ParseVariants("paged attention", q, sinks, window, soft_cap, &var); err.failure()) return err;
  return PagedAttentionRun(q, block_tables, layer, table_rows, positions, kv_lens, planes_in, out, k_codec, v_codec,
                            head_major, sm_scale, no_splits, var);
}

ffi::Error PagedAttentionRaggedVariantsImpl(ffi::AnyBuffer q, ffi::Buffer<ffi::S32, 2> block_tables,
                                            ffi::Buffer<ffi::S32, 0> layer, ffi::Buffer<ffi::S32, 1> table_rows,
                                            ffi::Buffer<ffi::S32, 1> positions, ffi::Buffer<ffi::S32, 1> kv_lens,
                                            ffi::Buffer<ffi::S32, 1> query_starts, ffi::Buffer<ffi::F32, 1> sinks,
                                            ffi::RemainingArgs planes_in, ffi::Result<ffi::AnyBuffer> out,
                                            int32_t k_codec, int32_t v_codec, int32_t head_major, float sm_scale,
                                            int32_t no_splits, int32_t window, float soft_cap) {
  Variants var;
  if (auto err = ParseVariants("ragged paged attention", q, sinks, window, soft_cap, &var); err.failure()) return err;
  return PagedAttentionRaggedRun(q, block_tables, layer, table_rows, positions, kv_lens, query_starts, planes_in, out,
                                  k_codec, v_codec, head_major, sm_scale, no_splits, var);
}

}  // namespace

// The operands every paged handler takes after q (attention) and before its last vector:
// block_tables, layer, table_rows, positions.
template <class Binding>
auto BindPagedRows(Binding binding) {
  return std::move(binding)
      .template Arg<S32Matrix>()   // block_tables
      .template Arg<S32Scalar>()   // layer
      .template Arg<S32Vector>()   // table_rows
      .template Arg<S32Vector>();  // positions
}

template <class Binding>
auto BindAttentionAttrs(Binding binding) {
  return std::move(binding).template Attr<int32_t>("head_major").template Attr<float>("sm_scale").template Attr<int32_t>(
      "no_splits");
}

XLA_FFI_DEFINE_HANDLER(kPagedAppendHandler, PagedAppendImpl,
                       BindAppendTail(BindPagedRows(ffi::Ffi::Bind()).Arg<S32Vector>())  // valid
                           .Attr<int32_t>("head_major"));

XLA_FFI_DEFINE_HANDLER(kPagedAttentionHandler, PagedAttentionImpl,
                       BindAttentionAttrs(BindAttentionTail(
                           BindPagedRows(ffi::Ffi::Bind().Arg<ffi::AnyBuffer>()).Arg<S32Vector>())));  // q; kv_lens

XLA_FFI_DEFINE_HANDLER(kPagedAppendRaggedHandler, PagedAppendRaggedImpl,
                       BindAppendTail(BindPagedRows(ffi::Ffi::Bind()).Arg<S32Vector>())  // query_starts
                           .Attr<int32_t>("head_major"));

XLA_FFI_DEFINE_HANDLER(kPagedAttentionRaggedHandler, PagedAttentionRaggedImpl,
                       BindAttentionAttrs(BindAttentionTail(BindPagedRows(ffi::Ffi::Bind().Arg<ffi::AnyBuffer>())
                                                                .Arg<S32Vector>()      // kv_lens
                                                                .Arg<S32Vector>())));  // query_starts

using F32Vector = ffi::Buffer<ffi::F32, 1>;

template <class Binding>
auto BindVariantAttrs(Binding binding) {
  return std::move(binding).template Attr<int32_t>("window").template Attr<float>("soft_cap");
}

XLA_FFI_DEFINE_HANDLER(kPagedAttentionVariantsHandler, PagedAttentionVariantsImpl,
                       BindVariantAttrs(BindAttentionAttrs(BindAttentionTail(
                           BindPagedRows(ffi::Ffi::Bind().Arg<ffi::AnyBuffer>())  // q
                               .Arg<S32Vector>()                                  // kv_lens
                               .Arg<F32Vector>()))));                             // sinks

XLA_FFI_DEFINE_HANDLER(kPagedAttentionRaggedVariantsHandler, PagedAttentionRaggedVariantsImpl,
                       BindVariantAttrs(BindAttentionAttrs(BindAttentionTail(
                           BindPagedRows(ffi::Ffi::Bind().Arg<ffi::AnyBuffer>())  // q
                               .Arg<S32Vector>()                                  // kv_lens
                               .Arg<S32Vector>()                                  // query_starts
                               .Arg<F32Vector>()))));                             // sinks

XLA_FFI_Error* PagedAppendHandler(XLA_FFI_CallFrame* call_frame) { return kPagedAppendHandler(call_frame); }
XLA_FFI_Error* PagedAttentionHandler(XLA_FFI_CallFrame* call_frame) { return kPagedAttentionHandler(call_frame); }
XLA_FFI_Error* PagedAppendRaggedHandler(XLA_FFI_CallFrame* call_frame) { return kPagedAppendRaggedHandler(call_frame); }
XLA_FFI_Error* PagedAttentionRaggedHandler(XLA_FFI_CallFrame* call_frame) {
  return kPagedAttentionRaggedHandler(call_frame);
}
XLA_FFI_Error* PagedAttentionVariantsHandler(XLA_FFI_CallFrame* call_frame) {
  return kPagedAttentionVariantsHandler(call_frame);
}
XLA_FFI_Error* PagedAttentionRaggedVariantsHandler(XLA_FFI_CallFrame* call_frame) {
  return kPagedAttentionRaggedVariantsHandler(call_frame);
}

NINFER_KV_NAMESPACE_END
