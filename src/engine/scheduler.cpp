#include "engine/scheduler.h"

#include "core/error.h"

namespace kiln {

namespace {

TokenEvent shutdown_event() {
  TokenEvent event;
  event.finished = true;
  event.finish_reason = FinishReason::Cancelled;
  event.error = "server shutting down";
  return event;
}

}  // namespace

Scheduler::Scheduler(Model& model, SchedulerOptions options)
    : SchedulerQueue(options.max_queue), model_(model), options_(options) {
  const ServingSizes sizes{options_.max_batch, options_.context_tokens, options_.prefill_chunk, 0, 0.0,
                           options_.prefix_snapshots};
  check_serving_sizes(sizes, model_.config());
  if (options_.kv_cache_tokens < 0 || options_.kv_cache_tokens % kKvBlockTokens != 0)
    fail("the KV cache's {} tokens are not a multiple of its {}-token blocks", options_.kv_cache_tokens, kKvBlockTokens);
  core_ = std::make_unique<GenerationCore>(model_, options_.max_batch, options_.context_tokens,
                                           options_.prefill_chunk, sizes.step_token_budget(), options_.prefix_cache,
                                           options_.kv_cache_tokens / kKvBlockTokens, sizes.snapshots());
  stats_.cache_tokens_total = core_->cache_tokens_total();
  publish_cache_stats();
  thread_ = std::thread([this] { run(); });
}

Scheduler::~Scheduler() { shutdown(false); }

std::shared_ptr<RequestStream> Scheduler::submit(GenerationRequest request) {
  bound_request(request, options_.context_tokens, model_.config().vocab_size);
  auto stream = std::make_shared<RequestStream>();
  stream->prompt_tokens_ = static_cast<int64_t>(request.prompt.size());
  enqueue({std::move(request), stream});
  return stream;
}

void Scheduler::run() {
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !waiting_.empty() || core_->running() > 0; });
      if (stopping_ && !finish_on_stop_) {
        for (auto& [request, stream] : waiting_) stream->push(shutdown_event());
        waiting_.clear();
        core_->cancel_all(shutdown_event().error);
        return;
      }
      if (stopping_ && waiting_.empty() && core_->running() == 0) return;
      while (!waiting_.empty() && core_->can_admit(waiting_.front().first)) {
        auto [request, stream] = std::move(waiting_.front());
        waiting_.pop_front();
        core_->admit(std::move(request), std::move(stream));
      }
      stats_.prefix_query_tokens = core_->prefix_query_tokens();
      stats_.prefix_hit_tokens = core_->prefix_hit_tokens();
      stats_.speculation = core_->speculation_counts();
      stats_.waiting = static_cast<int64_t>(waiting_.size());
      stats_.running = static_cast<int64_t>(core_->running());
    }
    step();
  }
}

void Scheduler::step() {
  const bool ran = core_->step([this] {
    std::lock_guard lock(mutex_);
    return !waiting_.empty();
  });
  // With nothing left to run the loop sleeps, so the stats must say so now (a cancelled last
  // request would otherwise stay counted as running, holding its cache positions).
  const int64_t cache_used = core_->cache_tokens_used();
  std::lock_guard lock(mutex_);
  if (ran) stats_.steps++;
  stats_.running = static_cast<int64_t>(core_->running());
  stats_.cache_tokens_used = cache_used;
  stats_.speculation = core_->speculation_counts();
  publish_cache_stats();
}

void Scheduler::publish_cache_stats() {
  const KvCacheStats cache = core_->kv_cache_stats();
  stats_.kv_blocks_total = cache.blocks;
  stats_.kv_blocks_free = cache.free_blocks;
  stats_.kv_blocks_cached = cache.cached_blocks;
  stats_.kv_blocks_used = cache.used_blocks;
  stats_.preemptions = cache.preemptions;
  stats_.prefix_snapshots = cache.snapshots;
}

}  // namespace kiln
