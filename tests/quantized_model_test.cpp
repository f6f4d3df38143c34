// Quantized checkpoints end to end on the CPU: the project's MLX affine (4-bit with 8-bit
// per-module entries) and FP8 block fixtures against the float64 forward of their dequantized
// weights, and the load-time refusals of malformed quantized checkpoints.
#include <fstream>
#include <functional>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/weight.h"
#include "engine/generation.h"
#include "io/safetensors.h"
#include "io/safetensors_writer.h"
#include "model/loader.h"
#include "model_test_support.h"
#include "test_support.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

class QuantizedParity : public ::testing::TestWithParam<std::string> {};

TEST_P(QuantizedParity, F32ActivationsMatchFloat64OfTheDequantizedWeights) {
  const auto fixture = fixtures_dir() / GetParam();
  TestModel loaded = open_cpu_model(fixture / "q");
  const Tensor logits = prompt_logits(*loaded.model, fixture_prompt(fixture), 0);
  const std::vector<double> errors = row_relative_errors(logits, read_npy(fixture / "q/ref_logits_f64.npy"));
  ASSERT_EQ(errors.size(), 300u);
  for (size_t row = 0; row < errors.size(); ++row) ASSERT_LE(errors[row], 1e-4) << "position " << row;
}

TEST_P(QuantizedParity, GreedyContinuationMatchesFloat64Reference) {
  const auto fixture = fixtures_dir() / GetParam();
  TestModel loaded = open_cpu_model(fixture / "q");
  expect_greedy_continuation_of_float64_reference(*loaded.model, fixture);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, QuantizedParity, ::testing::Values("qwen3-mlx-tiny", "llama3-fp8-tiny"));

// The CUDA backend's activation dtype follows planned_float_dtype: a quantized checkpoint's packed
// codes (U32 words, FP8 values) must not count, or a bf16-scaled 4-bit model runs on the f32 path.
TEST(QuantizedCheckpoint, PlannedFloatDtypeIsTheDtypeOfTheUnpackedTensors) {
  const auto plan_of = [](const std::filesystem::path& dir) { return plan_model(dir, Device::CPU, true); };
  EXPECT_EQ(planned_float_dtype(plan_of(fixtures_dir() / "qwen3-mlx-tiny/q")), DType::BF16);
  EXPECT_EQ(planned_float_dtype(plan_of(fixtures_dir() / "llama3-fp8-tiny/q")), DType::BF16);
  EXPECT_EQ(planned_float_dtype(plan_of(fixtures_dir() / "qwen3-tiny/bf16")), DType::BF16);
  EXPECT_EQ(planned_float_dtype(plan_of(fixtures_dir() / "qwen3-tiny/f32")), DType::F32);
}

using Entries = std::vector<SafetensorsEntry>;

// A copy of a project fixture's checkpoint with its tensors and config.json edited.
std::filesystem::path edited_fixture(const TempDir& temp, const std::string& name,
                                     const std::function<void(Entries&)>& edit_tensors,
                                     const std::function<void(nlohmann::json&)>& edit_config = {}) {
  const auto source = fixtures_dir() / name / "q";
  const auto target = temp.path() / name;
  std::filesystem::create_directories(target);
  nlohmann::json config = nlohmann::json::parse(std::ifstream(source / "config.json"));
  if (edit_config) edit_config(config);
  std::ofstream(target / "config.json") << config.dump();
  const Checkpoint checkpoint = Checkpoint::open(source);
  Entries entries;
  for (const auto& [tensor_name, info] : checkpoint.tensors()) {
    const Tensor tensor = checkpoint.view(tensor_name);
    const auto* bytes = static_cast<const uint8_t*>(tensor.raw());
    entries.push_back({tensor_name, info.dtype, info.shape, {bytes, bytes + tensor.nbytes()}, {}});
  }
  edit_tensors(entries);
  write_safetensors(target / "model.safetensors", entries);
  return target;
}

SafetensorsEntry& entry(Entries& entries, const std::string& name) {
  for (SafetensorsEntry& candidate : entries)
    if (candidate.name == name) return candidate;
  throw std::runtime_error("test fixture has no tensor " + name);
}

void remove_tensor(Entries& entries, const std::string& name) {
  std::erase_if(entries, [&](const SafetensorsEntry& candidate) { return candidate.name == name; });
}

// Planning alone (no weight byte read) must refuse it: the error comes from plan_model.
void expect_plan_refused(const std::filesystem::path& dir, const std::vector<std::string>& fragments) {
  expect_error_mentions([&] { plan_model(dir, Device::CPU, true); }, fragments);
}

