// Continuous batching: every request served among others equals the same request served alone.
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <thread>

#include <gtest/gtest.h>

#include "core/error.h"
#include "engine/generation.h"
#include "engine/scheduler.h"
#include "model_test_support.h"
#include "test_support.h"

using namespace kiln;
using namespace kiln::testing;
using namespace std::chrono_literals;

namespace {

std::vector<int32_t> collect(RequestStream& stream, FinishReason* finish_reason = nullptr) {
  std::vector<int32_t> tokens;
  for (;;) {
    auto event = stream.next(30s);
    if (!event) ADD_FAILURE() << "no event within 30 s";
    if (!event) return tokens;
    if (event->token >= 0) tokens.push_back(event->token);
    if (event->finished) {
      if (finish_reason) *finish_reason = event->finish_reason;
      return tokens;
    }
  }
}

GenerationRequest make_request(const std::vector<int32_t>& prompt, int64_t max_tokens, float temperature, uint64_t seed) {
  GenerationRequest request;
  request.prompt = prompt;
  request.max_tokens = max_tokens;
  request.sampling.temperature = temperature;
  request.sampling.top_k = 40;
  request.sampling.seed = seed;
  return request;
}

TEST(Scheduler, ConcurrentRequestsEqualTheirSoloRuns) {
  const auto fixture = fixtures_dir() / "qwen3-tiny";
  TestModel loaded = open_cpu_model(fixture / "f32");
  const std::vector<int32_t> prompt = fixture_prompt(fixture);

  std::vector<GenerationRequest> requests;
  for (int i = 0; i < 6; ++i)
    requests.push_back(make_request(std::vector<int32_t>(prompt.begin() + i * 7, prompt.begin() + i * 7 + 20 + 30 * i),
                                    12 + i, i % 2 ? 0.8f : 0.0f, 100 + i));

  const std::vector<std::vector<int32_t>> solo = solo_tokens(*loaded.model, requests);

  SchedulerOptions options;
  options.max_batch = 4;  // fewer slots than requests: some wait and join mid-flight
  options.context_tokens = 512;
  options.prefill_chunk = 64;
  Scheduler scheduler(*loaded.model, options);
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const auto& request : requests) streams.push_back(scheduler.submit(request));
  for (size_t i = 0; i < streams.size(); ++i) EXPECT_EQ(collect(*streams[i]), solo[i]) << "request " << i;
}

// Bias and penalties read each request's own prompt and tokens: batched, a penalised request equals
// its solo run, and the penalties do change what it generates.
TEST(Scheduler, PenalisedRequestsEqualTheirSoloRuns) {
  const auto fixture = fixtures_dir() / "qwen3-tiny";
  TestModel loaded = open_cpu_model(fixture / "f32");
  const std::vector<int32_t> prompt = fixture_prompt(fixture);
  const std::vector<GenerationRequest> requests = penalised_scheduler_requests(prompt, 12);
  const std::vector<std::vector<int32_t>> solo = solo_tokens(*loaded.model, requests);
  expect_solo_results(scheduled_events(*loaded.model, requests, 512), requests, solo);
  const std::vector<std::vector<int32_t>> plain = solo_tokens(*loaded.model, mixed_scheduler_requests(prompt, 12));
  for (size_t i : {0, 1, 5}) EXPECT_NE(solo[i], plain[i]) << "request " << i << ": the penalties changed nothing";
}

TEST(Scheduler, CancelledRequestFreesItsSlot) {
  const auto fixture = fixtures_dir() / "llama3-tiny";
  TestModel loaded = open_cpu_model(fixture / "f32");
  const std::vector<int32_t> prompt = fixture_prompt(fixture);
  SchedulerOptions options;
  options.max_batch = 1;
  options.context_tokens = 1024;
  options.prefill_chunk = 64;
  Scheduler scheduler(*loaded.model, options);
  auto endless = scheduler.submit(make_request({prompt.begin(), prompt.begin() + 10}, 900, 0.0f, 1));
  ASSERT_TRUE(endless->next(30s).has_value());
  endless->cancel();
  FinishReason reason = FinishReason::Stop;
  collect(*endless, &reason);
  EXPECT_EQ(reason, FinishReason::Cancelled);
  auto next = scheduler.submit(make_request({prompt.begin(), prompt.begin() + 10}, 3, 0.0f, 1));
  EXPECT_EQ(collect(*next, &reason).size(), 3u);
  EXPECT_EQ(reason, FinishReason::Length);
}

