// XLA FFI handlers of the cyclic (ring buffer) ops: append (in place) and windowed attention.
//
// Planes are (num_layers, rows, H, slots, X); key j of a row lives in slot j mod slots.
//   NinferKvCyclicAppend(rows s32 (B,), positions s32 (B,), valid s32 (B,), layer s32 (),
//                        k (B, T, H, D), v (B, T, H, D), planes...) -> planes... (aliased)
//   NinferKvCyclicAttention(q (B, T, Hq, D), rows, positions, kv_lens s32 (B,), layer,
//                           planes...) -> out (B, T, Hq, D)
//   attributes: k_codec, v_codec; window (s32 >= 1) and sm_scale (f32) for attention.
//
// Append writes token t < valid[b] at slot (positions[b] + t) mod slots when the position is
// >= 0 and among the last `slots` positions the call writes for that row (earlier ones would be
// overwritten in the same call); a row index outside [0, rows) or a layer outside
// [0, num_layers) writes nothing.  Attention clamps the row index and the layer; query
// (b, t) at p = positions[b] + t sees key j iff p - window < j <= p, j < kv_lens[b], j >= 0 and
// j > positions[b] + T - 1 - slots (the keys the ring still holds).
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "append_common.h"
#include "attention_driver.h"
#include "common.h"
#include "planes.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace ninfer_kv_ffi {
namespace {

constexpr int64_t kRun = 64;  // keys folded per run (runs also break at the ring's end)

struct RingGeometry {
  int64_t layers, rows, heads, slots;
  static RingGeometry Of(const PlaneSet& p) { return {p.dims[0], p.dims[1], p.dims[2], p.dims[3]}; }
  int64_t Token(int64_t layer, int64_t row, int64_t head, int64_t slot) const {
    return ((layer * rows + row) * heads + head) * slots + slot;
  }
};

ffi::Error CheckBatchVector(const ffi::Buffer<ffi::S32, 1>& buf, const char* name, int64_t batch) {
  if (buf.dimensions()[0] != batch) {
    return ffi::Error::InvalidArgument(std::string(name) + " must have shape (B,) with B=" + std::to_string(batch) +
                                       ", got " + DimsString(buf.dimensions()));
  }
  return ffi::Error::Success();
}

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
    const int64_t qpos = static_cast<int64_t>(pos_[b]) + t;
    const int64_t top = static_cast<int64_t>(pos_[b]) + queries_ - 1;
    *lo = std::max({qpos - window_ + 1, top - geo_.slots + 1, int64_t{0}});
    *hi = std::min(qpos, static_cast<int64_t>(lens_[b]) - 1);
  }

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
  AppendInputs in;
  if (auto err = ParseAppendInputs(k, v, &in); err.failure()) return err;
  std::vector<ffi::AnyBuffer> outs, ins;
  if (auto err = CollectRets(planes_out, &outs); err.failure()) return err;
  if (auto err = CollectArgs(planes_in, &ins); err.failure()) return err;
  if (ins.size() != outs.size()) return ffi::Error::InvalidArgument("cyclic append: plane operands and results differ in count");
  PlaneSet planes;
  if (auto err = ParsePlanes(outs, k_codec, v_codec, static_cast<int>(in.head_dim), &planes); err.failure()) return err;
  const RingGeometry geo = RingGeometry::Of(planes);
  if (geo.heads != in.heads) {
    return ffi::Error::InvalidArgument("cyclic append: k has " + std::to_string(in.heads) + " heads, the planes have " +
                                       std::to_string(geo.heads));
  }
  for (auto* check : {&rows, &positions, &valid}) {
    if (auto err = CheckBatchVector(*check, "rows/positions/valid", in.batch); err.failure()) return err;
  }
  const int64_t lay = layer.typed_data()[0];
  if (lay < 0 || lay >= geo.layers) return ffi::Error::Success();
  const int32_t* rw = rows.typed_data();
  const int32_t* pos = positions.typed_data();
  const int32_t* val = valid.typed_data();
  const int64_t T = in.queries;
  ForEachItem(in.batch * T, in.heads * in.head_dim, [&](int64_t item) {
    const int64_t b = item / T, t = item % T;
    if (t >= val[b]) return;
    const int64_t p = static_cast<int64_t>(pos[b]) + t;
    const int64_t last = static_cast<int64_t>(pos[b]) + val[b] - 1;
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
                               int32_t v_codec, int32_t window, float sm_scale) {
  auto qd = q.dimensions();
  if (qd.size() != 4) return ffi::Error::InvalidArgument("q must be (B, T, Hq, D), got " + DimsString(qd));
  const auto dt = q.element_type();
  if (dt != ffi::DataType::F32 && dt != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument("q must be float32 or bfloat16");
  }
  if (out->element_type() != dt || out->dimensions().size() != 4 ||
      !std::equal(qd.begin(), qd.end(), out->dimensions().begin())) {
    return ffi::Error::InvalidArgument("cyclic attention: the output must have q's shape and dtype");
  }
  if (window < 1) return ffi::Error::InvalidArgument("cyclic attention: window must be >= 1, got " + std::to_string(window));
  std::vector<ffi::AnyBuffer> ins;
  if (auto err = CollectArgs(planes_in, &ins); err.failure()) return err;
  PlaneSet planes;
  if (auto err = ParsePlanes(ins, k_codec, v_codec, static_cast<int>(qd[3]), &planes); err.failure()) return err;
  const RingGeometry geo = RingGeometry::Of(planes);
  if (qd[2] % geo.heads != 0) {
    return ffi::Error::InvalidArgument("cyclic attention: q heads (" + std::to_string(qd[2]) +
                                       ") must be a multiple of the KV heads (" + std::to_string(geo.heads) + ")");
  }
  for (auto* check : {&rows, &positions, &kv_lens}) {
    if (auto err = CheckBatchVector(*check, "rows/positions/kv_lens", qd[0]); err.failure()) return err;
  }
  const int64_t lay = Clamp64(layer.typed_data()[0], 0, geo.layers - 1);
  RingSource src(planes, geo, lay, window, qd[1], rows.typed_data(), positions.typed_data(), kv_lens.typed_data());
  AttentionShape shape{qd[0], qd[1], qd[2], geo.heads, qd[3], sm_scale, q.untyped_data(), dt == ffi::DataType::BF16,
                       out->untyped_data()};
  RunAttention(shape, src);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace ninfer_kv_ffi

// Aliases without commas: the handler-definition macro counts its arguments by commas.
using S32Scalar = ffi::Buffer<ffi::S32, 0>;
using S32Vector = ffi::Buffer<ffi::S32, 1>;
using S32Matrix = ffi::Buffer<ffi::S32, 2>;

extern "C" {
__attribute__((visibility("default"))) XLA_FFI_Error* NinferKvCyclicAppend(XLA_FFI_CallFrame* call_frame);
__attribute__((visibility("default"))) XLA_FFI_Error* NinferKvCyclicAttention(XLA_FFI_CallFrame* call_frame);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(NinferKvCyclicAppend, ninfer_kv_ffi::CyclicAppendImpl,
                              ffi::Ffi::Bind()
                                  .Arg<S32Vector>()  // rows
                                  .Arg<S32Vector>()  // positions
                                  .Arg<S32Vector>()  // valid
                                  .Arg<S32Scalar>()  // layer
                                  .Arg<ffi::AnyBuffer>()            // k
                                  .Arg<ffi::AnyBuffer>()            // v
                                  .RemainingArgs()                  // planes
                                  .RemainingRets()                  // planes (aliased)
                                  .Attr<int32_t>("k_codec")
                                  .Attr<int32_t>("v_codec"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(NinferKvCyclicAttention, ninfer_kv_ffi::CyclicAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()            // q
                                  .Arg<S32Vector>()  // rows
                                  .Arg<S32Vector>()  // positions
                                  .Arg<S32Vector>()  // kv_lens
                                  .Arg<S32Scalar>()  // layer
                                  .RemainingArgs()                  // planes
                                  .Ret<ffi::AnyBuffer>()            // out
                                  .Attr<int32_t>("k_codec")
                                  .Attr<int32_t>("v_codec")
                                  .Attr<int32_t>("window")
                                  .Attr<float>("sm_scale"));
