// One input's embedding: its final hidden states (Model::forward_hidden) pooled as the model's
// PoolingConfig says, then cut to the first `dimensions` values (Matryoshka) and L2-normalised.
// The rows arrive chunk by chunk as the input is prefilled; the pooling sums them on the host in
// position order, so the embedding depends only on the input's own rows, which are the same bits
// whatever batch or chunking computed them (DEVELOPERS.md, contract 1).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/tensor.h"
#include "engine/generation.h"
#include "io/pooling_config.h"
#include "model/model.h"

namespace kiln {

class PooledEmbedding {
 public:
  // An input of `tokens` tokens (at least one) whose hidden states have `hidden_size` values.
  PooledEmbedding(PoolingMode mode, int64_t tokens, int64_t hidden_size);

  // Whether the pooling reads the hidden state at `position`.
  bool reads(int64_t position) const;
  // Takes the hidden state at `position`, one the pooling reads, in ascending position order.
  void add(int64_t position, std::span<const float> hidden);
  // The embedding once every row it reads was added: the pooled vector's first `dimensions` values
  // (1 to hidden_size), divided by their L2 norm when `normalize` (as torch's F.normalize, the
  // norm at least 1e-12). Truncating before normalising is what Matryoshka-trained models expect.
  std::vector<float> finish(int64_t dimensions, bool normalize) const;

 private:
  PoolingMode mode_;
  int64_t tokens_;
  int64_t rows_added_ = 0;
  int64_t next_position_ = 0;
  std::vector<double> sum_;  // the sum of the rows read (one row for last-token and cls pooling)
};

// Runs one forward over `sequences` (in order) stopped before lm_head, and returns the final hidden
// states (Model::forward_hidden) of `rows`, indices into the step's tokens sequence by sequence, as
// a host f32 tensor [rows, hidden_size]: exact widenings of the backend's activations.
Tensor run_hidden_step(Model& model, ModelCache& cache, const std::vector<SequenceStep>& sequences,
                       const std::vector<int32_t>& rows);

// The L2-normalised copy of `values` (each divided by max(‖values‖₂, 1e-12), computed in double).
std::vector<float> l2_normalized(std::span<const float> values);

}  // namespace kiln
