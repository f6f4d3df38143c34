#include "model/quantize.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <set>

#include <fmt/format.h>

#include "core/error.h"
#include "core/thread_pool.h"
#include "io/safetensors.h"
#include "model/family.h"
#include "model/synth.h"

namespace kiln {
namespace {

using json = nlohmann::json;

// `value` rounded once (to nearest even) to `dtype`, as torch's .to(dtype) of a float64 tensor.
// BF16 and F16 go through f32 rounded to odd: with 24 ≥ p + 2 bits, rounding the round-to-odd
// value to p bits is the correctly rounded result (Boldo and Melquiond, 2008).
float round_to_dtype(double value, DType dtype) {
  float narrowed = static_cast<float>(value);
  if (dtype == DType::F32) return narrowed;
  if (std::fabs(static_cast<double>(narrowed)) > std::fabs(value)) narrowed = std::nextafter(narrowed, 0.0f);
  if (static_cast<double>(narrowed) != value) narrowed = std::bit_cast<float>(std::bit_cast<uint32_t>(narrowed) | 1u);
  switch (dtype) {
    case DType::BF16: return bf16_to_f32(f32_to_bf16(narrowed));
    case DType::F16: return f16_to_f32(f32_to_f16(narrowed));
    default: break;
  }
  fail("quantize: scales in {} (expected F32, BF16 or F16)", dtype_name(dtype));
}

float stored_as_f32(const Tensor& tensor, int64_t index) {
  switch (tensor.dtype()) {
    case DType::F32: return tensor.data<const float>()[index];
    case DType::BF16: return bf16_to_f32(tensor.data<const uint16_t>()[index]);
    case DType::F16: return f16_to_f32(tensor.data<const uint16_t>()[index]);
    default: break;
  }
  fail("quantize: a {} matrix is not a floating-point weight", dtype_name(tensor.dtype()));
}

template <typename T>
SafetensorsEntry in_memory(const std::string& name, DType dtype, Shape shape, const std::vector<T>& values) {
  SafetensorsEntry entry{name, dtype, std::move(shape), {}, {}};
  entry.bytes.resize(values.size() * sizeof(T));
  std::memcpy(entry.bytes.data(), values.data(), entry.bytes.size());
  return entry;
}

// f32 values as `dtype` (exact: they were rounded to it).
SafetensorsEntry in_dtype(const std::string& name, DType dtype, Shape shape, const std::vector<float>& values) {
  if (dtype == DType::F32) return in_memory(name, dtype, std::move(shape), values);
  std::vector<uint16_t> narrowed(values.size());
  for (size_t i = 0; i < values.size(); ++i)
    narrowed[i] = dtype == DType::BF16 ? f32_to_bf16(values[i]) : f32_to_f16(values[i]);
  return in_memory(name, dtype, std::move(shape), narrowed);
}

SafetensorsEntry stored_copy(const std::string& name, const Tensor& tensor) {
  SafetensorsEntry entry{name, tensor.dtype(), tensor.shape(), {}, {}};
  const auto* bytes = static_cast<const uint8_t*>(tensor.raw());
  entry.bytes.assign(bytes, bytes + tensor.nbytes());
  return entry;
}

}  // namespace

AffineRows quantize_affine_rows(const float* values, int64_t rows, int64_t columns, AffineScheme scheme,
                                DType scale_dtype) {
  const int64_t groups = columns / scheme.group_size;
  const int64_t row_words = columns * scheme.bits / 32;
  const double levels = static_cast<double>((1 << scheme.bits) - 1);
  AffineRows out;
  out.codes.assign(static_cast<size_t>(rows * row_words), 0u);
  out.scales.resize(static_cast<size_t>(rows * groups));
  out.biases.resize(static_cast<size_t>(rows * groups));
  ThreadPool::global().parallel_for(rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      uint32_t* words = out.codes.data() + row * row_words;
      for (int64_t group = 0; group < groups; ++group) {
        const float* w = values + row * columns + group * scheme.group_size;
        const auto [lowest, highest] = std::minmax_element(w, w + scheme.group_size);
        const double scale = round_to_dtype((static_cast<double>(*highest) - *lowest) / levels, scale_dtype);
        const double bias = round_to_dtype(*lowest, scale_dtype);
        out.scales[row * groups + group] = static_cast<float>(scale);
        out.biases[row * groups + group] = static_cast<float>(bias);
        for (int64_t i = 0; i < scheme.group_size; ++i) {
          // nearbyint rounds half to even in the default rounding mode, as torch.round does.
          const double code = scale == 0.0 ? 0.0 : std::clamp(std::nearbyint((w[i] - bias) / scale), 0.0, levels);
          const int64_t bit = (group * scheme.group_size + i) * scheme.bits;
          const uint64_t shifted = static_cast<uint64_t>(code) << (bit % 32);
          words[bit / 32] |= static_cast<uint32_t>(shifted);
          if (shifted >> 32) words[bit / 32 + 1] |= static_cast<uint32_t>(shifted >> 32);
        }
      }
    }
  });
  return out;
}

