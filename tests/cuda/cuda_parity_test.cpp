// Every fixture (Llama-3, Qwen3, the hybrid Qwen3.5 in both layouts, and the Qwen3-MoE and
// Qwen3.5-MoE mixtures of experts) on the CUDA backend,
// loaded through the same path as the CLI:
// F32 activations against transformers' float64 logits, BF16 activations no further from them
// than transformers' own bf16 run, and a prompt's logits bit-identical whether it is prefilled in
// one call, in 64-token chunks, or decoded one token at a time (for the hybrid models, after the
// last whole 64-token chunk).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <string>

#include <gtest/gtest.h>

#include "backend/cuda/cuda_backend.h"
#include "cuda_test_support.h"
#include "engine/generation.h"
#include "model/loader.h"
#include "model_test_support.h"
#include "test_support.h"

namespace kiln::testing {
namespace {


class CudaFixtureParity : public ::testing::TestWithParam<std::string> {
 protected:
  // The logits of every position of `fixture`'s prompt (a host tensor), from its `checkpoint`
  // folder ("f32" or "bf16") loaded on the CUDA backend with `activations`, prefilled in one step.
  static Tensor whole_prompt_logits(const std::filesystem::path& fixture, const std::string& checkpoint,
                                    DType activations) {
    TestModel loaded = open_cuda_model(fixture / checkpoint, activations);
    return prompt_logits(*loaded.model, fixture_prompt(fixture), kWholePrompt);
  }
};

TEST_P(CudaFixtureParity, F32MatchesFloat64ReferenceAtEveryPosition) {
  KILN_REQUIRE_CUDA();
  const std::filesystem::path fixture = fixtures_dir() / GetParam();
  const Tensor logits = whole_prompt_logits(fixture, "f32", DType::F32);
  const std::vector<double> errors = row_relative_errors(logits, read_npy(fixture / "f32/ref_logits_f64.npy"));
  ASSERT_EQ(errors.size(), 300u);
  for (size_t row = 0; row < errors.size(); ++row) ASSERT_LE(errors[row], 1e-4) << "position " << row;
}

TEST_P(CudaFixtureParity, Bf16IsNoFurtherFromTruthThanTransformersBf16) {
  KILN_REQUIRE_CUDA();
  const std::filesystem::path fixture = fixtures_dir() / GetParam();
  const Tensor logits = whole_prompt_logits(fixture, "bf16", DType::BF16);
  const auto [ours, theirs] = bf16_row_errors(logits, fixture / "bf16");
  ASSERT_EQ(ours.size(), theirs.size());
  // transformers' own bf16 error on the fixture is its mean and its worst row error; kiln's bf16 path
  // must be within 1.5 × of both. Row by row the two are independent draws of rounding noise (the
  // same rounding points accumulated in different orders): a float64 torch emulation of
  // qwen3_5-text-tiny that rounds only the matmul inputs to bf16 — the least any bf16 tensor-core
  // path rounds — still has a row at 3.9 × transformers' error at that row (docs/numerics.md), so rows
  // over 1.5 × are reported, not failed.
  const auto mean = [](const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0) / v.size(); };
  const auto our_worst_row = std::max_element(ours.begin(), ours.end());
  const double our_worst = *our_worst_row;
  const double their_worst = *std::max_element(theirs.begin(), theirs.end());
  size_t rows_over = 0;
  for (size_t row = 0; row < ours.size(); ++row) rows_over += ours[row] > 1.5 * theirs[row];
  std::printf("%s bf16 error: mean %.5f (transformers %.5f), worst row %.5f at position %td (transformers %.5f), %zu "
              "of %zu rows over 1.5 x transformers' error at that row\n",
              GetParam().c_str(), mean(ours), mean(theirs), our_worst, our_worst_row - ours.begin(), their_worst,
              rows_over, ours.size());
  EXPECT_LE(mean(ours), 1.5 * mean(theirs));
  EXPECT_LE(our_worst, 1.5 * their_worst);
}

TEST_P(CudaFixtureParity, GreedyContinuationMatchesFloat64Reference) {
  KILN_REQUIRE_CUDA();
  const std::filesystem::path fixture = fixtures_dir() / GetParam();
  TestModel loaded = open_cuda_model(fixture / "f32", DType::F32);
  expect_greedy_continuation_of_float64_reference(*loaded.model, fixture);
}

// Every position's logits, through the whole graph: one-shot prefill, 64-token chunks, and
// token-by-token decode (which takes the decode matmul and split-KV attention kernels). The hybrid
// models compute whole aligned 64-token chunks of the delta rule in the chunked form, so their
// token-by-token decode starts after the last such chunk (position 256 of 300), as on the CPU.
TEST_P(CudaFixtureParity, LogitsAreBitIdenticalOneShotChunkedAndDecoded) {
  KILN_REQUIRE_CUDA();
  const std::filesystem::path fixture = fixtures_dir() / GetParam();
  const bool hybrid = GetParam().starts_with("qwen3_5");
  for (const auto& [folder, activations] : {std::pair{"f32", DType::F32}, std::pair{"bf16", DType::BF16}}) {
    TestModel loaded = open_cuda_model(fixture / folder, activations);
    const std::vector<int32_t> prompt = fixture_prompt(fixture);
    const Tensor one_shot = prompt_logits(*loaded.model, prompt, 0);
    std::vector<size_t> chunks_of_64, token_by_token;
    for (size_t position = 64; position < prompt.size(); position += 64) chunks_of_64.push_back(position);
    for (size_t position = hybrid ? prompt.size() / 64 * 64 : 1; position < prompt.size(); ++position)
      token_by_token.push_back(position);
    for (const auto& [name, cuts] : {std::pair{"chunks of 64", chunks_of_64}, std::pair{"token by token", token_by_token}}) {
      const Tensor stepped = logits_with_cuts(*loaded.model, prompt, cuts);
      for (int64_t row = 0; row < one_shot.dim(0); ++row)
        ASSERT_TRUE(same_rows(stepped, row, one_shot, row, 1))
            << folder << ": position " << row << " differs between one-shot and " << name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaFixtureParity,
                         ::testing::Values("llama3-tiny", "qwen3-tiny", "qwen3_5-text-tiny", "qwen3_5-vl-tiny",
                                           "qwen3-moe-tiny", "qwen3_5-moe-tiny"),
                         [](const auto& info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

}  // namespace
}  // namespace kiln::testing
