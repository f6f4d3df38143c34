// The Qwen3.5 / Qwen3-Next hybrid graph: Gated DeltaNet layers and gated attention layers.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "io/config.h"
#include "model/load_plan.h"
#include "model/model.h"
#include "model/tensor_parallel_rank.h"

namespace kiln {

// Builds the graph over canonical weights (see model/qwen3_5_checkpoint.h for the plan that
// maps both checkpoint generations onto them). Fails naming a missing or misshapen tensor.
// A tensor-parallel `rank` builds that rank's part over weights sharded by qwen3_5_tensor_shard.
std::unique_ptr<Model> make_qwen3_5_model(WeightMap& weights, const ModelConfig& config, Backend& backend,
                                          const TensorParallelRank& rank = {});

// The hybrid graph's split: gated attention and the MLP as in the dense graph (the q_proj rows of
// a head hold its query and its gate); a Gated DeltaNet layer by whole key heads with the value
// heads that read them (value head h reads key head h / (Hv / Hk), spec A.6): their q, k and v
// rows of in_proj_qkv and conv1d, their z, b, a rows, dt_bias and A_log, and the matching input
// columns of out_proj. The per-head norm weights are replicated.
void check_qwen3_5_tensor_parallel(const ModelConfig& config, int ranks);
TensorShard qwen3_5_tensor_shard(const ModelConfig& config, const TensorParallelRank& rank,
                                 const std::string& canonical, const Shape& shape);

}  // namespace kiln
