// Standalone check of one instruction-set level of the kernels, without XLA: built together with
// the kernel sources that need no XLA headers (attention_core.cc, dequantize.cc, quantize.cc)
// under one level's flags and NINFER_KV_ISA_ID.  tests/ffi/test_neon_emulated.py builds it for
// AArch64 (the neon level, run under qemu-aarch64) and natively (the portable reference path).
//
// Checks, against the scalar codec (scalar_codec.h) and a double-precision attention:
//  * the intrinsic hot spots themselves (widening loads, narrowing stores, e2m1 / e4m3fn
//    decoders over every byte value, the e4m3fn NaN scan) lane for lane;
//  * QuantizeRow codes and scales bit for bit, on random rows and on NaN / inf / subnormal /
//    zero / rounding-tie inputs;
//  * DequantizeRows and the fused row decoders (Chunk, Chunk2, KeyChunk) bit for bit;
//  * AttentionAccumulator outputs within 1e-5 of sum_j p_j |v_j| (the condition scale of the
//    weighted average) per element.
// Prints PASS or FAIL (with the first mismatches) and exits nonzero on failure.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attention_core.h"
#include "common.h"
#include "dequantize.h"
#include "quantize.h"
#include "row_decoders.h"
#include "scalar_codec.h"
#include "simd.h"
#include "vector_codec.h"

using namespace ninfer_kv_ffi;

namespace {

// The codecs this check has scalar references for (QuantizeRef, QuantizeInputs, Tokens::Value,
// RawTokens); the kernels themselves are reached through their codec table.
constexpr Codec kCodecs[] = {Codec::kBF16, Codec::kInt8G64, Codec::kFp8Row, Codec::kNvfp4G16};

int g_failures = 0;
int g_reported = 0;

void Fail(const std::string& what) {
  ++g_failures;
  if (++g_reported <= 20) std::printf("  MISMATCH %s\n", what.c_str());
}

std::string Hex(uint32_t u) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", u);
  return buf;
}

std::string Sci(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2g", x);
  return buf;
}

// Float equality for bit-exact paths: equal bits, or both NaN (a NaN's payload is not part of
// the codecs' contract).
bool SameFloat(float a, float b) { return (a != a && b != b) || FloatBits(a) == FloatBits(b); }

void ExpectFloat(const char* what, int idx, float got, float want) {
  if (!SameFloat(got, want)) {
    Fail(std::string(what) + " [" + std::to_string(idx) + "]: got " + Hex(FloatBits(got)) + " want " +
         Hex(FloatBits(want)));
  }
}

void Report(const char* name, int before, long count) {
  std::printf("%s %s (%ld values)\n", g_failures == before ? "ok  " : "FAIL", name, count);
}

const char* CodecName(Codec c) { return InfoOf(c).name; }

const char* SimdPath() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#elif defined(NINFER_KV_NEON)
  return "neon";
#else
  return "portable";
#endif
}

// ---- the intrinsic hot spots ----------------------------------------------------------------

