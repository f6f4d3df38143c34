// Llama / Qwen2 / Qwen3 / MiniCPM5 — transformers' LlamaForCausalLM and Qwen3ForCausalLM:
//
//   h = E[x]
//   for each layer:
//     a = RMSNorm(h)
//     q, k, v = a·Wqᵀ (+bq), a·Wkᵀ (+bk), a·Wvᵀ (+bv)         (bias: Qwen2, attention_bias)
//     q, k = RMSNorm_head(q), RMSNorm_head(k)                   (Qwen3 only)
//     q, k = RoPE(q), RoPE(k)                                   (rotate-half, default or llama3)
//     h = h + Attention(q, K, V)·Woᵀ                            (causal, GQA, scale dh^-½)
//     h = h + (silu(b·Wgᵀ) ⊙ b·Wuᵀ)·Wdᵀ  with b = RMSNorm(h)
//   logits = RMSNorm(h)·Wlmᵀ                                     (Wlm = E when tied and absent)
//
// Split over tensor-parallel ranks (model/tensor_parallel.h), a rank holds whole query heads with
// their KV heads and a column block of the MLP; Attention·Woᵀ and the MLP's ·Wdᵀ are then partial
// sums, all-reduced before they join the residual. With one rank the code below is unchanged.
#include "model/llama.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "model/family.h"
#include "model/moe.h"
#include "model/paged_kv_cache.h"
#include "model/rope_frequencies.h"

namespace kiln {
namespace {

struct LlamaLayer {
  Tensor input_norm, post_attention_norm;
  Weight q_proj, k_proj, v_proj, o_proj;
  Tensor q_bias, k_bias, v_bias, o_bias;  // undefined when the family has none
  Tensor q_norm, k_norm;                  // Qwen3 only
  Weight gate_proj, up_proj, down_proj;
  Tensor gate_bias, up_bias, down_bias;   // Llama mlp_bias only
  std::optional<SparseMoeWeights> moe;    // a sparse layer's experts (Qwen3-MoE) instead of the MLP
};

class KVCache final : public ModelCache {
 public:
  KVCache(Backend& backend, int64_t layers, int64_t slots, int64_t capacity, int64_t blocks, int64_t kv_heads,
          int64_t head_dim)
      : kv(backend, layers, slots, capacity, blocks, kv_heads, head_dim), slots_(slots), capacity_(capacity) {}
  int64_t slots() const override { return slots_; }
  int64_t capacity() const override { return capacity_; }
  int64_t blocks() const override { return kv.blocks(); }
  int64_t table_width() const override { return kv.table_width(); }
  void assign_blocks(int32_t slot, int64_t first_entry, std::span<const int32_t> blocks) override {
    kv.assign_blocks(slot, first_entry, blocks);
  }
  // Attention reads only rows 0..position of a slot, all written by the slot's own sequence
  // before they are read, so a slot needs no clearing to be reused.
  void reset_slot(int32_t slot) override {
    if (slot < 0 || slot >= slots_) fail("cache slot {} out of range (cache has {} slots)", slot, slots_);
  }
  bool resumes_at_any_position() const override { return true; }
  size_t bytes() const override { return kv.bytes(); }

  PagedKvCache kv;

