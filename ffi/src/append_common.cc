#include "append_common.h"

#include <functional>

#include "thread_pool.h"

NINFER_KV_NAMESPACE_BEGIN
namespace ffi = xla::ffi;

ffi::Error ParseAppendInputs(const ffi::AnyBuffer& k, const ffi::AnyBuffer& v, AppendInputs* out) {
  auto kd = k.dimensions(), vd = v.dimensions();
  if (kd.size() != 4 || vd.size() != 4) {
    return ffi::Error::InvalidArgument("k and v must be (B, T, H, D); got " + DimsString(kd) + " and " +
                                       DimsString(vd));
  }
  for (int i = 0; i < 4; ++i) {
    if (kd[i] != vd[i]) {
      return ffi::Error::InvalidArgument("k and v shapes differ: " + DimsString(kd) + " vs " + DimsString(vd));
    }
  }
  const auto dt = k.element_type();
  if (dt != v.element_type() || (dt != ffi::DataType::F32 && dt != ffi::DataType::BF16)) {
    return ffi::Error::InvalidArgument("k and v must both be float32 or both bfloat16");
  }
  out->k = k.untyped_data();
  out->v = v.untyped_data();
  out->bf16 = dt == ffi::DataType::BF16;
  out->batch = kd[0];
  out->queries = kd[1];
  out->heads = kd[2];
  out->head_dim = kd[3];
  return ffi::Error::Success();
}

namespace {

void WriteOne(Codec c, const void* base, bool bf16, int64_t index, int d, uint8_t* code, uint8_t* scale) {
  if (bf16) {
    QuantizeRowBf16(c, static_cast<const uint16_t*>(base) + index * d, d, code, scale);
  } else {
    QuantizeRow(c, static_cast<const float*>(base) + index * d, d, code, scale);
  }
}

}  // namespace

void WriteToken(const AppendInputs& in, const PlaneSet& p, int64_t b, int64_t t, int64_t h, int64_t token) {
  const int d = static_cast<int>(in.head_dim);
  const int64_t index = (b * in.queries + t) * in.heads + h;
  const PlaneStrides& tb = p.token_bytes;
  WriteOne(p.k_codec, in.k, in.bf16, index, d, p.k_data + token * tb.k_data,
           p.k_scale ? p.k_scale + token * tb.k_scale : nullptr);
  WriteOne(p.v_codec, in.v, in.bf16, index, d, p.v_data + token * tb.v_data,
           p.v_scale ? p.v_scale + token * tb.v_scale : nullptr);
}

void ForEachItem(int64_t n, int64_t per_item, const std::function<void(int64_t)>& fn) {
  constexpr int64_t kParallelElements = 1 << 15;
  if (n <= 1 || n * per_item < kParallelElements) {
    ScopedFlushDenormal flush;
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  ParallelFor(n, [&](int64_t i) {
    ScopedFlushDenormal flush;
    fn(i);
  });
}

NINFER_KV_NAMESPACE_END
