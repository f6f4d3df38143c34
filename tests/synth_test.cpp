// kiln synth: the checkpoints it writes load through Checkpoint::open and load_model_config with the
// shapes the published config implies, deterministically and in any shard layout.
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <utility>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/config.h"
#include "io/safetensors.h"
#include "model/family.h"
#include "model/load_plan.h"
#include "model/moe.h"
#include "model/quantize.h"
#include "model/qwen3_5_checkpoint.h"
#include "model/synth.h"
#include "profile_support.h"
#include "test_support.h"

using namespace kiln;
namespace fs = std::filesystem;

TEST(Synth, Qwen3OneLayerCheckpointLoads) {
  kiln::testing::TempDir dir;
  const fs::path out = dir.path() / "qwen3";
  const auto result = kiln::testing::run_command(kiln::testing::kiln_binary().string() +
                                           " synth --shape qwen3-0.6b --layers 1 --dtype bf16 --out " + out.string());
  ASSERT_EQ(result.exit_code, 0) << result.output;

  const ModelConfig config = load_model_config(out);
  EXPECT_EQ(config.model_type, "qwen3");
  kiln::testing::expect_sizes(config, {.hidden_size = 1024, .intermediate_size = 3072, .num_hidden_layers = 1,
                                       .num_attention_heads = 16, .num_key_value_heads = 8, .head_dim = 128,
                                       .vocab_size = 151936});
  EXPECT_EQ(config.rope.theta, 1e6);
  EXPECT_TRUE(config.tie_word_embeddings);
  EXPECT_EQ(config.torch_dtype, "bfloat16");
  EXPECT_EQ(config.eos_token_ids, std::vector<int64_t>{151645});

  const Checkpoint checkpoint = Checkpoint::open(out);
  const std::map<std::string, Shape> expected = {
      {"model.embed_tokens.weight", {151936, 1024}},
      {"model.layers.0.input_layernorm.weight", {1024}},
      {"model.layers.0.self_attn.q_proj.weight", {2048, 1024}},
      {"model.layers.0.self_attn.k_proj.weight", {1024, 1024}},
      {"model.layers.0.self_attn.v_proj.weight", {1024, 1024}},
      {"model.layers.0.self_attn.o_proj.weight", {1024, 2048}},
      {"model.layers.0.self_attn.q_norm.weight", {128}},
      {"model.layers.0.self_attn.k_norm.weight", {128}},
      {"model.layers.0.post_attention_layernorm.weight", {1024}},
      {"model.layers.0.mlp.gate_proj.weight", {3072, 1024}},
      {"model.layers.0.mlp.up_proj.weight", {3072, 1024}},
      {"model.layers.0.mlp.down_proj.weight", {1024, 3072}},
      {"model.norm.weight", {1024}},
  };
  ASSERT_EQ(checkpoint.tensors().size(), expected.size());
  WeightMap weights(checkpoint, identity_plan(checkpoint));
  for (const auto& [name, shape] : expected) {
    EXPECT_EQ(checkpoint.info(name).dtype, DType::BF16) << name;
    weights.take(name, shape);
  }
  EXPECT_NO_THROW(weights.require_all_used());

  // Norm gains are 1; matrices are small, centred and spread like N(0, 0.02).
  const Tensor gain = checkpoint.view("model.layers.0.self_attn.q_norm.weight");
  for (int64_t i = 0; i < gain.numel(); ++i) ASSERT_EQ(bf16_to_f32(gain.data<const uint16_t>()[i]), 1.0f);
  const Tensor q = checkpoint.view("model.layers.0.self_attn.q_proj.weight");
  double sum = 0, sum_squares = 0;
  for (int64_t i = 0; i < q.numel(); ++i) {
    const double value = bf16_to_f32(q.data<const uint16_t>()[i]);
    sum += value;
    sum_squares += value * value;
  }
  const double mean = sum / static_cast<double>(q.numel());
  EXPECT_LT(std::abs(mean), 1e-4);
  EXPECT_NEAR(std::sqrt(sum_squares / static_cast<double>(q.numel()) - mean * mean), 0.02, 0.001);

  // The library writes the same bytes again when the shards are split differently.
  SynthOptions options;
  options.shape = "qwen3-0.6b";
  options.layers = 1;
  options.out = dir.path() / "sharded";
  options.max_shard_bytes = 64ull << 20;
  const SynthResult sharded = write_synthetic_checkpoint(options);
  EXPECT_TRUE(fs::exists(options.out / "model.safetensors.index.json"));
  const Checkpoint again = Checkpoint::open(options.out);
  EXPECT_GT(again.files().size(), 1u);
  for (const auto& [name, info] : checkpoint.tensors()) {
    const Tensor first = checkpoint.view(name);
    const Tensor second = again.view(name);
    ASSERT_EQ(first.nbytes(), second.nbytes());
    EXPECT_EQ(std::memcmp(first.raw(), second.raw(), first.nbytes()), 0) << name;
  }
  EXPECT_NE(std::memcmp(checkpoint.view("model.layers.0.self_attn.k_proj.weight").raw(),
                        checkpoint.view("model.layers.0.self_attn.v_proj.weight").raw(), 1024 * 1024 * 2),
            0);
}