 private:
  int64_t slots_, capacity_;
};

class LlamaModel final : public Model {
 public:
  LlamaModel(WeightMap& weights, const ModelConfig& config, Backend& backend, const TensorParallelRank& rank)
      : config_(config), backend_(backend), collective_(rank.collective) {
    const AttentionShard heads = attention_shard(config, rank);
    heads_ = heads.heads;
    kv_heads_ = heads.kv_heads;
    ffn_ = config.intermediate_size / rank.ranks;
    const int64_t hidden = config.hidden_size;
    const int64_t q_width = heads_ * config.head_dim;
    const int64_t kv_width = kv_heads_ * config.head_dim;
    const int64_t ffn = ffn_;
    // A row-parallel layer's bias joins its partial sum on rank 0 only (the others hold none).
    const int64_t reduced_bias = rank.rank == 0 ? hidden : 0;

    auto take = [&](const std::string& name, const Shape& shape) { return backend.upload(weights.take(name, shape)); };
    auto take_matrix = [&](const std::string& name, const Shape& shape) {
      return backend.upload_weight(weights.take_weight(name, shape));
    };
    embed_tokens_ = take_matrix("model.embed_tokens.weight", {config.vocab_size, hidden});
    for (int64_t index = 0; index < config.num_hidden_layers; ++index) {
      const std::string prefix = "model.layers." + std::to_string(index) + ".";
      LlamaLayer layer;
      layer.input_norm = take(prefix + "input_layernorm.weight", {hidden});
      layer.post_attention_norm = take(prefix + "post_attention_layernorm.weight", {hidden});
      layer.q_proj = take_matrix(prefix + "self_attn.q_proj.weight", {q_width, hidden});
      layer.k_proj = take_matrix(prefix + "self_attn.k_proj.weight", {kv_width, hidden});
      layer.v_proj = take_matrix(prefix + "self_attn.v_proj.weight", {kv_width, hidden});
      layer.o_proj = take_matrix(prefix + "self_attn.o_proj.weight", {hidden, q_width});
      if (config.attention_bias) {
        layer.q_bias = take(prefix + "self_attn.q_proj.bias", {q_width});
        layer.k_bias = take(prefix + "self_attn.k_proj.bias", {kv_width});
        layer.v_bias = take(prefix + "self_attn.v_proj.bias", {kv_width});
      }
      if (config.attention_output_bias) layer.o_bias = take(prefix + "self_attn.o_proj.bias", {reduced_bias});
      if (config.qk_norm) {
        layer.q_norm = take(prefix + "self_attn.q_norm.weight", {config.head_dim});
        layer.k_norm = take(prefix + "self_attn.k_norm.weight", {config.head_dim});
      }
      if (config.moe.experts > 0 && config.moe.sparse_layers.at(index)) {
        layer.moe = take_sparse_moe(weights, backend, prefix, config);
        layers_.push_back(std::move(layer));
        continue;
      }
      layer.gate_proj = take_matrix(prefix + "mlp.gate_proj.weight", {ffn, hidden});
      layer.up_proj = take_matrix(prefix + "mlp.up_proj.weight", {ffn, hidden});
      layer.down_proj = take_matrix(prefix + "mlp.down_proj.weight", {hidden, ffn});
      if (config.mlp_bias) {
        layer.gate_bias = take(prefix + "mlp.gate_proj.bias", {ffn});
        layer.up_bias = take(prefix + "mlp.up_proj.bias", {ffn});
        layer.down_bias = take(prefix + "mlp.down_proj.bias", {reduced_bias});
      }
      layers_.push_back(std::move(layer));
    }
    const auto sparse_layers =
        std::count_if(layers_.begin(), layers_.end(), [](const LlamaLayer& layer) { return layer.moe.has_value(); });
    expert_reads_ = ExpertReadCounter(backend, sparse_layers);
    final_norm_ = take("model.norm.weight", {hidden});
    // A checkpoint that stores lm_head uses it; a tied one without it reads the embedding; an
    // untied one without it (a bare decoder, e.g. Qwen3-Embedding-8B's Qwen3Model) has none and
    // gives hidden states only.
    if (weights.contains("lm_head.weight"))
      lm_head_ = take_matrix("lm_head.weight", {config.vocab_size, hidden});
    else if (config.tie_word_embeddings)
      lm_head_ = embed_tokens_;

    const int64_t rotary_dim = rope_rotary_dim(config);
    std::vector<float> inv_freq = rope_inverse_frequencies(config.rope, rotary_dim, rope_frequency_dtype(config, embed_tokens_.float_dtype()));
    Tensor host_inv_freq = Tensor::empty({static_cast<int64_t>(inv_freq.size())}, DType::F32);
    std::copy(inv_freq.begin(), inv_freq.end(), host_inv_freq.data<float>());
    inv_freq_ = backend.upload(host_inv_freq);
    rotary_dim_ = static_cast<int>(rotary_dim);
  }

  const ModelConfig& config() const override { return config_; }
  Backend& backend() const override { return backend_; }

