// The one path that builds a model from a folder: config → fingerprints → profile resolution →
// engine capabilities → implementation selection → checkpoint → the family's load plan → weights
// → construction. Everything up to the load plan reads no weight byte (plan_model, which
// `kiln inspect` shows); load_model then materialises the weights and constructs the model.
#pragma once

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>

#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "core/dtype.h"
#include "io/config.h"
#include "io/safetensors.h"
#include "model/load_plan.h"
#include "model/model.h"
#include "model/profile.h"
#include "model/registry.h"

namespace kiln {

// Maps a family's checkpoint conventions onto its graph's canonical names, from tensor names and
// shapes alone. With `keep_mtp` the plan keeps the checkpoint's multi-token-prediction head too
// (LoadOptions::mtp); a family that has none ignores it, and plan_model refuses the load.
using Sanitizer = std::function<LoadPlan(const Checkpoint& checkpoint, const ModelConfig& config, bool keep_mtp)>;

// The sanitizer of each graph. Immutable; with() returns a new table.
class SanitizerTable {
 public:
  SanitizerTable() = default;
  explicit SanitizerTable(std::map<Graph, Sanitizer> sanitizers);
  SanitizerTable with(Graph graph, Sanitizer sanitizer) const;
  // Fails naming the profile when its graph has no sanitizer.
  const Sanitizer& for_profile(const ModelProfile& profile) const;

 private:
  std::map<Graph, Sanitizer> sanitizers_;
};

// The sanitizers kiln ships with (model/builtin.cpp).
const SanitizerTable& builtin_sanitizers();

struct LoadOptions {
  // The dtype every floating-point weight is converted to at load; nothing: as stored.
  std::optional<DType> dtype;
  // Fingerprint a folder that is not a Hugging Face snapshot by hashing its weight files.
  bool hash_artifact = false;
  // Keep the checkpoint's multi-token-prediction head for --speculative mtp (the model then has a
  // Model::draft_head); without it those tensors are dropped and cost nothing. A load option, not
  // the profile's: the profile declares how the model is built, this what the load keeps.
  bool mtp = false;
  const ProfileTable* profiles = &builtin_profile_table();
  const ImplementationRegistry* registry = &builtin_registry();
  const SanitizerTable* sanitizers = &builtin_sanitizers();
};

// Everything decided about a model before any weight byte is read.
struct ModelPlan {
  std::filesystem::path model_dir;
  ModelConfig config;
  ResolvedProfile resolved;
  Device device;
  std::set<Capability> engine_capabilities;
  std::shared_ptr<const ModelImplementation> implementation;
  Checkpoint checkpoint;
  LoadPlan load_plan;

  // What `kiln inspect` prints: model_type, profile, fingerprints, exact_artifact,
  // implementation, capabilities, parameters, bytes_by_dtype, checkpoint and load_plan.
  nlohmann::json to_json() const;
};

// Resolves, validates and plans the model in `model_dir` for `device`; `backend_present` says
// whether this engine has a backend for that device. Fails, naming the profile and what is
// missing, before any weight is read.
ModelPlan plan_model(const std::filesystem::path& model_dir, Device device, bool backend_present,
                     const LoadOptions& options = {});

// Materialises the plan's weights (converted to `dtype` when given) and constructs the model
// with the plan's implementation on `backend`, which must be the plan's device. The weights are
// borrowed by the construction; every tensor the plan maps must be taken by it. `on_progress`, when
// given, hears of each tensor as the construction takes it (the loader itself prints nothing).
std::unique_ptr<Model> build_model(const ModelPlan& plan, Backend& backend, std::optional<DType> dtype = std::nullopt,
                                   const LoadProgressCallback& on_progress = {});

// The floating-point dtype most of the plan's weight bytes are stored in: a dense checkpoint's
// matrices'; a quantized one's scales, norms and unquantized tensors (its packed codes, U32 words
// or FP8 values, are no activation dtype). F32 when the plan has no floating-point tensor. The
// CUDA backend's activations follow it (bf16 tensor cores for a bf16 or bf16-scaled checkpoint).
DType planned_float_dtype(const ModelPlan& plan);

// The bytes build_model will hold of the plan's weights (converted to `dtype` when given), before
// any weight is read.
uint64_t planned_weight_bytes(const ModelPlan& plan, std::optional<DType> dtype = std::nullopt);

// plan_model on `backend`'s device, then build_model.
std::unique_ptr<Model> load_model(const std::filesystem::path& model_dir, Backend& backend,
                                  const LoadOptions& options = {});

}  // namespace kiln
