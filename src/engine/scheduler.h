// Continuous batching: requests join and leave the decode batch at every step, and new prompts
// are prefilled in chunks interleaved with decode. One scheduler thread owns the model: it admits
// waiting requests into free cache slots and drives the generation core (engine/generation_core.h)
// a step at a time.
//
// By the invariance contract (every op's per-element reduction order is independent of the
// batch), and because each request samples from its own seeded generator, a request's tokens
// are the same whether it is served alone or among others.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>

#include "engine/generation_core.h"
#include "engine/scheduler_queue.h"
#include "engine/serving_sizes.h"
#include "model/model.h"

namespace kiln {

struct SchedulerOptions {
  int32_t max_batch = 8;           // sequences decoded together (= cache slots)
  int64_t context_tokens = 4096;   // per-sequence capacity (prompt + generation)
  int64_t max_queue = 64;          // waiting requests beyond this are refused (QueueFull)
  int64_t prefill_chunk = kDefaultPrefillChunk;  // most prompt tokens one sequence prefills per step (multiple of 64)
  bool prefix_cache = true;  // reuse cached KV blocks as a new prompt's prefix (GenerationCore)
  // Positions of the paged KV cache's pool (a multiple of 64; 0: max_batch × context_tokens): requests
  // share it, so more may run at once than whole contexts fit (GenerationCore).
  int64_t kv_cache_tokens = 0;
  // Snapshots a hybrid model's prefix cache keeps (ServingSizes::prefix_snapshots; -1: its default).
  int64_t prefix_snapshots = -1;
};

class Scheduler : public SchedulerQueue<std::pair<GenerationRequest, std::shared_ptr<RequestStream>>> {
 public:
  Scheduler(Model& model, SchedulerOptions options);
  ~Scheduler();

  // Queues a request (bound_request against the context). Throws kiln::Error for an invalid
  // request (e.g. longer than the context) and QueueFull when the queue is at capacity.
  std::shared_ptr<RequestStream> submit(GenerationRequest request);
  const SchedulerOptions& options() const { return options_; }

 private:
  void run();
  // Runs one step of the core and publishes the stats it leaves.
  void step();
  // Copies the core's KV cache stats into stats_ (with the mutex held, or before the thread starts).
  void publish_cache_stats();

  Model& model_;
  SchedulerOptions options_;
  std::unique_ptr<GenerationCore> core_;  // touched by the scheduler thread only
};

}  // namespace kiln
