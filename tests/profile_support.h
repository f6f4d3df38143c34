// Small configs and profiles for the profile, registry and loader tests, built in memory so the
// rules can be tested without a checkpoint on disk.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "io/config.h"
#include "io/fingerprint.h"
#include "model/family.h"
#include "model/profile.h"
#include "test_support.h"

namespace kiln::testing {

// Sizes a config must have: each one given is checked, each one left out is not.
struct ConfigSizes {
  std::optional<int64_t> hidden_size = std::nullopt;
  std::optional<int64_t> intermediate_size = std::nullopt;
  std::optional<int64_t> num_hidden_layers = std::nullopt;
  std::optional<int64_t> num_attention_heads = std::nullopt;
  std::optional<int64_t> num_key_value_heads = std::nullopt;
  std::optional<int64_t> head_dim = std::nullopt;
  std::optional<int64_t> vocab_size = std::nullopt;
  std::optional<int64_t> linear_num_key_heads = std::nullopt;
  std::optional<int64_t> linear_num_value_heads = std::nullopt;
  std::optional<int64_t> linear_key_head_dim = std::nullopt;
  std::optional<int64_t> linear_value_head_dim = std::nullopt;
  std::optional<int64_t> linear_conv_kernel_dim = std::nullopt;
};

// Expects `config` to have each size given in `expected`, naming the field of any that differs.
inline void expect_sizes(const ModelConfig& config, const ConfigSizes& expected) {
  using Size = std::tuple<const char*, int64_t ModelConfig::*, std::optional<int64_t> ConfigSizes::*>;
  const Size sizes[] = {{"hidden_size", &ModelConfig::hidden_size, &ConfigSizes::hidden_size},
                        {"intermediate_size", &ModelConfig::intermediate_size, &ConfigSizes::intermediate_size},
                        {"num_hidden_layers", &ModelConfig::num_hidden_layers, &ConfigSizes::num_hidden_layers},
                        {"num_attention_heads", &ModelConfig::num_attention_heads, &ConfigSizes::num_attention_heads},
                        {"num_key_value_heads", &ModelConfig::num_key_value_heads, &ConfigSizes::num_key_value_heads},
                        {"head_dim", &ModelConfig::head_dim, &ConfigSizes::head_dim},
                        {"vocab_size", &ModelConfig::vocab_size, &ConfigSizes::vocab_size},
                        {"linear_num_key_heads", &ModelConfig::linear_num_key_heads,
                         &ConfigSizes::linear_num_key_heads},
                        {"linear_num_value_heads", &ModelConfig::linear_num_value_heads,
                         &ConfigSizes::linear_num_value_heads},
                        {"linear_key_head_dim", &ModelConfig::linear_key_head_dim, &ConfigSizes::linear_key_head_dim},
                        {"linear_value_head_dim", &ModelConfig::linear_value_head_dim,
                         &ConfigSizes::linear_value_head_dim},
                        {"linear_conv_kernel_dim", &ModelConfig::linear_conv_kernel_dim,
                         &ConfigSizes::linear_conv_kernel_dim}};
  for (const auto& [name, actual, wanted] : sizes) {
    if (expected.*wanted) {
      EXPECT_EQ(config.*actual, *(expected.*wanted)) << name;
    }
  }
}

// A tiny Llama-shaped config of the given model_type (hybrid fields filled for hybrid types, four
// experts on every layer for the MoE types).
inline ModelConfig tiny_config(const std::string& model_type = "llama") {
  ModelConfig config;
  config.source = "/models/tiny/config.json";
  config.model_type = model_type;
  config.outer_model_type = model_type;
  config.hidden_size = 64;
  config.intermediate_size = 128;
  config.num_hidden_layers = 4;
  config.num_attention_heads = 4;
  config.num_key_value_heads = 2;
  config.head_dim = 16;
  config.vocab_size = 256;
  config.max_position_embeddings = 512;
  config.rms_norm_eps = 1e-5;
  config.torch_dtype = "float32";
  config.layer_types.assign(4, LayerKind::FullAttention);
  const FamilySpec* family = builtin_families().find(model_type);
  if (family && family->loop == Loop::HybridRecurrent) {
    config.layer_types = {LayerKind::LinearAttention, LayerKind::LinearAttention, LayerKind::LinearAttention,
                          LayerKind::FullAttention};
    config.linear_num_key_heads = 2;
    config.linear_num_value_heads = 4;
    config.linear_key_head_dim = 16;
    config.linear_value_head_dim = 16;
    config.linear_conv_kernel_dim = 4;
    config.rope.partial_rotary_factor = 0.25;
    config.rope.mrope_section = {2, 1, 1};
    config.rope.mrope_interleaved = true;
  }
  if (model_type == "qwen3_moe" || model_type == "qwen3_5_moe_text") {
    config.moe.experts = 4;
    config.moe.experts_per_token = 2;
    config.moe.expert_intermediate_size = 32;
    config.moe.shared_expert_intermediate_size = model_type == "qwen3_5_moe_text" ? 32 : 0;
    config.moe.normalize_top_k = true;
    config.moe.sparse_layers.assign(4, true);
  }
  return config;
}

// A valid family profile spec for `graph` (the loop and capabilities its execution needs).
inline ModelProfileSpec family_spec(const std::string& id, Graph graph = builtin_graph("llama")) {
  ModelProfileSpec spec;
  spec.id = id;
  spec.fidelity = {FidelityTier::ReferenceParity, "transformers float64 logits"};
  spec.execution.graph = graph;
  spec.execution.loop = graph == builtin_graph("qwen3_5") || graph == builtin_graph("qwen3_5_moe")
                            ? Loop::HybridRecurrent
                            : Loop::Autoregressive;
  spec.execution.specialization = Specialization::Dedicated;
  spec.capabilities = execution_capabilities(spec.execution);
  return spec;
}

// An artifact fingerprint in the Hugging Face form, distinct per `tag`.
inline std::string hf_fingerprint(char tag = 'a') { return "hf:org/tiny@" + std::string(40, tag); }

// A valid exact-artifact spec bound to `artifact` and to `config`'s fingerprint.
inline ModelProfileSpec exact_spec(const std::string& id, const ModelConfig& config, const std::string& artifact,
                                   Graph graph = builtin_graph("llama")) {
  ModelProfileSpec spec = family_spec(id, graph);
  spec.execution.specialization = Specialization::Artifact;
  spec.artifact_fingerprint = artifact;
  spec.config_fingerprint = config_fingerprint(config);
  return spec;
}

// Sets an environment variable for the life of the object, then restores what was there.
class ScopedEnv {
 public:
  ScopedEnv(std::string name, const std::string& value) : name_(std::move(name)) {
    if (const char* previous = std::getenv(name_.c_str())) previous_ = previous;
    ::setenv(name_.c_str(), value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (previous_) ::setenv(name_.c_str(), previous_->c_str(), 1);
    else ::unsetenv(name_.c_str());
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> previous_;
};

}  // namespace kiln::testing

// Expects `statement` to throw a kiln::Error whose message mentions every listed fragment.
#define EXPECT_FAILS_MENTIONING(statement, ...)                                   \
  do {                                                                            \
    SCOPED_TRACE(#statement);                                                     \
    ::kiln::testing::expect_error_mentions([&] { statement; }, {__VA_ARGS__});   \
  } while (0)
