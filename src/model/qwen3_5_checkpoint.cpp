#include "model/qwen3_5_checkpoint.h"

#include <array>
#include <charconv>
#include <optional>
#include <set>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/ranges.h>

#include "core/error.h"
#include "model/family.h"
#include "model/moe.h"

namespace kiln {
namespace {

struct Renaming {
  std::string_view source_prefix;
  std::string_view canonical_prefix;
};

// Longest prefixes first: `model.language_model.` must win over `model.`.
constexpr std::array<Renaming, 5> kRenamings = {{
    {"model.language_model.", "model."},      // HF Qwen3.5 multimodal export
    {"language_model.model.", "model."},      // mlx-lm conversion
    {"language_model.lm_head.", "lm_head."},  // mlx-lm conversion
    {"model.", "model."},
    {"lm_head.", "lm_head."},
}};

struct DropRule {
  std::string_view prefix;
  std::string_view reason;
};

// The multi-token-prediction head's tensors, wherever an export nests them: mtp.* (Hugging Face),
// language_model.mtp.* or model.mtp.* (wrapped multimodal exports).
bool is_mtp_tensor(std::string_view name) { return name.starts_with("mtp.") || name.find(".mtp.") != std::string_view::npos; }
constexpr std::string_view kMtpReason = "multi-token-prediction head (kept only for --speculative mtp)";

// An MTP tensor's canonical name: the name from its `mtp.` on (model.mtp.fc.weight → mtp.fc.weight).
std::string mtp_canonical_name(const std::string& name) {
  return name.starts_with("mtp.") ? name : name.substr(name.find(".mtp.") + 1);
}

constexpr std::array<DropRule, 3> kDropRules = {{
    {"model.visual.", "vision tower (text graph)"},
    {"vision_tower.", "vision tower (text graph)"},
    {"visual.", "vision tower (text graph)"},
}};

// The zero-centred RMSNorm gains (spec A.4 #1): the per-layer ones by suffix, plus the final norm.
constexpr std::array<std::string_view, 4> kZeroCentredLayerGains = {
    ".input_layernorm.weight", ".post_attention_layernorm.weight", ".self_attn.q_norm.weight",
    ".self_attn.k_norm.weight"};
constexpr std::string_view kFinalNorm = "model.norm.weight";

enum class ConvLayout { HuggingFace, Mlx, Canonical };

std::string_view layout_name(ConvLayout layout) {
  switch (layout) {
    case ConvLayout::HuggingFace: return "[C, 1, K] (Hugging Face)";
    case ConvLayout::Mlx: return "[C, K, 1] (mlx-lm)";
    case ConvLayout::Canonical: return "[C, K] (kiln)";
  }
  return "?";
}

using Source = CheckpointTensor;

std::string where(const TensorInfo& info) {
  return info.file.empty() ? std::string("checkpoint") : info.file.string();
}

// The config's GDN geometry (spec notation).
struct Geometry {
  int64_t hidden, key_heads, value_heads, key_dim, value_dim, kernel, head_dim;
  int64_t ratio() const { return value_heads / key_heads; }
  int64_t conv_channels() const { return 2 * key_heads * key_dim + value_heads * value_dim; }
};

Geometry checked_geometry(const ModelConfig& config) {
  const FamilySpec* family = builtin_families().find(config.model_type);
  if (!family || family->loop != Loop::HybridRecurrent) {
    std::vector<std::string> hybrid;
    for (const FamilySpec& spec : builtin_families().specs())
      if (spec.loop == Loop::HybridRecurrent)
        for (const ModelTypeRules& rules : spec.model_types) hybrid.push_back(rules.model_type);
    fail("{}: the Qwen3.5 checkpoint sanitizer needs a hybrid model ({}), got model_type {}", config.source.string(),
         fmt::join(hybrid, " or "), config.model_type);
  }
  const Geometry geometry{config.hidden_size,           config.linear_num_key_heads, config.linear_num_value_heads,
                          config.linear_key_head_dim,   config.linear_value_head_dim, config.linear_conv_kernel_dim,
                          config.head_dim};
  const std::pair<std::string_view, int64_t> fields[] = {
      {"hidden_size", geometry.hidden},
      {"linear_num_key_heads", geometry.key_heads},
      {"linear_num_value_heads", geometry.value_heads},
      {"linear_key_head_dim", geometry.key_dim},
      {"linear_value_head_dim", geometry.value_dim},
      {"head_dim", geometry.head_dim}};
  for (const auto& [field, value] : fields)
    if (value <= 0) fail("{}: field {} must be positive, got {}", config.source.string(), field, value);
  if (geometry.value_heads % geometry.key_heads != 0)
    fail("{}: linear_num_value_heads ({}) must be a multiple of linear_num_key_heads ({})", config.source.string(),
         geometry.value_heads, geometry.key_heads);
  // A kernel of 1 would make the [C, 1, K] and [C, K, 1] conv layouts indistinguishable.
  if (geometry.kernel < 2)
    fail("{}: field linear_conv_kernel_dim must be at least 2, got {}", config.source.string(), geometry.kernel);
  if (static_cast<int64_t>(config.layer_types.size()) != config.num_hidden_layers)
    fail("{}: layer_types has {} entries for {} layers", config.source.string(), config.layer_types.size(),
         config.num_hidden_layers);
  return geometry;
}

std::optional<std::string> canonical_name(const std::string& name) {
  for (const Renaming& renaming : kRenamings)
    if (name.starts_with(renaming.source_prefix))
      return std::string(renaming.canonical_prefix) + name.substr(renaming.source_prefix.size());
  return std::nullopt;
}

// The layer index of a canonical `model.layers.{i}.…` name.
std::optional<int64_t> layer_index(const std::string& canonical) {
  constexpr std::string_view prefix = "model.layers.";
  if (!canonical.starts_with(prefix)) return std::nullopt;
  const char* begin = canonical.data() + prefix.size();
  const char* end = canonical.data() + canonical.size();
  int64_t index = 0;
  const auto [stop, error] = std::from_chars(begin, end, index);
  if (error != std::errc() || stop == begin || stop == end || *stop != '.') return std::nullopt;
  return index;
}

class CheckpointPlanner {
 public:
  CheckpointPlanner(const std::map<std::string, TensorInfo>& tensors, const ModelConfig& config, bool keep_mtp)
      : tensors_(tensors), config_(config), geometry_(checked_geometry(config)), keep_mtp_(keep_mtp) {}

