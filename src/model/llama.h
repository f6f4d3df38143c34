// The dense decoder graph shared by Llama-2/3, MiniCPM5 (a Llama checkpoint), Qwen2 (q/k/v bias)
// and Qwen3 (per-head q/k RMSNorm before RoPE).
#pragma once

#include <memory>

#include "backend/backend.h"
#include "io/config.h"
#include "model/load_plan.h"
#include "model/model.h"

namespace kiln {

// Builds the graph over `weights` (borrowed: the model keeps device copies or views of the
// tensors it takes) on `backend`. Fails naming the tensor when a weight is missing or misshapen.
std::unique_ptr<Model> make_llama_model(WeightMap& weights, const ModelConfig& config, Backend& backend);

}  // namespace kiln
