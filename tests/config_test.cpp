// config.json parsing: the fixtures and stories260K parse to the right values, the legacy and v5
// RoPE layouts agree, and every unsupported or inconsistent config fails naming file and field.
#include <fstream>
#include <limits>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/config.h"
#include "model/family.h"
#include "profile_support.h"
#include "test_support.h"

using namespace kiln;
namespace fs = std::filesystem;
using kiln::testing::expect_sizes;
using nlohmann::json;

namespace {

const fs::path kSource = "/models/example/config.json";

// A valid Llama-3 style config, small.
json llama_config() {
  return json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "hidden_act": "silu",
    "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": false, "bos_token_id": 1, "eos_token_id": [2, 3],
    "torch_dtype": "bfloat16"
  })");
}

// A valid Qwen3.5 text config, small.
json qwen3_5_text_config() {
  return json::parse(R"({
    "model_type": "qwen3_5_text",
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 8,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-06,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [2, 1, 1], "mrope_interleaved": true}
  })");
}

// Whether the config's family runs the hybrid (Gated DeltaNet + attention) graph.
bool hybrid(const ModelConfig& config) {
  return builtin_families().find(config.model_type)->loop == Loop::HybridRecurrent;
}

std::vector<LayerKind> kinds(const std::string& pattern) {
  std::vector<LayerKind> result;
  for (char c : pattern) result.push_back(c == 'F' ? LayerKind::FullAttention : LayerKind::LinearAttention);
  return result;
}

}  // namespace

TEST(Config, Llama3TinyFixture) {
  const ModelConfig config = load_model_config(kiln::testing::fixtures_dir() / "llama3-tiny/f32");
  EXPECT_EQ(config.source, kiln::testing::fixtures_dir() / "llama3-tiny/f32/config.json");
  EXPECT_EQ(config.model_type, "llama");
  EXPECT_EQ(config.outer_model_type, "llama");
  EXPECT_EQ(config.architectures, std::vector<std::string>{"LlamaForCausalLM"});
  EXPECT_EQ(config.hidden_size, 64);
  EXPECT_EQ(config.intermediate_size, 160);
  EXPECT_EQ(config.num_hidden_layers, 2);
  EXPECT_EQ(config.num_attention_heads, 4);
  EXPECT_EQ(config.num_key_value_heads, 2);
  EXPECT_EQ(config.head_dim, 16);
  EXPECT_EQ(config.vocab_size, 512);
  EXPECT_EQ(config.max_position_embeddings, 4096);
  EXPECT_EQ(config.rms_norm_eps, 1e-5);
  EXPECT_EQ(config.rope.type, "llama3");
  EXPECT_EQ(config.rope.theta, 500000.0);
  EXPECT_EQ(config.rope.factor, 8.0);
  EXPECT_EQ(config.rope.low_freq_factor, 1.0);
  EXPECT_EQ(config.rope.high_freq_factor, 4.0);
  EXPECT_EQ(config.rope.original_max_position_embeddings, 64);
  EXPECT_EQ(config.rope.partial_rotary_factor, 1.0);
  EXPECT_FALSE(config.tie_word_embeddings);
  EXPECT_FALSE(config.attention_bias);
  EXPECT_FALSE(config.qk_norm);
  EXPECT_FALSE(hybrid(config));
  EXPECT_EQ(config.layer_types, kinds("FF"));
  EXPECT_EQ(config.torch_dtype, "float32");
  EXPECT_EQ(config.bos_token_id, 1);
  EXPECT_EQ(config.eos_token_ids, std::vector<int64_t>{2});
  EXPECT_EQ(load_model_config(kiln::testing::fixtures_dir() / "llama3-tiny/bf16").torch_dtype, "bfloat16");
}

TEST(Config, Qwen3TinyFixture) {
  const ModelConfig config = load_model_config(kiln::testing::fixtures_dir() / "qwen3-tiny/f32");
  EXPECT_EQ(config.model_type, "qwen3");
  // head_dim is explicit: 4 heads × 32 ≠ hidden 64.
  expect_sizes(config, {.hidden_size = 64, .intermediate_size = 128, .num_key_value_heads = 2, .head_dim = 32});
  EXPECT_TRUE(config.qk_norm);
  EXPECT_TRUE(config.tie_word_embeddings);
  EXPECT_EQ(config.rope.type, "default");
  EXPECT_EQ(config.rope.theta, 1e6);
  EXPECT_EQ(config.rms_norm_eps, 1e-6);
  EXPECT_EQ(config.layer_types, kinds("FF"));
  EXPECT_FALSE(config.bos_token_id.has_value());
  EXPECT_TRUE(config.eos_token_ids.empty());
}

