#include "io/quantization_config.h"

#include <set>

#include "core/weight.h"

namespace kiln {
namespace {

using json = nlohmann::json;

int affine_bits(const ConfigFields& fields, const std::string& key, bool (*allowed)(int), const char* list) {
  const int64_t bits = fields.integer(key);
  if (!allowed(static_cast<int>(bits)) || bits > 8)
    fields.fail_field(key, "is {}; kiln runs {}", bits, list);
  return static_cast<int>(bits);
}

int group_size(const ConfigFields& fields, const std::string& key) {
  const int64_t group = fields.integer(key);
  if (!is_affine_group_size(static_cast<int>(group)) || group > 128)
    fields.fail_field(key, "is {}; kiln runs group sizes 32, 64 and 128", group);
  return static_cast<int>(group);
}

bool mlx_bits(int bits) { return is_affine_bits(bits); }
bool gptq_bits(int bits) { return bits == 4 || bits == 8; }
// AutoAWQ's GEMM packing (awq/modules/linear/gemm.py) has an interleave order for 4 bits only.
bool awq_bits(int bits) { return bits == 4; }

// The keys of an MLX quantization object that are settings, not module paths.
const std::set<std::string> kMlxSettings = {"group_size", "bits", "mode", "quant_method"};

QuantizationConfig parse_mlx(const ConfigFields& fields) {
  QuantizationConfig config;
  config.method = QuantMethod::MlxAffine;
  if (fields.has("mode") && fields.string("mode", "affine") != "affine")
    fields.fail_field("mode", "is '{}'; kiln runs MLX's 'affine' mode", fields.string("mode", ""));
  config.affine = {affine_bits(fields, "bits", mlx_bits, "2, 3, 4, 5, 6 or 8 bits"), group_size(fields, "group_size")};
  for (const auto& [key, value] : fields.raw_object().items()) {
    if (kMlxSettings.count(key)) continue;
    if (value.is_boolean() && !value.get<bool>()) {
      config.module_schemes.emplace(key, std::nullopt);
      continue;
    }
    if (!value.is_object())
      fields.fail_field(key, "is {}; a per-module entry is {{\"group_size\", \"bits\"}} or false", value.dump());
    const ConfigFields module = fields.object(key);
    config.module_schemes.emplace(
        key, AffineScheme{affine_bits(module, "bits", mlx_bits, "2, 3, 4, 5, 6 or 8 bits"),
                          module.has("group_size") ? group_size(module, "group_size") : config.affine.group_size});
  }
  return config;
}

QuantizationConfig parse_method(const ConfigFields& fields, const std::string& method) {
  QuantizationConfig config;
  if (method == "awq") {
    config.method = QuantMethod::Awq;
    const std::string bits_key = fields.has("w_bit") ? "w_bit" : "bits";
    const std::string group_key = fields.has("q_group_size") ? "q_group_size" : "group_size";
    config.affine = {affine_bits(fields, bits_key, awq_bits, "AWQ's GEMM packing at 4 bits"), group_size(fields, group_key)};
    const std::string version = fields.string("version", "gemm");
    if (version != "gemm" && version != "GEMM")
      fields.fail_field("version", "is '{}'; kiln reads AWQ's GEMM packing ('gemm')", version);
    if (!fields.boolean("zero_point", true)) fields.fail_field("zero_point", "is false; kiln reads AWQ with zero points");
    return config;
  }
  if (method == "gptq") {
    config.method = QuantMethod::Gptq;
    config.affine = {affine_bits(fields, "bits", gptq_bits, "4 or 8 bits"), group_size(fields, "group_size")};
    config.gptq_desc_act = fields.boolean("desc_act", false);
    config.gptq_symmetric = fields.boolean("sym", true);
    const std::string format = fields.string("checkpoint_format", "gptq");
    if (format != "gptq") fields.fail_field("checkpoint_format", "is '{}'; kiln reads 'gptq'", format);
    return config;
  }
  if (method == "fp8") {
    config.method = QuantMethod::Fp8;
    const std::string scheme = fields.string("activation_scheme", "dynamic");
    if (scheme != "dynamic")
      fields.fail_field("activation_scheme", "is '{}'; kiln runs FP8 weights with dynamic (unquantized) activations",
                        scheme);
    const std::string format = fields.string("fmt", "e4m3");
    if (format != "e4m3") fields.fail_field("fmt", "is '{}'; kiln reads e4m3 FP8 weights", format);
    if (!fields.has("weight_block_size"))
      fields.fail_field("weight_block_size", "is required: kiln reads block-scaled (fine-grained) FP8");
    const json& block = fields.raw("weight_block_size");
    if (!block.is_array() || block.size() != 2 || !block[0].is_number_integer() || !block[1].is_number_integer() ||
        block[0].get<int64_t>() <= 0 || block[1].get<int64_t>() <= 0 || block[0].get<int64_t>() > 4096 ||
        block[1].get<int64_t>() > 4096)
      fields.fail_field("weight_block_size", "is {}; expected [rows, columns] of positive integers", block.dump());
    config.block_rows = block[0].get<int>();
    config.block_columns = block[1].get<int>();
    return config;
  }
  fields.fail_field("quant_method", "is '{}'; kiln reads 'awq', 'gptq', 'fp8' and MLX affine checkpoints", method);
}

}  // namespace

const char* quant_method_name(QuantMethod method) {
  switch (method) {
    case QuantMethod::None: return "none";
    case QuantMethod::MlxAffine: return "mlx";
    case QuantMethod::Awq: return "awq";
    case QuantMethod::Gptq: return "gptq";
    case QuantMethod::Fp8: return "fp8";
  }
  return "?";
}

std::optional<AffineScheme> QuantizationConfig::scheme_for(const std::string& module) const {
  const auto found = module_schemes.find(module);
  if (found != module_schemes.end()) return found->second;
  return affine;
}

json QuantizationConfig::to_json() const {
  json out{{"method", quant_method_name(method)}};
  switch (method) {
    case QuantMethod::None: break;
    case QuantMethod::MlxAffine:
    case QuantMethod::Awq:
    case QuantMethod::Gptq: {
      out["bits"] = affine.bits;
      out["group_size"] = affine.group_size;
      json modules = json::object();
      for (const auto& [module, scheme] : module_schemes)
        modules[module] = scheme ? json{{"bits", scheme->bits}, {"group_size", scheme->group_size}} : json(false);
      if (!modules.empty()) out["module_overrides"] = modules;
      if (method == QuantMethod::Gptq) out["desc_act"] = gptq_desc_act;
      break;
    }
    case QuantMethod::Fp8: out["weight_block_size"] = {block_rows, block_columns}; break;
  }
  return out;
}

QuantizationConfig parse_quantization_config(const ConfigFields& top, const ConfigFields& text) {
  // A nested text config may carry the quantization instead of the top level.
  const ConfigFields& holder = (top.has("quantization") || top.has("quantization_config")) ? top : text;
  if (!holder.has("quantization") && !holder.has("quantization_config")) return {};
  // mlx-lm writes both keys with the same object; "quantization" is MLX's own.
  const std::string key = holder.has("quantization") ? "quantization" : "quantization_config";
  const ConfigFields fields = holder.object(key);
  if (fields.has("quant_method") && fields.string("quant_method", "") != "mlx")
    return parse_method(fields, fields.string("quant_method", ""));
  return parse_mlx(fields);
}

}  // namespace kiln
