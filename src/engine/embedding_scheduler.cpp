#include "engine/embedding_scheduler.h"

#include <utility>

#include "core/error.h"
#include "engine/generation.h"
#include "engine/step_plan.h"

namespace kiln {

std::optional<std::vector<std::vector<float>>> EmbeddingJob::wait(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  ready_.wait_for(lock, timeout, [&] { return failure_ || completed_ == inputs_.size(); });
  if (failure_) fail("{}", *failure_);
  if (completed_ < inputs_.size()) return std::nullopt;
  return embeddings_;
}

bool EmbeddingJob::failed() {
  std::lock_guard lock(mutex_);
  return failure_.has_value();
}

void EmbeddingJob::complete(size_t input, std::vector<float> embedding) {
  {
    std::lock_guard lock(mutex_);
    embeddings_[input] = std::move(embedding);
    ++completed_;
  }
  ready_.notify_all();
}

void EmbeddingJob::fail_with(const std::string& reason) {
  {
    std::lock_guard lock(mutex_);
    if (!failure_) failure_ = reason;
  }
  ready_.notify_all();
}

EmbeddingScheduler::EmbeddingScheduler(Model& model, EmbeddingSchedulerOptions options)
    : SchedulerQueue(options.max_queue), model_(model), options_(std::move(options)) {
  const ServingSizes sizes{options_.max_batch, options_.context_tokens, options_.prefill_chunk};
  check_serving_sizes(sizes, model_.config());
  step_token_budget_ = sizes.step_token_budget();
  cache_ = model_.make_cache(options_.max_batch, options_.context_tokens);
  for (int32_t slot = options_.max_batch - 1; slot >= 0; --slot) free_slots_.push_back(slot);
  stats_.cache_tokens_total = options_.max_batch * options_.context_tokens;
  thread_ = std::thread([this] { run(); });
}

EmbeddingScheduler::~EmbeddingScheduler() { shutdown(false); }

std::shared_ptr<EmbeddingJob> EmbeddingScheduler::submit(std::vector<std::vector<int32_t>> inputs, int64_t dimensions) {
  const ModelConfig& config = model_.config();
  if (inputs.empty()) fail("an embedding request needs at least one input");
  if (dimensions < 1 || dimensions > config.hidden_size)
    fail("dimensions must be 1 to {} (the model's hidden size), got {}", config.hidden_size, dimensions);
  auto job = std::make_shared<EmbeddingJob>();
  for (size_t index = 0; index < inputs.size(); ++index) {
    const std::vector<int32_t>& input = inputs[index];
    if (input.empty()) fail("input {} is empty", index);
    if (static_cast<int64_t>(input.size()) > options_.context_tokens)
      fail("input {} has {} tokens but the context holds {}", index, input.size(), options_.context_tokens);
    for (int32_t token : input)
      if (token < 0 || token >= config.vocab_size)
        fail("input {}: token id {} is outside the vocabulary (size {})", index, token, config.vocab_size);
    job->tokens_ += static_cast<int64_t>(input.size());
  }
  job->embeddings_.resize(inputs.size());
  job->inputs_ = std::move(inputs);
  job->dimensions_ = dimensions;
  enqueue(job);
  return job;
}

void EmbeddingScheduler::run() {
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !waiting_.empty() || !running_.empty(); });
      if (stopping_ && !finish_on_stop_) {
        for (const auto& job : waiting_) job->fail_with(kSchedulerShuttingDown);
        waiting_.clear();
        for (const Sequence& sequence : running_) sequence.job->fail_with(kSchedulerShuttingDown);
        running_.clear();
        return;
      }
      if (stopping_ && waiting_.empty() && running_.empty()) return;
      admit_waiting();
    }
    const bool ran = step();
    publish_stats(ran);
  }
}

