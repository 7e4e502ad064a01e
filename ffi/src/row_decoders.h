// The decoders of the codecs: everything that reads a codec's planes, one Decoder<C> per row of
// NINFER_KV_CODECS (common.h).
//
// Decoder<C>::TokenCodes: vector decoder of one token's codes (one head): chunk c is the kVL
// dequantized float32 values of elements [c * kVL, (c + 1) * kVL), equal to float(code) * scale
// exactly as ninfer_kv.ops.codecs.decode_kv computes them.  Used directly on page memory (fused
// decode) when the head dim is a multiple of kVL; it never reads outside its own codes and scales.
// Decoder<C>::Prepare: decodes a run's scales to float32 for the rows (PrepareRows).
// Decoder<C>::Dequantize: a run into a float32 tile (DequantizeRows: head dims that are not a
// multiple of kVL).
// Traits with defaults (DecoderOps): NanValues, the decoder of value runs holding a NaN code;
// IntScores(d), whether keys of head dim d take the integer scores of int_scores.h.
#ifndef NINFER_KV_FFI_ROW_DECODERS_H_
#define NINFER_KV_FFI_ROW_DECODERS_H_

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"
#include "dequantize.h"
#include "int_scores.h"
#include "scalar_codec.h"
#include "simd.h"

NINFER_KV_NAMESPACE_BEGIN

// e4m3fn codes (zero-extended to 32-bit lanes) -> float32, exact, without denormal arithmetic.
inline VFloat E4m3fnLanes(VUInt w) {
  const VUInt em = w & 0x7Fu;
  const VUInt sign = (w & 0x80u) << 24;
  const VUInt normal = sign | ((em << 20) + (120u << 23));
  const VFloat sub_mag = ToFloat(__builtin_convertvector(em, VInt)) * Splat(0.001953125f);  // m * 2^-9
  VUInt bits = (em >> 3) == 0u ? (AsUInt(sub_mag) | sign) : normal;
  bits = em == 0x7Fu ? (sign | 0x7FC00000u) : bits;
  return AsFloat(bits);
}

// e2m1 codes (one per 32-bit lane, sign in bit 3) -> float32.
inline VFloat E2m1Lanes(VUInt c) {
  const VUInt e = (c >> 1) & 3u;
  const VUInt m = c & 1u;
  const VUInt normal = ((e + 126u) << 23) | (m << 22);
  const VUInt sub = m * 0x3F000000u;
  const VUInt bits = e == 0u ? sub : normal;
  return AsFloat(bits | ((c & 8u) << 28));
}

#if defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)
// High bytes of the float16 values of the 16 e2m1 codes (sign in bit 3): 0, 0.5, 1, 1.5, 2, 3, 4, 6.
inline __m128i E2m1F16High() {
  return _mm_setr_epi8(0x00, 0x38, 0x3C, 0x3E, 0x40, 0x42, 0x44, 0x46, static_cast<char>(0x80), static_cast<char>(0xB8),
                       static_cast<char>(0xBC), static_cast<char>(0xBE), static_cast<char>(0xC0), static_cast<char>(0xC2),
                       static_cast<char>(0xC4), static_cast<char>(0xC6));
}
#elif defined(NINFER_KV_NEON)
// The same table for tbl.
inline uint8x16_t E2m1F16High() {
  static constexpr uint8_t kHigh[16] = {0x00, 0x38, 0x3C, 0x3E, 0x40, 0x42, 0x44, 0x46,
                                        0x80, 0xB8, 0xBC, 0xBE, 0xC0, 0xC2, 0xC4, 0xC6};
  return vld1q_u8(kHigh);
}
#endif