void CheckPrimitives(std::mt19937& rng) {
  int before = g_failures;
  long count = 0;
  std::vector<uint8_t> bytes(4096 + 64);
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  for (int off = 0; off < 4096; off += 3) {  // odd offsets: no alignment assumed
    const uint8_t* p = bytes.data() + off;
    const VUInt u8 = LoadU8AsU32(p);
    const VInt i8 = LoadI8AsI32(p);
    const VUInt u16 = LoadU16AsU32(p);
    for (int i = 0; i < kVL; ++i, ++count) {
      uint16_t w;
      std::memcpy(&w, p + 2 * i, 2);
      if (u8[i] != p[i]) Fail("LoadU8AsU32 lane " + std::to_string(i));
      if (i8[i] != static_cast<int8_t>(p[i])) Fail("LoadI8AsI32 lane " + std::to_string(i));
      if (u16[i] != w) Fail("LoadU16AsU32 lane " + std::to_string(i));
    }
    VUInt v8, v16;
    for (int i = 0; i < kVL; ++i) {
      v8[i] = p[i];
      v16[i] = u16[i];
    }
    uint8_t out8[kVL + 1], out16[2 * kVL + 1];
    out8[kVL] = out16[2 * kVL] = 0xA5;  // guard bytes
    StoreLanesU8(out8, v8);
    StoreLanesU16(out16, v16);
    if (std::memcmp(out8, p, kVL) != 0 || out8[kVL] != 0xA5) Fail("StoreLanesU8");
    if (std::memcmp(out16, p, 2 * kVL) != 0 || out16[2 * kVL] != 0xA5) Fail("StoreLanesU16");
  }
  Report("widening loads, narrowing stores", before, count);

  // e2m1: every byte value in every position of a kVL / 2 byte group.
  before = g_failures;
  count = 0;
  for (int b = 0; b < 256; ++b) {
    for (int pos = 0; pos < 8; ++pos) {
      uint8_t p[16];
      for (int i = 0; i < 16; ++i) p[i] = static_cast<uint8_t>(b + 37 * i + 11 * pos);
      p[pos] = static_cast<uint8_t>(b);
      const VFloat v = E2m1Packed(p);
      for (int e = 0; e < kVL; ++e, ++count) ExpectFloat("E2m1Packed", e, v[e], E2m1ToFloat((p[e / 2] >> (4 * (e & 1))) & 15u));
#if defined(NINFER_KV_PAIR_DECODERS)
      VFloat pair[2];
      E2m1Packed16(p, pair);
      for (int e = 0; e < 2 * kVL; ++e, ++count) {
        ExpectFloat("E2m1Packed16", e, pair[e / kVL][e % kVL], E2m1ToFloat((p[e / 2] >> (4 * (e & 1))) & 15u));
      }
#endif
    }
  }
  Report("e2m1 decoders", before, count);

  // e4m3fn scaled by 2^-8: every code in every lane.  NaN codes give a finite stand-in on the
  // levels with the float16 trick and NaN on the portable path; only their sign is compared.
  before = g_failures;
  count = 0;
  for (int b = 0; b < 256; ++b) {
    for (int lane = 0; lane < 16; ++lane) {
      uint8_t p[32];  // E4m3fnScaledLanes(p + kVL) reads kVL bytes
      for (int i = 0; i < 32; ++i) p[i] = static_cast<uint8_t>(b * 7 + 29 * i + lane);
      p[lane] = static_cast<uint8_t>(b);
      VFloat v[2];
      v[0] = E4m3fnScaledLanes(p);
      v[1] = E4m3fnScaledLanes(p + kVL);
#if defined(NINFER_KV_PAIR_DECODERS)
      VFloat pair[2];
      E4m3fnScaled16(p, pair);
#endif
      for (int e = 0; e < 2 * kVL && e < 16; ++e, ++count) {
        const float want = E4m3fnToFloat(p[e]) * 0.00390625f;
        const float got = v[e / kVL][e % kVL];
        if ((p[e] & 0x7Fu) == 0x7Fu) {
          if ((FloatBits(got) >> 31) != (p[e] >> 7u)) Fail("E4m3fnScaledLanes NaN-code sign");
          continue;
        }
        ExpectFloat("E4m3fnScaledLanes", e, got, want);
#if defined(NINFER_KV_PAIR_DECODERS)
        ExpectFloat("E4m3fnScaled16", e, pair[e / kVL][e % kVL], want);
#endif
      }
    }
  }
  Report("e4m3fn decoders", before, count);

  // NaN scan: every length up to 300, no NaN code or one at each position (either sign).
  before = g_failures;
  count = 0;
  std::vector<uint8_t> row(320);
  for (int n = 0; n <= 300; ++n) {
    for (auto& b : row) {
      b = static_cast<uint8_t>(rng());
      if ((b & 0x7Fu) == 0x7Fu) b ^= 1u;
    }
    row[n] = 0x7F;  // a NaN code just past the end must not count
    ++count;
    if (HasE4m3Nan(row.data(), n)) Fail("HasE4m3Nan false positive, n=" + std::to_string(n));
    for (int pos = 0; pos < n; ++pos, ++count) {
      const uint8_t saved = row[pos];
      row[pos] = (pos & 1) ? 0xFF : 0x7F;
      if (!HasE4m3Nan(row.data(), n)) Fail("HasE4m3Nan missed n=" + std::to_string(n) + " pos=" + std::to_string(pos));
      row[pos] = saved;
    }
  }
  Report("e4m3fn NaN scan", before, count);
}

