// Both Qwen3.5 checkpoint generations load onto one graph: the fixture rewritten into the other
// generations' layouts gives bit-identical logits; and an mlx-community 4-bit conversion (the
// mlx-lm layout with every Linear and the embedding quantized) gives the logits of its decoded
// weights.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>

#include <gtest/gtest.h>

#include "engine/generation.h"
#include "io/safetensors.h"
#include "io/safetensors_writer.h"
#include "model_test_support.h"
#include "test_support.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

bool is_zero_centred_gain(const std::string& name) {
  for (const char* suffix : {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                             "self_attn.k_norm.weight"})
    if (name.ends_with(suffix)) return true;
  return name == "model.norm.weight";
}

enum class Generation {
  MlxConverted,  // language_model.model.*, gains stored as 1 + γ, conv [C, K, 1], no MTP head
  HfMultimodal,  // model.language_model.*, gains as γ, conv [C, 1, K], with an MTP head to drop
};

// Writes the canonical checkpoint in `source` to `target` in the other generation's layout.
void rewrite(const std::filesystem::path& source, const std::filesystem::path& target, Generation generation) {
  std::filesystem::create_directories(target);
  std::filesystem::copy_file(source / "config.json", target / "config.json");
  const Checkpoint checkpoint = Checkpoint::open(source);
  std::vector<SafetensorsEntry> entries;
  for (const auto& [name, info] : checkpoint.tensors()) {
    const Tensor tensor = checkpoint.view(name);
    SafetensorsEntry entry{name, info.dtype, info.shape, {}, {}};
    const auto* bytes = static_cast<const uint8_t*>(tensor.raw());
    entry.bytes.assign(bytes, bytes + tensor.nbytes());
    const std::string body = name.substr(std::string("model.").size());
    if (generation == Generation::MlxConverted) {
      if (name.starts_with("model.")) entry.name = "language_model.model." + body;
      if (is_zero_centred_gain(name)) {
        // 1 + γ held in f32: exact for bf16 γ, so the graph's γ = stored − 1 recovers it bit for bit.
        entry.dtype = DType::F32;
        entry.bytes.resize(tensor.numel() * sizeof(float));
        auto* shifted = reinterpret_cast<float*>(entry.bytes.data());
        for (int64_t i = 0; i < tensor.numel(); ++i) {
          const float gamma = info.dtype == DType::BF16 ? bf16_to_f32(tensor.data<uint16_t>()[i]) : tensor.data<float>()[i];
          shifted[i] = gamma + 1.0f;
        }
      }
      if (name.ends_with("conv1d.weight")) entry.shape = {info.shape[0], info.shape[2], 1};
    } else {
      if (name.starts_with("model.")) entry.name = "model.language_model." + body;
    }
    entries.push_back(std::move(entry));
  }
  if (generation == Generation::HfMultimodal) {
    const Tensor embed = checkpoint.view("model.embed_tokens.weight");
    for (const char* mtp : {"mtp.fc.weight", "mtp.norm.weight"}) {
      SafetensorsEntry entry{mtp, embed.dtype(), {4, 4}, std::vector<uint8_t>(16 * dtype_size(embed.dtype()), 0), {}};
      entries.push_back(std::move(entry));
    }
  }
  write_safetensors(target / "model.safetensors", entries);
}

// MLX affine round to nearest of one row group: scale = (max − min) / 15 and bias = min, both
// rounded to bf16 (as mlx.core.quantize keeps them in the model dtype), codes clamped to 0..15.
struct QuantizedRow {
  std::vector<uint32_t> words;
  std::vector<uint16_t> scales, biases;
  std::vector<float> decoded;
};
QuantizedRow quantize_row_4bit(const float* row, int64_t columns, int64_t group) {
  QuantizedRow out;
  out.words.assign(static_cast<size_t>(columns / 8), 0);
  for (int64_t first = 0; first < columns; first += group) {
    const auto [low, high] = std::minmax_element(row + first, row + first + group);
    const float scale = round_to_bf16((*high - *low) / 15.0f), bias = round_to_bf16(*low);
    out.scales.push_back(f32_to_bf16(scale));
    out.biases.push_back(f32_to_bf16(bias));
    for (int64_t k = first; k < first + group; ++k) {
      const float code = scale == 0.0f ? 0.0f : std::clamp(std::nearbyint((row[k] - bias) / scale), 0.0f, 15.0f);
      out.words[k / 8] |= static_cast<uint32_t>(code) << (4 * (k % 8));
      out.decoded.push_back(affine_value(scale, static_cast<uint32_t>(code), bias));
    }
  }
  return out;
}

template <typename T>
std::vector<uint8_t> bytes_of(const std::vector<T>& values) {
  const auto* first = reinterpret_cast<const uint8_t*>(values.data());
  return {first, first + values.size() * sizeof(T)};
}

