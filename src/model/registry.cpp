#include "model/registry.h"

#include <fmt/ranges.h>

#include "core/error.h"

namespace kiln {

ImplementationRegistry::ImplementationRegistry(std::vector<ModelImplementation> implementations) {
  for (auto& implementation : implementations) {
    const std::string id = implementation.id;
    if (id.find_first_not_of(" \t\r\n") == std::string::npos) fail("model implementation id must not be empty");
    if (!implementation.create) fail("model implementation {} has no factory", id);
    if (!implementation.graph.declared()) fail("model implementation {} names no graph that a family declares", id);
    if (!legal_loaders(implementation.graph).count(implementation.loader))
      fail("model implementation {} pairs graph {} with loader {}, which that graph cannot be loaded by", id,
           graph_name(implementation.graph), loader_name(implementation.loader));
    if (!legal_loops(implementation.graph).count(implementation.loop))
      fail("model implementation {} pairs graph {} with loop {}, which cannot run that graph", id,
           graph_name(implementation.graph), loop_name(implementation.loop));
    const Device backend = implementation.backend;
    auto shared = std::make_shared<const ModelImplementation>(std::move(implementation));
    if (!entries_.emplace(std::make_pair(id, backend), std::move(shared)).second)
      fail("duplicate model implementation {} on {}", id, device_name(backend));
  }
}

ImplementationRegistry ImplementationRegistry::from_entries(Entries entries) {
  ImplementationRegistry registry;
  registry.entries_ = std::move(entries);
  return registry;
}

ImplementationRegistry ImplementationRegistry::with(std::vector<ModelImplementation> more) const {
  // Validate the additions on their own, then merge: entries already here are shared, not copied,
  // so bindings handed out by this registry stay the same objects in the new one.
  ImplementationRegistry additions(std::move(more));
  auto merged = entries_;
  for (auto& [key, implementation] : additions.entries_)
    if (!merged.emplace(key, implementation).second)
      fail("duplicate model implementation {} on {}", key.first, device_name(key.second));
  return from_entries(std::move(merged));
}

void check_implementation_binding(const ModelImplementation& implementation, const ModelProfile& profile,
                                  Device device) {
  const std::string id = implementation_id(profile);
  if (implementation.id != id || implementation.backend != device)
    fail("model profile {} requires implementation {} on {}, but is bound to implementation {} on {}; refusing to "
         "fall back",
         profile.id(), id, device_name(device), implementation.id, device_name(implementation.backend));
  const ExecutionComposition& execution = profile.execution();
  if (implementation.graph != execution.graph || implementation.loader != execution.loader ||
      implementation.loop != execution.loop)
    fail("model implementation {} on {} (graph {}, loader {}, loop {}) is incompatible with model profile {} "
         "(graph {}, loader {}, loop {}); refusing to fall back",
         id, device_name(device), graph_name(implementation.graph), loader_name(implementation.loader),
         loop_name(implementation.loop), profile.id(), graph_name(execution.graph), loader_name(execution.loader),
         loop_name(execution.loop));
}

std::shared_ptr<const ModelImplementation> ImplementationRegistry::select(const ModelConfig& config,
                                                                          const ResolvedProfile& resolved,
                                                                          Device device) const {
  check_resolved_profile(config, resolved);
  const ModelProfile& profile = resolved.profile;
  const std::string id = implementation_id(profile);
  const auto found = entries_.find({id, device});
  if (found == entries_.end()) {
    std::vector<std::string_view> elsewhere;
    for (const auto& [key, implementation] : entries_)
      if (key.first == id) elsewhere.push_back(device_name(key.second));
    fail("model profile {} requires implementation {} on {}, which is not registered{}; refusing to fall back",
         profile.id(), id, device_name(device),
         elsewhere.empty() ? std::string() : fmt::format(" (it is registered on {})", fmt::join(elsewhere, ", ")));
  }
  check_implementation_binding(*found->second, profile, device);
  return found->second;
}

std::set<Capability> ImplementationRegistry::capabilities(Device device) const {
  std::set<Capability> provided;
  for (const auto& [key, implementation] : entries_) {
    if (key.second != device) continue;
    provided.insert(graph_capability(implementation->graph));
    provided.insert(loop_capability(implementation->loop));
    provided.merge(loop_state_capabilities(implementation->loop));
  }
  return provided;
}

std::set<Capability> engine_capabilities(const ImplementationRegistry& registry, Device device, bool backend_present) {
  // Safetensors is the one format kiln's loader reads, on every backend.
  std::set<Capability> engine = registry.capabilities(device);
  engine.insert(Capability::FormatSafetensors);
  if (backend_present) engine.insert(backend_capability(device));
  return engine;
}

}  // namespace kiln