// ---- quantization ---------------------------------------------------------------------------

float AbsMaxRef(const float* x, int n) {
  float amax = 0.0f;
  bool nan = false;
  for (int i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    nan |= a != a;
    amax = a > amax ? a : amax;
  }
  return nan ? BitsFloat(0x7FC00000u) : amax;
}

// The codecs as quantize.h specifies them, one element at a time with scalar_codec.h.
void QuantizeRef(Codec c, const float* x, int d, uint8_t* code, uint8_t* scale) {
  switch (c) {
    case Codec::kBF16:
      for (int i = 0; i < d; ++i) {
        const uint16_t b = FloatToBf16(x[i]);
        std::memcpy(code + 2 * i, &b, 2);
      }
      return;
    case Codec::kInt8G64:
      for (int g = 0; g < d / 64; ++g) {
        const uint16_t sb = FloatToBf16(AbsMaxRef(x + 64 * g, 64) / 127.0f);
        std::memcpy(scale + 2 * g, &sb, 2);
        const float s = Bf16ToFloat(sb);
        for (int i = 64 * g; i < 64 * g + 64; ++i) {
          code[i] = (s == 0.0f || !IsFinite(s))
                        ? 0
                        : static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(ClipNan(x[i] / s, -127.0f, 127.0f))));
        }
      }
      return;
    case Codec::kFp8Row: {
      const uint16_t sb = FloatToBf16(AbsMaxRef(x, d) / 448.0f);
      std::memcpy(scale, &sb, 2);
      const float s = Bf16ToFloat(sb);
      for (int i = 0; i < d; ++i) code[i] = (s == 0.0f || !IsFinite(s)) ? 0 : FloatToE4m3fn(ClipNan(x[i] / s, -448.0f, 448.0f));
      return;
    }
    case Codec::kNvfp4G16:
      for (int g = 0; g < d / 16; ++g) {
        float t = AbsMaxRef(x + 16 * g, 16) / 6.0f;
        t = (t != t) ? t : std::fmin(t, 448.0f);
        scale[g] = FloatToE4m3fn(t);
        const float s = E4m3fnToFloat(scale[g]);
        for (int j = 0; j < 8; ++j) {
          uint8_t b = 0;
          if (s != 0.0f && IsFinite(s)) {
            const uint8_t c0 = FloatToE2m1(ClipNan(x[16 * g + 2 * j] / s, -6.0f, 6.0f));
            const uint8_t c1 = FloatToE2m1(ClipNan(x[16 * g + 2 * j + 1] / s, -6.0f, 6.0f));
            b = static_cast<uint8_t>((c0 & 15u) | ((c1 & 15u) << 4));
          }
          code[8 * g + j] = b;
        }
      }
      return;
  }
}

// Random float with a random binary magnitude in [2^-lo, 2^hi).
float RandomFloat(std::mt19937& rng, int lo, int hi) {
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> ex(-lo, hi);
  return std::ldexp(normal(rng), ex(rng));
}