  LoadPlan plan() {
    rename_and_drop();
    check_layers();
    if (keep_mtp_) check_mtp();
    const bool shift = decide_gain_convention();
    for (int64_t layer = 0; layer < config_.num_hidden_layers; ++layer)
      if (config_.moe.experts > 0 && config_.moe.sparse_layers.at(static_cast<size_t>(layer)))
        for (PlannedTensor& tensor : plan_experts(canonical_, layer, config_, regrouped_))
          planned_.emplace(tensor.canonical, std::move(tensor));
    for (const auto& [canonical, source] : canonical_) {
      if (regrouped_.count(canonical)) continue;
      PlannedTensor tensor{canonical, source.name, {}, source.info->shape, {}};
      if (layer_index(canonical) && canonical.ends_with(".linear_attn.conv1d.weight")) plan_conv(tensor, *source.info);
      if (shift && is_zero_centred_gain(canonical)) tensor.fixups.push_back(FixUp::SubtractOne);
      planned_.emplace(canonical, std::move(tensor));
    }
    LoadPlan plan;
    for (auto& [canonical, tensor] : planned_) plan.tensors.push_back(std::move(tensor));
    plan.dropped = std::move(dropped_);
    plan.notes = std::move(notes_);
    return plan;
  }

 private:
  void rename_and_drop() {
    for (const auto& [name, info] : tensors_) {
      if (is_mtp_tensor(name)) {
        mtp_tensors_++;
        if (!keep_mtp_) {
          dropped_.push_back({name, std::string(kMtpReason)});
          continue;
        }
        const auto [existing, inserted] = canonical_.emplace(mtp_canonical_name(name), Source{name, &info});
        if (!inserted)
          fail("{}: tensors {} and {} both name the canonical tensor {}", where(info), existing->second.name, name,
               existing->first);
        continue;
      }
      const DropRule* drop = nullptr;
      for (const DropRule& rule : kDropRules)
        if (!drop && name.starts_with(rule.prefix)) drop = &rule;
      if (drop) {
        dropped_.push_back({name, std::string(drop->reason)});
        continue;
      }
      std::optional<std::string> canonical = canonical_name(name);
      if (!canonical)
        fail("{}: tensor {} has no Qwen3.5 name prefix (model.*, model.language_model.*, language_model.model.*, "
             "lm_head.*, language_model.lm_head.*, or a dropped *mtp.* / vision-tower tensor)",
             where(info), name);
      const auto [existing, inserted] = canonical_.emplace(*canonical, Source{name, &info});
      if (!inserted)
        fail("{}: tensors {} and {} both name the canonical tensor {}", where(info), existing->second.name, name,
             *canonical);
    }
    for (const Renaming& renaming : kRenamings) {
      if (renaming.source_prefix == renaming.canonical_prefix) continue;
      int64_t count = 0;
      for (const auto& [canonical, source] : canonical_)
        if (source.name.starts_with(renaming.source_prefix)) ++count;
      if (count > 0)
        notes_.push_back(fmt::format("{} tensors renamed {}* → {}*", count, renaming.source_prefix,
                                     renaming.canonical_prefix));
    }
    if (config_.tie_word_embeddings) {
      if (auto head = canonical_.find("lm_head.weight"); head != canonical_.end()) {
        dropped_.push_back({head->second.name, "lm_head tied to model.embed_tokens.weight (tie_word_embeddings)"});
        canonical_.erase(head);
      }
    }
  }

