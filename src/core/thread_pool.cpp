#include "core/thread_pool.h"

#include <algorithm>
#include <memory>

#include "core/error.h"

namespace kiln {

ThreadPool::ThreadPool(int threads) {
  if (threads < 1) fail("thread count must be at least 1, got {}", threads);
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (auto& worker : workers_) worker.join();
}

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;
  for (;;) {
    std::unique_lock lock(mutex_);
    wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
    if (stopping_) return;
    seen = generation_;
    auto block = static_cast<size_t>(index) < blocks_.size() ? blocks_[index] : std::pair<int64_t, int64_t>{0, 0};
    const auto* body = body_;
    lock.unlock();
    if (block.second > block.first) (*body)(block.first, block.second);
    lock.lock();
    if (--pending_ == 0) done_.notify_one();
  }
}

void ThreadPool::parallel_for(int64_t count, int64_t grain,
                              const std::function<void(int64_t, int64_t)>& body) {
  if (count <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t units = (count + grain - 1) / grain;
  const int64_t parts = std::min<int64_t>(units, size());
  if (parts <= 1) {
    body(0, count);
    return;
  }
  std::vector<std::pair<int64_t, int64_t>> blocks(size());
  for (int64_t part = 0; part < parts; ++part) {
    int64_t begin = std::min(count, units * part / parts * grain);
    int64_t end = std::min(count, units * (part + 1) / parts * grain);
    blocks[part] = {begin, end};
  }
  {
    std::lock_guard lock(mutex_);
    blocks_ = blocks;
    body_ = &body;
    pending_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  wake_.notify_all();
  body(blocks[0].first, blocks[0].second);
  std::unique_lock lock(mutex_);
  done_.wait(lock, [&] { return pending_ == 0; });
}

namespace {
std::unique_ptr<ThreadPool>& global_pool() {
  static std::unique_ptr<ThreadPool> pool;
  return pool;
}
}  // namespace

ThreadPool& ThreadPool::global() {
  auto& pool = global_pool();
  if (!pool) pool = std::make_unique<ThreadPool>(std::max(1u, std::thread::hardware_concurrency()));
  return *pool;
}

void ThreadPool::set_global_threads(int threads) { global_pool() = std::make_unique<ThreadPool>(threads); }

}  // namespace kiln
