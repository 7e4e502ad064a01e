#include "dequantize.h"

#include <cstring>

#include "row_decoders.h"
#include "scalar_codec.h"
#include "simd.h"

NINFER_KV_NAMESPACE_BEGIN
namespace {

inline void PrefetchBytes(const uint8_t* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

// Prefetches row r of a scaled source (its data bytes and its scale), if there is one.
inline void PrefetchScaledRow(const RowSource* pf, int r) {
  if (pf == nullptr) return;
  PrefetchBytes(pf->data + r * pf->data_stride, pf->data_stride);
  __builtin_prefetch(pf->scale + r * pf->scale_stride, 0, 3);
}

inline void ZeroPad(float* row, int d, int ld) {
  for (int i = d; i < ld; ++i) row[i] = 0.0f;
}

void Bf16Rows(const RowSource& s, int n, int d, int ld, float* out, const RowSource* pf) {
  for (int r = 0; r < n; ++r) {
    const uint8_t* src = s.data + r * s.data_stride;
    if (pf) PrefetchBytes(pf->data + r * pf->data_stride, pf->data_stride);
    float* row = out + static_cast<int64_t>(r) * ld;
    int c = 0;
    for (; c + kVL <= d; c += kVL) {
      Store(row + c, AsFloat(LoadU16AsU32(src + 2 * c) << 16));
    }
    for (; c < d; ++c) {
      uint16_t b;
      std::memcpy(&b, src + 2 * c, 2);
      row[c] = Bf16ToFloat(b);
    }
    ZeroPad(row, d, ld);
  }
}

void Int8Rows(const RowSource& s, int n, int d, int ld, float* out, const RowSource* pf) {
  for (int r = 0; r < n; ++r) {
    const uint8_t* src = s.data + r * s.data_stride;
    const uint8_t* sc = s.scale + r * s.scale_stride;
    PrefetchScaledRow(pf, r);
    float* row = out + static_cast<int64_t>(r) * ld;
    for (int g = 0; g < d / 64; ++g) {
      uint16_t sb;
      std::memcpy(&sb, sc + 2 * g, 2);
      const VFloat scale = Splat(Bf16ToFloat(sb));
      for (int c = g * 64; c < g * 64 + 64; c += kVL) {
        Store(row + c, ToFloat(LoadI8AsI32(src + c)) * scale);
      }
    }
    ZeroPad(row, d, ld);
  }
}

void Fp8Rows(const RowSource& s, int n, int d, int ld, float* out, const RowSource* pf) {
  for (int r = 0; r < n; ++r) {
    const uint8_t* src = s.data + r * s.data_stride;
    PrefetchScaledRow(pf, r);
    uint16_t sb;
    std::memcpy(&sb, s.scale + r * s.scale_stride, 2);
    const float sf = Bf16ToFloat(sb);
    const VFloat scale = Splat(sf);
    float* row = out + static_cast<int64_t>(r) * ld;
    int c = 0;
    for (; c + kVL <= d; c += kVL) {
      Store(row + c, E4m3fnLanes(LoadU8AsU32(src + c)) * scale);
    }
    for (; c < d; ++c) row[c] = E4m3fnToFloat(src[c]) * sf;
    ZeroPad(row, d, ld);
  }
}

void Nvfp4Rows(const RowSource& s, int n, int d, int ld, float* out, const RowSource* pf) {
  const int nbytes = d / 2;
  for (int r = 0; r < n; ++r) {
    const uint8_t* src = s.data + r * s.data_stride;
    const uint8_t* sc = s.scale + r * s.scale_stride;
    PrefetchScaledRow(pf, r);
    float* row = out + static_cast<int64_t>(r) * ld;
    int byte = 0;
    // kVL bytes -> 2 * kVL elements; each scale group is 16 elements (8 bytes).
    for (; byte + kVL <= nbytes; byte += kVL) {
      const VUInt b = LoadU8AsU32(src + byte);
      VFloat lo = E2m1Lanes(b & 15u);
      VFloat hi = E2m1Lanes(b >> 4);
      const int e0 = 2 * byte;
#if defined(__AVX512F__)
      VFloat a = __builtin_shufflevector(lo, hi, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
      VFloat z = __builtin_shufflevector(lo, hi, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
#else
      VFloat a = __builtin_shufflevector(lo, hi, 0, 8, 1, 9, 2, 10, 3, 11);
      VFloat z = __builtin_shufflevector(lo, hi, 4, 12, 5, 13, 6, 14, 7, 15);
#endif
      Store(row + e0, a * Splat(E4m3fnToFloat(sc[e0 / 16])));
      Store(row + e0 + kVL, z * Splat(E4m3fnToFloat(sc[(e0 + kVL) / 16])));
    }
    for (; byte < nbytes; ++byte) {
      const float sf = E4m3fnToFloat(sc[(2 * byte) / 16]);
      row[2 * byte] = E2m1ToFloat(src[byte] & 15u) * sf;
      row[2 * byte + 1] = E2m1ToFloat(src[byte] >> 4) * sf;
    }
    ZeroPad(row, d, ld);
  }
}

}  // namespace

void DequantizeRows(const RowSource& src, int n, int d, int ld, float* out, const RowSource* prefetch) {
  switch (src.codec) {
    case Codec::kBF16: Bf16Rows(src, n, d, ld, out, prefetch); return;
    case Codec::kInt8G64: Int8Rows(src, n, d, ld, out, prefetch); return;
    case Codec::kFp8Row: Fp8Rows(src, n, d, ld, out, prefetch); return;
    case Codec::kNvfp4G16: Nvfp4Rows(src, n, d, ld, out, prefetch); return;
  }
}

NINFER_KV_NAMESPACE_END

NINFER_KV_NAMESPACE_BEGIN

PreparedRows PrepareRows(const RowSource& src, int cnt, int head_dim, AlignedFloats* scales, std::vector<uint8_t>* nan) {
  PreparedRows out;
  out.data = src.data;
  out.stride = src.data_stride;
  switch (src.codec) {
    case Codec::kBF16:
      return out;
    case Codec::kInt8G64:
    case Codec::kFp8Row: {  // bfloat16 scales; the scale rows of consecutive tokens are contiguous
      const int groups = src.codec == Codec::kFp8Row ? 1 : head_dim / 64;
      const int total = cnt * groups;
      float* f = scales->Get(static_cast<size_t>(total) + kVL);
      int i = 0;
      for (; i + kVL <= total; i += kVL) Store(f + i, AsFloat(LoadU16AsU32(src.scale + 2 * i) << 16));
      for (; i < total; ++i) {
        uint16_t b;
        std::memcpy(&b, src.scale + 2 * i, 2);
        f[i] = Bf16ToFloat(b);
      }
      out.scales = f;
      out.groups = groups;
      if (src.codec == Codec::kFp8Row) {
        // One scan over the run's codes (tokens are contiguous when the stride is the head dim);
        // per-token flags only for a run that holds a NaN code at all.
        const bool contiguous = src.data_stride == head_dim;
        bool any = !contiguous || HasE4m3Nan(src.data, cnt * head_dim);
        if (any) {
          nan->resize(static_cast<size_t>(cnt));
          any = false;
          for (int j = 0; j < cnt; ++j) {
            (*nan)[j] = HasE4m3Nan(src.data + j * src.data_stride, head_dim) ? 1 : 0;
            any |= (*nan)[j] != 0;
          }
        }
        out.nan = any ? nan->data() : nullptr;
      }
      return out;
    }
    case Codec::kNvfp4G16: {  // e4m3fn scale bytes
      const int groups = head_dim / 16;
      const int total = cnt * groups;
      float* f = scales->Get(static_cast<size_t>(total) + kVL);
      int i = 0;
      for (; i + kVL <= total; i += kVL) Store(f + i, E4m3fnLanes(LoadU8AsU32(src.scale + i)));
      for (; i < total; ++i) f[i] = E4m3fnToFloat(src.scale[i]);
      out.scales = f;
      out.groups = groups;
      return out;
    }
  }
  return out;
}

NINFER_KV_NAMESPACE_END
