// Quantized checkpoints end to end on the CPU: the project's MLX affine (4-bit with 8-bit
// per-module entries) and FP8 block fixtures against the float64 forward of their dequantized
// weights, and the load-time refusals of malformed quantized checkpoints.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "engine/generation.h"
#include "model/loader.h"
#include "model_test_support.h"
#include "test_support.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

std::filesystem::path project_fixture(const std::string& name) { return source_dir() / "tests/data/fixtures" / name; }

class QuantizedParity : public ::testing::TestWithParam<std::string> {};

TEST_P(QuantizedParity, F32ActivationsMatchFloat64OfTheDequantizedWeights) {
  const auto fixture = project_fixture(GetParam());
  TestModel loaded = open_cpu_model(fixture / "q");
  const Tensor logits = prompt_logits(*loaded.model, fixture_prompt(fixture), 0);
  const std::vector<double> errors = row_relative_errors(logits, read_npy(fixture / "q/ref_logits_f64.npy"));
  ASSERT_EQ(errors.size(), 300u);
  for (size_t row = 0; row < errors.size(); ++row) ASSERT_LE(errors[row], 1e-4) << "position " << row;
}

TEST_P(QuantizedParity, GreedyContinuationMatchesFloat64Reference) {
  const auto fixture = project_fixture(GetParam());
  TestModel loaded = open_cpu_model(fixture / "q");
  expect_greedy_continuation_of_float64_reference(*loaded.model, fixture);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, QuantizedParity, ::testing::Values("qwen3-mlx-tiny", "llama3-fp8-tiny"));

}  // namespace
