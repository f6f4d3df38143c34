#include "model/moe.h"

#include <algorithm>
#include <cctype>
#include <limits>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"

namespace kiln {

void read_moe_fields(const ConfigFields& text, ModelConfig& config, const MoeFieldDefaults& defaults) {
  MoeConfig& moe = config.moe;
  // transformers v5 saves Qwen3MoeConfig's num_experts as num_local_experts (its attribute_map).
  const bool named_local = text.has("num_local_experts");
  if (named_local && text.has("num_experts") && text.integer("num_experts") != text.integer("num_local_experts"))
    text.fail_field("num_local_experts", "is {} but num_experts is {}", text.integer("num_local_experts"),
                    text.integer("num_experts"));
  const std::string experts_key = named_local ? "num_local_experts" : "num_experts";
  moe.experts = text.has(experts_key) ? text.integer(experts_key) : defaults.experts;
  if (moe.experts < 0) text.fail_field(experts_key, "is {}, below 0", moe.experts);
  if (moe.experts == 0) {  // transformers builds every layer's dense MLP then
    moe = MoeConfig{};
    return;
  }
  moe.experts_per_token = text.optional_positive_integer("num_experts_per_tok").value_or(defaults.experts_per_token);
  moe.expert_intermediate_size =
      text.optional_positive_integer("moe_intermediate_size").value_or(defaults.expert_intermediate_size);
  if (defaults.shared_expert_intermediate_size > 0)
    moe.shared_expert_intermediate_size = text.optional_positive_integer("shared_expert_intermediate_size")
                                              .value_or(defaults.shared_expert_intermediate_size);
  moe.normalize_top_k = defaults.normalize_field ? text.boolean("norm_topk_prob", defaults.normalize_top_k) : true;
  if (moe.experts_per_token > moe.experts)
    text.fail_field("num_experts_per_tok", "is {}, more than the {} experts", moe.experts_per_token, moe.experts);
  // The router's experts are indexed by I32 on every backend.
  if (moe.experts > std::numeric_limits<int32_t>::max())
    text.fail_field(experts_key, "is {}, beyond 32-bit expert ids", moe.experts);

  std::vector<bool> dense_only(static_cast<size_t>(config.num_hidden_layers), false);
  int64_t step = 1;
  if (defaults.sparse_step_fields) {
    step = text.optional_positive_integer("decoder_sparse_step").value_or(1);
    if (text.has("mlp_only_layers")) {
      const nlohmann::json& listed = text.raw("mlp_only_layers");
      if (!listed.is_array()) text.fail_field("mlp_only_layers", "is a JSON {}, not a list", json_kind(listed));
      for (const nlohmann::json& entry : listed) {
        if (!entry.is_number_integer() || entry.get<int64_t>() < 0 || entry.get<int64_t>() >= config.num_hidden_layers)
          text.fail_field("mlp_only_layers", "holds {}, not a layer index below num_hidden_layers {}", entry.dump(),
                          config.num_hidden_layers);
        dense_only[entry.get<size_t>()] = true;
      }
    }
  }
  // transformers (Qwen3MoeDecoderLayer, Qwen3NextDecoderLayer): layer i is sparse iff it is not in
  // mlp_only_layers, there are experts, and (i + 1) % decoder_sparse_step == 0.
  moe.sparse_layers.clear();
  bool any_dense = false;
  for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer) {
    const bool sparse = !dense_only[static_cast<size_t>(layer)] && (layer + 1) % step == 0;
    moe.sparse_layers.push_back(sparse);
    any_dense = any_dense || !sparse;
  }
  if (any_dense && config.intermediate_size <= 0)
    text.fail_field("intermediate_size", "is required: some layers have a dense MLP (decoder_sparse_step {}, "
                    "mlp_only_layers)", step);
}

namespace {

// A MoE field's fingerprint value: null (left out) for a model without experts, so a dense model of
// a family that may have experts (Qwen3-Next) keeps the fingerprint it had.
template <typename T>
nlohmann::json moe_field(const ModelConfig& config, const T& value) {
  return config.moe.experts > 0 ? nlohmann::json(value) : nlohmann::json();
}

}  // namespace