TEST(Synth, ShapesMatchThePublishedConfigs) {
  struct Expected {
    const char* shape;
    int64_t hidden, intermediate, layers, heads, kv_heads, head_dim, vocab;
    bool tied;
    const char* rope_type;
    double rope_factor;
  };
  const Expected table[] = {
      {"llama-3.2-1b", 2048, 8192, 16, 32, 8, 64, 128256, true, "llama3", 32.0},
      {"llama-3.1-8b", 4096, 14336, 32, 32, 8, 128, 128256, false, "llama3", 8.0},
      {"qwen3-0.6b", 1024, 3072, 28, 16, 8, 128, 151936, true, "default", 1.0},
      {"qwen3-8b", 4096, 12288, 36, 32, 8, 128, 151936, false, "default", 1.0},
  };
  for (const Expected& expected : table) {
    SCOPED_TRACE(expected.shape);
    const ModelConfig config = parse_model_config(find_synth_shape(expected.shape).config, "config.json");
    EXPECT_EQ(config.hidden_size, expected.hidden);
    EXPECT_EQ(config.intermediate_size, expected.intermediate);
    EXPECT_EQ(config.num_hidden_layers, expected.layers);
    EXPECT_EQ(config.num_attention_heads, expected.heads);
    EXPECT_EQ(config.num_key_value_heads, expected.kv_heads);
    EXPECT_EQ(config.head_dim, expected.head_dim);
    EXPECT_EQ(config.vocab_size, expected.vocab);
    EXPECT_EQ(config.tie_word_embeddings, expected.tied);
    EXPECT_EQ(config.rope.type, expected.rope_type);
    EXPECT_EQ(config.rope.factor, expected.rope_factor);
    const auto layout = synth_tensor_layout(config);
    const size_t per_layer = config.qk_norm ? 11 : 9;
    EXPECT_EQ(layout.size(), 2 + per_layer * static_cast<size_t>(expected.layers) + (expected.tied ? 0 : 1));
  }
  EXPECT_THROW(find_synth_shape("gpt-2"), Error);
}

TEST(Synth, RefusesANonEmptyDirectory) {
  kiln::testing::TempDir dir;
  std::ofstream(dir.path() / "keep.txt") << "x";
  const auto result = kiln::testing::run_command(kiln::testing::kiln_binary().string() + " synth --shape qwen3-0.6b --out " +
                                           dir.path().string());
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_NE(result.output.find("new or empty directory"), std::string::npos) << result.output;
}

TEST(Synth, Qwen35ShapesAreHybridAndTheSanitizerPlansEveryTensor) {
  struct Expected {
    const char* shape;
    int64_t hidden, layers, value_heads;
    bool tied;
    double min_parameters, max_parameters;
  };
  const Expected table[] = {
      {"qwen3.5-9b", 4096, 32, 32, false, 8.5e9, 9.5e9},
      {"qwen3.5-2b-like", 2048, 24, 16, true, 1.5e9, 2.5e9},
  };
  for (const Expected& expected : table) {
    SCOPED_TRACE(expected.shape);
    const ModelConfig config = parse_model_config(find_synth_shape(expected.shape).config, "config.json");
    EXPECT_EQ(config.model_type, "qwen3_5_text");
    EXPECT_EQ(config.hidden_size, expected.hidden);
    EXPECT_EQ(config.num_hidden_layers, expected.layers);
    EXPECT_EQ(config.linear_num_value_heads, expected.value_heads);
    EXPECT_EQ(config.vocab_size, 248320);
    EXPECT_EQ(config.tie_word_embeddings, expected.tied);
    ASSERT_EQ(config.layer_types.size(), static_cast<size_t>(expected.layers));
    for (size_t layer = 0; layer < config.layer_types.size(); ++layer)
      EXPECT_EQ(config.layer_types[layer], layer % 4 == 3 ? LayerKind::FullAttention : LayerKind::LinearAttention)
          << layer;

    std::map<std::string, TensorInfo> tensors;
    double parameters = 0;
    for (const SynthTensor& tensor : synth_tensor_layout(config)) {
      tensors[tensor.name] = TensorInfo{tensor.name, DType::BF16, tensor.shape, {}, 0, 0};
      double count = 1;
      for (int64_t extent : tensor.shape) count *= static_cast<double>(extent);
      parameters += count;
      // Zero-centred gains are stored as w (applied as 1 + w) and start at 0, as transformers'.
      if (tensor.name.ends_with("layernorm.weight") || tensor.name.ends_with("_norm.weight") ||
          tensor.name == "model.norm.weight") {
        EXPECT_EQ(tensor.init, SynthInit::Zeros) << tensor.name;
      }
    }
    EXPECT_GT(parameters, expected.min_parameters);
    EXPECT_LT(parameters, expected.max_parameters);
    const LoadPlan plan = plan_qwen3_5_checkpoint(tensors, config);
    EXPECT_TRUE(plan.dropped.empty());
    EXPECT_EQ(plan.tensors.size(), tensors.size());
  }
}

