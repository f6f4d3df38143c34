// config.json → ModelConfig: every field that shapes a graph, parsed strictly.
//
// The fields every family shares are read here; which model_type values are accepted, and what
// each one's configuration class adds (defaults, required fields, family-only fields), comes from
// a ConfigVocabulary that the model layer builds from its family specs (model/family.h:
// load_model_config / parse_model_config use kiln's own families). An unknown model_type, a
// missing required field, or an unsupported value (e.g. an unknown rope_type) is a kiln::Error
// naming the file and the field — never a guess.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/config_fields.h"
#include "io/quantization_config.h"

namespace kiln {

struct RopeConfig {
  std::string type = "default";  // "default" | "llama3"
  double theta = 10000.0;
  double partial_rotary_factor = 1.0;  // fraction of head_dim that rotates (Qwen3.5: 0.25)
  // llama3 scaling (HF modeling_rope_utils._compute_llama3_parameters)
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 0;
  // Qwen3.5 multimodal RoPE; for text input every stream is the 1-D position (spec A.5.3).
  std::vector<int64_t> mrope_section;
  bool mrope_interleaved = false;
};

enum class LayerKind { FullAttention, LinearAttention };

// A mixture-of-experts MLP (transformers' Qwen3MoeSparseMoeBlock, Qwen3NextSparseMoeBlock,
// Qwen3_5MoeSparseMoeBlock; spec A.7): every sparse layer routes each token to its top
// experts_per_token of `experts` SwiGLU experts of width expert_intermediate_size, plus, where
// shared_expert_intermediate_size > 0, a shared expert scaled by sigmoid(x·w_gateᵀ).
struct MoeConfig {
  int64_t experts = 0;  // 0: a dense model
  int64_t experts_per_token = 0;
  int64_t expert_intermediate_size = 0;
  int64_t shared_expert_intermediate_size = 0;
  bool normalize_top_k = false;     // renormalise the top-k probabilities to sum to 1
  std::vector<bool> sparse_layers;  // per layer: routed experts (true) or the dense MLP
};

struct ModelConfig {
  std::filesystem::path source;  // the config.json this came from
  std::string model_type;        // the text model's type (e.g. "qwen3_5_text" for a qwen3_5 VL file)
  std::string outer_model_type;  // the top-level model_type when nested (e.g. "qwen3_5"), else equal
  std::vector<std::string> architectures;
  nlohmann::json text_json;      // the (unwrapped) text config as read, for fingerprints

  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;  // explicit, or hidden_size / num_attention_heads
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  std::string hidden_act = "silu";
  RopeConfig rope;
  bool tie_word_embeddings = false;
  bool attention_bias = false;         // q/k/v bias (ModelTypeRules::qkv_bias_always, else attention_bias)
  bool attention_output_bias = false;  // o_proj bias (ModelTypeRules::output_bias_follows_attention_bias)
  bool mlp_bias = false;
  bool qk_norm = false;         // Qwen3 q_norm/k_norm
  std::string torch_dtype;      // "float32" | "bfloat16" | "float16" | "" (as declared)

  // layer_types is filled for every model: all FullAttention unless the model_type's rules give a
  // layer schedule. The linear_* fields are the hybrid family's (Gated DeltaNet), 0 elsewhere.
  std::vector<LayerKind> layer_types;
  int64_t linear_num_key_heads = 0;
  int64_t linear_num_value_heads = 0;
  int64_t linear_key_head_dim = 0;
  int64_t linear_value_head_dim = 0;
  int64_t linear_conv_kernel_dim = 0;
  // The multi-token-prediction layers the hybrid family's checkpoints carry beside the model
  // (Qwen3.5's mtp_num_hidden_layers, Qwen3-Next's num_nextn_predict_layers; 1 when the config does
  // not say, as vLLM reads it), run only for --speculative mtp; 0 elsewhere.
  int64_t mtp_layers = 0;

  MoeConfig moe;  // experts 0 for a dense model

  std::optional<int64_t> bos_token_id;
  std::vector<int64_t> eos_token_ids;

  QuantizationConfig quantization;  // method None for an unquantized checkpoint
};

// What one model_type's configuration class adds to the fields every family shares, from its
// transformers configuration and modeling files. A family's spec (model/family.h) declares the
// rules of each model_type it accepts.
struct ModelTypeRules {
  std::string model_type;
  // q/k/v are biased whatever attention_bias says (Qwen2Attention builds them with bias=True).
  bool qkv_bias_always = false;
  // o_proj is biased when attention_bias is (Llama, Qwen3); false: never (Qwen2Attention).
  bool output_bias_follows_attention_bias = true;
  // q_norm/k_norm over head_dim before RoPE.
  bool qk_norm = false;
  // An absent head_dim is hidden_size / num_attention_heads, unless the class defaults it to a
  // constant (Qwen3: 128, Qwen3.5: 256): then it cannot be derived and is required.
  bool head_dim_required = false;
  // An absent num_key_value_heads is num_attention_heads (plain multi-head), unless the class
  // defaults it to a constant: then it is required.
  bool key_value_heads_required = false;
  // The dense MLP width when the config does not give intermediate_size; absent: required. A
  // family whose every layer is sparse (Qwen3.5-MoE) has no dense MLP and defaults it to 0.
  std::optional<int64_t> default_intermediate_size = std::nullopt;
  // The fraction of head_dim that rotates when the config does not say.
  double default_partial_rotary_factor = 1.0;
  // The kind of each of `layers` layers; absent: all full attention (a `layer_types` list may then
  // name only full_attention).
  std::function<std::vector<LayerKind>(const ConfigFields& text, int64_t layers)> layer_schedule = {};
  // Reads and checks the fields only this family has, after the shared ones; absent: none.
  std::function<void(const ConfigFields& text, ModelConfig& config)> read_family_fields = {};
};

// A multimodal wrapper whose text model kiln serves: the outer model_type and the model_type of
// the `text_config` it nests.
struct ConfigWrapper {
  std::string model_type;
  std::string text_model_type;
};

// The model_types parse_config accepts (in the order errors list them) and the wrappers it unwraps.
struct ConfigVocabulary {
  std::vector<ModelTypeRules> model_types;
  std::vector<ConfigWrapper> wrappers;
};

// Parses and validates a config object of one of `vocabulary`'s model types; `source` names it in
// errors.
ModelConfig parse_config(const nlohmann::json& config, const std::filesystem::path& source,
                         const ConfigVocabulary& vocabulary);
// Reads DIR/config.json (and the token ids of DIR/generation_config.json when present).
ModelConfig load_config(const std::filesystem::path& model_dir, const ConfigVocabulary& vocabulary);

// `layer_types`, when the config lists it: one entry per layer, each one of `kinds` (its name in
// config.json and its kind, in the order errors list them); sliding_attention is refused as such.
std::optional<std::vector<LayerKind>> read_layer_types(const ConfigFields& text, int64_t layers,
                                                       const std::vector<std::pair<std::string, LayerKind>>& kinds);

}  // namespace kiln
