#include "engine/scheduler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"

namespace kiln {

std::optional<TokenEvent> RequestStream::next(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  if (!ready_.wait_for(lock, timeout, [&] { return !events_.empty(); })) return std::nullopt;
  TokenEvent event = std::move(events_.front());
  events_.pop_front();
  return event;
}

void RequestStream::push(TokenEvent event) {
  {
    std::lock_guard lock(mutex_);
    events_.push_back(std::move(event));
  }
  ready_.notify_all();
}

struct Scheduler::Active {
  GenerationRequest request;
  std::shared_ptr<RequestStream> stream;
  Sampler sampler;
  int32_t slot = 0;
  int64_t prefilled = 0;  // prompt tokens already in the cache
  int32_t next_input = -1;  // the last sampled token, fed at the next decode step
  int64_t generated = 0;
  uint64_t id = 0;  // unique among the scheduler's requests: names its rows in a step in flight
};

namespace {

constexpr int64_t kChunkAlignment = 64;  // prefill splits fall on multiples of 64 (hybrid GDN chunks)

std::vector<std::pair<int32_t, float>> top_logprobs(std::span<const float> logits, int32_t count) {
  const double maximum = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (float logit : logits) sum += std::exp(static_cast<double>(logit) - maximum);
  const double log_sum = std::log(sum);
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  const size_t keep = std::min<size_t>(count, order.size());
  std::partial_sort(order.begin(), order.begin() + keep, order.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  std::vector<std::pair<int32_t, float>> top;
  for (size_t i = 0; i < keep; ++i)
    top.emplace_back(order[i], static_cast<float>(logits[order[i]] - maximum - log_sum));
  return top;
}

}  // namespace

Scheduler::Scheduler(Model& model, SchedulerOptions options) : model_(model), options_(options) {
  if (options_.max_batch < 1) fail("max batch must be at least 1, got {}", options_.max_batch);
  if (options_.prefill_chunk < kChunkAlignment || options_.prefill_chunk % kChunkAlignment != 0)
    fail("prefill chunk must be a positive multiple of {}, got {}", kChunkAlignment, options_.prefill_chunk);
  // Decode steps run as captured graphs where the backend can; their padded rows need the spare
  // slots of decode_bucket(max_batch) (engine/decode_graph.h), which requests never hold.
  const bool graphs = DecodeGraphs::supported(model_);
  cache_ = model_.make_cache(graphs ? decode_bucket(options_.max_batch) : options_.max_batch, options_.context_tokens);
  if (graphs) decode_graphs_ = std::make_unique<DecodeGraphs>(model_, *cache_);
  for (int32_t slot = options_.max_batch - 1; slot >= 0; --slot) free_slots_.push_back(slot);
  stats_.cache_tokens_total = options_.max_batch * options_.context_tokens;
  thread_ = std::thread([this] { run(); });
}

Scheduler::~Scheduler() { shutdown(false); }

std::shared_ptr<RequestStream> Scheduler::submit(GenerationRequest request) {
  const auto prompt_length = static_cast<int64_t>(request.prompt.size());
  if (prompt_length == 0) fail("the prompt is empty");
  if (prompt_length >= options_.context_tokens)
    fail("the prompt has {} tokens but the context holds {} (prompt and completion together)", prompt_length,
         options_.context_tokens);
  if (request.max_tokens < 0) fail("max_tokens must be ≥ 0, got {}", request.max_tokens);
  request.sampling.validate();
  const int64_t vocab = model_.config().vocab_size;
  for (int32_t token : request.prompt)
    if (token < 0 || token >= vocab) fail("prompt token id {} is outside the vocabulary (size {})", token, vocab);
  request.max_tokens = std::min(request.max_tokens, options_.context_tokens - prompt_length);

  auto stream = std::make_shared<RequestStream>();
  stream->prompt_tokens_ = prompt_length;
  {
    std::lock_guard lock(mutex_);
    if (stopping_) fail("the server is shutting down");
    if (static_cast<int64_t>(waiting_.size()) >= options_.max_queue)
      throw QueueFull("the request queue is full (" + std::to_string(options_.max_queue) + " waiting)");
    waiting_.emplace_back(std::move(request), stream);
    stats_.waiting = static_cast<int64_t>(waiting_.size());
  }
  wake_.notify_one();
  return stream;
}

SchedulerStats Scheduler::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

void Scheduler::shutdown(bool finish) {
  {
    std::lock_guard lock(mutex_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
    finish_on_stop_ = finish;
  }
  wake_.notify_one();
  if (thread_.joinable()) thread_.join();
}

void Scheduler::run() {
  std::vector<std::unique_ptr<Active>> running;
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !waiting_.empty() || !running.empty(); });
      if (stopping_ && !finish_on_stop_) {
        for (auto& [request, stream] : waiting_) stream->push({-1, 0, {}, true, "cancelled", "server shutting down"});
        waiting_.clear();
        for (auto& active : running) active->stream->push({-1, 0, {}, true, "cancelled", "server shutting down"});
        return;
      }
      if (stopping_ && waiting_.empty() && running.empty()) return;
      while (!free_slots_.empty() && !waiting_.empty()) {
        auto [request, stream] = std::move(waiting_.front());
        waiting_.pop_front();
        auto active = std::make_unique<Active>(Active{std::move(request), std::move(stream),
                                                      Sampler(SamplingParams{}), free_slots_.back()});
        active->sampler = Sampler(active->request.sampling);
        free_slots_.pop_back();
        active->id = ++admitted_;
        cache_->reset_slot(active->slot);
        running.push_back(std::move(active));
      }
      stats_.waiting = static_cast<int64_t>(waiting_.size());
      stats_.running = static_cast<int64_t>(running.size());
    }
    step(running);
  }
}

