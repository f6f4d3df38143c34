// The Qwen3.5 / Qwen3-Next checkpoint sanitizer: one load plan that maps every checkpoint
// generation (spec A.9) onto the canonical form the hybrid graph takes.
//
// kiln's canonical form is the Hugging Face convention, with the conv unit axis dropped:
//   names   model.embed_tokens.weight, model.layers.{i}.…, model.norm.weight, lm_head.weight
//   GDN     linear_attn.in_proj_qkv / in_proj_z / in_proj_b / in_proj_a in the Qwen3.5 row layout
//           (spec A.6.1), linear_attn.conv1d.weight [Cconv, Kc]
//   norms   zero-centred gains (input_layernorm, post_attention_layernorm, model.norm,
//           self_attn.q_norm, self_attn.k_norm) stored as γ — the graph computes 1 + γ in f32
//           (spec A.4 #1); linear_attn.norm.weight is a plain multiplier and is never shifted.
//
// Generations it accepts:
//   HF Qwen3.5 text       model.*, conv [C, 1, K], γ, maybe mtp.*
//   HF Qwen3.5 multimodal model.language_model.*, lm_head.*, model.visual.*, mtp.*, conv [C, 1, K], γ
//   mlx-lm conversion     language_model.model.*, language_model.lm_head.*, vision_tower.*,
//                         conv [C, K, 1], gains stored as ⟦1 + γ⟧, no mtp.*
//   HF Qwen3-Next         model.*, in_proj_qkvz + in_proj_ba (regrouped by a row gather), conv [C, 1, K]
//   kiln canonical        model.*, conv [C, K], γ: the identity plan
//
// The gain convention is decided once over the whole weight map, never per tensor name: any mtp.*
// tensor or any conv1d in the HF [C, 1, K] layout marks an HF export (γ, used as stored);
// otherwise a conv1d in the mlx [C, K, 1] layout marks an mlx-lm conversion (1 + γ, shifted back by
// SubtractOne); otherwise the artifact is canonical. The decision is recorded in the plan's notes.
// Vision-tower tensors are dropped (the text graph does not run them), and lm_head is dropped when
// the config ties it to the embedding. The multi-token-prediction head's tensors (named by `mtp.`
// anywhere: mtp.*, language_model.mtp.*, model.mtp.*) are dropped too unless the load keeps them
// for --speculative mtp: then they are renamed to mtp.* and checked (one full-attention layer with
// the model's MLP, fc [H, 2H] and three zero-centred norms; engine/mtp_proposer.h runs them).
#pragma once

#include <map>
#include <string>

#include "io/config.h"
#include "io/safetensors.h"
#include "model/load_plan.h"

namespace kiln {

// A pure function of the tensor headers and the config (no byte is read). Validates every tensor
// the plan's decisions rest on — the GDN tensors of each linear_attention layer, the zero-centred
// gains, the conv layouts — and fails with a kiln::Error naming the tensor on anything malformed:
// an unknown name prefix, two sources for one canonical name, a missing or mis-shaped tensor, a
// tensor of the wrong layer kind, conv layouts that disagree between layers. With `keep_mtp`, also
// on a checkpoint without MTP weights, a config declaring other than one MTP layer, and a missing,
// misshapen or unknown mtp.* tensor.
LoadPlan plan_qwen3_5_checkpoint(const std::map<std::string, TensorInfo>& tensors, const ModelConfig& config,
                                 bool keep_mtp = false);

}  // namespace kiln