  size_t decode_weight_bytes() const override {
    size_t bytes = final_norm_.nbytes() + embed_tokens_.row_nbytes();
    if (lm_head_.defined()) bytes += lm_head_.nbytes();
    for (const LlamaLayer& layer : layers_) {
      for (const Tensor* tensor : {&layer.input_norm, &layer.post_attention_norm, &layer.q_bias, &layer.k_bias,
                                   &layer.v_bias, &layer.o_bias, &layer.q_norm, &layer.k_norm, &layer.gate_bias,
                                   &layer.up_bias, &layer.down_bias})
        if (tensor->defined()) bytes += tensor->nbytes();
      for (const Weight* weight : {&layer.q_proj, &layer.k_proj, &layer.v_proj, &layer.o_proj, &layer.gate_proj,
                                   &layer.up_proj, &layer.down_proj})
        bytes += weight->nbytes();
      if (layer.moe) bytes += sparse_moe_bytes(*layer.moe, config_.moe, config_.moe.experts_per_token);
    }
    return bytes;
  }

  double weight_bytes_read(int64_t forwards) override {
    const std::vector<uint64_t> experts_read = expert_reads_.take();
    double bytes = Model::weight_bytes_read(forwards);
    size_t sparse = 0;
    // decode_weight_bytes() counts experts_per_token experts of each sparse layer per forward.
    for (const LlamaLayer& layer : layers_)
      if (layer.moe)
        bytes += static_cast<double>(sparse_moe_expert_bytes(*layer.moe, config_.moe)) *
                 (static_cast<double>(experts_read[sparse++]) -
                  static_cast<double>(forwards * config_.moe.experts_per_token));
    return bytes;
  }

  std::unique_ptr<ModelCache> make_cache(int64_t slots, int64_t capacity, int64_t blocks) const override {
    return std::make_unique<KVCache>(backend_, config_.num_hidden_layers, slots, capacity, blocks, kv_heads_,
                                     config_.head_dim);
  }

  bool computes_logits() const override { return lm_head_.defined(); }

  void forward(const BatchLayout& layout, const Tensor& logit_rows, ModelCache& model_cache,
               Tensor& logits) override {
    if (!lm_head_.defined())
      fail("this checkpoint has no lm_head.weight and does not tie it to the embedding (tie_word_embeddings is "
           "false): it gives hidden states only (kiln serve --embeddings), not logits");
    run_layers(layout, model_cache,
               [&](const Tensor& normed) { lm_head_logits(backend_, normed, logit_rows, lm_head_, logits); });
  }

  void forward_hidden(const BatchLayout& layout, const Tensor& rows, ModelCache& model_cache,
                      Tensor& hidden) override {
    run_layers(layout, model_cache, [&](const Tensor& normed) { backend_.gather_rows(normed, rows, hidden); });
  }