TEST(Scheduler, RefusesInvalidRequestsAndAFullQueue) {
  TestModel loaded = open_cpu_model(fixtures_dir() / "llama3-tiny/f32");
  SchedulerOptions options;
  options.max_batch = 1;
  options.context_tokens = 64;
  options.max_queue = 1;
  options.prefill_chunk = 64;
  Scheduler scheduler(*loaded.model, options);
  EXPECT_THROW(scheduler.submit(make_request({}, 4, 0, 1)), Error);
  EXPECT_THROW(scheduler.submit(make_request(std::vector<int32_t>(64, 5), 4, 0, 1)), Error);
  EXPECT_THROW(scheduler.submit(make_request({5, 100000}, 4, 0, 1)), Error);
  GenerationRequest biased = make_request({5, 6}, 4, 0, 1);
  biased.sampling.logit_bias = {{static_cast<int32_t>(loaded.model->config().vocab_size), 1.0f}};
  expect_error_mentions([&] { scheduler.submit(biased); }, {"logit_bias", "outside the vocabulary"});
  // One request runs, one waits; the third finds the queue full.
  auto running = scheduler.submit(make_request({5, 6}, 60, 0, 1));
  ASSERT_TRUE(running->next(30s).has_value());
  auto waiting = scheduler.submit(make_request({5, 6}, 2, 0, 1));
  EXPECT_THROW(scheduler.submit(make_request({5, 6}, 2, 0, 1)), QueueFull);
  running->cancel();
  EXPECT_EQ(collect(*waiting).size(), 2u);
}

// The first `count` tokens of a fixture's prompt.
std::vector<int32_t> prompt_start(const std::filesystem::path& fixture, size_t count) {
  const std::vector<int32_t> prompt = fixture_prompt(fixture);
  EXPECT_GE(prompt.size(), count);
  return {prompt.begin(), prompt.begin() + std::min(count, prompt.size())};
}

// generate() runs the same core for one request: the same chunk rule, the same ends, one context.
TEST(Generate, IsOneRequestOfTheCoreWithItsRules) {
  const auto fixture = fixtures_dir() / "llama3-tiny";
  TestModel loaded = open_cpu_model(fixture / "f32");
  const std::vector<int32_t> prompt = prompt_start(fixture, 150);
  GenerationOptions options;
  options.max_tokens = 6;
  options.sampling.temperature = 0;
  const GenerationResult whole = generate(*loaded.model, prompt, options);
  EXPECT_EQ(whole.tokens.size(), 6u);
  EXPECT_EQ(whole.finish_reason, FinishReason::Length);
  options.prefill_chunk = 64;
  EXPECT_EQ(generate(*loaded.model, prompt, options).tokens, whole.tokens);

  options.stop_ids = {whole.tokens[2]};
  const GenerationResult stopped = generate(*loaded.model, prompt, options);
  EXPECT_EQ(stopped.tokens, std::vector<int32_t>(whole.tokens.begin(), whole.tokens.begin() + 3));
  EXPECT_EQ(stopped.finish_reason, FinishReason::Stop);
  options.stop_ids.clear();
  int calls = 0;
  const GenerationResult cut = generate(*loaded.model, prompt, options, [&](const SampledToken&) { return ++calls < 2; });
  EXPECT_EQ(cut.tokens.size(), 2u);
  EXPECT_EQ(cut.finish_reason, FinishReason::Stop);
  options.max_tokens = 0;
  const GenerationResult none = generate(*loaded.model, prompt, options);
  EXPECT_TRUE(none.tokens.empty());
  EXPECT_EQ(none.finish_reason, FinishReason::Length);

  options.max_tokens = 6;
  options.prefill_chunk = 100;
  EXPECT_THROW(generate(*loaded.model, prompt, options), Error);
  EXPECT_THROW(prompt_logits(*loaded.model, prompt, 100), Error);
  options.prefill_chunk = 64;
  const int64_t context = loaded.model->config().max_position_embeddings;
  EXPECT_THROW(generate(*loaded.model, std::vector<int32_t>(context, 5), options), Error);
}

TEST(PromptLogits, ChunksSplitAsTheStepPlanSplitsThem) {
  const auto fixture = fixtures_dir() / "qwen3_5-text-tiny";
  TestModel loaded = open_cpu_model(fixture / "f32");
  const std::vector<int32_t> prompt = prompt_start(fixture, 150);
  const Tensor one_shot = prompt_logits(*loaded.model, prompt, kWholePrompt);
  const Tensor chunked = prompt_logits(*loaded.model, prompt, 64);
  ASSERT_EQ(one_shot.shape(), chunked.shape());
  EXPECT_EQ(std::memcmp(one_shot.raw(), chunked.raw(), one_shot.nbytes()), 0);
}

}  // namespace
