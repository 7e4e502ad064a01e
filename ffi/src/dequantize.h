// Dequantization of a run of tokens of one (layer, page, head) into a float32 tile.
#ifndef NINFER_KV_FFI_DEQUANTIZE_H_
#define NINFER_KV_FFI_DEQUANTIZE_H_

#include <cstdint>

#include "common.h"

NINFER_KV_NAMESPACE_BEGIN

// Source of one tensor (K or V) of a token run: the data and scale rows of its first token and
// the per-token byte strides.
struct RowSource {
  Codec codec;
  const uint8_t* data;
  const uint8_t* scale;  // null for BF16
  int64_t data_stride;   // bytes per token
  int64_t scale_stride;
};

// The K and V sources of one run of consecutive tokens of one head.
struct KVRunSource {
  RowSource k;
  RowSource v;
};

// Writes out[r * ld + i] = dequantized element i of token r, for r in [0, n) and i in [0, d),
// and zeros in columns [d, ld) (ld is a multiple of kVL >= d).  The values equal
// float(code) * scale in float32, exactly as ninfer_kv.ops.codecs.decode_kv.  Only the n tokens named
// are read.  When `prefetch` is non-null, the same byte range of the next run is prefetched.
void DequantizeRows(const RowSource& src, int n, int d, int ld, float* out, const RowSource* prefetch);

NINFER_KV_NAMESPACE_END

#endif  // NINFER_KV_FFI_DEQUANTIZE_H_
