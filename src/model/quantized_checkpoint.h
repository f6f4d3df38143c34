// A quantized checkpoint's matrices, found and checked from tensor names, shapes and dtypes alone
// (no byte is read), and planned beside the family's own plan.
//
// MLX: `M.weight` (U32 codes) beside `M.scales` and `M.biases`; FP8: an F8_E4M3 `M.weight`
// beside `M.weight_scale_inv`. The family's sanitizer sees the checkpoint as if it were dense (each
// quantized matrix as a float tensor of its logical shape, its other parts hidden), so it plans
// names and shapes as it always does; each planned matrix is then marked quantized and its other
// parts are planned beside it with the same row fix-ups (a family's row regrouping, Qwen3-Next's
// in_proj_qkvz, carries its scales along). AWQ and GPTQ matrices (`M.qweight` beside `M.qzeros`,
// `M.scales` and, for GPTQ, `M.g_idx`), mapped by the sanitizer as stored, are planned instead as
// the three Affine parts `M.weight`, `M.scales` and `M.biases`, each computed at materialisation
// from the stored tensors (AffineRepack in model/load_plan.h); g_idx, once checked to be
// k / group_size, is dropped. Every error names the file, the tensor or the config field.
#pragma once

#include <functional>
#include <map>
#include <set>
#include <string>

#include "io/config.h"
#include "io/safetensors.h"
#include "model/load_plan.h"

namespace kiln {

// The load plan of `checkpoint` for a model of `config`, from the family's `sanitize`.
LoadPlan plan_checkpoint(const Checkpoint& checkpoint, const ModelConfig& config,
                         const std::function<LoadPlan(const Checkpoint&)>& sanitize);

}  // namespace kiln