constexpr const char* kQProj = "model.layers.0.self_attn.q_proj";

TEST(QuantizedCheckpoint, ScalesOfTheWrongShapeAreRefusedNamingTheTensor) {
  TempDir temp;
  const auto dir = edited_fixture(temp, "qwen3-mlx-tiny", [](Entries& entries) {
    SafetensorsEntry& scales = entry(entries, std::string(kQProj) + ".scales");
    scales.shape = {scales.shape[0] / 2, scales.shape[1] * 2};
  });
  expect_plan_refused(dir, {"model.safetensors", "q_proj.scales", "wrong shape [64, 4]", "expected [128, 2]"});
}

TEST(QuantizedCheckpoint, MissingBiasesAreRefusedNamingTheTensor) {
  TempDir temp;
  const auto dir = edited_fixture(temp, "qwen3-mlx-tiny", [](Entries& entries) { remove_tensor(entries, std::string(kQProj) + ".biases"); });
  expect_plan_refused(dir, {"q_proj.scales", "its biases 'model.layers.0.self_attn.q_proj.biases' are missing"});
}

TEST(QuantizedCheckpoint, BiasesInAnotherDtypeThanTheScalesAreRefused) {
  TempDir temp;
  const auto dir = edited_fixture(temp, "qwen3-mlx-tiny", [](Entries& entries) {
    SafetensorsEntry& biases = entry(entries, std::string(kQProj) + ".biases");
    biases.dtype = DType::F32;
    biases.bytes.resize(biases.nbytes());
  });
  expect_plan_refused(dir, {"q_proj.biases", "dtype F32 differs from its scales' BF16"});
}

TEST(QuantizedCheckpoint, BitsThatDisagreeWithThePackedWidthAreRefused) {
  TempDir temp;
  const auto dir = edited_fixture(temp, "qwen3-mlx-tiny", [](Entries&) {}, [](nlohmann::json& config) {
    config["quantization"]["bits"] = 3;
  });
  expect_plan_refused(dir, {"model.safetensors", "16 packed words per row do not hold whole 3-bit codes"});
}

TEST(QuantizedCheckpoint, AModuleEntryNamingNoQuantizedModuleIsRefused) {
  TempDir temp;
  const auto dir = edited_fixture(temp, "qwen3-mlx-tiny", [](Entries&) {}, [](nlohmann::json& config) {
    config["quantization"]["model.layers.9.mlp.down_proj"] = {{"group_size", 64}, {"bits", 8}};
  });
  expect_plan_refused(dir, {"config.json", "field 'quantization.model.layers.9.mlp.down_proj'",
                            "names no quantized module"});
}

TEST(QuantizedCheckpoint, AModuleMarkedUnquantizedThatHoldsScalesIsRefused) {
  TempDir temp;
  const auto dir = edited_fixture(temp, "qwen3-mlx-tiny", [](Entries&) {}, [](nlohmann::json& config) {
    config["quantization"][kQProj] = false;
  });
  expect_plan_refused(dir, {"field 'quantization.model.layers.0.self_attn.q_proj' is false", "q_proj.scales"});
}

TEST(QuantizedCheckpoint, PackedCodesWithoutAQuantizationConfigAreRefused) {
  TempDir temp;
  const auto dir = edited_fixture(temp, "qwen3-mlx-tiny", [](Entries&) {}, [](nlohmann::json& config) {
    config.erase("quantization");
    config.erase("quantization_config");
  });
  expect_plan_refused(dir, {"model.safetensors", "dtype U32 is not a floating-point weight", "(none)"});
}

TEST(QuantizedCheckpoint, Fp8WithoutItsScaleIsRefused) {
  TempDir temp;
  const auto dir = edited_fixture(temp, "llama3-fp8-tiny", [](Entries& entries) {
    remove_tensor(entries, "model.layers.1.mlp.up_proj.weight_scale_inv");
  });
  expect_plan_refused(dir, {"'model.layers.1.mlp.up_proj.weight'", "dtype F8_E4M3 is not a floating-point weight"});
}

TEST(QuantizedCheckpoint, Fp8ScalesOfTheWrongShapeAreRefused) {
  TempDir temp;
  const auto dir = edited_fixture(temp, "llama3-fp8-tiny", [](Entries& entries) {
    SafetensorsEntry& scales = entry(entries, "model.layers.1.mlp.up_proj.weight_scale_inv");
    scales.shape = {scales.shape[1], scales.shape[0]};
  });
  expect_plan_refused(dir, {"up_proj.weight_scale_inv", "wrong shape [2, 5], expected [5, 2]", "128x128 blocks"});
}

