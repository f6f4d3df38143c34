#include "engine/embedding.h"

#include <algorithm>
#include <cmath>

#include "core/dtype.h"
#include "core/error.h"

namespace kiln {

PooledEmbedding::PooledEmbedding(PoolingMode mode, int64_t tokens, int64_t hidden_size)
    : mode_(mode), tokens_(tokens), sum_(static_cast<size_t>(hidden_size), 0.0) {
  if (tokens < 1) fail("an embedding needs at least one token, got {}", tokens);
  if (hidden_size < 1) fail("an embedding needs a positive hidden size, got {}", hidden_size);
}

bool PooledEmbedding::reads(int64_t position) const {
  switch (mode_) {
    case PoolingMode::LastToken: return position == tokens_ - 1;
    case PoolingMode::Cls: return position == 0;
    case PoolingMode::Mean: return position >= 0 && position < tokens_;
  }
  return false;
}

void PooledEmbedding::add(int64_t position, std::span<const float> hidden) {
  if (!reads(position)) fail("the {} pooling does not read position {}", pooling_mode_name(mode_), position);
  if (position < next_position_) fail("pooled position {} arrived after position {}", position, next_position_ - 1);
  if (hidden.size() != sum_.size()) fail("a hidden state of {} values, expected {}", hidden.size(), sum_.size());
  for (size_t i = 0; i < sum_.size(); ++i) sum_[i] += hidden[i];
  next_position_ = position + 1;
  ++rows_added_;
}

std::vector<float> PooledEmbedding::finish(int64_t dimensions, bool normalize) const {
  const int64_t rows_read = mode_ == PoolingMode::Mean ? tokens_ : 1;
  if (rows_added_ != rows_read)
    fail("the {} pooling of {} tokens has {} of its {} rows", pooling_mode_name(mode_), tokens_, rows_added_,
         rows_read);
  if (dimensions < 1 || dimensions > static_cast<int64_t>(sum_.size()))
    fail("dimensions {} is outside 1 to {}", dimensions, sum_.size());
  std::vector<float> pooled(static_cast<size_t>(dimensions));
  for (size_t i = 0; i < pooled.size(); ++i) pooled[i] = static_cast<float>(sum_[i] / static_cast<double>(rows_read));
  return normalize ? l2_normalized(pooled) : pooled;
}

Tensor run_hidden_step(Model& model, ModelCache& cache, const std::vector<SequenceStep>& sequences,
                       const std::vector<int32_t>& rows) {
  Backend& backend = model.backend();
  const StepBatch batch = step_batch(sequences, cache, "model's");
  if (rows.empty()) fail("a hidden-state step must read at least one row");
  for (int32_t row : rows)
    if (row < 0 || row >= static_cast<int64_t>(batch.token_ids.size()))
      fail("hidden-state row {} is outside the step's {} tokens", row, batch.token_ids.size());
  const BatchLayout layout = backend.make_layout(batch.spans, batch.token_ids);
  const int64_t hidden_size = model.config().hidden_size;
  Tensor hidden = backend.alloc({static_cast<int64_t>(rows.size()), hidden_size}, backend.activation_dtype());
  model.forward_hidden(layout, upload_row_indices(backend, rows), cache, hidden);
  const Tensor activations = backend.download(hidden);
  if (activations.dtype() == DType::F32) return activations;
  Tensor widened = Tensor::empty(activations.shape(), DType::F32);
  const auto* bits = activations.data<const uint16_t>();
  float* out = widened.data<float>();
  for (int64_t i = 0; i < activations.numel(); ++i) {
    switch (activations.dtype()) {
      case DType::BF16: out[i] = bf16_to_f32(bits[i]); break;
      case DType::F16: out[i] = f16_to_f32(bits[i]); break;
      default: fail("hidden states in {} cannot be widened to f32", dtype_name(activations.dtype()));
    }
  }
  return widened;
}

std::vector<float> l2_normalized(std::span<const float> values) {
  double squares = 0.0;
  for (float value : values) squares += static_cast<double>(value) * value;
  // torch.nn.functional.normalize's eps: a zero vector stays zero.
  const double norm = std::max(std::sqrt(squares), 1e-12);
  std::vector<float> normalized(values.size());
  for (size_t i = 0; i < values.size(); ++i) normalized[i] = static_cast<float>(values[i] / norm);
  return normalized;
}

}  // namespace kiln