// Rows that reach the codecs' edge cases: NaN, inf, float32 subnormals, zeros, huge values, and
// rows whose amax makes the scale exactly 1 so that the other elements hit rounding ties.
std::vector<std::vector<float>> QuantizeInputs(Codec c, int d, std::mt19937& rng) {
  std::vector<std::vector<float>> rows;
  const float nan = BitsFloat(0x7FC00000u), nnan = BitsFloat(0xFFC00001u), inf = INFINITY;
  const float sub = BitsFloat(0x00000001u), sub2 = BitsFloat(0x807FFFFFu);
  for (int r = 0; r < 24; ++r) {  // plain random rows at several magnitudes
    std::vector<float> x(d);
    for (auto& v : x) v = RandomFloat(rng, 2 + r, r < 12 ? 2 : 40);
    rows.push_back(x);
  }
  const float specials[] = {nan, nnan, inf, -inf, sub, sub2, 0.0f, -0.0f, 3.0e38f, -3.4028235e38f, 1e-30f, 1e-38f};
  for (float sp : specials) {
    for (int pos : {0, d / 2 + 1, d - 1}) {
      std::vector<float> x(d);
      for (auto& v : x) v = RandomFloat(rng, 4, 4);
      x[pos] = sp;
      rows.push_back(x);
    }
  }
  rows.push_back(std::vector<float>(d, 0.0f));
  rows.push_back(std::vector<float>(d, -0.0f));
  {
    std::vector<float> x(d);
    for (int i = 0; i < d; ++i) x[i] = (i & 1) ? sub : sub2;  // all subnormal (DAZ: amax 0)
    rows.push_back(x);
  }
  {
    std::vector<float> x(d);
    for (int i = 0; i < d; ++i) x[i] = (i % 5 == 0) ? 1e30f : RandomFloat(rng, 30, 0);  // codes underflow
    rows.push_back(x);
  }
  // Ties: the group amax makes the scale exactly 1 (127 / 448 / 6 are exact bf16 / e4m3fn).
  const int group = c == Codec::kInt8G64 ? 64 : c == Codec::kNvfp4G16 ? 16 : d;
  const float top = c == Codec::kInt8G64 ? 127.0f : c == Codec::kNvfp4G16 ? 6.0f : 448.0f;
  std::vector<float> ties;
  if (c == Codec::kBF16) {  // float32 halfway between bf16 neighbours, and the overflow edge
    for (uint32_t u : {0x3F808000u, 0x3F818000u, 0xBF808000u, 0x00008000u, 0x00018000u, 0x7F7F8000u, 0x7F7F7FFFu,
                       0xFF7F8000u, 0x7F800001u, 0x7FFFFFFFu}) {
      ties.push_back(BitsFloat(u));
    }
  } else if (c == Codec::kInt8G64) {
    for (int k = -127; k < 127; ++k) ties.push_back(k + 0.5f);
  } else if (c == Codec::kNvfp4G16) {
    for (float t : {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 0.2499f, 5.001f, 7.0f}) {
      ties.push_back(t);
      ties.push_back(-t);
    }
  } else {
    for (int k = 0; k < 16; ++k) ties.push_back(std::ldexp(2.0f * k + 1.0f, -10));  // e4m3fn subnormal ties
    for (int e = -6; e <= 8; ++e) {
      for (int m = 0; m < 8; ++m) ties.push_back(std::ldexp(1.0f + (2.0f * m + 1.0f) / 16.0f, e));  // normal ties
    }
    for (float t : {464.0f, 449.0f, 447.9f, 1e-3f, 1.9e-3f, 2.0e-3f, 1e-6f}) ties.push_back(t);
  }
  for (size_t start = 0; start < ties.size(); start += static_cast<size_t>(d)) {
    std::vector<float> x(d);
    for (int i = 0; i < d; ++i) {
      const size_t k = start + static_cast<size_t>(i);
      x[i] = i % group == 0 ? ((i / group) & 1 ? -top : top) : (k < ties.size() ? ties[k] : -ties[k % ties.size()]);
    }
    rows.push_back(x);
  }
  return rows;
}

void CheckQuantize(std::mt19937& rng) {
  for (Codec c : kCodecs) {
    const int before = g_failures;
    long count = 0;
    std::vector<int> dims = {64, 128, 192};
    if (c == Codec::kBF16 || c == Codec::kFp8Row) dims.insert(dims.end(), {1, 7, 36, 100});
    if (c == Codec::kNvfp4G16) dims.insert(dims.end(), {16, 48});
    for (int d : dims) {
      const CodecPlanes pl = PlanesOf(c, d);
      const size_t nb = static_cast<size_t>(pl.data_extent) * pl.data_itemsize;
      const size_t ns = static_cast<size_t>(pl.scale_extent) * pl.scale_itemsize;
      for (const auto& x : QuantizeInputs(c, d, rng)) {
        std::vector<uint8_t> code(nb + 8, 0xEE), scale(ns + 8, 0xEE), rcode(nb + 8, 0xEE), rscale(ns + 8, 0xEE);
        QuantizeRow(c, x.data(), d, code.data(), scale.data());
        QuantizeRef(c, x.data(), d, rcode.data(), rscale.data());
        count += static_cast<long>(nb + ns);
        for (size_t i = 0; i < nb + 8; ++i) {
          if (code[i] != rcode[i]) {
            Fail(std::string(CodecName(c)) + " d=" + std::to_string(d) + " code byte " + std::to_string(i) + ": got " +
                 std::to_string(code[i]) + " want " + std::to_string(rcode[i]));
            break;
          }
        }
        for (size_t i = 0; i < ns + 8; ++i) {
          if (scale[i] != rscale[i]) {
            Fail(std::string(CodecName(c)) + " d=" + std::to_string(d) + " scale byte " + std::to_string(i));
            break;
          }
        }
      }
    }
    Report((std::string("quantize ") + CodecName(c)).c_str(), before, count);
  }
}

