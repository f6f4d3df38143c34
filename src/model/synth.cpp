#include "model/synth.h"

#include <algorithm>
#include <cmath>
#include <fstream>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "core/thread_pool.h"
#include "io/safetensors_writer.h"

namespace kiln {
namespace {

using nlohmann::json;

// The sizes that differ between the Qwen3.5 text shapes; every other field is Qwen3_5TextConfig's
// default: head_dim 256, linear heads of 128 (16 key heads), conv kernel 4, partial rotary 0.25,
// rope_theta 1e7, vocabulary 248320, every 4th layer full attention (full_attention_interval 4).
struct Qwen35Sizes {
  int hidden, intermediate, layers, heads, kv_heads, linear_value_heads;
  bool tied;
};

json qwen3_5_text_config(const Qwen35Sizes& sizes) {
  json layer_types = json::array();
  for (int layer = 0; layer < sizes.layers; ++layer)
    layer_types.push_back((layer + 1) % 4 == 0 ? "full_attention" : "linear_attention");
  json config = json::parse(R"({
    "architectures": ["Qwen3_5ForCausalLM"],
    "attention_bias": false,
    "attention_dropout": 0.0,
    "bos_token_id": null,
    "eos_token_id": null,
    "head_dim": 256,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "model_type": "qwen3_5_text",
    "pad_token_id": null,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"mrope_interleaved": true, "mrope_section": [11, 11, 10],
                        "partial_rotary_factor": 0.25, "rope_theta": 10000000.0, "rope_type": "default"},
    "torch_dtype": "bfloat16",
    "use_cache": true,
    "vocab_size": 248320
  })");
  config["hidden_size"] = sizes.hidden;
  config["intermediate_size"] = sizes.intermediate;
  config["num_hidden_layers"] = sizes.layers;
  config["layer_types"] = layer_types;
  config["num_attention_heads"] = sizes.heads;
  config["num_key_value_heads"] = sizes.kv_heads;
  config["linear_num_value_heads"] = sizes.linear_value_heads;
  config["tie_word_embeddings"] = sizes.tied;
  return config;
}

// The config.json files as published on the Hugging Face Hub, field for field (the Qwen3.5
// entries say where theirs come from).
const std::vector<SynthShape>& shape_table() {
  static const std::vector<SynthShape> table = {
      {"llama-3.2-1b", "meta-llama/Llama-3.2-1B", json::parse(R"({
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": false,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 8192,
        "max_position_embeddings": 131072,
        "mlp_bias": false,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 16,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0,
        "tie_word_embeddings": true,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0.dev0",
        "use_cache": true,
        "vocab_size": 128256
      })")},
      {"llama-3.1-8b", "meta-llama/Llama-3.1-8B", json::parse(R"({
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": false,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "mlp_bias": false,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0,
        "tie_word_embeddings": false,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.43.0.dev0",
        "use_cache": true,
        "vocab_size": 128256
      })")},
      {"qwen3-0.6b", "Qwen/Qwen3-0.6B", json::parse(R"({
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": false,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 1024,
        "initializer_range": 0.02,
        "intermediate_size": 3072,
        "max_position_embeddings": 40960,
        "max_window_layers": 28,
        "model_type": "qwen3",
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": null,
        "rope_theta": 1000000,
        "sliding_window": null,
        "tie_word_embeddings": true,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": true,
        "use_sliding_window": false,
        "vocab_size": 151936
      })")},
      {"qwen3-8b", "Qwen/Qwen3-8B", json::parse(R"({
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": false,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 12288,
        "max_position_embeddings": 40960,
        "max_window_layers": 36,
        "model_type": "qwen3",
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": null,
        "rope_theta": 1000000,
        "sliding_window": null,
        "tie_word_embeddings": false,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": true,
        "use_sliding_window": false,
        "vocab_size": 151936
      })")},
      // transformers' Qwen3_5TextConfig() defaults, which are the 9B model's text decoder
      // (configuration_qwen3_5.py), written as save_pretrained writes a Qwen3_5ForCausalLM.
      {"qwen3.5-9b", "transformers Qwen3_5TextConfig defaults",
       qwen3_5_text_config({.hidden = 4096, .intermediate = 12288, .layers = 32, .heads = 16, .kv_heads = 4,
                            .linear_value_heads = 32, .tied = false})},
      // A ~1.9B-parameter hybrid for 2B-class benchmarks: the published Qwen3.5-2B's hidden size
      // (2048), vocabulary and head geometry with the 3:1 linear/full schedule; the layer count
      // and MLP width are ours (the published config was not reachable), hence "-like".
      {"qwen3.5-2b-like", "kiln (Qwen3.5-2B-sized; not a published config)",
       qwen3_5_text_config({.hidden = 2048, .intermediate = 6144, .layers = 24, .heads = 8, .kv_heads = 2,
                            .linear_value_heads = 16, .tied = true})},
  };
  return table;
}

