// Bulk copies of page data with non-temporal stores, and the strided block copy that
// ninfer_kv/host/block_copy.py calls through ctypes for the Host tier's staging and gathers.
#include "stream_copy.h"

#include <algorithm>
#include <cstring>

#include "thread_pool.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace ninfer_kv_ffi {

void StreamCopy(uint8_t* dst, const uint8_t* src, int64_t n) {
#if defined(__SSE2__)
  constexpr int64_t kStreamBytes = 4096;
  if (n >= kStreamBytes) {
    const int64_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
    std::memcpy(dst, src, static_cast<size_t>(head));
    dst += head, src += head, n -= head;
    const int64_t body = n & ~int64_t{63};
    for (int64_t i = 0; i < body; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
    dst += body, src += body, n -= body;
  }
#endif
  std::memcpy(dst, src, static_cast<size_t>(n));
}

void Fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

}  // namespace ninfer_kv_ffi

extern "C" {

// Copies blocks of `block_bytes` contiguous bytes: for every index (i_0, ..., i_{ndim-1}) below
// `shape`, the block at src + s(i_0) * src_strides[0] + sum_{k>0} i_k * src_strides[k] goes to
// dst + sum_k i_k * dst_strides[k], where s(i) = src_index[i] when src_index is not null and i
// otherwise (a gather along the first axis).  Strides are in bytes and may be negative; the
// caller guarantees that every address is in bounds and that source and destination do not
// overlap.  The blocks are split in pieces of at most 1 MiB spread over the kernel threads
// (`threads` <= 0: all of them; 1: the calling thread alone).  Returns 0, or -1 for ndim outside
// [0, 8] or a negative extent.
__attribute__((visibility("default"))) int32_t NinferKvFfiCopyBlocks(void* dst, const void* src, int32_t ndim,
                                                                     const int64_t* shape, const int64_t* dst_strides,
                                                                     const int64_t* src_strides,
                                                                     const int64_t* src_index, int64_t block_bytes,
                                                                     int32_t threads) {
  constexpr int kMaxDims = 8;
  constexpr int64_t kPiece = int64_t{1} << 20;
  if (ndim < 0 || ndim > kMaxDims || block_bytes < 0) return -1;
  int64_t blocks = 1;
  for (int k = 0; k < ndim; ++k) {
    if (shape[k] < 0) return -1;
    blocks *= shape[k];
  }
  if (blocks == 0 || block_bytes == 0) return 0;
  const int64_t pieces = (block_bytes + kPiece - 1) / kPiece;  // per block
  const int64_t units = blocks * pieces;
  const int64_t pool = threads > 0 ? threads : ninfer_kv_ffi::PoolThreads();
  const int64_t slices = std::max<int64_t>(1, std::min<int64_t>(pool, units));
  auto* out = static_cast<uint8_t*>(dst);
  const auto* in = static_cast<const uint8_t*>(src);
  auto run = [&](int64_t slice) {
    const int64_t lo = units * slice / slices, hi = units * (slice + 1) / slices;
    for (int64_t u = lo; u < hi; ++u) {
      int64_t block = u / pieces, rest = block;
      const int64_t piece = u - block * pieces;
      int64_t d = 0, s = 0;
      for (int k = ndim - 1; k >= 0; --k) {
        const int64_t i = rest % shape[k];
        rest /= shape[k];
        d += i * dst_strides[k];
        s += (k == 0 && src_index != nullptr ? src_index[i] : i) * src_strides[k];
      }
      const int64_t at = piece * kPiece, n = std::min(kPiece, block_bytes - at);
      ninfer_kv_ffi::StreamCopy(out + d + at, in + s + at, n);
    }
    ninfer_kv_ffi::Fence();
  };
  if (slices == 1) {
    run(0);
  } else {
    ninfer_kv_ffi::ParallelFor(slices, run);
  }
  return 0;
}

}  // extern "C"
