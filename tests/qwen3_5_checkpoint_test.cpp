// The Qwen3.5 checkpoint sanitizer on the fixture checkpoints and on every other generation's
// layout (spec A.9), built from the same names and shapes.
#include <algorithm>
#include <cstdint>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/safetensors_writer.h"
#include "model/quantized_checkpoint.h"
#include "model/qwen3_5_checkpoint.h"
#include "model/synth.h"
#include "test_support.h"

using namespace kiln;

namespace {

using TensorMap = std::map<std::string, TensorInfo>;

// The fields the sanitizer reads, as the fixture generator sets them (shared/oracle/gen_fixtures.py).
ModelConfig tiny_config() {
  ModelConfig config;
  config.source = "qwen3_5-tiny/config.json";
  config.model_type = "qwen3_5_text";
  config.hidden_size = 128;
  config.intermediate_size = 256;
  config.num_hidden_layers = 4;
  config.num_attention_heads = 4;
  config.num_key_value_heads = 2;
  config.head_dim = 32;
  config.vocab_size = 512;
  config.tie_word_embeddings = true;
  config.layer_types = {LayerKind::LinearAttention, LayerKind::LinearAttention, LayerKind::LinearAttention,
                        LayerKind::FullAttention};
  config.linear_num_key_heads = 2;
  config.linear_num_value_heads = 4;
  config.linear_key_head_dim = 32;
  config.linear_value_head_dim = 32;
  config.linear_conv_kernel_dim = 4;
  return config;
}

void add(TensorMap& map, const std::string& name, Shape shape, DType dtype = DType::F32) {
  map[name] = TensorInfo{name, dtype, std::move(shape), {}, 0, 0};
}

// The names and shapes transformers writes for a Qwen3_5ForCausalLM (the text fixture's layout).
// The text checkpoint transformers' Qwen3_5ForCausalLM saves for `c`'s shapes: kiln synth's
// layout (Qwen3-Next tests regroup it into their own layout).
TensorMap hf_text_tensors(const ModelConfig& c) {
  ModelConfig qwen3_5 = c;
  qwen3_5.model_type = "qwen3_5_text";
  TensorMap map;
  for (const SynthTensor& tensor : synth_tensor_layout(qwen3_5)) add(map, tensor.name, tensor.shape);
  return map;
}

// Renames every tensor with `rename` and reshapes conv1d weights with `conv_shape`.
TensorMap transform(const TensorMap& map, const std::function<std::string(const std::string&)>& rename,
                    const std::function<Shape(const Shape&)>& conv_shape) {
  TensorMap out;
  for (const auto& [name, info] : map) {
    const bool conv = name.ends_with("conv1d.weight");
    add(out, rename(name), conv ? conv_shape(info.shape) : info.shape, info.dtype);
  }
  return out;
}

std::string replace_prefix(const std::string& name, const std::string& from, const std::string& to) {
  return name.starts_with(from) ? to + name.substr(from.size()) : name;
}

Shape kernel_last(const Shape& s) { return {s[0], s[2], 1}; }
Shape channels_kernel(const Shape& s) { return {s[0], s[2]}; }

// mlx-lm's Qwen3.5 conversion: language_model.* names, [C, K, 1] conv, no mtp, a vision tower.
TensorMap mlx_tensors(const ModelConfig& config) {
  TensorMap map = transform(
      hf_text_tensors(config),
      [](const std::string& n) {
        return n == "lm_head.weight" ? "language_model.lm_head.weight" : replace_prefix(n, "model.", "language_model.model.");
      },
      kernel_last);
  if (!map.count("language_model.lm_head.weight"))
    add(map, "language_model.lm_head.weight", {config.vocab_size, config.hidden_size});
  add(map, "vision_tower.blocks.0.attn.qkv.weight", {96, 32});
  return map;
}

const PlannedTensor& planned(const LoadPlan& plan, const std::string& canonical) {
  for (const PlannedTensor& tensor : plan.tensors)
    if (tensor.canonical == canonical) return tensor;
  throw std::runtime_error("plan has no " + canonical);
}

bool has_fixup(const PlannedTensor& tensor, FixUp fixup) {
  return std::find(tensor.fixups.begin(), tensor.fixups.end(), fixup) != tensor.fixups.end();
}

std::set<std::string> canonical_names(const LoadPlan& plan) {
  std::set<std::string> names;
  for (const PlannedTensor& tensor : plan.tensors) names.insert(tensor.canonical);
  return names;
}

std::string notes_of(const LoadPlan& plan) {
  std::string text;
  for (const std::string& note : plan.notes) text += note + "\n";
  return text;
}

// The canonical names of the zero-centred gains of tiny_config(): 4 × 2 layer norms, q/k norms of
// the one full-attention layer, and the final norm.
const std::set<std::string>& zero_centred_gains() {
  static const std::set<std::string> names = [] {
    std::set<std::string> set = {"model.norm.weight", "model.layers.3.self_attn.q_norm.weight",
                                 "model.layers.3.self_attn.k_norm.weight"};
    for (int i = 0; i < 4; ++i) {
      set.insert("model.layers." + std::to_string(i) + ".input_layernorm.weight");
      set.insert("model.layers." + std::to_string(i) + ".post_attention_layernorm.weight");
    }
    return set;
  }();
  return names;
}

std::string error_of(const TensorMap& map, const ModelConfig& config) {
  try {
    plan_qwen3_5_checkpoint(map, config);
  } catch (const Error& error) {
    return error.what();
  }
  return "(no error)";
}

// A safetensors file's header as TensorInfos (names, dtypes, shapes; no data is read).
TensorMap read_header(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  uint64_t length = 0;
  in.read(reinterpret_cast<char*>(&length), sizeof length);
  std::string text(length, '\0');
  in.read(text.data(), static_cast<std::streamsize>(length));
  TensorMap map;
  const nlohmann::json header = nlohmann::json::parse(text);
  for (auto item = header.begin(); item != header.end(); ++item) {
    const std::string& name = item.key();
    const nlohmann::json& entry = item.value();
    if (name == "__metadata__") continue;
    add(map, name, entry.at("shape").get<Shape>(), *parse_dtype(entry.at("dtype").get<std::string>()));
    map[name].file = path;
  }
  return map;
}

}  // namespace