// transformers' initializer_range in every config above.
constexpr float kInitStd = 0.02f;

// SplitMix64's output function (Steele, Lea & Flood, "Fast splittable pseudorandom number
// generators", OOPSLA 2014): a bijective 64-bit mix whose outputs pass BigCrush for counter inputs.
uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// 64-bit FNV-1a of the tensor name, so every tensor gets its own stream.
uint64_t name_hash(const std::string& name) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (unsigned char c : name) hash = (hash ^ c) * 0x100000001b3ull;
  return hash;
}

// A standard-normal-like value from 64 random bits: the Irwin–Hall sum of four 16-bit uniforms,
// centred and scaled to unit variance (each uniform on {0..65535} has variance (65536² − 1)/12).
float normal_like(uint64_t bits) {
  const double sum = static_cast<double>((bits & 0xffff) + ((bits >> 16) & 0xffff) + ((bits >> 32) & 0xffff) +
                                         (bits >> 48));
  constexpr double kMean = 4 * 32767.5;
  static const double kStd = std::sqrt(4 * (65536.0 * 65536.0 - 1) / 12);
  return static_cast<float>((sum - kMean) / kStd);
}

TensorByteFill make_fill(const SynthTensor& tensor, DType dtype, uint64_t seed) {
  const uint64_t stream = mix64(seed ^ mix64(name_hash(tensor.name)));
  const SynthInit init = tensor.init;
  return [stream, init, dtype](uint64_t offset, std::span<uint8_t> out) {
    const size_t element_size = dtype_size(dtype);
    const uint64_t first = offset / element_size;
    const auto count = static_cast<int64_t>(out.size() / element_size);
    auto value_at = [&](uint64_t index) {
      if (init == SynthInit::Ones) return 1.0f;
      if (init == SynthInit::Zeros) return 0.0f;
      return kInitStd * normal_like(mix64(stream + index));
    };
    // Each element depends only on its index, so any split over threads gives the same bytes.
    ThreadPool::global().parallel_for(count, 1 << 14, [&](int64_t begin, int64_t end) {
      if (dtype == DType::F32) {
        auto* values = reinterpret_cast<float*>(out.data());
        for (int64_t i = begin; i < end; ++i) values[i] = value_at(first + i);
      } else {
        auto* values = reinterpret_cast<uint16_t*>(out.data());
        for (int64_t i = begin; i < end; ++i)
          values[i] = dtype == DType::BF16 ? f32_to_bf16(value_at(first + i)) : f32_to_f16(value_at(first + i));
      }
    });
  };
}

std::string torch_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32: return "float32";
    case DType::BF16: return "bfloat16";
    case DType::F16: return "float16";
    case DType::I32: break;
  }
  fail("synth writes F32, F16 or BF16 weights, not {}", dtype_name(dtype));
}

}  // namespace

const std::vector<SynthShape>& synth_shapes() { return shape_table(); }

const SynthShape& find_synth_shape(const std::string& name) {
  for (const SynthShape& shape : shape_table())
    if (shape.name == name) return shape;
  std::vector<std::string> names;
  for (const SynthShape& shape : shape_table()) names.push_back(shape.name);
  fail("synth: unknown shape '{}' (known: {})", name, fmt::join(names, ", "));
}

