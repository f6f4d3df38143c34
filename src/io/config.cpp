#include "io/config.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <fstream>
#include <limits>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"

namespace kiln {
namespace {

using nlohmann::json;

// What differs between the supported families, from their transformers configuration and
// modeling files (models/{llama,qwen2,qwen3,qwen3_5,qwen3_next}).
struct Family {
  std::string model_type;
  bool qkv_bias_always;  // Qwen2Attention builds q/k/v with bias=True whatever the config says
  bool qk_norm;          // q_norm/k_norm over head_dim before RoPE
  bool hybrid;           // Gated DeltaNet layers mixed with attention layers
  // Qwen3/Qwen3.5/Qwen3-Next configs default head_dim to a constant (128/256), not
  // hidden_size / num_attention_heads, so an absent head_dim cannot be derived: it is required.
  bool head_dim_required;
  // Qwen3NextConfig / Qwen3_5TextConfig default partial_rotary_factor to 0.25; the others rotate
  // the whole head.
  double default_partial_rotary_factor;
};

const std::vector<Family>& families() {
  static const std::vector<Family> table = {
      {"llama", false, false, false, false, 1.0},
      {"qwen2", true, false, false, false, 1.0},
      {"qwen3", false, true, false, true, 1.0},
      {"qwen3_5_text", false, true, true, true, 0.25},
      {"qwen3_next", false, true, true, true, 0.25},
  };
  return table;
}

// Multimodal wrappers whose text model kiln serves: outer model_type → text_config model_type.
const std::vector<std::pair<std::string, std::string>>& wrappers() {
  static const std::vector<std::pair<std::string, std::string>> table = {{"qwen3_5", "qwen3_5_text"}};
  return table;
}

std::string supported_list() {
  std::vector<std::string> names = supported_model_types();
  for (const auto& [outer, inner] : wrappers()) names.push_back(fmt::format("{} (text_config {})", outer, inner));
  return fmt::format("{}", fmt::join(names, ", "));
}

std::string json_kind(const json& value) {
  if (value.is_number_integer()) return "integer";
  if (value.is_number_float()) return "number";
  return value.type_name();
}

// Typed, strict access to the fields of one config object. Errors read
// "<config.json>: field '<prefix><key>': <what is wrong>".
class Fields {
 public:
  Fields(const json& object, const std::filesystem::path& source, std::string prefix)
      : object_(object), source_(source), prefix_(std::move(prefix)) {}

  // Present and not null (transformers writes absent optional values as null).
  bool has(const std::string& key) const { return object_.contains(key) && !object_[key].is_null(); }
  const json& raw(const std::string& key) const { return object_.at(key); }
  std::string name(const std::string& key) const { return prefix_ + key; }
  const std::filesystem::path& source() const { return source_; }

  template <typename... Args>
  [[noreturn]] void fail_field(const std::string& key, fmt::format_string<Args...> format, Args&&... args) const {
    fail("{}: field '{}': {}", source_.string(), name(key), fmt::format(format, std::forward<Args>(args)...));
  }

  int64_t integer(const std::string& key) const {
    if (!has(key)) fail_field(key, "is required");
    const json& value = raw(key);
    if (!value.is_number_integer()) fail_field(key, "is {}, not an integer", value.dump());
    if (value.is_number_unsigned() && value.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      fail_field(key, "is {}, too large", value.dump());
    return value.get<int64_t>();
  }
  int64_t positive_integer(const std::string& key) const {
    const int64_t value = integer(key);
    if (value <= 0) fail_field(key, "is {}, not positive", value);
    return value;
  }
  std::optional<int64_t> optional_positive_integer(const std::string& key) const {
    if (!has(key)) return std::nullopt;
    return positive_integer(key);
  }
  double number(const std::string& key) const {
    if (!has(key)) fail_field(key, "is required");
    const json& value = raw(key);
    if (!value.is_number()) fail_field(key, "is {}, not a number", value.dump());
    return value.get<double>();
  }
  double positive_number(const std::string& key) const {
    const double value = number(key);
    if (!(value > 0) || !std::isfinite(value)) fail_field(key, "is {}, not a positive number", value);
    return value;
  }
  bool boolean(const std::string& key, bool fallback) const {
    if (!has(key)) return fallback;
    const json& value = raw(key);
    if (!value.is_boolean()) fail_field(key, "is {}, not true or false", value.dump());
    return value.get<bool>();
  }
  std::string string(const std::string& key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    const json& value = raw(key);
    if (!value.is_string()) fail_field(key, "is {}, not a string", value.dump());
    return value.get<std::string>();
  }
  Fields object(const std::string& key) const {
    const json& value = raw(key);
    if (!value.is_object()) fail_field(key, "is a JSON {}, not an object", json_kind(value));
    return Fields(value, source_, name(key) + ".");
  }
  // A token id field: an integer, a list of integers, or absent/null.
  std::vector<int64_t> token_ids(const std::string& key) const {
    if (!has(key)) return {};
    const json& value = raw(key);
    std::vector<int64_t> ids;
    auto take = [&](const json& id) {
      const bool valid = id.is_number_unsigned()
                             ? id.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())
                             : id.is_number_integer() && id.get<int64_t>() >= 0;
      if (!valid) fail_field(key, "holds {}, not a non-negative token id", id.dump());
      ids.push_back(id.get<int64_t>());
    };
    if (value.is_array()) {
      for (const json& id : value) take(id);
    } else {
      take(value);
    }
    return ids;
  }