Fp8Blocks quantize_fp8_blocks(const float* values, int64_t rows, int64_t columns, int block_rows, int block_columns) {
  const int64_t block_grid_rows = (rows + block_rows - 1) / block_rows;
  const int64_t block_grid_columns = (columns + block_columns - 1) / block_columns;
  Fp8Blocks out;
  out.values.assign(static_cast<size_t>(rows * columns), 0);
  out.scale_inv.resize(static_cast<size_t>(block_grid_rows * block_grid_columns));
  ThreadPool::global().parallel_for(block_grid_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block_row = begin; block_row < end; ++block_row) {
      const int64_t row_end = std::min(rows, (block_row + 1) * block_rows);
      for (int64_t block_column = 0; block_column < block_grid_columns; ++block_column) {
        const int64_t column_begin = block_column * block_columns;
        const int64_t column_end = std::min(columns, column_begin + block_columns);
        double amax = 0.0;
        for (int64_t row = block_row * block_rows; row < row_end; ++row)
          for (int64_t column = column_begin; column < column_end; ++column)
            amax = std::max(amax, std::fabs(static_cast<double>(values[row * columns + column])));
        const float scale_inv = static_cast<float>(amax / 448.0);
        out.scale_inv[block_row * block_grid_columns + block_column] = scale_inv;
        if (scale_inv == 0.0f) continue;
        for (int64_t row = block_row * block_rows; row < row_end; ++row)
          for (int64_t column = column_begin; column < column_end; ++column)
            out.values[row * columns + column] = f32_to_fp8_e4m3(values[row * columns + column] / scale_inv);
      }
    }
  });
  return out;
}

json mlx_quantization_json(AffineScheme scheme, const std::map<std::string, std::optional<AffineScheme>>& modules) {
  json quantization{{"group_size", scheme.group_size}, {"bits", scheme.bits}};
  for (const auto& [module, own] : modules)
    quantization[module] = own ? json{{"group_size", own->group_size}, {"bits", own->bits}} : json(false);
  return quantization;
}

json fp8_quantization_json() {
  return {{"quant_method", "fp8"},
          {"activation_scheme", "dynamic"},
          {"fmt", "e4m3"},
          {"weight_block_size", {kFp8Block, kFp8Block}}};
}

std::map<std::string, std::optional<AffineScheme>> read_module_schemes(const std::filesystem::path& file,
                                                                       int group_size) {
  std::ifstream in(file);
  if (!in) fail("{}: cannot read the --mixed file", file.string());
  json entries;
  try {
    entries = json::parse(in);
  } catch (const json::exception& error) {
    fail("{}: not JSON: {}", file.string(), error.what());
  }
  if (!entries.is_object()) fail("{}: expected an object of module path → bits or false", file.string());
  std::map<std::string, std::optional<AffineScheme>> schemes;
  for (const auto& [module, value] : entries.items()) {
    if (value.is_boolean() && !value.get<bool>()) {
      schemes.emplace(module, std::nullopt);
    } else if (value.is_number_integer() && is_affine_bits(value.get<int>())) {
      schemes.emplace(module, AffineScheme{value.get<int>(), group_size});
    } else {
      fail("{}: entry '{}' is {}; expected bits (2, 3, 4, 5, 6 or 8) or false", file.string(), module, value.dump());
    }
  }
  return schemes;
}

