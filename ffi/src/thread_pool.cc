#include "thread_pool.h"

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "common.h"

namespace ninfer_kv_ffi {
namespace {

struct Job {
  const std::function<void(int64_t)>* fn;
  int64_t n;
  std::atomic<int64_t> next{0};
  int active = 0;  // workers currently inside this job (guarded by the pool mutex)
};

class Pool {
 public:
  explicit Pool(int threads) : threads_(threads) {
    for (int i = 1; i < threads_; ++i) workers_.emplace_back([this] { WorkerLoop(); });
  }

  int threads() const { return threads_; }

  void Run(int64_t n, const std::function<void(int64_t)>& fn) {
    if (n <= 0) return;
    if (threads_ <= 1 || n == 1) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    Job job;
    job.fn = &fn;
    job.n = n;
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back(&job);
    }
    work_cv_.notify_all();
    Drain(&job);
    std::unique_lock<std::mutex> lock(mu_);
    Remove(&job);
    done_cv_.wait(lock, [&] { return job.active == 0; });
  }

 private:
  static void Drain(Job* job) {
    for (;;) {
      int64_t i = job->next.fetch_add(1, std::memory_order_relaxed);
      if (i >= job->n) return;
      (*job->fn)(i);
    }
  }

  void Remove(Job* job) {  // requires mu_
    for (auto it = jobs_.begin(); it != jobs_.end(); ++it) {
      if (*it == job) {
        jobs_.erase(it);
        return;
      }
    }
  }

  void WorkerLoop() {
    ScopedFlushDenormal flush;
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      work_cv_.wait(lock, [&] { return !jobs_.empty(); });
      Job* job = jobs_.front();
      ++job->active;
      lock.unlock();
      Drain(job);
      lock.lock();
      Remove(job);  // exhausted: nobody else needs to pick it up
      if (--job->active == 0) done_cv_.notify_all();
    }
  }

  const int threads_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<Job*> jobs_;
};

int ConfiguredThreads() {
  if (const char* env = std::getenv("NINFER_KV_FFI_THREADS")) {
    char* end = nullptr;
    long v = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && v >= 1) return static_cast<int>(v < 1024 ? v : 1024);
  }
  unsigned hc = std::thread::hardware_concurrency();
  return hc == 0 ? 1 : static_cast<int>(hc);
}

Pool& GetPool() {
  static Pool* pool = new Pool(ConfiguredThreads());  // intentionally never destroyed
  return *pool;
}

}  // namespace

int PoolThreads() { return GetPool().threads(); }

void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn) { GetPool().Run(n, fn); }

}  // namespace ninfer_kv_ffi