namespace {

// Llama / Qwen2 / Qwen3: transformers' LlamaForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM
// parameter names and shapes.
std::vector<SynthTensor> dense_decoder_layout(const ModelConfig& config) {
  const int64_t hidden = config.hidden_size;
  const int64_t q_width = config.num_attention_heads * config.head_dim;
  const int64_t kv_width = config.num_key_value_heads * config.head_dim;
  const int64_t intermediate = config.intermediate_size;
  // Llama and Qwen3 give all four attention projections a bias when attention_bias is set; Qwen2
  // biases q/k/v only.
  const bool output_bias = config.attention_bias && config.model_type != "qwen2";

  std::vector<SynthTensor> tensors;
  tensors.push_back({"model.embed_tokens.weight", {config.vocab_size, hidden}});
  for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer) {
    const std::string prefix = fmt::format("model.layers.{}.", layer);
    tensors.push_back({prefix + "input_layernorm.weight", {hidden}, SynthInit::Ones});
    tensors.push_back({prefix + "self_attn.q_proj.weight", {q_width, hidden}});
    tensors.push_back({prefix + "self_attn.k_proj.weight", {kv_width, hidden}});
    tensors.push_back({prefix + "self_attn.v_proj.weight", {kv_width, hidden}});
    tensors.push_back({prefix + "self_attn.o_proj.weight", {hidden, q_width}});
    if (config.attention_bias) {
      tensors.push_back({prefix + "self_attn.q_proj.bias", {q_width}});
      tensors.push_back({prefix + "self_attn.k_proj.bias", {kv_width}});
      tensors.push_back({prefix + "self_attn.v_proj.bias", {kv_width}});
    }
    if (output_bias) tensors.push_back({prefix + "self_attn.o_proj.bias", {hidden}});
    if (config.qk_norm) {
      tensors.push_back({prefix + "self_attn.q_norm.weight", {config.head_dim}, SynthInit::Ones});
      tensors.push_back({prefix + "self_attn.k_norm.weight", {config.head_dim}, SynthInit::Ones});
    }
    tensors.push_back({prefix + "post_attention_layernorm.weight", {hidden}, SynthInit::Ones});
    tensors.push_back({prefix + "mlp.gate_proj.weight", {intermediate, hidden}});
    tensors.push_back({prefix + "mlp.up_proj.weight", {intermediate, hidden}});
    tensors.push_back({prefix + "mlp.down_proj.weight", {hidden, intermediate}});
    if (config.mlp_bias) {
      tensors.push_back({prefix + "mlp.gate_proj.bias", {intermediate}});
      tensors.push_back({prefix + "mlp.up_proj.bias", {intermediate}});
      tensors.push_back({prefix + "mlp.down_proj.bias", {hidden}});
    }
  }
  tensors.push_back({"model.norm.weight", {hidden}, SynthInit::Ones});
  if (!config.tie_word_embeddings) tensors.push_back({"lm_head.weight", {config.vocab_size, hidden}});
  return tensors;
}

// Qwen3.5 text decoder as transformers' Qwen3_5ForCausalLM saves it (spec A): zero-centred
// RMSNorm gains (stored w, applied as 1 + w), gated attention (q_proj carries query and gate per
// head), Gated DeltaNet layers with the depthwise conv weight in torch's [C, 1, K] layout.
std::vector<SynthTensor> qwen3_5_text_layout(const ModelConfig& config) {
  const int64_t hidden = config.hidden_size;
  const int64_t head_dim = config.head_dim;
  const int64_t key_width = config.linear_num_key_heads * config.linear_key_head_dim;
  const int64_t value_width = config.linear_num_value_heads * config.linear_value_head_dim;
  const int64_t conv_channels = 2 * key_width + value_width;
  const int64_t value_heads = config.linear_num_value_heads;
  const int64_t intermediate = config.intermediate_size;

  std::vector<SynthTensor> tensors;
  tensors.push_back({"model.embed_tokens.weight", {config.vocab_size, hidden}});
  for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer) {
    const std::string prefix = fmt::format("model.layers.{}.", layer);
    tensors.push_back({prefix + "input_layernorm.weight", {hidden}, SynthInit::Zeros});
    if (config.layer_types.at(static_cast<size_t>(layer)) == LayerKind::FullAttention) {
      const std::string attention = prefix + "self_attn.";
      tensors.push_back({attention + "q_proj.weight", {2 * config.num_attention_heads * head_dim, hidden}});
      tensors.push_back({attention + "k_proj.weight", {config.num_key_value_heads * head_dim, hidden}});
      tensors.push_back({attention + "v_proj.weight", {config.num_key_value_heads * head_dim, hidden}});
      tensors.push_back({attention + "o_proj.weight", {hidden, config.num_attention_heads * head_dim}});
      tensors.push_back({attention + "q_norm.weight", {head_dim}, SynthInit::Zeros});
      tensors.push_back({attention + "k_norm.weight", {head_dim}, SynthInit::Zeros});
    } else {
      const std::string linear = prefix + "linear_attn.";
      tensors.push_back({linear + "in_proj_qkv.weight", {conv_channels, hidden}});
      tensors.push_back({linear + "in_proj_z.weight", {value_width, hidden}});
      tensors.push_back({linear + "in_proj_b.weight", {value_heads, hidden}});
      tensors.push_back({linear + "in_proj_a.weight", {value_heads, hidden}});
      tensors.push_back({linear + "conv1d.weight", {conv_channels, 1, config.linear_conv_kernel_dim}});
      tensors.push_back({linear + "dt_bias", {value_heads}, SynthInit::Ones});
      tensors.push_back({linear + "A_log", {value_heads}});
      tensors.push_back({linear + "norm.weight", {config.linear_value_head_dim}, SynthInit::Ones});
      tensors.push_back({linear + "out_proj.weight", {hidden, value_width}});
    }
    tensors.push_back({prefix + "post_attention_layernorm.weight", {hidden}, SynthInit::Zeros});
    tensors.push_back({prefix + "mlp.gate_proj.weight", {intermediate, hidden}});
    tensors.push_back({prefix + "mlp.up_proj.weight", {intermediate, hidden}});
    tensors.push_back({prefix + "mlp.down_proj.weight", {hidden, intermediate}});
  }
  tensors.push_back({"model.norm.weight", {hidden}, SynthInit::Zeros});
  if (!config.tie_word_embeddings) tensors.push_back({"lm_head.weight", {config.vocab_size, hidden}});
  return tensors;
}

