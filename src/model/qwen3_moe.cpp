// The Qwen3-MoE family — transformers' Qwen3MoeForCausalLM: the Qwen3 decoder (model/llama.cpp's
// graph, q/k RMSNorm before RoPE) whose MLP is, on its sparse layers, the mixture of experts of
// model/moe.h:
//
//   sparse layer i  ⇔  i ∉ mlp_only_layers  and  (i + 1) % decoder_sparse_step == 0
//   h = h + MoE(RMSNorm(h))      (top num_experts_per_tok of num_experts, renormalised when norm_topk_prob)
//   h = h + SwiGLU-MLP(RMSNorm(h))  on the other layers (width intermediate_size)
#include <nlohmann/json.hpp>

#include <fmt/format.h>

#include "model/family.h"
#include "model/llama.h"
#include "model/moe.h"

namespace kiln {
namespace {

// Qwen3MoeConfig (configuration_qwen3_moe.py): 128 experts, top 8, expert width 768, dense width
// 6144, norm_topk_prob false, every layer sparse (decoder_sparse_step 1, no mlp_only_layers).
constexpr MoeFieldDefaults kQwen3MoeDefaults{
    .experts = 128, .experts_per_token = 8, .expert_intermediate_size = 768, .normalize_top_k = false};

// transformers' save_pretrained layout: the dense decoder's tensors, with each sparse layer's MLP
// replaced by its router and per-expert matrices.
std::vector<SynthTensor> qwen3_moe_synth_layout(const ModelConfig& config) {
  std::vector<SynthTensor> tensors;
  for (SynthTensor& tensor : dense_decoder_synth_layout(config)) {
    const std::string& name = tensor.name;
    const size_t mlp = name.find(".mlp.");
    if (mlp != std::string::npos && name.starts_with("model.layers.")) {
      const int64_t layer = std::stoll(name.substr(std::string("model.layers.").size()));
      if (config.moe.sparse_layers.at(static_cast<size_t>(layer))) {
        // The layer's experts replace its dense MLP, once (at its gate_proj).
        if (name.ends_with(".mlp.gate_proj.weight"))
          for (SynthTensor& expert : sparse_moe_synth_layout(name.substr(0, mlp + 1), config, ExpertLayout::PerExpert))
            tensors.push_back(std::move(expert));
        continue;
      }
    }
    tensors.push_back(std::move(tensor));
  }
  return tensors;
}

}  // namespace

FamilySpec qwen3_moe_family() {
  using nlohmann::json;
  std::vector<GraphShapingField> fields = moe_graph_shaping_fields();
  return {
      .graph = "qwen3_moe",
      .loop = Loop::Autoregressive,
      .oracle = "transformers float64 logits, tests/data/fixtures/qwen3-moe-tiny",
      .model_types = {{.model_type = "qwen3_moe",
                       .qk_norm = true,
                       .head_dim_required = true,
                       .default_intermediate_size = 6144,
                       .read_family_fields =
                           [](const ConfigFields& text, ModelConfig& config) {
                             read_moe_fields(text, config, kQwen3MoeDefaults);
                           }}},
      .graph_shaping_fields = std::move(fields),
      // Canonical names but for the experts, which come per expert, fused or mlx-lm stacked.
      .sanitize = [](const Checkpoint& checkpoint, const ModelConfig& config, bool) {
        return plan_moe_checkpoint(checkpoint.tensors(), config);
      },
      // The llama graph runs the sparse layers through model/moe.h; experts are not split over ranks.
      .backends = {{Device::CPU, make_llama_model}, {Device::CUDA, make_llama_model}},
      .synth_shapes = {
        // As published on the Hugging Face Hub (Qwen/Qwen3-30B-A3B config.json), field for field.
        {"qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", json::parse(R"({
          "architectures": ["Qwen3MoeForCausalLM"],
          "attention_bias": false,
          "attention_dropout": 0.0,
          "bos_token_id": 151643,
          "decoder_sparse_step": 1,
          "eos_token_id": 151645,
          "head_dim": 128,
          "hidden_act": "silu",
          "hidden_size": 2048,
          "initializer_range": 0.02,
          "intermediate_size": 6144,
          "max_position_embeddings": 40960,
          "max_window_layers": 48,
          "mlp_only_layers": [],
          "model_type": "qwen3_moe",
          "moe_intermediate_size": 768,
          "norm_topk_prob": true,
          "num_attention_heads": 32,
          "num_experts": 128,
          "num_experts_per_tok": 8,
          "num_hidden_layers": 48,
          "num_key_value_heads": 4,
          "output_router_logits": false,
          "rms_norm_eps": 1e-06,
          "rope_scaling": null,
          "rope_theta": 1000000.0,
          "router_aux_loss_coef": 0.001,
          "sliding_window": null,
          "tie_word_embeddings": false,
          "torch_dtype": "bfloat16",
          "transformers_version": "4.51.0",
          "use_cache": true,
          "use_sliding_window": false,
          "vocab_size": 151936
        })")},
      },
      .synth_layout = qwen3_moe_synth_layout,
      .synth_model_types = {"qwen3_moe"},
  };
}

}  // namespace kiln
