// Quantization of one (token, head) row with a closed codec (the append path).
#ifndef NINFER_KV_FFI_QUANTIZE_H_
#define NINFER_KV_FFI_QUANTIZE_H_

#include <cstdint>

#include "common.h"

NINFER_KV_NAMESPACE_BEGIN

// Quantizes x[0, d) (float32) with codec `c` and writes the codes to `code` (the data plane's
// X elements of this token-head) and, for codecs with scales, the scales to `scale`.
//
// Bit-identical to ninfer_kv.ops.codecs on CPU, provided the caller runs under ScopedFlushDenormal:
// float32 arithmetic, every division (amax / c and x / s) a correctly rounded IEEE division
// (codecs.div_rn).  A group (INT8: 64 elements, FP8: the row, NVFP4: 16) holding a NaN stores
// the NaN scale (bf16 0x7FC0, NVFP4 byte 0x7F) and all codes 0; a scale that is 0 or not finite
// (INT8 / FP8 with an infinite element) stores all codes 0; BF16 codes store every NaN as 0x7FC0.
void QuantizeRow(Codec c, const float* x, int d, uint8_t* code, uint8_t* scale);

// The same for a bfloat16 row x[0, d): the codes of its float32 values (BF16 codes: a copy of the
// bits, NaNs as 0x7FC0).
void QuantizeRowBf16(Codec c, const uint16_t* x, int d, uint8_t* code, uint8_t* scale);

NINFER_KV_NAMESPACE_END

#endif  // NINFER_KV_FFI_QUANTIZE_H_
