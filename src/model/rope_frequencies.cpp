#include "model/rope_frequencies.h"

#include <cmath>
#include <numbers>

#include "core/error.h"

namespace kiln {

namespace {

std::vector<float> inverse_frequencies_f32(const RopeConfig& rope, int64_t rotary_dim) {
  // HF _compute_default_rope_parameters: 1 / base ** (arange(0, dim, 2).float() / dim), all f32.
  std::vector<float> inv_freq(rotary_dim / 2);
  const float base = static_cast<float>(rope.theta);
  for (int64_t j = 0; j < rotary_dim / 2; ++j) {
    const float exponent = static_cast<float>(2 * j) / static_cast<float>(rotary_dim);
    inv_freq[j] = 1.0f / std::pow(base, exponent);
  }
  if (rope.type == "default") return inv_freq;
  if (rope.type != "llama3") fail("rope type '{}' is not supported", rope.type);

  // HF _compute_llama3_parameters (f32 tensor arithmetic): frequencies with a wavelength longer
  // than original_max / low_freq_factor are divided by `factor`, shorter than
  // original_max / high_freq_factor are kept, and the band between is interpolated.
  const float factor = static_cast<float>(rope.factor);
  const float low = static_cast<float>(rope.low_freq_factor);
  const float high = static_cast<float>(rope.high_freq_factor);
  const float original = static_cast<float>(rope.original_max_position_embeddings);
  const float low_freq_wavelen = original / low;
  const float high_freq_wavelen = original / high;
  for (float& frequency : inv_freq) {
    const float wavelen = 2.0f * std::numbers::pi_v<float> / frequency;
    const float scaled = wavelen > low_freq_wavelen ? frequency / factor : frequency;
    const bool medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
    if (medium) {
      const float smooth = (original / wavelen - low) / (high - low);
      frequency = (1.0f - smooth) * scaled / factor + smooth * scaled;
    } else {
      frequency = scaled;
    }
  }
  return inv_freq;
}

}  // namespace

std::vector<float> rope_inverse_frequencies(const RopeConfig& rope, int64_t rotary_dim, DType model_dtype) {
  std::vector<float> inv_freq = inverse_frequencies_f32(rope, rotary_dim);
  for (float& frequency : inv_freq) {
    if (model_dtype == DType::BF16) frequency = round_to_bf16(frequency);
    if (model_dtype == DType::F16) frequency = f16_to_f32(f32_to_f16(frequency));
  }
  return inv_freq;
}

int64_t rope_rotary_dim(const ModelConfig& config) {
  return static_cast<int64_t>(static_cast<double>(config.head_dim) * config.rope.partial_rotary_factor);
}

DType rope_frequency_dtype(const ModelConfig& config, DType embedding_dtype) {
  return config.quantization.method == QuantMethod::None ? embedding_dtype : DType::F32;
}

}  // namespace kiln
