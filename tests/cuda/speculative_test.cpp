// Exact speculative decoding on the GPU (engine/speculative.h): with n-gram, adversarial and oracle
// proposals, greedy and seeded, a request's tokens and logprob bits are those of its plain run on
// the same backend, for the dense fixtures and the hybrid one (its GDN and conv states saved with
// Backend::copy and restored on rejection), in f32 with F32 and in bf16 with BF16 activations,
// and stories260K (f32). The
// verify steps run eagerly while plain steps replay decode graphs, so this also holds the
// (k+1)-row append to the one-row graph's bits.
#include <filesystem>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "cuda_test_support.h"
#include "speculative_support.h"
#include "test_support.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

class CudaSpeculativeDecoding : public ::testing::TestWithParam<std::tuple<const char*, DType>> {};

TEST_P(CudaSpeculativeDecoding, GivesThePlainRunBitForBit) {
  KILN_REQUIRE_CUDA();
  const std::string model_name = std::get<0>(GetParam());
  const DType activations = std::get<1>(GetParam());
  const bool stories = model_name == "stories260K";
  const std::filesystem::path dir =
      stories ? stories_dir() : fixtures_dir() / model_name / (activations == DType::BF16 ? "bf16" : "f32");
  TestModel opened = open_cuda_model(dir, activations);
  std::vector<int32_t> prompt = {1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421};
  if (!stories) {
    prompt = fixture_prompt(fixtures_dir() / model_name);
    prompt.resize(40);
  }
  expect_speculation_gives_the_plain_run(*opened.model, prompt);
}

INSTANTIATE_TEST_SUITE_P(EveryFamily, CudaSpeculativeDecoding,
                         ::testing::Values(std::tuple{"llama3-tiny", DType::F32}, std::tuple{"llama3-tiny", DType::BF16},
                                           std::tuple{"qwen3-tiny", DType::BF16},
                                           std::tuple{"qwen3_5-text-tiny", DType::F32},
                                           std::tuple{"qwen3_5-text-tiny", DType::BF16},
                                           std::tuple{"stories260K", DType::F32}),
                         [](const auto& info) {
                           std::string name = std::string(std::get<0>(info.param)) + "_" + std::string(dtype_name(std::get<1>(info.param)));
                           for (char& c : name)
                             if (c == '-' || c == '.') c = '_';
                           return name;
                         });

}  // namespace
