// Speculation with the MTP head on the GPU (engine/mtp_proposer.h): on the dense and the MoE fixture
// with random MTP weights, in f32 with F32 and in bf16 with BF16 activations, a request's tokens and
// logprob bits are those of its plain run on the same backend, greedy and seeded, and every proposal
// is what a fresh head proposes from the plain run's hidden states (the head's cache caught up after
// every depth of acceptance). Plain steps replay decode graphs for the dense fixture while the MTP
// steps run directly, so this also holds the direct multi-token appends to the graph's bits.
#include <filesystem>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "cuda_test_support.h"
#include "mtp_support.h"
#include "speculative_support.h"
#include "test_support.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

class CudaMtpSpeculation : public ::testing::TestWithParam<std::tuple<const char*, DType>> {};

TEST_P(CudaMtpSpeculation, GivesThePlainRunAndProposesAsAFreshHead) {
  KILN_REQUIRE_CUDA();
  const std::string name = std::get<0>(GetParam());
  const DType activations = std::get<1>(GetParam());
  TempDir dir;
  write_with_mtp(fixtures_dir() / name / (activations == DType::BF16 ? "bf16" : "f32"), dir.path());
  TestModel opened = open_with_mtp_head(dir.path(), make_cuda_backend(0, activations));
  Model& model = *opened.model;
  const std::vector<int32_t> own = fixture_prompt(fixtures_dir() / name);
  std::vector<int32_t> prompt;
  while (prompt.size() < 100) prompt.insert(prompt.end(), own.begin(), own.end());
  prompt.resize(100);
  const int64_t context = static_cast<int64_t>(prompt.size()) + kGeneratedTokens + 1;
  for (const float temperature : {0.0f, 0.8f}) {
    const std::string at = name + " at temperature " + std::to_string(temperature);
    const GeneratedRun plain = run_generate(model, prompt, plain_options(temperature));
    for (const size_t period : {0u, 3u}) {
      auto recording = std::make_shared<RecordingMtpProposer>(model, 1, context, prompt, plain.tokens, period);
      const GeneratedRun checked = run_generate(model, prompt, with_speculation(plain_options(temperature), recording, 4));
      expect_same_run(checked, plain, at + ", period " + std::to_string(period));
      EXPECT_GT(checked.counts.verify_steps, 0) << at;
      expect_fresh_head_proposals(model, prompt, plain.tokens, recording->records,
                                  at + ", period " + std::to_string(period));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaMtpSpeculation,
                         ::testing::Values(std::tuple{"qwen3_5-text-tiny", DType::F32},
                                           std::tuple{"qwen3_5-text-tiny", DType::BF16},
                                           std::tuple{"qwen3_5-moe-tiny", DType::F32},
                                           std::tuple{"qwen3_5-moe-tiny", DType::BF16}),
                         [](const auto& info) {
                           std::string name = std::string(std::get<0>(info.param)) + "_" +
                                              std::string(dtype_name(std::get<1>(info.param)));
                           for (char& c : name)
                             if (c == '-' || c == '.') c = '_';
                           return name;
                         });

}  // namespace
