// Shared pieces of the append handlers: reading one (token, head) row of k / v and writing its
// codes into the planes.
#ifndef NINFER_KV_FFI_APPEND_COMMON_H_
#define NINFER_KV_FFI_APPEND_COMMON_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common.h"
#include "planes.h"
#include "quantize.h"
#include "xla/ffi/api/ffi.h"

NINFER_KV_NAMESPACE_BEGIN

// k and v inputs (B, T, H, D), float32 or bfloat16 (both the same dtype).
struct AppendInputs {
  const void* k;
  const void* v;
  bool bf16;
  int64_t batch, queries, heads, head_dim;
};

// Checks k / v shapes and dtypes; fills `out`.
xla::ffi::Error ParseAppendInputs(const xla::ffi::AnyBuffer& k, const xla::ffi::AnyBuffer& v, AppendInputs* out);

// Quantizes row (b, t, h) of k and v into plane token `token` of `planes`.
void WriteToken(const AppendInputs& in, const PlaneSet& planes, int64_t b, int64_t t, int64_t h, int64_t token);

// Runs fn(item) for item in [0, n): on the pool when the work (n * per_item elements) is large
// enough to pay for the hand-off, else inline; always with denormals flushed.
void ForEachItem(int64_t n, int64_t per_item, const std::function<void(int64_t)>& fn);

NINFER_KV_NAMESPACE_END

#endif  // NINFER_KV_FFI_APPEND_COMMON_H_