TEST(Config, Qwen3_5TextTinyFixture) {
  const ModelConfig config = load_model_config(kiln::testing::fixtures_dir() / "qwen3_5-text-tiny/f32");
  EXPECT_EQ(config.model_type, "qwen3_5_text");
  EXPECT_TRUE(hybrid(config));
  EXPECT_EQ(config.layer_types, kinds("LLLF"));
  expect_sizes(config, {.hidden_size = 128, .head_dim = 32, .linear_num_key_heads = 2, .linear_num_value_heads = 4,
                        .linear_key_head_dim = 32, .linear_value_head_dim = 32, .linear_conv_kernel_dim = 4});
  EXPECT_EQ(config.rope.theta, 1e7);
  EXPECT_EQ(config.rope.partial_rotary_factor, 0.25);
  EXPECT_EQ(config.rope.mrope_section, (std::vector<int64_t>{2, 1, 1}));
  EXPECT_TRUE(config.rope.mrope_interleaved);
  EXPECT_TRUE(config.tie_word_embeddings);
}

TEST(Config, Qwen3_5VisionLanguageFixtureNestsTheTextModel) {
  const ModelConfig config = load_model_config(kiln::testing::fixtures_dir() / "qwen3_5-vl-tiny/f32");
  EXPECT_EQ(config.model_type, "qwen3_5_text");
  EXPECT_EQ(config.outer_model_type, "qwen3_5");
  EXPECT_EQ(config.architectures, std::vector<std::string>{"Qwen3_5ForConditionalGeneration"});
  EXPECT_EQ(config.text_json["model_type"], "qwen3_5_text");
  EXPECT_EQ(config.layer_types, kinds("LLLF"));
  EXPECT_EQ(config.hidden_size, 128);
  EXPECT_EQ(config.vocab_size, 512);
  EXPECT_EQ(config.rope.partial_rotary_factor, 0.25);
  EXPECT_EQ(config.torch_dtype, "float32");  // from the top level
  // The outer model owns lm_head and its flag is false (the checkpoint stores an untied lm_head),
  // although text_config says true.
  EXPECT_FALSE(config.tie_word_embeddings);
}

TEST(Config, Stories260K) {
  const ModelConfig config = load_model_config(kiln::testing::stories_dir());
  EXPECT_EQ(config.model_type, "llama");
  expect_sizes(config, {.hidden_size = 64, .intermediate_size = 172, .num_hidden_layers = 5,
                        .num_attention_heads = 8, .num_key_value_heads = 4, .head_dim = 8});
  EXPECT_EQ(config.max_position_embeddings, 512);
  EXPECT_EQ(config.rope.type, "default");
  EXPECT_EQ(config.rope.theta, 10000.0);
  EXPECT_TRUE(config.tie_word_embeddings);
  EXPECT_EQ(config.bos_token_id, 1);
  EXPECT_EQ(config.eos_token_ids, std::vector<int64_t>{2});
  EXPECT_EQ(config.torch_dtype, "float32");
}