 private:
  // Runs the layers and the final norm over the step's tokens, then `head` on the normed hidden
  // states [tokens, hidden]. The head runs while the step's buffers are still held, so a forward
  // allocates as it did before forward_hidden existed (what the memory plan and the captured
  // decode graphs were measured with).
  template <typename Head>
  void run_layers(const BatchLayout& layout, ModelCache& model_cache, const Head& head) {
    auto& cache = dynamic_cast<KVCache&>(model_cache);
    const int64_t tokens = layout.total_tokens;
    const int64_t hidden = config_.hidden_size;
    const int64_t heads = heads_;
    const int64_t kv_heads = kv_heads_;
    const int64_t head_dim = config_.head_dim;
    const float eps = static_cast<float>(config_.rms_norm_eps);
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
    const DType act = backend_.activation_dtype();
    Backend& ops = backend_;

    // The residual stream and the products that join it stay f32 (see model.h).
    Tensor residual = ops.alloc({tokens, hidden}, DType::F32);
    Tensor normed = ops.alloc({tokens, hidden}, act);
    Tensor q = ops.alloc({tokens, heads, head_dim}, act);
    Tensor k = ops.alloc({tokens, kv_heads, head_dim}, act);
    Tensor v = ops.alloc({tokens, kv_heads, head_dim}, act);
    Tensor attention = ops.alloc({tokens, heads, head_dim}, act);
    Tensor projected = ops.alloc({tokens, hidden}, DType::F32);
    Tensor gate = ops.alloc({tokens, ffn_}, act);
    Tensor up = ops.alloc({tokens, ffn_}, act);
    auto flat = [](const Tensor& t) { return t.reshape({t.dim(0), t.numel() / t.dim(0)}); };
    auto optional = [](const Tensor& t) { return t.defined() && t.numel() ? &t : nullptr; };

    int64_t sparse = 0;
    ops.embedding(embed_tokens_, layout.token_ids, residual);
    ops.rms_norm(residual, layers_.front().input_norm, eps, NormStyle::Plain, normed);
    for (size_t index = 0; index < layers_.size(); ++index) {
      const LlamaLayer& layer = layers_[index];
      Tensor q_flat = flat(q), k_flat = flat(k), v_flat = flat(v);
      const MatmulTarget qkv[] = {{&layer.q_proj, optional(layer.q_bias), &q_flat},
                                  {&layer.k_proj, optional(layer.k_bias), &k_flat},
                                  {&layer.v_proj, optional(layer.v_bias), &v_flat}};
      ops.matmul_group(normed, qkv);
      const HeadNorms head_norms{layer.q_norm, layer.k_norm, eps, NormStyle::Plain};
      const KvCacheView kv = cache.kv.layer(index);
      ops.rope_kv_write(q, k, v, layout, inv_freq_, rotary_dim_, config_.qk_norm ? &head_norms : nullptr, kv);
      ops.attention(q, kv, layout, scale, attention);
      ops.matmul(flat(attention), layer.o_proj, optional(layer.o_bias), projected);
      if (collective_) collective_->all_reduce_sum(projected);
      ops.add_rms_norm(residual, projected, layer.post_attention_norm, eps, NormStyle::Plain, normed);

      if (layer.moe) {
        sparse_moe(ops, *layer.moe, config_.moe, normed, projected, expert_reads_.layer(sparse++));
      } else {
        const MatmulTarget gate_up[] = {{&layer.gate_proj, optional(layer.gate_bias), &gate},
                                        {&layer.up_proj, optional(layer.up_bias), &up}};
        ops.matmul_group(normed, gate_up);
        ops.swiglu(gate, up, gate);
        ops.matmul(gate, layer.down_proj, optional(layer.down_bias), projected);
        if (collective_) collective_->all_reduce_sum(projected);
      }
      const Tensor& next_norm = index + 1 < layers_.size() ? layers_[index + 1].input_norm : final_norm_;
      ops.add_rms_norm(residual, projected, next_norm, eps, NormStyle::Plain, normed);
    }
    head(normed);
  }

