// What one rank of a tensor-parallel model is (model/tensor_parallel.h has the design), and how a
// graph declares that it can be split: a config check, a shard rule, a rank factory.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "backend/backend.h"
#include "backend/collective.h"
#include "io/config.h"
#include "model/load_plan.h"
#include "model/model.h"

namespace kiln {

struct ResolvedProfile;

// Rank `rank` of `ranks`; `collective` (borrowed) is null for an unsplit model (ranks == 1), whose
// graph then runs exactly its single-device code.
struct TensorParallelRank {
  int rank = 0;
  int ranks = 1;
  Collective* collective = nullptr;
};

// The attention heads one rank holds: query heads [first_head, first_head + heads) and key/value
// heads [first_kv_head, first_kv_head + kv_heads). When there are fewer KV heads than ranks, each
// KV head is replicated on ranks / num_key_value_heads consecutive ranks (those whose query heads
// read it), so a rank always holds whole query groups.
struct AttentionShard {
  int64_t first_head = 0, heads = 0;
  int64_t first_kv_head = 0, kv_heads = 0;
};
AttentionShard attention_shard(const ModelConfig& config, const TensorParallelRank& rank);

// Fails, naming the field and N, unless `ranks` ≥ 1 and the attention heads split over it: query
// heads divisible by N, key/value heads divisible by N or dividing N.
void check_attention_split(const ModelConfig& config, int ranks);
// Fails when `ranks` > 1 and the model has experts: kiln splits dense layers only.
void check_no_experts(const ModelConfig& config, int ranks);
// Fails, naming `field` and N, unless `value` is divisible by `ranks`.
void check_divisible(const char* field, int64_t value, int ranks);

// A graph's tensor-parallel support, registered with its implementation (model/registry.h).
struct TensorParallelSupport {
  // Fails, naming the config field and N, when the config cannot be split over `ranks`; called
  // before any weight is read.
  std::function<void(const ModelConfig& config, int ranks)> check;
  // The part of the canonical tensor `canonical` (full shape `shape`) that `rank` holds.
  std::function<TensorShard(const ModelConfig& config, const TensorParallelRank& rank, const std::string& canonical,
                            const Shape& shape)>
      shard;
  // Builds one rank's graph over its sharded weights.
  std::function<std::unique_ptr<Model>(WeightMap& weights, const ModelConfig& config, const ResolvedProfile& profile,
                                       Backend& backend, const TensorParallelRank& rank)>
      create;

  bool supported() const { return check && shard && create; }
};

}  // namespace kiln
