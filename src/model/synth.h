// Synthetic checkpoints: a published model's exact config.json with deterministic random weights,
// for tests and benchmarks of full-size graphs without downloading the real weights.
//
// The weights come from a counter-based generator (each element is a hash of the seed, the
// tensor name and the element index), so any chunk is produced independently and in parallel and
// the same seed always gives the same bytes. Matrices are N(0, 0.02)-like, as transformers'
// initializer_range; norm gains are 1 so activations stay in a sane range (zero-centred norms, whose
// gain is 1 + w, store 0, as transformers initialises them).
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/tensor.h"
#include "io/config.h"
#include "model/quantize.h"

namespace kiln {

// One known model: its name for `kiln synth --shape` and its config.json as published.
struct SynthShape {
  std::string name;    // e.g. "qwen3-0.6b"
  std::string origin;  // where the config comes from (the Hugging Face repository)
  nlohmann::json config;
};

class FamilyList;
const FamilyList& builtin_families();

// Every known shape: the builtin families' (model/family.h), in their order. Adding a model is one
// entry in its family's synth_shapes.
const std::vector<SynthShape>& synth_shapes();
// The shape called `name`; the error lists the known names.
const SynthShape& find_synth_shape(const std::string& name);

enum class SynthInit { Normal, Ones, Zeros };

// What a tensor is to the graph, for quantizers (model/quantize.h): the matrices of the decoder
// layers' Linear layers, the output head's, the token embedding, or anything else (norm gains,
// biases, convolutions, per-head parameters), which stays as it is.
enum class TensorRole { Other, LayerLinear, HeadLinear, Embedding };

struct SynthTensor {
  std::string name;
  Shape shape;
  SynthInit init = SynthInit::Normal;
  TensorRole role = TensorRole::Other;
};

// Whether `format` quantizes a tensor of `role`: MLX every Linear matrix and the embedding (as
// mlx_lm does), FP8 the decoder layers' Linear matrices only.
inline bool quantizes(QuantizeFormat format, TensorRole role) {
  return format == QuantizeFormat::Fp8 ? role == TensorRole::LayerLinear : role != TensorRole::Other;
}

// Random-normal matrices of each quantizable role.
inline SynthTensor layer_linear(std::string name, Shape shape) {
  return {std::move(name), std::move(shape), SynthInit::Normal, TensorRole::LayerLinear};
}
inline SynthTensor head_linear(std::string name, Shape shape) {
  return {std::move(name), std::move(shape), SynthInit::Normal, TensorRole::HeadLinear};
}
inline SynthTensor embedding(std::string name, Shape shape) {
  return {std::move(name), std::move(shape), SynthInit::Normal, TensorRole::Embedding};
}

// The tensors a Hugging Face checkpoint of `config` holds, with their shapes: the synth layout of
// the family that writes its model_type. Fails for a model_type no family writes (qwen3_next).
std::vector<SynthTensor> synth_tensor_layout(const ModelConfig& config,
                                             const FamilyList& families = builtin_families());
// The multi-token-prediction head's tensors of such a checkpoint (`kiln synth --mtp`). Fails for a
// model_type whose family has none.
std::vector<SynthTensor> synth_mtp_tensor_layout(const ModelConfig& config,
                                                 const FamilyList& families = builtin_families());

// `kiln synth --quantize`: the checkpoint written already quantized, as quantize_checkpoint
// (model/quantize.h) would write the `dtype` one of the same seed, without writing that one first.
struct SynthQuantization {
  QuantizeFormat format = QuantizeFormat::MlxAffine;
  AffineScheme scheme{4, 64};  // MLX
};

struct SynthOptions {
  std::string shape;
  DType dtype = DType::BF16;  // of the weights, or of the scales and unquantized tensors when quantized
  std::optional<SynthQuantization> quantize;
  std::filesystem::path out;
  uint64_t seed = 0;
  std::optional<int64_t> layers;  // overrides num_hidden_layers (quick tests of big shapes)
  // Also write the multi-token-prediction head (mtp.*, one layer, mtp_num_hidden_layers 1 in the
  // config, as the published Qwen3.5 checkpoints have it), for --speculative mtp.
  bool mtp = false;
  // transformers writes shards of at most a few GB; 4 GiB keeps each file well inside that.
  uint64_t max_shard_bytes = 4ull << 30;
};

struct SynthResult {
  ModelConfig config;
  std::vector<std::filesystem::path> files;  // config.json, the safetensors files, the index if sharded
  uint64_t tensor_bytes = 0;
  size_t tensor_count = 0;
};

// Writes OUT/config.json and the random-weight safetensors. OUT must be absent or empty.
SynthResult write_synthetic_checkpoint(const SynthOptions& options);

}  // namespace kiln
