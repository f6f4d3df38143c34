// Mixture-of-experts families end to end on the CPU: Qwen3-MoE and Qwen3.5-MoE against
// transformers' float64 logits (tests/data/fixtures), the three expert layouts and quantized
// experts giving the same bits, the routing rule, the weight bytes a step reads, and the load-time
// refusals of malformed MoE checkpoints and configs.
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <set>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/weight.h"
#include "engine/generation.h"
#include "io/safetensors.h"
#include "io/safetensors_writer.h"
#include "model/family.h"
#include "model/loader.h"
#include "model/moe.h"
#include "model/quantize.h"
#include "forwarding_backend.h"
#include "model_test_support.h"
#include "test_support.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

using Entries = std::vector<SafetensorsEntry>;

Entries read_entries(const std::filesystem::path& dir) {
  const Checkpoint checkpoint = Checkpoint::open(dir);
  Entries entries;
  for (const auto& [name, info] : checkpoint.tensors()) {
    const Tensor tensor = checkpoint.view(name);
    const auto* bytes = static_cast<const uint8_t*>(tensor.raw());
    entries.push_back({name, info.dtype, info.shape, {bytes, bytes + tensor.nbytes()}, {}});
  }
  return entries;
}

// A copy of checkpoint folder `source` with its tensors and config.json edited.
std::filesystem::path edited_copy(const std::filesystem::path& source, const std::filesystem::path& target,
                                  const std::function<void(Entries&)>& edit_tensors,
                                  const std::function<void(nlohmann::json&)>& edit_config = {}) {
  std::filesystem::create_directories(target);
  nlohmann::json config = nlohmann::json::parse(std::ifstream(source / "config.json"));
  if (edit_config) edit_config(config);
  std::ofstream(target / "config.json") << config.dump();
  Entries entries = read_entries(source);
  edit_tensors(entries);
  write_safetensors(target / "model.safetensors", entries);
  return target;
}

const SafetensorsEntry& entry(const Entries& entries, const std::string& name) {
  for (const SafetensorsEntry& candidate : entries)
    if (candidate.name == name) return candidate;
  throw std::runtime_error("test checkpoint has no tensor " + name);
}

// Entries `names` (equal shapes and dtypes) stacked along a new axis 0, under `stacked_name`.
SafetensorsEntry stacked(const Entries& entries, const std::vector<std::string>& names, const std::string& stacked_name) {
  SafetensorsEntry out = entry(entries, names.front());
  out.name = stacked_name;
  out.shape.insert(out.shape.begin(), static_cast<int64_t>(names.size()));
  out.bytes.clear();
  for (const std::string& name : names) {
    const SafetensorsEntry& part = entry(entries, name);
    out.bytes.insert(out.bytes.end(), part.bytes.begin(), part.bytes.end());
  }
  return out;
}

// The per-expert tensors of every layer `sparse` lists, restacked by `restack(entries, layer prefix, E)`.
void restack_experts(Entries& entries, int64_t layers, int64_t experts,
                     const std::function<Entries(const Entries&, const std::string&)>& restack) {
  Entries added;
  for (int64_t layer = 0; layer < layers; ++layer) {
    const std::string prefix = fmt::format("model.layers.{}.mlp.", layer);
    if (!std::any_of(entries.begin(), entries.end(),
                     [&](const SafetensorsEntry& e) { return e.name.starts_with(prefix + "experts."); }))
      continue;
    for (SafetensorsEntry& e : restack(entries, prefix)) added.push_back(std::move(e));
  }
  std::erase_if(entries, [](const SafetensorsEntry& e) { return e.name.find(".mlp.experts.") != std::string::npos; });
  for (SafetensorsEntry& e : added) entries.push_back(std::move(e));
  (void)experts;
}

std::vector<std::string> expert_names(const std::string& prefix, int64_t experts, const std::string& matrix,
                                      const std::string& part = "weight") {
  std::vector<std::string> names;
  for (int64_t e = 0; e < experts; ++e) names.push_back(fmt::format("{}experts.{}.{}.{}", prefix, e, matrix, part));
  return names;
}

