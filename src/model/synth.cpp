#include "model/synth.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "core/thread_pool.h"
#include "io/safetensors_writer.h"
#include "model/family.h"
#include "model/quantize.h"

namespace kiln {
namespace {

using nlohmann::json;

// transformers' initializer_range in every published config of the families' synth shapes.
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

// The value of each element of a tensor, by index (before rounding to the checkpoint's dtype).
struct SynthValues {
  uint64_t stream = 0;
  SynthInit init = SynthInit::Normal;

  SynthValues(const SynthTensor& tensor, uint64_t seed)
      : stream(mix64(seed ^ mix64(name_hash(tensor.name)))), init(tensor.init) {}
  float at(uint64_t index) const {
    if (init == SynthInit::Ones) return 1.0f;
    if (init == SynthInit::Zeros) return 0.0f;
    return kInitStd * normal_like(mix64(stream + index));
  }
};

float round_to(DType dtype, float value) {
  if (dtype == DType::BF16) return bf16_to_f32(f32_to_bf16(value));
  if (dtype == DType::F16) return f16_to_f32(f32_to_f16(value));
  return value;
}

TensorByteFill make_fill(const SynthTensor& tensor, DType dtype, uint64_t seed) {
  const SynthValues synth(tensor, seed);
  return [synth, dtype](uint64_t offset, std::span<uint8_t> out) {
    const size_t element_size = dtype_size(dtype);
    const uint64_t first = offset / element_size;
    const auto count = static_cast<int64_t>(out.size() / element_size);
    // Each element depends only on its index, so any split over threads gives the same bytes.
    ThreadPool::global().parallel_for(count, 1 << 14, [&](int64_t begin, int64_t end) {
      if (dtype == DType::F32) {
        auto* values = reinterpret_cast<float*>(out.data());
        for (int64_t i = begin; i < end; ++i) values[i] = synth.at(first + i);
      } else {
        auto* values = reinterpret_cast<uint16_t*>(out.data());
        for (int64_t i = begin; i < end; ++i)
          values[i] = dtype == DType::BF16 ? f32_to_bf16(synth.at(first + i)) : f32_to_f16(synth.at(first + i));
      }
    });
  };
}

// A fill that produces its tensor `unit_bytes` at a time (a row, or a row of FP8 blocks):
// `produce(first, count)` gives the bytes of units [first, first + count).
using UnitProducer = std::function<std::vector<uint8_t>(int64_t first, int64_t count)>;
TensorByteFill units_fill(uint64_t unit_bytes, UnitProducer produce) {
  return [unit_bytes, produce = std::move(produce)](uint64_t offset, std::span<uint8_t> out) {
    const auto first = static_cast<int64_t>(offset / unit_bytes);
    const auto last = static_cast<int64_t>((offset + out.size() + unit_bytes - 1) / unit_bytes);
    const std::vector<uint8_t> bytes = produce(first, last - first);
    std::memcpy(out.data(), bytes.data() + (offset - first * unit_bytes), out.size());
  };
}

template <typename T>
std::vector<uint8_t> as_bytes(const std::vector<T>& values) {
  std::vector<uint8_t> bytes(values.size() * sizeof(T));
  std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

std::vector<uint8_t> in_dtype(const std::vector<float>& values, DType dtype) {
  if (dtype == DType::F32) return as_bytes(values);
  std::vector<uint16_t> narrowed(values.size());
  for (size_t i = 0; i < values.size(); ++i)
    narrowed[i] = dtype == DType::BF16 ? f32_to_bf16(values[i]) : f32_to_f16(values[i]);
  return as_bytes(narrowed);
}

// Rows [first, first + count) of a matrix's values as the `dtype` checkpoint holds them, in f32.
std::vector<float> synth_rows(const SynthValues& synth, int64_t columns, int64_t first, int64_t count, DType dtype) {
  std::vector<float> values(static_cast<size_t>(count * columns));
  ThreadPool::global().parallel_for(count * columns, 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) values[i] = round_to(dtype, synth.at(first * columns + i));
  });
  return values;
}

// The entries of a quantized matrix: what quantize_checkpoint writes for the `dtype` checkpoint of
// the same seed, produced row by row.
std::vector<SafetensorsEntry> quantized_entries(const SynthTensor& tensor, const SynthQuantization& quantization,
                                                DType dtype, uint64_t seed) {
  const SynthValues synth(tensor, seed);
  const int64_t rows = tensor.shape[0], columns = tensor.shape[1];
  const auto capped = [rows](int64_t first, int64_t count) { return std::min(count, rows - first); };
  if (quantization.format == QuantizeFormat::Fp8) {
    const int64_t block_rows = (rows + kFp8Block - 1) / kFp8Block, block_columns = (columns + kFp8Block - 1) / kFp8Block;
    auto blocks = [=](int64_t first_block, int64_t count) {
      const int64_t first = first_block * kFp8Block;
      const int64_t row_count = capped(first, count * kFp8Block);
      const std::vector<float> values = synth_rows(synth, columns, first, row_count, dtype);
      return quantize_fp8_blocks(values.data(), row_count, columns, kFp8Block, kFp8Block);
    };
    SafetensorsEntry values{tensor.name, DType::F8E4M3, tensor.shape, {}, {}};
    values.fill = units_fill(static_cast<uint64_t>(kFp8Block * columns),
                             [=](int64_t first, int64_t count) { return blocks(first, count).values; });
    SafetensorsEntry scales{tensor.name + "_scale_inv", DType::F32, {block_rows, block_columns}, {}, {}};
    scales.fill = units_fill(static_cast<uint64_t>(block_columns) * 4,
                             [=](int64_t first, int64_t count) { return as_bytes(blocks(first, count).scale_inv); });
    return {std::move(values), std::move(scales)};
  }
  const AffineScheme scheme = quantization.scheme;
  auto quantized = [=](int64_t first, int64_t count) {
    const std::vector<float> values = synth_rows(synth, columns, first, capped(first, count), dtype);
    return quantize_affine_rows(values.data(), capped(first, count), columns, scheme, dtype);
  };
  const std::string module = tensor.name.substr(0, tensor.name.size() - std::string(".weight").size());
  const int64_t groups = columns / scheme.group_size, row_words = columns * scheme.bits / 32;
  SafetensorsEntry codes{tensor.name, DType::U32, {rows, row_words}, {}, {}};
  codes.fill = units_fill(static_cast<uint64_t>(row_words) * 4,
                          [=](int64_t first, int64_t count) { return as_bytes(quantized(first, count).codes); });
  SafetensorsEntry scales{module + ".scales", dtype, {rows, groups}, {}, {}};
  scales.fill = units_fill(static_cast<uint64_t>(groups) * dtype_size(dtype), [=](int64_t first, int64_t count) {
    return in_dtype(quantized(first, count).scales, dtype);
  });
  SafetensorsEntry biases{module + ".biases", dtype, {rows, groups}, {}, {}};
  biases.fill = units_fill(static_cast<uint64_t>(groups) * dtype_size(dtype), [=](int64_t first, int64_t count) {
    return in_dtype(quantized(first, count).biases, dtype);
  });
  return {std::move(codes), std::move(scales), std::move(biases)};
}

std::string torch_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32: return "float32";
    case DType::BF16: return "bfloat16";
    case DType::F16: return "float16";
    default: break;
  }
  fail("synth writes F32, F16 or BF16 weights, not {}", dtype_name(dtype));
}

}  // namespace

