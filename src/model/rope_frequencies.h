// RoPE inverse frequencies from a config, computed exactly as transformers does (in f32).
#pragma once

#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "io/config.h"

namespace kiln {

// inv_freq[j] for j < rotary_dim / 2 (rope types "default" and "llama3"), stored in the model's
// dtype: transformers keeps inv_freq as a floating-point buffer, so a model cast to bf16
// (`model.to(torch.bfloat16)`, as the reference fixtures were made) holds bf16-rounded
// frequencies, and its angles pos · inv_freq use them. `model_dtype` is the weights' dtype.
std::vector<float> rope_inverse_frequencies(const RopeConfig& rope, int64_t rotary_dim, DType model_dtype);

// The model_dtype above for a model whose embedding matrix is kept in `embedding_dtype`. A quantized
// checkpoint's frequencies stay f32: its reference is the forward of its dequantized weights in
// their float model (MLX computes RoPE angles in f32, and the quantized fixtures' references were
// never cast to bf16).
DType rope_frequency_dtype(const ModelConfig& config, DType embedding_dtype);

// The number of leading dims of each head that rotate: int(head_dim · partial_rotary_factor).
int64_t rope_rotary_dim(const ModelConfig& config);

}  // namespace kiln
