// What every scheduler (engine/scheduler.h's for generation, engine/embedding_scheduler.h's for
// embeddings) keeps around its one worker thread: the bounded queue of waiting requests, the stats
// it publishes, and the stop. The derived scheduler starts the thread, takes requests from
// waiting_ under mutex_, and calls shutdown() in its destructor, so that the thread is joined
// before the members it uses go.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

#include "core/error.h"
#include "engine/speculative.h"

namespace kiln {

struct SchedulerStats {
  int64_t waiting = 0;
  int64_t running = 0;
  int64_t cache_tokens_used = 0;
  int64_t cache_tokens_total = 0;
  int64_t steps = 0;
  int64_t prefix_query_tokens = 0;  // prompt tokens admitted
  int64_t prefix_hit_tokens = 0;    // of them, served from the prefix cache
  // The paged KV cache's blocks (engine/generation_core.h's KvCacheStats): free, cached and held by
  // no running request, held; and the preemptions so far.
  int64_t kv_blocks_total = 0;
  int64_t kv_blocks_free = 0;
  int64_t kv_blocks_cached = 0;
  int64_t kv_blocks_used = 0;
  int64_t preemptions = 0;
  int64_t prefix_snapshots = 0;     // a hybrid model's recurrent-state snapshots held for the prefix cache
  SpeculationCounts speculation;    // verify steps, proposed and accepted tokens (engine/speculative.h)
};

class QueueFull : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// What a request in flight is told when the scheduler stops without finishing it.
inline constexpr const char* kSchedulerShuttingDown = "the server is shutting down";

template <typename Waiting>
class SchedulerQueue {
 public:
  SchedulerQueue(const SchedulerQueue&) = delete;
  SchedulerQueue& operator=(const SchedulerQueue&) = delete;

  SchedulerStats stats() const {
    std::lock_guard lock(mutex_);
    return stats_;
  }
  // Stops accepting work and waits for the thread: it cancels (or, with finish = true, completes)
  // everything in flight.
  void shutdown(bool finish) {
    {
      std::lock_guard lock(mutex_);
      if (stopping_ && !thread_.joinable()) return;
      stopping_ = true;
      finish_on_stop_ = finish;
    }
    wake_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

 protected:
  explicit SchedulerQueue(int64_t max_queue) : max_queue_(max_queue) {}
  ~SchedulerQueue() = default;

  // Queues a request for the thread. Fails while shutting down; throws QueueFull when max_queue
  // requests already wait.
  void enqueue(Waiting waiting) {
    {
      std::lock_guard lock(mutex_);
      if (stopping_) fail(kSchedulerShuttingDown);
      if (static_cast<int64_t>(waiting_.size()) >= max_queue_)
        throw QueueFull("the request queue is full (" + std::to_string(max_queue_) + " waiting)");
      waiting_.push_back(std::move(waiting));
      stats_.waiting = static_cast<int64_t>(waiting_.size());
    }
    wake_.notify_one();
  }

  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Waiting> waiting_;
  SchedulerStats stats_;
  bool stopping_ = false;
  bool finish_on_stop_ = false;
  std::thread thread_;

 private:
  int64_t max_queue_;
};

}  // namespace kiln