void EmbeddingScheduler::admit_waiting() {
  const int64_t hidden_size = model_.config().hidden_size;
  while (!free_slots_.empty() && !waiting_.empty()) {
    const std::shared_ptr<EmbeddingJob> job = waiting_.front();
    if (job->cancelled() || job->failed()) {
      waiting_.pop_front();
      continue;
    }
    const size_t input = job->admitted_++;
    if (job->admitted_ == job->inputs_.size()) waiting_.pop_front();
    const int32_t slot = free_slots_.back();
    free_slots_.pop_back();
    cache_->reset_slot(slot);
    const std::vector<int32_t>& tokens = job->inputs_[input];
    running_.push_back({job, input, &tokens, slot, 0,
                        PooledEmbedding(options_.pooling.mode, static_cast<int64_t>(tokens.size()), hidden_size)});
  }
  stats_.waiting = static_cast<int64_t>(waiting_.size());
  stats_.running = static_cast<int64_t>(running_.size());
}

bool EmbeddingScheduler::step() {
  // The inputs of a request that was cancelled or failed give up their slots before any compute
  // is spent on them.
  std::erase_if(running_, [&](const Sequence& sequence) {
    if (!sequence.job->cancelled() && !sequence.job->failed()) return false;
    free_slots_.push_back(sequence.slot);
    return true;
  });
  if (running_.empty()) return false;
  try {
    execute_step();
  } catch (const std::exception& error) {
    // The step's inputs fail with its error; the scheduler goes on with the next ones.
    for (const Sequence& sequence : running_) {
      sequence.job->fail_with(error.what());
      free_slots_.push_back(sequence.slot);
    }
    running_.clear();
  }
  return true;
}

void EmbeddingScheduler::execute_step() {
  std::vector<SequenceProgress> progress;
  for (const Sequence& sequence : running_)
    progress.push_back({static_cast<int64_t>(sequence.tokens->size()), sequence.prefilled});
  const StepPlan plan = plan_step(progress, options_.prefill_chunk, step_token_budget_);

  struct PooledRow {
    size_t sequence;
    int64_t position;
  };
  std::vector<SequenceStep> steps;
  std::vector<int32_t> rows;
  std::vector<PooledRow> row_positions;  // what each row is
  int32_t first_token = 0;
  for (const PlannedWork& work : plan.work) {
    const Sequence& sequence = running_[work.sequence];
    const auto begin = sequence.tokens->begin();
    steps.push_back({sequence.slot, static_cast<int32_t>(work.begin),
                     std::vector<int32_t>(begin + work.begin, begin + work.end), false});
    for (int64_t position = work.begin; position < work.end; ++position) {
      // Every chunk gives its last row, as a generation step does (so no step reads no row); the
      // pooling takes only the rows it reads.
      if (!sequence.pooled.reads(position) && position != work.end - 1) continue;
      rows.push_back(first_token + static_cast<int32_t>(position - work.begin));
      row_positions.push_back({work.sequence, position});
    }
    first_token += static_cast<int32_t>(work.end - work.begin);
  }
  const Tensor hidden = run_hidden_step(model_, *cache_, steps, rows);

  const int64_t hidden_size = model_.config().hidden_size;
  for (size_t row = 0; row < rows.size(); ++row) {
    const auto [index, position] = row_positions[row];
    PooledEmbedding& pooled = running_[index].pooled;
    if (pooled.reads(position))
      pooled.add(position, std::span<const float>(hidden.data<const float>() + static_cast<int64_t>(row) * hidden_size,
                                                  static_cast<size_t>(hidden_size)));
  }
  for (const PlannedWork& work : plan.work) running_[work.sequence].prefilled = work.end;
  // An input whose last chunk ran is done: its embedding goes to its request, its slot to the
  // next waiting input.
  std::vector<Sequence> still_running;
  for (Sequence& sequence : running_) {
    if (sequence.prefilled < static_cast<int64_t>(sequence.tokens->size())) {
      still_running.push_back(std::move(sequence));
      continue;
    }
    sequence.job->complete(sequence.input,
                           sequence.pooled.finish(sequence.job->dimensions_, options_.pooling.normalize));
    free_slots_.push_back(sequence.slot);
  }
  running_ = std::move(still_running);
}

void EmbeddingScheduler::publish_stats(bool ran) {
  int64_t cache_used = 0;
  for (const Sequence& sequence : running_) cache_used += sequence.prefilled;
  std::lock_guard lock(mutex_);
  if (ran) stats_.steps++;
  stats_.waiting = static_cast<int64_t>(waiting_.size());
  stats_.running = static_cast<int64_t>(running_.size());
  stats_.cache_tokens_used = cache_used;
}

}  // namespace kiln
