// The Qwen3.5 / Qwen3-Next hybrid graph: Gated DeltaNet layers and gated attention layers.
#pragma once

#include <memory>

#include "backend/backend.h"
#include "io/config.h"
#include "model/load_plan.h"
#include "model/model.h"

namespace kiln {

// Builds the graph over canonical weights (see model/qwen3_5_checkpoint.h for the plan that
// maps both checkpoint generations onto them). Fails naming a missing or misshapen tensor.
std::unique_ptr<Model> make_qwen3_5_model(WeightMap& weights, const ModelConfig& config, Backend& backend);

}  // namespace kiln
