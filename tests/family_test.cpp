// Model families: a spec declared once reaches every table read from the family list (config
// parsing, fingerprint, profile ladder, implementations, sanitizers, synth), and the list refuses
// specs that contradict each other.
#include <algorithm>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "io/safetensors_writer.h"
#include "model/family.h"
#include "model/llama.h"
#include "profile_support.h"
#include "test_support.h"

using namespace kiln;
using kiln::testing::tiny_config;
using nlohmann::json;

namespace {

// A family declared only here: the dense graph code under its own graph and model_type, with a
// family-only config field and a graph-shaping field of its own.
FamilySpec toy_family(std::string graph = "toy", std::string model_type = "toy_lm") {
  ModelTypeRules rules{.model_type = model_type, .qk_norm = true};
  rules.read_family_fields = [](const ConfigFields& text, ModelConfig& config) {
    config.linear_conv_kernel_dim = text.positive_integer("toy_kernel");
  };
  return {
      .graph = std::move(graph),
      .loop = Loop::Autoregressive,
      .oracle = "a toy oracle",
      .model_types = {rules},
      .wrappers = {{"toy_vl", model_type}},
      .graph_shaping_fields = {{"toy_kernel", [](const ModelConfig& c) { return c.linear_conv_kernel_dim; }}},
      .sanitize = [](const Checkpoint& checkpoint, const ModelConfig&, bool) { return identity_plan(checkpoint); },
      .tensor_parallel = {check_llama_tensor_parallel, llama_tensor_shard},
      .backends = {{Device::CPU, make_llama_model}, {Device::CUDA, make_llama_model}},
      .synth_layout = dense_decoder_synth_layout,
      .synth_model_types = {model_type},
  };
}

json toy_config_json() {
  return {{"model_type", "toy_lm"}, {"hidden_size", 64},  {"intermediate_size", 128}, {"num_hidden_layers", 2},
          {"num_attention_heads", 4}, {"vocab_size", 256}, {"max_position_embeddings", 512},
          {"rms_norm_eps", 1e-6},     {"rope_theta", 1e4}, {"toy_kernel", 3}};
}

bool has(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

}  // namespace

TEST(Family, ASpecDeclaredOnceReachesEveryTable) {
  const FamilyList families({toy_family()});

  // config.json: its model_type, its rules, its own fields and its wrapper.
  EXPECT_EQ(families.model_types(), std::vector<std::string>{"toy_lm"});
  const ModelConfig config = parse_model_config(toy_config_json(), "/toy/config.json", families);
  EXPECT_EQ(config.model_type, "toy_lm");
  EXPECT_TRUE(config.qk_norm);
  EXPECT_EQ(config.linear_conv_kernel_dim, 3);
  json missing = toy_config_json();
  missing.erase("toy_kernel");
  EXPECT_FAILS_MENTIONING(parse_model_config(missing, "/toy/config.json", families), "field 'toy_kernel'",
                          "is required");
  EXPECT_EQ(parse_model_config({{"model_type", "toy_vl"}, {"text_config", toy_config_json()}}, "/toy/config.json",
                               families)
                .outer_model_type,
            "toy_vl");
  json llama = toy_config_json();
  llama["model_type"] = "llama";
  EXPECT_FAILS_MENTIONING(parse_model_config(llama, "/toy/config.json", families), "'llama' is not supported",
                          "toy_lm, toy_vl (text_config toy_lm)");

  // The fingerprint hashes its graph-shaping field.
  const json fields = graph_shaping_fields(config, families);
  EXPECT_EQ(fields["toy_kernel"], 3);
  ModelConfig wider = config;
  wider.linear_conv_kernel_dim = 4;
  EXPECT_NE(config_fingerprint(wider, families), config_fingerprint(config, families));

  // The profile ladder: one family profile on its graph, with its loop and oracle.
  const ProfileTable profiles = family_profiles(families);
  ASSERT_EQ(profiles.families().size(), 1u);
  const ModelProfile& profile = profiles.families().front();
  EXPECT_EQ(profile.id(), "toy-family");
  EXPECT_EQ(profile.execution().graph, families.graph("toy"));
  EXPECT_EQ(profile.execution().loop, Loop::Autoregressive);
  EXPECT_EQ(profile.fidelity().oracle, "a toy oracle");
  EXPECT_TRUE(graph_accepts(profile.execution().graph, config));
  EXPECT_TRUE(profile.capabilities().count(graph_capability(families.graph("toy"))));
  EXPECT_EQ(profiles.supported_families(), "toy-family (toy_lm)");

  // Its implementations: the graph on the CPU and on CUDA, each splitting over ranks.
  const std::vector<ModelImplementation> implementations = family_implementations(families);
  ASSERT_EQ(implementations.size(), 2u);
  for (size_t index = 0; index < implementations.size(); ++index) {
    const ModelImplementation& implementation = implementations[index];
    EXPECT_EQ(implementation.id, "toy");
    EXPECT_EQ(implementation.graph, families.graph("toy"));
    EXPECT_EQ(implementation.backend, index == 0 ? Device::CPU : Device::CUDA);
    EXPECT_TRUE(implementation.create);
    EXPECT_TRUE(implementation.tensor_parallel.supported());
  }

  // Its sanitizer, found by the profile's graph.
  EXPECT_NO_THROW(family_sanitizers(families).for_profile(profile));
  EXPECT_FAILS_MENTIONING(family_sanitizers(families).for_profile(builtin_profile_table().families().front()),
                          "llama-family", "no checkpoint sanitizer");

  // Its synth layout.
  EXPECT_EQ(synth_tensor_layout(config, families).size(), dense_decoder_synth_layout(config).size());
  EXPECT_FAILS_MENTIONING(synth_tensor_layout(tiny_config("llama"), families), "no tensor layout", "llama",
                          "toy_lm");
}

TEST(Family, EveryBuiltinSpecReachesEveryTable) {
  const FamilyList& families = builtin_families();
  ASSERT_EQ(builtin_profile_table().families().size(), families.specs().size());
  for (size_t index = 0; index < families.specs().size(); ++index) {
    const FamilySpec& spec = families.specs()[index];
    SCOPED_TRACE(spec.graph);
    const Graph graph = builtin_graph(spec.graph);
    const ModelProfile& profile = builtin_profile_table().families()[index];
    EXPECT_EQ(profile.id(), spec.graph + "-family");
    EXPECT_EQ(profile.execution().graph, graph);
    EXPECT_NO_THROW(builtin_sanitizers().for_profile(profile));
    for (Device device : {Device::CPU, Device::CUDA})
      EXPECT_TRUE(builtin_registry().capabilities(device).count(graph_capability(graph))) << device_name(device);
    for (const ModelTypeRules& rules : spec.model_types) {
      EXPECT_TRUE(has(supported_model_types(), rules.model_type)) << rules.model_type;
      EXPECT_EQ(families.find(rules.model_type), &spec) << rules.model_type;
      const ModelConfig config = tiny_config(rules.model_type);
      EXPECT_TRUE(graph_accepts(graph, config)) << rules.model_type;
      // Every family field is hashed, but for those that do not apply to the config (null: a dense
      // model's MoE fields), which are left out.
      const json fields = graph_shaping_fields(config);
      size_t applying = 0;
      for (const GraphShapingField& field : spec.graph_shaping_fields) {
        const bool applies = !field.value(config).is_null();
        applying += applies;
        EXPECT_EQ(fields.contains(std::string(field.name)), applies) << field.name;
      }
      EXPECT_EQ(fields.size(), common_graph_shaping_fields().size() + applying);
    }
    for (const std::string& model_type : spec.synth_model_types)
      EXPECT_FALSE(synth_tensor_layout(tiny_config(model_type)).empty()) << model_type;
  }
}

TEST(Family, AModelTypeBelongsToOneFamily) {
  EXPECT_FAILS_MENTIONING(FamilyList({toy_family("toy"), toy_family("other")}), "model_type 'toy_lm'",
                          "model family toy", "again by other");
  // A wrapper's name is a model_type too.
  FamilySpec wrapping = toy_family("other", "other_lm");
  wrapping.wrappers = {{"toy_lm", "other_lm"}};
  EXPECT_FAILS_MENTIONING(FamilyList({toy_family(), wrapping}), "model_type 'toy_lm'", "again by other");
  // The builtin families and a new one that claims qwen2.
  std::vector<FamilySpec> specs = builtin_families().specs();
  specs.push_back(toy_family("qwen2_again", "qwen2"));
  EXPECT_FAILS_MENTIONING(FamilyList(std::move(specs)), "model_type 'qwen2'", "model family llama",
                          "again by qwen2_again");
}

TEST(Family, TheListRefusesIncompleteOrContradictorySpecs) {
  EXPECT_FAILS_MENTIONING(FamilyList({toy_family("toy", "a"), toy_family("toy", "b")}), "two model families",
                          "graph toy");
  FamilySpec no_sanitizer = toy_family();
  no_sanitizer.sanitize = nullptr;
  EXPECT_FAILS_MENTIONING(FamilyList({no_sanitizer}), "model family toy", "no checkpoint sanitizer");
  FamilySpec no_backend = toy_family();
  no_backend.backends.clear();
  EXPECT_FAILS_MENTIONING(FamilyList({no_backend}), "model family toy", "no backend");
  FamilySpec twice_on_cpu = toy_family();
  twice_on_cpu.backends.push_back({Device::CPU, make_llama_model});
  EXPECT_FAILS_MENTIONING(FamilyList({twice_on_cpu}), "model family toy", "backend cpu twice");
  FamilySpec foreign_wrapper = toy_family();
  foreign_wrapper.wrappers = {{"toy_vl", "llama"}};
  EXPECT_FAILS_MENTIONING(FamilyList({foreign_wrapper}), "model family toy", "'toy_vl' to 'llama'");
  FamilySpec common_field_again = toy_family();
  common_field_again.graph_shaping_fields.push_back(common_graph_shaping_fields().front());
  EXPECT_FAILS_MENTIONING(FamilyList({common_field_again}), "model family toy", "model_type", "twice");
  FamilySpec foreign_synth = toy_family();
  foreign_synth.synth_model_types = {"llama"};
  EXPECT_FAILS_MENTIONING(FamilyList({foreign_synth}), "model family toy", "'llama'", "does not accept");
  FamilySpec half_split = toy_family();
  half_split.tensor_parallel.shard = nullptr;
  EXPECT_FAILS_MENTIONING(FamilyList({half_split}), "model family toy", "half a tensor-parallel rule");
}

TEST(Family, TheGraphVocabularyIsTheFamilies) {
  EXPECT_EQ(builtin_graph("qwen3").name(), "qwen3");
  EXPECT_EQ(builtin_graph("qwen3_5").model_types(), (std::vector<std::string>{"qwen3_5_text", "qwen3_next"}));
  EXPECT_FAILS_MENTIONING(builtin_graph("mamba"), "no model family declares graph 'mamba'",
                          "llama, qwen3, qwen3_moe, qwen3_5, qwen3_5_moe");
  // A profile naming no declared graph is refused, naming the profile.
  ModelProfileSpec spec = kiln::testing::family_spec("graphless");
  spec.execution.graph = Graph();
  EXPECT_FAILS_MENTIONING(ModelProfile::build(spec), "model profile graphless", "names no graph");
}

// The Qwen2 bias rule lives in its ModelTypeRules alone: with attention_bias set, a Llama or Qwen3
// checkpoint biases all four attention projections and a Qwen2 one q/k/v only (transformers'
// LlamaAttention, Qwen3Attention, Qwen2Attention), and the graph takes exactly what synth writes.
TEST(Family, TheGraphTakesTheBiasesItsModelTypeDeclares) {
  auto backend = make_cpu_backend();
  for (const char* model_type : {"llama", "qwen2", "qwen3"}) {
    SCOPED_TRACE(model_type);
    json config_json = toy_config_json();
    config_json.erase("toy_kernel");
    config_json["model_type"] = model_type;
    config_json["head_dim"] = 16;
    config_json["attention_bias"] = true;
    kiln::testing::TempDir dir;
    std::ofstream(dir.path() / "config.json") << config_json.dump();
    const ModelConfig config = load_model_config(dir.path());
    std::vector<SafetensorsEntry> entries;
    bool output_bias = false;
    for (const SynthTensor& tensor : dense_decoder_synth_layout(config)) {
      SafetensorsEntry entry;
      entry.name = tensor.name;
      entry.shape = tensor.shape;
      entry.bytes.assign(entry.nbytes(), 0);
      entries.push_back(std::move(entry));
      output_bias = output_bias || tensor.name.ends_with("o_proj.bias");
    }
    EXPECT_EQ(output_bias, std::string(model_type) != "qwen2");
    write_safetensors(dir.path() / "model.safetensors", entries);
    EXPECT_NO_THROW(load_model(dir.path(), *backend));
  }
}