std::vector<GraphShapingField> moe_graph_shaping_fields() {
  return {
      // The experts: how many, how many each token reads, their widths and how their weights combine.
      {"moe.experts", [](const ModelConfig& c) { return moe_field(c, c.moe.experts); }},
      {"moe.experts_per_token", [](const ModelConfig& c) { return moe_field(c, c.moe.experts_per_token); }},
      {"moe.expert_intermediate_size", [](const ModelConfig& c) { return moe_field(c, c.moe.expert_intermediate_size); }},
      {"moe.shared_expert_intermediate_size", [](const ModelConfig& c) { return moe_field(c, c.moe.shared_expert_intermediate_size); }},
      {"moe.normalize_top_k", [](const ModelConfig& c) { return moe_field(c, c.moe.normalize_top_k); }},
      // Which layers route to experts and which run the dense MLP.
      {"moe.sparse_layers", [](const ModelConfig& c) { return moe_field(c, c.moe.sparse_layers); }},
  };
}

SparseMoeWeights take_sparse_moe(WeightMap& weights, Backend& backend, const std::string& prefix,
                                 const ModelConfig& config) {
  const MoeConfig& moe = config.moe;
  const int64_t hidden = config.hidden_size, width = moe.expert_intermediate_size;
  const std::string mlp = prefix + "mlp.";
  auto matrix = [&](const std::string& name, const Shape& shape) {
    return backend.upload_weight(weights.take_weight(mlp + name, shape));
  };
  auto stack = [&](const std::string& name, const Shape& shape) {
    return backend.upload_weight(weights.take_stacked_weight(mlp + name, shape));
  };
  SparseMoeWeights layer;
  layer.router = matrix("gate.weight", {moe.experts, hidden});
  layer.gate = stack("experts.gate_proj.weight", {moe.experts, width, hidden});
  layer.up = stack("experts.up_proj.weight", {moe.experts, width, hidden});
  layer.down = stack("experts.down_proj.weight", {moe.experts, hidden, width});
  if (const int64_t shared = moe.shared_expert_intermediate_size; shared > 0) {
    layer.shared_gate = matrix("shared_expert.gate_proj.weight", {shared, hidden});
    layer.shared_up = matrix("shared_expert.up_proj.weight", {shared, hidden});
    layer.shared_down = matrix("shared_expert.down_proj.weight", {hidden, shared});
    layer.shared_expert_gate = matrix("shared_expert_gate.weight", {1, hidden});
  }
  return layer;
}

void sparse_moe(Backend& ops, const SparseMoeWeights& weights, const MoeConfig& moe, const Tensor& x, Tensor& out,
                Tensor* experts_read) {
  const int64_t tokens = x.dim(0), hidden = x.dim(1);
  const int64_t top_k = moe.experts_per_token, width = moe.expert_intermediate_size;
  const int64_t pairs = tokens * top_k;
  const bool shared = weights.shared_gate.defined();
  const DType act = ops.activation_dtype();

  Tensor logits = ops.alloc({tokens, moe.experts}, DType::F32);
  ops.matmul(x, weights.router, nullptr, logits);
  Tensor shared_logits;
  if (shared) {
    shared_logits = ops.alloc({tokens, 1}, DType::F32);
    ops.matmul(x, weights.shared_expert_gate, nullptr, shared_logits);
  }
  // Each token's experts ascending by id with their weights, then the shared expert's σ(x·w_sharedᵀ).
  Tensor experts = ops.alloc({tokens, top_k}, DType::I32);
  Tensor route_weights = ops.alloc({tokens, top_k + (shared ? 1 : 0)}, DType::F32);
  ops.moe_route(logits, shared ? &shared_logits : nullptr, moe.normalize_top_k, experts, route_weights);

  // Row t·k + j of the expert products is token t's j-th expert.
  Tensor gate = ops.alloc({pairs, width}, act);
  Tensor up = ops.alloc({pairs, width}, act);
  const MatmulTarget gate_up[] = {{&weights.gate, nullptr, &gate}, {&weights.up, nullptr, &up}};
  ops.expert_matmul(x, experts, gate_up, experts_read);
  ops.swiglu(gate, up, gate);
  Tensor routed = ops.alloc({pairs, hidden}, DType::F32);
  const MatmulTarget down[] = {{&weights.down, nullptr, &routed}};
  ops.expert_matmul(gate, experts, down, nullptr);

  Tensor shared_out;
  if (shared) {
    const int64_t shared_width = weights.shared_gate.dim(0);
    Tensor shared_gate = ops.alloc({tokens, shared_width}, act);
    Tensor shared_up = ops.alloc({tokens, shared_width}, act);
    shared_out = ops.alloc({tokens, hidden}, DType::F32);
    const MatmulTarget shared_gate_up[] = {{&weights.shared_gate, nullptr, &shared_gate},
                                           {&weights.shared_up, nullptr, &shared_up}};
    ops.matmul_group(x, shared_gate_up);
    ops.swiglu(shared_gate, shared_up, shared_gate);
    ops.matmul(shared_gate, weights.shared_down, nullptr, shared_out);
  }
  ops.moe_combine(routed, shared ? &shared_out : nullptr, route_weights, out);
}

