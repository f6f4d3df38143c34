#include "core/thread_pool.h"

#include <algorithm>
#include <memory>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "core/error.h"

namespace kiln {

namespace {

// How long an idle worker polls for the next job before it sleeps: long enough to cover the gap
// between two ops of a decode step, short enough that an idle pool costs no CPU.
constexpr auto kSpinBeforeSleep = std::chrono::microseconds(200);

// Chunks per thread: enough to rebalance when one core is briefly taken, few enough that the
// shared counter is not contended.
constexpr int64_t kChunksPerThread = 4;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

}  // namespace

ThreadPool::ThreadPool(int threads) {
  if (threads < 1) fail("thread count must be at least 1, got {}", threads);
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mutex_);
    stopping_.store(true, std::memory_order_release);
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  for (auto& worker : workers_) worker.join();
}

void ThreadPool::run_chunks() {
  for (;;) {
    const int64_t begin = next_.fetch_add(chunk_, std::memory_order_relaxed);
    if (begin >= count_) return;
    (*body_)(begin, std::min(count_, begin + chunk_));
  }
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  for (;;) {
    const auto spin_until = std::chrono::steady_clock::now() + kSpinBeforeSleep;
    int polls = 0;
    while (generation_.load(std::memory_order_acquire) == seen) {
      cpu_relax();
      if (++polls % 256 == 0 && std::chrono::steady_clock::now() > spin_until) {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
        break;
      }
    }
    seen = generation_.load(std::memory_order_acquire);
    if (stopping_.load(std::memory_order_acquire)) return;
    run_chunks();
    busy_workers_.fetch_sub(1, std::memory_order_release);
  }
}

void ThreadPool::parallel_for(int64_t count, int64_t grain,
                              const std::function<void(int64_t, int64_t)>& body) {
  if (count <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t units = (count + grain - 1) / grain;
  if (units <= 1 || workers_.empty()) {
    body(0, count);
    return;
  }
  const int64_t chunk_units = std::max<int64_t>(1, units / (size() * kChunksPerThread));
  body_ = &body;
  count_ = count;
  chunk_ = chunk_units * grain;
  next_.store(0, std::memory_order_relaxed);
  busy_workers_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
  {
    // Bumped under the mutex so that a worker checking the predicate cannot miss the wake-up.
    std::lock_guard lock(mutex_);
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  run_chunks();
  // A worker that slept may need a moment to be scheduled; yield the core to it after a while.
  int polls = 0;
  while (busy_workers_.load(std::memory_order_acquire) != 0) {
    if (++polls < 4096) cpu_relax();
    else std::this_thread::yield();
  }
}

namespace {
std::unique_ptr<ThreadPool>& global_pool() {
  static std::unique_ptr<ThreadPool> pool;
  return pool;
}
thread_local ThreadPool* this_thread_pool = nullptr;
}  // namespace

ThreadPool& ThreadPool::global() {
  if (this_thread_pool) return *this_thread_pool;
  auto& pool = global_pool();
  if (!pool) pool = std::make_unique<ThreadPool>(std::max(1u, std::thread::hardware_concurrency()));
  return *pool;
}

void ThreadPool::set_global_threads(int threads) { global_pool() = std::make_unique<ThreadPool>(threads); }

void ThreadPool::use_on_this_thread(ThreadPool* pool) { this_thread_pool = pool; }

}  // namespace kiln
