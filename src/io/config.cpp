#include "io/config.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <fstream>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"

namespace kiln {
namespace {

using nlohmann::json;

std::string supported_list(const ConfigVocabulary& vocabulary) {
  std::vector<std::string> names;
  for (const ModelTypeRules& rules : vocabulary.model_types) names.push_back(rules.model_type);
  for (const ConfigWrapper& wrapper : vocabulary.wrappers)
    names.push_back(fmt::format("{} (text_config {})", wrapper.model_type, wrapper.text_model_type));
  return fmt::format("{}", fmt::join(names, ", "));
}

// rope_type, spelled `rope_type` (transformers ≥ 4.45) or `type` (older) in rope_scaling.
std::string read_rope_type(const ConfigFields& rope) {
  const bool has_new = rope.has("rope_type");
  const bool has_old = rope.has("type");
  if (has_new && has_old && rope.string("rope_type", "") != rope.string("type", ""))
    rope.fail_field("type", "'{}' contradicts rope_type '{}'", rope.string("type", ""), rope.string("rope_type", ""));
  return has_new ? rope.string("rope_type", "") : rope.string("type", "default");
}

void read_rope_scaling_fields(const ConfigFields& rope, RopeConfig& config) {
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
      if (!entry.is_number_integer() || entry.get<int64_t>() < 0)
        rope.fail_field("mrope_section", "holds {}, not a non-negative integer", entry.dump());
      config.mrope_section.push_back(entry.get<int64_t>());
    }
  }
  config.mrope_interleaved = rope.boolean("mrope_interleaved", false);
}

