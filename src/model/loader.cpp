#include "model/loader.h"

#include <algorithm>
#include <map>

#include <fmt/format.h>

#include "core/error.h"
#include "io/fingerprint.h"
#include "model/family.h"
#include "model/quantized_checkpoint.h"

namespace kiln {

SanitizerTable::SanitizerTable(std::map<Graph, Sanitizer> sanitizers) : sanitizers_(std::move(sanitizers)) {
  for (const auto& [graph, sanitizer] : sanitizers_)
    if (!sanitizer) fail("checkpoint sanitizer for graph {} is empty", graph_name(graph));
}

SanitizerTable SanitizerTable::with(Graph graph, Sanitizer sanitizer) const {
  auto sanitizers = sanitizers_;
  if (!sanitizers.emplace(graph, std::move(sanitizer)).second)
    fail("duplicate checkpoint sanitizer for graph {}", graph_name(graph));
  return SanitizerTable(std::move(sanitizers));
}

const Sanitizer& SanitizerTable::for_profile(const ModelProfile& profile) const {
  const Graph graph = profile.execution().graph;
  const auto found = sanitizers_.find(graph);
  if (found == sanitizers_.end())
    fail("model profile {} selects graph {}, for which no checkpoint sanitizer is registered", profile.id(),
         graph_name(graph));
  return found->second;
}

ModelPlan plan_model(const std::filesystem::path& model_dir, Device device, bool backend_present,
                     const LoadOptions& options) {
  ModelConfig config = load_model_config(model_dir);
  const auto artifact = artifact_fingerprint(model_dir, options.hash_artifact);
  ResolvedProfile resolved = resolve_profile(config, artifact, *options.profiles);
  auto engine = engine_capabilities(*options.registry, device, backend_present);
  require_engine_capabilities(resolved.profile, device, engine);
  auto implementation = options.registry->select(config, resolved, device);
  const Sanitizer& sanitize = options.sanitizers->for_profile(resolved.profile);
  Checkpoint checkpoint = Checkpoint::open(model_dir);
  LoadPlan load_plan =
      plan_checkpoint(checkpoint, config, [&](const Checkpoint& seen) { return sanitize(seen, config, options.mtp); });
  if (options.mtp && std::none_of(load_plan.tensors.begin(), load_plan.tensors.end(),
                                  [](const PlannedTensor& tensor) { return tensor.canonical.starts_with("mtp."); }))
    fail("{}: model_type {} has no multi-token-prediction head that kiln runs (--speculative mtp runs Qwen3.5's, "
         "Qwen3.5-MoE's and Qwen3-Next's)", model_dir.string(), config.model_type);
  return ModelPlan{model_dir,
                   std::move(config),
                   std::move(resolved),
                   device,
                   std::move(engine),
                   std::move(implementation),
                   std::move(checkpoint),
                   std::move(load_plan)};
}

std::unique_ptr<Model> build_model(const ModelPlan& plan, Backend& backend, std::optional<DType> dtype,
                                   const LoadProgressCallback& on_progress) {
  const ModelImplementation& implementation = *plan.implementation;
  const std::string& profile = plan.resolved.profile.id();
  if (backend.device() != plan.device)
    fail("model profile {}: implementation {} was planned for {}, but the backend is {}", profile, implementation.id,
         device_name(plan.device), backend.name());
  WeightMap weights(plan.checkpoint, plan.load_plan);
  if (dtype) weights.convert_to(*dtype);
  if (on_progress) weights.report_progress(on_progress);
  // The construction seam: the resolved profile is checked again against the config it builds,
  // and the implementation against the profile (as selection did).
  check_resolved_profile(plan.config, plan.resolved);
  check_implementation_binding(implementation, plan.resolved.profile, plan.device);
  std::unique_ptr<Model> model = implementation.create(weights, plan.config, plan.resolved, backend);
  if (!model)
    fail("model implementation {} returned no model for profile {} ({})", implementation.id, profile,
         plan.model_dir.string());
  weights.require_all_used();
  return model;
}

DType planned_float_dtype(const ModelPlan& plan) {
  std::map<DType, uint64_t> bytes;
  for (const auto& planned : plan.load_plan.tensors) {
    const TensorInfo& info = plan.checkpoint.info(planned.source);
    if (is_float_dtype(info.dtype)) bytes[info.dtype] += info.nbytes;
  }
  DType dominant = DType::F32;
  uint64_t most = 0;
  for (const auto& [dtype, count] : bytes)
    if (count > most) most = count, dominant = dtype;
  return dominant;
}

uint64_t planned_weight_bytes(const ModelPlan& plan, std::optional<DType> dtype) {
  return WeightMap::shapes_only(plan.checkpoint, plan.load_plan, dtype).bytes();
}

std::unique_ptr<Model> load_model(const std::filesystem::path& model_dir, Backend& backend,
                                  const LoadOptions& options) {
  const ModelPlan plan = plan_model(model_dir, backend.device(), /*backend_present=*/true, options);
  return build_model(plan, backend, options.dtype);
}

nlohmann::json ModelPlan::to_json() const {
  // Parameters and bytes count what the graph will hold: the planned tensors, not the dropped
  // ones (which the load plan lists).
  int64_t parameters = 0;
  std::map<std::string, uint64_t> bytes_by_dtype;
  std::map<std::string, uint64_t> planned_bytes;  // by canonical name
  for (const auto& planned : load_plan.tensors) {
    const TensorInfo& info = checkpoint.info(planned.source);
    // A repacked part (AWQ, GPTQ) is held in its own shape and dtype, not its main source's.
    const Shape shape = planned.repack ? planned.canonical_shape : info.shape;
    const DType dtype = planned.materialised_dtype(info.dtype);
    const uint64_t bytes = planned.repack ? static_cast<uint64_t>(shape_numel(shape)) * dtype_size(dtype) : info.nbytes;
    parameters += shape_numel(shape);
    bytes_by_dtype[std::string(dtype_name(planned.repack ? dtype : info.dtype))] += bytes;
    planned_bytes[planned.canonical] = bytes;
  }
  nlohmann::json quantization = config.quantization.to_json();
  if (config.quantization.method != QuantMethod::None) {
    // What the quantized matrices hold once loaded: packed values with their scales and biases.
    uint64_t packed_bytes = 0;
    int64_t matrices = 0;
    std::map<std::string, int64_t> matrices_by_layout;
    for (const auto& planned : load_plan.tensors) {
      if (!planned.quantized) continue;
      const QuantizedParts& parts = *planned.quantized;
      ++matrices;
      packed_bytes += planned_bytes.at(planned.canonical) + planned_bytes.at(parts.scales);
      if (!parts.biases.empty()) packed_bytes += planned_bytes.at(parts.biases);
      ++matrices_by_layout[parts.format == WeightFormat::Affine
                               ? fmt::format("affine {}-bit group {}", parts.bits, parts.group_size)
                               : fmt::format("fp8 blocks {}x{}", parts.block_rows, parts.block_columns)];
    }
    quantization["quantized_matrices"] = matrices;
    quantization["matrices_by_layout"] = matrices_by_layout;
    quantization["packed_bytes"] = packed_bytes;
  }
  std::set<Capability> required_set = resolved.profile.capabilities();
  required_set.insert(backend_capability(device));
  nlohmann::json required = nlohmann::json::array();
  for (Capability capability : required_set) required.push_back(capability_name(capability));
  nlohmann::json engine = nlohmann::json::array();
  for (Capability capability : engine_capabilities) engine.push_back(capability_name(capability));
  nlohmann::json files = nlohmann::json::array();
  for (const auto& file : checkpoint.files()) files.push_back(file.string());

  return {
      {"model_dir", model_dir.string()},
      {"model_type", config.model_type},
      {"device", device_name(device)},
      {"profile", resolved.profile.to_json()},
      {"artifact_fingerprint", resolved.artifact_fingerprint ? nlohmann::json(*resolved.artifact_fingerprint)
                                                             : nlohmann::json(nullptr)},
      {"config_fingerprint", resolved.config_fingerprint},
      {"exact_artifact", resolved.exact_artifact},
      {"implementation", implementation->id},
      {"capabilities", {{"required", required}, {"engine", engine}}},
      {"parameters", parameters},
      {"bytes_by_dtype", bytes_by_dtype},
      {"quantization", quantization},
      {"checkpoint", {{"files", files}, {"tensors", checkpoint.tensors().size()}, {"bytes", checkpoint.total_bytes()}}},
      {"load_plan", load_plan.to_json()},
  };
}

}  // namespace kiln