TEST(Qwen35Checkpoint, SyntheticHfLayoutMatchesTheTextFixture) {
  const TensorMap fixture = read_header(kiln::testing::fixtures_dir() / "qwen3_5-text-tiny/f32/model.safetensors");
  const TensorMap synthetic = hf_text_tensors(tiny_config());
  ASSERT_EQ(fixture.size(), synthetic.size());
  for (const auto& [name, info] : synthetic) {
    ASSERT_TRUE(fixture.count(name)) << name;
    EXPECT_EQ(fixture.at(name).shape, info.shape) << name;
  }
}

TEST(Qwen35Checkpoint, TextFixtureKeepsNamesAndGainsAndDropsTheConvUnitAxis) {
  const TensorMap tensors = read_header(kiln::testing::fixtures_dir() / "qwen3_5-text-tiny/bf16/model.safetensors");
  const LoadPlan plan = plan_qwen3_5_checkpoint(tensors, tiny_config());
  EXPECT_TRUE(plan.dropped.empty());
  ASSERT_EQ(plan.tensors.size(), tensors.size());
  for (const PlannedTensor& tensor : plan.tensors) {
    EXPECT_EQ(tensor.canonical, tensor.source);
    EXPECT_FALSE(has_fixup(tensor, FixUp::SubtractOne)) << tensor.canonical;
    if (tensor.canonical.ends_with("conv1d.weight")) {
      EXPECT_EQ(tensor.fixups, std::vector<FixUp>{FixUp::ConvToChannelsKernel});
      EXPECT_EQ(tensor.canonical_shape, (std::vector<int64_t>{256, 4}));
    } else {
      EXPECT_TRUE(tensor.fixups.empty()) << tensor.canonical;
      EXPECT_EQ(tensor.canonical_shape, tensors.at(tensor.source).shape) << tensor.canonical;
    }
  }
  EXPECT_NE(notes_of(plan).find("stored as γ (Hugging Face export: conv1d in the [C, 1, K] layout)"),
            std::string::npos)
      << notes_of(plan);
}

