#include "model/synth.h"

#include <algorithm>
#include <cmath>
#include <fstream>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "core/thread_pool.h"
#include "io/safetensors_writer.h"
#include "model/family.h"

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
  result.config = parse_model_config(config_json, config_path);
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
