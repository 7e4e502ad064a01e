// Bulk copies of page data with non-temporal stores.
//
// Page data copied between the Host tier and the planes is read much later (by a later step or a
// later transfer), so on x86-64 the copies of large blocks use streaming stores: no
// read-for-ownership of the destination, no eviction of the working set.  A store fence (Fence)
// must follow before the written bytes are handed to another thread.
#ifndef NINFER_KV_FFI_STREAM_COPY_H_
#define NINFER_KV_FFI_STREAM_COPY_H_

#include <cstdint>

namespace ninfer_kv_ffi {

// Copies n bytes (streaming stores for n >= 4 KiB on x86-64, memcpy otherwise).
void StreamCopy(uint8_t* dst, const uint8_t* src, int64_t n);

// Orders the streaming stores issued so far before later stores (sfence; nothing elsewhere).
void Fence();

}  // namespace ninfer_kv_ffi

#endif  // NINFER_KV_FFI_STREAM_COPY_H_