  // The checkpoint tensor under `canonical`, or an error naming it and why it is needed.
  const Source& find_required(const std::string& canonical, std::string_view why) const {
    const auto found = canonical_.find(canonical);
    if (found == canonical_.end())
      fail("{}: the checkpoint has no tensor for {} ({})", config_.source.string(), canonical, why);
    return found->second;
  }

  void require(const std::string& canonical, const Shape& shape, std::string_view why) const {
    const Source& source = find_required(canonical, why);
    if (source.info->shape != shape)
      fail("{}: tensor {} has shape {}, expected {}", where(*source.info), source.name,
           shape_string(source.info->shape), shape_string(shape));
  }

  void check_layers() {
    const Geometry& g = geometry_;
    for (const auto& [canonical, source] : canonical_) {
      const std::optional<int64_t> layer = layer_index(canonical);
      if (canonical.starts_with("model.layers.") && (!layer || *layer < 0 || *layer >= config_.num_hidden_layers))
        fail("{}: tensor {} is not in one of the config's {} layers", where(*source.info), source.name,
             config_.num_hidden_layers);
      if (!layer) continue;
      const bool linear = config_.layer_types[*layer] == LayerKind::LinearAttention;
      const std::string_view foreign = linear ? ".self_attn." : ".linear_attn.";
      if (canonical.find(foreign) != std::string::npos)
        fail("{}: tensor {} belongs to a {} layer, but layer {} is {}", where(*source.info), source.name,
             linear ? "full_attention" : "linear_attention", *layer, linear ? "linear_attention" : "full_attention");
    }
    require(std::string(kFinalNorm), {g.hidden}, "the final norm");
    for (int64_t layer = 0; layer < config_.num_hidden_layers; ++layer) {
      const std::string prefix = fmt::format("model.layers.{}.", layer);
      require(prefix + "input_layernorm.weight", {g.hidden}, "every layer's input norm");
      require(prefix + "post_attention_layernorm.weight", {g.hidden}, "every layer's post-attention norm");
      if (config_.layer_types[layer] == LayerKind::LinearAttention)
        check_linear_layer(prefix + "linear_attn.", layer);
      else
        for (const char* norm : {"self_attn.q_norm.weight", "self_attn.k_norm.weight"})
          require(prefix + norm, {g.head_dim}, "a full_attention layer's q/k norm");
    }
  }

