// The Qwen3.5 / Qwen3-Next hybrid graph: Gated DeltaNet layers and gated attention layers.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <optional>
#include <string>

#include "backend/backend.h"
#include "io/config.h"
#include "io/fingerprint.h"
#include "model/moe.h"
#include "model/synth.h"
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

// The config rules of a hybrid model_type (transformers' Qwen3_5TextConfig, Qwen3NextConfig,
// Qwen3_5MoeTextConfig): head_dim and num_key_value_heads required, a quarter of each head rotated,
// the Gated DeltaNet fields, and with `moe` its mixture-of-experts fields.
ModelTypeRules hybrid_rules(std::string model_type, std::optional<MoeFieldDefaults> moe = std::nullopt,
                            std::optional<int64_t> default_intermediate_size = std::nullopt);
// The fields only the hybrid graph is shaped by (its MoE fields included, left out for dense models).
std::vector<GraphShapingField> hybrid_graph_shaping_fields();
// The tensors transformers' Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM saves for `config`, for
// `kiln synth` (sparse layers' experts in the fused v5 layout).
std::vector<SynthTensor> qwen3_5_text_synth_layout(const ModelConfig& config);
// The multi-token-prediction head's tensors beside them (mtp.*), for `kiln synth --mtp`.
std::vector<SynthTensor> qwen3_5_mtp_synth_layout(const ModelConfig& config);

}  // namespace kiln
