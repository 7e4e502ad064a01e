// A small persistent thread pool for the CPU kernels.
//
// ParallelFor(n, fn) runs fn(i) for every i in [0, n) and returns when all calls have finished.
// The calling thread takes part in the work, so a call always makes progress even when every
// worker is busy with another caller's job (no deadlock when XLA runs two custom calls at once).
// Items are handed out one at a time from an atomic counter (dynamic load balancing).
//
// Size: std::thread::hardware_concurrency() threads in total (the caller plus workers), or the
// value of the environment variable NINFER_KV_FFI_THREADS (>= 1) read when the pool is first
// used.  Workers run with denormals flushed to zero, like XLA's CPU runtime.  The pool lives for
// the whole process (it is never destroyed, so no thread is joined during interpreter shutdown).
#ifndef NINFER_KV_FFI_THREAD_POOL_H_
#define NINFER_KV_FFI_THREAD_POOL_H_

#include <cstdint>
#include <functional>

namespace ninfer_kv_ffi {

// Total threads (caller included) that ParallelFor uses.
int PoolThreads();

// Runs fn(i) for i in [0, n) on the pool and the calling thread.  fn must not throw and must not
// call ParallelFor itself.
void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn);

}  // namespace ninfer_kv_ffi

#endif  // NINFER_KV_FFI_THREAD_POOL_H_