// ---- decoding -------------------------------------------------------------------------------

// A run of tokens of one tensor: codes and scales with per-token strides (padded, so that a
// row read past its end would see other bytes).
struct Tokens {
  Codec codec;
  int d = 0, n = 0;
  int64_t data_stride = 0, scale_stride = 0;
  std::vector<uint8_t> data, scale;
  RowSource Source() const {
    return RowSource{codec, data.data(), scale.empty() ? nullptr : scale.data(), data_stride, scale_stride};
  }
  // Element i of token t, decoded with the scalar codec.
  float Value(int t, int i) const {
    const uint8_t* row = data.data() + t * data_stride;
    const uint8_t* sc = scale.data() + t * scale_stride;
    switch (codec) {
      case Codec::kBF16: {
        uint16_t b;
        std::memcpy(&b, row + 2 * i, 2);
        return Bf16ToFloat(b);
      }
      case Codec::kInt8G64: {
        uint16_t sb;
        std::memcpy(&sb, sc + 2 * (i / 64), 2);
        return static_cast<float>(static_cast<int8_t>(row[i])) * Bf16ToFloat(sb);
      }
      case Codec::kFp8Row: {
        uint16_t sb;
        std::memcpy(&sb, sc, 2);
        return E4m3fnToFloat(row[i]) * Bf16ToFloat(sb);
      }
      case Codec::kNvfp4G16:
        return E2m1ToFloat((row[i / 2] >> (4 * (i & 1))) & 15u) * E4m3fnToFloat(sc[i / 16]);
    }
    return 0.0f;
  }
};

Tokens MakeTokens(Codec c, int d, int n, int pad) {
  Tokens t;
  t.codec = c;
  t.d = d;
  t.n = n;
  const CodecPlanes pl = PlanesOf(c, d);
  t.data_stride = static_cast<int64_t>(pl.data_extent) * pl.data_itemsize + pad;
  t.scale_stride = static_cast<int64_t>(pl.scale_extent) * pl.scale_itemsize;
  t.data.assign(static_cast<size_t>(t.data_stride) * n + 64, 0xCD);
  if (t.scale_stride > 0) t.scale.assign(static_cast<size_t>(t.scale_stride) * n + 64, 0xCD);
  return t;
}

// Tokens quantized (by the kernels' QuantizeRow) from rows of normal floats times `spread`.
Tokens QuantizedTokens(Codec c, int d, int n, int pad, std::mt19937& rng, float spread) {
  Tokens t = MakeTokens(c, d, n, pad);
  std::normal_distribution<float> normal;
  std::vector<float> x(d);
  for (int j = 0; j < n; ++j) {
    for (auto& v : x) v = normal(rng) * spread;
    QuantizeRow(c, x.data(), d, t.data.data() + j * t.data_stride, t.scale.empty() ? nullptr : t.scale.data() + j * t.scale_stride);
  }
  return t;
}

