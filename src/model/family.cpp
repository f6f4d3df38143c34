#include "model/family.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <set>

#include <fmt/ranges.h>

#include "core/error.h"

namespace kiln {
namespace {

bool blank(const std::string& text) {
  return std::all_of(text.begin(), text.end(), [](unsigned char c) { return std::isspace(c); });
}

bool contains(const std::vector<std::string>& names, std::string_view name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

void check_spec(const FamilySpec& spec, const std::set<std::string>& common_fields) {
  const std::string& family = spec.graph;
  if (spec.model_types.empty()) fail("model family {} accepts no model_type", family);
  std::vector<std::string> accepted;
  for (const ModelTypeRules& rules : spec.model_types) accepted.push_back(rules.model_type);
  for (const ConfigWrapper& wrapper : spec.wrappers)
    if (!contains(accepted, wrapper.text_model_type))
      fail("model family {} unwraps model_type '{}' to '{}', which it does not accept", family, wrapper.model_type,
           wrapper.text_model_type);
  if (blank(spec.oracle)) fail("model family {} names no oracle for its reference-parity claim", family);
  if (!spec.sanitize) fail("model family {} has no checkpoint sanitizer", family);
  if (static_cast<bool>(spec.tensor_parallel.check) != static_cast<bool>(spec.tensor_parallel.shard))
    fail("model family {} gives half a tensor-parallel rule (a config check and a shard rule come together)", family);
  if (spec.backends.empty()) fail("model family {} runs on no backend", family);
  std::set<Device> devices;
  for (const BackendGraph& backend : spec.backends) {
    if (!backend.build) fail("model family {} lists {} without a graph builder", family, device_name(backend.backend));
    if (!devices.insert(backend.backend).second)
      fail("model family {} lists backend {} twice", family, device_name(backend.backend));
  }
  if (static_cast<bool>(spec.synth_layout) == spec.synth_model_types.empty())
    fail("model family {} must give a synth layout and the model_types it writes together", family);
  for (const std::string& model_type : spec.synth_model_types)
    if (!contains(accepted, model_type))
      fail("model family {} writes synth checkpoints of model_type '{}', which it does not accept", family, model_type);
  if (spec.synth_mtp_layout && !spec.synth_layout)
    fail("model family {} gives a synth MTP layout but no synth layout for the model itself", family);
  std::set<std::string_view> fields;
  for (const GraphShapingField& field : spec.graph_shaping_fields) {
    if (!field.value) fail("model family {} reads graph-shaping field {} from nothing", family, field.name);
    if (common_fields.count(std::string(field.name)) || !fields.insert(field.name).second)
      fail("model family {} lists graph-shaping field {} twice (or a common one again)", family, field.name);
  }
}

}  // namespace

FamilyList::FamilyList(std::vector<FamilySpec> specs) : specs_(std::move(specs)) {
  std::set<std::string> common_fields;
  for (const GraphShapingField& field : common_graph_shaping_fields()) common_fields.emplace(field.name);
  std::map<std::string, std::string> declared_by;  // model_type or wrapper → the family declaring it
  std::set<std::string> synth_shapes;
  for (const FamilySpec& spec : specs_) {
    if (blank(spec.graph)) fail("a model family has no graph name");
    for (const Graph& graph : graphs_)
      if (graph.name() == spec.graph) fail("two model families declare graph {}", spec.graph);
    check_spec(spec, common_fields);
    auto declare = [&](const std::string& model_type) {
      if (blank(model_type)) fail("model family {} declares a blank model_type", spec.graph);
      const auto [found, inserted] = declared_by.emplace(model_type, spec.graph);
      if (!inserted)
        fail("model_type '{}' is declared by model family {} and again by {}", model_type, found->second,
             spec.graph);
    };
    for (const ModelTypeRules& rules : spec.model_types) declare(rules.model_type);
    for (const ConfigWrapper& wrapper : spec.wrappers) declare(wrapper.model_type);
    for (const SynthShape& shape : spec.synth_shapes)
      if (!synth_shapes.insert(shape.name).second)
        fail("model family {} lists synth shape {}, which another shape already names", spec.graph, shape.name);

    GraphDeclaration declaration{spec.graph, {}, Loader::Safetensors, spec.loop};
    for (const ModelTypeRules& rules : spec.model_types) declaration.model_types.push_back(rules.model_type);
    graphs_.push_back(Graph(std::make_shared<const GraphDeclaration>(std::move(declaration))));
    vocabulary_.model_types.insert(vocabulary_.model_types.end(), spec.model_types.begin(), spec.model_types.end());
    vocabulary_.wrappers.insert(vocabulary_.wrappers.end(), spec.wrappers.begin(), spec.wrappers.end());
  }
}

const FamilySpec* FamilyList::find(std::string_view model_type) const {
  for (const FamilySpec& spec : specs_)
    for (const ModelTypeRules& rules : spec.model_types)
      if (rules.model_type == model_type) return &spec;
  return nullptr;
}

Graph FamilyList::graph(std::string_view name) const {
  std::vector<std::string> names;
  for (const Graph& graph : graphs_) {
    if (graph.name() == name) return graph;
    names.push_back(graph.name());
  }
  fail("no model family declares graph '{}' (declared: {})", name, fmt::join(names, ", "));
}

std::vector<std::string> FamilyList::model_types() const {
  std::vector<std::string> names;
  for (const ModelTypeRules& rules : vocabulary_.model_types) names.push_back(rules.model_type);
  return names;
}

Graph builtin_graph(std::string_view name) { return builtin_families().graph(name); }

const std::vector<std::string>& supported_model_types() {
  static const std::vector<std::string> names = builtin_families().model_types();
  return names;
}

ModelConfig parse_model_config(const nlohmann::json& config, const std::filesystem::path& source,
                               const FamilyList& families) {
  return parse_config(config, source, families.config_vocabulary());
}

ModelConfig load_model_config(const std::filesystem::path& model_dir, const FamilyList& families) {
  return load_config(model_dir, families.config_vocabulary());
}

nlohmann::json graph_shaping_fields(const ModelConfig& config, const FamilyList& families) {
  const FamilySpec* family = families.find(config.model_type);
  if (!family)
    fail("{}: model_type '{}' has no documented list of graph-shaping fields to fingerprint", config.source.string(),
         config.model_type);
  return graph_shaping_fields(config, family->graph_shaping_fields);
}

std::string config_fingerprint(const ModelConfig& config, const FamilyList& families) {
  const FamilySpec* family = families.find(config.model_type);
  if (!family)
    fail("{}: model_type '{}' has no documented list of graph-shaping fields to fingerprint", config.source.string(),
         config.model_type);
  return config_fingerprint(config, family->graph_shaping_fields);
}

ProfileTable family_profiles(const FamilyList& families) {
  std::vector<ModelProfile> ladder;
  for (const FamilySpec& spec : families.specs()) {
    ModelProfileSpec profile;
    profile.id = spec.graph + "-family";
    profile.fidelity = {FidelityTier::ReferenceParity, spec.oracle};
    profile.execution = {Loader::Safetensors, families.graph(spec.graph), spec.loop, Specialization::Dedicated,
                         std::nullopt};
    profile.capabilities = execution_capabilities(profile.execution);
    ladder.push_back(ModelProfile::build(std::move(profile)));
  }
  return ProfileTable({}, std::move(ladder));
}

std::vector<ModelImplementation> family_implementations(const FamilyList& families) {
  std::vector<ModelImplementation> implementations;
  for (const FamilySpec& spec : families.specs()) {
    for (const BackendGraph& backend : spec.backends) {
      const GraphBuilder build = backend.build;
      ModelImplementation implementation{
          spec.graph, families.graph(spec.graph), Loader::Safetensors, spec.loop, backend.backend,
          [build](WeightMap& weights, const ModelConfig& config, const ResolvedProfile&, Backend& device) {
            return build(weights, config, device, TensorParallelRank{});
          }};
      if (spec.tensor_parallel.check)
        implementation.tensor_parallel = {spec.tensor_parallel.check, spec.tensor_parallel.shard,
                                          [build](WeightMap& weights, const ModelConfig& config, const ResolvedProfile&,
                                                  Backend& device, const TensorParallelRank& rank) {
                                            return build(weights, config, device, rank);
                                          }};
      implementations.push_back(std::move(implementation));
    }
  }
  return implementations;
}

SanitizerTable family_sanitizers(const FamilyList& families) {
  std::map<Graph, Sanitizer> sanitizers;
  for (const FamilySpec& spec : families.specs()) sanitizers.emplace(families.graph(spec.graph), spec.sanitize);
  return SanitizerTable(std::move(sanitizers));
}

}  // namespace kiln
