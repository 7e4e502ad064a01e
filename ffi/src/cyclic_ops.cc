// XLA FFI handlers of the cyclic (ring buffer) ops: append (in place) and windowed attention.
//
// Planes are (num_layers, rows, H, slots, X); key j of a row lives in slot j mod slots.
//   NinferKvCyclicAppend(rows s32 (B,), positions s32 (B,), valid s32 (B,), layer s32 (),
//                        k (B, T, H, D), v (B, T, H, D), planes...) -> planes... (aliased)
//   NinferKvCyclicAttention(q (B, T, Hq, D), rows, positions, kv_lens s32 (B,), layer,
//                           planes...) -> out (B, T, Hq, D)
//   attributes: k_codec, v_codec; window (s32 >= 1), sm_scale (f32) and no_splits (s32 0/1) for attention.
//
// Append writes token t < clip(valid[b], 0, T) at slot (positions[b] + t) mod slots when the
// position is >= 0 and among the last `slots` positions the call writes for that row (earlier ones would be
// overwritten in the same call); a row index outside [0, rows) or a layer outside
// [0, num_layers) writes nothing.  Attention returns zeros for a row index outside [0, rows)
// and clamps the layer; query
// (b, t) at p = positions[b] + t sees key j iff p - window < j <= p, j < kv_lens[b], j >= 0 and
// j > positions[b] + T - 1 - slots (the keys the ring still holds).
#include <algorithm>
#include <cstdint>
#include <string>

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

constexpr int64_t kRun = 64;  // keys folded per run (runs also break at the ring's end)

struct RingGeometry {
  int64_t layers, rows, heads, slots;
  static RingGeometry Of(const PlaneSet& p) { return {p.dims[0], p.dims[1], p.dims[2], p.dims[3]}; }
  int64_t Token(int64_t layer, int64_t row, int64_t head, int64_t slot) const {
    return ((layer * rows + row) * heads + head) * slots + slot;
  }
};

class RingSource {
 public:
  RingSource(const PlaneSet& planes, const RingGeometry& geo, int64_t layer, int64_t window, int64_t queries,
             const int32_t* rows, const int32_t* positions, const int32_t* kv_lens)
      : planes_(planes), geo_(geo), layer_(layer), window_(window), queries_(queries), rows_(rows), pos_(positions),
        lens_(kv_lens) {}

  int run_capacity() const { return static_cast<int>(kRun); }
  int64_t split_align() const { return kRun; }
  int64_t RunEnd(int, int64_t j) const {
    return std::min(j - j % geo_.slots + geo_.slots, (j / kRun + 1) * kRun);
  }

  void Visible(int b, int t, int64_t* lo, int64_t* hi) const {
    if (rows_[b] < 0 || rows_[b] >= geo_.rows) {  // an inert row sees no key
      *lo = 0;
      *hi = -1;
      return;
    }
    const int64_t qpos = static_cast<int64_t>(pos_[b]) + t;
    const int64_t top = static_cast<int64_t>(pos_[b]) + queries_ - 1;
    *lo = std::max({qpos - window_ + 1, top - geo_.slots + 1, int64_t{0}});
    *hi = std::min(qpos, static_cast<int64_t>(lens_[b]) - 1);
  }

  bool RunValid(int, int64_t) const { return true; }

  KVRunSource Run(int b, int h, int64_t j) const {
    const int64_t row = Clamp64(rows_[b], 0, geo_.rows - 1);
    return planes_.Run(geo_.Token(layer_, row, h, j % geo_.slots));
  }

 private:
  const PlaneSet& planes_;
  RingGeometry geo_;
  int64_t layer_, window_, queries_;
  const int32_t* rows_;
  const int32_t* pos_;
  const int32_t* lens_;
};

