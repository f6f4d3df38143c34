// RoPE inverse frequencies from a config, computed exactly as transformers does (in f32).
#pragma once

#include <cstdint>
#include <vector>

#include "io/config.h"

namespace kiln {

// inv_freq[j] for j < rotary_dim / 2 (rope types "default" and "llama3").
std::vector<float> rope_inverse_frequencies(const RopeConfig& rope, int64_t rotary_dim);

// The number of leading dims of each head that rotate: int(head_dim · partial_rotary_factor).
int64_t rope_rotary_dim(const ModelConfig& config);

}  // namespace kiln
