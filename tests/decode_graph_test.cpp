// Host logic of captured decode steps (engine/decode_graph.h): bucket choice, the slots padded
// rows take, the CPU's plain path, the sampler's shared random stream, and the engine's use of
// GraphOps (generate, the scheduler) over a CPU backend whose "captures" re-run the work. The
// CUDA graphs themselves run in tests/cuda/decode_graph_test.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "engine/decode_graph.h"
#include "engine/generation.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "model/loader.h"
#include "forwarding_backend.h"
#include "model_test_support.h"
#include "speculative_support.h"
#include "test_support.h"

namespace kiln::testing {
namespace {

// The CPU backend with GraphOps: capture() runs the work and replay() runs it again (reading the
// buffers as they are then, as a graph does); sample_tokens applies choose_token to each row with
// the draw from its settings. It lets the engine's graph path run, and be checked, on the CPU.
class ReplayingCpuBackend final : public ForwardingCpuBackend, public GraphOps {
 public:
  GraphOps* graph_ops() override { return this; }
  std::string name() const override { return "cpu-replaying"; }

  std::unique_ptr<CapturedWork> capture(const std::function<void()>& work) override {
    struct Rerun final : CapturedWork {
      std::function<void()> work;
      int* replays;
      void replay() override {
        ++*replays;
        work();
      }
    };
    ++captures;
    work();
    auto captured = std::make_unique<Rerun>();
    captured->work = work;
    captured->replays = &replays;
    return captured;
  }
  void upload_into(const Tensor& host, Tensor& device) override {
    ASSERT_EQ(host.nbytes(), device.nbytes());
    std::memcpy(device.raw(), host.raw(), host.nbytes());
  }
  void sample_tokens(const Tensor& logits, const Tensor& settings, bool sorting, Tensor& tokens,
                     Tensor& logprobs) override {
    const int64_t vocab = logits.dim(1);
    widest_sample_call = std::max(widest_sample_call, logits.dim(0));
    for (int64_t row = 0; row < logits.dim(0); ++row) {
      const int32_t* words = settings.data<int32_t>() + row * kSamplingSettingsWords;
      SamplingParams params;
      params.temperature = std::bit_cast<float>(words[0]);
      params.top_k = words[1];
      params.top_p = std::bit_cast<float>(words[2]);
      params.min_p = std::bit_cast<float>(words[3]);
      if (params.temperature != 0.0f) {
        EXPECT_TRUE(sorting) << "row " << row << " samples in a greedy-only call";
      }
      const uint64_t draw = static_cast<uint32_t>(words[4]) | (uint64_t{static_cast<uint32_t>(words[5])} << 32);
      const SampledToken token = choose_token(params, {logits.data<float>() + row * vocab, static_cast<size_t>(vocab)},
                                              std::bit_cast<double>(draw));
      tokens.data<int32_t>()[row] = token.token;
      logprobs.data<float>()[row] = token.logprob;
    }
  }

  void feed_tokens(const Tensor& previous, const Tensor& feed, Tensor& token_ids) override {
    for (int64_t i = 0; i < feed.numel(); ++i) {
      const int32_t row = feed.data<int32_t>()[i];
      if (row < 0) continue;
      ++fed_rows;
      ASSERT_LT(row, previous.numel()) << "feed row " << i;
      token_ids.data<int32_t>()[i] = previous.data<int32_t>()[row];
    }
  }
  // The CPU has run every op by the time it returns, so the copy is made at once.
  std::unique_ptr<PendingDownload> download_later(const Tensor& device, Tensor& host) override {
    struct Done final : PendingDownload {
      void wait() override {}
    };
    EXPECT_EQ(host.nbytes(), device.nbytes());
    std::memcpy(host.raw(), device.raw(), device.nbytes());
    return std::make_unique<Done>();
  }
  Tensor alloc_pinned(const Shape& shape, DType dtype) override { return Tensor::empty(shape, dtype); }

  int captures = 0;
  int replays = 0;
  int fed_rows = 0;  // rows that took the previous step's token on the "device"
  int64_t widest_sample_call = 0;  // the most rows one sample_tokens call chose tokens for
};

// Tests of the engine's graph path on a ReplayingCpuBackend (`backend`), over the tiny fixtures.
class DecodeGraphsWithReplayingBackend : public ::testing::Test {
 protected:
  void SetUp() override {
    tiny_fixtures_ = fixtures_dir();
  }
  std::filesystem::path fixture(const std::string& name) const { return tiny_fixtures_ / name; }
  // The f32 checkpoint of the tiny fixture `name`, loaded onto `backend`.
  std::unique_ptr<Model> load_replaying_f32(const std::string& name) {
    return load_model(fixture(name) / "f32", backend, LoadOptions{});
  }