// mlx-lm's layout: switch_mlp.{gate,up,down}_proj.{weight[, scales, biases]} stacked over experts.
Entries to_switch_mlp(const Entries& entries, const std::string& prefix, int64_t experts, bool quantized) {
  Entries out;
  for (const char* matrix : {"gate_proj", "up_proj", "down_proj"})
    for (const char* part : {"weight", "scales", "biases"}) {
      if (std::string(part) != "weight" && (!quantized || !std::any_of(entries.begin(), entries.end(), [&](const auto& e) {
                                              return e.name == expert_names(prefix, 1, matrix, part).front();
                                            })))
        continue;
      out.push_back(stacked(entries, expert_names(prefix, experts, matrix, part),
                            fmt::format("{}switch_mlp.{}.{}", prefix, matrix, part)));
    }
  return out;
}

// transformers v5's fused layout: experts.gate_up_proj [E, 2·Ie, H] (gate rows first), experts.down_proj.
Entries to_fused(const Entries& entries, const std::string& prefix, int64_t experts) {
  SafetensorsEntry gate_up = stacked(entries, expert_names(prefix, experts, "gate_proj"), prefix + "experts.gate_up_proj");
  gate_up.shape[1] *= 2;
  gate_up.bytes.clear();
  for (int64_t e = 0; e < experts; ++e)
    for (const char* matrix : {"gate_proj", "up_proj"}) {
      const SafetensorsEntry& part = entry(entries, fmt::format("{}experts.{}.{}.weight", prefix, e, matrix));
      gate_up.bytes.insert(gate_up.bytes.end(), part.bytes.begin(), part.bytes.end());
    }
  return {gate_up, stacked(entries, expert_names(prefix, experts, "down_proj"), prefix + "experts.down_proj")};
}

std::vector<int32_t> first_tokens(const std::filesystem::path& fixture, size_t count) {
  std::vector<int32_t> prompt = fixture_prompt(fixture);
  prompt.resize(count);
  return prompt;
}

void expect_bit_identical(const Tensor& a, const Tensor& b, const std::string& what) {
  ASSERT_EQ(a.shape(), b.shape()) << what;
  ASSERT_EQ(std::memcmp(a.raw(), b.raw(), a.nbytes()), 0) << what;
}

struct MoeFixture {
  std::string name;
  int64_t layers, experts;
};

class MoeParity : public ::testing::TestWithParam<MoeFixture> {};

TEST_P(MoeParity, F32ActivationsMatchFloat64OfEachCheckpoint) {
  const auto fixture = fixtures_dir() / GetParam().name;
  for (const char* dtype : {"f32", "bf16"}) {
    SCOPED_TRACE(dtype);
    TestModel loaded = open_cpu_model(fixture / dtype);
    const Tensor logits = prompt_logits(*loaded.model, fixture_prompt(fixture), 0);
    const std::vector<double> errors = row_relative_errors(logits, read_npy(fixture / dtype / "ref_logits_f64.npy"));
    ASSERT_EQ(errors.size(), 300u);
    for (size_t row = 0; row < errors.size(); ++row) ASSERT_LE(errors[row], 1e-4) << "position " << row;
  }
}

TEST_P(MoeParity, GreedyContinuationMatchesFloat64Reference) {
  const auto fixture = fixtures_dir() / GetParam().name;
  TestModel loaded = open_cpu_model(fixture / "f32");
  expect_greedy_continuation_of_float64_reference(*loaded.model, fixture);
}