TEST(Qwen35Checkpoint, MultimodalFixtureRenamesDropsVisionAndKeepsItsUntiedHead) {
  const std::filesystem::path tiny = kiln::testing::fixtures_dir();
  const TensorMap tensors = read_header(tiny / "qwen3_5-vl-tiny/bf16/model.safetensors");
  ModelConfig config = tiny_config();
  // The outer config of a nested model governs tying: the VL fixture's top-level
  // tie_word_embeddings is false and it stores an lm_head that differs from embed_tokens.
  config.tie_word_embeddings = false;
  config.vocab_size = 504;
  const LoadPlan plan = plan_qwen3_5_checkpoint(tensors, config);

  std::set<std::string> expected = canonical_names(
      plan_qwen3_5_checkpoint(read_header(tiny / "qwen3_5-text-tiny/bf16/model.safetensors"), tiny_config()));
  expected.insert("lm_head.weight");
  EXPECT_EQ(canonical_names(plan), expected);
  EXPECT_EQ(planned(plan, "model.layers.0.linear_attn.A_log").source,
            "model.language_model.layers.0.linear_attn.A_log");
  EXPECT_EQ(planned(plan, "lm_head.weight").source, "lm_head.weight");
  EXPECT_EQ(planned(plan, "model.layers.2.linear_attn.conv1d.weight").fixups,
            std::vector<FixUp>{FixUp::ConvToChannelsKernel});
  for (const PlannedTensor& tensor : plan.tensors) EXPECT_FALSE(has_fixup(tensor, FixUp::SubtractOne));
  size_t visual = 0;
  for (const auto& [name, info] : tensors) visual += name.starts_with("model.visual.");
  ASSERT_EQ(plan.dropped.size(), visual);
  for (const DroppedTensor& dropped : plan.dropped) {
    EXPECT_TRUE(dropped.source.starts_with("model.visual.")) << dropped.source;
    EXPECT_EQ(dropped.reason, "vision tower (text graph)");
  }
  EXPECT_NE(notes_of(plan).find("renamed model.language_model.* → model.*"), std::string::npos) << notes_of(plan);
}

TEST(Qwen35Checkpoint, MlxConversionIsRenamedAndItsZeroCentredGainsShiftedOnce) {
  ModelConfig config = tiny_config();
  config.tie_word_embeddings = false;
  const LoadPlan plan = plan_qwen3_5_checkpoint(mlx_tensors(config), config);
  EXPECT_EQ(canonical_names(plan), [&] {
    std::set<std::string> names;
    for (const auto& [name, info] : hf_text_tensors(config)) names.insert(name);
    names.insert("lm_head.weight");
    return names;
  }());
  EXPECT_EQ(planned(plan, "lm_head.weight").source, "language_model.lm_head.weight");
  for (const PlannedTensor& tensor : plan.tensors) {
    EXPECT_EQ(has_fixup(tensor, FixUp::SubtractOne), zero_centred_gains().count(tensor.canonical) == 1)
        << tensor.canonical;
    EXPECT_EQ(tensor.source, tensor.canonical == "lm_head.weight" ? "language_model.lm_head.weight"
                                                                  : "language_model." + tensor.canonical);
  }
  // The gated norm's gain is a plain multiplier: never shifted.
  EXPECT_TRUE(planned(plan, "model.layers.0.linear_attn.norm.weight").fixups.empty());
  const PlannedTensor& conv = planned(plan, "model.layers.1.linear_attn.conv1d.weight");
  EXPECT_EQ(conv.fixups, std::vector<FixUp>{FixUp::ConvFromKernelLast});
  EXPECT_EQ(conv.canonical_shape, (std::vector<int64_t>{256, 4}));
  ASSERT_EQ(plan.dropped.size(), 1u);
  EXPECT_EQ(plan.dropped[0].source, "vision_tower.blocks.0.attn.qkv.weight");
  EXPECT_NE(notes_of(plan).find("stored as 1 + γ (mlx-lm conversion"), std::string::npos) << notes_of(plan);
}

