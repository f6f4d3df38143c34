// The step planner: which sequences prefill which chunk and which decode, under a token budget.
#include <gtest/gtest.h>

#include "core/error.h"
#include "engine/serving_sizes.h"
#include "engine/step_plan.h"
#include "test_support.h"

using namespace kiln;

namespace {

struct Expected {
  size_t sequence;
  bool decodes;
  int64_t begin, end;
  bool samples;
};

void expect_work(const StepPlan& plan, const std::vector<Expected>& expected) {
  ASSERT_EQ(plan.work.size(), expected.size());
  int64_t tokens = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    const PlannedWork& work = plan.work[i];
    EXPECT_EQ(work.sequence, expected[i].sequence) << "work " << i;
    EXPECT_EQ(work.decodes, expected[i].decodes) << "work " << i;
    if (!work.decodes) {
      EXPECT_EQ(work.begin, expected[i].begin) << "work " << i;
      EXPECT_EQ(work.end, expected[i].end) << "work " << i;
    }
    EXPECT_EQ(work.samples, expected[i].samples) << "work " << i;
    tokens += work.tokens();
  }
  EXPECT_EQ(plan.tokens, tokens);
}

TEST(StepPlan, ChunksEndAtMultiplesOf64UntilThePromptEnds) {
  EXPECT_EQ(prefill_chunk_end(300, 0, 256), 256);
  EXPECT_EQ(prefill_chunk_end(300, 256, 256), 300);
  EXPECT_EQ(prefill_chunk_end(100, 0, 256), 100);
  EXPECT_EQ(prefill_chunk_end(200, 128, 64), 192);
  // A chunk cut short (by a budget) ends at the last multiple of 64 it reaches.
  EXPECT_EQ(prefill_chunk_end(300, 0, 100), 64);
  EXPECT_EQ(prefill_chunk_end(300, 64, 63), 64);

  // A 200-token prompt in chunks of 64: three aligned chunks, then the tail, which samples.
  std::vector<SequenceProgress> sequence{{200, 0}};
  std::vector<std::pair<int64_t, int64_t>> chunks;
  for (;;) {
    const StepPlan plan = plan_step(sequence, 64, 64);
    ASSERT_EQ(plan.work.size(), 1u);
    chunks.emplace_back(plan.work[0].begin, plan.work[0].end);
    EXPECT_EQ(plan.work[0].samples, plan.work[0].end == 200);
    EXPECT_FALSE(plan.every_sequence_decodes);
    sequence[0].prefilled = plan.work[0].end;
    if (plan.work[0].samples) break;
  }
  EXPECT_EQ(chunks, (std::vector<std::pair<int64_t, int64_t>>{{0, 64}, {64, 128}, {128, 192}, {192, 200}}));
}

TEST(StepPlan, MixesPrefillAndDecodeInSequenceOrder) {
  const std::vector<SequenceProgress> sequences{{10, 10}, {300, 0}, {20, 20}, {100, 64}};
  const StepPlan plan = plan_step(sequences, 256, 4 * 256);
  // The last sequence's final chunk is in this step: it samples its first token, but does not decode.
  expect_work(plan, {{0, true, 0, 0, true}, {1, false, 0, 256, false}, {2, true, 0, 0, true}, {3, false, 64, 100, true}});
  EXPECT_EQ(plan.tokens, 1 + 256 + 1 + 36);
  EXPECT_FALSE(plan.every_sequence_decodes);
}

TEST(StepPlan, EverySequenceDecodesOnlyWhenEachHasADecode) {
  EXPECT_TRUE(plan_step(std::vector<SequenceProgress>{{5, 5}, {70, 70}}, 64, 128).every_sequence_decodes);
  EXPECT_FALSE(plan_step(std::vector<SequenceProgress>{{5, 5}, {70, 64}}, 64, 128).every_sequence_decodes);
  // A decoding sequence the budget leaves out: not every sequence decodes in this step.
  const StepPlan short_budget = plan_step(std::vector<SequenceProgress>{{5, 5}, {70, 70}}, 64, 1);
  expect_work(short_budget, {{0, true, 0, 0, true}});
  EXPECT_FALSE(short_budget.every_sequence_decodes);
}

TEST(StepPlan, TheBudgetOfEveryPrefillingSequenceTakingAChunkNeverBinds) {
  std::vector<SequenceProgress> sequences(8, SequenceProgress{1000, 0});
  sequences[3] = {1000, 1000};
  const StepPlan plan = plan_step(sequences, 256, ServingSizes{8, 0, 256}.step_token_budget());
  ASSERT_EQ(plan.work.size(), 8u);
  for (const PlannedWork& work : plan.work) EXPECT_EQ(work.tokens(), work.decodes ? 1 : 256);
}

TEST(StepPlan, ALowBudgetServesDecodesFirstThenPrefillsInOrder) {
  const std::vector<SequenceProgress> sequences{{300, 0}, {300, 0}, {9, 9}, {9, 9}};
  // 2 decode tokens, then 298 for prefills: the first takes 256, the second's 42 reach no split.
  expect_work(plan_step(sequences, 256, 300), {{0, false, 0, 256, false}, {2, true, 0, 0, true}, {3, true, 0, 0, true}});
  // 400: the second prefill gets 142 tokens, cut to 128.
  expect_work(plan_step(sequences, 256, 400),
              {{0, false, 0, 256, false}, {1, false, 0, 128, false}, {2, true, 0, 0, true}, {3, true, 0, 0, true}});
  // A budget the decodes use up leaves every prefill waiting, whatever its place.
  expect_work(plan_step(sequences, 256, 2), {{2, true, 0, 0, true}, {3, true, 0, 0, true}});
  // A final chunk shorter than 64 fits a budget below 64.
  expect_work(plan_step(std::vector<SequenceProgress>{{70, 64}}, 64, 6), {{0, false, 64, 70, true}});
}