  // The multi-token-prediction head (spec A.8, vLLM's qwen3_5_mtp.py): its norms and fc, then one
  // full-attention decoder layer whose MLP is the model's (the sparse one where layer 0 of the
  // model is sparse, as vLLM builds mtp.layers.0). Every mtp.* tensor must be one of them.
  void check_mtp() {
    const Geometry& g = geometry_;
    if (mtp_tensors_ == 0)
      fail("{}: has no MTP weights (no tensor named mtp.*) for --speculative mtp", config_.source.parent_path().string());
    if (config_.mtp_layers != 1)
      fail("{}: declares {} multi-token-prediction layers (mtp_num_hidden_layers / num_nextn_predict_layers); kiln "
           "runs exactly one, as the published Qwen3.5 and Qwen3-Next checkpoints have",
           config_.source.string(), config_.mtp_layers);
    const std::string why = "the multi-token-prediction head (--speculative mtp)";
    const int64_t q_width = config_.num_attention_heads * g.head_dim, kv_width = config_.num_key_value_heads * g.head_dim;
    const std::string layer = "mtp.layers.0.";
    std::vector<std::pair<std::string, Shape>> expected = {
        {"mtp.fc.weight", {g.hidden, 2 * g.hidden}},
        {"mtp.pre_fc_norm_embedding.weight", {g.hidden}},
        {"mtp.pre_fc_norm_hidden.weight", {g.hidden}},
        {"mtp.norm.weight", {g.hidden}},
        {layer + "input_layernorm.weight", {g.hidden}},
        {layer + "post_attention_layernorm.weight", {g.hidden}},
        {layer + "self_attn.q_proj.weight", {2 * q_width, g.hidden}},
        {layer + "self_attn.k_proj.weight", {kv_width, g.hidden}},
        {layer + "self_attn.v_proj.weight", {kv_width, g.hidden}},
        {layer + "self_attn.o_proj.weight", {g.hidden, q_width}},
        {layer + "self_attn.q_norm.weight", {g.head_dim}},
        {layer + "self_attn.k_norm.weight", {g.head_dim}},
    };
    const MoeConfig& moe = config_.moe;
    if (moe.experts > 0 && moe.sparse_layers.at(0)) {
      for (PlannedTensor& tensor : plan_experts(canonical_, layer, "MTP layer 0", config_, regrouped_))
        planned_.emplace(tensor.canonical, std::move(tensor));
      expected.push_back({layer + "mlp.gate.weight", {moe.experts, g.hidden}});
      if (const int64_t shared = moe.shared_expert_intermediate_size; shared > 0) {
        expected.push_back({layer + "mlp.shared_expert.gate_proj.weight", {shared, g.hidden}});
        expected.push_back({layer + "mlp.shared_expert.up_proj.weight", {shared, g.hidden}});
        expected.push_back({layer + "mlp.shared_expert.down_proj.weight", {g.hidden, shared}});
        expected.push_back({layer + "mlp.shared_expert_gate.weight", {1, g.hidden}});
      }
    } else {
      const int64_t width = config_.intermediate_size;
      expected.push_back({layer + "mlp.gate_proj.weight", {width, g.hidden}});
      expected.push_back({layer + "mlp.up_proj.weight", {width, g.hidden}});
      expected.push_back({layer + "mlp.down_proj.weight", {g.hidden, width}});
    }
    std::set<std::string> known;
    for (const auto& [canonical, shape] : expected) {
      require(canonical, shape, why);
      known.insert(canonical);
    }
    for (const auto& [canonical, source] : canonical_)
      if (canonical.starts_with("mtp.") && !known.count(canonical) && !regrouped_.count(canonical))
        fail("{}: tensor {} is not part of the multi-token-prediction head kiln runs (fc, its norms and one "
             "full-attention layer)", where(*source.info), source.name);
    notes_.push_back(fmt::format("{} multi-token-prediction tensors kept for --speculative mtp", mtp_tensors_));
  }