TEST(QuantizedWeight, PartsAreCheckedAgainstEachOther) {
  const Tensor codes = Tensor::zeros({2, 12}, DType::U32);  // 96 4-bit codes per row
  const Tensor groups = Tensor::zeros({2, 1}, DType::BF16);
  expect_error_mentions([&] { Weight::affine(codes, groups, groups, 4, 64); },
                        {"group size 64 does not divide the input dimension 96"});
  expect_error_mentions([&] { Weight::affine(codes, groups, groups, 7, 32); }, {"7 bits is not one of"});
  const Tensor two = Tensor::zeros({2, 2}, DType::BF16);
  expect_error_mentions([&] { Weight::affine(codes, two, two, 4, 32); }, {"scales are [2, 2]", "expected [2, 3]"});
  expect_error_mentions([&] { Weight::affine(codes, Tensor::zeros({2, 3}, DType::BF16), Tensor::zeros({2, 3}, DType::F32), 4, 32); },
                        {"biases are F32 but scales are BF16"});
  expect_error_mentions([&] { Weight::fp8_block(Tensor::zeros({200, 328}, DType::F8E4M3), Tensor::zeros({2, 2}, DType::F32), 128, 128); },
                        {"weight_scale_inv is [2, 2], expected [2, 3]"});
}

// The decode rule of core/weight.h on hand-made values: the codes of a row form one little-endian
// bit stream (3-bit codes cross word boundaries), and w = fma(scale, q, bias).
TEST(QuantizedWeight, DecodesCodesScalesAndBiasesExactly) {
  Tensor codes = Tensor::zeros({1, 3}, DType::U32);  // 32 3-bit codes
  for (int64_t i = 0; i < 32; ++i) {
    const uint64_t bit = static_cast<uint64_t>(i) * 3, value = static_cast<uint64_t>(i % 8);
    codes.data<uint32_t>()[bit / 32] |= static_cast<uint32_t>(value << (bit % 32));
    if (bit % 32 + 3 > 32) codes.data<uint32_t>()[bit / 32 + 1] |= static_cast<uint32_t>(value >> (32 - bit % 32));
  }
  Tensor scales = Tensor::empty({1, 1}, DType::BF16), biases = Tensor::empty({1, 1}, DType::BF16);
  scales.data<uint16_t>()[0] = f32_to_bf16(0.5f);
  biases.data<uint16_t>()[0] = f32_to_bf16(-1.25f);
  const Weight weight = Weight::affine(codes, scales, biases, 3, 32);
  std::vector<float> decoded(32);
  decode_rows(weight, 0, 1, decoded.data());
  for (int64_t i = 0; i < 32; ++i) EXPECT_EQ(decoded[i], 0.5f * static_cast<float>(i % 8) - 1.25f) << "code " << i;
}

// A weight whose codes a backend rearranged (CodeOrder::Fragment, the CUDA backend's) keeps that
// order through row views and new parts, and nothing on the host reads it as if it were stored.
TEST(QuantizedWeight, CodesInTheFragmentOrderAreReadByTheCudaKernelsOnly) {
  const Tensor codes = Tensor::zeros({4, 8}, DType::U32);  // 64 4-bit codes per row
  const Tensor groups = Tensor::zeros({4, 1}, DType::BF16);
  const Weight stored = Weight::affine(codes, groups, groups, 4, 64);
  EXPECT_EQ(stored.code_order(), CodeOrder::Stored);
  const Weight arranged = stored.in_code_order(CodeOrder::Fragment);
  EXPECT_EQ(arranged.code_order(), CodeOrder::Fragment);
  EXPECT_EQ(arranged.rows(1, 2).code_order(), CodeOrder::Fragment);
  EXPECT_EQ(arranged.with_parts(Tensor::zeros({4, 8}, DType::U32), groups, groups).code_order(), CodeOrder::Fragment);
  expect_error_mentions([&] { Weight(Tensor::zeros({2, 2}, DType::F32)).in_code_order(CodeOrder::Fragment); },
                        {"dense weight has no codes"});
  std::vector<float> decoded(4 * 64);
  expect_error_mentions([&] { decode_rows(arranged, 0, 4, decoded.data()); }, {"stored order"});
  auto cpu = make_cpu_backend();
  const Tensor x = Tensor::zeros({1, 64}, DType::F32);
  Tensor out = Tensor::empty({1, 4}, DType::F32);
  expect_error_mentions([&] { cpu->matmul(x, arranged, nullptr, out); }, {"fragment order", "only the CUDA kernels"});
}

}  // namespace
