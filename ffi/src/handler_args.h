// Operand decoding shared by the paged and cyclic handlers, and the operand/attribute tails of
// their FFI bindings.
//
// Every check returns an InvalidArgument error naming the operand and the expected value, and
// reads its operands only; nothing is written before all checks of a handler have passed.
#ifndef NINFER_KV_FFI_HANDLER_ARGS_H_
#define NINFER_KV_FFI_HANDLER_ARGS_H_

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "append_common.h"
#include "attention_driver.h"
#include "planes.h"
#include "xla/ffi/api/ffi.h"

NINFER_KV_NAMESPACE_BEGIN

// Aliases without commas: the handler-definition macro counts its arguments by commas.
using S32Scalar = xla::ffi::Buffer<xla::ffi::S32, 0>;
using S32Vector = xla::ffi::Buffer<xla::ffi::S32, 1>;
using S32Matrix = xla::ffi::Buffer<xla::ffi::S32, 2>;

// Checks that each of `vectors` has shape (batch,); `names` names them all in the error.
inline xla::ffi::Error CheckBatchVectors(std::initializer_list<const S32Vector*> vectors, const char* names,
                                         int64_t batch) {
  for (const S32Vector* buf : vectors) {
    if (buf->dimensions()[0] != batch) {
      return xla::ffi::Error::InvalidArgument(std::string(names) + " must have shape (B,) with B=" +
                                              std::to_string(batch) + ", got " + DimsString(buf->dimensions()));
    }
  }
  return xla::ffi::Error::Success();
}

// Append operands: checks k / v (into `in`), then the plane operands and their aliased results
// (equal counts), and parses the results into `planes` for head dim D of k.
inline xla::ffi::Error ParseAppendOperands(const char* op, const xla::ffi::AnyBuffer& k, const xla::ffi::AnyBuffer& v,
                                           const xla::ffi::RemainingArgs& planes_in,
                                           const xla::ffi::RemainingRets& planes_out, int32_t k_codec,
                                           int32_t v_codec, AppendInputs* in, PlaneSet* planes) {
  if (auto err = ParseAppendInputs(k, v, in); err.failure()) return err;
  std::vector<xla::ffi::AnyBuffer> outs, ins;
  if (auto err = CollectRets(planes_out, &outs); err.failure()) return err;
  if (auto err = CollectArgs(planes_in, &ins); err.failure()) return err;
  if (ins.size() != outs.size()) {
    return xla::ffi::Error::InvalidArgument(std::string(op) + ": plane operands and results differ in count");
  }
  return ParsePlanes(outs, k_codec, v_codec, static_cast<int>(in->head_dim), planes);
}

// Checks that k has as many heads as the planes, then that each of `vectors` is (B,).
inline xla::ffi::Error CheckAppendBatch(const char* op, const AppendInputs& in, int64_t plane_heads,
                                        std::initializer_list<const S32Vector*> vectors, const char* names) {
  if (plane_heads != in.heads) {
    return xla::ffi::Error::InvalidArgument(std::string(op) + ": k has " + std::to_string(in.heads) +
                                            " heads, the planes have " + std::to_string(plane_heads));
  }
  return CheckBatchVectors(vectors, names, in.batch);
}

// Ragged operands: the token tensor's leading dim is 1, its heads match the planes', each of
// `vectors` is (R,) and query_starts is (R + 1,).
inline xla::ffi::Error CheckRaggedRows(const char* op, int64_t lead, int64_t heads, int64_t plane_heads,
                                       const S32Vector& query_starts, std::initializer_list<const S32Vector*> vectors,
                                       const char* names) {
  if (lead != 1) {
    return xla::ffi::Error::InvalidArgument(std::string(op) + ": the ragged tokens must be (1, T, ...), got a leading " +
                                            "dimension of " + std::to_string(lead));
  }
  if (heads != plane_heads) {
    return xla::ffi::Error::InvalidArgument(std::string(op) + ": k has " + std::to_string(heads) +
                                            " heads, the planes have " + std::to_string(plane_heads));
  }
  const int64_t rows = query_starts.dimensions()[0] - 1;
  if (rows < 0) return xla::ffi::Error::InvalidArgument(std::string(op) + ": query_starts must have R + 1 >= 1 entries");
  return CheckBatchVectors(vectors, names, rows);
}

