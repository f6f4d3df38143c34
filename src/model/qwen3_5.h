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

// What the graph allocates, tensor by tensor, in bytes (engine/memory_plan.h): the cache of
// make_cache(slots, capacity) (KV rows for the attention layers, the conv tail and the delta-rule
// state for the GDN layers), and the scratch of one forward over `tokens` tokens with `logit_rows`
// logit rows. tests/memory_plan_test.cpp holds the cache to make_cache; the GPU memory test holds
// the whole plan above a served model's measured use.
std::vector<uint64_t> qwen3_5_cache_tensor_bytes(const ModelConfig& config, int64_t slots, int64_t capacity,
                                                 DType activation);
std::vector<uint64_t> qwen3_5_step_tensor_bytes(const ModelConfig& config, int64_t tokens, int64_t logit_rows,
                                                DType activation);

// The hybrid graph's split: gated attention and the MLP as in the dense graph (the q_proj rows of
// a head hold its query and its gate); a Gated DeltaNet layer by whole key heads with the value
// heads that read them (value head h reads key head h / (Hv / Hk), spec A.6): their q, k and v
// rows of in_proj_qkv and conv1d, their z, b, a rows, dt_bias and A_log, and the matching input
// columns of out_proj. The per-head norm weights are replicated.
void check_qwen3_5_tensor_parallel(const ModelConfig& config, int ranks);
TensorShard qwen3_5_tensor_shard(const ModelConfig& config, const TensorParallelRank& rank,
                                 const std::string& canonical, const Shape& shape);

}  // namespace kiln