// Tokens of raw random codes and scales: every code value, NaN codes and NaN / inf / zero /
// tiny scales included.
Tokens RawTokens(Codec c, int d, int n, int pad, std::mt19937& rng) {
  Tokens t = MakeTokens(c, d, n, pad);
  for (auto& b : t.data) b = static_cast<uint8_t>(rng());
  std::uniform_real_distribution<float> uni(1e-3f, 4.0f);
  for (int j = 0; j < n; ++j) {
    uint8_t* sc = t.scale.empty() ? nullptr : t.scale.data() + j * t.scale_stride;
    if (c == Codec::kInt8G64 || c == Codec::kFp8Row) {
      const int groups = c == Codec::kFp8Row ? 1 : d / 64;
      for (int g = 0; g < groups; ++g) {
        uint16_t sb = FloatToBf16(uni(rng));
        if (j % 7 == 3) sb = 0x7FC0;                    // NaN scale
        if (j % 7 == 5) sb = 0x7F80;                    // inf scale
        if (j % 11 == 6) sb = 0x0000;                   // zero scale
        if (j % 13 == 9) sb = FloatToBf16(1e-37f);      // products below the float32 normals
        std::memcpy(sc + 2 * g, &sb, 2);
      }
    } else if (c == Codec::kNvfp4G16) {
      for (int g = 0; g < d / 16; ++g) sc[g] = static_cast<uint8_t>(rng());
    }
    if (c == Codec::kFp8Row && j % 3 != 0) {  // most rows without NaN codes
      uint8_t* row = t.data.data() + j * t.data_stride;
      for (int i = 0; i < d; ++i) {
        if ((row[i] & 0x7Fu) == 0x7Fu) row[i] ^= 2u;
      }
    }
  }
  return t;
}

template <Codec C>
void CheckRowDecoder(const Tokens& t, long* count) {
  AlignedFloats scales;
  std::vector<uint8_t> nan;
  const PreparedRows pr = PrepareRows(t.Source(), t.n, t.d, &scales, &nan);
  const int nchunks = t.d / kVL;
  bool any_nan = false;
  for (int j = 0; j < t.n; ++j) {
    const typename Decoder<C>::TokenCodes row = pr.template At<Decoder<C>>(j);
    bool row_nan = false;
    for (int i = 0; i < t.d && C == Codec::kFp8Row; ++i) row_nan |= (t.data[j * t.data_stride + i] & 0x7Fu) == 0x7Fu;
    any_nan |= row_nan;
    // Per-token flags exist only for a run that holds a NaN code.
    const bool flagged = pr.nan != nullptr && pr.nan[j] != 0;
    if (C == Codec::kFp8Row && flagged != row_nan) Fail("PrepareRows NaN flag, token " + std::to_string(j));
    // An FP8 value row holding a NaN code is decoded by Fp8ExactDecoder (Decoder's value form
    // assumes none); its value lanes must match the reference exactly, NaNs included.
    const bool use_exact = C == Codec::kFp8Row && row_nan;
    const Fp8ExactDecoder::TokenCodes exact = use_exact ? pr.template At<Fp8ExactDecoder>(j) : Fp8ExactDecoder::TokenCodes();
    for (int c = 0; c < nchunks; ++c) {
      const VFloat v = use_exact ? exact.Chunk(c) : row.Chunk(c);
      VFloat pair[2] = {};
      if ((c & 1) == 0 && c + 1 < nchunks) {
        if (use_exact) {
          exact.Chunk2(c, pair);
        } else {
          row.Chunk2(c, pair);
        }
      }
      const VFloat key = row.KeyChunk(c);
      VFloat key_pair[2] = {};
      if ((c & 1) == 0 && c + 1 < nchunks) row.KeyChunk2(c, key_pair);
      for (int l = 0; l < kVL; ++l, ++*count) {
        const int i = c * kVL + l;
        const float want = t.Value(j, i);
        ExpectFloat("Chunk", i, v[l], want);
        if ((c & 1) == 0 && c + 1 < nchunks) {
          ExpectFloat("Chunk2", i, pair[0][l], want);
          ExpectFloat("Chunk2", i + kVL, pair[1][l], t.Value(j, i + kVL));
        }
        // The key form times KeyScale() is the value (FP8: the code times 2^-8, exactly).
        if (Decoder<C>::TokenCodes::kKeyScaled) {
          if (row_nan) continue;  // a NaN code's key lane is unspecified; KeyScale() is NaN
          const uint8_t code = t.data[j * t.data_stride + i];
          ExpectFloat("KeyChunk", i, key[l], E4m3fnToFloat(code) * 0.00390625f);
          if ((c & 1) == 0 && c + 1 < nchunks) {
            ExpectFloat("KeyChunk2", i, key_pair[0][l], E4m3fnToFloat(code) * 0.00390625f);
            ExpectFloat("KeyChunk2", i + kVL, key_pair[1][l], E4m3fnToFloat(t.data[j * t.data_stride + i + kVL]) * 0.00390625f);
          }
        } else {
          ExpectFloat("KeyChunk", i, key[l], want);
        }
      }
    }
    if (C == Codec::kFp8Row && j + 1 == t.n && pr.any_nan() != any_nan) Fail("PrepareRows any_nan flag");
    if (Decoder<C>::TokenCodes::kKeyScaled) {
      uint16_t sb;
      std::memcpy(&sb, t.scale.data() + j * t.scale_stride, 2);
      const float want = row_nan ? BitsFloat(0x7FC00000u) : Bf16ToFloat(sb) * 256.0f;
      ExpectFloat("KeyScale", j, row.KeyScale(), want);
    }
  }
}