  void check_linear_layer(const std::string& prefix, int64_t layer) {
    const Geometry& g = geometry_;
    const std::string why = fmt::format("layer {} is linear_attention", layer);
    require(prefix + "A_log", {g.value_heads}, why);
    require(prefix + "dt_bias", {g.value_heads}, why);
    require(prefix + "norm.weight", {g.value_dim}, why);
    require(prefix + "out_proj.weight", {g.hidden, g.value_heads * g.value_dim}, why);
    check_conv(prefix + "conv1d.weight", why);

    const bool grouped = canonical_.count(prefix + "in_proj_qkvz.weight") || canonical_.count(prefix + "in_proj_ba.weight");
    if (!grouped) {
      require(prefix + "in_proj_qkv.weight", {g.conv_channels(), g.hidden}, why);
      require(prefix + "in_proj_z.weight", {g.value_heads * g.value_dim, g.hidden}, why);
      require(prefix + "in_proj_b.weight", {g.value_heads, g.hidden}, why);
      require(prefix + "in_proj_a.weight", {g.value_heads, g.hidden}, why);
      return;
    }
    for (const char* flat : {"in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"})
      if (auto found = canonical_.find(prefix + flat); found != canonical_.end())
        fail("{}: tensor {} mixes the Qwen3.5 projection layout into a layer that holds the Qwen3-Next "
             "in_proj_qkvz / in_proj_ba", where(*found->second.info), found->second.name);
    require(prefix + "in_proj_qkvz.weight", {g.conv_channels() + g.value_heads * g.value_dim, g.hidden}, why);
    require(prefix + "in_proj_ba.weight", {2 * g.value_heads, g.hidden}, why);
    regroup_qwen3_next(prefix);
  }

  void check_conv(const std::string& canonical, const std::string& why) {
    const Geometry& g = geometry_;
    const Source& source = find_required(canonical, why);
    const TensorInfo& info = *source.info;
    const int64_t c = g.conv_channels(), k = g.kernel;
    ConvLayout layout;
    if (info.shape == Shape{c, 1, k})
      layout = ConvLayout::HuggingFace;
    else if (info.shape == Shape{c, k, 1})
      layout = ConvLayout::Mlx;
    else if (info.shape == Shape{c, k})
      layout = ConvLayout::Canonical;
    else
      fail("{}: tensor {} has shape {}, expected {} (Hugging Face), {} (mlx-lm) or {} (kiln)", where(info),
           source.name, shape_string(info.shape), shape_string({c, 1, k}), shape_string({c, k, 1}),
           shape_string({c, k}));
    if (conv_layout_ && *conv_layout_ != layout)
      fail("{}: tensor {} is in the {} conv layout but {} is in {}: one checkpoint mixes two generations",
           where(info), source.name, layout_name(layout), first_conv_, layout_name(*conv_layout_));
    if (!conv_layout_) {
      conv_layout_ = layout;
      first_conv_ = source.name;
    }
  }