 private:
  const json& object_;
  const std::filesystem::path& source_;
  std::string prefix_;
};

// rope_type, spelled `rope_type` (transformers ≥ 4.45) or `type` (older) in rope_scaling.
std::string read_rope_type(const Fields& rope) {
  const bool has_new = rope.has("rope_type");
  const bool has_old = rope.has("type");
  if (has_new && has_old && rope.string("rope_type", "") != rope.string("type", ""))
    rope.fail_field("type", "'{}' contradicts rope_type '{}'", rope.string("type", ""), rope.string("rope_type", ""));
  return has_new ? rope.string("rope_type", "") : rope.string("type", "default");
}

void read_rope_scaling_fields(const Fields& rope, RopeConfig& config) {
  const std::string type_key = rope.has("rope_type") || !rope.has("type") ? "rope_type" : "type";
  config.type = read_rope_type(rope);
  if (config.type != "default" && config.type != "llama3")
    rope.fail_field(type_key, "unsupported rope type '{}' (kiln supports 'default' and 'llama3')", config.type);
  if (config.type == "llama3") {
    // transformers modeling_rope_utils._compute_llama3_parameters reads all four.
    config.factor = rope.positive_number("factor");
    config.low_freq_factor = rope.positive_number("low_freq_factor");
    config.high_freq_factor = rope.positive_number("high_freq_factor");
    config.original_max_position_embeddings = rope.positive_integer("original_max_position_embeddings");
    if (config.factor < 1.0) rope.fail_field("factor", "is {}, below 1", config.factor);
    if (config.high_freq_factor <= config.low_freq_factor)
      rope.fail_field("high_freq_factor", "is {}, not above low_freq_factor {}", config.high_freq_factor,
                      config.low_freq_factor);
  }
  if (rope.has("mrope_section")) {
    const json& section = rope.raw("mrope_section");
    if (!section.is_array() || section.empty()) rope.fail_field("mrope_section", "is {}, not a list", section.dump());
    for (const json& entry : section) {
      if (!entry.is_number_integer() || entry.get<int64_t>() <= 0)
        rope.fail_field("mrope_section", "holds {}, not a positive integer", entry.dump());
      config.mrope_section.push_back(entry.get<int64_t>());
    }
  }
  config.mrope_interleaved = rope.boolean("mrope_interleaved", false);
}

RopeConfig read_rope(const Fields& text, const Family& family) {
  RopeConfig rope;
  std::optional<double> nested_partial_factor;
  if (text.has("rope_parameters")) {
    // transformers v5 layout: everything inside rope_parameters.
    const Fields parameters = text.object("rope_parameters");
    if (text.has("rope_scaling"))
      text.fail_field("rope_scaling", "is set alongside rope_parameters; only one may describe RoPE");
    rope.theta = parameters.positive_number("rope_theta");
    if (text.has("rope_theta") && text.number("rope_theta") != rope.theta)
      text.fail_field("rope_theta", "is {}, contradicting rope_parameters.rope_theta {}", text.number("rope_theta"),
                      rope.theta);
    read_rope_scaling_fields(parameters, rope);
    if (parameters.has("partial_rotary_factor"))
      nested_partial_factor = parameters.positive_number("partial_rotary_factor");
  } else {
    // Legacy layout: rope_theta at the top, scaling in rope_scaling (null for plain RoPE).
    rope.theta = text.positive_number("rope_theta");
    if (text.has("rope_scaling")) read_rope_scaling_fields(text.object("rope_scaling"), rope);
  }

  rope.partial_rotary_factor = family.default_partial_rotary_factor;
  if (nested_partial_factor) rope.partial_rotary_factor = *nested_partial_factor;
  if (text.has("partial_rotary_factor")) {
    const double top_level = text.positive_number("partial_rotary_factor");
    if (nested_partial_factor && *nested_partial_factor != top_level)
      text.fail_field("partial_rotary_factor", "is {}, contradicting rope_parameters.partial_rotary_factor {}",
                      top_level, *nested_partial_factor);
    rope.partial_rotary_factor = top_level;
  }
  if (rope.partial_rotary_factor > 1.0)
    text.fail_field("partial_rotary_factor", "is {}, above 1", rope.partial_rotary_factor);
  return rope;
}

std::vector<LayerKind> read_layer_types(const Fields& text, const Family& family, int64_t layers) {
  std::vector<LayerKind> kinds;
  if (text.has("layer_types")) {
    const json& list = text.raw("layer_types");
    if (!list.is_array()) text.fail_field("layer_types", "is a JSON {}, not a list", json_kind(list));
    if (static_cast<int64_t>(list.size()) != layers)
      text.fail_field("layer_types", "has {} entries but num_hidden_layers is {}", list.size(), layers);
    for (size_t index = 0; index < list.size(); ++index) {
      const std::string kind = list[index].is_string() ? list[index].get<std::string>() : list[index].dump();
      if (kind == "full_attention") {
        kinds.push_back(LayerKind::FullAttention);
      } else if (kind == "linear_attention" && family.hybrid) {
        kinds.push_back(LayerKind::LinearAttention);
      } else if (kind == "sliding_attention") {
        text.fail_field("layer_types", "entry {} is 'sliding_attention'; sliding-window attention is not supported",
                        index);
      } else {
        text.fail_field("layer_types", "entry {} is '{}', not {}", index, kind,
                        family.hybrid ? "'linear_attention' or 'full_attention'" : "'full_attention'");
      }
    }
    return kinds;
  }
  if (!family.hybrid) return std::vector<LayerKind>(layers, LayerKind::FullAttention);
  // transformers Qwen3NextConfig: layer i is full attention iff (i + 1) % interval == 0, interval 4
  // by default.
  const int64_t interval = text.optional_positive_integer("full_attention_interval").value_or(4);
  for (int64_t index = 0; index < layers; ++index)
    kinds.push_back((index + 1) % interval == 0 ? LayerKind::FullAttention : LayerKind::LinearAttention);
  return kinds;
}

void read_hybrid_fields(const Fields& text, ModelConfig& config) {
  config.linear_num_key_heads = text.positive_integer("linear_num_key_heads");
  config.linear_num_value_heads = text.positive_integer("linear_num_value_heads");
  config.linear_key_head_dim = text.positive_integer("linear_key_head_dim");
  config.linear_value_head_dim = text.positive_integer("linear_value_head_dim");
  config.linear_conv_kernel_dim = text.positive_integer("linear_conv_kernel_dim");
  if (config.linear_num_value_heads % config.linear_num_key_heads != 0)
    text.fail_field("linear_num_value_heads", "{} value heads are not divisible by {} key heads",
                    config.linear_num_value_heads, config.linear_num_key_heads);
  if (config.linear_conv_kernel_dim < 2)
    text.fail_field("linear_conv_kernel_dim", "is {}; a causal conv needs a kernel of at least 2",
                    config.linear_conv_kernel_dim);
}

void check_rotary_dims(const Fields& text, const ModelConfig& config) {
  // transformers: rotary dim = int(head_dim * partial_rotary_factor), rotated in pairs.
  const double rotary_product = static_cast<double>(config.head_dim) * config.rope.partial_rotary_factor;
  // A head_dim near 2^63 rounds up to 2^63 as a double, which int64 cannot hold (the cast would
  // be undefined behaviour).
  if (rotary_product >= 0x1p63)
    text.fail_field("head_dim", "is {}; its rotary dim {} × {} does not fit 64 bits", config.head_dim,
                    config.rope.partial_rotary_factor, config.head_dim);
  const auto rotary_dim = static_cast<int64_t>(rotary_product);
  if (rotary_dim <= 0 || rotary_dim % 2 != 0)
    text.fail_field("partial_rotary_factor", "{} × head_dim {} gives rotary dim {}, not a positive even number",
                    config.rope.partial_rotary_factor, config.head_dim, rotary_dim);
  if (!config.rope.mrope_section.empty()) {
    // Summed in 128 bits: the sections are any positive int64s, whose int64 sum could overflow.
    __int128 pairs = 0;
    for (int64_t section : config.rope.mrope_section) pairs += section;
    if (pairs != rotary_dim / 2)
      text.fail_field(text.has("rope_parameters") ? "rope_parameters.mrope_section" : "rope_scaling.mrope_section",
                      "sums to {} but the rotary dim {} has {} frequency pairs", pairs, rotary_dim, rotary_dim / 2);
  }
}

void merge_ids(std::vector<int64_t>& into, const std::vector<int64_t>& ids) {
  for (int64_t id : ids)
    if (std::find(into.begin(), into.end(), id) == into.end()) into.push_back(id);
}

json read_json_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open ({})", path.string(), std::strerror(errno));
  try {
    return json::parse(in);
  } catch (const json::exception& error) {
    // parse_error for bad syntax, out_of_range for a number beyond a double (found by
    // fuzz/config_fuzz: "1e9551615" escaped as an uncaught exception).
    fail("{}: not valid JSON ({})", path.string(), error.what());
  }
}

}  // namespace

