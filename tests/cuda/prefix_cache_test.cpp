// The prefix cache on the GPU (GenerationCore; the scenarios are tests/prefix_cache_support.h's,
// which the CPU runs too): a request served from cached blocks — and, on a hybrid model, from a
// snapshot of its recurrent state in device memory — gives the tokens, logprobs and top
// alternatives of the same request on a cold scheduler, bit for bit, with F32 and BF16 activations:
// a prompt's prefix, one prompt token left, a chat's next turns, a hit in a batch with others, and
// snapshots and blocks evicted; a snapshot put back into another slot gives the one-shot logits.
#include <cctype>
#include <string>

#include <gtest/gtest.h>

#include "parameter_name.h"
#include "cuda_test_support.h"
#include "prefix_cache_support.h"
#include "test_support.h"

namespace kiln::testing {
namespace {

struct PrefixCase {
  std::string fixture;
  std::string folder;  // "f32" | "bf16"
  DType activations;
  bool hybrid;
};

class CudaPrefixCache : public ::testing::TestWithParam<PrefixCase> {
 protected:
  void SetUp() override {
    KILN_REQUIRE_CUDA();
    const auto fixture = fixtures_dir() / GetParam().fixture;
    loaded_ = open_cuda_model(fixture / GetParam().folder, GetParam().activations);
    prompt_ = fixture_prompt(fixture);
  }

  TestModel loaded_;
  std::vector<int32_t> prompt_;
};

TEST_P(CudaPrefixCache, HitsGiveTheColdAnswerBitForBit) {
  if (GetParam().hybrid)
    expect_hybrid_hits_give_the_cold_answers(*loaded_.model, prompt_);
  else
    expect_attention_hits_give_the_cold_answers(*loaded_.model, prompt_);
}

TEST_P(CudaPrefixCache, HybridEvictionsLeaveTheColdAnswers) {
  if (!GetParam().hybrid) GTEST_SKIP() << "a KV cache keeps no snapshots (its evictions: the CPU's pool tests)";
  expect_hybrid_evictions_keep_the_cold_answers(*loaded_.model, prompt_);
}

TEST_P(CudaPrefixCache, ASnapshotPutBackInAnotherSlotGivesTheOneShotLogits) {
  if (!GetParam().hybrid) GTEST_SKIP() << "a KV cache keeps no snapshots";
  expect_a_snapshot_resumes_with_the_one_shot_logits(*loaded_.model, prompt_);
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, CudaPrefixCache,
    ::testing::Values(PrefixCase{"llama3-tiny", "f32", DType::F32, false},
                      PrefixCase{"llama3-tiny", "bf16", DType::BF16, false},
                      PrefixCase{"qwen3-moe-tiny", "bf16", DType::BF16, false},
                      PrefixCase{"qwen3_5-text-tiny", "f32", DType::F32, true},
                      PrefixCase{"qwen3_5-text-tiny", "bf16", DType::BF16, true},
                      PrefixCase{"qwen3_5-moe-tiny", "bf16", DType::BF16, true}),
    [](const auto& info) { return parameter_name(info.param.fixture + "_" + info.param.folder); });

}  // namespace
}  // namespace kiln::testing