// Any mtp.* tensor marks a Hugging Face export for the whole map, whatever else the map holds.
TEST(Qwen35Checkpoint, MtpTensorsDecideTheGainConventionForTheWholeMap) {
  ModelConfig config = tiny_config();
  config.tie_word_embeddings = false;
  TensorMap tensors = mlx_tensors(config);
  add(tensors, "mtp.fc.weight", {128, 256});
  add(tensors, "mtp.norm.weight", {128});
  const LoadPlan plan = plan_qwen3_5_checkpoint(tensors, config);
  for (const PlannedTensor& tensor : plan.tensors) EXPECT_FALSE(has_fixup(tensor, FixUp::SubtractOne)) << tensor.canonical;
  int mtp_dropped = 0;
  for (const DroppedTensor& dropped : plan.dropped)
    if (dropped.source.starts_with("mtp.")) {
      ++mtp_dropped;
      EXPECT_NE(dropped.reason.find("multi-token-prediction"), std::string::npos);
    }
  EXPECT_EQ(mtp_dropped, 2);
  EXPECT_NE(notes_of(plan).find("stored as γ (Hugging Face export: 2 mtp.* tensors)"), std::string::npos)
      << notes_of(plan);
}

// Wrapped exports nest the head: language_model.mtp.* and model.mtp.* are the same head, dropped and
// counted as mtp.* is.
TEST(Qwen35Checkpoint, MtpTensorsAreRecognisedWhereverAnExportNestsThem) {
  ModelConfig config = tiny_config();
  config.tie_word_embeddings = false;
  TensorMap tensors = mlx_tensors(config);
  add(tensors, "language_model.mtp.fc.weight", {128, 256});
  add(tensors, "model.mtp.norm.weight", {128});
  const LoadPlan plan = plan_qwen3_5_checkpoint(tensors, config);
  int mtp_dropped = 0;
  for (const DroppedTensor& dropped : plan.dropped)
    if (dropped.source.find("mtp.") != std::string::npos) {
      ++mtp_dropped;
      EXPECT_NE(dropped.reason.find("multi-token-prediction"), std::string::npos);
    }
  EXPECT_EQ(mtp_dropped, 2);
  for (const PlannedTensor& tensor : plan.tensors) EXPECT_FALSE(has_fixup(tensor, FixUp::SubtractOne)) << tensor.canonical;
}

TEST(Qwen35Checkpoint, CanonicalArtifactGetsTheIdentityPlan) {
  const ModelConfig config = tiny_config();
  const TensorMap tensors = transform(hf_text_tensors(config), [](const std::string& n) { return n; }, channels_kernel);
  const LoadPlan plan = plan_qwen3_5_checkpoint(tensors, config);
  ASSERT_EQ(plan.tensors.size(), tensors.size());
  for (const PlannedTensor& tensor : plan.tensors) {
    EXPECT_EQ(tensor.canonical, tensor.source);
    EXPECT_TRUE(tensor.fixups.empty()) << tensor.canonical;
    EXPECT_EQ(tensor.canonical_shape, tensors.at(tensor.source).shape);
  }
  EXPECT_TRUE(plan.dropped.empty());
  EXPECT_NE(notes_of(plan).find("kiln's canonical layout"), std::string::npos) << notes_of(plan);
}

