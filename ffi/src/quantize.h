// Quantization of one (token, head) row with a closed codec (the append path).
#ifndef NINFER_KV_FFI_QUANTIZE_H_
#define NINFER_KV_FFI_QUANTIZE_H_

#include <cstdint>

#include "common.h"

namespace ninfer_kv_ffi {

// Quantizes x[0, d) (float32) with codec `c` and writes the codes to `code` (the data plane's
// X elements of this token-head) and, for codecs with scales, the scales to `scale`.
//
// Bit-identical to ninfer_kv.codecs on CPU, provided the caller runs under ScopedFlushDenormal:
// float32 arithmetic, every division (amax / c and x / s) a correctly rounded IEEE division
// (codecs.div_rn), zero scale -> codes 0.
void QuantizeRow(Codec c, const float* x, int d, uint8_t* code, uint8_t* scale);

// Writes x[0, d) (bfloat16 input) as BF16 codes: a plain copy of the bits.
void CopyBf16Row(const uint16_t* x, int d, uint8_t* code);

}  // namespace ninfer_kv_ffi

#endif  // NINFER_KV_FFI_QUANTIZE_H_
