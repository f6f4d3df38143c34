// Model profiles: how a model is constructed, declared as data and validated before any weight is
// read.
//
// A profile names the graph, the loader and the generation loop, the capabilities the engine must
// have, and the fidelity it claims. A family profile serves every artifact of a family; an
// exact-artifact profile is bound to one artifact (artifact + config fingerprints, always
// together) and may name the one implementation that must build it. Profiles are immutable once
// built and validated on construction; a resolved profile is validated again where the model is
// constructed (registry.h).
#pragma once

#include <compare>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/tensor.h"
#include "io/config.h"

namespace kiln {

// --- the vocabulary -----------------------------------------------------------------------------
//
// Loaders, loops, specialisations, fidelity tiers and the fixed capabilities are closed sets. The
// graphs are those kiln's families declare (model/family.h): a Graph is a handle on one family's
// declaration, handed out only by a validated FamilyList, so a profile names a declared graph or
// none (which validate_profile refuses, naming the profile).

enum class Loader { Safetensors };
// Autoregressive: attention only, per-sequence state is the KV cache. HybridRecurrent: KV cache
// for the attention layers plus the recurrent (conv + delta-rule) state of the linear layers.
enum class Loop { Autoregressive, HybridRecurrent };
// Artifact: specialised to one artifact. Dedicated: the family's hand-written graph. Generic: a
// graph assembled from generic parts.
enum class Specialization { Artifact, Dedicated, Generic };
// ReferenceParity: matches an external oracle's outputs within its tolerance. SelfConsistency:
// checked only against kiln itself (e.g. batched against single-sequence). MeasuredOnly: no
// numerical claim; speed and memory are measured.
enum class FidelityTier { ReferenceParity, SelfConsistency, MeasuredOnly };

// What a family declares about its graph.
struct GraphDeclaration {
  std::string name;                      // e.g. "qwen3_5"
  std::vector<std::string> model_types;  // the model_type values it accepts, in the order errors list them
  Loader loader = Loader::Safetensors;   // the one loader it is built with
  Loop loop = Loop::Autoregressive;      // the one loop that can run it
};

class FamilyList;

// A graph kiln implements (qwen2 and MiniCPM5, model_type llama, run on the llama graph;
// qwen3_next on the qwen3_5 graph). Graphs compare by name.
class Graph {
 public:
  Graph() = default;  // no graph
  bool declared() const { return declaration_ != nullptr; }
  const std::string& name() const;                      // "?" for no graph
  const std::vector<std::string>& model_types() const;  // none for no graph
  const GraphDeclaration* declaration() const { return declaration_.get(); }

  bool operator==(const Graph& other) const { return name() == other.name(); }
  auto operator<=>(const Graph& other) const { return name() <=> other.name(); }

 private:
  friend class FamilyList;
  explicit Graph(std::shared_ptr<const GraphDeclaration> declaration) : declaration_(std::move(declaration)) {}
  std::shared_ptr<const GraphDeclaration> declaration_;
};

// What an engine provides and a profile requires: a checkpoint format, a graph, a loop, the state a
// loop keeps, a backend. Ordered by kind in that order, then by name.
class Capability {
 public:
  static const Capability FormatSafetensors;
  static const Capability LoopAutoregressive;
  static const Capability LoopHybridRecurrent;
  static const Capability StateKvCache;
  static const Capability StateRecurrent;
  static const Capability BackendCpu;
  static const Capability BackendCuda;
  const std::string& name() const { return name_; }
  auto operator<=>(const Capability&) const = default;

 private:
  enum class Kind { Format, Graph, Loop, State, Backend };
  Capability(Kind kind, std::string name) : kind_(kind), name_(std::move(name)) {}
  friend Capability graph_capability(const Graph& graph);
  Kind kind_;
  std::string name_;
};
inline const Capability Capability::FormatSafetensors{Kind::Format, "format:safetensors"};
inline const Capability Capability::LoopAutoregressive{Kind::Loop, "loop:autoregressive"};
inline const Capability Capability::LoopHybridRecurrent{Kind::Loop, "loop:hybrid_recurrent"};
inline const Capability Capability::StateKvCache{Kind::State, "state:kv_cache"};
inline const Capability Capability::StateRecurrent{Kind::State, "state:recurrent"};
inline const Capability Capability::BackendCpu{Kind::Backend, "backend:cpu"};
inline const Capability Capability::BackendCuda{Kind::Backend, "backend:cuda"};

std::string graph_name(const Graph& graph);
std::string_view loader_name(Loader loader);
std::string_view loop_name(Loop loop);
std::string_view specialization_name(Specialization specialization);
std::string capability_name(const Capability& capability);  // e.g. "state:recurrent"
std::string_view fidelity_tier_name(FidelityTier tier);
std::string_view device_name(Device device);  // "cpu" | "cuda"

// The model_type values a graph accepts, in the order errors list them.
const std::vector<std::string>& graph_model_types(const Graph& graph);
bool graph_accepts(const Graph& graph, const ModelConfig& config);
// The capabilities that name a graph (graph:<name>), a loop, a loader's format, a backend.
Capability graph_capability(const Graph& graph);
Capability loop_capability(Loop loop);
Capability loader_capability(Loader loader);
Capability backend_capability(Device device);
// The per-sequence state a loop keeps (state:kv_cache, state:recurrent).
std::set<Capability> loop_state_capabilities(Loop loop);
// The loaders and loops a graph can be built and run with (none for no graph).
std::set<Loader> legal_loaders(const Graph& graph);
std::set<Loop> legal_loops(const Graph& graph);

// "a, b, c" of capability names.
std::string capability_list(const std::set<Capability>& capabilities);

// --- profiles -----------------------------------------------------------------------------------

struct FidelityClaim {
  FidelityTier tier = FidelityTier::MeasuredOnly;
  std::string oracle;  // what the outputs are checked against; empty only for MeasuredOnly
};

struct ExecutionComposition {
  Loader loader = Loader::Safetensors;
  Graph graph;
  Loop loop = Loop::Autoregressive;
  Specialization specialization = Specialization::Dedicated;
  // The engine-owned implementation that must build this artifact; only on an exact-artifact
  // profile with artifact specialisation. Absent: the default implementation of the graph.
  std::optional<std::string> implementation;
};

// Everything a profile declares, as plain data; ModelProfile::build validates and freezes it.
struct ModelProfileSpec {
  std::string id;
  FidelityClaim fidelity;
  std::set<Capability> capabilities;
  ExecutionComposition execution;
  std::optional<std::string> artifact_fingerprint;
  std::optional<std::string> config_fingerprint;
};

class ModelProfile {
 public:
  // Validates `spec` (validate_profile) and freezes it.
  static ModelProfile build(ModelProfileSpec spec);