TEST(Qwen35Checkpoint, TiedHeadIsDropped) {
  ModelConfig config = tiny_config();  // tie_word_embeddings: true
  TensorMap tensors = hf_text_tensors(config);
  add(tensors, "lm_head.weight", {512, 128});
  const LoadPlan plan = plan_qwen3_5_checkpoint(tensors, config);
  EXPECT_FALSE(canonical_names(plan).count("lm_head.weight"));
  ASSERT_EQ(plan.dropped.size(), 1u);
  EXPECT_EQ(plan.dropped[0].source, "lm_head.weight");
  EXPECT_NE(plan.dropped[0].reason.find("tie_word_embeddings"), std::string::npos);
}

// Qwen3-Next's grouped in_proj_qkvz / in_proj_ba become the Qwen3.5 projections by row gathers
// that realise spec A.6.1's permutation, for value/key head ratios 1, 2 and 4.
TEST(Qwen35Checkpoint, QwenNextGroupedProjectionsAreRegroupedBySpecPermutation) {
  for (int64_t ratio : {1, 2, 4}) {
    SCOPED_TRACE("ratio " + std::to_string(ratio));
    ModelConfig config = tiny_config();
    config.model_type = "qwen3_next";
    config.linear_num_key_heads = 2;
    config.linear_num_value_heads = 2 * ratio;
    config.linear_key_head_dim = 3;
    config.linear_value_head_dim = 5;
    const int64_t Hk = 2, Hv = 2 * ratio, dk = 3, dv = 5, H = config.hidden_size;
    TensorMap tensors;
    for (const auto& [name, info] : hf_text_tensors(config)) {
      if (name.find("in_proj_") != std::string::npos) continue;
      tensors[name] = info;
    }
    for (int i = 0; i < 3; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".linear_attn.";
      add(tensors, p + "in_proj_qkvz.weight", {2 * Hk * dk + 2 * Hv * dv, H});
      add(tensors, p + "in_proj_ba.weight", {2 * Hv, H});
    }
    add(tensors, "mtp.layers.0.input_layernorm.weight", {H});
    const LoadPlan plan = plan_qwen3_5_checkpoint(tensors, config);
    EXPECT_FALSE(canonical_names(plan).count("model.layers.0.linear_attn.in_proj_qkvz.weight"));
    EXPECT_FALSE(canonical_names(plan).count("model.layers.0.linear_attn.in_proj_ba.weight"));

    // Gathered source rows of each canonical tensor, in order.
    auto gathered = [&](const std::string& canonical, const std::string& source) {
      const PlannedTensor& tensor = planned(plan, "model.layers.1.linear_attn." + canonical);
      EXPECT_EQ(tensor.source, "model.layers.1.linear_attn." + source);
      EXPECT_EQ(tensor.fixups, std::vector<FixUp>{FixUp::GatherRows});
      std::vector<int64_t> rows;
      for (const RowBlock& block : tensor.row_blocks)
        for (int64_t r = 0; r < block.rows; ++r) rows.push_back(block.first_row + r);
      EXPECT_EQ(static_cast<int64_t>(rows.size()), tensor.canonical_shape[0]);
      EXPECT_EQ(tensor.canonical_shape[1], H);
      return rows;
    };
    const std::vector<int64_t> qkv = gathered("in_proj_qkv.weight", "in_proj_qkvz.weight");
    const std::vector<int64_t> z = gathered("in_proj_z.weight", "in_proj_qkvz.weight");
    const std::vector<int64_t> b = gathered("in_proj_b.weight", "in_proj_ba.weight");
    const std::vector<int64_t> a = gathered("in_proj_a.weight", "in_proj_ba.weight");
    ASSERT_EQ(qkv.size(), size_t(2 * Hk * dk + Hv * dv));
    ASSERT_EQ(z.size(), size_t(Hv * dv));
    // Spec A.6.1, with W = 2dk + 2r·dv.
    const int64_t W = 2 * dk + 2 * ratio * dv;
    for (int64_t g = 0; g < Hk; ++g) {
      for (int64_t i = 0; i < dk; ++i) {
        EXPECT_EQ(qkv[g * dk + i], g * W + i);
        EXPECT_EQ(qkv[Hk * dk + g * dk + i], g * W + dk + i);
      }
      for (int64_t j = 0; j < ratio; ++j) {
        for (int64_t i = 0; i < dv; ++i) {
          EXPECT_EQ(qkv[2 * Hk * dk + (g * ratio + j) * dv + i], g * W + 2 * dk + j * dv + i);
          EXPECT_EQ(z[(g * ratio + j) * dv + i], g * W + 2 * dk + ratio * dv + j * dv + i);
        }
        EXPECT_EQ(b[g * ratio + j], g * 2 * ratio + j);
        EXPECT_EQ(a[g * ratio + j], g * 2 * ratio + ratio + j);
      }
    }
    EXPECT_NE(notes_of(plan).find("in_proj_qkvz / in_proj_ba regrouped"), std::string::npos) << notes_of(plan);
  }
}