TEST(Config, LegacyRopeScalingEqualsRopeParameters) {
  const ModelConfig legacy = parse_model_config(llama_config(), kSource);
  json v5 = llama_config();
  v5.erase("rope_theta");
  v5.erase("rope_scaling");
  v5["rope_parameters"] = {{"rope_type", "llama3"}, {"rope_theta", 500000.0}, {"factor", 8.0},
                           {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                           {"original_max_position_embeddings", 8192}};
  json old_type_key = llama_config();
  old_type_key["rope_scaling"].erase("rope_type");
  old_type_key["rope_scaling"]["type"] = "llama3";
  for (const json& variant : {v5, old_type_key}) {
    const ModelConfig config = parse_model_config(variant, kSource);
    EXPECT_EQ(config.rope.type, "llama3");
    EXPECT_EQ(config.rope.theta, legacy.rope.theta);
    EXPECT_EQ(config.rope.factor, legacy.rope.factor);
    EXPECT_EQ(config.rope.low_freq_factor, legacy.rope.low_freq_factor);
    EXPECT_EQ(config.rope.high_freq_factor, legacy.rope.high_freq_factor);
    EXPECT_EQ(config.rope.original_max_position_embeddings, 8192);
  }
  EXPECT_EQ(legacy.head_dim, 16);  // derived: 64 / 4
  EXPECT_EQ(legacy.eos_token_ids, (std::vector<int64_t>{2, 3}));
}

TEST(Config, NestedTextConfigIsUnwrapped) {
  json outer = {{"model_type", "qwen3_5"},
                {"architectures", {"Qwen3_5ForConditionalGeneration"}},
                {"text_config", qwen3_5_text_config()},
                {"vision_config", {{"model_type", "qwen3_5_vision"}, {"hidden_act", "gelu_pytorch_tanh"}}}};
  outer["text_config"]["eos_token_id"] = 7;
  const ModelConfig config = parse_model_config(outer, kSource);
  EXPECT_EQ(config.model_type, "qwen3_5_text");
  EXPECT_EQ(config.outer_model_type, "qwen3_5");
  EXPECT_EQ(config.num_hidden_layers, 8);
  EXPECT_EQ(config.eos_token_ids, std::vector<int64_t>{7});
  EXPECT_FALSE(config.tie_word_embeddings);

  // A text config without model_type takes the one its wrapper nests.
  outer["text_config"].erase("model_type");
  EXPECT_EQ(parse_model_config(outer, kSource).model_type, "qwen3_5_text");
}

TEST(Config, LayerTypesComeFromTheFullAttentionInterval) {
  json config = qwen3_5_text_config();
  EXPECT_EQ(parse_model_config(config, kSource).layer_types, kinds("LLLFLLLF"));  // default interval 4
  config["full_attention_interval"] = 2;
  EXPECT_EQ(parse_model_config(config, kSource).layer_types, kinds("LFLFLFLF"));
  config["layer_types"] = {"full_attention",   "linear_attention", "linear_attention", "linear_attention",
                           "linear_attention", "linear_attention", "linear_attention", "full_attention"};
  EXPECT_EQ(parse_model_config(config, kSource).layer_types, kinds("FLLLLLLF"));  // explicit list wins
}

TEST(Config, FamilyDefaults) {
  json qwen2 = llama_config();
  qwen2["model_type"] = "qwen2";
  qwen2["attention_bias"] = false;
  EXPECT_TRUE(parse_model_config(qwen2, kSource).attention_bias);  // Qwen2 always biases q/k/v
  // attention_bias biases o_proj too, except on Qwen2 (Qwen2Attention: o_proj bias=False).
  qwen2["attention_bias"] = true;
  EXPECT_FALSE(parse_model_config(qwen2, kSource).attention_output_bias);
  for (const char* model_type : {"llama", "qwen3"}) {
    json biased = llama_config();
    biased["model_type"] = model_type;
    biased["head_dim"] = 16;
    EXPECT_FALSE(parse_model_config(biased, kSource).attention_output_bias) << model_type;
    biased["attention_bias"] = true;
    const ModelConfig config = parse_model_config(biased, kSource);
    EXPECT_TRUE(config.attention_bias) << model_type;
    EXPECT_TRUE(config.attention_output_bias) << model_type;
  }

  json qwen3_next = qwen3_5_text_config();
  qwen3_next["model_type"] = "qwen3_next";
  qwen3_next.erase("rope_parameters");
  qwen3_next["rope_theta"] = 10000000;
  qwen3_next["rope_scaling"] = nullptr;
  const ModelConfig next = parse_model_config(qwen3_next, kSource);
  EXPECT_TRUE(hybrid(next));
  EXPECT_EQ(next.rope.partial_rotary_factor, 0.25);  // Qwen3NextConfig's default
  EXPECT_TRUE(next.qk_norm);

  json llama = llama_config();
  llama.erase("num_key_value_heads");
  llama.erase("tie_word_embeddings");
  const ModelConfig plain = parse_model_config(llama, kSource);
  EXPECT_EQ(plain.num_key_value_heads, 4);  // multi-head when absent
  EXPECT_FALSE(plain.tie_word_embeddings);  // LlamaConfig's default
}

TEST(Config, GenerationConfigIdsAreMerged) {
  kiln::testing::TempDir dir;
  std::ofstream(dir.path() / "config.json") << llama_config().dump();
  std::ofstream(dir.path() / "generation_config.json") << R"({"bos_token_id": 5, "eos_token_id": [3, 9]})";
  const ModelConfig config = load_model_config(dir.path());
  EXPECT_EQ(config.eos_token_ids, (std::vector<int64_t>{2, 3, 9}));
  EXPECT_EQ(config.bos_token_id, 5);
}

TEST(Config, SupportedModelTypes) {
  EXPECT_EQ(supported_model_types(),
            (std::vector<std::string>{"llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_5_text", "qwen3_next",
                                      "qwen3_5_moe_text"}));
}

// ---------------------------------------------------------------------------------------------
// Bad configs: each fails with a one-line kiln::Error naming the file, the field and the problem.

namespace {

struct BadConfig {
  std::string label;
  std::function<json()> make;
  std::vector<std::string> expected;
};

std::vector<BadConfig> bad_configs() {
  auto llama_with = [](const std::function<void(json&)>& edit) {
    return [edit] {
      json config = llama_config();
      edit(config);
      return config;
    };
  };
  auto hybrid_with = [](const std::function<void(json&)>& edit) {
    return [edit] {
      json config = qwen3_5_text_config();
      edit(config);
      return config;
    };
  };
  return {
      {"unknown_model_type", llama_with([](json& c) { c["model_type"] = "mistral"; }),
       {"field 'model_type'", "'mistral' is not supported", "llama, qwen2, qwen3, qwen3_moe, qwen3_5_text, qwen3_next, qwen3_5_moe_text",
        "qwen3_5 (text_config qwen3_5_text)"}},
      {"unsupported_rope_type_v5",
       llama_with([](json& c) {
         c.erase("rope_scaling");
         c.erase("rope_theta");
         c["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 1e6}, {"factor", 4.0}};
       }),
       {"field 'rope_parameters.rope_type'", "unsupported rope type 'yarn'"}},
      {"unsupported_rope_type_legacy",
       llama_with([](json& c) { c["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}}; }),
       {"field 'rope_scaling.type'", "unsupported rope type 'linear'"}},
      {"llama3_rope_missing_factor", llama_with([](json& c) { c["rope_scaling"].erase("low_freq_factor"); }),
       {"field 'rope_scaling.low_freq_factor'", "is required"}},
      {"missing_rope_theta", llama_with([](json& c) { c.erase("rope_theta"); }),
       {"field 'rope_theta'", "is required"}},
      {"missing_hidden_size", llama_with([](json& c) { c.erase("hidden_size"); }),
       {"field 'hidden_size'", "is required"}},
      {"null_vocab_size", llama_with([](json& c) { c["vocab_size"] = nullptr; }),
       {"field 'vocab_size'", "is required"}},
      {"fractional_layers", llama_with([](json& c) { c["num_hidden_layers"] = 2.5; }),
       {"field 'num_hidden_layers'", "2.5, not an integer"}},
      {"negative_intermediate", llama_with([](json& c) { c["intermediate_size"] = -160; }),
       {"field 'intermediate_size'", "-160, not positive"}},
      {"heads_not_divisible", llama_with([](json& c) { c["num_key_value_heads"] = 3; }),
       {"field 'num_key_value_heads'", "4 attention heads are not divisible by 3"}},
      {"head_dim_underivable",
       llama_with([](json& c) {
         c["hidden_size"] = 66;
       }),
       {"field 'head_dim'", "66 is not divisible by 4"}},
      {"qwen3_needs_head_dim",
       llama_with([](json& c) {
         c["model_type"] = "qwen3";
         c.erase("rope_scaling");
       }),
       {"field 'head_dim'", "is required"}},
      {"unsupported_activation", llama_with([](json& c) { c["hidden_act"] = "gelu"; }),
       {"field 'hidden_act'", "'gelu' is not supported"}},
      {"sliding_window", llama_with([](json& c) { c["model_type"] = "qwen2"; c["use_sliding_window"] = true; }),
       {"field 'use_sliding_window'", "not supported"}},
      {"sliding_layer_type",
       llama_with([](json& c) { c["layer_types"] = {"full_attention", "sliding_attention"}; }),
       {"field 'layer_types'", "entry 1 is 'sliding_attention'"}},
      {"quant_method_unknown", llama_with([](json& c) { c["quantization_config"] = {{"quant_method", "bitsandbytes"}}; }),
       {"field 'quantization_config.quant_method'", "'bitsandbytes'"}},
      {"fp8_without_blocks", llama_with([](json& c) { c["quantization_config"] = {{"quant_method", "fp8"}}; }),
       {"field 'quantization_config.weight_block_size'", "is required"}},
      {"fp8_static_activations",
       llama_with([](json& c) {
         c["quantization_config"] = {
             {"quant_method", "fp8"}, {"activation_scheme", "static"}, {"weight_block_size", {128, 128}}};
       }),
       {"field 'quantization_config.activation_scheme'", "'static'"}},
      {"fp8_bad_blocks",
       llama_with([](json& c) {
         c["quantization_config"] = {{"quant_method", "fp8"}, {"weight_block_size", {128}}};
       }),
       {"field 'quantization_config.weight_block_size'", "[128]"}},
      {"mlx_bits_7", llama_with([](json& c) { c["quantization"] = {{"group_size", 64}, {"bits", 7}}; }),
       {"field 'quantization.bits'", "is 7"}},
      {"mlx_group_48", llama_with([](json& c) { c["quantization"] = {{"group_size", 48}, {"bits", 4}}; }),
       {"field 'quantization.group_size'", "is 48"}},
      {"mlx_module_bits",
       llama_with([](json& c) {
         c["quantization"] = {{"group_size", 64}, {"bits", 4}, {"model.embed_tokens", {{"bits", 1}}}};
       }),
       {"field 'quantization.model.embed_tokens.bits'", "is 1"}},
      {"mlx_module_not_object",
       llama_with([](json& c) { c["quantization"] = {{"group_size", 64}, {"bits", 4}, {"lm_head", 8}}; }),
       {"field 'quantization.lm_head'", "per-module entry"}},
      {"mlx_mode", llama_with([](json& c) {
         c["quantization"] = {{"group_size", 32}, {"bits", 4}, {"mode", "mxfp4"}};
       }),
       {"field 'quantization.mode'", "'mxfp4'"}},
      {"gptq_bits_3",
       llama_with([](json& c) {
         c["quantization_config"] = {{"quant_method", "gptq"}, {"bits", 3}, {"group_size", 128}};
       }),
       {"field 'quantization_config.bits'", "is 3"}},
      {"awq_bits_8",
       llama_with([](json& c) {
         c["quantization_config"] = {{"quant_method", "awq"}, {"bits", 8}, {"group_size", 128}};
       }),
       {"field 'quantization_config.bits'", "is 8", "AWQ's GEMM packing at 4 bits"}},
      {"awq_gemv",
       llama_with([](json& c) {
         c["quantization_config"] = {{"quant_method", "awq"}, {"bits", 4}, {"group_size", 128}, {"version", "gemv"}};
       }),
       {"field 'quantization_config.version'", "'gemv'"}},
      {"eos_outside_vocabulary", llama_with([](json& c) { c["eos_token_id"] = 512; }),
       {"field 'eos_token_id'", "512 is outside the vocabulary of 512"}},
      {"bad_layer_type",
       hybrid_with([](json& c) {
         c["layer_types"] = {"linear_attention", "linear_attention", "mamba",           "full_attention",
                             "linear_attention", "linear_attention", "linear_attention", "full_attention"};
       }),
       {"field 'layer_types'", "entry 2 is 'mamba'", "'linear_attention' or 'full_attention'"}},
      {"layer_types_length", hybrid_with([](json& c) { c["layer_types"] = {"full_attention"}; }),
       {"field 'layer_types'", "has 1 entries but num_hidden_layers is 8"}},
      {"value_heads_not_divisible", hybrid_with([](json& c) { c["linear_num_value_heads"] = 5; }),
       {"field 'linear_num_value_heads'", "5 value heads are not divisible by 2 key heads"}},
      {"missing_linear_dim", hybrid_with([](json& c) { c.erase("linear_key_head_dim"); }),
       {"field 'linear_key_head_dim'", "is required"}},
      {"conv_kernel_too_small", hybrid_with([](json& c) { c["linear_conv_kernel_dim"] = 1; }),
       {"field 'linear_conv_kernel_dim'", "at least 2"}},
      {"mrope_section_mismatch",
       hybrid_with([](json& c) {
         c["rope_parameters"]["mrope_section"] = {11, 11, 10};
         c["rope_parameters"]["mrope_interleaved"] = false;
       }),
       {"field 'rope_parameters.mrope_section'", "sums to 32", "rotary dim 8 has 4 frequency pairs",
        "not interleaved"}},
      {"mrope_section_negative", hybrid_with([](json& c) { c["rope_parameters"]["mrope_section"] = {2, -1, 1}; }),
       {"field 'rope_parameters.mrope_section'", "holds -1, not a non-negative integer"}},
      // Fields near 2^63: the rotary dim and the mrope section sum must not overflow on the way.
      {"head_dim_rotary_beyond_64_bits",
       llama_with([](json& c) { c["head_dim"] = std::numeric_limits<int64_t>::max(); }),
       {"field 'head_dim'", "does not fit 64 bits"}},
      {"mrope_section_sum_beyond_64_bits",
       hybrid_with([](json& c) {
         c["rope_parameters"]["mrope_section"] = {std::numeric_limits<int64_t>::max(),
                                                  std::numeric_limits<int64_t>::max(), 2};
         c["rope_parameters"]["mrope_interleaved"] = false;
       }),
       {"field 'rope_parameters.mrope_section'", "sums to 18446744073709551616"}},
      {"partial_rotary_contradiction", hybrid_with([](json& c) { c["partial_rotary_factor"] = 0.5; }),
       {"field 'partial_rotary_factor'", "contradicting rope_parameters.partial_rotary_factor 0.25"}},
      {"nested_wrong_text_type",
       [] {
         json text = llama_config();
         return json{{"model_type", "qwen3_5"}, {"text_config", text}};
       },
       {"field 'text_config.model_type'", "'llama' but a 'qwen3_5' config nests 'qwen3_5_text'"}},
      {"nested_missing_field",
       [] {
         json text = qwen3_5_text_config();
         text.erase("num_attention_heads");
         return json{{"model_type", "qwen3_5"}, {"text_config", text}};
       },
       {"field 'text_config.num_attention_heads'", "is required"}},
      {"not_an_object", [] { return json::array({1, 2}); }, {"config is a JSON array, not an object"}},
  };
}

void PrintTo(const BadConfig& bad, std::ostream* out) { *out << bad.label; }

class ConfigBad : public ::testing::TestWithParam<BadConfig> {};

TEST_P(ConfigBad, FailsNamingTheField) {
  const BadConfig& bad = GetParam();
  try {
    parse_model_config(bad.make(), kSource);
    FAIL() << "parse_model_config accepted it";
  } catch (const Error& error) {
    const std::string message = error.what();
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    EXPECT_EQ(message.rfind(kSource.string() + ": ", 0), 0u) << message;
    for (const std::string& expected : bad.expected)
      EXPECT_NE(message.find(expected), std::string::npos) << "expected '" << expected << "' in: " << message;
  }
}

INSTANTIATE_TEST_SUITE_P(Config, ConfigBad, ::testing::ValuesIn(bad_configs()),
                         [](const ::testing::TestParamInfo<BadConfig>& info) { return info.param.label; });

}  // namespace

TEST(Config, LoadConfigNamesTheFileWhenItIsNotJson) {
  kiln::testing::TempDir dir;
  std::ofstream(dir.path() / "config.json") << "{\"model_type\": ";
  try {
    load_model_config(dir.path());
    FAIL() << "load_model_config accepted it";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find((dir.path() / "config.json").string() + ": not valid JSON"),
              std::string::npos)
        << error.what();
  }
  EXPECT_THROW(load_model_config(dir.path() / "absent"), Error);
}

// Found by fuzz/config_fuzz: nlohmann reports a number beyond a double as out_of_range, not
// parse_error; it escaped load_config as an uncaught exception.
TEST(Config, LoadConfigNamesTheFileWhenANumberIsBeyondADouble) {
  kiln::testing::TempDir dir;
  std::ofstream(dir.path() / "config.json") << R"({"model_type": "llama", "hidden_size": 1e9551615})";
  kiln::testing::expect_error_mentions([&] { load_model_config(dir.path()); },
                                       {(dir.path() / "config.json").string() + ": not valid JSON"});
}