void CheckDecode(std::mt19937& rng) {
  for (Codec c : kCodecs) {
    const int before = g_failures;
    long count = 0;
    std::vector<int> dims = {64, 128, 192};
    if (c == Codec::kBF16 || c == Codec::kFp8Row) dims.insert(dims.end(), {8, 36, 100});
    if (c == Codec::kNvfp4G16) dims.insert(dims.end(), {16, 48, 80});
    for (int d : dims) {
      for (int pad : {0, 3}) {
        for (int raw = 0; raw < 2; ++raw) {
          const Tokens t = raw ? RawTokens(c, d, 40, pad, rng) : QuantizedTokens(c, d, 40, pad, rng, 3.0f);
          const int ld = static_cast<int>(RoundUp(d, kVL)) + (pad ? kVL : 0);
          std::vector<float> out(static_cast<size_t>(ld) * t.n, 12345.0f);
          DequantizeRows(t.Source(), t.n, d, ld, out.data(), nullptr);
          for (int j = 0; j < t.n; ++j) {
            for (int i = 0; i < ld; ++i, ++count) {
              ExpectFloat("DequantizeRows", i, out[static_cast<size_t>(j) * ld + i], i < d ? t.Value(j, i) : 0.0f);
            }
          }
          if (d % kVL != 0) continue;  // the fused decoders serve head dims that are multiples of kVL
          VisitCodec(c, [&](auto codec) { CheckRowDecoder<decltype(codec)::value>(t, &count); });
        }
      }
    }
    Report((std::string("decode ") + CodecName(c)).c_str(), before, count);
  }
}

// ---- attention ------------------------------------------------------------------------------

struct AttentionCase {
  Codec kc, vc;
  int d, rows, keys, run;
  bool same_range;  // every row sees all keys (else causal-like ranges, one row sees none)
};