// Quantizes every 2-D weight of `mlx_dir` (written by rewrite: Linear weights, the embedding and
// the head) in place to MLX 4-bit group 32, and writes to `decoded_dir` the canonical checkpoint of
// `canonical_dir` with those matrices replaced by their decoded f32 values.
void quantize_mlx_4bit(const std::filesystem::path& mlx_dir, const std::filesystem::path& canonical_dir,
                       const std::filesystem::path& decoded_dir) {
  constexpr int64_t kGroup = 32;
  const Checkpoint mlx = Checkpoint::open(mlx_dir);
  std::vector<SafetensorsEntry> quantized;
  std::map<std::string, std::vector<float>> decoded;  // by the matrix's canonical name
  for (const auto& [name, info] : mlx.tensors()) {
    const Tensor tensor = mlx.view(name);
    const auto* bytes = static_cast<const uint8_t*>(tensor.raw());
    if (info.shape.size() != 2 || !name.ends_with(".weight")) {
      quantized.push_back({name, info.dtype, info.shape, {bytes, bytes + tensor.nbytes()}, {}});
      continue;
    }
    const int64_t rows = info.shape[0], columns = info.shape[1];
    std::vector<float> widened(static_cast<size_t>(rows * columns));
    for (size_t i = 0; i < widened.size(); ++i) widened[i] = bf16_to_f32(tensor.data<uint16_t>()[i]);
    std::vector<uint32_t> words;
    std::vector<uint16_t> scales, biases;
    std::vector<float>& values = decoded[name.starts_with("language_model.model.") ? name.substr(15) : "lm_head.weight"];
    for (int64_t row = 0; row < rows; ++row) {
      const QuantizedRow q = quantize_row_4bit(widened.data() + row * columns, columns, kGroup);
      words.insert(words.end(), q.words.begin(), q.words.end());
      scales.insert(scales.end(), q.scales.begin(), q.scales.end());
      biases.insert(biases.end(), q.biases.begin(), q.biases.end());
      values.insert(values.end(), q.decoded.begin(), q.decoded.end());
    }
    const std::string module = name.substr(0, name.size() - std::string(".weight").size());
    quantized.push_back({name, DType::U32, {rows, columns / 8}, bytes_of(words), {}});
    quantized.push_back({module + ".scales", DType::BF16, {rows, columns / kGroup}, bytes_of(scales), {}});
    quantized.push_back({module + ".biases", DType::BF16, {rows, columns / kGroup}, bytes_of(biases), {}});
  }
  write_safetensors(mlx_dir / "model.safetensors", quantized, {{"format", "mlx"}});
  nlohmann::json config = nlohmann::json::parse(std::ifstream(mlx_dir / "config.json"));
  config["quantization"] = {{"group_size", kGroup}, {"bits", 4}};
  config["quantization_config"] = config["quantization"];
  std::ofstream(mlx_dir / "config.json") << config.dump();

  std::filesystem::create_directories(decoded_dir);
  std::filesystem::copy_file(canonical_dir / "config.json", decoded_dir / "config.json");
  const Checkpoint canonical = Checkpoint::open(canonical_dir);
  std::vector<SafetensorsEntry> dense;
  for (const auto& [name, info] : canonical.tensors()) {
    const Tensor tensor = canonical.view(name);
    const auto* bytes = static_cast<const uint8_t*>(tensor.raw());
    const auto found = decoded.find(name);
    if (found == decoded.end())
      dense.push_back({name, info.dtype, info.shape, {bytes, bytes + tensor.nbytes()}, {}});
    else
      dense.push_back({name, DType::F32, info.shape, bytes_of(found->second), {}});
  }
  write_safetensors(decoded_dir / "model.safetensors", dense);
}

Tensor fixture_logits(const std::filesystem::path& dir, const std::vector<int32_t>& prompt) {
  TestModel loaded = open_cpu_model(dir);
  return prompt_logits(*loaded.model, prompt, 0);
}

TEST(Qwen35Generations, RewrittenCheckpointsGiveIdenticalLogits) {
  const auto fixture = fixtures_dir() / "qwen3_5-text-tiny";
  std::vector<int32_t> prompt = fixture_prompt(fixture);
  prompt.resize(100);
  const Tensor canonical = fixture_logits(fixture / "bf16", prompt);
  TempDir temp;
  for (Generation generation : {Generation::MlxConverted, Generation::HfMultimodal}) {
    const auto target = temp.path() / (generation == Generation::MlxConverted ? "mlx" : "hf");
    rewrite(fixture / "bf16", target, generation);
    const Tensor rewritten = fixture_logits(target, prompt);
    ASSERT_EQ(rewritten.shape(), canonical.shape());
    EXPECT_EQ(std::memcmp(rewritten.raw(), canonical.raw(), canonical.nbytes()), 0)
        << (generation == Generation::MlxConverted ? "mlx-converted" : "HF multimodal") << " layout";
  }
}

TEST(Qwen35Generations, MlxFourBitConversionGivesTheLogitsOfItsDecodedWeights) {
  const auto fixture = fixtures_dir() / "qwen3_5-text-tiny";
  std::vector<int32_t> prompt = fixture_prompt(fixture);
  prompt.resize(100);
  TempDir temp;
  rewrite(fixture / "bf16", temp.path() / "mlx-4bit", Generation::MlxConverted);
  quantize_mlx_4bit(temp.path() / "mlx-4bit", fixture / "bf16", temp.path() / "decoded");
  const Tensor quantized = fixture_logits(temp.path() / "mlx-4bit", prompt);
  const Tensor decoded = fixture_logits(temp.path() / "decoded", prompt);
  ASSERT_EQ(quantized.shape(), decoded.shape());
  EXPECT_EQ(std::memcmp(quantized.raw(), decoded.raw(), decoded.nbytes()), 0);
}

}  // namespace
