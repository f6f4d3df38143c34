// Host logic of captured decode steps (engine/decode_graph.h): bucket choice, the slots padded
// rows take, the CPU's plain path, and the sampler's shared random stream. The graphs themselves
// run in tests/cuda/decode_graph_test.cpp.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "core/error.h"
#include "engine/decode_graph.h"
#include "engine/sampler.h"
#include "model_test_support.h"
#include "test_support.h"

namespace kiln::testing {
namespace {

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
  KILN_REQUIRE_SHARED(shared);
  TestModel loaded = open_cpu_model(shared / "fixtures/tiny/llama3-tiny/f32");
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

}  // namespace
}  // namespace kiln::testing
