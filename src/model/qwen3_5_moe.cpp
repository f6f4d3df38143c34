// The Qwen3.5-MoE family — transformers' Qwen3_5MoeForCausalLM (and the text model of
// Qwen3_5MoeForConditionalGeneration): model/qwen3_5.cpp's hybrid graph (Gated DeltaNet and gated
// attention layers) whose every MLP is the mixture of model/moe.h with a shared expert:
//
//   h = h + MoE(RMSNorm_zc(h)) + σ(x·w_sharedᵀ) · SwiGLU_shared(x)     (top-k always renormalised)
//
// Checkpoints: the Hub's fused experts (experts.gate_up_proj / experts.down_proj), transformers'
// save_pretrained per-expert tensors, or mlx-lm's switch_mlp stacks, in every Qwen3.5 naming
// generation (model/qwen3_5_checkpoint.h).
#include <nlohmann/json.hpp>

#include "model/family.h"
#include "model/moe.h"
#include "model/qwen3_5.h"
#include "model/qwen3_5_checkpoint.h"

namespace kiln {
namespace {

// Qwen3_5MoeTextConfig (configuration_qwen3_5_moe.py): 256 experts, top 8, experts and shared
// expert of width 512; no norm_topk_prob (always renormalised) and no dense layers.
constexpr MoeFieldDefaults kQwen3_5MoeDefaults{.experts = 256,
                                               .experts_per_token = 8,
                                               .expert_intermediate_size = 512,
                                               .shared_expert_intermediate_size = 512,
                                               .normalize_top_k = true,
                                               .normalize_field = false,
                                               .sparse_step_fields = false};

// Qwen/Qwen3.5-35B-A3B's text model, written as save_pretrained writes a Qwen3_5MoeForCausalLM:
// 256 experts, top 8 and one shared expert as transformers' model page (qwen3_5_moe.md) documents
// them. The widths (hidden 2048, 40 layers, 16 query / 2 KV heads of 256, 32 GDN value heads,
// experts and shared expert of 512) are the published config's as we remember it: the Hub cannot
// be reached from kiln's machines to check them, so treat the shape as "35B-A3B-sized".
nlohmann::json qwen3_5_35b_a3b_config() {
  nlohmann::json layer_types = nlohmann::json::array();
  for (int layer = 0; layer < 40; ++layer) layer_types.push_back((layer + 1) % 4 == 0 ? "full_attention" : "linear_attention");
  nlohmann::json config = nlohmann::json::parse(R"({
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "attention_bias": false,
    "attention_dropout": 0.0,
    "bos_token_id": null,
    "eos_token_id": null,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "model_type": "qwen3_5_moe_text",
    "moe_intermediate_size": 512,
    "num_attention_heads": 16,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 40,
    "num_key_value_heads": 2,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"mrope_interleaved": true, "mrope_section": [11, 11, 10],
                        "partial_rotary_factor": 0.25, "rope_theta": 10000000.0, "rope_type": "default"},
    "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": false,
    "torch_dtype": "bfloat16",
    "use_cache": true,
    "vocab_size": 248320
  })");
  config["layer_types"] = layer_types;
  return config;
}

}  // namespace

FamilySpec qwen3_5_moe_family() {
  return {
      .graph = "qwen3_5_moe",
      .loop = Loop::HybridRecurrent,
      .oracle = "transformers float64 logits, tests/data/fixtures/qwen3_5-moe-tiny",
      .model_types = {hybrid_rules("qwen3_5_moe_text", kQwen3_5MoeDefaults, 0)},
      // The multimodal Qwen3.5-MoE: its text model.
      .wrappers = {{"qwen3_5_moe", "qwen3_5_moe_text"}},
      .graph_shaping_fields = hybrid_graph_shaping_fields(),
      .sanitize = [](const Checkpoint& checkpoint, const ModelConfig& config,
                     bool keep_mtp) { return plan_qwen3_5_checkpoint(checkpoint.tensors(), config, keep_mtp); },
      // The graph needs the backend's HybridOps: the CPU and CUDA have them.
      .backends = {{Device::CPU, make_qwen3_5_model}, {Device::CUDA, make_qwen3_5_model}},
      .synth_shapes = {{"qwen3.5-35b-a3b", "Qwen/Qwen3.5-35B-A3B (text model; see qwen3_5_35b_a3b_config)",
                        qwen3_5_35b_a3b_config()}},
      .synth_layout = qwen3_5_text_synth_layout,
      .synth_model_types = {"qwen3_5_moe_text"},
      .synth_mtp_layout = qwen3_5_mtp_synth_layout,
  };
}

}  // namespace kiln
