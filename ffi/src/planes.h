// Decoding and checking of the plane operands of a handler (K planes then V planes, in the
// profile's schema order: k, [k_scale], v, [v_scale]).
#ifndef NINFER_KV_FFI_PLANES_H_
#define NINFER_KV_FFI_PLANES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "common.h"
#include "dequantize.h"
#include "xla/ffi/api/ffi.h"

NINFER_KV_NAMESPACE_BEGIN

// The typed planes of one pool (or cyclic state), all sharing their first four dimensions.
struct PlaneSet {
  Codec k_codec, v_codec;
  uint8_t* k_data = nullptr;
  uint8_t* k_scale = nullptr;
  uint8_t* v_data = nullptr;
  uint8_t* v_scale = nullptr;
  int64_t dims[4] = {0, 0, 0, 0};  // the leading four dims shared by every plane
  PlaneStrides token_bytes{0, 0, 0, 0};  // bytes per token of each plane
  int head_dim = 0;

  // K and V row sources of flat token index `token` (the index over the leading four dims).
  KVRunSource Run(int64_t token) const {
    KVRunSource r;
    r.k = {k_codec, k_data + token * token_bytes.k_data,
           k_scale ? k_scale + token * token_bytes.k_scale : nullptr, token_bytes.k_data, token_bytes.k_scale};
    r.v = {v_codec, v_data + token * token_bytes.v_data,
           v_scale ? v_scale + token * token_bytes.v_scale : nullptr, token_bytes.v_data, token_bytes.v_scale};
    return r;
  }
};

// Parses `planes` (K planes then V planes) for codecs (k_codec, v_codec) and head dim d.  Checks
// count, rank 5, dtypes, matching leading dims and each plane's extent; on failure returns an
// InvalidArgument error naming the plane and the expected value.
xla::ffi::Error ParsePlanes(const std::vector<xla::ffi::AnyBuffer>& planes, int32_t k_codec, int32_t v_codec, int d,
                            PlaneSet* out);

// Collects the remaining arguments (or results) of a call as AnyBuffers.
xla::ffi::Error CollectArgs(const xla::ffi::RemainingArgs& args, std::vector<xla::ffi::AnyBuffer>* out);
xla::ffi::Error CollectRets(const xla::ffi::RemainingRets& rets, std::vector<xla::ffi::AnyBuffer>* out);

// "Expected X, got Y" helpers for error messages.
std::string DimsString(xla::ffi::AnyBuffer::Dimensions dims);

NINFER_KV_NAMESPACE_END

#endif  // NINFER_KV_FFI_PLANES_H_
