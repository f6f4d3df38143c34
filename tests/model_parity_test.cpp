// Parity of every family graph (Llama-3, Qwen3, Qwen3.5 in both checkpoint layouts) against
// transformers on the fixtures, and of the real stories260K model against its reference decode.
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "engine/generation.h"
#include "model_test_support.h"
#include "test_support.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

class ModelParity : public ::testing::TestWithParam<std::string> {};

TEST_P(ModelParity, F32MatchesFloat64ReferenceAtEveryPosition) {
  const auto fixture = fixtures_dir() / GetParam();
  TestModel loaded = open_cpu_model(fixture / "f32");
  const Tensor logits = prompt_logits(*loaded.model, fixture_prompt(fixture), 0);
  const std::vector<double> errors = row_relative_errors(logits, read_npy(fixture / "f32/ref_logits_f64.npy"));
  ASSERT_EQ(errors.size(), 300u);
  for (size_t row = 0; row < errors.size(); ++row) ASSERT_LE(errors[row], 1e-4) << "position " << row;
}

TEST_P(ModelParity, Bf16IsNoFurtherFromTruthThanTransformersBf16) {
  const auto fixture = fixtures_dir() / GetParam();
  TestModel loaded = open_cpu_model(fixture / "bf16");
  const Tensor logits = prompt_logits(*loaded.model, fixture_prompt(fixture), 0);
  const auto [ours, theirs] = bf16_row_errors(logits, fixture / "bf16");
  for (size_t row = 0; row < ours.size(); ++row)
    ASSERT_LE(ours[row], 1.5 * theirs[row]) << "position " << row << " (transformers bf16 error " << theirs[row] << ")";
}

TEST_P(ModelParity, GreedyContinuationMatchesFloat64Reference) {
  const auto fixture = fixtures_dir() / GetParam();
  TestModel loaded = open_cpu_model(fixture / "f32");
  expect_greedy_continuation_of_float64_reference(*loaded.model, fixture);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ModelParity,
                         ::testing::Values("llama3-tiny", "qwen3-tiny", "qwen3_5-text-tiny", "qwen3_5-vl-tiny"));

TEST(Stories260K, GreedyFromBosReproducesReferenceIds) {
  const auto model_dir = stories_dir();
  nlohmann::json ref = nlohmann::json::parse(std::ifstream(model_dir / "ref_greedy.json"));
  TestModel loaded = open_cpu_model(model_dir);
  GenerationOptions options;
  options.sampling.temperature = 0;
  options.max_tokens = static_cast<int64_t>(ref["greedy_ids"].size());
  options.stop_ids = {1};  // llama2.c stops on BOS (see the model's README)
  const GenerationResult result = generate(*loaded.model, ref["input_ids"].get<std::vector<int32_t>>(), options);
  EXPECT_EQ(result.tokens, ref["greedy_ids"].get<std::vector<int32_t>>());
}

TEST(Stories260K, FirstLogitsMatchReference) {
  const auto model_dir = stories_dir();
  nlohmann::json ref = nlohmann::json::parse(std::ifstream(model_dir / "ref_greedy.json"));
  TestModel loaded = open_cpu_model(model_dir);
  std::vector<int32_t> path = ref["input_ids"].get<std::vector<int32_t>>();
  const auto greedy = ref["greedy_ids"].get<std::vector<int32_t>>();
  path.insert(path.end(), greedy.begin(), greedy.begin() + 7);
  const Tensor logits = prompt_logits(*loaded.model, path, 0);
  const auto& expected = ref["logits_first8"];
  for (size_t position = 0; position < 8; ++position)
    for (size_t token = 0; token < 512; ++token)
      ASSERT_NEAR(logits.data<float>()[position * 512 + token], expected[position][token].get<double>(), 2e-5)
          << "position " << position << " token " << token;
}

}  // namespace
