// A fixed pool of worker threads that share each parallel_for by grain-aligned chunks.
//
// Invariance contract: parallel_for splits an index range into contiguous chunks whose
// boundaries are multiples of `grain`; a kernel must compute each output element entirely
// inside one chunk, so neither the thread count nor which thread takes which chunk changes any
// element's reduction order (and therefore never changes a result bit).
//
// Why chunks are taken dynamically and workers spin before sleeping: a decode step is a few
// hundred short parallel_for calls (~100 µs each for a 1B model). A condition-variable wake-up
// costs tens of µs per call, and a static split waits for the slowest thread whenever the other
// core is briefly busy; both cost several percent of decode bandwidth on a 2-core machine.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kiln {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs body(begin, end) over [0, count) in chunks whose boundaries are multiples of `grain`;
  // the calling thread works too. Blocks until every chunk is done. Not reentrant.
  void parallel_for(int64_t count, int64_t grain, const std::function<void(int64_t, int64_t)>& body);

  // The pool the CPU backend runs on from the calling thread: the thread's own pool when one is
  // installed (use_on_this_thread), else the process-wide pool (hardware concurrency unless set).
  static ThreadPool& global();
  static void set_global_threads(int threads);
  // Installs `pool` (borrowed; nullptr: none) as the calling thread's pool. A pool is not
  // reentrant, so threads that drive backends concurrently (the ranks of a tensor-parallel model)
  // each need their own.
  static void use_on_this_thread(ThreadPool* pool);

 private:
  void worker_loop();
  void run_chunks();

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;

  // The job being run; written by parallel_for before generation_ is bumped (release) and read
  // by workers after they observe the bump (acquire).
  const std::function<void(int64_t, int64_t)>* body_ = nullptr;
  int64_t count_ = 0;
  int64_t chunk_ = 0;
  std::atomic<int64_t> next_{0};
  std::atomic<int> busy_workers_{0};
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> stopping_{false};
};

}  // namespace kiln