// kVL / 2 packed bytes -> kVL e2m1 values (element 2i: low nibble of byte i).
inline VFloat E2m1Packed(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m512 kLut = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f,
                                     -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
#if defined(__AVX512VBMI__) && defined(__AVX512VL__)
  // Element e is the nibble at bit 4e of the 8 bytes: one multishift puts it in the low bits of
  // byte e (the permute reads only bits 0..3 of each index, so the high bits need no mask).
  uint64_t bits;
  std::memcpy(&bits, p, sizeof bits);
  const __m128i ctrl = _mm_setr_epi8(0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60);
  const __m128i nib = _mm_multishift_epi64_epi8(ctrl, _mm_set1_epi64x(static_cast<long long>(bits)));
  const __m512 v = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(nib), kLut);
  VFloat r;
  std::memcpy(&r, &v, sizeof r);
  return r;
#else
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  __m512i w = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b));
  // (the permute reads only bits 0..3 of each index, so the high bits need no mask)
  w = _mm512_srlv_epi32(w, _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4));
  const __m512 v = _mm512_permutexvar_ps(w, kLut);
  VFloat r;
  std::memcpy(&r, &v, sizeof r);
  return r;
#endif
#elif defined(__AVX2__) && defined(__F16C__)
  // The 8 nibbles of 4 bytes, in element order, index a 16-entry byte table (pshufb) holding the
  // high byte of each e2m1 value as a float16 (whose low byte is 0); the float16 -> float32
  // conversion is exact.
  int32_t four;
  std::memcpy(&four, p, 4);
  const __m128i b = _mm_cvtsi32_si128(four);
  const __m128i low = _mm_set1_epi8(0x0F);
  const __m128i nib = _mm_unpacklo_epi8(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
  const __m128i hi = _mm_shuffle_epi8(E2m1F16High(), nib);
  const __m256 v = _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), hi));
  VFloat r;
  std::memcpy(&r, &v, sizeof r);
  return r;
#elif defined(NINFER_KV_NEON)
  // As on AVX2: the nibbles in element order index the float16 high-byte table (tbl), and the
  // widening shift by 8 makes the float16 values (exact in float32).
  uint32_t four;
  std::memcpy(&four, p, 4);
  const uint8x8_t b = vreinterpret_u8_u32(vdup_n_u32(four));
  const uint8x8_t nib = vzip1_u8(vand_u8(b, vdup_n_u8(0x0F)), vshr_n_u8(b, 4));
  const float16x8_t h = vreinterpretq_f16_u16(vshll_n_u8(vqtbl1_u8(E2m1F16High(), nib), 8));
  const float32x4_t v[2] = {vcvt_f32_f16(vget_low_f16(h)), vcvt_high_f32_f16(h)};
  VFloat r;
  std::memcpy(&r, v, sizeof r);
  return r;
#else
  VUInt c;
  for (int i = 0; i < kVL; ++i) c[i] = (p[i / 2] >> ((i & 1) * 4)) & 15u;
  return E2m1Lanes(c);
#endif
}

// Whether any of the n e4m3fn codes at p is a NaN (S.1111.111): 32 bytes at a time over portable
// byte vectors (one compare per 16 or 32 bytes on every level; 64 with AVX-512BW).
inline bool HasE4m3Nan(const uint8_t* p, int n) {
  int i = 0;
#if defined(__AVX512BW__)
  const __m512i mask = _mm512_set1_epi8(0x7F);
  for (; i + 64 <= n; i += 64) {
    const __m512i b = _mm512_and_si512(_mm512_loadu_si512(p + i), mask);
    if (_mm512_cmpeq_epi8_mask(b, mask) != 0) return true;
  }
#elif defined(NINFER_KV_NEON)
  // 16 bytes per compare, one horizontal max per row (rows are short).
  const uint8x16_t mask = vdupq_n_u8(0x7F);
  uint8x16_t hit = vdupq_n_u8(0);
  for (; i + 16 <= n; i += 16) hit = vorrq_u8(hit, vceqq_u8(vandq_u8(vld1q_u8(p + i), mask), mask));
  if (vmaxvq_u8(hit) != 0) return true;
#endif
  typedef uint8_t VB __attribute__((vector_size(32)));
  typedef int8_t VM __attribute__((vector_size(32)));
  VM any = VM{};
  for (; i + 32 <= n; i += 32) {
    VB b;
    std::memcpy(&b, p + i, sizeof b);
    any |= (b & 0x7Fu) == 0x7Fu;
  }
  uint64_t words[4];
  std::memcpy(words, &any, sizeof words);
  if ((words[0] | words[1] | words[2] | words[3]) != 0) return true;
  for (; i < n; ++i) {
    if ((p[i] & 0x7Fu) == 0x7Fu) return true;
  }
  return false;
}

