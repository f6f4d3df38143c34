// Batching for embeddings (kiln serve --embeddings): every input of every request in flight is a
// sequence in a cache slot, prefilled in chunks by the step planner (engine/step_plan.h) alongside
// the others; each step is one forward stopped before lm_head (Model::forward_hidden), whose rows
// feed each input's pooling (engine/embedding.h). An input ends when its last chunk has run: its
// slot takes the next waiting input. One scheduler thread owns the model, as the generation
// Scheduler's does; the two never share one.
//
// An input's embedding is the same bits alone or among others: its hidden rows are (the
// invariance contract) and its pooling reads only them.
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

#include "engine/embedding.h"
#include "engine/scheduler_queue.h"
#include "engine/serving_sizes.h"
#include "io/pooling_config.h"
#include "model/model.h"

namespace kiln {

struct EmbeddingSchedulerOptions {
  int32_t max_batch = 8;          // inputs prefilled together (= cache slots)
  int64_t context_tokens = 4096;  // the most tokens one input may have
  int64_t max_queue = 64;         // waiting requests beyond this are refused (QueueFull)
  int64_t prefill_chunk = kDefaultPrefillChunk;  // most tokens an input prefills per step (multiple of 64)
  PoolingConfig pooling = {};
};

// One request's inputs on their way through the scheduler; its handler waits for all of them.
class EmbeddingJob {
 public:
  // Waits up to `timeout` for every input's embedding, in input order; nothing while some are still
  // missing. Throws kiln::Error with the reason when the job failed (a failed step, a shutdown).
  std::optional<std::vector<std::vector<float>>> wait(std::chrono::milliseconds timeout);
  // Asks the scheduler to drop the job's inputs (at its next step).
  void cancel() { cancelled_.store(true); }
  bool cancelled() const { return cancelled_.load(); }
  // Tokens over every input.
  int64_t tokens() const { return tokens_; }

 private:
  friend class EmbeddingScheduler;
  void complete(size_t input, std::vector<float> embedding);
  void fail_with(const std::string& reason);
  bool failed();

  std::vector<std::vector<int32_t>> inputs_;
  int64_t dimensions_ = 0;
  int64_t tokens_ = 0;
  size_t admitted_ = 0;  // inputs handed to slots so far (the scheduler thread's)
  std::mutex mutex_;
  std::condition_variable ready_;
  std::vector<std::vector<float>> embeddings_;
  size_t completed_ = 0;
  std::optional<std::string> failure_;
  std::atomic<bool> cancelled_{false};
};

// Its stats: waiting counts requests, running and the cache positions count inputs.
class EmbeddingScheduler : public SchedulerQueue<std::shared_ptr<EmbeddingJob>> {
 public:
  // Checks the sizes against the model (check_serving_sizes) and starts the scheduler thread.
  EmbeddingScheduler(Model& model, EmbeddingSchedulerOptions options);
  ~EmbeddingScheduler();

  // Queues a request: one or more inputs of 1 to context_tokens token ids each, within the
  // vocabulary, embedded with `dimensions` values (1 to hidden_size). Throws kiln::Error for an
  // invalid request and QueueFull when the queue is at capacity.
  std::shared_ptr<EmbeddingJob> submit(std::vector<std::vector<int32_t>> inputs, int64_t dimensions);
  const EmbeddingSchedulerOptions& options() const { return options_; }
  // Values in an embedding before any `dimensions` cut: the model's hidden size.
  int64_t hidden_size() const { return model_.config().hidden_size; }

 private:
  struct Sequence {
    std::shared_ptr<EmbeddingJob> job;
    size_t input = 0;
    const std::vector<int32_t>* tokens = nullptr;  // the job's input
    int32_t slot = 0;
    int64_t prefilled = 0;  // tokens already run
    PooledEmbedding pooled;
  };

  void run();
  // Moves waiting inputs into free slots (the caller holds mutex_).
  void admit_waiting();
  // Drops the inputs of cancelled and failed jobs, then runs one step; false when none ran.
  bool step();
  // Plans and runs one step over the running inputs, and completes those whose last chunk ran.
  void execute_step();
  void publish_stats(bool ran);

  Model& model_;
  EmbeddingSchedulerOptions options_;
  int64_t step_token_budget_ = 0;
  std::unique_ptr<ModelCache> cache_;     // touched by the scheduler thread only
  std::vector<Sequence> running_;         // likewise
  std::vector<int32_t> free_slots_;       // likewise
};

}  // namespace kiln
