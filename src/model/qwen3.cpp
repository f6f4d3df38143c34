// The Qwen3 family — transformers' Qwen3ForCausalLM: the dense decoder graph of model/llama.cpp
// with per-head q/k RMSNorm before RoPE (Qwen3Config: head_dim defaults to 128, so it is required).
#include <nlohmann/json.hpp>

#include "model/family.h"
#include "model/llama.h"

namespace kiln {

FamilySpec qwen3_family() {
  using nlohmann::json;
  return {
      .graph = "qwen3",
      .loop = Loop::Autoregressive,
      .oracle = "transformers float64 logits, fixtures/tiny/qwen3-tiny",
      .model_types = {{.model_type = "qwen3", .qk_norm = true, .head_dim_required = true}},
      // Qwen3 checkpoints are stored under the graph's canonical names; Qwen3-Embedding's bare
      // Qwen3Model under them less "model.".
      .sanitize = [](const Checkpoint& checkpoint, const ModelConfig&, bool) { return dense_decoder_plan(checkpoint); },
      .tensor_parallel = {check_llama_tensor_parallel, llama_tensor_shard},
      .backends = {{Device::CPU, make_llama_model}, {Device::CUDA, make_llama_model}},
      // As published on the Hugging Face Hub, field for field.
      .synth_shapes = {
        {"qwen3-0.6b", "Qwen/Qwen3-0.6B", json::parse(R"({
          "architectures": ["Qwen3ForCausalLM"],
          "attention_bias": false,
          "attention_dropout": 0.0,
          "bos_token_id": 151643,
          "eos_token_id": 151645,
          "head_dim": 128,
          "hidden_act": "silu",
          "hidden_size": 1024,
          "initializer_range": 0.02,
          "intermediate_size": 3072,
          "max_position_embeddings": 40960,
          "max_window_layers": 28,
          "model_type": "qwen3",
          "num_attention_heads": 16,
          "num_hidden_layers": 28,
          "num_key_value_heads": 8,
          "rms_norm_eps": 1e-06,
          "rope_scaling": null,
          "rope_theta": 1000000,
          "sliding_window": null,
          "tie_word_embeddings": true,
          "torch_dtype": "bfloat16",
          "transformers_version": "4.51.0",
          "use_cache": true,
          "use_sliding_window": false,
          "vocab_size": 151936
        })")},
        {"qwen3-8b", "Qwen/Qwen3-8B", json::parse(R"({
          "architectures": ["Qwen3ForCausalLM"],
          "attention_bias": false,
          "attention_dropout": 0.0,
          "bos_token_id": 151643,
          "eos_token_id": 151645,
          "head_dim": 128,
          "hidden_act": "silu",
          "hidden_size": 4096,
          "initializer_range": 0.02,
          "intermediate_size": 12288,
          "max_position_embeddings": 40960,
          "max_window_layers": 36,
          "model_type": "qwen3",
          "num_attention_heads": 32,
          "num_hidden_layers": 36,
          "num_key_value_heads": 8,
          "rms_norm_eps": 1e-06,
          "rope_scaling": null,
          "rope_theta": 1000000,
          "sliding_window": null,
          "tie_word_embeddings": false,
          "torch_dtype": "bfloat16",
          "transformers_version": "4.51.0",
          "use_cache": true,
          "use_sliding_window": false,
          "vocab_size": 151936
        })")},
      },
      .synth_layout = dense_decoder_synth_layout,
      .synth_model_types = {"qwen3"},
  };
}

}  // namespace kiln