void CheckAttention(std::mt19937& rng) {
  const AttentionCase cases[] = {
      {Codec::kBF16, Codec::kBF16, 128, 1, 37, 16, false},
      {Codec::kBF16, Codec::kBF16, 36, 5, 40, 16, false},
      {Codec::kInt8G64, Codec::kInt8G64, 128, 2, 50, 16, false},
      {Codec::kInt8G64, Codec::kInt8G64, 64, 8, 33, 32, true},
      {Codec::kFp8Row, Codec::kFp8Row, 128, 3, 45, 16, false},
      {Codec::kFp8Row, Codec::kFp8Row, 100, 4, 30, 8, true},
      {Codec::kNvfp4G16, Codec::kNvfp4G16, 128, 11, 41, 16, false},
      {Codec::kNvfp4G16, Codec::kNvfp4G16, 48, 1, 20, 16, true},
      {Codec::kInt8G64, Codec::kNvfp4G16, 128, 8, 48, 16, false},  // K8V4
      {Codec::kInt8G64, Codec::kNvfp4G16, 64, 3, 29, 8, true},     // K8V4
  };
  AttentionAccumulator acc;
  std::normal_distribution<float> normal;
  for (const AttentionCase& tc : cases) {
    const int before = g_failures;
    long count = 0;
    const Tokens k = QuantizedTokens(tc.kc, tc.d, tc.keys, 5, rng, 1.5f);
    const Tokens v = QuantizedTokens(tc.vc, tc.d, tc.keys, 0, rng, 1.0f);
    const float sm_scale = 1.0f / std::sqrt(static_cast<float>(tc.d));
    std::vector<std::vector<float>> q(tc.rows, std::vector<float>(tc.d));
    std::vector<int64_t> lo(tc.rows), hi(tc.rows);
    acc.Begin(tc.rows, tc.d, tc.run, sm_scale);
    for (int m = 0; m < tc.rows; ++m) {
      for (auto& x : q[m]) x = normal(rng);
      std::memcpy(acc.QueryRow(m), q[m].data(), sizeof(float) * tc.d);
      lo[m] = 0;
      hi[m] = tc.keys - 1;
      if (!tc.same_range) {
        lo[m] = (m % 3) * 3;
        hi[m] = tc.keys - 1 - 2 * (tc.rows - 1 - m);
        if (m == 1) lo[m] = hi[m] + 1;  // sees no key
      }
      acc.SetVisible(m, lo[m], hi[m]);
    }
    for (int j0 = 0; j0 < tc.keys; j0 += tc.run) {
      const int n = std::min(tc.run, tc.keys - j0);
      RowSource ks = k.Source(), vs = v.Source();
      ks.data += j0 * ks.data_stride;
      vs.data += j0 * vs.data_stride;
      if (ks.scale) ks.scale += j0 * ks.scale_stride;
      if (vs.scale) vs.scale += j0 * vs.scale_stride;
      acc.Fold(KVRunSource{ks, vs}, j0, n, nullptr);
    }
    std::vector<float> out(tc.d);
    double worst = 0.0;
    for (int m = 0; m < tc.rows; ++m) {
      acc.Output(m, out.data());
      std::vector<double> s;
      double smax = -INFINITY;
      for (int64_t j = lo[m]; j <= hi[m]; ++j) {
        double dot = 0.0;
        for (int i = 0; i < tc.d; ++i) dot += static_cast<double>(q[m][i]) * k.Value(static_cast<int>(j), i);
        s.push_back(dot * sm_scale);
        smax = std::max(smax, s.back());
      }
      double den = 0.0;
      for (double& x : s) den += (x = std::exp(x - smax));
      for (int i = 0; i < tc.d; ++i, ++count) {
        double num = 0.0, cond = 0.0;
        for (size_t t = 0; t < s.size(); ++t) {
          const double vi = v.Value(static_cast<int>(lo[m] + static_cast<int64_t>(t)), i);
          num += s[t] * vi;
          cond += s[t] * std::fabs(vi);
        }
        const double want = s.empty() ? 0.0 : num / den;
        const double err = std::fabs(out[i] - want);
        const double rel = s.empty() ? err : err / std::max(cond / den, 1e-30);
        worst = std::max(worst, rel);
        if (!(rel <= 1e-5)) {
          Fail(std::string("attention ") + CodecName(tc.kc) + "/" + CodecName(tc.vc) + " row " + std::to_string(m) +
               " elem " + std::to_string(i) + ": got " + std::to_string(out[i]) + " want " + std::to_string(want));
        }
      }
    }
    const std::string name = std::string("attention K ") + CodecName(tc.kc) + " V " + CodecName(tc.vc) + " d=" +
                             std::to_string(tc.d) + " rows=" + std::to_string(tc.rows) + " (max rel err " +
                             Sci(worst) + ")";
    Report(name.c_str(), before, count);
  }
}

}  // namespace

int main() {
  std::printf("ninfer_kv kernel check: level %s, simd %s, kVL %d\n", NINFER_KV_STR(NINFER_KV_ISA_ID), SimdPath(), kVL);
  ScopedFlushDenormal ftz;  // the mode every kernel runs under (and so the reference here)
  std::mt19937 rng(20261201u);
  CheckPrimitives(rng);
  CheckQuantize(rng);
  CheckDecode(rng);
  CheckAttention(rng);
  if (g_failures != 0) {
    std::printf("FAIL: %d mismatches\n", g_failures);
    return 1;
  }
  std::printf("PASS\n");
  return 0;
}