// kVL e4m3fn codes -> float32 values times 2^-8, exactly: the sign-extended byte shifted left by
// 7 (with bit 14 cleared) is the float16 with the same sign, exponent field and mantissa, whose
// value is the e4m3fn value times 2^-8 (subnormals included); the hardware float16 conversion is
// exact.  NaN codes come out as +-1.875 (what 480 would give; callers check runs for NaN codes).
inline VFloat E4m3fnScaledLanes(const uint8_t* p) {
#if defined(__AVX512F__)
  __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  w = _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(static_cast<int16_t>(0xBFFF)));
  const __m512 f = _mm512_cvtph_ps(w);
  VFloat r;
  std::memcpy(&r, &f, sizeof r);
  return r;
#elif defined(__AVX2__) && defined(__F16C__)
  __m128i w = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  w = _mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16(static_cast<int16_t>(0xBFFF)));
  const __m256 f = _mm256_cvtph_ps(w);
  VFloat r;
  std::memcpy(&r, &f, sizeof r);
  return r;
#elif defined(NINFER_KV_NEON)
  // The float16 trick above.  fcvtl reads float16 subnormals exactly whatever the kernels'
  // flush-to-zero mode (FPCR.FZ covers single and double precision; conversions ignore FZ16).
  int16x8_t w = vmovl_s8(vld1_s8(reinterpret_cast<const int8_t*>(p)));
  w = vandq_s16(vshlq_n_s16(w, 7), vdupq_n_s16(static_cast<int16_t>(0xBFFF)));
  const float16x8_t h = vreinterpretq_f16_s16(w);
  const float32x4_t f[2] = {vcvt_f32_f16(vget_low_f16(h)), vcvt_high_f32_f16(h)};
  VFloat r;
  std::memcpy(&r, f, sizeof r);
  return r;
#else
  return E4m3fnLanes(LoadU8AsU32(p)) * Splat(0.00390625f);
#endif
}

#if defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)
// Two-vector (16 value) forms of the AVX2 decoders above, sharing their loads and shuffles.

// 8 packed bytes -> 16 e2m1 values.
inline void E2m1Packed16(const uint8_t* p, VFloat* out) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i low = _mm_set1_epi8(0x0F);
  const __m128i nib = _mm_unpacklo_epi8(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
  const __m128i hi = _mm_shuffle_epi8(E2m1F16High(), nib);
  const __m128i zero = _mm_setzero_si128();
  const __m256 a = _mm256_cvtph_ps(_mm_unpacklo_epi8(zero, hi));
  const __m256 z = _mm256_cvtph_ps(_mm_unpackhi_epi8(zero, hi));
  std::memcpy(&out[0], &a, sizeof a);
  std::memcpy(&out[1], &z, sizeof z);
}

// 16 e4m3fn codes -> their values times 2^-8 (NaN codes as in E4m3fnScaledLanes).
inline void E4m3fnScaled16(const uint8_t* p, VFloat* out) {
  __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  w = _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(static_cast<int16_t>(0xBFFF)));
  const __m256 a = _mm256_cvtph_ps(_mm256_castsi256_si128(w));
  const __m256 z = _mm256_cvtph_ps(_mm256_extracti128_si256(w, 1));
  std::memcpy(&out[0], &a, sizeof a);
  std::memcpy(&out[1], &z, sizeof z);
}
#define NINFER_KV_PAIR_DECODERS 1
#elif defined(NINFER_KV_NEON)
// Two-vector (16 value) forms of the NEON decoders above (kVL == 8).