RopeConfig read_rope(const ConfigFields& text, const ModelTypeRules& rules) {
  RopeConfig rope;
  std::optional<double> nested_partial_factor;
  if (text.has("rope_parameters")) {
    // transformers v5 layout: everything inside rope_parameters.
    const ConfigFields parameters = text.object("rope_parameters");
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

  rope.partial_rotary_factor = rules.default_partial_rotary_factor;
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

void check_rotary_dims(const ConfigFields& text, const ModelConfig& config) {
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
  // transformers' interleaved mRoPE (Qwen3.5) writes the height and width sections into every
  // third frequency pair and leaves the rest to the temporal stream, so any sections run; the
  // chunked layout (Qwen2-VL) splits the pairs by the sections, which must then cover them exactly.
  // For text input every stream carries the same position, so the sections do not change the result.
  if (!config.rope.mrope_section.empty() && !config.rope.mrope_interleaved) {
    // Summed in 128 bits: the sections are any non-negative int64s, whose int64 sum could overflow.
    __int128 pairs = 0;
    for (int64_t section : config.rope.mrope_section) pairs += section;
    if (pairs != rotary_dim / 2)
      text.fail_field(text.has("rope_parameters") ? "rope_parameters.mrope_section" : "rope_scaling.mrope_section",
                      "sums to {} but the rotary dim {} has {} frequency pairs (sections that are not interleaved "
                      "must cover them)",
                      pairs, rotary_dim, rotary_dim / 2);
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

std::optional<std::vector<LayerKind>> read_layer_types(const ConfigFields& text, int64_t layers,
                                                       const std::vector<std::pair<std::string, LayerKind>>& kinds) {
  if (!text.has("layer_types")) return std::nullopt;
  const json& list = text.raw("layer_types");
  if (!list.is_array()) text.fail_field("layer_types", "is a JSON {}, not a list", json_kind(list));
  if (static_cast<int64_t>(list.size()) != layers)
    text.fail_field("layer_types", "has {} entries but num_hidden_layers is {}", list.size(), layers);
  std::vector<LayerKind> schedule;
  for (size_t index = 0; index < list.size(); ++index) {
    const std::string kind = list[index].is_string() ? list[index].get<std::string>() : list[index].dump();
    const auto known = std::find_if(kinds.begin(), kinds.end(), [&](const auto& entry) { return entry.first == kind; });
    if (known != kinds.end()) {
      schedule.push_back(known->second);
      continue;
    }
    if (kind == "sliding_attention")
      text.fail_field("layer_types", "entry {} is 'sliding_attention'; sliding-window attention is not supported",
                      index);
    std::vector<std::string> accepted;
    for (const auto& entry : kinds) accepted.push_back("'" + entry.first + "'");
    text.fail_field("layer_types", "entry {} is '{}', not {}", index, kind, fmt::join(accepted, " or "));
  }
  return schedule;
}

ModelConfig parse_config(const json& config_json, const std::filesystem::path& source,
                         const ConfigVocabulary& vocabulary) {
  if (!config_json.is_object()) fail("{}: config is a JSON {}, not an object", source.string(), json_kind(config_json));
  const ConfigFields top(config_json, source, "");
  ModelConfig config;
  config.source = source;
  if (!top.has("model_type")) top.fail_field("model_type", "is required (supported: {})", supported_list(vocabulary));
  config.outer_model_type = top.string("model_type", "");

  // Unwrap a multimodal config to the text model it nests.
  const json* text_json = &config_json;
  std::string prefix;
  for (const auto& [outer, inner] : vocabulary.wrappers) {
    if (config.outer_model_type != outer) continue;
    if (!top.has("text_config")) top.fail_field("text_config", "is required for model_type '{}'", outer);
    const ConfigFields nested = top.object("text_config");
    const std::string inner_type = nested.string("model_type", inner);
    if (inner_type != inner)
      nested.fail_field("model_type", "is '{}' but a '{}' config nests '{}'", inner_type, outer, inner);
    text_json = &config_json.at("text_config");
    prefix = "text_config.";
    config.model_type = inner;
  }
  if (prefix.empty()) config.model_type = config.outer_model_type;
  const ConfigFields text(*text_json, source, prefix);

  const auto rules_it =
      std::find_if(vocabulary.model_types.begin(), vocabulary.model_types.end(),
                   [&](const ModelTypeRules& rules) { return rules.model_type == config.model_type; });
  if (rules_it == vocabulary.model_types.end())
    top.fail_field("model_type", "'{}' is not supported (supported: {})", config.model_type,
                   supported_list(vocabulary));
  const ModelTypeRules& rules = *rules_it;
  config.text_json = *text_json;

  if (top.has("architectures")) {
    const json& list = top.raw("architectures");
    if (!list.is_array()) top.fail_field("architectures", "is a JSON {}, not a list", json_kind(list));
    for (const json& name : list) {
      if (!name.is_string()) top.fail_field("architectures", "holds {}, not a class name", name.dump());
      config.architectures.push_back(name.get<std::string>());
    }
  }
  config.quantization = parse_quantization_config(top, text);

  config.hidden_size = text.positive_integer("hidden_size");
  config.intermediate_size = text.has("intermediate_size") || !rules.default_intermediate_size
                                 ? text.positive_integer("intermediate_size")
                                 : *rules.default_intermediate_size;
  config.num_hidden_layers = text.positive_integer("num_hidden_layers");
  config.num_attention_heads = text.positive_integer("num_attention_heads");
  config.num_key_value_heads = rules.key_value_heads_required
                                   ? text.positive_integer("num_key_value_heads")
                                   : text.optional_positive_integer("num_key_value_heads")
                                         .value_or(config.num_attention_heads);
  if (config.num_attention_heads % config.num_key_value_heads != 0)
    text.fail_field("num_key_value_heads", "{} attention heads are not divisible by {} key/value heads",
                    config.num_attention_heads, config.num_key_value_heads);
  if (text.has("head_dim") || rules.head_dim_required) {
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

  config.rope = read_rope(text, rules);
  check_rotary_dims(text, config);

  // transformers ties lm_head to embed_tokens per the config of the model that owns lm_head:
  // for a nested multimodal config that is the outer model (Qwen3_5ForConditionalGeneration reads
  // the top-level flag; the qwen3_5-vl-tiny fixture stores an untied lm_head beside
  // text_config.tie_word_embeddings = true). Every supported config class defaults it to false.
  config.tie_word_embeddings = top.has("tie_word_embeddings") ? top.boolean("tie_word_embeddings", false)
                                                              : text.boolean("tie_word_embeddings", false);
  const bool attention_bias = text.boolean("attention_bias", false);
  config.attention_bias = rules.qkv_bias_always || attention_bias;
  config.attention_output_bias = rules.output_bias_follows_attention_bias && attention_bias;
  config.mlp_bias = text.boolean("mlp_bias", false);
  config.qk_norm = rules.qk_norm;
  // transformers v5 writes `dtype`, v4 wrote `torch_dtype`.
  const ConfigFields& dtype_fields = text.has("dtype") || text.has("torch_dtype") ? text : top;
  const std::string dtype_key = dtype_fields.has("dtype") ? "dtype" : "torch_dtype";
  config.torch_dtype = dtype_fields.string(dtype_key, "");
  if (!config.torch_dtype.empty() && config.torch_dtype != "float32" && config.torch_dtype != "bfloat16" &&
      config.torch_dtype != "float16")
    dtype_fields.fail_field(dtype_key, "'{}' is not float32, bfloat16 or float16", config.torch_dtype);

  config.layer_types =
      rules.layer_schedule
          ? rules.layer_schedule(text, config.num_hidden_layers)
          : read_layer_types(text, config.num_hidden_layers, {{"full_attention", LayerKind::FullAttention}})
                .value_or(std::vector<LayerKind>(config.num_hidden_layers, LayerKind::FullAttention));
  if (rules.read_family_fields) rules.read_family_fields(text, config);

  // Token ids: the text config first, then the top level of a nested config.
  for (const ConfigFields* fields : {&text, &top}) {
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

ModelConfig load_config(const std::filesystem::path& model_dir, const ConfigVocabulary& vocabulary) {
  const auto config_path = model_dir / "config.json";
  ModelConfig config = parse_config(read_json_file(config_path), config_path, vocabulary);

  // generation_config.json (written beside config.json by save_pretrained) is what
  // transformers' generate() reads: its eos ids join the model's, and its bos id wins.
  const auto generation_path = model_dir / "generation_config.json";
  if (std::filesystem::exists(generation_path)) {
    const json generation = read_json_file(generation_path);
    if (!generation.is_object())
      fail("{}: generation config is a JSON {}, not an object", generation_path.string(), json_kind(generation));
    const ConfigFields fields(generation, generation_path, "");
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