size_t sparse_moe_expert_bytes(const SparseMoeWeights& weights, const MoeConfig& moe) {
  return (weights.gate.nbytes() + weights.up.nbytes() + weights.down.nbytes()) / static_cast<size_t>(moe.experts);
}

size_t sparse_moe_bytes(const SparseMoeWeights& weights, const MoeConfig& moe, int64_t experts_read) {
  size_t bytes = weights.router.nbytes() + sparse_moe_expert_bytes(weights, moe) * static_cast<size_t>(experts_read);
  for (const Weight* weight : {&weights.shared_gate, &weights.shared_up, &weights.shared_down, &weights.shared_expert_gate})
    if (weight->defined()) bytes += weight->nbytes();
  return bytes;
}

ExpertReadCounter::ExpertReadCounter(Backend& backend, int64_t sparse_layers)
    : backend_(&backend), taken_(static_cast<size_t>(sparse_layers), 0) {
  if (sparse_layers == 0) return;
  counts_ = backend.alloc({sparse_layers}, DType::U32);
  backend.zero(counts_);
  for (int64_t layer = 0; layer < sparse_layers; ++layer) layers_.push_back(counts_.slice_rows(layer, 1));
}

Tensor* ExpertReadCounter::layer(int64_t index) {
  return index < static_cast<int64_t>(layers_.size()) ? &layers_[static_cast<size_t>(index)] : nullptr;
}

std::vector<uint64_t> ExpertReadCounter::take() {
  std::vector<uint64_t> read(taken_.size(), 0);
  if (taken_.empty()) return read;
  const Tensor counts = backend_->download(counts_);
  for (size_t layer = 0; layer < taken_.size(); ++layer) {
    const uint32_t now = counts.data<uint32_t>()[layer];
    read[layer] = static_cast<uint32_t>(now - taken_[layer]);
    taken_[layer] = now;
  }
  return read;
}

namespace {

std::string where(const CheckpointTensor& tensor) {
  return fmt::format("{}: tensor '{}'", tensor.info->file.string(), tensor.name);
}

// The expert index of `experts.{e}.…` after `prefix`, or -1.
int64_t expert_index(const std::string& name, const std::string& prefix) {
  if (!name.starts_with(prefix)) return -1;
  int64_t index = 0;
  size_t at = prefix.size();
  if (at >= name.size() || !std::isdigit(static_cast<unsigned char>(name[at]))) return -1;
  while (at < name.size() && std::isdigit(static_cast<unsigned char>(name[at]))) {
    if (index > (std::numeric_limits<int64_t>::max() - 9) / 10) return std::numeric_limits<int64_t>::max();
    index = index * 10 + (name[at++] - '0');
  }
  return at < name.size() && name[at] == '.' ? index : -1;
}

}  // namespace

std::vector<PlannedTensor> plan_experts(const std::map<std::string, CheckpointTensor>& canonical, int64_t layer,
                                        const ModelConfig& config, std::set<std::string>& consumed) {
  return plan_experts(canonical, fmt::format("model.layers.{}.", layer), fmt::format("layer {}", layer), config,
                      consumed);
}

