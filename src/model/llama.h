// The dense decoder graph shared by Llama-2/3, MiniCPM5 (a Llama checkpoint), Qwen2 (q/k/v bias)
// and Qwen3 (per-head q/k RMSNorm before RoPE). llama.cpp declares the llama family (llama, qwen2);
// qwen3.cpp declares the qwen3 family on the same graph code.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "io/config.h"
#include "model/load_plan.h"
#include "model/model.h"
#include "model/synth.h"
#include "model/tensor_parallel_rank.h"

namespace kiln {

// Builds the graph over `weights` (borrowed: the model keeps device copies or views of the
// tensors it takes) on `backend`. Fails naming the tensor when a weight is missing or misshapen.
// A tensor-parallel `rank` builds that rank's part over weights sharded by llama_tensor_shard.
std::unique_ptr<Model> make_llama_model(WeightMap& weights, const ModelConfig& config, Backend& backend,
                                        const TensorParallelRank& rank = {});

// The dense graph's split (Megatron): q/k/v and gate/up by output rows (whole heads), o_proj and
// down_proj by input columns; their biases are added once, by rank 0.
void check_llama_tensor_parallel(const ModelConfig& config, int ranks);
TensorShard llama_tensor_shard(const ModelConfig& config, const TensorParallelRank& rank, const std::string& canonical,
                               const Shape& shape);

// The load plan of a dense graph checkpoint: its tensors under their own names, or, for a bare
// decoder saved without the causal-LM wrapper (transformers' LlamaModel, Qwen2Model or Qwen3Model,
// as Qwen3-Embedding ships: embed_tokens.weight, layers.N.…, norm.weight), each under "model.".
LoadPlan dense_decoder_plan(const Checkpoint& checkpoint);

// The tensors of a Hugging Face checkpoint of the dense graph (transformers' LlamaForCausalLM,
// Qwen2ForCausalLM and Qwen3ForCausalLM parameter names and shapes), for `kiln synth`.
std::vector<SynthTensor> dense_decoder_synth_layout(const ModelConfig& config);

}  // namespace kiln