const std::vector<SynthShape>& synth_shapes() {
  static const std::vector<SynthShape> shapes = [] {
    std::vector<SynthShape> all;
    for (const FamilySpec& family : builtin_families().specs())
      all.insert(all.end(), family.synth_shapes.begin(), family.synth_shapes.end());
    return all;
  }();
  return shapes;
}

const SynthShape& find_synth_shape(const std::string& name) {
  for (const SynthShape& shape : synth_shapes())
    if (shape.name == name) return shape;
  std::vector<std::string> names;
  for (const SynthShape& shape : synth_shapes()) names.push_back(shape.name);
  fail("synth: unknown shape '{}' (known: {})", name, fmt::join(names, ", "));
}

namespace {

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

std::vector<SynthTensor> synth_tensor_layout(const ModelConfig& config, const FamilyList& families) {
  std::vector<std::string> known;
  for (const FamilySpec& family : families.specs()) {
    for (const std::string& model_type : family.synth_model_types) {
      if (model_type == config.model_type) return family.synth_layout(config);
      known.push_back(model_type);
    }
  }
  fail("synth: no tensor layout for model_type '{}' (it knows {})", config.model_type, fmt::join(known, ", "));
}

std::vector<SynthTensor> synth_mtp_tensor_layout(const ModelConfig& config, const FamilyList& families) {
  const FamilySpec* family = families.find(config.model_type);
  if (!family || !family->synth_mtp_layout)
    fail("synth --mtp: model_type '{}' has no multi-token-prediction head", config.model_type);
  return family->synth_mtp_layout(config);
}

SynthResult write_synthetic_checkpoint(const SynthOptions& options) {
  const SynthShape& shape = find_synth_shape(options.shape);
  if (std::filesystem::exists(options.out) &&
      (!std::filesystem::is_directory(options.out) || !std::filesystem::is_empty(options.out)))
    fail("{}: synth writes into a new or empty directory", options.out.string());

  json config_json = shape.config;
  if (options.layers) override_layers(config_json, *options.layers, shape.name);
  if (options.mtp) {
    json& text = config_json.contains("text_config") ? config_json["text_config"] : config_json;
    text["mtp_num_hidden_layers"] = 1;
  }
  // save_pretrained records the dtype the weights were written in (`dtype` since transformers v5).
  config_json[config_json.contains("dtype") ? "dtype" : "torch_dtype"] = torch_dtype_name(options.dtype);
  const auto config_path = options.out / "config.json";

  SynthResult result;
  result.config = parse_model_config(config_json, config_path);
  std::vector<SafetensorsEntry> entries;
  std::map<std::string, std::optional<AffineScheme>> unquantized;  // MLX: `false` in the config
  std::vector<SynthTensor> layout = synth_tensor_layout(result.config);
  if (options.mtp)
    for (SynthTensor& tensor : synth_mtp_tensor_layout(result.config)) layout.push_back(std::move(tensor));
  for (const SynthTensor& tensor : layout) {
    if (options.quantize && quantizes(options.quantize->format, tensor.role)) {
      if (options.quantize->format == QuantizeFormat::MlxAffine &&
          tensor.shape[1] % options.quantize->scheme.group_size != 0) {
        unquantized.emplace(tensor.name.substr(0, tensor.name.size() - std::string(".weight").size()), std::nullopt);
      } else {
        for (SafetensorsEntry& entry : quantized_entries(tensor, *options.quantize, options.dtype, options.seed)) {
          result.tensor_bytes += entry.nbytes();
          entries.push_back(std::move(entry));
        }
        continue;
      }
    }
    SafetensorsEntry entry;
    entry.name = tensor.name;
    entry.dtype = options.dtype;
    entry.shape = tensor.shape;
    entry.fill = make_fill(tensor, options.dtype, options.seed);
    result.tensor_bytes += entry.nbytes();
    entries.push_back(std::move(entry));
  }
  result.tensor_count = entries.size();

  if (options.quantize && options.quantize->format == QuantizeFormat::Fp8) {
    config_json["quantization_config"] = fp8_quantization_json();
  } else if (options.quantize) {
    config_json["quantization"] = mlx_quantization_json(options.quantize->scheme, unquantized);
    config_json["quantization_config"] = config_json["quantization"];
  }
  result.config = parse_model_config(config_json, config_path);
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
