// The registry of engine-owned model implementations, and the strict selection that binds a
// resolved profile to exactly one of them.
//
// Implementations are registered per (id, backend); the default id of a graph's implementation
// is the graph's name. Selection never substitutes: a profile gets the implementation it names
// (or its graph's default) on the backend it runs on, or an error — never another implementation,
// never the same graph on another backend. The registry is immutable; with() returns a new one,
// and a selected implementation is shared, so models built from it keep their binding whatever
// happens to the registry afterwards.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "io/config.h"
#include "model/model.h"
#include "model/profile.h"
#include "model/tensor_parallel_rank.h"

namespace kiln {

class WeightMap;

struct ModelImplementation {
  // Builds the model. The weights are borrowed: the implementation takes the tensors it needs
  // from them and must not keep the map itself. A construction that fails must release
  // everything it allocated (RAII: it owns nothing through raw pointers).
  using Factory = std::function<std::unique_ptr<Model>(WeightMap& weights, const ModelConfig& config,
                                                       const ResolvedProfile& profile, Backend& backend)>;

  std::string id;
  Graph graph;
  Loader loader = Loader::Safetensors;
  Loop loop = Loop::Autoregressive;
  Device backend = Device::CPU;
  Factory create;
  // How the graph splits over tensor-parallel ranks; unsupported (empty) for graphs that cannot.
  TensorParallelSupport tensor_parallel = {};
};

// Fails, naming the profile, unless `implementation` is the one `profile` declares on `device`: its
// id (the named implementation, or the graph's default), its backend, graph, loader and loop.
// Selection checks it, and so does the construction seam (build_model), so a plan whose
// implementation was swapped after selection is refused where the model is built.
void check_implementation_binding(const ModelImplementation& implementation, const ModelProfile& profile,
                                  Device device);

class ImplementationRegistry {
 public:
  ImplementationRegistry() = default;
  // Fails on an empty id, no declared graph, a missing factory, a duplicate (id, backend), or a loader
  // or loop that is not legal for the graph.
  explicit ImplementationRegistry(std::vector<ModelImplementation> implementations);

  // A new registry holding these implementations and `more`; this one is unchanged.
  ImplementationRegistry with(std::vector<ModelImplementation> more) const;

  // Re-validates the resolved profile against `config` (check_resolved_profile) and returns the
  // implementation the profile declares for `device`, or fails naming the profile and what is
  // missing or incompatible.
  std::shared_ptr<const ModelImplementation> select(const ModelConfig& config, const ResolvedProfile& resolved,
                                                    Device device) const;

  // The graphs, loops and state kinds the implementations registered for `device` provide.
  std::set<Capability> capabilities(Device device) const;
  size_t size() const { return entries_.size(); }

 private:
  using Entries = std::map<std::pair<std::string, Device>, std::shared_ptr<const ModelImplementation>>;
  static ImplementationRegistry from_entries(Entries entries);

  Entries entries_;
};

// What this engine can run on `device`: the safetensors format, the backend itself when
// `backend_present`, and the graphs, loops and state kinds of the implementations registered for
// that device.
std::set<Capability> engine_capabilities(const ImplementationRegistry& registry, Device device, bool backend_present);

// The implementations kiln ships with (model/builtin.cpp), built once.
const ImplementationRegistry& builtin_registry();

}  // namespace kiln
