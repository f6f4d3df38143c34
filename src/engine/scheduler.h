// Continuous batching: requests join and leave the decode batch at every step, and new prompts
// are prefilled in chunks interleaved with decode. One scheduler thread owns the model.
//
// By the invariance contract (every op's per-element reduction order is independent of the
// batch), and because each request samples from its own seeded generator, a request's tokens
// are the same whether it is served alone or among others.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "engine/decode_graph.h"
#include "engine/generation.h"
#include "engine/sampler.h"
#include "model/model.h"

namespace kiln {

struct TokenEvent {
  int32_t token = -1;  // -1 on a final event that carries no token (cancelled, error)
  float logprob = 0.0f;
  std::vector<std::pair<int32_t, float>> top_logprobs;
  bool finished = false;
  std::string finish_reason;  // "stop" | "length" | "cancelled" | "error" (on the final event)
  std::string error;
};

struct GenerationRequest {
  std::vector<int32_t> prompt;
  int64_t max_tokens = 256;
  SamplingParams sampling;
  std::vector<int32_t> stop_ids;
  int32_t top_logprobs = 0;  // how many alternatives to report per token (0: none)
};

// The consumer side of one request: events arrive in order; the last one has finished = true.
class RequestStream {
 public:
  // Waits up to `timeout` for the next event.
  std::optional<TokenEvent> next(std::chrono::milliseconds timeout);
  // Asks the scheduler to stop the request (its slot is freed at the next step).
  void cancel() { cancelled_.store(true); }
  bool cancelled() const { return cancelled_.load(); }
  int64_t prompt_tokens() const { return prompt_tokens_; }

 private:
  friend class Scheduler;
  void push(TokenEvent event);

  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<TokenEvent> events_;
  std::atomic<bool> cancelled_{false};
  int64_t prompt_tokens_ = 0;
};

struct SchedulerOptions {
  int32_t max_batch = 8;           // sequences decoded together (= cache slots)
  int64_t context_tokens = 4096;   // per-sequence capacity (prompt + generation)
  int64_t max_queue = 64;          // waiting requests beyond this are refused (QueueFull)
  int64_t prefill_chunk = 256;     // most prompt tokens one sequence prefills per step (multiple of 64)
};

struct SchedulerStats {
  int64_t waiting = 0;
  int64_t running = 0;
  int64_t cache_tokens_used = 0;
  int64_t cache_tokens_total = 0;
  int64_t steps = 0;
};

class QueueFull : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Scheduler {
 public:
  Scheduler(Model& model, SchedulerOptions options);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queues a request. Throws kiln::Error for an invalid request (e.g. longer than the context)
  // and QueueFull when the queue is at capacity.
  std::shared_ptr<RequestStream> submit(GenerationRequest request);
  SchedulerStats stats() const;
  const SchedulerOptions& options() const { return options_; }
  // Stops accepting work; cancels (or, with finish = true, completes) everything in flight.
  void shutdown(bool finish);

 private:
  struct Active;
  void run();
  void step(std::vector<std::unique_ptr<Active>>& running);

  Model& model_;
  SchedulerOptions options_;
  std::unique_ptr<ModelCache> cache_;
  std::unique_ptr<DecodeGraphs> decode_graphs_;  // null on backends without GraphOps (the CPU)
  // The requests (Active::id, in row order) of the decode step in flight: queued on the device,
  // its tokens not yet read. Empty when none is. Only the scheduler thread touches it.
  std::vector<uint64_t> in_flight_;
  uint64_t admitted_ = 0;  // requests admitted so far (the last Active::id)
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::pair<GenerationRequest, std::shared_ptr<RequestStream>>> waiting_;
  std::vector<int32_t> free_slots_;
  SchedulerStats stats_;
  bool stopping_ = false;
  bool finish_on_stop_ = false;
  std::thread thread_;
};

}  // namespace kiln
