// Both Qwen3.5 checkpoint generations load onto one graph: the fixture rewritten into the other
// generations' layouts gives bit-identical logits.
#include <cstring>
#include <fstream>

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

Tensor fixture_logits(const std::filesystem::path& dir, const std::vector<int32_t>& prompt) {
  TestModel loaded = open_cpu_model(dir);
  return prompt_logits(*loaded.model, prompt, 0);
}

TEST(Qwen35Generations, RewrittenCheckpointsGiveIdenticalLogits) {
  KILN_REQUIRE_SHARED(shared);
  const auto fixture = shared / "fixtures/tiny/qwen3_5-text-tiny";
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

}  // namespace
