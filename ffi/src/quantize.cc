#include "quantize.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "scalar_codec.h"
#include "simd.h"
#include "vector_codec.h"

NINFER_KV_NAMESPACE_BEGIN
namespace {

// The bfloat16 inputs x[0, d) widened to float32 (exact), in a buffer of the calling thread.
const float* WidenBf16(const uint16_t* x, int d) {
  static thread_local std::vector<float> row;
  if (row.size() < static_cast<size_t>(d)) row.resize(d);
  for (int i = 0; i < d; ++i) row[i] = Bf16ToFloat(x[i]);
  return row.data();
}

// Defaults of every encoder (CRTP): bfloat16 inputs are widened to float32 and encoded as such.
template <class E>
struct EncoderOps {
  static void EncodeBf16(const uint16_t* x, int d, uint8_t* code, uint8_t* scale) {
    E::Encode(WidenBf16(x, d), d, code, scale);
  }
};

// Encoder<C>::Encode(x, d, code, scale) writes the codes (and scales) of one token's float32
// values, as QuantizeRow documents; Encoder<C>::EncodeBf16 does the same for bfloat16 values.  One
// specialization per row of NINFER_KV_CODECS.
template <Codec C>
struct Encoder;

template <>
struct Encoder<Codec::kBF16> : EncoderOps<Encoder<Codec::kBF16>> {
  static void Encode(const float* x, int d, uint8_t* code, uint8_t*) { FloatsToBf16(x, d, code); }
  // bfloat16 inputs are their own codes: a copy of the bits, NaNs as 0x7FC0.
  static void EncodeBf16(const uint16_t* x, int d, uint8_t* code, uint8_t*) {
    for (int i = 0; i < d; ++i) {
      const uint16_t b = (x[i] & 0x7FFFu) > 0x7F80u ? kBf16CanonicalNan : x[i];
      std::memcpy(code + 2 * i, &b, 2);
    }
  }
};

template <>
struct Encoder<Codec::kInt8G64> : EncoderOps<Encoder<Codec::kInt8G64>> {
  static void Encode(const float* x, int d, uint8_t* code, uint8_t* scale) {
    for (int g = 0; g < d / 64; ++g) {
      const float* xg = x + g * 64;
      const uint16_t sb = FloatToBf16(AbsMaxV(xg, 64) / 127.0f);
      std::memcpy(scale + 2 * g, &sb, 2);
      const float s = Bf16ToFloat(sb);
      uint8_t* out = code + g * 64;
      if (s == 0.0f || !IsFinite(s)) {  // zero, NaN (a NaN in the group) or inf scale: codes 0
        std::memset(out, 0, 64);
        continue;
      }
      const VFloat sv = Splat(s);
      for (int i = 0; i < 64; i += kVL) {  // 64 is a multiple of kVL
        VFloat q = RoundHalfEvenV(ClipV(Load(xg + i) / sv, -127.0f, 127.0f));
        StoreLanesU8(out + i, __builtin_convertvector(__builtin_convertvector(q, VInt), VUInt) & 0xFFu);
      }
    }
  }
};

template <>
struct Encoder<Codec::kFp8Row> : EncoderOps<Encoder<Codec::kFp8Row>> {
  static void Encode(const float* x, int d, uint8_t* code, uint8_t* scale) {
    const uint16_t sb = FloatToBf16(AbsMaxV(x, d) / 448.0f);
    std::memcpy(scale, &sb, 2);
    const float s = Bf16ToFloat(sb);
    if (s == 0.0f || !IsFinite(s)) {  // zero, NaN (a NaN in the row) or inf scale: codes 0
      std::memset(code, 0, static_cast<size_t>(d));
      return;
    }
    const VFloat sv = Splat(s);
    int i = 0;
    for (; i + kVL <= d; i += kVL) StoreLanesU8(code + i, FloatToE4m3fnV(ClipV(Load(x + i) / sv, -448.0f, 448.0f)));
    for (; i < d; ++i) code[i] = FloatToE4m3fn(ClipNan(x[i] / s, -448.0f, 448.0f));
  }
};

template <>
struct Encoder<Codec::kNvfp4G16> : EncoderOps<Encoder<Codec::kNvfp4G16>> {
  static void Encode(const float* x, int d, uint8_t* code, uint8_t* scale) {
    for (int g = 0; g < d / 16; ++g) {
      const float* xg = x + g * 16;
      float t = AbsMaxV(xg, 16) / 6.0f;
      t = (t != t) ? t : (t < 448.0f ? t : 448.0f);  // jnp.minimum propagates NaN
      const uint8_t sb = FloatToE4m3fn(t);
      scale[g] = sb;
      const float s = E4m3fnToFloat(sb);
      if (s == 0.0f || !IsFinite(s)) {  // zero or NaN scale (0x7F: a NaN in the group): codes 0
        std::memset(code + g * 8, 0, 8);
        continue;
      }
      PackGroup(xg, s, code + g * 8);
    }
  }

 private:
  // Codes of one group of 16 elements with scale s != 0, packed two per byte (element 2j low).
  static void PackGroup(const float* xg, float s, uint8_t* out) {
#if defined(__AVX512F__)
    const VUInt c = FloatToE2m1V(ClipV(Load(xg) / Splat(s), -6.0f, 6.0f));
    const VUInt lo = __builtin_shufflevector(c, c, 0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14);
    const VUInt hi = __builtin_shufflevector(c, c, 1, 3, 5, 7, 9, 11, 13, 15, 1, 3, 5, 7, 9, 11, 13, 15);
    uint8_t bytes[16];
    StoreLanesU8(bytes, (lo & 0xFu) | ((hi & 0xFu) << 4));
    std::memcpy(out, bytes, 8);
#else
    for (int j = 0; j < 8; ++j) {
      const uint8_t c0 = FloatToE2m1(ClipNan(xg[2 * j] / s, -6.0f, 6.0f));
      const uint8_t c1 = FloatToE2m1(ClipNan(xg[2 * j + 1] / s, -6.0f, 6.0f));
      out[j] = static_cast<uint8_t>((c0 & 0xFu) | ((c1 & 0xFu) << 4));
    }
#endif
  }
};

}  // namespace

void QuantizeRow(Codec c, const float* x, int d, uint8_t* code, uint8_t* scale) {
  VisitCodec(c, [&](auto codec) { Encoder<decltype(codec)::value>::Encode(x, d, code, scale); });
}

void QuantizeRowBf16(Codec c, const uint16_t* x, int d, uint8_t* code, uint8_t* scale) {
  VisitCodec(c, [&](auto codec) { Encoder<decltype(codec)::value>::EncodeBf16(x, d, code, scale); });
}

NINFER_KV_NAMESPACE_END
