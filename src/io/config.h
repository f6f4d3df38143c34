// config.json → ModelConfig: every field that shapes a graph, parsed strictly.
//
// Supported model_type values (text config, after unwrapping a nested `text_config`):
//   llama (Llama-2/3, MiniCPM5), qwen2, qwen3, qwen3_5_text (Qwen3.5 dense), qwen3_next.
// An unknown model_type, a missing required field, or an unsupported value (e.g. an unknown
// rope_type) is a kiln::Error naming the file and the field — never a guess.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

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
  bool attention_bias = false;  // q/k/v bias (Qwen2 always; Llama when attention_bias is true)
  bool mlp_bias = false;
  bool qk_norm = false;         // Qwen3 q_norm/k_norm
  std::string torch_dtype;      // "float32" | "bfloat16" | "float16" | "" (as declared)

  // Hybrid models (qwen3_5_text, qwen3_next). layer_types is filled for every model:
  // all FullAttention for dense families.
  std::vector<LayerKind> layer_types;
  int64_t linear_num_key_heads = 0;
  int64_t linear_num_value_heads = 0;
  int64_t linear_key_head_dim = 0;
  int64_t linear_value_head_dim = 0;
  int64_t linear_conv_kernel_dim = 0;

  std::optional<int64_t> bos_token_id;
  std::vector<int64_t> eos_token_ids;

  bool is_hybrid() const { return model_type == "qwen3_5_text" || model_type == "qwen3_next"; }
};

// The model types parse_config accepts, in the order errors list them.
const std::vector<std::string>& supported_model_types();

// Parses and validates a config object; `source` names it in errors.
ModelConfig parse_config(const nlohmann::json& config, const std::filesystem::path& source);
// Reads DIR/config.json.
ModelConfig load_config(const std::filesystem::path& model_dir);

}  // namespace kiln
