// `kiln quantize` (model/quantize.h): the MLX affine rounding rule checked group by group against a
// plain float64 computation of it, the loaded result against the f32 model, the project's MLX
// fixture reproduced from its own dequantized weights, FP8 blocks, and the refusals.
#include <algorithm>
#include <cmath>
#include <fstream>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/weight.h"
#include "engine/generation.h"
#include "io/safetensors.h"
#include "model/loader.h"
#include "model/quantize.h"
#include "model_test_support.h"
#include "test_support.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

std::filesystem::path llama_f32() { return fixtures_dir() / "llama3-tiny/f32"; }

float f32_at(const Tensor& tensor, int64_t index) {
  switch (tensor.dtype()) {
    case DType::F32: return tensor.data<const float>()[index];
    case DType::BF16: return bf16_to_f32(tensor.data<const uint16_t>()[index]);
    default: return f16_to_f32(tensor.data<const uint16_t>()[index]);
  }
}

// The decoded weights of every quantized matrix of a model folder, by canonical module.
std::map<std::string, std::pair<Weight, std::vector<float>>> decoded_matrices(const std::filesystem::path& dir) {
  const ModelPlan plan = plan_model(dir, Device::CPU, true);
  WeightMap weights(plan.checkpoint, plan.load_plan);
  std::map<std::string, std::pair<Weight, std::vector<float>>> decoded;
  for (const PlannedTensor& planned : plan.load_plan.tensors) {
    if (!planned.quantized) continue;
    Shape logical = planned.canonical_shape;  // FP8: the values' own; Affine: the codes' words unpacked
    if (planned.quantized->format == WeightFormat::Affine) logical[1] = logical[1] * 32 / planned.quantized->bits;
    const Weight weight = weights.take_weight(planned.canonical, logical);
    std::vector<float> values(static_cast<size_t>(weight.dim(0) * weight.dim(1)));
    decode_rows(weight, 0, weight.dim(0), values.data());
    decoded.emplace(planned.canonical, std::make_pair(weight, std::move(values)));
  }
  return decoded;
}

TEST(Quantize, EveryGroupFollowsTheRoundToNearestRuleExactly) {
  TempDir temp;
  QuantizeOptions options{llama_f32(), temp.path() / "q4", QuantizeFormat::MlxAffine, {4, 64}, {}};
  const QuantizeResult result = quantize_checkpoint(options);
  // 2 layers x 7 projections, the embedding and the head; down_proj's 160 inputs are no multiple
  // of 64, so mlx_lm's rule leaves both down_proj unquantized.
  EXPECT_EQ(result.quantized, 2u * 6u + 2u);
  const nlohmann::json config = nlohmann::json::parse(std::ifstream(temp.path() / "q4/config.json"));
  EXPECT_EQ(config["quantization"]["bits"], 4);
  EXPECT_EQ(config["quantization"]["model.layers.0.mlp.down_proj"], false);
  EXPECT_EQ(config["quantization_config"], config["quantization"]);
  EXPECT_TRUE(std::filesystem::exists(temp.path() / "q4/generation_config.json"));

  const Checkpoint source = Checkpoint::open(llama_f32());
  const auto decoded = decoded_matrices(temp.path() / "q4");
  ASSERT_EQ(decoded.size(), result.quantized);
  for (const auto& [name, entry] : decoded) {
    const auto& [weight, values] = entry;
    const Tensor original = source.view(name);
    const int64_t columns = weight.dim(1);
    for (int64_t row = 0; row < weight.dim(0); ++row) {
      for (int64_t group = 0; group < columns / 64; ++group) {
        const float* w = original.data<const float>() + row * columns + group * 64;
        const double lowest = *std::min_element(w, w + 64), highest = *std::max_element(w, w + 64);
        const float scale = static_cast<float>((highest - lowest) / 15.0);  // an F32 model: scales in F32
        const float bias = static_cast<float>(lowest);
        ASSERT_EQ(f32_at(weight.scales(), row * (columns / 64) + group), scale) << name;
        ASSERT_EQ(f32_at(weight.biases(), row * (columns / 64) + group), bias) << name;
        for (int64_t i = 0; i < 64; ++i) {
          const double code = std::clamp(std::nearbyint((w[i] - static_cast<double>(bias)) / scale), 0.0, 15.0);
          ASSERT_EQ(values[row * columns + group * 64 + i], std::fma(scale, static_cast<float>(code), bias))
              << name << " [" << row << ", " << group * 64 + i << "]";
        }
      }
    }
  }
}