  ModelConfig config_;
  Backend& backend_;
  Collective* collective_;  // null: one rank
  int64_t heads_ = 0, kv_heads_ = 0, ffn_ = 0;  // this rank's query heads, KV heads, MLP width
  Weight embed_tokens_, lm_head_;
  Tensor final_norm_, inv_freq_;
  std::vector<LlamaLayer> layers_;
  int rotary_dim_ = 0;
  ExpertReadCounter expert_reads_;  // the experts each sparse layer read
};

}  // namespace

std::unique_ptr<Model> make_llama_model(WeightMap& weights, const ModelConfig& config, Backend& backend,
                                        const TensorParallelRank& rank) {
  check_llama_tensor_parallel(config, rank.ranks);
  return std::make_unique<LlamaModel>(weights, config, backend, rank);
}

void check_llama_tensor_parallel(const ModelConfig& config, int ranks) {
  check_no_experts(config, ranks);
  check_attention_split(config, ranks);
  check_divisible("intermediate_size", config.intermediate_size, ranks);
}

TensorShard llama_tensor_shard(const ModelConfig& config, const TensorParallelRank& rank, const std::string& canonical,
                               const Shape& shape) {
  const AttentionShard heads = attention_shard(config, rank);
  const int64_t head_dim = config.head_dim;
  const int64_t ffn = config.intermediate_size / rank.ranks;
  auto rows = [](int64_t first, int64_t count) {
    return TensorShard{TensorShard::Axis::Rows, {RowBlock{first, count}}};
  };
  auto columns = [](int64_t first, int64_t count) {
    return TensorShard{TensorShard::Axis::Columns, {}, first, count};
  };
  if (canonical.ends_with("self_attn.q_proj.weight") || canonical.ends_with("self_attn.q_proj.bias"))
    return rows(heads.first_head * head_dim, heads.heads * head_dim);
  for (const char* name : {"self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight",
                           "self_attn.v_proj.bias"})
    if (canonical.ends_with(name)) return rows(heads.first_kv_head * head_dim, heads.kv_heads * head_dim);
  for (const char* name : {"mlp.gate_proj.weight", "mlp.gate_proj.bias", "mlp.up_proj.weight", "mlp.up_proj.bias"})
    if (canonical.ends_with(name)) return rows(rank.rank * ffn, ffn);
  if (canonical.ends_with("self_attn.o_proj.weight"))
    return columns(heads.first_head * head_dim, heads.heads * head_dim);
  if (canonical.ends_with("mlp.down_proj.weight")) return columns(rank.rank * ffn, ffn);
  if (canonical.ends_with("self_attn.o_proj.bias") || canonical.ends_with("mlp.down_proj.bias"))
    return rows(0, rank.rank == 0 ? shape.at(0) : 0);
  return {};  // embedding, norms, q/k norms, lm_head: replicated
}

LoadPlan dense_decoder_plan(const Checkpoint& checkpoint) {
  if (!checkpoint.contains("embed_tokens.weight") || checkpoint.contains("model.embed_tokens.weight"))
    return identity_plan(checkpoint);
  LoadPlan plan;
  for (const auto& [name, info] : checkpoint.tensors())
    plan.tensors.push_back({name == "lm_head.weight" ? name : "model." + name, name, {}, info.shape});
  plan.notes.push_back("a bare decoder (no model. prefix, as transformers' *Model saves it): names prefixed with model.");
  return plan;
}

std::vector<SynthTensor> dense_decoder_synth_layout(const ModelConfig& config) {
  const int64_t hidden = config.hidden_size;
  const int64_t q_width = config.num_attention_heads * config.head_dim;
  const int64_t kv_width = config.num_key_value_heads * config.head_dim;
  const int64_t intermediate = config.intermediate_size;

  std::vector<SynthTensor> tensors;
  tensors.push_back(embedding("model.embed_tokens.weight", {config.vocab_size, hidden}));
  for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer) {
    const std::string prefix = fmt::format("model.layers.{}.", layer);
    tensors.push_back({prefix + "input_layernorm.weight", {hidden}, SynthInit::Ones});
    tensors.push_back(layer_linear(prefix + "self_attn.q_proj.weight", {q_width, hidden}));
    tensors.push_back(layer_linear(prefix + "self_attn.k_proj.weight", {kv_width, hidden}));
    tensors.push_back(layer_linear(prefix + "self_attn.v_proj.weight", {kv_width, hidden}));
    tensors.push_back(layer_linear(prefix + "self_attn.o_proj.weight", {hidden, q_width}));
    if (config.attention_bias) {
      tensors.push_back({prefix + "self_attn.q_proj.bias", {q_width}});
      tensors.push_back({prefix + "self_attn.k_proj.bias", {kv_width}});
      tensors.push_back({prefix + "self_attn.v_proj.bias", {kv_width}});
    }
    if (config.attention_output_bias) tensors.push_back({prefix + "self_attn.o_proj.bias", {hidden}});
    if (config.qk_norm) {
      tensors.push_back({prefix + "self_attn.q_norm.weight", {config.head_dim}, SynthInit::Ones});
      tensors.push_back({prefix + "self_attn.k_norm.weight", {config.head_dim}, SynthInit::Ones});
    }
    tensors.push_back({prefix + "post_attention_layernorm.weight", {hidden}, SynthInit::Ones});
    tensors.push_back(layer_linear(prefix + "mlp.gate_proj.weight", {intermediate, hidden}));
    tensors.push_back(layer_linear(prefix + "mlp.up_proj.weight", {intermediate, hidden}));
    tensors.push_back(layer_linear(prefix + "mlp.down_proj.weight", {hidden, intermediate}));
    if (config.mlp_bias) {
      tensors.push_back({prefix + "mlp.gate_proj.bias", {intermediate}});
      tensors.push_back({prefix + "mlp.up_proj.bias", {intermediate}});
      tensors.push_back({prefix + "mlp.down_proj.bias", {hidden}});
    }
  }
  tensors.push_back({"model.norm.weight", {hidden}, SynthInit::Ones});
  if (!config.tie_word_embeddings) tensors.push_back(head_linear("lm_head.weight", {config.vocab_size, hidden}));
  return tensors;
}