std::vector<PlannedTensor> plan_experts(const std::map<std::string, CheckpointTensor>& canonical,
                                        const std::string& prefix, const std::string& layer, const ModelConfig& config,
                                        std::set<std::string>& consumed) {
  const MoeConfig& moe = config.moe;
  const int64_t experts = moe.experts, hidden = config.hidden_size, width = moe.expert_intermediate_size;
  const std::string mlp = prefix + "mlp.";
  const std::string per_expert = mlp + "experts.", fused_gate_up = mlp + "experts.gate_up_proj",
                    fused_down = mlp + "experts.down_proj", mlx = mlp + "switch_mlp.";
  // Which layouts the layer holds, with one tensor of each to name.
  const CheckpointTensor* seen_per_expert = nullptr;
  const CheckpointTensor* seen_fused = nullptr;
  const CheckpointTensor* seen_mlx = nullptr;
  for (auto it = canonical.lower_bound(mlp); it != canonical.end() && it->first.starts_with(mlp); ++it) {
    const std::string& name = it->first;
    if (name == fused_gate_up || name == fused_down) {
      seen_fused = seen_fused ? seen_fused : &it->second;
    } else if (name.starts_with(mlx)) {
      seen_mlx = seen_mlx ? seen_mlx : &it->second;
    } else if (const int64_t e = expert_index(name, per_expert); e >= 0) {
      if (e >= experts)
        fail("{}: expert {} of {} is beyond num_experts {}", where(it->second), e, layer, experts);
      seen_per_expert = seen_per_expert ? seen_per_expert : &it->second;
    }
  }
  const std::vector<const CheckpointTensor*> layouts = {seen_per_expert, seen_fused, seen_mlx};
  if (std::count(layouts.begin(), layouts.end(), nullptr) < 2) {
    std::vector<std::string> held;
    for (const CheckpointTensor* tensor : layouts)
      if (tensor) held.push_back("'" + tensor->name + "'");
    fail("{}: {} mixes expert layouts (per-expert, fused and mlx-lm stacked tensors cannot be combined): {}",
         config.source.string(), layer, fmt::join(held, " and "));
  }
  auto find = [&](const std::string& name, const Shape& shape, const std::string& why) -> const CheckpointTensor& {
    const auto found = canonical.find(name);
    if (found == canonical.end())
      fail("{}: {} is sparse but the checkpoint has no tensor for {} ({})", config.source.string(), layer, name,
           why);
    if (found->second.info->shape != shape)
      fail("{}: has shape {}, expected {} ({})", where(found->second), shape_string(found->second.info->shape),
           shape_string(shape), why);
    consumed.insert(name);
    return found->second;
  };
  // The router: one row of logits per expert.
  if (const auto router = canonical.find(mlp + "gate.weight"); router == canonical.end())
    fail("{}: {} is sparse but the checkpoint has no router {}gate.weight", config.source.string(), layer, mlp);
  else if (router->second.info->shape != Shape{experts, hidden})
    fail("{}: {}'s router has shape {}, expected [{}, {}] (num_experts {} rows of hidden_size {})",
         where(router->second), layer, shape_string(router->second.info->shape), experts, hidden, experts, hidden);
  const Shape gate_shape{experts, width, hidden}, down_shape{experts, hidden, width};
  std::vector<PlannedTensor> planned;
  if (seen_fused) {
    const std::string why = fmt::format("{} experts of width {}, gate rows first", experts, width);
    const CheckpointTensor& gate_up = find(fused_gate_up, {experts, 2 * width, hidden}, why);
    const CheckpointTensor& down = find(fused_down, down_shape, why);
    planned.push_back({mlp + "experts.gate_proj.weight", gate_up.name, {FixUp::GatherExpertRows}, gate_shape, {{0, width}}});
    planned.push_back({mlp + "experts.up_proj.weight", gate_up.name, {FixUp::GatherExpertRows}, gate_shape, {{width, width}}});
    planned.push_back({mlp + "experts.down_proj.weight", down.name, {}, down_shape});
  } else if (seen_mlx) {
    for (const auto& [name, shape] : {std::pair{"gate_proj", gate_shape}, {"up_proj", gate_shape}, {"down_proj", down_shape}}) {
      const CheckpointTensor& stacked = find(mlx + name + ".weight", shape, fmt::format("{} stacked experts", experts));
      planned.push_back({mlp + "experts." + name + ".weight", stacked.name, {}, shape});
    }
  } else {
    for (const auto& [name, shape] : {std::pair{"gate_proj", Shape{width, hidden}}, {"up_proj", Shape{width, hidden}},
                                      {"down_proj", Shape{hidden, width}}}) {
      PlannedTensor stack{mlp + "experts." + name + ".weight", "", {FixUp::StackExperts}, {}};
      for (int64_t e = 0; e < experts; ++e) {
        const CheckpointTensor& tensor = find(fmt::format("{}{}.{}.weight", per_expert, e, name), shape,
                                              fmt::format("expert {} of {}", e, experts));
        stack.stacked_sources.push_back(tensor.name);
      }
      stack.source = stack.stacked_sources.front();
      stack.canonical_shape = {experts, shape[0], shape[1]};
      planned.push_back(std::move(stack));
    }
  }
  // Anything else under the expert prefixes is not an expert matrix kiln knows.
  for (auto it = canonical.lower_bound(mlp); it != canonical.end() && it->first.starts_with(mlp); ++it)
    if (!consumed.count(it->first) && (it->first.starts_with(per_expert) || it->first.starts_with(mlx)))
      fail("{}: is not one of {}'s expert matrices (gate_proj, up_proj, down_proj)", where(it->second), layer);
  return planned;
}