ffi::Error CyclicAppendImpl(ffi::Buffer<ffi::S32, 1> rows, ffi::Buffer<ffi::S32, 1> positions,
                            ffi::Buffer<ffi::S32, 1> valid, ffi::Buffer<ffi::S32, 0> layer, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::RemainingArgs planes_in, ffi::RemainingRets planes_out,
                            int32_t k_codec, int32_t v_codec) {
  constexpr const char* kOp = "cyclic append";
  AppendInputs in;
  PlaneSet planes;
  if (auto err = ParseAppendOperands(kOp, k, v, planes_in, planes_out, k_codec, v_codec, &in, &planes); err.failure()) {
    return err;
  }
  const RingGeometry geo = RingGeometry::Of(planes);
  if (auto err = CheckAppendBatch(kOp, in, geo.heads, {&rows, &positions, &valid}, "rows/positions/valid");
      err.failure()) {
    return err;
  }
  const int64_t lay = layer.typed_data()[0];
  if (lay < 0 || lay >= geo.layers) return ffi::Error::Success();
  const int32_t* rw = rows.typed_data();
  const int32_t* pos = positions.typed_data();
  const int32_t* val = valid.typed_data();
  const int64_t T = in.queries;
  ForEachItem(in.batch * T, in.heads * in.head_dim, [&](int64_t item) {
    const int64_t b = item / T, t = item % T;
    const int64_t vb = Clamp64(val[b], 0, T);  // valid is clipped to [0, T]
    if (t >= vb) return;
    const int64_t p = static_cast<int64_t>(pos[b]) + t;
    const int64_t last = static_cast<int64_t>(pos[b]) + vb - 1;
    if (p < 0 || p <= last - geo.slots) return;
    const int64_t row = rw[b];
    if (row < 0 || row >= geo.rows) return;
    for (int64_t h = 0; h < in.heads; ++h) WriteToken(in, planes, b, t, h, geo.Token(lay, row, h, p % geo.slots));
  });
  return ffi::Error::Success();
}

ffi::Error CyclicAttentionImpl(ffi::AnyBuffer q, ffi::Buffer<ffi::S32, 1> rows, ffi::Buffer<ffi::S32, 1> positions,
                               ffi::Buffer<ffi::S32, 1> kv_lens, ffi::Buffer<ffi::S32, 0> layer,
                               ffi::RemainingArgs planes_in, ffi::Result<ffi::AnyBuffer> out, int32_t k_codec,
                               int32_t v_codec, int32_t window, float sm_scale, int32_t no_splits) {
  constexpr const char* kOp = "cyclic attention";
  if (auto err = CheckQueryAndOutput(kOp, q, *out); err.failure()) return err;
  if (window < 1) return ffi::Error::InvalidArgument("cyclic attention: window must be >= 1, got " + std::to_string(window));
  PlaneSet planes;
  if (auto err = ParseAttentionPlanes(q, planes_in, k_codec, v_codec, &planes); err.failure()) return err;
  const RingGeometry geo = RingGeometry::Of(planes);
  if (auto err = CheckAttentionBatch(kOp, q, geo.heads, {&rows, &positions, &kv_lens}, "rows/positions/kv_lens");
      err.failure()) {
    return err;
  }
  const int64_t lay = Clamp64(layer.typed_data()[0], 0, geo.layers - 1);
  RingSource src(planes, geo, lay, window, q.dimensions()[1], rows.typed_data(), positions.typed_data(), kv_lens.typed_data());
  RunAttention(QueryShape(q, *out, geo.heads, sm_scale, no_splits), src);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kCyclicAppendHandler, CyclicAppendImpl,
                       BindAppendTail(ffi::Ffi::Bind()
                                          .Arg<S32Vector>()     // rows
                                          .Arg<S32Vector>()     // positions
                                          .Arg<S32Vector>()     // valid
                                          .Arg<S32Scalar>()));  // layer

XLA_FFI_DEFINE_HANDLER(kCyclicAttentionHandler, CyclicAttentionImpl,
                       BindAttentionTail(ffi::Ffi::Bind()
                                             .Arg<ffi::AnyBuffer>()  // q
                                             .Arg<S32Vector>()       // rows
                                             .Arg<S32Vector>()       // positions
                                             .Arg<S32Vector>()       // kv_lens
                                             .Arg<S32Scalar>())      // layer
                           .Attr<int32_t>("window")
                           .Attr<float>("sm_scale")
                           .Attr<int32_t>("no_splits"));

XLA_FFI_Error* CyclicAppendHandler(XLA_FFI_CallFrame* call_frame) { return kCyclicAppendHandler(call_frame); }
XLA_FFI_Error* CyclicAttentionHandler(XLA_FFI_CallFrame* call_frame) { return kCyclicAttentionHandler(call_frame); }

NINFER_KV_NAMESPACE_END