// A quantized Qwen3-Next checkpoint (MLX 4-bit where the input width allows): the regrouping row
// gathers of in_proj_qkvz / in_proj_ba carry the scales and biases along, and the codes keep their
// packed width.
TEST(Qwen35Checkpoint, QwenNextRegroupingGathersTheScalesOfQuantizedProjections) {
  ModelConfig config = tiny_config();
  config.model_type = "qwen3_next";
  config.linear_num_value_heads = 4;
  config.linear_key_head_dim = 3;
  config.linear_value_head_dim = 5;
  config.quantization.method = QuantMethod::MlxAffine;
  config.quantization.affine = {4, 32};
  const int64_t Hk = 2, Hv = 4, dk = 3, dv = 5, H = config.hidden_size;
  TensorMap dense;
  for (const auto& [name, info] : hf_text_tensors(config))
    if (name.find("in_proj_") == std::string::npos) dense[name] = info;
  for (int i = 0; i < 3; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".linear_attn.";
    add(dense, p + "in_proj_qkvz.weight", {2 * Hk * dk + 2 * Hv * dv, H});
    add(dense, p + "in_proj_ba.weight", {2 * Hv, H});
  }
  std::vector<SafetensorsEntry> entries;
  auto zeros = [](DType dtype, const Shape& shape) {
    return SafetensorsEntry{"", dtype, shape, std::vector<uint8_t>(shape_numel(shape) * dtype_size(dtype)), {}};
  };
  for (const auto& [name, info] : dense) {
    if (info.shape.size() == 2 && info.shape[1] % 32 == 0 && name.ends_with(".weight")) {
      const std::string module = name.substr(0, name.size() - 7);
      entries.push_back(zeros(DType::U32, {info.shape[0], info.shape[1] / 8}));
      entries.back().name = name;
      for (const char* part : {".scales", ".biases"}) {
        entries.push_back(zeros(DType::BF16, {info.shape[0], info.shape[1] / 32}));
        entries.back().name = module + part;
      }
      continue;
    }
    entries.push_back(zeros(info.dtype, info.shape));
    entries.back().name = name;
  }
  kiln::testing::TempDir temp;
  write_safetensors(temp.path() / "model.safetensors", entries);
  const Checkpoint checkpoint = Checkpoint::open(temp.path());
  const LoadPlan plan = plan_checkpoint(checkpoint, config, [&](const Checkpoint& seen) {
    return plan_qwen3_5_checkpoint(seen.tensors(), config);
  });
  const std::string p = "model.layers.1.linear_attn.";
  const PlannedTensor& codes = planned(plan, p + "in_proj_qkv.weight");
  ASSERT_TRUE(codes.quantized.has_value());
  EXPECT_EQ(codes.canonical_shape, (Shape{2 * Hk * dk + Hv * dv, H / 8}));
  EXPECT_EQ(codes.quantized->scales, p + "in_proj_qkv.scales");
  for (const char* part : {"in_proj_qkv.scales", "in_proj_qkv.biases"}) {
    const PlannedTensor& gathered = planned(plan, p + part);
    EXPECT_EQ(gathered.source, p + "in_proj_qkvz." + std::string(part).substr(12));
    EXPECT_EQ(gathered.fixups, std::vector<FixUp>{FixUp::GatherRows});
    EXPECT_EQ(gathered.canonical_shape, (Shape{2 * Hk * dk + Hv * dv, H / 32}));
    ASSERT_EQ(gathered.row_blocks.size(), codes.row_blocks.size());
    for (size_t i = 0; i < codes.row_blocks.size(); ++i) {
      EXPECT_EQ(gathered.row_blocks[i].first_row, codes.row_blocks[i].first_row);
      EXPECT_EQ(gathered.row_blocks[i].rows, codes.row_blocks[i].rows);
    }
  }
  EXPECT_EQ(planned(plan, p + "in_proj_b.biases").canonical_shape, (Shape{Hv, H / 32}));
  EXPECT_FALSE(canonical_names(plan).count(p + "in_proj_qkvz.scales"));
  // The whole plan materialises: every planned part and value has its planned shape.
  WeightMap weights(checkpoint, plan);
  EXPECT_EQ(weights.take_weight(p + "in_proj_z.weight", {Hv * dv, H}).describe(), "affine 4-bit group 32 (scales BF16)");
}