// 8 packed bytes -> 16 e2m1 values.
inline void E2m1Packed16(const uint8_t* p, VFloat* out) {
  const uint8x8_t b = vld1_u8(p);
  const uint8x8_t lo = vand_u8(b, vdup_n_u8(0x0F)), hi = vshr_n_u8(b, 4);
  const uint8x16_t t = vqtbl1q_u8(E2m1F16High(), vcombine_u8(vzip1_u8(lo, hi), vzip2_u8(lo, hi)));
  const float16x8_t a = vreinterpretq_f16_u16(vshll_n_u8(vget_low_u8(t), 8));
  const float16x8_t z = vreinterpretq_f16_u16(vshll_high_n_u8(t, 8));
  const float32x4_t f[4] = {vcvt_f32_f16(vget_low_f16(a)), vcvt_high_f32_f16(a), vcvt_f32_f16(vget_low_f16(z)),
                            vcvt_high_f32_f16(z)};
  std::memcpy(out, f, 2 * sizeof(VFloat));
}

// 16 e4m3fn codes -> their values times 2^-8 (NaN codes as in E4m3fnScaledLanes).
inline void E4m3fnScaled16(const uint8_t* p, VFloat* out) {
  const int8x16_t b = vld1q_s8(reinterpret_cast<const int8_t*>(p));
  const int16x8_t keep = vdupq_n_s16(static_cast<int16_t>(0xBFFF));
  const float16x8_t a = vreinterpretq_f16_s16(vandq_s16(vshlq_n_s16(vmovl_s8(vget_low_s8(b)), 7), keep));
  const float16x8_t z = vreinterpretq_f16_s16(vandq_s16(vshlq_n_s16(vmovl_high_s8(b), 7), keep));
  const float32x4_t f[4] = {vcvt_f32_f16(vget_low_f16(a)), vcvt_high_f32_f16(a), vcvt_f32_f16(vget_low_f16(z)),
                            vcvt_high_f32_f16(z)};
  std::memcpy(out, f, 2 * sizeof(VFloat));
}
#define NINFER_KV_PAIR_DECODERS 1
#endif

// A run of token rows of one tensor, ready for a Decoder: codes in place, scales as float32.
struct PreparedRows {
  const uint8_t* data = nullptr;
  int64_t stride = 0;             // bytes per token of the codes
  const float* scales = nullptr;  // `groups` floats per token (null for BF16)
  int groups = 0;
  const uint8_t* nan = nullptr;   // per-token NaN-code flags (FP8 runs holding one), else null

  // Whether some token of the run holds a NaN code (FP8).
  bool any_nan() const { return nan != nullptr; }

  template <class Dec>
  typename Dec::TokenCodes At(int64_t j) const {
    return typename Dec::TokenCodes(data + j * stride, scales ? scales + j * groups : nullptr,
                                    nan ? nan[j] != 0 : false);
  }
};

// Helpers of the decoders' Prepare and Dequantize.

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

// The bfloat16 scales of tokens [0, cnt) of src, `groups` per token, as float32 (INT8-G64, FP8 row).
inline void PrepareBf16Scales(const RowSource& src, int cnt, int groups, AlignedFloats* scales, PreparedRows* out) {
  // the scale rows of consecutive tokens are contiguous
  const int total = cnt * groups;
  float* f = scales->Get(static_cast<size_t>(total) + kVL);
  int i = 0;
  for (; i + kVL <= total; i += kVL) Store(f + i, AsFloat(LoadU16AsU32(src.scale + 2 * i) << 16));
  for (; i < total; ++i) {
    uint16_t b;
    std::memcpy(&b, src.scale + 2 * i, 2);
    f[i] = Bf16ToFloat(b);
  }
  out->scales = f;
  out->groups = groups;
}

