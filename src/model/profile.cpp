#include "model/profile.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <regex>

#include <fmt/ranges.h>

#include "core/error.h"
#include "io/fingerprint.h"
#include "model/family.h"

namespace kiln {

const std::string& Graph::name() const {
  static const std::string none = "?";
  return declaration_ ? declaration_->name : none;
}

const std::vector<std::string>& Graph::model_types() const {
  static const std::vector<std::string> none;
  return declaration_ ? declaration_->model_types : none;
}

std::string graph_name(const Graph& graph) { return graph.name(); }

std::string_view loader_name(Loader loader) {
  switch (loader) {
    case Loader::Safetensors: return "safetensors";
  }
  return "?";
}

std::string_view loop_name(Loop loop) {
  switch (loop) {
    case Loop::Autoregressive: return "autoregressive";
    case Loop::HybridRecurrent: return "hybrid_recurrent";
  }
  return "?";
}

std::string_view specialization_name(Specialization specialization) {
  switch (specialization) {
    case Specialization::Artifact: return "artifact";
    case Specialization::Dedicated: return "dedicated";
    case Specialization::Generic: return "generic";
  }
  return "?";
}

std::string capability_name(const Capability& capability) { return capability.name(); }

std::string_view fidelity_tier_name(FidelityTier tier) {
  switch (tier) {
    case FidelityTier::ReferenceParity: return "reference_parity";
    case FidelityTier::SelfConsistency: return "self_consistency";
    case FidelityTier::MeasuredOnly: return "measured_only";
  }
  return "?";
}

std::string_view device_name(Device device) {
  switch (device) {
    case Device::CPU: return "cpu";
    case Device::CUDA: return "cuda";
  }
  return "?";
}

const std::vector<std::string>& graph_model_types(const Graph& graph) { return graph.model_types(); }

bool graph_accepts(const Graph& graph, const ModelConfig& config) {
  const auto& types = graph.model_types();
  return std::find(types.begin(), types.end(), config.model_type) != types.end();
}

Capability graph_capability(const Graph& graph) { return Capability(Capability::Kind::Graph, "graph:" + graph.name()); }

Capability loop_capability(Loop loop) {
  switch (loop) {
    case Loop::Autoregressive: return Capability::LoopAutoregressive;
    case Loop::HybridRecurrent: return Capability::LoopHybridRecurrent;
  }
  fail("unknown loop {}", static_cast<int>(loop));
}

Capability loader_capability(Loader loader) {
  switch (loader) {
    case Loader::Safetensors: return Capability::FormatSafetensors;
  }
  fail("unknown loader {}", static_cast<int>(loader));
}

Capability backend_capability(Device device) {
  switch (device) {
    case Device::CPU: return Capability::BackendCpu;
    case Device::CUDA: return Capability::BackendCuda;
  }
  fail("unknown device {}", static_cast<int>(device));
}

std::set<Capability> loop_state_capabilities(Loop loop) {
  switch (loop) {
    case Loop::Autoregressive: return {Capability::StateKvCache};
    case Loop::HybridRecurrent: return {Capability::StateKvCache, Capability::StateRecurrent};
  }
  fail("unknown loop {}", static_cast<int>(loop));
}

std::set<Loader> legal_loaders(const Graph& graph) {
  // A family builds its graph with one loader; the checkpoint's conventions are its sanitizer's
  // business, not the loader's.
  if (!graph.declared()) return {};
  return {graph.declaration()->loader};
}

std::set<Loop> legal_loops(const Graph& graph) {
  // A family's graph runs in one loop: an attention-only graph keeps a KV cache alone; the hybrid
  // graph's linear layers also carry a recurrent state that an attention-only loop would neither
  // allocate nor reset.
  if (!graph.declared()) return {};
  return {graph.declaration()->loop};
}

std::string capability_list(const std::set<Capability>& capabilities) {
  std::string list;
  for (Capability capability : capabilities) {
    if (!list.empty()) list += ", ";
    list += capability_name(capability);
  }
  return list.empty() ? "none" : list;
}

std::set<Capability> execution_capabilities(const ExecutionComposition& execution) {
  std::set<Capability> implied = loop_state_capabilities(execution.loop);
  implied.insert(loader_capability(execution.loader));
  implied.insert(graph_capability(execution.graph));
  implied.insert(loop_capability(execution.loop));
  return implied;
}

namespace {

bool blank(const std::string& text) {
  return std::all_of(text.begin(), text.end(), [](unsigned char c) { return std::isspace(c); });
}

bool well_formed_artifact_fingerprint(const std::string& fingerprint) {
  // The two forms io/fingerprint produces: a Hugging Face snapshot or a content hash.
  static const std::regex pattern(R"(hf:([A-Za-z0-9_.-]+/)?[A-Za-z0-9_.-]+@[0-9a-f]{40}|sha256:[0-9a-f]{64})");
  return std::regex_match(fingerprint, pattern);
}

bool well_formed_config_fingerprint(const std::string& fingerprint) {
  static const std::regex pattern("sha256:[0-9a-f]{64}");
  return std::regex_match(fingerprint, pattern);
}

nlohmann::json optional_json(const std::optional<std::string>& value) {
  return value ? nlohmann::json(*value) : nlohmann::json(nullptr);
}

}  // namespace

void validate_profile(const ModelProfileSpec& spec) {
  if (blank(spec.id)) fail("model profile id must not be empty");
  const std::string& id = spec.id;
  const ExecutionComposition& execution = spec.execution;
  if (!execution.graph.declared())
    fail("model profile {} names no graph that a family declares (model/family.h)", id);

  if (spec.fidelity.tier != FidelityTier::MeasuredOnly && blank(spec.fidelity.oracle))
    fail("model profile {} claims {} fidelity but names no oracle", id, fidelity_tier_name(spec.fidelity.tier));

  if (spec.artifact_fingerprint.has_value() != spec.config_fingerprint.has_value())
    fail("model profile {} must declare artifact_fingerprint and config_fingerprint together (it has only {})", id,
         spec.artifact_fingerprint ? "artifact_fingerprint" : "config_fingerprint");
  if (spec.artifact_fingerprint && !well_formed_artifact_fingerprint(*spec.artifact_fingerprint))
    fail("model profile {} has a malformed artifact_fingerprint '{}' (expected hf:org/name@<40 hex> or sha256:<64 hex>)",
         id, *spec.artifact_fingerprint);
  if (spec.config_fingerprint && !well_formed_config_fingerprint(*spec.config_fingerprint))
    fail("model profile {} has a malformed config_fingerprint '{}' (expected sha256:<64 hex>)", id,
         *spec.config_fingerprint);

  const bool exact = spec.artifact_fingerprint.has_value();
  if (execution.specialization == Specialization::Artifact && !exact)
    fail("model profile {} declares artifact specialization but binds no artifact (artifact_fingerprint missing)", id);
  if (execution.implementation) {
    if (blank(*execution.implementation))
      fail("model profile {} names an empty implementation", id);
    if (!exact || execution.specialization != Specialization::Artifact)
      fail("model profile {} names implementation {} but must bind a named implementation to an exact artifact "
           "with artifact specialization (it has {}, specialization {})",
           id, *execution.implementation, exact ? "an exact artifact" : "no artifact_fingerprint",
           specialization_name(execution.specialization));
  }

  if (!legal_loaders(execution.graph).count(execution.loader))
    fail("model profile {} pairs graph {} with loader {}, which that graph cannot be loaded by", id,
         graph_name(execution.graph), loader_name(execution.loader));
  if (!legal_loops(execution.graph).count(execution.loop))
    fail("model profile {} pairs graph {} with loop {}, which cannot run that graph", id, graph_name(execution.graph),
         loop_name(execution.loop));

  for (Capability implied : execution_capabilities(execution))
    if (!spec.capabilities.count(implied))
      fail("model profile {} does not declare capability {}, which its execution (loader {}, graph {}, loop {}) "
           "requires",
           id, capability_name(implied), loader_name(execution.loader), graph_name(execution.graph),
           loop_name(execution.loop));
}

ModelProfile ModelProfile::build(ModelProfileSpec spec) {
  validate_profile(spec);
  return ModelProfile(std::move(spec));
}

nlohmann::json ModelProfile::to_json() const {
  nlohmann::json capabilities = nlohmann::json::array();
  for (Capability capability : spec_.capabilities) capabilities.push_back(capability_name(capability));
  const ExecutionComposition& execution = spec_.execution;
  return {
      {"id", spec_.id},
      {"fidelity", {{"tier", fidelity_tier_name(spec_.fidelity.tier)}, {"oracle", spec_.fidelity.oracle}}},
      {"capabilities", capabilities},
      {"execution",
       {{"loader", loader_name(execution.loader)},
        {"graph", graph_name(execution.graph)},
        {"loop", loop_name(execution.loop)},
        {"specialization", specialization_name(execution.specialization)},
        {"implementation", optional_json(execution.implementation)}}},
      {"artifact_fingerprint", optional_json(spec_.artifact_fingerprint)},
      {"config_fingerprint", optional_json(spec_.config_fingerprint)},
  };
}

std::string implementation_id(const ModelProfile& profile) {
  const ExecutionComposition& execution = profile.execution();
  if (execution.implementation) return *execution.implementation;
  const std::string graph(graph_name(execution.graph));
  return execution.specialization == Specialization::Generic ? graph + "-generic" : graph;
}

void require_engine_capabilities(const ModelProfile& profile, Device device, const std::set<Capability>& engine) {
  const Capability backend = backend_capability(device);
  if (!engine.count(backend))
    fail("model profile {} cannot run on {}: this engine lacks {} (it has: {})", profile.id(), device_name(device),
         capability_name(backend), capability_list(engine));
  for (Capability required : profile.capabilities()) {
    if (engine.count(required)) continue;
    if (required == Capability::BackendCpu || required == Capability::BackendCuda)
      fail("model profile {} requires {} but is asked to run on {}", profile.id(), capability_name(required),
           device_name(device));
    fail("model profile {} requires {}, which no implementation registered for {} provides (this engine has: {})",
         profile.id(), capability_name(required), device_name(device), capability_list(engine));
  }
}

ProfileTable::ProfileTable(std::vector<ModelProfile> exact, std::vector<ModelProfile> families)
    : exact_(std::move(exact)), families_(std::move(families)) {
  std::set<std::string> ids;
  std::map<std::string, std::string> artifacts;
  for (const auto& profile : exact_) {
    if (!profile.exact_artifact())
      fail("model profile {} is listed as exact-artifact but binds no artifact_fingerprint", profile.id());
    if (!ids.insert(profile.id()).second) fail("duplicate model profile {}", profile.id());
    auto [bound, inserted] = artifacts.emplace(*profile.artifact_fingerprint(), profile.id());
    if (!inserted)
      fail("model profiles {} and {} are both bound to artifact {}", bound->second, profile.id(),
           *profile.artifact_fingerprint());
  }
  for (const auto& profile : families_) {
    if (profile.exact_artifact())
      fail("model profile {} is listed as a family profile but is bound to artifact {}", profile.id(),
           *profile.artifact_fingerprint());
    if (!ids.insert(profile.id()).second) fail("duplicate model profile {}", profile.id());
  }
}

std::string ProfileTable::supported_families() const {
  std::string list;
  for (const auto& profile : families_) {
    if (!list.empty()) list += ", ";
    list += fmt::format("{} ({})", profile.id(), fmt::join(graph_model_types(profile.execution().graph), ", "));
  }
  return list.empty() ? "none" : list;
}

nlohmann::json ResolvedProfile::to_json() const {
  return {{"profile", profile.to_json()},
          {"config_fingerprint", config_fingerprint},
          {"artifact_fingerprint", optional_json(artifact_fingerprint)},
          {"exact_artifact", exact_artifact}};
}

ResolvedProfile resolve_profile(const ModelConfig& config, const std::optional<std::string>& artifact_fingerprint,
                                const ProfileTable& table) {
  const std::string config_file = config.source.string();
  const auto family = std::find_if(table.families().begin(), table.families().end(), [&](const ModelProfile& p) {
    return graph_accepts(p.execution().graph, config);
  });
  if (family == table.families().end())
    fail("{}: unsupported model_type '{}'; supported families: {}", config_file, config.model_type,
         table.supported_families());
  const std::string fingerprint = config_fingerprint(config);

  if (artifact_fingerprint) {
    for (const auto& profile : table.exact()) {
      if (profile.artifact_fingerprint() != artifact_fingerprint) continue;
      if (profile.config_fingerprint() != fingerprint)
        fail("model profile {} is bound to artifact {} with config fingerprint {}, but {} has {}; refusing to fall back",
             profile.id(), *artifact_fingerprint, *profile.config_fingerprint(), config_file, fingerprint);
      if (!graph_accepts(profile.execution().graph, config))
        fail("model profile {} selects graph {}, which does not accept model_type '{}' of {}; refusing to fall back",
             profile.id(), graph_name(profile.execution().graph), config.model_type, config_file);
      return ResolvedProfile{profile, fingerprint, artifact_fingerprint, true};
    }
  }
  return ResolvedProfile{*family, fingerprint, artifact_fingerprint, false};
}

void check_resolved_profile(const ModelConfig& config, const ResolvedProfile& resolved) {
  const ModelProfile& profile = resolved.profile;
  validate_profile(profile.spec());
  const std::string fingerprint = config_fingerprint(config);
  if (resolved.config_fingerprint != fingerprint)
    fail("model profile {} was resolved for config fingerprint {}, but {} has {}", profile.id(),
         resolved.config_fingerprint, config.source.string(), fingerprint);
  if (!graph_accepts(profile.execution().graph, config))
    fail("model profile {} selects graph {}, which does not accept model_type '{}' of {}", profile.id(),
         graph_name(profile.execution().graph), config.model_type, config.source.string());
  if (resolved.exact_artifact != profile.exact_artifact())
    fail("model profile {} is {}an exact-artifact profile but was resolved as {}", profile.id(),
         profile.exact_artifact() ? "" : "not ", resolved.exact_artifact ? "exact" : "not exact");
  if (resolved.exact_artifact &&
      (profile.artifact_fingerprint() != resolved.artifact_fingerprint || profile.config_fingerprint() != fingerprint))
    fail("model profile {} does not match artifact {} (it is bound to {} with config fingerprint {})", profile.id(),
         resolved.artifact_fingerprint.value_or("<unidentified>"), *profile.artifact_fingerprint(),
         *profile.config_fingerprint());
}

}  // namespace kiln