TEST(Qwen35Checkpoint, MalformedCheckpointsNameTheTensor) {
  const ModelConfig config = tiny_config();
  const TensorMap good = hf_text_tensors(config);
  auto without = [&](const std::string& name) {
    TensorMap map = good;
    map.erase(name);
    return map;
  };
  auto with = [&](const std::string& name, Shape shape) {
    TensorMap map = good;
    add(map, name, std::move(shape));
    return map;
  };
  auto expect_error = [&](const TensorMap& map, const std::vector<std::string>& fragments,
                          const ModelConfig& used = tiny_config()) {
    const std::string message = error_of(map, used);
    for (const std::string& fragment : fragments) EXPECT_NE(message.find(fragment), std::string::npos) << message;
  };

  expect_error(without("model.layers.1.linear_attn.A_log"),
               {"model.layers.1.linear_attn.A_log", "layer 1 is linear_attention"});
  expect_error(with("model.layers.0.linear_attn.conv1d.weight", {256, 2, 4}),
               {"model.layers.0.linear_attn.conv1d.weight", "[256, 2, 4]", "[256, 1, 4]", "[256, 4, 1]", "[256, 4]"});
  expect_error(with("model.layers.2.linear_attn.conv1d.weight", {256, 4, 1}),
               {"model.layers.2.linear_attn.conv1d.weight", "mixes two generations"});
  expect_error(with("model.layers.0.linear_attn.dt_bias", {5}), {"model.layers.0.linear_attn.dt_bias", "[5]", "[4]"});
  expect_error(with("model.layers.1.linear_attn.in_proj_qkvz.weight", {512, 128}),
               {"model.layers.1.linear_attn.in_proj_", "Qwen3-Next"});
  expect_error(with("model.layers.3.linear_attn.A_log", {4}),
               {"model.layers.3.linear_attn.A_log", "layer 3 is full_attention"});
  expect_error(with("model.layers.4.input_layernorm.weight", {128}), {"model.layers.4.input_layernorm.weight"});
  expect_error(without("model.layers.3.self_attn.k_norm.weight"), {"model.layers.3.self_attn.k_norm.weight"});
  expect_error(with("encoder.weight", {4}), {"encoder.weight", "no Qwen3.5 name prefix"});
  expect_error(with("model.language_model.norm.weight", {128}),
               {"model.language_model.norm.weight", "model.norm.weight", "both name"});

  ModelConfig dense = tiny_config();
  dense.model_type = "qwen3";
  expect_error(good, {"qwen3", "hybrid"}, dense);
  ModelConfig odd_heads = tiny_config();
  odd_heads.linear_num_value_heads = 3;
  expect_error(good, {"linear_num_value_heads"}, odd_heads);
}
