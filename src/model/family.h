// A model family, declared in one place: its family file (model/<family>.cpp) defines one
// FamilySpec, and model/builtin.cpp lists it. Everything else that knows about families reads the
// list: config.json parsing (the model_types and their rules), the config fingerprint (the fields
// that shape the graph), the profile ladder (one family profile per graph), the implementation
// registry (the graph on each backend, with its tensor-parallel split), the checkpoint sanitizers
// (the load plan) and `kiln synth` (the published shapes and the checkpoint layout).
//
// A FamilyList is validated once and immutable; it hands out the Graph handles profiles and
// implementations name, so the graph vocabulary is exactly the families' graphs.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "io/config.h"
#include "io/fingerprint.h"
#include "model/loader.h"
#include "model/model.h"
#include "model/profile.h"
#include "model/registry.h"
#include "model/synth.h"
#include "model/tensor_parallel_rank.h"

namespace kiln {

// Builds the family's graph over canonical weights (borrowed) on `backend`. With a rank of a
// tensor-parallel model it builds that rank's part over the weights its shard rule cut; an unsplit
// model is rank 0 of 1.
using GraphBuilder = std::function<std::unique_ptr<Model>(WeightMap& weights, const ModelConfig& config,
                                                          Backend& backend, const TensorParallelRank& rank)>;

// The graph on one backend.
struct BackendGraph {
  Device backend = Device::CPU;
  GraphBuilder build;
};

// How a graph splits over tensor-parallel ranks (model/tensor_parallel.h): the config check (naming
// the field and N) and the part of each canonical tensor a rank holds.
struct TensorParallelRule {
  std::function<void(const ModelConfig& config, int ranks)> check;
  std::function<TensorShard(const ModelConfig& config, const TensorParallelRank& rank, const std::string& canonical,
                            const Shape& shape)>
      shard;
};

// The tensors a Hugging Face checkpoint of a config holds, with their shapes.
using SynthLayout = std::function<std::vector<SynthTensor>(const ModelConfig& config)>;

struct FamilySpec {
  // The graph's name: its family profile is "<graph>-family", its implementations' id is the name,
  // its capability graph:<name>.
  std::string graph;
  // The loop that runs the graph (and the per-sequence state it keeps).
  Loop loop = Loop::Autoregressive;
  // What the family profile's reference-parity claim is checked against.
  std::string oracle;
  // config.json: the model_types the graph accepts, each with its configuration class's rules,
  // and the multimodal wrappers whose text model it serves.
  std::vector<ModelTypeRules> model_types;
  std::vector<ConfigWrapper> wrappers = {};
  // The fields beyond the common ones (io/fingerprint.h) that shape the graph.
  std::vector<GraphShapingField> graph_shaping_fields = {};
  // The load plan: an artifact's tensors onto the graph's canonical names.
  Sanitizer sanitize;
  // How the graph splits over tensor-parallel ranks; empty: it cannot.
  TensorParallelRule tensor_parallel = {};
  // The graph on each backend it runs on.
  std::vector<BackendGraph> backends;
  // `kiln synth`: the published configs of the family's models, the checkpoint layout it writes,
  // and the model_types whose checkpoints have that layout.
  std::vector<SynthShape> synth_shapes = {};
  SynthLayout synth_layout = {};
  std::vector<std::string> synth_model_types = {};
  // `kiln synth --mtp`: the multi-token-prediction head's tensors a checkpoint of a config holds
  // beside the model's (empty: the family has no such head).
  SynthLayout synth_mtp_layout = {};
};

class FamilyList {
 public:
  // Fails naming the family and what is wrong: a blank or repeated graph name, no model_type, a
  // model_type (or wrapper) that another family (or this one) already declares, a wrapper around
  // a model_type of another family, no oracle, no sanitizer, no backend or one listed twice or
  // without a builder, half a tensor-parallel rule, a synth layout without its model_types (or of a
  // model_type the family does not accept), an MTP synth layout without a synth layout, a synth
  // shape name or a graph-shaping field repeated.
  explicit FamilyList(std::vector<FamilySpec> specs);

  const std::vector<FamilySpec>& specs() const { return specs_; }
  // The family whose graph accepts `model_type` (a config's text model type), or null.
  const FamilySpec* find(std::string_view model_type) const;
  // The handle on a family's graph; fails naming `name` and the declared graphs.
  Graph graph(std::string_view name) const;
  // The model_types (not the wrappers) in list order, as errors list them.
  std::vector<std::string> model_types() const;
  // What parse_config accepts: every family's model_types with their rules, then the wrappers.
  const ConfigVocabulary& config_vocabulary() const { return vocabulary_; }

 private:
  std::vector<FamilySpec> specs_;
  std::vector<Graph> graphs_;  // one per spec, in the same order
  ConfigVocabulary vocabulary_;
};

// The families kiln ships with (model/builtin.cpp), validated once.
const FamilyList& builtin_families();
// The handle on a builtin graph, e.g. builtin_graph("llama").
Graph builtin_graph(std::string_view name);
// The model types the builtin families accept, in the order errors list them.
const std::vector<std::string>& supported_model_types();

// config.json through io/config with the families' model_types and rules.
ModelConfig parse_model_config(const nlohmann::json& config, const std::filesystem::path& source,
                               const FamilyList& families = builtin_families());
ModelConfig load_model_config(const std::filesystem::path& model_dir, const FamilyList& families = builtin_families());

// The graph-shaping fields of `config` (the common ones and its family's) and their fingerprint.
// Fail naming the config file when no family accepts its model_type.
nlohmann::json graph_shaping_fields(const ModelConfig& config, const FamilyList& families = builtin_families());
std::string config_fingerprint(const ModelConfig& config, const FamilyList& families = builtin_families());

// The tables the families are read into.
// The family ladder: one reference-parity profile per family, "<graph>-family", in list order.
ProfileTable family_profiles(const FamilyList& families);
// Each family's graph on each backend it declares (id: the graph's name), with its tensor-parallel
// support.
std::vector<ModelImplementation> family_implementations(const FamilyList& families);
// Each family's sanitizer, for its graph.
SanitizerTable family_sanitizers(const FamilyList& families);

}  // namespace kiln