FamilySpec llama_family() {
  // transformers' LlamaConfig and Qwen2Config (models/llama, models/qwen2). MiniCPM5 ships as llama.
  const ModelTypeRules llama{.model_type = "llama"};
  const ModelTypeRules qwen2{
      .model_type = "qwen2", .qkv_bias_always = true, .output_bias_follows_attention_bias = false};
  using nlohmann::json;
  return {
      .graph = "llama",
      .loop = Loop::Autoregressive,
      .oracle = "transformers float64 logits, fixtures/tiny/llama3-tiny",
      .model_types = {llama, qwen2},
      // Llama-family checkpoints are stored under the graph's canonical names (a bare decoder's
      // under them less "model.").
      .sanitize = [](const Checkpoint& checkpoint, const ModelConfig&, bool) { return dense_decoder_plan(checkpoint); },
      .tensor_parallel = {check_llama_tensor_parallel, llama_tensor_shard},
      // Written against the Backend interface alone, the graph runs on every backend.
      .backends = {{Device::CPU, make_llama_model}, {Device::CUDA, make_llama_model}},
      // As published on the Hugging Face Hub, field for field.
      .synth_shapes = {
        {"llama-3.2-1b", "meta-llama/Llama-3.2-1B", json::parse(R"({
          "architectures": ["LlamaForCausalLM"],
          "attention_bias": false,
          "attention_dropout": 0.0,
          "bos_token_id": 128000,
          "eos_token_id": 128001,
          "head_dim": 64,
          "hidden_act": "silu",
          "hidden_size": 2048,
          "initializer_range": 0.02,
          "intermediate_size": 8192,
          "max_position_embeddings": 131072,
          "mlp_bias": false,
          "model_type": "llama",
          "num_attention_heads": 32,
          "num_hidden_layers": 16,
          "num_key_value_heads": 8,
          "pretraining_tp": 1,
          "rms_norm_eps": 1e-05,
          "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                           "original_max_position_embeddings": 8192, "rope_type": "llama3"},
          "rope_theta": 500000.0,
          "tie_word_embeddings": true,
          "torch_dtype": "bfloat16",
          "transformers_version": "4.45.0.dev0",
          "use_cache": true,
          "vocab_size": 128256
        })")},
        {"llama-3.1-8b", "meta-llama/Llama-3.1-8B", json::parse(R"({
          "architectures": ["LlamaForCausalLM"],
          "attention_bias": false,
          "attention_dropout": 0.0,
          "bos_token_id": 128000,
          "eos_token_id": 128001,
          "hidden_act": "silu",
          "hidden_size": 4096,
          "initializer_range": 0.02,
          "intermediate_size": 14336,
          "max_position_embeddings": 131072,
          "mlp_bias": false,
          "model_type": "llama",
          "num_attention_heads": 32,
          "num_hidden_layers": 32,
          "num_key_value_heads": 8,
          "pretraining_tp": 1,
          "rms_norm_eps": 1e-05,
          "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192, "rope_type": "llama3"},
          "rope_theta": 500000.0,
          "tie_word_embeddings": false,
          "torch_dtype": "bfloat16",
          "transformers_version": "4.43.0.dev0",
          "use_cache": true,
          "vocab_size": 128256
        })")},
      },
      .synth_layout = dense_decoder_synth_layout,
      .synth_model_types = {"llama", "qwen2"},
  };
}

}  // namespace kiln
