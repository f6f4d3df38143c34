// The quantization a config.json declares, read and checked before any weight is read.
//
//   MLX affine   "quantization" (and/or "quantization_config", the same object) =
//                {"group_size": G, "bits": B, ["mode": "affine"], <module path>: {"group_size",
//                "bits"} | false, …}
//   AWQ          "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": G,
//                "version": "gemm", "zero_point": true}
//   GPTQ         "quantization_config": {"quant_method": "gptq", "bits": 4|8, "group_size": G,
//                "desc_act": bool, "sym": bool}
//   FP8          "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
//                "weight_block_size": [Br, Bc], ["fmt": "e4m3"]}
// Any other method or value is refused in one line naming the field and the value.
#pragma once

#include <map>
#include <optional>
#include <string>

#include "io/config_fields.h"

namespace kiln {

enum class QuantMethod { None, MlxAffine, Awq, Gptq, Fp8 };

// "none", "mlx", "awq", "gptq", "fp8".
const char* quant_method_name(QuantMethod method);

struct AffineScheme {
  int bits = 0;
  int group_size = 0;
  bool operator==(const AffineScheme&) const = default;
};

struct QuantizationConfig {
  QuantMethod method = QuantMethod::None;
  AffineScheme affine;  // MLX, AWQ, GPTQ: the default scheme
  // MLX per-module entries, by module path as the checkpoint names it: its own scheme, or
  // nullopt for `false` (that module stays unquantized).
  std::map<std::string, std::optional<AffineScheme>> module_schemes;
  bool gptq_desc_act = false;  // GPTQ: groups follow g_idx rather than k / group_size
  bool gptq_symmetric = true;
  int block_rows = 0, block_columns = 0;  // FP8 weight_block_size

  // The scheme of an MLX module: its own entry, else the default (nullopt: left unquantized).
  std::optional<AffineScheme> scheme_for(const std::string& module) const;
  nlohmann::json to_json() const;
};

// Reads `quantization` / `quantization_config` from the top-level config (and, for a nested text
// config, from `text`). Errors read "<config.json>: field '<name>': …".
QuantizationConfig parse_quantization_config(const ConfigFields& top, const ConfigFields& text);

}  // namespace kiln