TEST(Synth, MoeShapesCountEveryExpertAndTheSanitizerPlansThem) {
  struct Expected {
    const char* shape;
    int64_t layers, experts, top_k, width, shared_width;
    double min_parameters, max_parameters;  // Qwen3-30B-A3B: 30.5B; Qwen3.5-35B-A3B: 35B (the model cards)
  };
  const Expected table[] = {
      {"qwen3-30b-a3b", 48, 128, 8, 768, 0, 30.0e9, 31.0e9},
      {"qwen3.5-35b-a3b", 40, 256, 8, 512, 512, 34.0e9, 36.0e9},
  };
  for (const Expected& expected : table) {
    SCOPED_TRACE(expected.shape);
    const ModelConfig config = parse_model_config(find_synth_shape(expected.shape).config, "config.json");
    EXPECT_EQ(config.num_hidden_layers, expected.layers);
    EXPECT_EQ(config.moe.experts, expected.experts);
    EXPECT_EQ(config.moe.experts_per_token, expected.top_k);
    EXPECT_EQ(config.moe.expert_intermediate_size, expected.width);
    EXPECT_EQ(config.moe.shared_expert_intermediate_size, expected.shared_width);
    EXPECT_TRUE(config.moe.normalize_top_k);
    EXPECT_EQ(config.moe.sparse_layers, std::vector<bool>(static_cast<size_t>(expected.layers), true));
    std::map<std::string, TensorInfo> tensors;
    double parameters = 0;
    for (const SynthTensor& tensor : synth_tensor_layout(config)) {
      tensors[tensor.name] = TensorInfo{tensor.name, DType::BF16, tensor.shape, {}, 0, 0};
      parameters += static_cast<double>(shape_numel(tensor.shape));
    }
    EXPECT_GT(parameters, expected.min_parameters);
    EXPECT_LT(parameters, expected.max_parameters);
    const LoadPlan plan = config.model_type == "qwen3_moe" ? plan_moe_checkpoint(tensors, config)
                                                           : plan_qwen3_5_checkpoint(tensors, config);
    // Each sparse layer's experts become three stacks; every other tensor maps as it is.
    size_t sources = 0;
    for (const PlannedTensor& planned : plan.tensors) sources += planned.sources().size();
    EXPECT_EQ(sources, tensors.size() + (config.model_type == "qwen3_moe" ? 0 : expected.layers));
  }
}