  const std::string& id() const { return spec_.id; }
  const FidelityClaim& fidelity() const { return spec_.fidelity; }
  const std::set<Capability>& capabilities() const { return spec_.capabilities; }
  const ExecutionComposition& execution() const { return spec_.execution; }
  const std::optional<std::string>& artifact_fingerprint() const { return spec_.artifact_fingerprint; }
  const std::optional<std::string>& config_fingerprint() const { return spec_.config_fingerprint; }
  bool exact_artifact() const { return spec_.artifact_fingerprint.has_value(); }
  const ModelProfileSpec& spec() const { return spec_; }

  nlohmann::json to_json() const;

 private:
  explicit ModelProfile(ModelProfileSpec spec) : spec_(std::move(spec)) {}
  ModelProfileSpec spec_;
};

// The capabilities a profile's execution implies: its loader's format, its graph, its loop and
// the state that loop keeps.
std::set<Capability> execution_capabilities(const ExecutionComposition& execution);

// Every rule a profile obeys on its own; fails naming the profile and what is wrong:
// a non-empty id; a declared graph; an oracle unless the claim is measured-only; artifact and config fingerprints
// together and well-formed; artifact specialisation only with an exact artifact; a named
// implementation only on an exact-artifact profile with artifact specialisation; a loader and a
// loop legal for the graph; declared capabilities covering the execution's.
void validate_profile(const ModelProfileSpec& spec);

// The implementation id a profile asks for: the named one, else `<graph>-generic` for generic
// specialisation, else the graph's name.
std::string implementation_id(const ModelProfile& profile);

// Fails naming the profile and the first missing capability unless `engine` holds every
// capability the profile requires plus the backend it is asked to run on.
void require_engine_capabilities(const ModelProfile& profile, Device device, const std::set<Capability>& engine);

// --- resolution ---------------------------------------------------------------------------------

// The profiles resolution chooses from: exact-artifact profiles (matched by artifact
// fingerprint) and the ordered ladder of family profiles (the first whose graph accepts the
// config wins). Built once, validated, immutable.
class ProfileTable {
 public:
  ProfileTable(std::vector<ModelProfile> exact, std::vector<ModelProfile> families);

  const std::vector<ModelProfile>& exact() const { return exact_; }
  const std::vector<ModelProfile>& families() const { return families_; }
  // "llama (llama, qwen2), qwen3 (qwen3), …": the families and the model types each accepts.
  std::string supported_families() const;

 private:
  std::vector<ModelProfile> exact_;
  std::vector<ModelProfile> families_;
};

// The family ladder kiln ships with (one profile per family of builtin_families(), in its order:
// model/builtin.cpp) and no exact-artifact profiles.
const ProfileTable& builtin_profile_table();

struct ResolvedProfile {
  ModelProfile profile;
  std::string config_fingerprint;
  std::optional<std::string> artifact_fingerprint;
  bool exact_artifact = false;

  nlohmann::json to_json() const;
};

// Chooses the profile for `config` before any weight is read: the exact-artifact profile bound to
// `artifact_fingerprint` if there is one (failing, never falling back, when its config
// fingerprint differs or its graph rejects the config), else the first family profile whose graph
// accepts the config; an unknown model_type fails listing the supported families.
ResolvedProfile resolve_profile(const ModelConfig& config, const std::optional<std::string>& artifact_fingerprint,
                                const ProfileTable& table);

// The re-validation at the construction seam: the profile's own rules, its config fingerprint
// and graph against `config`, and its exact-artifact binding against the resolution.
void check_resolved_profile(const ModelConfig& config, const ResolvedProfile& resolved);

}  // namespace kiln