// A hybrid model's prefix cache keeps the state where a chunk ends at a sequence's chunk boundary:
// the chunk that would run past it ends there, the next runs on to the prompt's end.
TEST(StepPlan, AChunkEndsAtTheSequencesChunkBoundary) {
  expect_work(plan_step(std::vector<SequenceProgress>{{300, 0, 1, 256}}, 512, 1000), {{0, false, 0, 256, false}});
  expect_work(plan_step(std::vector<SequenceProgress>{{300, 256, 1, 256}}, 512, 1000), {{0, false, 256, 300, true}});
  // Chunks that end at the boundary anyway, a boundary before the chunk and one at the prompt's end
  // change nothing.
  expect_work(plan_step(std::vector<SequenceProgress>{{300, 0, 1, 128}}, 128, 1000), {{0, false, 0, 128, false}});
  expect_work(plan_step(std::vector<SequenceProgress>{{300, 128, 1, 64}}, 512, 1000), {{0, false, 128, 300, true}});
  expect_work(plan_step(std::vector<SequenceProgress>{{256, 0, 1, 256}}, 512, 1000), {{0, false, 0, 256, true}});
  // A budget that runs low still cuts at a multiple of 64 before the boundary.
  expect_work(plan_step(std::vector<SequenceProgress>{{300, 0, 1, 256}}, 512, 200), {{0, false, 0, 192, false}});
  EXPECT_THROW(plan_step(std::vector<SequenceProgress>{{300, 0, 1, 100}}, 512, 1000), Error);
}

TEST(StepPlan, RefusesChunksOffTheAlignmentAndAnEmptyBudget) {
  const std::vector<SequenceProgress> sequences{{100, 0}};
  for (int64_t chunk : {0, -64, 100, 32})
    EXPECT_THROW(plan_step(sequences, chunk, 1000), Error) << "chunk " << chunk;
  kiln::testing::expect_error_mentions([&] { plan_step(sequences, 64, 0); },
                                       {"a step's token budget must be at least 1, got 0"});
}

TEST(ServingSizes, OneCheckForBatchChunkAndContext) {
  ModelConfig config;
  config.max_position_embeddings = 4096;
  EXPECT_NO_THROW(check_serving_sizes({}, config));
  EXPECT_EQ(ServingSizes{}.prefill_chunk, kDefaultPrefillChunk);
  EXPECT_EQ((ServingSizes{8, 0, 256}.context(config)), 4096);
  EXPECT_EQ((ServingSizes{8, 100, 256}.context(config)), 100);
  EXPECT_EQ((ServingSizes{8, 9000, 256}.context(config)), 4096);
  const auto error_of = [&](const ServingSizes& sizes) {
    try {
      check_serving_sizes(sizes, config);
    } catch (const Error& error) {
      return std::string(error.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(error_of({0, 0, 256}), "max batch must be at least 1, got 0");
  EXPECT_EQ(error_of({8, 0, 100}), "prefill chunk must be a positive multiple of 64, got 100");
  EXPECT_EQ(error_of({8, 0, 0}), "prefill chunk must be a positive multiple of 64, got 0");
  EXPECT_EQ(error_of({8, -1, 256}), "max context must not be negative, got -1");
  config.max_position_embeddings = 0;
  config.source = "m/config.json";
  EXPECT_EQ(error_of({8, 0, 256}), "m/config.json: max_position_embeddings is missing; give --max-context");
  EXPECT_EQ(error_of({8, 512, 256}), "no error");
  // The shared KV pool: whole blocks, at least one context's.
  EXPECT_EQ(error_of({8, 512, 256, 1024}), "no error");
  EXPECT_EQ(error_of({8, 512, 256, 1000}), "the KV cache's tokens must be a multiple of its 64-token blocks, got 1000");
  EXPECT_EQ(error_of({8, 512, 256, 448}), "a KV cache of 448 tokens cannot hold one sequence of the context's 512 tokens");
  // The memory share: a fraction of the device, and the pool's one sizing.
  EXPECT_EQ(error_of({8, 512, 256, 0, 0.9}), "no error");
  EXPECT_EQ(error_of({8, 512, 256, 0, 1.5}), "the memory share must be above 0 and at most 1, got 1.5");
  EXPECT_EQ(error_of({8, 512, 256, 0, -0.5}), "the memory share must be above 0 and at most 1, got -0.5");
  EXPECT_EQ(error_of({8, 512, 256, 1024, 0.9}),
            "give the KV cache's tokens or the memory share, not both: the share sizes the KV cache");
  EXPECT_EQ((ServingSizes{8, 512, 256, 1024}.kv_blocks(512)), 16);
  EXPECT_EQ((ServingSizes{8, 512, 256}.kv_blocks(500)), 8 * 8);
  // A hybrid model's prefix snapshots: by default two per sequence, or as many as asked (0: none).
  EXPECT_EQ((ServingSizes{8, 512, 256}.snapshots()), 16);
  EXPECT_EQ((ServingSizes{8, 512, 256, 0, 0.0, 3}.snapshots()), 3);
  EXPECT_EQ((ServingSizes{8, 512, 256, 0, 0.0, 0}.snapshots()), 0);
  EXPECT_EQ(error_of({8, 512, 256, 0, 0.0, -2}), "the prefix cache keeps 0 to 2147483647 snapshots, not -2");
}

}  // namespace