void Scheduler::step(std::vector<std::unique_ptr<Active>>& running) {
  auto finish = [&](Active& active, TokenEvent event) {
    active.stream->push(std::move(event));
    std::lock_guard lock(mutex_);
    free_slots_.push_back(active.slot);
  };
  // Drop cancelled requests (a disconnected client) before spending compute on them.
  std::erase_if(running, [&](const std::unique_ptr<Active>& active) {
    if (!active->stream->cancelled()) return false;
    finish(*active, {-1, 0, {}, true, "cancelled", ""});
    return true;
  });
  // With nothing left to run the loop sleeps, so the stats must say so now (a cancelled last
  // request would otherwise stay counted as running, holding its cache positions).
  auto publish_idle = [&] {
    std::lock_guard lock(mutex_);
    stats_.running = 0;
    stats_.cache_tokens_used = 0;
  };
  // A step that fails ends every running request with the error; the server keeps serving.
  auto fail_running = [&](const std::exception& error) {
    while (decode_graphs_ && decode_graphs_->queued() > 0) {
      try {
        decode_graphs_->collect();
      } catch (const std::exception&) {
        // the step's own error is the one reported
      }
    }
    in_flight_.clear();
    for (auto& active : running) finish(*active, {-1, 0, {}, true, "error", error.what()});
    running.clear();
    publish_idle();
  };
  // Takes a sampled token into its request (row: its logits, for top logprobs); false when the
  // request ends with it.
  auto accept = [&](Active& active, const SampledToken& token, std::span<const float> row) {
    ++active.generated;
    active.next_input = token.token;
    TokenEvent event{token.token, token.logprob, {}, false, "", ""};
    if (active.request.top_logprobs > 0) event.top_logprobs = top_logprobs(row, active.request.top_logprobs);
    const auto& stops = active.request.stop_ids;
    if (std::find(stops.begin(), stops.end(), token.token) != stops.end()) {
      event.finished = true;
      event.finish_reason = "stop";
    } else if (active.generated >= active.request.max_tokens) {
      event.finished = true;
      event.finish_reason = "length";
    }
    if (event.finished) {
      finish(active, std::move(event));
      return false;
    }
    active.stream->push(std::move(event));
    return true;
  };
  auto publish = [&] {
    int64_t cache_used = 0;
    for (const auto& active : running) cache_used += active->prefilled + active->generated;
    std::lock_guard lock(mutex_);
    stats_.steps++;
    stats_.running = static_cast<int64_t>(running.size());
    stats_.cache_tokens_used = cache_used;
  };
  // The rows of a decode step for every running request, each taking its last token (from the
  // host, or fed on the device from the step in flight).
  auto decode_rows = [&](bool fed) {
    std::vector<DecodeRow> rows;
    for (const auto& active : running) {
      const auto prompt_length = static_cast<int64_t>(active->request.prompt.size());
      DecodeRow row{active->slot, static_cast<int32_t>(prompt_length + active->generated - 1), active->next_input,
                    &active->sampler};
      if (fed) {
        row.position += 1;
        row.fed_from = static_cast<int32_t>(std::find(in_flight_.begin(), in_flight_.end(), active->id) -
                                            in_flight_.begin());
      }
      rows.push_back(row);
    }
    return rows;
  };
  auto ids_of_running = [&] {
    std::vector<uint64_t> ids;
    for (const auto& active : running) ids.push_back(active->id);
    return ids;
  };

  if (!in_flight_.empty()) {
    // A decode step is in flight (queued, its tokens not yet read). The next one is queued before
    // reading them — it takes them on the device — when every running request was in it and
    // decodes again, none asks for logits, each has room for two more tokens, and no waiting
    // request could be admitted now (it would need a prefill step first).
    bool queue_next = std::all_of(running.begin(), running.end(), [&](const auto& active) {
      return std::find(in_flight_.begin(), in_flight_.end(), active->id) != in_flight_.end() &&
             active->request.top_logprobs == 0 && active->generated + 2 <= active->request.max_tokens;
    });
    {
      std::lock_guard lock(mutex_);
      if (!waiting_.empty() && !free_slots_.empty()) queue_next = false;
    }
    std::vector<uint64_t> next;
    std::vector<SampledToken> tokens;
    try {
      if (queue_next && !running.empty()) {
        decode_graphs_->launch(decode_rows(true));
        next = ids_of_running();
      }
      tokens = decode_graphs_->collect();
    } catch (const std::exception& error) {
      fail_running(error);
      return;
    }
    // Rows of requests that ended meanwhile (a stop, a cancellation) are dropped.
    std::vector<std::unique_ptr<Active>> still_running;
    for (auto& active : running) {
      const auto row = std::find(in_flight_.begin(), in_flight_.end(), active->id);
      if (row == in_flight_.end() || accept(*active, tokens[row - in_flight_.begin()], {}))
        still_running.push_back(std::move(active));
    }
    running = std::move(still_running);
    in_flight_ = std::move(next);
    if (running.empty() && !in_flight_.empty()) {
      try {
        decode_graphs_->collect();  // every request of the queued step has ended
      } catch (const std::exception& error) {
        fail_running(error);
        return;
      }
      in_flight_.clear();
    }
    publish();
    return;
  }
  if (running.empty()) {
    publish_idle();
    return;
  }

  std::vector<SequenceStep> steps;
  std::vector<bool> samples;  // whether the step's logit row is used to sample a token
  bool every_sequence_decodes = true;
  for (const auto& active : running) {
    const auto prompt_length = static_cast<int64_t>(active->request.prompt.size());
    if (active->prefilled < prompt_length) {
      int64_t end = std::min(prompt_length, active->prefilled + options_.prefill_chunk);
      if (end < prompt_length) end = end / kChunkAlignment * kChunkAlignment;
      steps.push_back({active->slot, static_cast<int32_t>(active->prefilled),
                       std::vector<int32_t>(active->request.prompt.begin() + active->prefilled,
                                            active->request.prompt.begin() + end),
                       false});
      samples.push_back(end == prompt_length);
      active->prefilled = end;
      every_sequence_decodes = false;
    } else {
      steps.push_back({active->slot, static_cast<int32_t>(prompt_length + active->generated - 1), {active->next_input}, false});
      samples.push_back(true);
    }
  }

  // A step in which every sequence decodes runs as a captured graph and samples on the device;
  // the logits come back only when a request asks for top logprobs, and otherwise the step is
  // left in flight: the next call queues the following step before reading its tokens.
  // (A sequence whose last prompt chunk is in this step is not decoding yet.)
  const bool on_device = decode_graphs_ && every_sequence_decodes;
  const bool wants_logits =
      std::any_of(running.begin(), running.end(), [](const auto& active) { return active->request.top_logprobs > 0; });
  std::vector<SampledToken> device_tokens;
  Tensor logits;
  try {
    if (on_device && !wants_logits) {
      decode_graphs_->launch(decode_rows(false));
      in_flight_ = ids_of_running();
      publish();
      return;
    }
    if (on_device) {
      device_tokens = decode_graphs_->step(decode_rows(false));
      logits = model_.backend().download(decode_graphs_->last_logits());
    } else {
      logits = run_step(model_, *cache_, steps);
    }
  } catch (const std::exception& error) {
    fail_running(error);
    return;
  }
  const int64_t vocab = model_.config().vocab_size;
  std::vector<std::unique_ptr<Active>> still_running;
  for (size_t index = 0; index < running.size(); ++index) {
    Active& active = *running[index];
    if (samples[index] && active.request.max_tokens == 0) {
      finish(active, {-1, 0, {}, true, "length", ""});
      continue;
    }
    if (samples[index]) {
      const std::span<const float> row =
          logits.defined() ? std::span<const float>(logits.data<float>() + index * vocab, static_cast<size_t>(vocab))
                           : std::span<const float>();
      const SampledToken token = on_device ? device_tokens[index] : active.sampler.sample(row);
      if (!accept(active, token, row)) continue;
    }
    still_running.push_back(std::move(running[index]));
  }
  running = std::move(still_running);
  publish();
}

}  // namespace kiln