  // Qwen3-Next groups the projection rows by key head (spec A.6.1): per group g of width
  // W = 2dk + 2r·dv the rows are [q_g (dk) | k_g (dk) | v_g (r·dv) | z_g (r·dv)], and in_proj_ba
  // groups are [b_g (r) | a_g (r)]. The Qwen3.5 layout concatenates all q, all k, all v (head order).
  void regroup_qwen3_next(const std::string& prefix) {
    const Geometry& g = geometry_;
    const int64_t r = g.ratio(), dk = g.key_dim, dv = g.value_dim;
    const int64_t group_width = 2 * dk + 2 * r * dv;
    std::vector<RowBlock> qkv, z, b, a;
    for (int64_t group = 0; group < g.key_heads; ++group) qkv.push_back({group * group_width, dk});
    for (int64_t group = 0; group < g.key_heads; ++group) qkv.push_back({group * group_width + dk, dk});
    for (int64_t group = 0; group < g.key_heads; ++group) qkv.push_back({group * group_width + 2 * dk, r * dv});
    for (int64_t group = 0; group < g.key_heads; ++group)
      z.push_back({group * group_width + 2 * dk + r * dv, r * dv});
    for (int64_t group = 0; group < g.key_heads; ++group) {
      b.push_back({group * 2 * r, r});
      a.push_back({group * 2 * r + r, r});
    }
    const std::string qkvz_source = canonical_.at(prefix + "in_proj_qkvz.weight").name;
    const std::string ba_source = canonical_.at(prefix + "in_proj_ba.weight").name;
    auto gather = [&](const std::string& name, const std::string& source, int64_t rows, std::vector<RowBlock> blocks) {
      planned_.emplace(prefix + name, PlannedTensor{prefix + name, source, {FixUp::GatherRows}, {rows, g.hidden},
                                                    std::move(blocks)});
    };
    gather("in_proj_qkv.weight", qkvz_source, g.conv_channels(), std::move(qkv));
    gather("in_proj_z.weight", qkvz_source, g.value_heads * dv, std::move(z));
    gather("in_proj_b.weight", ba_source, g.value_heads, std::move(b));
    gather("in_proj_a.weight", ba_source, g.value_heads, std::move(a));
    regrouped_.insert(prefix + "in_proj_qkvz.weight");
    regrouped_.insert(prefix + "in_proj_ba.weight");
    if (!regroup_noted_) {
      notes_.push_back(
          "Qwen3-Next in_proj_qkvz / in_proj_ba regrouped by row gathers into the Qwen3.5 in_proj_qkv / "
          "in_proj_z / in_proj_b / in_proj_a layout (copies)");
      regroup_noted_ = true;
    }
  }

  void plan_conv(PlannedTensor& tensor, const TensorInfo& info) {
    switch (*conv_layout_) {
      case ConvLayout::HuggingFace: tensor.fixups.push_back(FixUp::ConvToChannelsKernel); break;
      case ConvLayout::Mlx: tensor.fixups.push_back(FixUp::ConvFromKernelLast); break;
      case ConvLayout::Canonical: break;
    }
    tensor.canonical_shape = {info.shape[0], geometry_.kernel};
  }

  static bool is_zero_centred_gain(const std::string& canonical) {
    if (canonical == kFinalNorm) return true;
    if (!layer_index(canonical)) return false;
    for (std::string_view suffix : kZeroCentredLayerGains)
      if (canonical.ends_with(suffix)) return true;
    return false;
  }

  // The whole-map decision of spec A.9 (see the header); returns whether gains need SubtractOne.
  bool decide_gain_convention() {
    if (mtp_tensors_ > 0 || conv_layout_ == ConvLayout::HuggingFace) {
      const std::string marker = mtp_tensors_ > 0 ? fmt::format("{} mtp.* tensors", mtp_tensors_)
                                                  : std::string("conv1d in the [C, 1, K] layout");
      notes_.push_back(fmt::format(
          "zero-centred norm gains stored as γ (Hugging Face export: {}): used as stored", marker));
      return false;
    }
    if (conv_layout_ == ConvLayout::Mlx) {
      notes_.push_back(
          "zero-centred norm gains stored as 1 + γ (mlx-lm conversion: conv1d in the [C, K, 1] layout, no mtp.* "
          "tensors): shifted to γ in f32");
      return true;
    }
    notes_.push_back("zero-centred norm gains stored as γ (kiln's canonical layout): used as stored");
    return false;
  }

  const std::map<std::string, TensorInfo>& tensors_;
  const ModelConfig& config_;
  const Geometry geometry_;
  std::map<std::string, Source> canonical_;        // canonical name → checkpoint tensor
  std::map<std::string, PlannedTensor> planned_;   // the plan, by canonical name
  std::set<std::string> regrouped_;                // canonical names replaced by row gathers or expert stacks
  std::vector<DroppedTensor> dropped_;
  std::vector<std::string> notes_;
  std::optional<ConvLayout> conv_layout_;
  std::string first_conv_;
  bool keep_mtp_;
  int64_t mtp_tensors_ = 0;
  bool regroup_noted_ = false;
};

}  // namespace

LoadPlan plan_qwen3_5_checkpoint(const std::map<std::string, TensorInfo>& tensors, const ModelConfig& config,
                                 bool keep_mtp) {
  return CheckpointPlanner(tensors, config, keep_mtp).plan();
}

}  // namespace kiln
