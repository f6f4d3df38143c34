// The paged KV cache (backend.h, model.h's ModelCache) through whole models on the CPU: a sequence
// whose blocks are scattered over the pool in any order gives the bits of the same sequence in
// the blocks a cache starts with, in one-shot prefill, chunked prefill and decode, for the dense
// graph and the hybrid one (whose GDN state stays per slot); a pool smaller than every slot's
// blocks serves the slots given blocks; and assign_blocks refuses what is out of range.
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "parameter_name.h"
#include "core/error.h"
#include "engine/generation.h"
#include "model_test_support.h"
#include "test_support.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

constexpr int64_t kCapacity = 256;  // 4 blocks a slot
constexpr int64_t kLength = 200;    // the sequence: blocks 0..3, the last partial

void expect_same_rows(const Tensor& actual, const Tensor& expected, const std::string& what) {
  ASSERT_EQ(actual.shape(), expected.shape()) << what;
  const int64_t vocab = actual.dim(1);
  for (int64_t row = 0; row < actual.dim(0); ++row)
    ASSERT_EQ(std::memcmp(actual.data<float>() + row * vocab, expected.data<float>() + row * vocab,
                          static_cast<size_t>(vocab) * sizeof(float)),
              0)
        << what << ": row " << row << " differs from the cache of contiguous blocks";
}

// The pool's blocks in a fixed shuffled order (a Fisher–Yates written out, the same in every build).
std::vector<int32_t> shuffled_blocks(int64_t blocks, uint32_t seed) {
  std::vector<int32_t> order(static_cast<size_t>(blocks));
  std::iota(order.begin(), order.end(), 0);
  std::mt19937 random(seed);
  for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[random() % i]);
  return order;
}

class PagedCache : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const auto fixture = fixtures_dir() / GetParam();
    loaded_ = open_cpu_model(fixture / "f32");
    prompt_ = fixture_prompt(fixture);
    prompt_.resize(kLength);
  }

  // A cache of three slots and a spare block, slot s given the blocks of `order` from s · 4.
  std::unique_ptr<ModelCache> scattered_cache(const std::vector<int32_t>& order) {
    auto cache = loaded_.model->make_cache(3, kCapacity, 3 * 4 + 1);
    for (int32_t slot = 0; slot < 3; ++slot)
      cache->assign_blocks(slot, 0, std::span<const int32_t>(order).subspan(static_cast<size_t>(slot) * 4, 4));
    return cache;
  }

  // The logits of every position of the sequence in `slot`: prefilled in steps ending at `cuts`
  // (the last runs to kLength − decoded), then the last `decoded` tokens one at a time. Slot 0,
  // when it is not the sequence's, prefills another window of the prompt in the same steps.
  Tensor logits(ModelCache& cache, int32_t slot, std::vector<int64_t> cuts, int64_t decoded) {
    Model& model = *loaded_.model;
    const int64_t vocab = model.config().vocab_size;
    Tensor all = Tensor::empty({kLength, vocab}, DType::F32);
    cuts.push_back(kLength - decoded);
    int64_t start = 0;
    for (int64_t end : cuts) {
      std::vector<SequenceStep> steps;
      if (slot != 0)
        steps.push_back({0, static_cast<int32_t>(start),
                         std::vector<int32_t>(prompt_.begin() + 7 + start, prompt_.begin() + 7 + end), false});
      steps.push_back({slot, static_cast<int32_t>(start),
                       std::vector<int32_t>(prompt_.begin() + start, prompt_.begin() + end), true});
      const Tensor step = run_step(model, cache, steps);
      // Slot 0's step gives one row (its last token's) ahead of the sequence's.
      std::memcpy(all.data<float>() + start * vocab, step.data<float>() + (slot != 0 ? vocab : 0),
                  static_cast<size_t>((end - start) * vocab) * sizeof(float));
      start = end;
    }
    for (int64_t position = start; position < kLength; ++position) {
      const Tensor step = run_step(model, cache, {SequenceStep{slot, static_cast<int32_t>(position),
                                                               {prompt_[static_cast<size_t>(position)]}, true}});
      std::memcpy(all.data<float>() + position * vocab, step.raw(), step.nbytes());
    }
    return all;
  }

  TestModel loaded_;
  std::vector<int32_t> prompt_;
};