QuantizeResult quantize_checkpoint(const QuantizeOptions& options) {
  if (std::filesystem::exists(options.out) &&
      (!std::filesystem::is_directory(options.out) || !std::filesystem::is_empty(options.out)))
    fail("{}: quantize writes into a new or empty directory", options.out.string());
  const bool fp8 = options.format == QuantizeFormat::Fp8;
  if (!fp8 && (!is_affine_bits(options.scheme.bits) || !is_affine_group_size(options.scheme.group_size)))
    fail("quantize: {} bits in groups of {} is not an MLX affine scheme (bits 2, 3, 4, 5, 6, 8; groups 32, 64, 128)",
         options.scheme.bits, options.scheme.group_size);
  const ModelConfig config = load_model_config(options.model);
  if (config.quantization.method != QuantMethod::None)
    fail("{}: the checkpoint is already quantized ({})", (options.model / "config.json").string(),
         quant_method_name(config.quantization.method));
  const Checkpoint checkpoint = Checkpoint::open(options.model);
  std::map<std::string, TensorRole> roles;
  for (const SynthTensor& tensor : synth_tensor_layout(config)) {
    if (quantizes(options.format, tensor.role) && !checkpoint.contains(tensor.name))
      fail("quantize: {} holds no '{}', which its family's layout names (a checkpoint in another naming?)",
           options.model.string(), tensor.name);
    roles.emplace(tensor.name, tensor.role);
  }

  std::map<std::string, std::optional<AffineScheme>> recorded;  // the config's per-module entries
  std::set<std::string> named;  // the --mixed entries not yet matched to a tensor
  for (const auto& [module, scheme] : options.module_schemes) named.insert(module);
  QuantizeResult result;
  std::vector<SafetensorsEntry> entries;
  for (const auto& [name, info] : checkpoint.tensors()) {
    const auto role = roles.find(name);
    const bool chosen = role != roles.end() && quantizes(options.format, role->second) && info.shape.size() == 2;
    const std::string module = name.ends_with(".weight") ? name.substr(0, name.size() - 7) : name;
    std::optional<AffineScheme> scheme = options.scheme;
    if (const auto own = options.module_schemes.find(module); own != options.module_schemes.end()) {
      if (!chosen)
        fail("quantize: --mixed entry '{}' names no quantizable matrix of {}", module, options.model.string());
      scheme = own->second;
      named.erase(module);
      recorded.emplace(module, scheme);
    }
    const Tensor stored = checkpoint.view(name);
    if (chosen && !fp8 && scheme && info.shape[1] % scheme->group_size != 0) {
      recorded[module] = std::nullopt;  // mlx_lm leaves such a layer unquantized
      scheme.reset();
    }
    if (!chosen || !scheme) {
      entries.push_back(stored_copy(name, stored));
      ++result.kept;
      continue;
    }
    const int64_t rows = info.shape[0], columns = info.shape[1];
    std::vector<float> values(static_cast<size_t>(rows * columns));
    for (int64_t i = 0; i < rows * columns; ++i) values[i] = stored_as_f32(stored, i);
    if (fp8) {
      const Fp8Blocks blocks = quantize_fp8_blocks(values.data(), rows, columns, kFp8Block, kFp8Block);
      entries.push_back(in_memory(name, DType::F8E4M3, info.shape, blocks.values));
      entries.push_back(in_memory(name + "_scale_inv", DType::F32,
                                  {(rows + kFp8Block - 1) / kFp8Block, (columns + kFp8Block - 1) / kFp8Block},
                                  blocks.scale_inv));
    } else {
      const AffineRows quantized = quantize_affine_rows(values.data(), rows, columns, *scheme, info.dtype);
      const Shape groups{rows, columns / scheme->group_size};
      const Shape words{rows, columns * scheme->bits / 32};
      entries.push_back(in_memory(module + ".weight", DType::U32, words, quantized.codes));
      entries.push_back(in_dtype(module + ".scales", info.dtype, groups, quantized.scales));
      entries.push_back(in_dtype(module + ".biases", info.dtype, groups, quantized.biases));
    }
    ++result.quantized;
  }
  if (!named.empty())
    fail("quantize: --mixed entry '{}' names no tensor of {}", *named.begin(), options.model.string());
  for (const SafetensorsEntry& entry : entries) result.tensor_bytes += entry.nbytes();

  json config_json = json::parse(std::ifstream(options.model / "config.json"));
  if (fp8) {
    config_json["quantization_config"] = fp8_quantization_json();
  } else {
    config_json["quantization"] = mlx_quantization_json(options.scheme, recorded);
    config_json["quantization_config"] = config_json["quantization"];
  }
  std::filesystem::create_directories(options.out);
  for (const auto& file : std::filesystem::directory_iterator(options.model)) {
    const std::string filename = file.path().filename().string();
    if (!file.is_regular_file() || filename == "config.json" || filename.ends_with(".safetensors") ||
        filename == "model.safetensors.index.json")
      continue;
    std::filesystem::copy_file(file.path(), options.out / filename);
    result.files.push_back(options.out / filename);
  }
  const auto config_path = options.out / "config.json";
  std::ofstream(config_path) << config_json.dump(2) << "\n";
  result.files.push_back(config_path);
  for (auto& file : write_sharded_safetensors(options.out, entries, options.max_shard_bytes))
    result.files.push_back(std::move(file));
  return result;
}

}  // namespace kiln
