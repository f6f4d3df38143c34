// The invariance contract on the CPU backend, quantized weights and mixtures of experts included: a token's logits are
// bit-identical however its sequence is prefilled (one shot, chunked — at any split for
// attention-only models, at multiples of 64 for the hybrid Gated DeltaNet models —, token by token
// or in small appends), whatever else shares the batch, and whatever the thread count.
#include <cstring>
#include <random>

#include <gtest/gtest.h>

#include "parameter_name.h"
#include "core/thread_pool.h"
#include "engine/generation.h"
#include "model_test_support.h"
#include "test_support.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

struct InvarianceCase {
  std::string fixture;
  std::string dtype_dir;
  bool hybrid = false;  // GDN chunks fall on absolute multiples of 64: splits must too
};

std::string case_name(const ::testing::TestParamInfo<InvarianceCase>& info) {
  return parameter_name(info.param.fixture + "_" + info.param.dtype_dir);
}

void expect_bit_identical(const Tensor& a, const Tensor& b, const std::string& what) {
  ASSERT_EQ(a.shape(), b.shape()) << what;
  const int64_t vocab = a.dim(1);
  for (int64_t row = 0; row < a.dim(0); ++row)
    ASSERT_EQ(std::memcmp(a.data<float>() + row * vocab, b.data<float>() + row * vocab, vocab * sizeof(float)), 0)
        << what << ": row " << row << " differs";
}

class Invariance : public ::testing::TestWithParam<InvarianceCase> {
 protected:
  void SetUp() override {
    fixture_ = fixtures_dir() / GetParam().fixture;
    loaded_ = open_cpu_model(fixture_ / GetParam().dtype_dir);
    prompt_ = fixture_prompt(fixture_);
    prompt_.resize(150);
  }
  std::filesystem::path fixture_;
  TestModel loaded_;
  std::vector<int32_t> prompt_;
};

TEST_P(Invariance, ChunkedPrefillAtRandomSplitsAndTokenByTokenEqualOneShot) {
  Model& model = *loaded_.model;
  const Tensor one_shot = logits_with_cuts(model, prompt_, {});
  const size_t split_unit = GetParam().hybrid ? 64 : 1;
  std::mt19937 random(7);
  for (int trial = 0; trial < 3; ++trial) {
    std::vector<size_t> cuts;
    for (size_t position = split_unit; position < prompt_.size(); position += split_unit)
      if (random() % (GetParam().hybrid ? 2 : 23) == 0) cuts.push_back(position);
    expect_bit_identical(one_shot, logits_with_cuts(model, prompt_, cuts), "random chunking");
  }
  const size_t prefill = GetParam().hybrid ? 128 : 40;
  std::vector<size_t> token_by_token;
  for (size_t position = prefill; position < prompt_.size(); ++position) token_by_token.push_back(position);
  expect_bit_identical(one_shot, logits_with_cuts(model, prompt_, token_by_token), "prefill then one by one");
}

TEST_P(Invariance, SmallAppendsEqualTokenByTokenDecode) {
  // What exact speculative decoding needs: k ≤ 16 tokens appended in one step give the logits
  // of decoding them one at a time.
  Model& model = *loaded_.model;
  std::vector<size_t> one_by_one, appends;
  for (size_t position = 128; position < prompt_.size(); ++position) one_by_one.push_back(position);
  for (size_t position = 128, k = 1; position < prompt_.size(); position += k, k = k % 16 + 1) appends.push_back(position);
  expect_bit_identical(logits_with_cuts(model, prompt_, one_by_one), logits_with_cuts(model, prompt_, appends),
                       "appends of 1..16 tokens vs one by one");
}

TEST_P(Invariance, SequenceAloneEqualsSequenceInBatchOfThree) {
  const AloneAndBatched runs = alone_and_in_a_batch_of_three(*loaded_.model, prompt_);
  expect_bit_identical(runs.alone_prefill, runs.batched_prefill, "prefill in a batch of 3");
  expect_bit_identical(runs.alone_decode, runs.batched_decode, "decode in a batch of 3");
}

TEST_P(Invariance, OneThreadEqualsTwoThreads) {
  Model& model = *loaded_.model;
  ThreadPool::set_global_threads(1);
  const Tensor single = logits_with_cuts(model, prompt_, {70});
  ThreadPool::set_global_threads(2);
  const Tensor pair = logits_with_cuts(model, prompt_, {70});
  ThreadPool::set_global_threads(3);
  const Tensor triple = logits_with_cuts(model, prompt_, {70});
  expect_bit_identical(single, pair, "1 vs 2 threads");
  expect_bit_identical(single, triple, "1 vs 3 threads");
}

INSTANTIATE_TEST_SUITE_P(Models, Invariance,
                         ::testing::Values(InvarianceCase{"llama3-tiny", "f32"}, InvarianceCase{"llama3-tiny", "bf16"},
                                           InvarianceCase{"qwen3-tiny", "f32"}, InvarianceCase{"qwen3-tiny", "bf16"},
                                           InvarianceCase{"qwen3_5-text-tiny", "f32", true},
                                           InvarianceCase{"qwen3_5-text-tiny", "bf16", true},
                                           InvarianceCase{"qwen3_5-vl-tiny", "bf16", true},
                                           InvarianceCase{"qwen3-mlx-tiny", "q"},
                                           InvarianceCase{"llama3-fp8-tiny", "q"},
                                           InvarianceCase{"qwen3-moe-tiny", "f32"},
                                           InvarianceCase{"qwen3-moe-tiny", "bf16"},
                                           InvarianceCase{"qwen3_5-moe-tiny", "f32", true},
                                           InvarianceCase{"qwen3_5-moe-tiny", "bf16", true}),
                         case_name);

}  // namespace