LoadPlan plan_moe_checkpoint(const std::map<std::string, TensorInfo>& tensors, const ModelConfig& config) {
  std::map<std::string, CheckpointTensor> canonical;
  for (const auto& [name, info] : tensors) canonical.emplace(name, CheckpointTensor{name, &info});
  LoadPlan plan;
  std::set<std::string> consumed;
  for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer)
    if (config.moe.sparse_layers.at(static_cast<size_t>(layer)))
      for (PlannedTensor& tensor : plan_experts(canonical, layer, config, consumed))
        plan.tensors.push_back(std::move(tensor));
  for (const auto& [name, info] : tensors)
    if (!consumed.count(name)) plan.tensors.push_back({name, name, {}, info.shape});
  return plan;
}

std::vector<SynthTensor> sparse_moe_synth_layout(const std::string& prefix, const ModelConfig& config,
                                                 ExpertLayout layout) {
  const MoeConfig& moe = config.moe;
  const int64_t hidden = config.hidden_size, width = moe.expert_intermediate_size;
  const std::string mlp = prefix + "mlp.";
  std::vector<SynthTensor> tensors;
  // The router stays dense in quantized checkpoints (mlx-lm and the FP8 exports keep mlp.gate).
  tensors.push_back({mlp + "gate.weight", {moe.experts, hidden}});
  if (layout == ExpertLayout::Fused) {
    // Stacked 3-d tensors: kiln quantize and synth --quantize keep them dense.
    tensors.push_back({mlp + "experts.gate_up_proj", {moe.experts, 2 * width, hidden}});
    tensors.push_back({mlp + "experts.down_proj", {moe.experts, hidden, width}});
  } else {
    for (int64_t e = 0; e < moe.experts; ++e) {
      const std::string expert = fmt::format("{}experts.{}.", mlp, e);
      tensors.push_back(layer_linear(expert + "gate_proj.weight", {width, hidden}));
      tensors.push_back(layer_linear(expert + "up_proj.weight", {width, hidden}));
      tensors.push_back(layer_linear(expert + "down_proj.weight", {hidden, width}));
    }
  }
  if (const int64_t shared = moe.shared_expert_intermediate_size; shared > 0) {
    tensors.push_back(layer_linear(mlp + "shared_expert.gate_proj.weight", {shared, hidden}));
    tensors.push_back(layer_linear(mlp + "shared_expert.up_proj.weight", {shared, hidden}));
    tensors.push_back(layer_linear(mlp + "shared_expert.down_proj.weight", {hidden, shared}));
    tensors.push_back({mlp + "shared_expert_gate.weight", {1, hidden}});
  }
  return tensors;
}

}  // namespace kiln
