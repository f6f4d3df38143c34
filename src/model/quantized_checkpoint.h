// A quantized checkpoint's parts, found and checked from tensor names, shapes and dtypes alone
// (no byte is read), and added to a family's load plan.
//
// The family's sanitizer maps every tensor by name as usual; this step then marks each planned
// tensor that holds a quantized matrix's values (MLX: `M.weight` beside `M.scales` and `M.biases`;
// FP8: an F8_E4M3 `M.weight` beside `M.weight_scale_inv`), and re-plans the matrix's other parts
// beside it with the same row fix-ups, so a family's row regrouping (Qwen3-Next's in_proj_qkvz)
// carries its scales along. AWQ and GPTQ matrices (`M.qweight` beside `M.qzeros`, `M.scales` and,
// for GPTQ, `M.g_idx`) are planned instead as the three Affine parts `M.weight`, `M.scales` and
// `M.biases`, each computed at materialisation from the stored tensors (AffineRepack in
// model/load_plan.h); g_idx, once checked to be k / group_size, is dropped. Every error names the
// file, the tensor or the config field.
#pragma once

#include "io/quantization_config.h"
#include "io/safetensors.h"
#include "model/load_plan.h"

namespace kiln {

LoadPlan plan_quantized_weights(LoadPlan sanitized, const Checkpoint& checkpoint,
                                const QuantizationConfig& quantization, const std::filesystem::path& config_source);

}  // namespace kiln
