#include "dequantize.h"

#include "row_decoders.h"

NINFER_KV_NAMESPACE_BEGIN

void DequantizeRows(const RowSource& src, int n, int d, int ld, float* out, const RowSource* prefetch) {
  VisitCodec(src.codec, [&](auto codec) {
    Decoder<decltype(codec)::value>::Dequantize(src, n, d, ld, out, prefetch);
  });
}

PreparedRows PrepareRows(const RowSource& src, int cnt, int head_dim, AlignedFloats* scales,
                         std::vector<uint8_t>* nan) {
  PreparedRows out;
  out.data = src.data;
  out.stride = src.data_stride;
  VisitCodec(src.codec, [&](auto codec) {
    Decoder<decltype(codec)::value>::Prepare(src, cnt, head_dim, scales, nan, &out);
  });
  return out;
}

NINFER_KV_NAMESPACE_END