const std::vector<std::string>& supported_model_types() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> list;
    for (const Family& family : families()) list.push_back(family.model_type);
    return list;
  }();
  return names;
}

ModelConfig parse_config(const json& config_json, const std::filesystem::path& source) {
  if (!config_json.is_object()) fail("{}: config is a JSON {}, not an object", source.string(), json_kind(config_json));
  const Fields top(config_json, source, "");
  ModelConfig config;
  config.source = source;
  if (!top.has("model_type")) top.fail_field("model_type", "is required (supported: {})", supported_list());
  config.outer_model_type = top.string("model_type", "");

  // Unwrap a multimodal config to the text model it nests.
  const json* text_json = &config_json;
  std::string prefix;
  for (const auto& [outer, inner] : wrappers()) {
    if (config.outer_model_type != outer) continue;
    if (!top.has("text_config")) top.fail_field("text_config", "is required for model_type '{}'", outer);
    const Fields nested = top.object("text_config");
    const std::string inner_type = nested.string("model_type", inner);
    if (inner_type != inner)
      nested.fail_field("model_type", "is '{}' but a '{}' config nests '{}'", inner_type, outer, inner);
    text_json = &config_json.at("text_config");
    prefix = "text_config.";
    config.model_type = inner;
  }
  if (prefix.empty()) config.model_type = config.outer_model_type;
  const Fields text(*text_json, source, prefix);

  const auto family_it = std::find_if(families().begin(), families().end(),
                                      [&](const Family& family) { return family.model_type == config.model_type; });
  if (family_it == families().end())
    top.fail_field("model_type", "'{}' is not supported (supported: {})", config.model_type, supported_list());
  const Family& family = *family_it;
  config.text_json = *text_json;

  if (top.has("architectures")) {
    const json& list = top.raw("architectures");
    if (!list.is_array()) top.fail_field("architectures", "is a JSON {}, not a list", json_kind(list));
    for (const json& name : list) {
      if (!name.is_string()) top.fail_field("architectures", "holds {}, not a class name", name.dump());
      config.architectures.push_back(name.get<std::string>());
    }
  }
  if (top.has("quantization_config") || text.has("quantization_config"))
    top.fail_field("quantization_config", "quantized checkpoints are not supported until quantization lands");

  config.hidden_size = text.positive_integer("hidden_size");
  config.intermediate_size = text.positive_integer("intermediate_size");
  config.num_hidden_layers = text.positive_integer("num_hidden_layers");
  config.num_attention_heads = text.positive_integer("num_attention_heads");
  // transformers: num_key_value_heads defaults to num_attention_heads (plain multi-head) for the
  // dense families; the hybrid families default it to a constant, so it must be given.
  config.num_key_value_heads = family.hybrid ? text.positive_integer("num_key_value_heads")
                                             : text.optional_positive_integer("num_key_value_heads")
                                                   .value_or(config.num_attention_heads);
  if (config.num_attention_heads % config.num_key_value_heads != 0)
    text.fail_field("num_key_value_heads", "{} attention heads are not divisible by {} key/value heads",
                    config.num_attention_heads, config.num_key_value_heads);
  if (text.has("head_dim") || family.head_dim_required) {
    config.head_dim = text.positive_integer("head_dim");
  } else {
    if (config.hidden_size % config.num_attention_heads != 0)
      text.fail_field("head_dim", "is absent and hidden_size {} is not divisible by {} attention heads",
                      config.hidden_size, config.num_attention_heads);
    config.head_dim = config.hidden_size / config.num_attention_heads;
  }
  config.vocab_size = text.positive_integer("vocab_size");
  config.max_position_embeddings = text.positive_integer("max_position_embeddings");
  config.rms_norm_eps = text.positive_number("rms_norm_eps");
  config.hidden_act = text.string("hidden_act", "silu");
  if (config.hidden_act != "silu")
    text.fail_field("hidden_act", "'{}' is not supported (kiln implements 'silu')", config.hidden_act);
  if (text.boolean("use_sliding_window", false))
    text.fail_field("use_sliding_window", "is true; sliding-window attention is not supported");

  config.rope = read_rope(text, family);
  check_rotary_dims(text, config);

  // transformers ties lm_head to embed_tokens per the config of the model that owns lm_head:
  // for a nested multimodal config that is the outer model (Qwen3_5ForConditionalGeneration reads
  // the top-level flag; the qwen3_5-vl-tiny fixture stores an untied lm_head beside
  // text_config.tie_word_embeddings = true). Every supported config class defaults it to false.
  config.tie_word_embeddings = top.has("tie_word_embeddings") ? top.boolean("tie_word_embeddings", false)
                                                              : text.boolean("tie_word_embeddings", false);
  config.attention_bias = family.qkv_bias_always || text.boolean("attention_bias", false);
  config.mlp_bias = text.boolean("mlp_bias", false);
  config.qk_norm = family.qk_norm;
  // transformers v5 writes `dtype`, v4 wrote `torch_dtype`.
  const Fields& dtype_fields = text.has("dtype") || text.has("torch_dtype") ? text : top;
  const std::string dtype_key = dtype_fields.has("dtype") ? "dtype" : "torch_dtype";
  config.torch_dtype = dtype_fields.string(dtype_key, "");
  if (!config.torch_dtype.empty() && config.torch_dtype != "float32" && config.torch_dtype != "bfloat16" &&
      config.torch_dtype != "float16")
    dtype_fields.fail_field(dtype_key, "'{}' is not float32, bfloat16 or float16", config.torch_dtype);

  config.layer_types = read_layer_types(text, family, config.num_hidden_layers);
  if (family.hybrid) read_hybrid_fields(text, config);

  // Token ids: the text config first, then the top level of a nested config.
  for (const Fields* fields : {&text, &top}) {
    merge_ids(config.eos_token_ids, fields->token_ids("eos_token_id"));
    const std::vector<int64_t> bos = fields->token_ids("bos_token_id");
    if (bos.size() > 1) fields->fail_field("bos_token_id", "lists {} ids; a model has one", bos.size());
    if (!config.bos_token_id && !bos.empty()) config.bos_token_id = bos.front();
  }
  for (int64_t id : config.eos_token_ids)
    if (id >= config.vocab_size) text.fail_field("eos_token_id", "{} is outside the vocabulary of {}", id, config.vocab_size);
  if (config.bos_token_id && *config.bos_token_id >= config.vocab_size)
    text.fail_field("bos_token_id", "{} is outside the vocabulary of {}", *config.bos_token_id, config.vocab_size);
  return config;
}

