// The paged KV cache on the GPU (backend.h, model.h's ModelCache): a sequence whose blocks are
// scattered over the pool in any order gives the bits of the same sequence in the blocks a cache
// starts with — one-shot prefill, chunked prefill and decode, with F32 and BF16 activations, for
// the dense graph and the hybrid one — and captured decode graphs read the block table when they
// replay: blocks assigned after the capture are the ones a replay attends to.
#include <cstring>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "parameter_name.h"
#include "cuda_test_support.h"
#include "engine/decode_graph.h"
#include "engine/generation.h"
#include "model_test_support.h"
#include "test_support.h"

namespace kiln::testing {
namespace {

constexpr int64_t kCapacity = 256;  // 4 blocks a slot
constexpr int64_t kLength = 200;    // the sequence: blocks 0..3, the last partial
constexpr int64_t kDecodeFrom = 100;

struct PagedCase {
  std::string fixture;
  std::string folder;  // "f32" | "bf16"
  DType activations;
};

// The pool's blocks in a fixed shuffled order (a Fisher–Yates written out, the same in every build).
std::vector<int32_t> shuffled_blocks(int64_t blocks, uint32_t seed) {
  std::vector<int32_t> order(static_cast<size_t>(blocks));
  std::iota(order.begin(), order.end(), 0);
  std::mt19937 random(seed);
  for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[random() % i]);
  return order;
}

void expect_same_rows(const Tensor& actual, const Tensor& expected, const std::string& what) {
  ASSERT_EQ(actual.shape(), expected.shape()) << what;
  for (int64_t row = 0; row < actual.dim(0); ++row)
    ASSERT_TRUE(same_rows(actual, row, expected, row, 1)) << what << ": row " << row << " differs";
}

class CudaPagedCache : public ::testing::TestWithParam<PagedCase> {
 protected:
  void SetUp() override {
    KILN_REQUIRE_CUDA();
    const auto fixture = fixtures_dir() / GetParam().fixture;
    loaded_ = open_cuda_model(fixture / GetParam().folder, GetParam().activations);
    prompt_ = fixture_prompt(fixture);
    prompt_.resize(kLength);
  }

  // A cache of two slots and a spare block, slot s given the blocks of `order` from s · 4.
  std::unique_ptr<ModelCache> scattered_cache(uint32_t seed) {
    const std::vector<int32_t> order = shuffled_blocks(2 * 4 + 1, seed);
    auto cache = loaded_.model->make_cache(2, kCapacity, 2 * 4 + 1);
    for (int32_t slot = 0; slot < 2; ++slot)
      cache->assign_blocks(slot, 0, std::span<const int32_t>(order).subspan(static_cast<size_t>(slot) * 4, 4));
    return cache;
  }

  // The logits of every position of the sequence in slot 1, prefilled in steps ending at `cuts`
  // (the last runs to kLength − decoded), then the last `decoded` tokens one step each.
  Tensor logits(ModelCache& cache, std::vector<int64_t> cuts, int64_t decoded) {
    Model& model = *loaded_.model;
    const int64_t vocab = model.config().vocab_size;
    Tensor all = Tensor::empty({kLength, vocab}, DType::F32);
    cuts.push_back(kLength - decoded);
    int64_t start = 0;
    for (int64_t end : cuts) {
      const Tensor step = run_step(model, cache, {SequenceStep{1, static_cast<int32_t>(start),
                                                               std::vector<int32_t>(prompt_.begin() + start,
                                                                                    prompt_.begin() + end),
                                                               true}});
      std::memcpy(all.data<float>() + start * vocab, step.raw(), step.nbytes());
      start = end;
    }
    for (int64_t position = start; position < kLength; ++position) {
      const Tensor step = run_step(model, cache, {SequenceStep{1, static_cast<int32_t>(position),
                                                               {prompt_[static_cast<size_t>(position)]}, true}});
      std::memcpy(all.data<float>() + position * vocab, step.raw(), step.nbytes());
    }
    return all;
  }

  // The prompt prefilled in slot 1 to kDecodeFrom, then decoded to kLength (the prompt's tokens
  // fed) through `graphs`: the logits rows of the decoded positions.
  Tensor graph_decode_logits(ModelCache& cache, DecodeGraphs& graphs) {
    Model& model = *loaded_.model;
    const int64_t vocab = model.config().vocab_size;
    run_step(model, cache,
             {SequenceStep{1, 0, std::vector<int32_t>(prompt_.begin(), prompt_.begin() + kDecodeFrom), false}});
    Tensor rows = Tensor::empty({kLength - kDecodeFrom, vocab}, DType::F32);
    for (int64_t position = kDecodeFrom; position < kLength; ++position) {
      graphs.step({DecodeRow{1, static_cast<int32_t>(position), prompt_[static_cast<size_t>(position)], nullptr}});
      const Tensor step = loaded_.backend->download(graphs.last_logits());
      std::memcpy(rows.data<float>() + (position - kDecodeFrom) * vocab, step.raw(),
                  static_cast<size_t>(vocab) * sizeof(float));
    }
    return rows;
  }

  TestModel loaded_;
  std::vector<int32_t> prompt_;
};

TEST_P(CudaPagedCache, ScatteredBlocksGiveTheBitsOfContiguousOnesInEveryKindOfStep) {
  Model& model = *loaded_.model;
  auto contiguous = [&] { return model.make_cache(2, kCapacity); };
  expect_same_rows(logits(*scattered_cache(11), {}, 0), logits(*contiguous(), {}, 0), "one-shot prefill");
  expect_same_rows(logits(*scattered_cache(12), {64, 128}, 0), logits(*contiguous(), {64, 128}, 0),
                   "chunked prefill");
  expect_same_rows(logits(*scattered_cache(13), {}, kLength - 60), logits(*contiguous(), {}, kLength - 60), "decode");
}

// Graphs captured over one block assignment replay over the next: the table is read when a replay
// runs, so a slot given other blocks after the capture attends to those.
TEST_P(CudaPagedCache, DecodeGraphsReadTheBlockTableWhenTheyReplay) {
  Model& model = *loaded_.model;
  if (!DecodeGraphs::supported(model)) GTEST_SKIP() << "this model's decode steps run directly";
  auto contiguous = model.make_cache(2, kCapacity);
  const Tensor all = logits(*contiguous, {}, kLength - kDecodeFrom);
  const Tensor expected = all.slice_rows(kDecodeFrom, kLength - kDecodeFrom);

  auto cache = scattered_cache(21);
  DecodeGraphs graphs(model, *cache);
  expect_same_rows(graph_decode_logits(*cache, graphs), expected, "captured over the first blocks");
  EXPECT_EQ(graphs.graphs(), 1u);
  cache->reset_slot(1);
  const std::vector<int32_t> reordered = {8, 2, 0, 5};  // the spare block and slot 0's among them
  cache->assign_blocks(1, 0, reordered);
  expect_same_rows(graph_decode_logits(*cache, graphs), expected, "replayed over blocks given after the capture");
  EXPECT_EQ(graphs.graphs(), 1u) << "the second sequence replays the graph captured for the first";
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, CudaPagedCache,
    ::testing::Values(PagedCase{"llama3-tiny", "f32", DType::F32}, PagedCase{"llama3-tiny", "bf16", DType::BF16},
                      PagedCase{"qwen3_5-text-tiny", "f32", DType::F32},
                      PagedCase{"qwen3_5-text-tiny", "bf16", DType::BF16}),
    [](const auto& info) { return parameter_name(info.param.fixture + "_" + info.param.folder); });

}  // namespace
}  // namespace kiln::testing