// Decoder<C>::TokenCodes(data, scales, nan) wraps the codes of one token: `data` its codes, `scales`
// its scales already decoded to float32 (Prepare), `nan` whether they hold a NaN code (FP8 only).
// Chunk(c) returns dequantized chunk c; Chunk2(c, out) writes chunks c and c + 1 (c even), which
// some levels decode together.
// Defaults of every decoder's TokenCodes (CRTP): Chunk2 as two Chunk calls, and the key form used
// by the score products: KeyChunk / KeyChunk2 may leave out a per-token factor that KeyScale() returns
// (the caller multiplies the finished dot product by it; kKeyScaled says whether there is one).
template <class T>
struct TokenCodesOps {
  static constexpr bool kKeyScaled = false;
  static constexpr bool kPairs = false;  // whether Chunk2 / KeyChunk2 decode two chunks at once
  void Chunk2(int c, VFloat* out) const {
    out[0] = Self().Chunk(c);
    out[1] = Self().Chunk(c + 1);
  }
  VFloat KeyChunk(int c) const { return Self().Chunk(c); }
  void KeyChunk2(int c, VFloat* out) const { Self().Chunk2(c, out); }
  float KeyScale() const { return 1.0f; }
  // The unscaled form for value passes that fold the scales into the probabilities: a TokenCodes
  // with kScaleGroup > 0 (elements per scale) also has RawChunk / RawChunk2 and a static
  // GroupScale(scales, g), and Chunk(c) == RawChunk(c) * GroupScale(scales, c * kVL / kScaleGroup)
  // up to the rounding of the product.  0: no such form.
  static constexpr int kScaleGroup = 0;

 private:
  const T& Self() const { return static_cast<const T&>(*this); }
};

// Defaults of every Decoder<C> (CRTP).
template <class D>
struct DecoderOps {
  // The decoder of value runs that hold a NaN code (any_nan()); D itself when its TokenCodes
  // decodes those.
  using NanValues = D;
  // Whether keys of head dim d take the integer scores (int_scores.h) on this level; their scorer
  // (AttentionAccumulator::ScoresNvfp4Int) reads NVFP4 codes, so only Decoder<kNvfp4G16> says yes.
  static bool IntScores(int d) { return false; }
  // Decodes nothing: a codec without scales (PreparedRows keeps no scales).
  static void Prepare(const RowSource& src, int cnt, int head_dim, AlignedFloats* scales, std::vector<uint8_t>* nan,
                      PreparedRows* out) {}
};

// One specialization per row of NINFER_KV_CODECS.
template <Codec C>
struct Decoder;

