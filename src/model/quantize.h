// Quantizing weights: MLX affine (round to nearest per group) and FP8 blocks, for `kiln quantize`
// and `kiln synth --quantize`. Which tensors are quantized comes from the family's tensor layout
// (SynthTensor::role), not from their names.
//
// MLX affine, per group of G inputs of a row (as ../shared/oracle/gen_fixtures_moe_quant.py's
// mlx_quantize, itself mlx.core.quantize's rule), in float64:
//   scale = (max − min) / (2^bits − 1), rounded once to the scales' dtype
//   bias  = min, rounded to the scales' dtype
//   q     = clamp(round_half_even((w − bias) / scale), 0, 2^bits − 1)   (q = 0 where scale is 0)
// FP8 blocks, per Br×Bc block (as the oracle's fp8_fixture):
//   scale_inv = float32(amax / 448)   (448: e4m3's largest finite value)
//   value     = e4m3(w / scale_inv) in f32, round to nearest even (0 where amax is 0)
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "io/quantization_config.h"
#include "io/safetensors_writer.h"

namespace kiln {

// One matrix's rows in the Affine layout (core/weight.h); scales and biases hold values
// representable in the dtype they were rounded to.
struct AffineRows {
  std::vector<uint32_t> codes;        // [rows, columns·bits/32]
  std::vector<float> scales, biases;  // [rows, columns/G]
};
// Quantizes `rows` rows of `columns` f32 values (row-major), rounding scales and biases to
// `scale_dtype` (F32, BF16 or F16). The group size must divide `columns`.
AffineRows quantize_affine_rows(const float* values, int64_t rows, int64_t columns, AffineScheme scheme,
                                DType scale_dtype);

struct Fp8Blocks {
  std::vector<uint8_t> values;     // e4m3 [rows, columns]
  std::vector<float> scale_inv;    // [⌈rows/Br⌉, ⌈columns/Bc⌉]
};
Fp8Blocks quantize_fp8_blocks(const float* values, int64_t rows, int64_t columns, int block_rows, int block_columns);

// The FP8 block size kiln quantize writes (DeepSeek-V3's and Qwen3-FP8's weight_block_size).
constexpr int kFp8Block = 128;

enum class QuantizeFormat { MlxAffine, Fp8 };

struct QuantizeOptions {
  std::filesystem::path model, out;
  QuantizeFormat format = QuantizeFormat::MlxAffine;
  AffineScheme scheme{4, 64};
  // MLX: a module path's own scheme, or nullopt to leave it unquantized (`--mixed`).
  std::map<std::string, std::optional<AffineScheme>> module_schemes;
  uint64_t max_shard_bytes = 4ull << 30;
};

struct QuantizeResult {
  size_t quantized = 0;  // matrices quantized
  size_t kept = 0;       // tensors copied as they are
  uint64_t tensor_bytes = 0;
  std::vector<std::filesystem::path> files;  // config.json, the safetensors, the index if sharded, copied files
};

// Writes OUT (absent or empty): the quantized checkpoint, config.json with `quantization` and
// `quantization_config` (MLX) or `quantization_config` (FP8), and every other file of MODEL
// (tokenizer, generation config) copied. MLX quantizes the decoder layers' Linear matrices, the
// head and the embedding, leaving (recorded as `false`) any whose input width the group size does
// not divide, as mlx_lm does; FP8 quantizes the decoder layers' Linear matrices only.
QuantizeResult quantize_checkpoint(const QuantizeOptions& options);

// The `--mixed` file: a JSON object of module path → bits (an integer) or false; each entry's group
// size is `group_size`. Errors name the file and the entry.
std::map<std::string, std::optional<AffineScheme>> read_module_schemes(const std::filesystem::path& file,
                                                                       int group_size);

// The config.json `quantization` object MLX writes for `scheme` and `modules`.
nlohmann::json mlx_quantization_json(AffineScheme scheme,
                                     const std::map<std::string, std::optional<AffineScheme>>& modules);
// The config.json `quantization_config` of an FP8 block checkpoint.
nlohmann::json fp8_quantization_json();

}  // namespace kiln