// Checks that q is (B, T, Hq, D) float32 or bfloat16 and that `out` has q's shape and dtype.
inline xla::ffi::Error CheckQueryAndOutput(const char* op, const xla::ffi::AnyBuffer& q,
                                           const xla::ffi::AnyBuffer& out) {
  auto qd = q.dimensions();
  if (qd.size() != 4) return xla::ffi::Error::InvalidArgument("q must be (B, T, Hq, D), got " + DimsString(qd));
  const auto dt = q.element_type();
  if (dt != xla::ffi::DataType::F32 && dt != xla::ffi::DataType::BF16) {
    return xla::ffi::Error::InvalidArgument("q must be float32 or bfloat16");
  }
  if (out.element_type() != dt || out.dimensions().size() != 4 ||
      !std::equal(qd.begin(), qd.end(), out.dimensions().begin())) {
    return xla::ffi::Error::InvalidArgument(std::string(op) + ": the output must have q's shape and dtype");
  }
  return xla::ffi::Error::Success();
}

// Attention planes: parses the plane operands into `planes` for q's head dim (q already checked).
inline xla::ffi::Error ParseAttentionPlanes(const xla::ffi::AnyBuffer& q, const xla::ffi::RemainingArgs& planes_in,
                                            int32_t k_codec, int32_t v_codec, PlaneSet* planes) {
  std::vector<xla::ffi::AnyBuffer> ins;
  if (auto err = CollectArgs(planes_in, &ins); err.failure()) return err;
  return ParsePlanes(ins, k_codec, v_codec, static_cast<int>(q.dimensions()[3]), planes);
}

// Checks that q's heads (Hq) are a multiple of the planes' KV heads (GQA groups), then that each
// of `vectors` is (B,) for q's batch B.
inline xla::ffi::Error CheckAttentionBatch(const char* op, const xla::ffi::AnyBuffer& q, int64_t kv_heads,
                                           std::initializer_list<const S32Vector*> vectors, const char* names) {
  const int64_t q_heads = q.dimensions()[2];
  if (q_heads % kv_heads != 0) {
    return xla::ffi::Error::InvalidArgument(std::string(op) + ": q heads (" + std::to_string(q_heads) +
                                            ") must be a multiple of the KV heads (" + std::to_string(kv_heads) + ")");
  }
  return CheckBatchVectors(vectors, names, q.dimensions()[0]);
}

// The attention problem of checked q / out over `kv_heads` KV heads.
inline AttentionShape QueryShape(const xla::ffi::AnyBuffer& q, xla::ffi::AnyBuffer& out, int64_t kv_heads,
                                 float sm_scale, int32_t no_splits) {
  auto qd = q.dimensions();
  return AttentionShape{qd[0],           qd[1],    qd[2], kv_heads, qd[3], sm_scale, q.untyped_data(),
                        q.element_type() == xla::ffi::DataType::BF16, out.untyped_data(), no_splits != 0};
}

// Binding tail of an append handler: k, v, the plane operands, the aliased plane results and
// the codec attributes (k_codec, v_codec), in that order.
template <class Binding>
auto BindAppendTail(Binding binding) {
  return std::move(binding)
      .template Arg<xla::ffi::AnyBuffer>()  // k
      .template Arg<xla::ffi::AnyBuffer>()  // v
      .RemainingArgs()                      // planes
      .RemainingRets()                      // planes (aliased)
      .template Attr<int32_t>("k_codec")
      .template Attr<int32_t>("v_codec");
}

// Binding tail of an attention handler: the plane operands, the output and the codec attributes
// (k_codec, v_codec), in that order.
template <class Binding>
auto BindAttentionTail(Binding binding) {
  return std::move(binding)
      .RemainingArgs()                      // planes
      .template Ret<xla::ffi::AnyBuffer>()  // out
      .template Attr<int32_t>("k_codec")
      .template Attr<int32_t>("v_codec");
}

NINFER_KV_NAMESPACE_END

#endif  // NINFER_KV_FFI_HANDLER_ARGS_H_