// synth --mtp: the head the published Qwen3.5 checkpoints carry beside the model (fc, three norms
// and one full-attention layer with the model's MLP), which the sanitizer keeps for --speculative
// mtp and drops otherwise; a family without an MTP head has none to write.
TEST(Synth, Qwen35MtpHeadsAreLaidOutAndPlanned) {
  for (const char* shape : {"qwen3.5-9b", "qwen3.5-35b-a3b"}) {
    SCOPED_TRACE(shape);
    const ModelConfig config = parse_model_config(find_synth_shape(shape).config, "config.json");
    const int64_t hidden = config.hidden_size;
    std::map<std::string, Shape> mtp;
    for (const SynthTensor& tensor : synth_mtp_tensor_layout(config)) mtp[tensor.name] = tensor.shape;
    EXPECT_EQ(mtp.at("mtp.fc.weight"), (Shape{hidden, 2 * hidden}));
    EXPECT_EQ(mtp.at("mtp.norm.weight"), Shape{hidden});
    EXPECT_EQ(mtp.at("mtp.layers.0.self_attn.q_proj.weight"),
              (Shape{2 * config.num_attention_heads * config.head_dim, hidden}));
    EXPECT_EQ(mtp.count("mtp.layers.0.mlp.experts.gate_up_proj"), config.moe.experts > 0 ? 1u : 0u);
    EXPECT_EQ(mtp.count("mtp.layers.0.mlp.gate_proj.weight"), config.moe.experts > 0 ? 0u : 1u);
    std::map<std::string, TensorInfo> tensors;
    for (const SynthTensor& tensor : synth_tensor_layout(config))
      tensors[tensor.name] = TensorInfo{tensor.name, DType::BF16, tensor.shape, {}, 0, 0};
    for (const auto& [name, tensor_shape] : mtp) tensors[name] = TensorInfo{name, DType::BF16, tensor_shape, {}, 0, 0};
    EXPECT_EQ(plan_qwen3_5_checkpoint(tensors, config).dropped.size(), mtp.size());
    EXPECT_TRUE(plan_qwen3_5_checkpoint(tensors, config, true).dropped.empty());
  }
  const ModelConfig dense = parse_model_config(find_synth_shape("qwen3-0.6b").config, "config.json");
  kiln::testing::expect_error_mentions([&] { synth_mtp_tensor_layout(dense); },
                                       {"synth --mtp", "no multi-token-prediction head"});
}

namespace {

// Every tensor of two checkpoints, byte for byte, and their config.json quantization.
void expect_same_checkpoints(const fs::path& first_dir, const fs::path& second_dir) {
  const Checkpoint first = Checkpoint::open(first_dir), second = Checkpoint::open(second_dir);
  ASSERT_EQ(first.tensors().size(), second.tensors().size());
  for (const auto& [name, info] : first.tensors()) {
    ASSERT_TRUE(second.contains(name)) << name;
    const Tensor a = first.view(name), b = second.view(name);
    ASSERT_EQ(a.dtype(), b.dtype()) << name;
    ASSERT_EQ(a.shape(), b.shape()) << name;
    EXPECT_EQ(std::memcmp(a.raw(), b.raw(), a.nbytes()), 0) << name;
  }
  const auto config = [](const fs::path& dir) { return nlohmann::json::parse(std::ifstream(dir / "config.json")); };
  EXPECT_EQ(config(first_dir)["quantization_config"], config(second_dir)["quantization_config"]);
}

}  // namespace

// synth --quantize writes, row by row, what kiln quantize makes of the BF16 checkpoint of the same
// seed: bit for bit, MLX affine and FP8.
TEST(Synth, QuantizedCheckpointsEqualTheQuantizedBf16One) {
  kiln::testing::TempDir dir;
  SynthOptions options;
  options.shape = "qwen3-0.6b";
  options.layers = 1;
  options.seed = 3;
  options.out = dir.path() / "bf16";
  write_synthetic_checkpoint(options);
  const std::vector<std::pair<std::string, SynthQuantization>> cases{
      {"q4", {QuantizeFormat::MlxAffine, {4, 64}}}, {"q8", {QuantizeFormat::MlxAffine, {8, 128}}},
      {"fp8", {QuantizeFormat::Fp8, {}}}};
  for (const auto& [name, quantization] : cases) {
    SCOPED_TRACE(name);
    SynthOptions quantized = options;
    quantized.quantize = quantization;
    quantized.out = dir.path() / ("synth-" + name);
    quantized.max_shard_bytes = 64ull << 20;  // shards cut through the streamed rows
    const SynthResult written = write_synthetic_checkpoint(quantized);
    EXPECT_EQ(written.config.quantization.method,
              quantization.format == QuantizeFormat::Fp8 ? QuantMethod::Fp8 : QuantMethod::MlxAffine);
    quantize_checkpoint({options.out, dir.path() / ("quantized-" + name), quantization.format, quantization.scheme, {}});
    expect_same_checkpoints(quantized.out, dir.path() / ("quantized-" + name));
  }
}

TEST(Synth, LayoutsMarkTheQuantizableMatrices) {
  const ModelConfig config = parse_model_config(find_synth_shape("llama-3.2-1b").config, "config.json");
  std::map<TensorRole, int64_t> counts;
  for (const SynthTensor& tensor : synth_tensor_layout(config)) ++counts[tensor.role];
  EXPECT_EQ(counts[TensorRole::LayerLinear], 7 * config.num_hidden_layers);
  EXPECT_EQ(counts[TensorRole::Embedding], 1);
  EXPECT_EQ(counts[TensorRole::HeadLinear], config.tie_word_embeddings ? 0 : 1);
  EXPECT_EQ(counts[TensorRole::Other], 2 * config.num_hidden_layers + 1);  // two norms a layer, the final norm
}