  ReplayingCpuBackend backend;

 private:
  std::filesystem::path tiny_fixtures_;
};

TEST(DecodeBucket, PowersOfTwoUpToEightThenMultiplesOfEight) {
  const std::vector<std::pair<int64_t, int64_t>> expected = {{1, 1},   {2, 2},   {3, 4},   {4, 4},   {5, 8},
                                                             {8, 8},   {9, 16},  {16, 16}, {17, 24}, {24, 24},
                                                             {25, 32}, {63, 64}, {64, 64}, {65, 72}};
  for (const auto& [rows, bucket] : expected) EXPECT_EQ(decode_bucket(rows), bucket) << rows << " rows";
  EXPECT_THROW(decode_bucket(0), Error);
}

TEST(DecodeBucket, PaddingNeverExceedsSevenRows) {
  for (int64_t rows = 1; rows <= 512; ++rows) {
    EXPECT_GE(decode_bucket(rows), rows);
    EXPECT_LE(decode_bucket(rows) - rows, 7) << rows << " rows";
  }
}

TEST(PaddingSlots, TakesTheLowestSlotsNoLiveRowHolds) {
  const std::vector<int32_t> live = {4, 0, 2};
  EXPECT_EQ(padding_slots(live, 1, 8), (std::vector<int32_t>{1}));
  EXPECT_EQ(padding_slots(live, 3, 8), (std::vector<int32_t>{1, 3, 5}));
  EXPECT_TRUE(padding_slots(live, 0, 3).empty());
}

TEST(PaddingSlots, ACacheWithTooFewSlotsIsAnError) {
  const std::vector<int32_t> live = {0, 1, 2};
  EXPECT_THROW(padding_slots(live, 1, 3), Error);
  // A cache of decode_bucket(rows) slots always has enough.
  for (int32_t rows = 1; rows <= 40; ++rows) {
    std::vector<int32_t> slots(rows);
    for (int32_t i = 0; i < rows; ++i) slots[i] = decode_bucket(rows) - 1 - i;
    EXPECT_EQ(static_cast<int64_t>(padding_slots(slots, decode_bucket(rows) - rows, decode_bucket(rows)).size()),
              decode_bucket(rows) - rows);
  }
}

TEST(DecodeGraphsOnCpu, TheCpuRunsStepsDirectlyAndSaysSo) {
  TestModel loaded = open_cpu_model(fixtures_dir() / "llama3-tiny/f32");
  EXPECT_FALSE(DecodeGraphs::supported(*loaded.model));
  auto cache = loaded.model->make_cache(1, 8);
  try {
    DecodeGraphs graphs(*loaded.model, *cache);
    FAIL() << "constructing decode graphs on the CPU must fail";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("cpu backend"), std::string::npos) << error.what();
  }
}

// The device sampler takes a request's draw through next_uniform(); sample() must take exactly
// one draw per non-greedy token (and none when greedy) for the two to share one stream.
TEST(SamplerStream, SampleTakesExactlyOneDrawPerSampledToken) {
  std::mt19937 random(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> logits(300);
  for (float& logit : logits) logit = normal(random);
  const SamplingParams params{0.8f, 50, 0.9f, 0.01f, 77};
  Sampler sampled(params), drawn(params);
  for (int i = 0; i < 20; ++i) {
    sampled.sample(logits);
    drawn.next_uniform();
  }
  EXPECT_EQ(sampled.sample(logits).token, drawn.sample(logits).token);
  EXPECT_EQ(sampled.next_uniform(), drawn.next_uniform());

  Sampler greedy(SamplingParams{0.0f, 0, 1.0f, 0.0f, 9}), fresh(SamplingParams{0.0f, 0, 1.0f, 0.0f, 9});
  greedy.sample(logits);
  EXPECT_EQ(greedy.next_uniform(), fresh.next_uniform());
}

// The scheduler runs a step through DecodeGraphs only when every sequence decodes one token (a
// sequence whose last prompt chunk is in the step is not decoding yet); with padding (3 slots,
// bucket 4), joins mid-flight, sampling and top logprobs, each request equals its solo run.
// Requests with a bias or penalties are sampled on the host from the graph step's logits (the device
// sampler applies none); batched with device-sampled ones, each equals its solo run.
TEST_F(DecodeGraphsWithReplayingBackend, PenalisedSchedulerRequestsEqualTheirSoloRuns) {
  auto model = load_replaying_f32("qwen3-tiny");
  const std::vector<int32_t> prompt = fixture_prompt(fixture("qwen3-tiny"));
  const std::vector<GenerationRequest> requests = penalised_scheduler_requests(prompt, 10);
  const std::vector<std::vector<int32_t>> solo = solo_tokens(*model, requests);
  const int solo_replays = backend.replays;
  expect_solo_results(scheduled_events(*model, requests, 512), requests, solo);
  EXPECT_GT(backend.replays, solo_replays) << "the scheduler's decode steps replayed captured work";
}

TEST_F(DecodeGraphsWithReplayingBackend, SchedulerRequestsEqualTheirSoloRuns) {
  auto model = load_replaying_f32("qwen3-tiny");
  const std::vector<int32_t> prompt = fixture_prompt(fixture("qwen3-tiny"));
  const std::vector<GenerationRequest> requests = mixed_scheduler_requests(prompt, 10);
  const std::vector<std::vector<int32_t>> solo = solo_tokens(*model, requests);
  const int solo_replays = backend.replays;
  expect_solo_results(scheduled_events(*model, requests, 512), requests, solo);
  EXPECT_GT(backend.replays, solo_replays) << "the scheduler's decode steps replayed captured work";
}

// A mixture of experts routes on the backend, so its decode steps run through the graph path too;
// batched (and padded), each request equals its solo run.
TEST_F(DecodeGraphsWithReplayingBackend, MixtureOfExpertsSchedulerRequestsEqualTheirSoloRuns) {
  for (const char* name : {"qwen3-moe-tiny", "qwen3_5-moe-tiny"}) {
    SCOPED_TRACE(name);
    auto model = load_replaying_f32(name);
    ASSERT_TRUE(DecodeGraphs::supported(*model));
    const std::vector<int32_t> prompt = fixture_prompt(fixture(name));
    const std::vector<GenerationRequest> requests = mixed_scheduler_requests(prompt, 8);
    const std::vector<std::vector<int32_t>> solo = solo_tokens(*model, requests);
    const int solo_replays = backend.replays;
    expect_solo_results(scheduled_events(*model, requests, 512), requests, solo);
    EXPECT_GT(backend.replays, solo_replays) << "the scheduler's decode steps replayed captured work";
  }
}

// Requests with reasoning budgets: a forced token replaces the device's (its row greedy, with no
// draw), and no step is queued ahead of a token that may be forced; batched with the others, each
// equals its solo run, and steps still take their tokens on the device where nothing is forced.
TEST_F(DecodeGraphsWithReplayingBackend, BudgetedSchedulerRequestsEqualTheirSoloRuns) {
  auto model = load_replaying_f32("qwen3-tiny");
  const std::vector<int32_t> prompt = fixture_prompt(fixture("qwen3-tiny"));
  const std::vector<GenerationRequest> requests = budgeted_scheduler_requests(prompt, 12);
  const std::vector<std::vector<int32_t>> solo = solo_tokens(*model, requests);
  expect_reasoning_capped(requests, solo);
  const int solo_fed_rows = backend.fed_rows;
  expect_solo_results(scheduled_events(*model, requests, 512), requests, solo);
  EXPECT_GT(backend.fed_rows, solo_fed_rows) << "decode steps took their tokens from the step before them";
}

// Steps queued ahead (launch, collect) whose rows take the previous step's tokens on the device
// (fed_from) give the tokens and logprobs of one step at a time with the tokens from the host —
// also when the rows change order and the batch shrinks to another bucket between steps.
TEST_F(DecodeGraphsWithReplayingBackend, QueuedFedStepsEqualStepsWithHostTokens) {
  auto model = load_replaying_f32("llama3-tiny");
  const std::vector<int32_t> prompt = fixture_prompt(fixture("llama3-tiny"));
  const std::vector<int> lengths = {9, 14, 5};
  auto stepped_cache = model->make_cache(4, 64);
  auto queued_cache = model->make_cache(4, 64);
  std::vector<SequenceStep> prefill;
  for (int32_t slot = 0; slot < 3; ++slot)
    prefill.push_back({slot, 0, std::vector<int32_t>(prompt.begin(), prompt.begin() + lengths[slot]), false});
  const Tensor logits = run_step(*model, *stepped_cache, prefill);
  run_step(*model, *queued_cache, prefill);
  std::vector<int32_t> first(3);
  for (int32_t slot = 0; slot < 3; ++slot)
    first[slot] = argmax({logits.data<float>() + slot * logits.dim(1), static_cast<size_t>(logits.dim(1))});

  // Step k's rows: slots in a rotating order; from step 4 on, slot 1 has finished.
  constexpr int kSteps = 8;
  auto slots_of_step = [](int step) {
    std::vector<int32_t> slots = step < 4 ? std::vector<int32_t>{0, 1, 2} : std::vector<int32_t>{0, 2};
    std::rotate(slots.begin(), slots.begin() + step % slots.size(), slots.end());
    return slots;
  };
  DecodeGraphs stepped(*model, *stepped_cache);
  std::vector<int32_t> next = first;  // by slot
  std::vector<std::vector<SampledToken>> expected;
  for (int step = 0; step < kSteps; ++step) {
    std::vector<DecodeRow> rows;
    for (int32_t slot : slots_of_step(step)) rows.push_back({slot, lengths[slot] + step, next[slot], nullptr});
    expected.push_back(stepped.step(rows));
    for (size_t row = 0; row < rows.size(); ++row) next[rows[row].slot] = expected.back()[row].token;
  }

  DecodeGraphs queued(*model, *queued_cache);
  std::vector<std::vector<SampledToken>> actual;
  for (int step = 0; step < kSteps; ++step) {
    std::vector<DecodeRow> rows;
    const std::vector<int32_t> previous = step > 0 ? slots_of_step(step - 1) : std::vector<int32_t>{};
    for (int32_t slot : slots_of_step(step)) {
      const auto found = std::find(previous.begin(), previous.end(), slot);
      const int32_t fed_from = step > 0 ? static_cast<int32_t>(found - previous.begin()) : -1;
      rows.push_back({slot, lengths[slot] + step, step > 0 ? -1 : first[slot], nullptr, fed_from});
    }
    queued.launch(rows);
    if (queued.queued() == DecodeGraphs::kMaxQueuedSteps) actual.push_back(queued.collect());
  }
  while (queued.queued() > 0) actual.push_back(queued.collect());
  ASSERT_EQ(actual.size(), expected.size());
  for (int step = 0; step < kSteps; ++step) {
    ASSERT_EQ(actual[step].size(), expected[step].size()) << "step " << step;
    for (size_t row = 0; row < actual[step].size(); ++row) {
      EXPECT_EQ(actual[step][row].token, expected[step][row].token) << "step " << step << " row " << row;
      EXPECT_EQ(actual[step][row].logprob, expected[step][row].logprob) << "step " << step << " row " << row;
    }
  }
}

TEST_F(DecodeGraphsWithReplayingBackend, QueueLimitsAndFeedRowsAreChecked) {
  auto model = load_replaying_f32("llama3-tiny");
  auto cache = model->make_cache(2, 16);
  DecodeGraphs graphs(*model, *cache);
  expect_error_mentions([&] { graphs.collect(); }, {"no launched step"});
  expect_error_mentions([&] { graphs.launch({DecodeRow{0, 0, 1, nullptr, 0}}); },
                        {"row 0 of the previous step, which had 0 one-token rows"});
  graphs.launch({DecodeRow{0, 0, 1, nullptr}});
  graphs.launch({DecodeRow{0, 1, 0, nullptr, 0}});
  expect_error_mentions([&] { graphs.launch({DecodeRow{0, 2, 0, nullptr, 0}}); }, {"2 steps are queued"});
  expect_error_mentions([&] { graphs.step({DecodeRow{0, 2, 0, nullptr, 0}}); }, {"still to be collected"});
  graphs.collect();
  expect_error_mentions([&] { graphs.launch({DecodeRow{1, 2, 0, nullptr, 1}}); },
                        {"row 1 of the previous step, which had 1 one-token rows"});
  graphs.collect();
}

// generate() on a backend with GraphOps queues each step before reading the previous one's token
// (and drops the step queued past a stop); it must emit what the CPU's direct loop emits.
TEST_F(DecodeGraphsWithReplayingBackend, GenerateEqualsTheDirectLoop) {
  auto replaying = load_replaying_f32("llama3-tiny");
  TestModel direct = open_cpu_model(fixture("llama3-tiny") / "f32");
  const std::vector<int32_t> full_prompt = fixture_prompt(fixture("llama3-tiny"));
  const std::vector<int32_t> prompt(full_prompt.begin(), full_prompt.begin() + 12);
  GenerationOptions greedy;
  greedy.max_tokens = 10;
  greedy.sampling.temperature = 0.0f;
  GenerationOptions sampled = greedy;
  sampled.sampling = {0.9f, 40, 0.95f, 0.0f, 42};
  const GenerationResult reference = generate(*direct.model, prompt, greedy);
  GenerationOptions stopping = greedy;
  stopping.stop_ids = {reference.tokens.at(4)};
  for (const GenerationOptions& options : {greedy, sampled, stopping}) {
    const int replays = backend.replays;
    const GenerationResult expected = generate(*direct.model, prompt, options);
    const GenerationResult actual = generate(*replaying, prompt, options);
    EXPECT_EQ(actual.tokens, expected.tokens);
    EXPECT_EQ(actual.finish_reason, expected.finish_reason);
    EXPECT_GT(backend.replays, replays) << "the decode steps replayed captured work";
  }
  EXPECT_LT(generate(*direct.model, prompt, stopping).tokens.size(), 10u) << "the stop id ends generation early";
}

// Requests that decode together without top logprobs: the scheduler queues each decode step
// before reading the previous one's tokens (fed on the device), drops the rows of a request that
// stopped meanwhile, and every request still equals its solo run.
TEST_F(DecodeGraphsWithReplayingBackend, SchedulerQueuedStepsEqualSoloRuns) {
  auto model = load_replaying_f32("qwen3-tiny");
  const std::vector<int32_t> prompt = fixture_prompt(fixture("qwen3-tiny"));
  std::vector<GenerationRequest> requests;
  for (int i = 0; i < 3; ++i) {
    GenerationRequest request;
    request.prompt.assign(prompt.begin() + 5 * i, prompt.begin() + 5 * i + 12 + 9 * i);
    request.max_tokens = 9 + 4 * i;
    request.sampling = {i == 1 ? 0.8f : 0.0f, 40, 1.0f, 0.0f, static_cast<uint64_t>(7 + i)};
    requests.push_back(request);
  }
  std::vector<std::vector<int32_t>> solo = solo_tokens(*model, requests);
  requests[2].stop_ids = {solo[2].at(5)};
  solo = solo_tokens(*model, requests);
  ASSERT_LT(solo[2].size(), static_cast<size_t>(requests[2].max_tokens)) << "request 2 stops early";
  expect_solo_results(scheduled_events(*model, requests, 128), requests, solo);
  EXPECT_GT(backend.fed_rows, 0) << "decode steps took their tokens from the step before them";
}


// Speculative decoding on a backend with graphs: a step in which every request verifies as many
// proposals runs as a verify graph that chooses each row's token on the "device" (with the draws
// read ahead of the request's stream), the others directly; the output is the plain run's, tokens
// and logprob bits, with rejections at every depth and, for the hybrid model, rollbacks.
TEST_F(DecodeGraphsWithReplayingBackend, VerifyStepsRunAsGraphsAndGiveThePlainRun) {
  for (const std::string name : {"llama3-tiny", "qwen3_5-text-tiny"}) {
    SCOPED_TRACE(name);
    auto model = load_replaying_f32(name);
    const std::vector<int32_t> full_prompt = fixture_prompt(fixture(name));
    const std::vector<int32_t> prompt(full_prompt.begin(), full_prompt.begin() + 12);
    backend.widest_sample_call = 0;
    expect_speculation_gives_the_plain_run(*model, prompt);
    // The oracle's steps verify 7 proposals: 8 rows chosen in one call.
    EXPECT_EQ(backend.widest_sample_call, 8) << "verify steps chose their tokens in a graph";
  }
}

// A backend that chooses no tokens on its device (the CPU) refuses a direct step's device choice in
// one line naming it, rather than running without a sampler.
TEST(SampleRowsOnDevice, ABackendWithoutGraphOpsIsRefused) {
  auto backend = make_cpu_backend();
  const Tensor logits = backend->alloc({1, 8}, DType::F32);
  try {
    sample_rows_on_device(*backend, logits, std::vector<Sampler*>{nullptr});
    ADD_FAILURE() << "the CPU backend chose tokens on a device";
  } catch (const Error& error) {
    EXPECT_STREQ(error.what(), "device sampling: the cpu backend chooses no tokens on its device");
  }
}

}  // namespace
}  // namespace kiln::testing