TEST_P(PagedCache, ScatteredBlocksGiveTheBitsOfContiguousOnesInEveryKindOfStep) {
  Model& model = *loaded_.model;
  auto contiguous = [&] { return model.make_cache(3, kCapacity); };
  EXPECT_EQ(contiguous()->blocks(), 3 * 4);
  EXPECT_EQ(contiguous()->table_width(), 4);
  auto one_shot = scattered_cache(shuffled_blocks(3 * 4 + 1, 11));
  expect_same_rows(logits(*one_shot, 1, {}, 0), logits(*contiguous(), 1, {}, 0), "one-shot prefill");
  // Chunked at multiples of 64 (where the hybrid graph's GDN splits), beside another sequence.
  auto chunked = scattered_cache(shuffled_blocks(3 * 4 + 1, 12));
  expect_same_rows(logits(*chunked, 2, {64, 128}, 0), logits(*contiguous(), 2, {64, 128}, 0), "chunked prefill");
  // Decoded one token at a time from position 60, across the edges of blocks 1, 2 and 3.
  auto decoded = scattered_cache(shuffled_blocks(3 * 4 + 1, 13));
  expect_same_rows(logits(*decoded, 1, {}, kLength - 60), logits(*contiguous(), 1, {}, kLength - 60), "decode");
}

// A pool with fewer blocks than slots × table width (the engine's pool, shared by the slots)
// serves the slots it gives blocks to; a slot can be given new blocks for its next sequence.
TEST_P(PagedCache, APoolSmallerThanEverySlotsBlocksServesTheSlotsGivenBlocks) {
  Model& model = *loaded_.model;
  auto pool = model.make_cache(4, kCapacity, 8);
  EXPECT_EQ(pool->blocks(), 8);
  EXPECT_EQ(pool->table_width(), 4);
  // Slot 0's window of the prompt, prefilled beside the sequence, reaches position 189: 3 blocks.
  const std::vector<int32_t> beside = {7, 5, 6}, first = {3, 0, 4, 1}, second = {2, 4, 1, 3};
  pool->assign_blocks(0, 0, beside);
  pool->assign_blocks(2, 0, std::span<const int32_t>(first).first(2));  // entries written in two parts
  pool->assign_blocks(2, 2, std::span<const int32_t>(first).subspan(2));
  expect_same_rows(logits(*pool, 2, {128}, 10), logits(*model.make_cache(4, kCapacity), 2, {128}, 10),
                   "the first sequence");
  pool->reset_slot(0);
  pool->reset_slot(2);
  pool->assign_blocks(2, 0, second);
  expect_same_rows(logits(*pool, 2, {64}, 70), logits(*model.make_cache(4, kCapacity), 2, {64}, 70),
                   "the next sequence in other blocks");
}

TEST_P(PagedCache, AssignBlocksRefusesWhatIsOutOfRange) {
  auto cache = loaded_.model->make_cache(2, 100, 6);  // 2 entries a slot
  const std::vector<int32_t> blocks = {5, 0, 1};
  expect_error_mentions([&] { cache->assign_blocks(2, 0, std::span<const int32_t>(blocks).first(1)); },
                        {"slot 2 out of range", "2 slots"});
  expect_error_mentions([&] { cache->assign_blocks(1, 0, blocks); },
                        {"slot 1 block table entries [0, 3) out of range", "2 entries of 64 positions"});
  expect_error_mentions([&] { cache->assign_blocks(0, -1, std::span<const int32_t>(blocks).first(1)); },
                        {"entries [-1, 0) out of range"});
  const std::vector<int32_t> outside = {2, 6};
  expect_error_mentions([&] { cache->assign_blocks(1, 0, outside); },
                        {"slot 1 block table entry 1 given block 6, but the pool has 6 blocks"});
  const std::vector<int32_t> negative = {-1};
  expect_error_mentions([&] { cache->assign_blocks(0, 1, negative); }, {"given block -1"});
  expect_error_mentions([&] { (void)loaded_.model->make_cache(2, 100, 0); }, {"blocks (0) must each be at least 1"});
}

INSTANTIATE_TEST_SUITE_P(Fixtures, PagedCache, ::testing::Values("llama3-tiny", "qwen3_5-text-tiny"),
                         [](const auto& info) { return parameter_name(info.param); });

}  // namespace