TEST(Quantize, EightBitLogitsStayCloseToTheF32Model) {
  TempDir temp;
  QuantizeOptions options{llama_f32(), temp.path() / "q8", QuantizeFormat::MlxAffine, {8, 32}, {}};
  EXPECT_EQ(quantize_checkpoint(options).quantized, 2u * 7u + 2u);
  TestModel quantized = open_cpu_model(temp.path() / "q8");
  TestModel full = open_cpu_model(llama_f32());
  const std::vector<int32_t> prompt{1, 17, 300, 42, 511, 7, 99, 250, 3, 64};
  const Tensor ours = prompt_logits(*quantized.model, prompt, 0);
  const Tensor reference = prompt_logits(*full.model, prompt, 0);
  const int64_t vocabulary = ours.dim(1);
  for (int64_t row = 0; row < ours.dim(0); ++row) {
    double largest = 0, error = 0;
    for (int64_t v = 0; v < vocabulary; ++v) {
      const double expected = reference.data<const float>()[row * vocabulary + v];
      largest = std::max(largest, std::fabs(expected));
      error = std::max(error, std::fabs(ours.data<const float>()[row * vocabulary + v] - expected));
    }
    EXPECT_LT(error / largest, 0.1) << "row " << row;
    EXPECT_GT(error, 0.0) << "row " << row << ": 8-bit codes changed nothing";
  }
}

// Round to nearest is a fixed point on a group whose codes reach both 0 and 2^bits − 1: its
// decoded minimum is its bias and its range is scale · (2^bits − 1), so quantizing the decoded
// weights gives back the fixture's scale, bias and codes. (A group whose codes stop short of
// either end decodes to a narrower range, which the rule spreads over every code again.)
TEST(Quantize, ReproducesTheMlxFixtureFromItsDequantizedWeights) {
  const std::filesystem::path fixture = fixtures_dir() / "qwen3-mlx-tiny/q";
  const auto decoded = decoded_matrices(fixture);
  ASSERT_FALSE(decoded.empty());
  int64_t full_range_groups = 0, groups_seen = 0;
  for (const auto& [name, entry] : decoded) {
    const auto& [weight, values] = entry;
    const AffineScheme scheme{weight.bits(), weight.group_size()};
    const AffineRows again =
        quantize_affine_rows(values.data(), weight.dim(0), weight.dim(1), scheme, weight.scales().dtype());
    const int64_t columns = weight.dim(1), groups = columns / scheme.group_size;
    const int64_t row_words = weight.values().dim(1);
    const uint32_t highest_code = (1u << scheme.bits) - 1u;
    for (int64_t row = 0; row < weight.dim(0); ++row) {
      const uint32_t* stored = weight.values().data<const uint32_t>() + row * row_words;
      for (int64_t group = 0; group < groups; ++group) {
        ++groups_seen;
        uint32_t lowest = highest_code, highest = 0;
        for (int64_t i = group * scheme.group_size; i < (group + 1) * scheme.group_size; ++i) {
          lowest = std::min(lowest, affine_code(stored, scheme.bits, i));
          highest = std::max(highest, affine_code(stored, scheme.bits, i));
        }
        if (lowest != 0 || highest != highest_code) continue;
        ++full_range_groups;
        const int64_t at = row * groups + group;
        ASSERT_EQ(again.scales[at], f32_at(weight.scales(), at)) << name << " row " << row << " group " << group;
        ASSERT_EQ(again.biases[at], f32_at(weight.biases(), at)) << name << " row " << row << " group " << group;
        for (int64_t i = group * scheme.group_size; i < (group + 1) * scheme.group_size; ++i)
          ASSERT_EQ(affine_code(again.codes.data() + row * row_words, scheme.bits, i), affine_code(stored, scheme.bits, i))
              << name << " [" << row << ", " << i << "]";
      }
    }
  }
  // Most groups reach both ends (the rule maps a group's minimum to 0 and, unless the scale
  // rounds up, its maximum to the top code).
  EXPECT_GT(full_range_groups * 2, groups_seen) << full_range_groups << " of " << groups_seen;
}

TEST(Quantize, Fp8BlocksFollowTheAmaxRuleAndLoad) {
  TempDir temp;
  QuantizeOptions options{llama_f32(), temp.path() / "fp8", QuantizeFormat::Fp8, {4, 64}, {}};
  EXPECT_EQ(quantize_checkpoint(options).quantized, 2u * 7u);  // decoder layers only
  const nlohmann::json config = nlohmann::json::parse(std::ifstream(temp.path() / "fp8/config.json"));
  EXPECT_EQ(config["quantization_config"], fp8_quantization_json());
  const Checkpoint source = Checkpoint::open(llama_f32());
  const Checkpoint written = Checkpoint::open(temp.path() / "fp8");
  EXPECT_EQ(written.info("model.embed_tokens.weight").dtype, DType::F32);
  const std::string name = "model.layers.1.mlp.gate_proj.weight";  // [160, 64]: a full and a partial block row
  const Tensor original = source.view(name), values = written.view(name), scale_inv = written.view(name + "_scale_inv");
  ASSERT_EQ(scale_inv.shape(), (Shape{2, 1}));
  for (int64_t block = 0; block < 2; ++block) {
    double amax = 0;
    for (int64_t row = block * 128; row < std::min<int64_t>(160, (block + 1) * 128); ++row)
      for (int64_t column = 0; column < 64; ++column)
        amax = std::max(amax, std::fabs(static_cast<double>(original.data<const float>()[row * 64 + column])));
    const float expected_scale = static_cast<float>(amax / 448.0);
    ASSERT_EQ(scale_inv.data<const float>()[block], expected_scale);
    for (int64_t row = block * 128; row < std::min<int64_t>(160, (block + 1) * 128); ++row)
      for (int64_t column = 0; column < 64; ++column)
        ASSERT_EQ(values.data<const uint8_t>()[row * 64 + column],
                  f32_to_fp8_e4m3(original.data<const float>()[row * 64 + column] / expected_scale));
  }
  TestModel loaded = open_cpu_model(temp.path() / "fp8");
  EXPECT_EQ(prompt_logits(*loaded.model, {1, 2, 3}, 0).dim(0), 3);
}

