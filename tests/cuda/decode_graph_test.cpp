// Decode steps as captured CUDA graphs (engine/decode_graph.h) and token choice on the device
// (GraphOps::sample_tokens): a replayed step gives the bits of the same step run directly, the
// device sampler picks the host Sampler's tokens, a step takes the previous step's tokens on the
// device (feed_tokens), and generate() on the graph path — each step queued before the previous
// one's token is read — emits the tokens of a direct decode loop with the host sampler, with logit
// bias and penalties too (chosen on the host from the graph step's logits).
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <random>

#include <gtest/gtest.h>

#include "backend/cuda/cuda_backend.h"
#include "core/error.h"
#include "cuda_test_support.h"
#include "engine/decode_graph.h"
#include "engine/generation.h"
#include "engine/scheduler.h"
#include "model/loader.h"
#include "model_test_support.h"
#include "test_support.h"

namespace kiln::testing {
namespace {

struct GraphCase {
  std::string fixture;
  std::string folder;  // "f32" | "bf16"
  DType activations;
  int batch;
};

class DecodeGraphReplay : public ::testing::TestWithParam<GraphCase> {};

// Prompts of different lengths so that the batch's contexts grow across 64 (the f32 attention
// tiles, the bf16 key tiles) and, for batch 3, across 256 (a bf16 key split). The cache holds 320
// positions, so a captured step sizes attention for two key splits where the direct step, at
// shorter contexts, uses one: the replay must still give the same bits.
TEST_P(DecodeGraphReplay, ReplayIsBitIdenticalToTheDirectStep) {
  KILN_REQUIRE_CUDA();
  const GraphCase& param = GetParam();
  const auto fixture = fixtures_dir() / param.fixture;
  TestModel loaded = open_cuda_model(fixture / param.folder, param.activations);
  Model& model = *loaded.model;
  const std::vector<int32_t> prompt = fixture_prompt(fixture);
  const std::vector<int> lengths = param.batch == 1 ? std::vector<int>{40} : std::vector<int>{40, 230, 47};
  constexpr int64_t kCapacity = 320;
  constexpr int kSteps = 45;

  auto graph_cache = model.make_cache(decode_bucket(param.batch), kCapacity);
  auto direct_cache = model.make_cache(param.batch, kCapacity);
  std::vector<SequenceStep> prefill;
  for (int32_t slot = 0; slot < param.batch; ++slot)
    prefill.push_back({slot, 0, std::vector<int32_t>(prompt.begin(), prompt.begin() + lengths[slot]), false});
  const Tensor prefill_logits = run_step(model, *graph_cache, prefill);
  ASSERT_TRUE(same_rows(prefill_logits, 0, run_step(model, *direct_cache, prefill), 0, param.batch));

  DecodeGraphs graphs(model, *graph_cache);
  std::vector<int32_t> next(param.batch);
  for (int32_t slot = 0; slot < param.batch; ++slot)
    next[slot] = argmax({prefill_logits.data<float>() + slot * prefill_logits.dim(1),
                         static_cast<size_t>(prefill_logits.dim(1))});
  for (int step = 0; step < kSteps; ++step) {
    std::vector<DecodeRow> rows;
    std::vector<SequenceStep> direct;
    for (int32_t slot = 0; slot < param.batch; ++slot) {
      const int32_t position = lengths[slot] + step;
      rows.push_back({slot, position, next[slot], nullptr});
      direct.push_back({slot, position, {next[slot]}, false});
    }
    const std::vector<SampledToken> sampled = graphs.step(rows);
    const Tensor replayed = loaded.backend->download(graphs.last_logits());
    const Tensor expected = run_step(model, *direct_cache, direct);
    for (int32_t slot = 0; slot < param.batch; ++slot) {
      ASSERT_TRUE(same_rows(replayed, slot, expected, slot, 1))
          << param.folder << " batch " << param.batch << ": step " << step << " row " << slot << " (position "
          << rows[slot].position << ") differs between the graph and the direct step";
      const std::span<const float> row(expected.data<float>() + slot * expected.dim(1),
                                       static_cast<size_t>(expected.dim(1)));
      ASSERT_EQ(sampled[slot].token, argmax(row)) << "step " << step << " row " << slot;
      ASSERT_NEAR(sampled[slot].logprob, log_probability(row, sampled[slot].token), 1e-5);
      next[slot] = sampled[slot].token;
    }
  }
  EXPECT_EQ(graphs.graphs(), 1u) << "one bucket, greedy: captured once, then replayed";
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, DecodeGraphReplay,
    ::testing::Values(GraphCase{"llama3-tiny", "f32", DType::F32, 1}, GraphCase{"llama3-tiny", "f32", DType::F32, 3},
                      GraphCase{"llama3-tiny", "bf16", DType::BF16, 1}, GraphCase{"llama3-tiny", "bf16", DType::BF16, 3},
                      GraphCase{"qwen3-tiny", "f32", DType::F32, 1}, GraphCase{"qwen3-tiny", "f32", DType::F32, 3},
                      GraphCase{"qwen3-tiny", "bf16", DType::BF16, 1}, GraphCase{"qwen3-tiny", "bf16", DType::BF16, 3},
                      // Mixtures of experts, routed on the device (model/moe.h)
                      GraphCase{"qwen3-moe-tiny", "f32", DType::F32, 1}, GraphCase{"qwen3-moe-tiny", "f32", DType::F32, 3},
                      GraphCase{"qwen3-moe-tiny", "bf16", DType::BF16, 1},
                      GraphCase{"qwen3-moe-tiny", "bf16", DType::BF16, 3},
                      GraphCase{"qwen3_5-moe-tiny", "f32", DType::F32, 1},
                      GraphCase{"qwen3_5-moe-tiny", "bf16", DType::BF16, 3}),
    [](const auto& info) {
      std::string name = info.param.fixture + "_" + info.param.folder + "_batch" + std::to_string(info.param.batch);
      std::replace(name.begin(), name.end(), '-', '_');
      return name;
    });

struct SamplerCase {
  std::string name;
  SamplingParams params;
};

class DeviceSampler : public ::testing::TestWithParam<SamplerCase> {};

// Logits on a coarse grid (multiples of 1/8) so that ties occur and the lower-id rule matters.
Tensor random_logits(int64_t rows, int64_t vocab, std::mt19937& random) {
  Tensor logits = Tensor::empty({rows, vocab}, DType::F32);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  for (int64_t i = 0; i < logits.numel(); ++i) logits.data<float>()[i] = std::round(normal(random) * 8.0f) / 8.0f;
  return logits;
}

// Through sample_rows_on_device, which packs each row's settings and draw as the decode graphs do.
TEST_P(DeviceSampler, PicksTheHostSamplersTokens) {
  KILN_REQUIRE_CUDA();
  const SamplingParams& params = GetParam().params;
  auto backend = make_cuda_backend(0, DType::F32);
  constexpr int64_t kRows = 6, kDraws = 12;
  std::mt19937 random(7);
  std::vector<Sampler> host, device;
  for (int64_t row = 0; row < kRows; ++row) {
    SamplingParams seeded = params;
    seeded.seed = 1000 + static_cast<uint64_t>(row);
    host.emplace_back(seeded);
    device.emplace_back(seeded);
  }
  // One chunk of the device's row summary, sixteen, and Llama-3's 63 with a short last one.
  for (int64_t vocab : {int64_t{1000}, int64_t{32000}, int64_t{128256}}) {
    for (int64_t draw = 0; draw < kDraws; ++draw) {
      const Tensor logits = random_logits(kRows, vocab, random);
      // The rows of a direct step, chosen on the device (each device sampler gives its row's draw).
      std::vector<Sampler*> samplers;
      for (Sampler& sampler : device) samplers.push_back(&sampler);
      const std::vector<SampledToken> chosen = sample_rows_on_device(*backend, backend->upload(logits), samplers);
      for (int64_t row = 0; row < kRows; ++row) {
        const SampledToken expected =
            host[row].sample({logits.data<float>() + row * vocab, static_cast<size_t>(vocab)});
        ASSERT_EQ(chosen[row].token, expected.token)
            << GetParam().name << ": vocab " << vocab << " draw " << draw << " row " << row;
        ASSERT_NEAR(chosen[row].logprob, expected.logprob, 1e-5 * std::max(1.0f, std::abs(expected.logprob)));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, DeviceSampler,
                         ::testing::Values(SamplerCase{"greedy", {0.0f, 0, 1.0f, 0.0f, {}}},
                                           SamplerCase{"temperature", {0.8f, 0, 1.0f, 0.0f, {}}},
                                           SamplerCase{"top_k", {1.0f, 40, 1.0f, 0.0f, {}}},
                                           SamplerCase{"top_p", {0.7f, 0, 0.9f, 0.0f, {}}},
                                           SamplerCase{"min_p", {1.2f, 0, 1.0f, 0.05f, {}}},
                                           SamplerCase{"all", {0.9f, 50, 0.95f, 0.02f, {}}}),
                         [](const auto& info) { return info.param.name; });

// A direct step's rows without a sampler (a prefill chunk before the prompt's end, a forced or
// host-sampled token) are greedy and take no draw: the sampling rows' streams stay those of their
// host samplers, which choose the same tokens.
TEST(DeviceSampler, RowsWithoutASamplerAreGreedyAndTakeNoDraw) {
  KILN_REQUIRE_CUDA();
  auto backend = make_cuda_backend(0, DType::F32);
  std::mt19937 random(11);
  SamplingParams params{0.9f, 50, 0.95f, 0.0f, 77};
  Sampler host(params), device(params);
  for (int step = 0; step < 8; ++step) {
    const Tensor logits = random_logits(3, 32000, random);
    const std::vector<Sampler*> samplers = {nullptr, &device, nullptr};
    const std::vector<SampledToken> chosen = sample_rows_on_device(*backend, backend->upload(logits), samplers);
    const auto row = [&](int64_t r) { return std::span<const float>(logits.data<float>() + r * 32000, 32000); };
    EXPECT_EQ(chosen[0].token, argmax(row(0))) << "step " << step;
    EXPECT_EQ(chosen[2].token, argmax(row(2))) << "step " << step;
    EXPECT_EQ(chosen[1].token, host.sample(row(1)).token) << "step " << step;
  }
  try {
    sample_rows_on_device(*backend, backend->upload(random_logits(2, 100, random)), std::vector<Sampler*>{nullptr});
    ADD_FAILURE() << "two logit rows with one sampler were taken";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("2 logit rows but 1 samplers"), std::string::npos) << error.what();
  }
}

// Equal largest logits in several of the device's chunks (kChunkLogits = 2048 in sampling.cu),
// the lowest at a chunk's first index: the lowest id wins, as on the host. The second row has a
// whole chunk at −∞, which must add nothing to its logprob's sum.
TEST(DeviceSampler, GreedyTiesAcrossChunksTakeTheLowestId) {
  KILN_REQUIRE_CUDA();
  auto backend = make_cuda_backend(0, DType::F32);
  constexpr int64_t kVocab = 128256;
  Tensor logits = Tensor::empty({2, kVocab}, DType::F32);
  std::fill_n(logits.data<float>(), logits.numel(), -1.0f);
  for (int64_t index : {kVocab - 1, int64_t{70001}, int64_t{4095}, int64_t{2048}}) logits.data<float>()[index] = 5.0f;
  for (int64_t index : {int64_t{9000}, int64_t{2047}}) logits.data<float>()[kVocab + index] = 3.0f;
  std::fill_n(logits.data<float>() + kVocab + 4096, 2048, -INFINITY);
  Tensor tokens = backend->alloc({2}, DType::I32);
  Tensor logprobs = backend->alloc({2}, DType::F32);
  const Tensor greedy = Tensor::zeros({2, kSamplingSettingsWords}, DType::I32);
  backend->graph_ops()->sample_tokens(backend->upload(logits), backend->upload(greedy), false, tokens, logprobs);
  const Tensor device_tokens = backend->download(tokens);
  const Tensor device_logprobs = backend->download(logprobs);
  const int32_t expected[2] = {2048, 2047};
  for (int64_t row = 0; row < 2; ++row) {
    const std::span<const float> host_row(logits.data<float>() + row * kVocab, kVocab);
    EXPECT_EQ(device_tokens.data<int32_t>()[row], expected[row]) << "row " << row;
    EXPECT_NEAR(device_logprobs.data<float>()[row], log_probability(host_row, expected[row]), 1e-5) << "row " << row;
  }
}

TEST(DeviceSamplerErrors, ASamplingRowWithoutSortingIsReported) {
  KILN_REQUIRE_CUDA();
  auto backend = make_cuda_backend(0, DType::F32);
  std::mt19937 random(3);
  Tensor settings = Tensor::zeros({1, kSamplingSettingsWords}, DType::I32);
  settings.data<int32_t>()[0] = std::bit_cast<int32_t>(1.0f);
  Tensor tokens = backend->alloc({1}, DType::I32);
  Tensor logprobs = backend->alloc({1}, DType::F32);
  backend->graph_ops()->sample_tokens(backend->upload(random_logits(1, 100, random)), backend->upload(settings),
                                      false, tokens, logprobs);
  EXPECT_THROW(backend->download(tokens), Error);
}

Tensor int_tensor(const std::vector<int32_t>& values) {
  Tensor host = Tensor::empty({static_cast<int64_t>(values.size())}, DType::I32);
  std::copy(values.begin(), values.end(), host.data<int32_t>());
  return host;
}

// feed_tokens takes the rows a feed names from the previous tokens and keeps the others; a feed
// index past the previous tokens is reported at the next wait; download_later's copy lands in
// page-locked memory by the time wait() returns.
TEST(DeviceFeed, FedRowsTakeThePreviousTokens) {
  KILN_REQUIRE_CUDA();
  auto backend = make_cuda_backend(0, DType::BF16);
  GraphOps& ops = *backend->graph_ops();
  const Tensor previous = backend->upload(int_tensor({7, 8, 9}));
  Tensor tokens = backend->upload(int_tensor({1, 2, 3, 4}));
  ops.feed_tokens(previous, backend->upload(int_tensor({2, -1, 0, -1})), tokens);
  Tensor pinned = ops.alloc_pinned({4}, DType::I32);
  ops.download_later(tokens, pinned)->wait();
  const int32_t* fed = pinned.data<int32_t>();
  EXPECT_EQ(std::vector<int32_t>(fed, fed + 4), (std::vector<int32_t>{9, 2, 7, 4}));

  Tensor one = backend->upload(int_tensor({5}));
  ops.feed_tokens(previous, backend->upload(int_tensor({3})), one);
  Tensor one_back = ops.alloc_pinned({1}, DType::I32);
  expect_error_mentions([&] { ops.download_later(one, one_back)->wait(); },
                        {"feed_tokens", "feed index 3 is past the previous step's 3 tokens"});
  EXPECT_EQ(backend->download(one).data<int32_t>()[0], 5) << "the error was cleared and the row kept its token";
}

// The host-side checks of the decode-step GraphOps name the op and what is wrong.
TEST(DeviceFeed, MisuseIsReportedWithItsReason) {
  KILN_REQUIRE_CUDA();
  auto backend = make_cuda_backend(0, DType::BF16);
  GraphOps& ops = *backend->graph_ops();
  const Tensor previous = backend->upload(int_tensor({7, 8, 9}));
  Tensor two = backend->upload(int_tensor({1, 2}));
  expect_error_mentions([&] { ops.feed_tokens(previous, backend->upload(int_tensor({0, 1, 2})), two); },
                        {"CUDA feed_tokens", "must have one entry per row"});
  Tensor wrong_size = ops.alloc_pinned({3}, DType::I32);
  expect_error_mentions([&] { ops.download_later(two, wrong_size); },
                        {"CUDA download_later", "does not match device"});
  expect_error_mentions([&] { ops.alloc_pinned({-1}, DType::I32); }, {"CUDA alloc_pinned", "negative extent"});
  std::vector<Tensor> hosts;
  std::vector<std::unique_ptr<PendingDownload>> pending;
  for (int i = 0; i < GraphOps::kMaxPendingDownloads; ++i) {
    hosts.push_back(ops.alloc_pinned({2}, DType::I32));
    pending.push_back(ops.download_later(two, hosts.back()));
  }
  Tensor one_more = ops.alloc_pinned({2}, DType::I32);
  expect_error_mentions([&] { ops.download_later(two, one_more); }, {"downloads are already pending"});
  pending.front()->wait();
  pending.erase(pending.begin());
  pending.push_back(ops.download_later(two, one_more));  // a finished download frees its place
  for (auto& download : pending) download->wait();
  EXPECT_EQ(one_more.data<int32_t>()[1], 2);
}

// generate() decodes through captured graphs on CUDA, sampling on the device; a direct loop with
// the host sampler over the same backend must emit the same tokens (same random stream).
TEST(DecodeGraphGenerate, MatchesADirectLoopWithTheHostSampler) {
  KILN_REQUIRE_CUDA();
  const auto fixture = fixtures_dir() / "llama3-tiny";
  TestModel loaded = open_cuda_model(fixture / "bf16", DType::BF16);
  Model& model = *loaded.model;
  const std::vector<int32_t> full_prompt = fixture_prompt(fixture);
  const std::vector<int32_t> prompt(full_prompt.begin(), full_prompt.begin() + 20);
  GenerationOptions options;
  options.max_tokens = 60;
  options.sampling = {0.9f, 40, 0.95f, 0.0f, 42};
  const GenerationResult result = generate(model, prompt, options);
  ASSERT_EQ(result.tokens.size(), 60u);

  Sampler sampler(options.sampling);
  auto cache = model.make_cache(1, 100);
  Tensor logits = run_step(model, *cache, {SequenceStep{0, 0, prompt, false}});
  std::vector<int32_t> expected;
  for (int64_t position = 20; expected.size() < 60; ++position) {
    const SampledToken token = sampler.sample({logits.data<float>(), static_cast<size_t>(logits.dim(1))});
    expected.push_back(token.token);
    logits = run_step(model, *cache, {SequenceStep{0, static_cast<int32_t>(position), {token.token}, false}});
  }
  EXPECT_EQ(result.tokens, expected);
}

// The server's scheduler on CUDA: steps in which every sequence decodes run as captured graphs
// (3 slots: bucket 4 with a padded row) sampling on the device, steps with prefill chunks run
// directly and choose their tokens on the device too (sample_rows_on_device); every request must
// still equal its solo generate() run.
TEST(DecodeGraphScheduler, ConcurrentRequestsEqualTheirSoloRuns) {
  KILN_REQUIRE_CUDA();
  const auto fixture = fixtures_dir() / "qwen3-tiny";
  TestModel loaded = open_cuda_model(fixture / "bf16", DType::BF16);
  const std::vector<int32_t> prompt = fixture_prompt(fixture);
  const std::vector<GenerationRequest> requests = mixed_scheduler_requests(prompt, 30);
  const std::vector<std::vector<int32_t>> solo = solo_tokens(*loaded.model, requests);
  expect_solo_results(scheduled_events(*loaded.model, requests, 512), requests, solo);
}

// A request with a bias and penalties decodes through the captured graphs with its tokens chosen
// by the host Sampler from each step's logits (the device sampler applies neither): a direct loop
// with the host sampler, fed the same tokens, emits the same ones.
TEST(DecodeGraphGenerate, PenalisedRequestMatchesADirectLoopWithTheHostSampler) {
  KILN_REQUIRE_CUDA();
  const auto fixture = fixtures_dir() / "llama3-tiny";
  TestModel loaded = open_cuda_model(fixture / "bf16", DType::BF16);
  Model& model = *loaded.model;
  const std::vector<int32_t> full_prompt = fixture_prompt(fixture);
  const std::vector<int32_t> prompt(full_prompt.begin(), full_prompt.begin() + 20);
  for (const float temperature : {0.0f, 0.9f}) {
    GenerationOptions options;
    options.max_tokens = 40;
    options.sampling = {temperature, 40, 0.95f, 0.0f, 42};
    options.sampling.repetition_penalty = 1.2f;
    options.sampling.presence_penalty = 0.5f;
    options.sampling.frequency_penalty = 0.25f;
    options.sampling.logit_bias = {{prompt[2], 3.0f}};
    const GenerationResult result = generate(model, prompt, options);
    ASSERT_EQ(result.tokens.size(), 40u);

    Sampler sampler(options.sampling, prompt);
    auto cache = model.make_cache(1, 100);
    Tensor logits = run_step(model, *cache, {SequenceStep{0, 0, prompt, false}});
    std::vector<int32_t> expected;
    for (int64_t position = 20; expected.size() < 40; ++position) {
      const SampledToken token = sampler.sample({logits.data<float>(), static_cast<size_t>(logits.dim(1))});
      sampler.accept(token.token);
      expected.push_back(token.token);
      logits = run_step(model, *cache, {SequenceStep{0, static_cast<int32_t>(position), {token.token}, false}});
    }
    EXPECT_EQ(result.tokens, expected) << "temperature " << temperature;
  }
}

// The scheduler on CUDA with penalised requests among device-sampled ones: the penalised rows are
// chosen on the host in graph steps and in direct steps alike, so each request equals its solo run.
TEST(DecodeGraphScheduler, PenalisedRequestsEqualTheirSoloRuns) {
  KILN_REQUIRE_CUDA();
  const auto fixture = fixtures_dir() / "qwen3-tiny";
  TestModel loaded = open_cuda_model(fixture / "bf16", DType::BF16);
  const std::vector<int32_t> prompt = fixture_prompt(fixture);
  const std::vector<GenerationRequest> requests = penalised_scheduler_requests(prompt, 30);
  const std::vector<std::vector<int32_t>> solo = solo_tokens(*loaded.model, requests);
  expect_solo_results(scheduled_events(*loaded.model, requests, 512), requests, solo);
}

// Reasoning budgets on CUDA: forced tokens replace the device's in graph steps (the row greedy,
// no draw) and no step is queued ahead of a token that may be forced; each request equals its solo
// run, its forced close right after its cap.
TEST(DecodeGraphScheduler, BudgetedRequestsEqualTheirSoloRuns) {
  KILN_REQUIRE_CUDA();
  const auto fixture = fixtures_dir() / "qwen3-tiny";
  TestModel loaded = open_cuda_model(fixture / "bf16", DType::BF16);
  const std::vector<int32_t> prompt = fixture_prompt(fixture);
  const std::vector<GenerationRequest> requests = budgeted_scheduler_requests(prompt, 30);
  const std::vector<std::vector<int32_t>> solo = solo_tokens(*loaded.model, requests);
  expect_reasoning_capped(requests, solo);
  expect_solo_results(scheduled_events(*loaded.model, requests, 512), requests, solo);
}

}  // namespace
}  // namespace kiln::testing