ModelConfig load_config(const std::filesystem::path& model_dir) {
  const auto config_path = model_dir / "config.json";
  ModelConfig config = parse_config(read_json_file(config_path), config_path);

  // generation_config.json (written beside config.json by save_pretrained) is what
  // transformers' generate() reads: its eos ids join the model's, and its bos id wins.
  const auto generation_path = model_dir / "generation_config.json";
  if (std::filesystem::exists(generation_path)) {
    const json generation = read_json_file(generation_path);
    if (!generation.is_object())
      fail("{}: generation config is a JSON {}, not an object", generation_path.string(), json_kind(generation));
    const Fields fields(generation, generation_path, "");
    merge_ids(config.eos_token_ids, fields.token_ids("eos_token_id"));
    const std::vector<int64_t> bos = fields.token_ids("bos_token_id");
    if (bos.size() > 1) fields.fail_field("bos_token_id", "lists {} ids; a model has one", bos.size());
    if (!bos.empty()) config.bos_token_id = bos.front();
    for (int64_t id : config.eos_token_ids)
      if (id >= config.vocab_size)
        fields.fail_field("eos_token_id", "{} is outside the vocabulary of {}", id, config.vocab_size);
    if (config.bos_token_id && *config.bos_token_id >= config.vocab_size)
      fields.fail_field("bos_token_id", "{} is outside the vocabulary of {}", *config.bos_token_id, config.vocab_size);
  }
  return config;
}

}  // namespace kiln