TEST(Quantize, MixedEntriesSetTheirModulesBits) {
  TempDir temp;
  std::ofstream(temp.path() / "mixed.json") << R"({"model.layers.1.self_attn.o_proj": 8, "lm_head": false})";
  QuantizeOptions options{llama_f32(), temp.path() / "mixed", QuantizeFormat::MlxAffine, {4, 32},
                          read_module_schemes(temp.path() / "mixed.json", 32)};
  quantize_checkpoint(options);
  const nlohmann::json config = nlohmann::json::parse(std::ifstream(temp.path() / "mixed/config.json"));
  EXPECT_EQ(config["quantization"]["model.layers.1.self_attn.o_proj"], (nlohmann::json{{"group_size", 32}, {"bits", 8}}));
  EXPECT_EQ(config["quantization"]["lm_head"], false);
  const Checkpoint written = Checkpoint::open(temp.path() / "mixed");
  EXPECT_EQ(written.info("model.layers.1.self_attn.o_proj.weight").shape, (Shape{64, 64 * 8 / 32}));
  EXPECT_EQ(written.info("lm_head.weight").dtype, DType::F32);
  TestModel loaded = open_cpu_model(temp.path() / "mixed");
  EXPECT_EQ(prompt_logits(*loaded.model, {1, 2, 3}, 0).dim(0), 3);
}

TEST(Quantize, RefusesWhatItCannotWrite) {
  TempDir temp;
  auto quantize_with = [&](std::map<std::string, std::optional<AffineScheme>> modules, const std::string& out) {
    QuantizeOptions options{llama_f32(), temp.path() / out, QuantizeFormat::MlxAffine, {4, 32}, modules};
    quantize_checkpoint(options);
  };
  expect_error_mentions([&] { quantize_with({{"model.layers.0.input_layernorm", AffineScheme{8, 32}}}, "a"); },
                        {"--mixed entry 'model.layers.0.input_layernorm'", "names no quantizable matrix"});
  expect_error_mentions([&] { quantize_with({{"model.layers.9.mlp.up_proj", AffineScheme{8, 32}}}, "b"); },
                        {"--mixed entry 'model.layers.9.mlp.up_proj'", "names no tensor"});
  std::ofstream(temp.path() / "bad.json") << R"({"lm_head": 7})";
  expect_error_mentions([&] { read_module_schemes(temp.path() / "bad.json", 64); },
                        {"bad.json", "entry 'lm_head' is 7", "bits (2, 3, 4, 5, 6 or 8) or false"});
  std::filesystem::create_directories(temp.path() / "full");
  std::ofstream(temp.path() / "full/x") << "x";
  expect_error_mentions([&] { quantize_with({}, "full"); }, {"full", "new or empty directory"});
  // A vision-language checkpoint names its text weights under model.language_model, not as the
  // text family's layout does.
  expect_error_mentions(
      [&] {
        quantize_checkpoint({fixtures_dir() / "qwen3_5-vl-tiny/bf16", temp.path() / "vl", QuantizeFormat::MlxAffine,
                             {4, 32}, {}});
      },
      {"qwen3_5-vl-tiny", "holds no 'model.embed_tokens.weight', which its family's layout names"});
  const std::filesystem::path mlx = fixtures_dir() / "qwen3-mlx-tiny/q";
  expect_error_mentions(
      [&] { quantize_checkpoint({mlx, temp.path() / "again", QuantizeFormat::MlxAffine, {4, 64}, {}}); },
      {"config.json", "already quantized (mlx)"});
}

TEST(Quantize, TheCommandWritesALoadableCheckpoint) {
  TempDir temp;
  const CommandResult result = run_command(kiln_command(
      fmt::format("quantize --model {} --out {} --bits 8 --group-size 32", llama_f32().string(),
                  (temp.path() / "q").string())));
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("16 matrices quantized"), std::string::npos) << result.output;
  expect_one_line_error({fmt::format("quantize --model {} --out {} --format fp8 --mixed x.json",
                                     llama_f32().string(), (temp.path() / "r").string()),
                         "--mixed applies to --format mlx, not fp8"});
  TestModel loaded = open_cpu_model(temp.path() / "q");
  EXPECT_EQ(prompt_logits(*loaded.model, {5, 6}, 0).dim(0), 2);
}

}  // namespace