template <>
struct Decoder<Codec::kBF16> : DecoderOps<Decoder<Codec::kBF16>> {
  static void Dequantize(const RowSource& s, int n, int d, int ld, float* out, const RowSource* pf) {
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

  struct TokenCodes : TokenCodesOps<TokenCodes> {
    const uint8_t* d = nullptr;
    TokenCodes() = default;
    TokenCodes(const uint8_t* data, const float*, bool) : d(data) {}
    VFloat Chunk(int c) const { return AsFloat(LoadU16AsU32(d + 2 * kVL * c) << 16); }
  };
};

template <>
struct Decoder<Codec::kInt8G64> : DecoderOps<Decoder<Codec::kInt8G64>> {
  static void Prepare(const RowSource& src, int cnt, int head_dim, AlignedFloats* scales, std::vector<uint8_t>*,
                      PreparedRows* out) {
    PrepareBf16Scales(src, cnt, head_dim / 64, scales, out);
  }
  static void Dequantize(const RowSource& s, int n, int d, int ld, float* out, const RowSource* pf) {
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

  struct TokenCodes : TokenCodesOps<TokenCodes> {
    const uint8_t* d = nullptr;
    const float* s = nullptr;
    TokenCodes() = default;
    static constexpr int kScaleGroup = 64;
    TokenCodes(const uint8_t* data, const float* scales, bool) : d(data), s(scales) {}
    VFloat Chunk(int c) const { return RawChunk(c) * Splat(s[(c * kVL) / 64]); }
    VFloat RawChunk(int c) const { return ToFloat(LoadI8AsI32(d + kVL * c)); }
    void RawChunk2(int c, VFloat* out) const {
      out[0] = RawChunk(c);
      out[1] = RawChunk(c + 1);
    }
    static float GroupScale(const float* scales, int g) { return scales[g]; }
  };
};

struct Fp8ExactDecoder;

template <>
struct Decoder<Codec::kFp8Row> : DecoderOps<Decoder<Codec::kFp8Row>> {
  using NanValues = Fp8ExactDecoder;
  static void Prepare(const RowSource& src, int cnt, int head_dim, AlignedFloats* scales, std::vector<uint8_t>* nan,
                      PreparedRows* out) {
    PrepareBf16Scales(src, cnt, 1, scales, out);
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
    out->nan = any ? nan->data() : nullptr;
  }
  static void Dequantize(const RowSource& s, int n, int d, int ld, float* out, const RowSource* pf) {
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

  // A row's values are code * s, computed as (code * 2^-8) * (s * 2^8): the same product (both
  // factors are exact, and s * 2^8 is finite for every scale amax / 448 can produce).  Keys leave
  // the factor s * 2^8 to the finished dot product (KeyScale); a key row holding a NaN code has a
  // NaN dot product, which KeyScale() = NaN gives.  Chunk / Chunk2 assume the row holds no NaN
  // code (the float16 form turns those into finite values): value runs that hold one use
  // Fp8ExactDecoder instead.
  struct TokenCodes : TokenCodesOps<TokenCodes> {
    static constexpr bool kKeyScaled = true;
#if defined(NINFER_KV_PAIR_DECODERS)
    static constexpr bool kPairs = true;
#endif
    const uint8_t* d = nullptr;
    float s = 0.0f;
    // 32 bits, not bool: a TokenCodes is then two aligned words with no padding, which the compiler
    // copies without overlapping partial stores and loads (those stall store forwarding).
    uint32_t nan = 0;
    TokenCodes() = default;
    TokenCodes(const uint8_t* data, const float* scales, bool has_nan)
        : d(data), s(scales[0]), nan(has_nan ? 1u : 0u) {}
    VFloat Chunk(int c) const { return KeyChunk(c) * Splat(s * 256.0f); }
    void Chunk2(int c, VFloat* out) const {
      KeyChunk2(c, out);
      const VFloat s256 = Splat(s * 256.0f);
      out[0] *= s256;
      out[1] *= s256;
    }
    VFloat KeyChunk(int c) const { return E4m3fnScaledLanes(d + kVL * c); }
    void KeyChunk2(int c, VFloat* out) const {
#if defined(NINFER_KV_PAIR_DECODERS)
      E4m3fnScaled16(d + kVL * c, out);
#else
      out[0] = KeyChunk(c);
      out[1] = KeyChunk(c + 1);
#endif
    }
    float KeyScale() const { return nan != 0 ? BitsFloat(0x7FC00000u) : s * 256.0f; }
    // One scale per row: the raw form is the key form (code * 2^-8), its factor s * 2^8.
    static constexpr int kScaleGroup = 1 << 30;
    VFloat RawChunk(int c) const { return KeyChunk(c); }
    void RawChunk2(int c, VFloat* out) const { KeyChunk2(c, out); }
    static float GroupScale(const float* scales, int) { return scales[0] * 256.0f; }
  };
};

// FP8 value rows of a run that holds a NaN code: the exact integer decode, so every NaN lands
// where the reference has it.
struct Fp8ExactDecoder {
  struct TokenCodes : TokenCodesOps<TokenCodes> {
    const uint8_t* d = nullptr;
    float s = 0.0f;
    TokenCodes() = default;
    TokenCodes(const uint8_t* data, const float* scales, bool) : d(data), s(scales[0]) {}
    VFloat Chunk(int c) const { return E4m3fnLanes(LoadU8AsU32(d + kVL * c)) * Splat(s); }
  };
};

template <>
struct Decoder<Codec::kNvfp4G16> : DecoderOps<Decoder<Codec::kNvfp4G16>> {
  static bool IntScores(int d) {
#if defined(NINFER_KV_INT_SCORES)
    return d % 16 == 0 && d <= 256;
#else
    return false;
#endif
  }
  static void Prepare(const RowSource& src, int cnt, int head_dim, AlignedFloats* scales, std::vector<uint8_t>*,
                      PreparedRows* out) {  // e4m3fn scale bytes
    const int groups = head_dim / 16;
    const int total = cnt * groups;
    float* f = scales->Get(static_cast<size_t>(total) + kVL);
    int i = 0;
    for (; i + kVL <= total; i += kVL) Store(f + i, E4m3fnLanes(LoadU8AsU32(src.scale + i)));
    for (; i < total; ++i) f[i] = E4m3fnToFloat(src.scale[i]);
    out->scales = f;
    out->groups = groups;
  }
  static void Dequantize(const RowSource& s, int n, int d, int ld, float* out, const RowSource* pf) {
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

  struct TokenCodes : TokenCodesOps<TokenCodes> {
    const uint8_t* d = nullptr;
    const float* s = nullptr;
    TokenCodes() = default;
#if defined(NINFER_KV_PAIR_DECODERS)
    static constexpr bool kPairs = true;
#endif
    TokenCodes(const uint8_t* data, const float* scales, bool) : d(data), s(scales) {}
    // No folded form: with a scale per 16 elements, the folded probabilities (one row per group)
    // cost more than the multiplies they save (measured again with 16 lanes, one group per chunk).
    VFloat Chunk(int c) const { return E2m1Packed(d + (kVL / 2) * c) * Splat(s[(c * kVL) / 16]); }
    void Chunk2(int c, VFloat* out) const {
#if defined(NINFER_KV_PAIR_DECODERS)
      // kVL == 8: chunks c, c + 1 (c even) are the 16 values of one scale group.
      E2m1Packed16(d + (kVL / 2) * c, out);
      const VFloat sc = Splat(s[(c * kVL) / 16]);
      out[0] *= sc;
      out[1] *= sc;
#else
      out[0] = Chunk(c);
      out[1] = Chunk(c + 1);
#endif
    }
  };
};

// Rows of an already dequantized float32 tile (the path for head dims that are not a multiple
// of kVL): `data` points at a row of ld floats.
struct F32Decoder {
  struct TokenCodes : TokenCodesOps<TokenCodes> {
    const float* p = nullptr;
    TokenCodes() = default;
    TokenCodes(const uint8_t* data, const float*, bool) : p(reinterpret_cast<const float*>(data)) {}
    VFloat Chunk(int c) const { return Load(p + kVL * c); }
  };
};

// A type as a value (what VisitValueDecoder hands its function).
template <class T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<D>{}) with D the decoder of the value rows of run v of codec c: Decoder<c>, or
// its NanValues when the run holds a NaN code.
template <class F>
NINFER_KV_ALWAYS_INLINE void VisitValueDecoder(Codec c, const PreparedRows& v, F&& f) {
  VisitCodec(c, [&](auto codec) {
    using D = Decoder<decltype(codec)::value>;
    if constexpr (!std::is_same_v<typename D::NanValues, D>) {
      if (v.any_nan()) {
        f(TypeTag<typename D::NanValues>{});
        return;
      }
    }
    f(TypeTag<D>{});
  });
}

// Decodes the scales of tokens [0, cnt) of `src` into `scales` (and NaN-code flags into `nan`)
// and returns the prepared run.  Reads exactly the cnt tokens' scale bytes.
PreparedRows PrepareRows(const RowSource& src, int cnt, int head_dim, AlignedFloats* scales, std::vector<uint8_t>* nan);

NINFER_KV_NAMESPACE_END

#endif  // NINFER_KV_FFI_ROW_DECODERS_H_
