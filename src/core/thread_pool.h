// A fixed pool of worker threads with a static, deterministic partition of work.
//
// Invariance contract: parallel_for splits an index range into contiguous blocks; a kernel
// must compute each output element entirely inside one block, so the thread count never changes
// any element's reduction order (and therefore never changes a result bit).
#pragma once

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

  // Runs body(begin, end) over [0, count) split into at most size() blocks whose boundaries
  // are multiples of `grain`; the calling thread takes block 0. Blocks until all are done.
  void parallel_for(int64_t count, int64_t grain, const std::function<void(int64_t, int64_t)>& body);

  // The process-wide pool used by the CPU backend (hardware concurrency unless set).
  static ThreadPool& global();
  static void set_global_threads(int threads);

 private:
  void worker_loop(int index);

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  const std::function<void(int64_t, int64_t)>* body_ = nullptr;
  std::vector<std::pair<int64_t, int64_t>> blocks_;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stopping_ = false;
};

}  // namespace kiln