using LayoutFunction = std::vector<SynthTensor> (*)(const ModelConfig&);

// model_type → the checkpoint layout synth writes for it.
const std::vector<std::pair<std::string, LayoutFunction>>& layouts() {
  static const std::vector<std::pair<std::string, LayoutFunction>> table = {
      {"llama", dense_decoder_layout}, {"qwen2", dense_decoder_layout}, {"qwen3", dense_decoder_layout},
      {"qwen3_5_text", qwen3_5_text_layout}};
  return table;
}

// Applies --layers to a config: the first `layers` layers of the model (in the nested text
// config when there is one, with layer_types cut to match).
void override_layers(json& config_json, int64_t layers, const std::string& shape) {
  if (layers <= 0) fail("synth: --layers must be positive, not {}", layers);
  json& text = config_json.contains("text_config") ? config_json["text_config"] : config_json;
  text["num_hidden_layers"] = layers;
  if (text.contains("layer_types") && text["layer_types"].is_array()) {
    json& kinds = text["layer_types"];
    if (static_cast<int64_t>(kinds.size()) < layers)
      fail("synth: shape '{}' lists {} layer_types; it cannot have {} layers", shape, kinds.size(), layers);
    kinds.erase(kinds.begin() + layers, kinds.end());
  }
}

}  // namespace

std::vector<SynthTensor> synth_tensor_layout(const ModelConfig& config) {
  std::vector<std::string> known;
  for (const auto& [model_type, layout] : layouts()) {
    if (model_type == config.model_type) return layout(config);
    known.push_back(model_type);
  }
  fail("synth: no tensor layout for model_type '{}' (it knows {})", config.model_type, fmt::join(known, ", "));
}

SynthResult write_synthetic_checkpoint(const SynthOptions& options) {
  const SynthShape& shape = find_synth_shape(options.shape);
  if (std::filesystem::exists(options.out) &&
      (!std::filesystem::is_directory(options.out) || !std::filesystem::is_empty(options.out)))
    fail("{}: synth writes into a new or empty directory", options.out.string());

  json config_json = shape.config;
  if (options.layers) override_layers(config_json, *options.layers, shape.name);
  // save_pretrained records the dtype the weights were written in (`dtype` since transformers v5).
  config_json[config_json.contains("dtype") ? "dtype" : "torch_dtype"] = torch_dtype_name(options.dtype);
  const auto config_path = options.out / "config.json";

  SynthResult result;
  result.config = parse_config(config_json, config_path);
  std::vector<SafetensorsEntry> entries;
  for (const SynthTensor& tensor : synth_tensor_layout(result.config)) {
    SafetensorsEntry entry;
    entry.name = tensor.name;
    entry.dtype = options.dtype;
    entry.shape = tensor.shape;
    entry.fill = make_fill(tensor, options.dtype, options.seed);
    result.tensor_bytes += entry.nbytes();
    entries.push_back(std::move(entry));
  }
  result.tensor_count = entries.size();

  std::filesystem::create_directories(options.out);
  {
    std::ofstream out(config_path);
    out << config_json.dump(2) << "\n";
    out.close();
    if (!out) fail("{}: write failed", config_path.string());
  }
  result.files.push_back(config_path);
  for (auto& file : write_sharded_safetensors(options.out, entries, options.max_shard_bytes))
    result.files.push_back(std::move(file));
  return result;
}

}  // namespace kiln