TEST_P(MoeParity, FusedAndMlxStackedExpertsGiveThePerExpertBits) {
  const auto fixture = fixtures_dir() / GetParam().name;
  const auto layers = GetParam().layers;  // plain copies: clang's lambdas capture no structured binding
  const auto experts = GetParam().experts;
  TempDir temp;
  const std::vector<int32_t> prompt = first_tokens(fixture, 40);
  TestModel per_expert = open_cpu_model(fixture / "bf16");
  const Tensor reference = prompt_logits(*per_expert.model, prompt, 0);
  const auto fused = edited_copy(fixture / "bf16", temp.path() / "fused", [&](Entries& entries) {
    restack_experts(entries, layers, experts,
                    [&](const Entries& all, const std::string& prefix) { return to_fused(all, prefix, experts); });
  });
  const auto mlx = edited_copy(fixture / "bf16", temp.path() / "mlx", [&](Entries& entries) {
    restack_experts(entries, layers, experts, [&](const Entries& all, const std::string& prefix) {
      return to_switch_mlp(all, prefix, experts, false);
    });
  });
  for (const auto& dir : {fused, mlx}) {
    TestModel restacked = open_cpu_model(dir);
    expect_bit_identical(reference, prompt_logits(*restacked.model, prompt, 0), dir.filename().string());
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, MoeParity,
                         ::testing::Values(MoeFixture{"qwen3-moe-tiny", 3, 8}, MoeFixture{"qwen3_5-moe-tiny", 4, 8}),
                         [](const auto& info) {
                           std::string name = info.param.name;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// The CPU backend, keeping the experts of every routing it computes.
class RecordingRoutesBackend final : public ForwardingCpuBackend {
 public:
  void moe_route(const Tensor& logits, const Tensor* shared_logits, bool normalize, Tensor& experts,
                 Tensor& weights) override {
    ForwardingCpuBackend::moe_route(logits, shared_logits, normalize, experts, weights);
    routes.push_back(download(experts));
  }
  std::vector<Tensor> routes;
};

// A step's weight bytes count, in each sparse layer, the union of the experts its tokens chose
// (counted by the backend as the step runs): one token reads its top k, what decode_weight_bytes()
// counts; a batch reads the union, which the test takes from the routes the backend computed.
TEST(MoeModel, WeightBytesReadCountTheUnionOfEachLayersExperts) {
  for (const char* fixture : {"qwen3-moe-tiny", "qwen3_5-moe-tiny"}) {
    SCOPED_TRACE(fixture);
    RecordingRoutesBackend backend;
    const std::unique_ptr<Model> model = load_model(fixtures_dir() / fixture / "f32", backend, LoadOptions{});
    const ModelConfig& config = model->config();
    const double expert_bytes = 3.0 * static_cast<double>(config.moe.expert_intermediate_size * config.hidden_size) *
                                static_cast<double>(sizeof(float));
    const std::vector<int32_t> prompt = first_tokens(fixtures_dir() / fixture, 24);
    auto cache = model->make_cache(3, 64);
    run_step(*model, *cache, {SequenceStep{0, 0, {prompt.begin(), prompt.begin() + 8}, false}});
    model->weight_bytes_read(0);
    backend.routes.clear();
    run_step(*model, *cache, {SequenceStep{0, 8, {prompt[8]}, false}});
    EXPECT_EQ(model->weight_bytes_read(1), static_cast<double>(model->decode_weight_bytes()));
    backend.routes.clear();
    std::vector<SequenceStep> batch;
    for (int32_t slot = 1; slot < 3; ++slot)
      batch.push_back({slot, 0, {prompt.begin() + 8 * slot, prompt.begin() + 8 * slot + 8}, false});
    run_step(*model, *cache, batch);
    double expected = static_cast<double>(model->decode_weight_bytes());
    ASSERT_FALSE(backend.routes.empty());
    for (const Tensor& route : backend.routes) {
      const std::set<int32_t> used(route.data<int32_t>(), route.data<int32_t>() + route.numel());
      expected += expert_bytes * static_cast<double>(static_cast<int64_t>(used.size()) - config.moe.experts_per_token);
    }
    EXPECT_EQ(model->weight_bytes_read(1), expected);
  }
}

TEST(MoeModel, QuantizedExpertsPerExpertAndStackedGiveTheSameBits) {
  // 8-bit groups of 32: the experts' gate/up ([48, 64]) quantize; their down_proj (48 inputs) stays
  // dense, recorded as such, as mlx_lm leaves a matrix its group size does not divide.
  TempDir temp;
  const auto fixture = fixtures_dir() / "qwen3-moe-tiny";
  QuantizeOptions options;
  options.model = fixture / "f32";
  options.out = temp.path() / "q8";
  options.scheme = {8, 32};
  quantize_checkpoint(options);
  const std::vector<int32_t> prompt = first_tokens(fixture, 40);
  TestModel quantized = open_cpu_model(options.out);
  const Tensor per_expert = prompt_logits(*quantized.model, prompt, 0);
  // The same model with every quantized matrix decoded and stored as f32: the quantized matmul is
  // bit-identical to the dense one of the decoded weights (core/weight.h), routing included.
  const auto decoded_dir = edited_copy(options.out, temp.path() / "decoded", [](Entries& entries) {
    Entries decoded;
    for (const SafetensorsEntry& scales : entries) {
      if (!scales.name.ends_with(".scales")) continue;
      const std::string module = scales.name.substr(0, scales.name.size() - std::string(".scales").size());
      auto tensor_of = [&](const std::string& name) {
        const SafetensorsEntry& stored = entry(entries, name);
        Tensor tensor = Tensor::empty(stored.shape, stored.dtype);
        std::memcpy(tensor.raw(), stored.bytes.data(), stored.bytes.size());
        return tensor;
      };
      const Weight weight = Weight::affine(tensor_of(module + ".weight"), tensor_of(module + ".scales"),
                                           tensor_of(module + ".biases"), 8, 32);
      std::vector<float> values(static_cast<size_t>(weight.dim(0) * weight.dim(1)));
      decode_rows(weight, 0, weight.dim(0), values.data());
      const auto* bytes = reinterpret_cast<const uint8_t*>(values.data());
      decoded.push_back({module + ".weight", DType::F32, weight.shape(), {bytes, bytes + values.size() * 4}, {}});
    }
    for (const SafetensorsEntry& matrix : decoded) {
      const std::string module = matrix.name.substr(0, matrix.name.size() - std::string(".weight").size());
      std::erase_if(entries, [&](const SafetensorsEntry& e) { return e.name.starts_with(module + "."); });
    }
    for (SafetensorsEntry& matrix : decoded) entries.push_back(std::move(matrix));
  }, [](nlohmann::json& config) {
    config.erase("quantization");
    config.erase("quantization_config");
  });
  expect_bit_identical(per_expert, prompt_logits(*open_cpu_model(decoded_dir).model, prompt, 0), "decoded weights");

  const auto stacked_dir = edited_copy(options.out, temp.path() / "q8-stacked", [&](Entries& entries) {
    restack_experts(entries, 3, 8, [&](const Entries& all, const std::string& prefix) {
      return to_switch_mlp(all, prefix, 8, true);
    });
  }, [](nlohmann::json& config) {
    // mlx-lm's per-module entries name the stacked module.
    for (const char* key : {"quantization", "quantization_config"})
      for (auto it = config[key].begin(); it != config[key].end();) {
        const std::string module = it.key();
        if (module.find(".mlp.experts.") == std::string::npos) {
          ++it;
          continue;
        }
        const size_t experts = module.find("experts.");
        const std::string stacked = module.substr(0, experts) + "switch_mlp." +
                                    module.substr(module.find('.', experts + std::string("experts.").size()) + 1);
        config[key][stacked] = it.value();
        it = config[key].erase(it);
      }
  });
  TestModel restacked = open_cpu_model(stacked_dir);
  expect_bit_identical(per_expert, prompt_logits(*restacked.model, prompt, 0), "switch_mlp stacks");
}

TEST(MoeRouting, SoftmaxTopKRenormalisedAscendingByExpert) {
  const float logits[] = {0.5f, 2.0f, -1.0f, 1.5f, 2.0f};
  const TokenRoute route = route_token(logits, 5, 3, true);
  // Experts 1 and 4 tie at the top; 3 is next. Returned ascending by id.
  EXPECT_EQ(route.experts, (std::vector<int32_t>{1, 3, 4}));
  double total = 0;
  for (float w : route.weights) total += w;
  EXPECT_NEAR(total, 1.0, 1e-6);
  EXPECT_EQ(route.weights[0], route.weights[2]);
  const TokenRoute raw = route_token(logits, 5, 3, false);
  EXPECT_LT(raw.weights[0] + raw.weights[1] + raw.weights[2], 1.0f);
  EXPECT_GT(raw.weights[0], raw.weights[1]);
}

TEST(MoeRouting, TiesGoToTheLowerExpertId) {
  const float logits[] = {1.0f, 1.0f, 1.0f, 1.0f};
  EXPECT_EQ(route_token(logits, 4, 2, true).experts, (std::vector<int32_t>{0, 1}));
  // A tie across the k-th place: experts 1 and 3 share the second probability.
  const float boundary[] = {3.0f, 2.0f, -1.0f, 2.0f, 0.5f};
  EXPECT_EQ(route_token(boundary, 5, 2, true).experts, (std::vector<int32_t>{0, 1}));
  // Probabilities that underflow to zero tie too.
  const float far[] = {0.0f, -200.0f, -300.0f, -250.0f};
  const TokenRoute route = route_token(far, 4, 3, false);
  EXPECT_EQ(route.experts, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(route.weights, (std::vector<float>{1.0f, 0.0f, 0.0f}));
}

// The exponential every backend's routing uses (backend/moe_routing.h) is within about an ulp of
// e^x, and exact where e^x is: e^0 = 1, the underflow to zero and the overflow to infinity.
TEST(MoeRouting, ItsExponentialIsWithinAnUlpOfExp) {
  EXPECT_EQ(routing::exponential(0.0f), 1.0f);
  EXPECT_EQ(routing::exponential(-0.0f), 1.0f);
  EXPECT_EQ(routing::exponential(-104.5f), 0.0f);
  EXPECT_GT(routing::exponential(-103.0f), 0.0f);  // a subnormal
  EXPECT_TRUE(std::isinf(routing::exponential(89.0f)));
  EXPECT_TRUE(std::isnan(routing::exponential(std::nanf(""))));
  EXPECT_EQ(routing::sigmoid(-200.0f), 0.0f);
  EXPECT_EQ(routing::sigmoid(200.0f), 1.0f);
  double worst = 0;
  for (float x = -87.0f; x < 88.5f; x += 0.01171875f) {
    const double truth = std::exp(static_cast<double>(x));
    const float rounded = static_cast<float>(truth);
    const double ulp = std::nextafter(rounded, INFINITY) - rounded;
    worst = std::max(worst, std::fabs(routing::exponential(x) - truth) / ulp);
  }
  EXPECT_LT(worst, 1.5);
}

// Planning alone (no weight byte read) must refuse it.
void expect_plan_refused(const std::filesystem::path& dir, const std::vector<std::string>& fragments) {
  expect_error_mentions([&] { plan_model(dir, Device::CPU, true); }, fragments);
}

void remove_tensor(Entries& entries, const std::string& name) {
  std::erase_if(entries, [&](const SafetensorsEntry& e) { return e.name == name; });
}

TEST(MoeCheckpoint, AMissingExpertIsRefusedNamingTheLayerAndTensor) {
  TempDir temp;
  const auto dir = edited_copy(fixtures_dir() / "qwen3-moe-tiny" / "bf16", temp.path() / "m", [](Entries& entries) {
    remove_tensor(entries, "model.layers.2.mlp.experts.5.up_proj.weight");
  });
  expect_plan_refused(dir, {"layer 2", "model.layers.2.mlp.experts.5.up_proj.weight", "expert 5 of 8"});
}

TEST(MoeCheckpoint, AnExpertBeyondNumExpertsIsRefused) {
  TempDir temp;
  const auto dir = edited_copy(fixtures_dir() / "qwen3-moe-tiny" / "bf16", temp.path() / "m", [](Entries& entries) {
    SafetensorsEntry extra = entry(entries, "model.layers.0.mlp.experts.7.gate_proj.weight");
    extra.name = "model.layers.0.mlp.experts.8.gate_proj.weight";
    entries.push_back(extra);
  });
  expect_plan_refused(dir, {"model.layers.0.mlp.experts.8.gate_proj.weight", "expert 8 of layer 0",
                            "beyond num_experts 8"});
}

TEST(MoeCheckpoint, MixedLayoutsInALayerAreRefused) {
  TempDir temp;
  const auto dir = edited_copy(fixtures_dir() / "qwen3-moe-tiny" / "bf16", temp.path() / "m", [](Entries& entries) {
    for (SafetensorsEntry& fused : to_fused(entries, "model.layers.0.mlp.", 8)) entries.push_back(fused);
  });
  expect_plan_refused(dir, {"layer 0 mixes expert layouts", "model.layers.0.mlp.experts.down_proj"});
}

TEST(MoeCheckpoint, ARouterOfTheWrongWidthIsRefusedNamingTheTensor) {
  TempDir temp;
  const auto dir = edited_copy(fixtures_dir() / "qwen3-moe-tiny" / "bf16", temp.path() / "m", [](Entries& entries) {
    for (SafetensorsEntry& e : entries)
      if (e.name == "model.layers.0.mlp.gate.weight") {
        e.shape = {6, 64};
        e.bytes.resize(6 * 64 * 2);
      }
  });
  expect_plan_refused(dir, {"model.layers.0.mlp.gate.weight", "layer 0's router has shape [6, 64]",
                            "expected [8, 64]"});
}

TEST(MoeCheckpoint, AMisshapenFusedTensorIsRefused) {
  TempDir temp;
  const auto dir = edited_copy(fixtures_dir() / "qwen3-moe-tiny" / "bf16", temp.path() / "m", [](Entries& entries) {
    Entries fused = to_fused(entries, "model.layers.0.mlp.", 8);
    fused[0].shape[1] = 48;  // gate rows only
    fused[0].bytes.resize(static_cast<size_t>(8 * 48 * 64 * 2));
    std::erase_if(entries, [](const SafetensorsEntry& e) { return e.name.starts_with("model.layers.0.mlp.experts."); });
    for (SafetensorsEntry& e : fused) entries.push_back(e);
  });
  expect_plan_refused(dir, {"model.layers.0.mlp.experts.gate_up_proj", "[8, 48, 64]", "[8, 96, 64]"});
}

ModelConfig qwen3_moe_config(const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json config =
      nlohmann::json::parse(std::ifstream(fixtures_dir() / "qwen3-moe-tiny" / "bf16/config.json"));
  edit(config);
  return parse_model_config(config, "config.json");
}

TEST(MoeConfig, FieldsAndSparseLayersFollowTransformers) {
  const ModelConfig fixture = qwen3_moe_config([](nlohmann::json&) {});
  EXPECT_EQ(fixture.moe.experts, 8);  // saved as num_local_experts by transformers v5
  EXPECT_EQ(fixture.moe.experts_per_token, 2);
  EXPECT_EQ(fixture.moe.expert_intermediate_size, 48);
  EXPECT_TRUE(fixture.moe.normalize_top_k);
  EXPECT_EQ(fixture.moe.sparse_layers, (std::vector<bool>{true, false, true}));  // mlp_only_layers [1]
  const ModelConfig stepped = qwen3_moe_config([](nlohmann::json& c) {
    c.erase("mlp_only_layers");
    c["decoder_sparse_step"] = 2;
  });
  EXPECT_EQ(stepped.moe.sparse_layers, (std::vector<bool>{false, true, false}));
  const ModelConfig dense = qwen3_moe_config([](nlohmann::json& c) { c["num_local_experts"] = 0; });
  EXPECT_EQ(dense.moe.experts, 0);
  EXPECT_EQ(graph_shaping_fields(dense).count("moe.experts"), 0u);
  EXPECT_EQ(graph_shaping_fields(fixture).at("moe.experts"), 8);
}

TEST(MoeConfig, BadFieldsAreRefusedNamingThem) {
  expect_error_mentions([] { qwen3_moe_config([](nlohmann::json& c) { c["num_experts_per_tok"] = 9; }); },
                        {"field 'num_experts_per_tok'", "is 9, more than the 8 experts"});
  expect_error_mentions([] { qwen3_moe_config([](nlohmann::json& c) { c["mlp_only_layers"] = {3}; }); },
                        {"field 'mlp_only_layers'", "holds 3"});
  expect_error_mentions([] { qwen3_moe_config([](nlohmann::json& c) { c["num_experts"] = 4; }); },
                        {"field 'num_local_experts'", "is 8 but num_experts is 4"});
  expect_error_mentions([] { qwen3_moe_config([](nlohmann::json& c) { c["num_local_experts"] = -1; }); },
                        {"field 'num_local_experts'", "below 0"});
}

}  // namespace
