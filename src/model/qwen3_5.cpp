// Qwen3.5 (dense) and Qwen3-Next text models — transformers' Qwen3_5ForCausalLM; spec part A:
//
//   h = E[x]
//   for each layer i (layer_types[i]):
//     a = RMSNorm_zc(h)                                   zero-centred: (1 + γ) · x̂, in f32
//     linear_attention (Gated DeltaNet, A.6):
//       qkv, z, b, a' = a·W_qkvᵀ, a·W_zᵀ, a·W_bᵀ, a·W_aᵀ
//       u = SiLU(causal_conv1d(qkv))                       (K = 4, per-sequence state tail)
//       q, k, v = split(u); q, k = l2norm(q)·dk^-½, l2norm(k)
//       β = sigmoid(b);  g = −exp(A_log)·softplus(a' + dt_bias)
//       o = DeltaRule(q, k, v, g, β)                        (f32 state S [Hv, dk, dv])
//       m = (RMSNorm(o)·w ⊙ SiLU(z))·W_outᵀ
//     full_attention (gated attention, A.5):
//       [q | gate] = a·W_qᵀ per head;  k, v = a·W_kᵀ, a·W_vᵀ
//       q, k = RMSNorm_zc(q), RMSNorm_zc(k);  partial RoPE on the first dh·0.25 dims
//       m = (Attention(q, K, V) ⊙ sigmoid(gate))·W_oᵀ
//     h = h + m;  h = h + SwiGLU-MLP(RMSNorm_zc(h))
//   logits = RMSNorm_zc(h)·W_lmᵀ
//
// Split over tensor-parallel ranks (model/tensor_parallel.h), a rank holds whole attention heads,
// whole GDN key heads with their value heads and a column block of the MLP; the W_oᵀ, W_outᵀ and
// MLP-down products are then partial sums, all-reduced before they join the residual. With one
// rank the code below is unchanged.
#include "model/qwen3_5.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/family.h"
#include "model/moe.h"
#include "model/paged_kv_cache.h"
#include "model/qwen3_5_checkpoint.h"
#include "model/rope_frequencies.h"

namespace kiln {
namespace {

struct GatedDeltaNetWeights {
  Weight in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj;
  Tensor conv1d, dt_bias, a_log, norm;
};

struct GatedAttentionWeights {
  Weight q_proj, k_proj, v_proj, o_proj;
  Tensor q_norm, k_norm;
};

struct HybridLayer {
  LayerKind kind = LayerKind::FullAttention;
  Tensor input_norm, post_attention_norm;
  GatedDeltaNetWeights delta;
  GatedAttentionWeights attention;
  Weight gate_proj, up_proj, down_proj;
  std::optional<SparseMoeWeights> moe;  // a sparse layer's experts instead of the dense MLP
  int64_t state_index = 0;  // index among the layers of its kind (cache tensors)
};

// The heads one rank holds (all of them with one rank).
struct HybridHeads {
  int64_t heads = 0, kv_heads = 0;              // gated attention
  int64_t key_heads = 0, value_heads = 0;       // Gated DeltaNet
  int64_t first_key_head = 0, first_value_head = 0;
  int64_t ffn = 0;                              // MLP width
};

HybridHeads hybrid_heads(const ModelConfig& config, const TensorParallelRank& rank) {
  const AttentionShard attention = attention_shard(config, rank);
  HybridHeads heads;
  heads.heads = attention.heads;
  heads.kv_heads = attention.kv_heads;
  heads.key_heads = config.linear_num_key_heads / rank.ranks;
  heads.value_heads = config.linear_num_value_heads / rank.ranks;
  heads.first_key_head = rank.rank * heads.key_heads;
  heads.first_value_head = rank.rank * heads.value_heads;
  heads.ffn = config.intermediate_size / rank.ranks;
  return heads;
}

// The states of the GDN layers, a row per sequence: the conv tail [rows, K−1, C] and the
// delta-rule state [rows, Hv, dk, dv] of each layer.
struct RecurrentStates {
  std::vector<Tensor> conv, delta;

  // Empty states of the same layers with `rows` rows (none when `like` has no layers).
  static RecurrentStates allocate_like(Backend& backend, const RecurrentStates& like, int64_t rows) {
    RecurrentStates states;
    for (size_t i = 0; i < like.conv.size(); ++i) {
      Shape conv_shape = like.conv[i].shape(), delta_shape = like.delta[i].shape();
      conv_shape[0] = delta_shape[0] = rows;
      states.conv.push_back(backend.alloc(conv_shape, like.conv[i].dtype()));
      states.delta.push_back(backend.alloc(delta_shape, like.delta[i].dtype()));
    }
    return states;
  }
  int64_t rows() const { return conv.empty() ? 0 : conv.front().dim(0); }
  size_t bytes() const {
    size_t total = 0;
    for (const auto* group : {&conv, &delta})
      for (const Tensor& tensor : *group) total += tensor.nbytes();
    return total;
  }
};

// Row `from_row` of every layer's states ← into row `to_row` of `to`'s: what saving a slot's state
// for a speculative rollback, keeping a prefix snapshot and resuming from either copy each do.
void copy_state_row(Backend& backend, const RecurrentStates& from, int64_t from_row, RecurrentStates& to,
                    int64_t to_row) {
  for (size_t i = 0; i < from.conv.size(); ++i) {
    Tensor conv = to.conv[i].slice_rows(to_row, 1), delta = to.delta[i].slice_rows(to_row, 1);
    backend.copy(from.conv[i].slice_rows(from_row, 1), conv);
    backend.copy(from.delta[i].slice_rows(from_row, 1), delta);
  }
}

// The paged KV cache of the attention layers; the conv tail and the delta-rule state of the GDN
// layers, per slot.
class HybridCache final : public ModelCache {
 public:
  HybridCache(Backend& backend, const ModelConfig& config, const HybridHeads& heads, int64_t attention_layers,
              int64_t delta_layers, int64_t slots, int64_t capacity, int64_t blocks)
      : kv(backend, attention_layers, slots, capacity, blocks, heads.kv_heads, config.head_dim),
        backend_(backend),
        slots_(slots),
        capacity_(capacity) {
    const int64_t conv_channels =
        2 * heads.key_heads * config.linear_key_head_dim + heads.value_heads * config.linear_value_head_dim;
    for (int64_t i = 0; i < delta_layers; ++i) {
      states.conv.push_back(backend.alloc({slots, config.linear_conv_kernel_dim - 1, conv_channels}, DType::F32));
      states.delta.push_back(backend.alloc(
          {slots, heads.value_heads, config.linear_key_head_dim, config.linear_value_head_dim}, DType::F32));
    }
  }
  int64_t slots() const override { return slots_; }
  int64_t capacity() const override { return capacity_; }
  int64_t blocks() const override { return kv.blocks(); }
  int64_t table_width() const override { return kv.table_width(); }
  void assign_blocks(int32_t slot, int64_t first_entry, std::span<const int32_t> blocks) override {
    kv.assign_blocks(slot, first_entry, blocks);
  }
  // A span at position 0 starts from zero conv and delta states whatever the slot holds, and
  // attention reads only rows its own sequence wrote: a slot needs no clearing to be reused.
  void reset_slot(int32_t slot) override { check_slot(slot); }
  bool resumes_at_any_position() const override { return false; }
  size_t bytes() const override { return kv.bytes() + states.bytes() + saved_.bytes() + snapshots_.bytes(); }
  // The conv and delta states of the slot, copied beside them. The copies are allocated at the
  // first save: a cache that never serves a speculative request does not hold them.
  void save_slot_state(int32_t slot) override {
    check_slot(slot);
    if (saved_.rows() == 0) saved_ = RecurrentStates::allocate_like(backend_, states, slots_);
    copy_state_row(backend_, states, slot, saved_, slot);
  }
  void restore_slot_state(int32_t slot) override {
    check_slot(slot);
    if (saved_.rows() == 0) fail("cache slot {} has no saved state to restore", slot);
    copy_state_row(backend_, saved_, slot, states, slot);
  }
  void allocate_snapshots(int64_t count) override {
    if (count < 0) fail("a cache cannot keep {} snapshots", count);
    if (snapshots_count_ > 0) fail("the cache's {} snapshots are allocated already", snapshots_count_);
    snapshots_ = RecurrentStates::allocate_like(backend_, states, count);
    snapshots_count_ = count;
  }
  int64_t snapshots() const override { return snapshots_count_; }
  void save_snapshot(int32_t slot, int64_t snapshot) override {
    check_slot(slot);
    check_snapshot(snapshot);
    copy_state_row(backend_, states, slot, snapshots_, snapshot);
  }
  void restore_snapshot(int64_t snapshot, int32_t slot) override {
    check_slot(slot);
    check_snapshot(snapshot);
    copy_state_row(backend_, snapshots_, snapshot, states, slot);
  }

  PagedKvCache kv;
  RecurrentStates states;

 private:
  void check_slot(int32_t slot) const {
    if (slot < 0 || slot >= slots_) fail("cache slot {} out of range (cache has {} slots)", slot, slots_);
  }
  void check_snapshot(int64_t snapshot) const {
    if (snapshot < 0 || snapshot >= snapshots_count_)
      fail("snapshot {} out of range (cache keeps {} snapshots)", snapshot, snapshots_count_);
  }

  Backend& backend_;
  int64_t slots_, capacity_;
  RecurrentStates saved_;      // save_slot_state's copies, a row per slot
  RecurrentStates snapshots_;  // a row per snapshot entry
  int64_t snapshots_count_ = 0;  // kept apart from snapshots_.rows(): a head's cache has no GDN layers
};

class Qwen35Model final : public Model {
 public:
  Qwen35Model(WeightMap& weights, const ModelConfig& config, Backend& backend, const TensorParallelRank& rank)
      : config_(config),
        backend_(backend),
        hybrid_(backend.hybrid_ops()),
        collective_(rank.collective),
        heads_(hybrid_heads(config, rank)) {
    if (!hybrid_)
      fail("the {} backend has no Gated DeltaNet kernels: the qwen3_5 graph cannot run on it", backend.name());
    const int64_t hidden = config.hidden_size;
    const int64_t ffn = heads_.ffn;
    const int64_t key_heads = heads_.key_heads, key_dim = config.linear_key_head_dim;
    const int64_t value_heads = heads_.value_heads, value_dim = config.linear_value_head_dim;
    const int64_t conv_channels = 2 * key_heads * key_dim + value_heads * value_dim;
    const int64_t q_width = heads_.heads * config.head_dim;
    const int64_t kv_width = heads_.kv_heads * config.head_dim;

    auto take = [&](const std::string& name, const Shape& shape) { return backend.upload(weights.take(name, shape)); };
    auto take_matrix = [&](const std::string& name, const Shape& shape) {
      return backend.upload_weight(weights.take_weight(name, shape));
    };
    embed_tokens_ = take_matrix("model.embed_tokens.weight", {config.vocab_size, hidden});
    // A decoder layer's weights under `prefix` (the model's layers, and the MTP head's one).
    auto take_layer = [&](const std::string& prefix, LayerKind kind, bool sparse) {
      HybridLayer layer;
      layer.kind = kind;
      layer.input_norm = take(prefix + "input_layernorm.weight", {hidden});
      layer.post_attention_norm = take(prefix + "post_attention_layernorm.weight", {hidden});
      if (layer.kind == LayerKind::LinearAttention) {
        const std::string p = prefix + "linear_attn.";
        GatedDeltaNetWeights& d = layer.delta;
        d.in_proj_qkv = take_matrix(p + "in_proj_qkv.weight", {conv_channels, hidden});
        d.in_proj_z = take_matrix(p + "in_proj_z.weight", {value_heads * value_dim, hidden});
        d.in_proj_b = take_matrix(p + "in_proj_b.weight", {value_heads, hidden});
        d.in_proj_a = take_matrix(p + "in_proj_a.weight", {value_heads, hidden});
        d.conv1d = take(p + "conv1d.weight", {conv_channels, config.linear_conv_kernel_dim});
        d.dt_bias = take(p + "dt_bias", {value_heads});
        d.a_log = take(p + "A_log", {value_heads});
        d.norm = take(p + "norm.weight", {value_dim});
        d.out_proj = take_matrix(p + "out_proj.weight", {hidden, value_heads * value_dim});
      } else {
        const std::string p = prefix + "self_attn.";
        GatedAttentionWeights& a = layer.attention;
        a.q_proj = take_matrix(p + "q_proj.weight", {2 * q_width, hidden});
        a.k_proj = take_matrix(p + "k_proj.weight", {kv_width, hidden});
        a.v_proj = take_matrix(p + "v_proj.weight", {kv_width, hidden});
        a.o_proj = take_matrix(p + "o_proj.weight", {hidden, q_width});
        a.q_norm = take(p + "q_norm.weight", {config.head_dim});
        a.k_norm = take(p + "k_norm.weight", {config.head_dim});
      }
      if (sparse) {
        layer.moe = take_sparse_moe(weights, backend, prefix, config);
      } else {
        layer.gate_proj = take_matrix(prefix + "mlp.gate_proj.weight", {ffn, hidden});
        layer.up_proj = take_matrix(prefix + "mlp.up_proj.weight", {ffn, hidden});
        layer.down_proj = take_matrix(prefix + "mlp.down_proj.weight", {hidden, ffn});
      }
      return layer;
    };
    const auto sparse = [&](int64_t index) { return config.moe.experts > 0 && config.moe.sparse_layers.at(index); };
    for (int64_t index = 0; index < config.num_hidden_layers; ++index) {
      HybridLayer layer = take_layer("model.layers." + std::to_string(index) + ".", config.layer_types.at(index),
                                     sparse(index));
      layer.state_index = layer.kind == LayerKind::LinearAttention ? delta_layers_++ : attention_layers_++;
      layers_.push_back(std::move(layer));
    }
    const auto sparse_layers =
        std::count_if(layers_.begin(), layers_.end(), [](const HybridLayer& layer) { return layer.moe.has_value(); });
    expert_reads_ = ExpertReadCounter(backend, sparse_layers);
    final_norm_ = take("model.norm.weight", {hidden});
    if (weights.contains("lm_head.weight") || !config.tie_word_embeddings)
      lm_head_ = take_matrix("lm_head.weight", {config.vocab_size, hidden});
    else
      lm_head_ = embed_tokens_;
    // The load plan holds the MTP head only when the load asked for it (LoadOptions::mtp). Its one
    // layer is full attention with the MLP of the model's layer 0 (as vLLM builds mtp.layers.0),
    // and the only attention layer of the head's own cache.
    if (weights.contains("mtp.fc.weight")) {
      mtp_.emplace(MtpWeights{take_matrix("mtp.fc.weight", {hidden, 2 * hidden}),
                              take("mtp.pre_fc_norm_embedding.weight", {hidden}),
                              take("mtp.pre_fc_norm_hidden.weight", {hidden}), take("mtp.norm.weight", {hidden}),
                              take_layer("mtp.layers.0.", LayerKind::FullAttention, sparse(0))});
      mtp_head_ = std::make_unique<MtpHead>(*this);
    }

    // Text-only input: the three mRoPE streams all carry the 1-D position, so the interleaved
    // multimodal RoPE is exactly partial 1-D RoPE (spec A.5.3).
    rotary_dim_ = static_cast<int>(rope_rotary_dim(config));
    const std::vector<float> inv_freq = rope_inverse_frequencies(config.rope, rotary_dim_, rope_frequency_dtype(config, embed_tokens_.float_dtype()));
    Tensor host_inv_freq = Tensor::empty({static_cast<int64_t>(inv_freq.size())}, DType::F32);
    std::copy(inv_freq.begin(), inv_freq.end(), host_inv_freq.data<float>());
    inv_freq_ = backend.upload(host_inv_freq);
  }

  const ModelConfig& config() const override { return config_; }
  Backend& backend() const override { return backend_; }

  size_t decode_weight_bytes() const override {
    size_t bytes = final_norm_.nbytes() + lm_head_.nbytes() + embed_tokens_.row_nbytes();
    for (const HybridLayer& layer : layers_) {
      const auto& d = layer.delta;
      const auto& a = layer.attention;
      for (const Tensor* tensor : {&layer.input_norm, &layer.post_attention_norm, &d.conv1d, &d.dt_bias, &d.a_log,
                                   &d.norm, &a.q_norm, &a.k_norm})
        if (tensor->defined()) bytes += tensor->nbytes();
      for (const Weight* weight : {&layer.gate_proj, &layer.up_proj, &layer.down_proj, &d.in_proj_qkv, &d.in_proj_z,
                                   &d.in_proj_b, &d.in_proj_a, &d.out_proj, &a.q_proj, &a.k_proj, &a.v_proj,
                                   &a.o_proj})
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
    for (const HybridLayer& layer : layers_)
      if (layer.moe)
        bytes += static_cast<double>(sparse_moe_expert_bytes(*layer.moe, config_.moe)) *
                 (static_cast<double>(experts_read[sparse++]) -
                  static_cast<double>(forwards * config_.moe.experts_per_token));
    return bytes;
  }

  std::unique_ptr<ModelCache> make_cache(int64_t slots, int64_t capacity, int64_t blocks) const override {
    return std::make_unique<HybridCache>(backend_, config_, heads_, attention_layers_, delta_layers_, slots, capacity,
                                         blocks);
  }

  void forward(const BatchLayout& layout, const Tensor& logit_rows, ModelCache& model_cache, Tensor& logits) override {
    run_layers(layout, model_cache,
               [&](const Tensor& normed) { lm_head_logits(backend_, normed, logit_rows, lm_head_, logits); });
  }

  void forward_hidden(const BatchLayout& layout, const Tensor& rows, ModelCache& model_cache,
                      Tensor& hidden) override {
    run_layers(layout, model_cache, [&](const Tensor& normed) { backend_.gather_rows(normed, rows, hidden); });
  }

  void forward_with_hidden(const BatchLayout& layout, const Tensor& logit_rows, const Tensor& hidden_rows,
                           ModelCache& model_cache, Tensor& logits, Tensor& hidden) override {
    run_layers(layout, model_cache, [&](const Tensor& normed) {
      lm_head_logits(backend_, normed, logit_rows, lm_head_, logits);
      backend_.gather_rows(normed, hidden_rows, hidden);
    });
  }

  DraftHead* draft_head() override { return mtp_head_.get(); }

 private:
  // The multi-token-prediction head's weights (checkpoint mtp.*).
  struct MtpWeights {
    Weight fc;  // [H, 2H]: the embedding's half of the input first, then the hidden state's
    Tensor pre_fc_norm_embedding, pre_fc_norm_hidden, norm;
    HybridLayer layer;
  };

  class MtpHead final : public DraftHead {
   public:
    explicit MtpHead(Qwen35Model& model) : model_(model) {}
    std::unique_ptr<ModelCache> make_cache(int64_t slots, int64_t capacity) const override {
      return std::make_unique<HybridCache>(model_.backend_, model_.config_, model_.heads_, 1, 0, slots, capacity,
                                         slots * kv_table_width(capacity));
    }
    void forward(const BatchLayout& layout, const Tensor& hidden, const Tensor& rows, ModelCache& cache, Tensor& logits,
                 Tensor& out_hidden) override {
      model_.mtp_forward(layout, hidden, rows, dynamic_cast<HybridCache&>(cache), logits, out_hidden);
    }

   private:
    Qwen35Model& model_;
  };

  // The MTP head over a step's pairs (x_{p+1} in layout.token_ids, h_p in `hidden`; spec A.8,
  // vLLM's Qwen3_5MultiTokenPredictor):
  //   e = RMSNorm_zc(E[x]; pre_fc_norm_embedding),  g = RMSNorm_zc(h; pre_fc_norm_hidden)
  //   u = [e | g]·W_fcᵀ                                  the residual stream, f32 as the model's
  //   u = u + GatedAttention(RMSNorm_zc(u)), u = u + MLP(RMSNorm_zc(u))    the layer, at position p
  //   o = RMSNorm_zc(u; mtp.norm);  logits = o·W_lmᵀ
  // vLLM's head returns o both to its logits and as the hidden state its next draft step takes.
  void mtp_forward(const BatchLayout& layout, const Tensor& hidden, const Tensor& rows, HybridCache& cache,
                   Tensor& logits, Tensor& out_hidden) {
    const MtpWeights& mtp = *mtp_;
    Backend& ops = backend_;
    const int64_t tokens = layout.total_tokens, width = config_.hidden_size;
    const float eps = static_cast<float>(config_.rms_norm_eps);
    const DType act = ops.activation_dtype();
    Tensor embedded = ops.alloc({tokens, width}, DType::F32);
    ops.embedding(embed_tokens_, layout.token_ids, embedded);
    // e and g stacked [2T, H], then a row gather interleaves them: rows 2t and 2t + 1 of [2T, H]
    // are row t of [T, 2H], so the fc input is [e_t | g_t] with no concatenation op.
    Tensor stacked = ops.alloc({2 * tokens, width}, act);
    Tensor e = stacked.slice_rows(0, tokens), g = stacked.slice_rows(tokens, tokens);
    ops.rms_norm(embedded, mtp.pre_fc_norm_embedding, eps, NormStyle::ZeroCentred, e);
    ops.rms_norm(hidden, mtp.pre_fc_norm_hidden, eps, NormStyle::ZeroCentred, g);
    Tensor order = Tensor::empty({2 * tokens}, DType::I32);
    for (int64_t t = 0; t < tokens; ++t) {
      order.data<int32_t>()[2 * t] = static_cast<int32_t>(t);
      order.data<int32_t>()[2 * t + 1] = static_cast<int32_t>(tokens + t);
    }
    Tensor joined = ops.alloc({2 * tokens, width}, act);
    ops.gather_rows(stacked, ops.upload(order), joined);
    Tensor residual = ops.alloc({tokens, width}, DType::F32);
    ops.matmul(joined.reshape({tokens, 2 * width}), mtp.fc, nullptr, residual);
    Tensor normed = ops.alloc({tokens, width}, act);
    Tensor mixed = ops.alloc({tokens, width}, DType::F32);
    ops.rms_norm(residual, mtp.layer.input_norm, eps, NormStyle::ZeroCentred, normed);
    gated_attention(mtp.layer, normed, layout, cache, mixed);
    ops.add_rms_norm(residual, mixed, mtp.layer.post_attention_norm, eps, NormStyle::ZeroCentred, normed);
    mlp(mtp.layer, normed, mixed, nullptr);
    ops.add_rms_norm(residual, mixed, mtp.norm, eps, NormStyle::ZeroCentred, normed);
    lm_head_logits(ops, normed, rows, lm_head_, logits);
    ops.gather_rows(normed, rows, out_hidden);
  }

  // Runs the layers and the final norm over the step's tokens, then `head` on the normed hidden
  // states [tokens, hidden], while the step's buffers are still held (as model/llama.cpp does).
  template <typename Head>
  void run_layers(const BatchLayout& layout, ModelCache& model_cache, const Head& head) {
    auto& cache = dynamic_cast<HybridCache&>(model_cache);
    const int64_t tokens = layout.total_tokens;
    const float eps = static_cast<float>(config_.rms_norm_eps);
    Backend& ops = backend_;
    // The residual stream and the products that join it stay f32 (see model.h).
    Tensor residual = ops.alloc({tokens, config_.hidden_size}, DType::F32);
    Tensor normed = ops.alloc({tokens, config_.hidden_size}, ops.activation_dtype());
    Tensor mixed = ops.alloc({tokens, config_.hidden_size}, DType::F32);

    int64_t sparse = 0;
    ops.embedding(embed_tokens_, layout.token_ids, residual);
    ops.rms_norm(residual, layers_.front().input_norm, eps, NormStyle::ZeroCentred, normed);
    for (size_t index = 0; index < layers_.size(); ++index) {
      const HybridLayer& layer = layers_[index];
      if (layer.kind == LayerKind::LinearAttention)
        gated_delta_net(layer, normed, layout, cache, mixed);
      else
        gated_attention(layer, normed, layout, cache, mixed);
      ops.add_rms_norm(residual, mixed, layer.post_attention_norm, eps, NormStyle::ZeroCentred, normed);
      mlp(layer, normed, mixed, layer.moe ? expert_reads_.layer(sparse++) : nullptr);
      const Tensor& next_norm = index + 1 < layers_.size() ? layers_[index + 1].input_norm : final_norm_;
      ops.add_rms_norm(residual, mixed, next_norm, eps, NormStyle::ZeroCentred, normed);
    }
    head(normed);
  }

  void gated_delta_net(const HybridLayer& layer, const Tensor& x, const BatchLayout& layout, HybridCache& cache,
                       Tensor& out) {
    Backend& ops = backend_;
    const GatedDeltaNetWeights& d = layer.delta;
    const int64_t tokens = x.dim(0);
    const int64_t key_heads = heads_.key_heads, key_dim = config_.linear_key_head_dim;
    const int64_t value_heads = heads_.value_heads, value_dim = config_.linear_value_head_dim;
    const DType act = ops.activation_dtype();
    Tensor qkv = ops.alloc({tokens, d.in_proj_qkv.dim(0)}, act);
    Tensor z = ops.alloc({tokens, value_heads, value_dim}, act);
    Tensor b = ops.alloc({tokens, value_heads}, act);
    Tensor a = ops.alloc({tokens, value_heads}, act);
    Tensor z_flat = z.reshape({tokens, value_heads * value_dim});
    const MatmulTarget projections[] = {
        {&d.in_proj_qkv, nullptr, &qkv}, {&d.in_proj_z, nullptr, &z_flat}, {&d.in_proj_b, nullptr, &b},
        {&d.in_proj_a, nullptr, &a}};
    ops.matmul_group(x, projections);

    Tensor convolved = ops.alloc(qkv.shape(), act);
    hybrid_->causal_conv1d_silu(qkv, d.conv1d, layout, cache.states.conv[layer.state_index], convolved);
    // q, k and v stay f32 whatever the activations: HF-Q35 L2-normalises q and k in f32 and runs
    // the recurrence on f32 inputs (architectures.md D.1).
    Tensor q = ops.alloc({tokens, key_heads, key_dim}, DType::F32);
    Tensor k = ops.alloc({tokens, key_heads, key_dim}, DType::F32);
    Tensor v = ops.alloc({tokens, value_heads, value_dim}, DType::F32);
    hybrid_->gated_delta_prepare_qkv(convolved, q, k, v);
    Tensor beta = ops.alloc({tokens, value_heads}, DType::F32);
    Tensor g = ops.alloc({tokens, value_heads}, DType::F32);
    hybrid_->gated_delta_gates(b, a, d.a_log, d.dt_bias, beta, g);

    Tensor core = ops.alloc({tokens, value_heads, value_dim}, act);
    hybrid_->gated_delta_rule(q, k, v, g, beta, layout, cache.states.delta[layer.state_index], core);
    hybrid_->rms_norm_gated(core, z, d.norm, static_cast<float>(config_.rms_norm_eps), core);
    ops.matmul(core.reshape({tokens, value_heads * value_dim}), d.out_proj, nullptr, out);
    if (collective_) collective_->all_reduce_sum(out);
  }

  void gated_attention(const HybridLayer& layer, const Tensor& x, const BatchLayout& layout, HybridCache& cache,
                       Tensor& out) {
    Backend& ops = backend_;
    const GatedAttentionWeights& w = layer.attention;
    const int64_t tokens = x.dim(0);
    const int64_t heads = heads_.heads, kv_heads = heads_.kv_heads;
    const int64_t head_dim = config_.head_dim;
    const float eps = static_cast<float>(config_.rms_norm_eps);
    const DType act = ops.activation_dtype();
    Tensor query_and_gate = ops.alloc({tokens, heads, 2 * head_dim}, act);
    Tensor query_and_gate_flat = query_and_gate.reshape({tokens, 2 * heads * head_dim});
    Tensor k = ops.alloc({tokens, kv_heads, head_dim}, act);
    Tensor v = ops.alloc({tokens, kv_heads, head_dim}, act);
    Tensor k_flat = k.reshape({tokens, kv_heads * head_dim}), v_flat = v.reshape({tokens, kv_heads * head_dim});
    const MatmulTarget projections[] = {
        {&w.q_proj, nullptr, &query_and_gate_flat}, {&w.k_proj, nullptr, &k_flat}, {&w.v_proj, nullptr, &v_flat}};
    ops.matmul_group(x, projections);
    Tensor q = ops.alloc({tokens, heads, head_dim}, act);
    Tensor gate = ops.alloc({tokens, heads, head_dim}, act);
    hybrid_->split_query_gate(query_and_gate, q, gate);
    const HeadNorms head_norms{w.q_norm, w.k_norm, eps, NormStyle::ZeroCentred};
    const KvCacheView kv = cache.kv.layer(static_cast<size_t>(layer.state_index));
    ops.rope_kv_write(q, k, v, layout, inv_freq_, rotary_dim_, &head_norms, kv);
    Tensor attended = ops.alloc({tokens, heads, head_dim}, act);
    ops.attention(q, kv, layout, 1.0f / std::sqrt(static_cast<float>(head_dim)), attended);
    hybrid_->sigmoid_gate(attended, gate);
    ops.matmul(attended.reshape({tokens, heads * head_dim}), w.o_proj, nullptr, out);
    if (collective_) collective_->all_reduce_sum(out);
  }

  // A sparse layer adds the experts it reads to experts_read (or counts nothing with null).
  void mlp(const HybridLayer& layer, const Tensor& x, Tensor& out, Tensor* experts_read) {
    Backend& ops = backend_;
    if (layer.moe) {
      sparse_moe(ops, *layer.moe, config_.moe, x, out, experts_read);
      return;
    }
    Tensor gate = ops.alloc({x.dim(0), heads_.ffn}, ops.activation_dtype());
    Tensor up = ops.alloc({x.dim(0), heads_.ffn}, ops.activation_dtype());
    const MatmulTarget gate_up[] = {{&layer.gate_proj, nullptr, &gate}, {&layer.up_proj, nullptr, &up}};
    ops.matmul_group(x, gate_up);
    ops.swiglu(gate, up, gate);
    ops.matmul(gate, layer.down_proj, nullptr, out);
    if (collective_) collective_->all_reduce_sum(out);
  }

  ModelConfig config_;
  Backend& backend_;
  HybridOps* hybrid_;
  Collective* collective_;  // null: one rank
  HybridHeads heads_;
  Weight embed_tokens_, lm_head_;
  Tensor final_norm_, inv_freq_;
  std::vector<HybridLayer> layers_;
  int64_t attention_layers_ = 0, delta_layers_ = 0;
  int rotary_dim_ = 0;
  ExpertReadCounter expert_reads_;  // the experts each sparse layer read
  std::optional<MtpWeights> mtp_;
  std::unique_ptr<MtpHead> mtp_head_;
};

}  // namespace

std::unique_ptr<Model> make_qwen3_5_model(WeightMap& weights, const ModelConfig& config, Backend& backend,
                                          const TensorParallelRank& rank) {
  check_qwen3_5_tensor_parallel(config, rank.ranks);
  return std::make_unique<Qwen35Model>(weights, config, backend, rank);
}

void check_qwen3_5_tensor_parallel(const ModelConfig& config, int ranks) {
  check_no_experts(config, ranks);
  check_attention_split(config, ranks);
  check_divisible("intermediate_size", config.intermediate_size, ranks);
  check_divisible("linear_num_key_heads", config.linear_num_key_heads, ranks);
}

TensorShard qwen3_5_tensor_shard(const ModelConfig& config, const TensorParallelRank& rank,
                                 const std::string& canonical, const Shape&) {
  const AttentionShard attention = attention_shard(config, rank);
  const HybridHeads heads = hybrid_heads(config, rank);
  const int64_t head_dim = config.head_dim;
  const int64_t key_dim = config.linear_key_head_dim, value_dim = config.linear_value_head_dim;
  const int64_t key_width = config.linear_num_key_heads * key_dim;
  auto rows = [](std::vector<RowBlock> blocks) { return TensorShard{TensorShard::Axis::Rows, std::move(blocks)}; };
  auto columns = [](int64_t first, int64_t count) { return TensorShard{TensorShard::Axis::Columns, {}, first, count}; };
  // Gated attention: a head's q_proj rows are its query then its gate (2·head_dim).
  if (canonical.ends_with("self_attn.q_proj.weight"))
    return rows({{attention.first_head * 2 * head_dim, attention.heads * 2 * head_dim}});
  if (canonical.ends_with("self_attn.k_proj.weight") || canonical.ends_with("self_attn.v_proj.weight"))
    return rows({{attention.first_kv_head * head_dim, attention.kv_heads * head_dim}});
  if (canonical.ends_with("self_attn.o_proj.weight"))
    return columns(attention.first_head * head_dim, attention.heads * head_dim);
  // Gated DeltaNet: in_proj_qkv and conv1d channels are [q (Hk·dk) | k (Hk·dk) | v (Hv·dv)].
  if (canonical.ends_with("linear_attn.in_proj_qkv.weight") || canonical.ends_with("linear_attn.conv1d.weight"))
    return rows({{heads.first_key_head * key_dim, heads.key_heads * key_dim},
                 {key_width + heads.first_key_head * key_dim, heads.key_heads * key_dim},
                 {2 * key_width + heads.first_value_head * value_dim, heads.value_heads * value_dim}});
  if (canonical.ends_with("linear_attn.in_proj_z.weight"))
    return rows({{heads.first_value_head * value_dim, heads.value_heads * value_dim}});
  for (const char* name : {"linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight", "linear_attn.dt_bias",
                           "linear_attn.A_log"})
    if (canonical.ends_with(name)) return rows({{heads.first_value_head, heads.value_heads}});
  if (canonical.ends_with("linear_attn.out_proj.weight"))
    return columns(heads.first_value_head * value_dim, heads.value_heads * value_dim);
  if (canonical.ends_with("mlp.gate_proj.weight") || canonical.ends_with("mlp.up_proj.weight"))
    return rows({{rank.rank * heads.ffn, heads.ffn}});
  if (canonical.ends_with("mlp.down_proj.weight")) return columns(rank.rank * heads.ffn, heads.ffn);
  return {};  // embedding, norms (layer, q/k, GDN gated), lm_head: replicated
}

namespace {

// --- config.json (transformers' Qwen3_5TextConfig and Qwen3NextConfig) --------------------------

// layer_types as listed, else transformers Qwen3NextConfig's schedule: layer i is full attention
// iff (i + 1) % full_attention_interval == 0, the interval 4 by default.
std::vector<LayerKind> hybrid_layer_schedule(const ConfigFields& text, int64_t layers) {
  const std::vector<std::pair<std::string, LayerKind>> names = {{"linear_attention", LayerKind::LinearAttention},
                                                                 {"full_attention", LayerKind::FullAttention}};
  if (auto listed = read_layer_types(text, layers, names)) return *listed;
  const int64_t interval = text.optional_positive_integer("full_attention_interval").value_or(4);
  std::vector<LayerKind> kinds;
  for (int64_t index = 0; index < layers; ++index)
    kinds.push_back((index + 1) % interval == 0 ? LayerKind::FullAttention : LayerKind::LinearAttention);
  return kinds;
}

// The Gated DeltaNet geometry, every field required.
void read_gated_delta_net_fields(const ConfigFields& text, ModelConfig& config) {
  config.linear_num_key_heads = text.positive_integer("linear_num_key_heads");
  config.linear_num_value_heads = text.positive_integer("linear_num_value_heads");
  config.linear_key_head_dim = text.positive_integer("linear_key_head_dim");
  config.linear_value_head_dim = text.positive_integer("linear_value_head_dim");
  config.linear_conv_kernel_dim = text.positive_integer("linear_conv_kernel_dim");
  if (config.linear_num_value_heads % config.linear_num_key_heads != 0)
    text.fail_field("linear_num_value_heads", "{} value heads are not divisible by {} key heads",
                    config.linear_num_value_heads, config.linear_num_key_heads);
  if (config.linear_conv_kernel_dim < 2)
    text.fail_field("linear_conv_kernel_dim", "is {}; a causal conv needs a kernel of at least 2",
                    config.linear_conv_kernel_dim);
  // The multi-token-prediction layers: Qwen3.5 names them mtp_num_hidden_layers, Qwen3-Next
  // num_nextn_predict_layers; absent, 1, as vLLM's qwen3_5_mtp.py and qwen3_next_mtp.py read them.
  config.mtp_layers = 1;
  const char* named = nullptr;
  for (const char* field : {"mtp_num_hidden_layers", "num_nextn_predict_layers"}) {
    if (!text.has(field)) continue;
    const int64_t layers = text.integer(field);
    if (layers < 0) text.fail_field(field, "is {}, not a count of layers", layers);
    if (named && layers != config.mtp_layers)
      text.fail_field(field, "is {}, but {} is {}", layers, named, config.mtp_layers);
    config.mtp_layers = layers;
    named = field;
  }
}

}  // namespace

ModelTypeRules hybrid_rules(std::string model_type, std::optional<MoeFieldDefaults> moe,
                            std::optional<int64_t> default_intermediate_size) {
  ModelTypeRules rules{.model_type = std::move(model_type),
                       .qk_norm = true,
                       .head_dim_required = true,
                       .key_value_heads_required = true,
                       .default_intermediate_size = default_intermediate_size,
                       .default_partial_rotary_factor = 0.25,
                       .layer_schedule = hybrid_layer_schedule,
                       .read_family_fields = read_gated_delta_net_fields};
  if (moe)
    rules.read_family_fields = [defaults = *moe](const ConfigFields& text, ModelConfig& config) {
      read_gated_delta_net_fields(text, config);
      read_moe_fields(text, config, defaults);
    };
  return rules;
}

std::vector<GraphShapingField> hybrid_graph_shaping_fields() {
  std::vector<GraphShapingField> fields = {
      // Which layers are Gated DeltaNet and which are attention.
      {"layer_types",
       [](const ModelConfig& c) {
         nlohmann::json kinds = nlohmann::json::array();
         for (LayerKind kind : c.layer_types)
           kinds.push_back(kind == LayerKind::FullAttention ? "full_attention" : "linear_attention");
         return kinds;
       }},
      // Gated DeltaNet head counts and widths: its projections and recurrent state shape.
      {"linear_num_key_heads", [](const ModelConfig& c) { return c.linear_num_key_heads; }},
      {"linear_num_value_heads", [](const ModelConfig& c) { return c.linear_num_value_heads; }},
      {"linear_key_head_dim", [](const ModelConfig& c) { return c.linear_key_head_dim; }},
      {"linear_value_head_dim", [](const ModelConfig& c) { return c.linear_value_head_dim; }},
      // The causal conv's kernel width: its weights and the conv state kept between steps.
      {"linear_conv_kernel_dim", [](const ModelConfig& c) { return c.linear_conv_kernel_dim; }},
      // Multimodal RoPE sections (spec A.5.3): how rotary dims split between position streams.
      {"rope.mrope_section", [](const ModelConfig& c) { return c.rope.mrope_section; }},
      {"rope.mrope_interleaved", [](const ModelConfig& c) { return c.rope.mrope_interleaved; }},
  };
  for (GraphShapingField& field : moe_graph_shaping_fields()) fields.push_back(std::move(field));
  return fields;
}

namespace {

// --- kiln synth ---------------------------------------------------------------------------------

using nlohmann::json;

// The sizes that differ between the Qwen3.5 text shapes; every other field is Qwen3_5TextConfig's
// default: head_dim 256, linear heads of 128 (16 key heads), conv kernel 4, partial rotary 0.25,
// rope_theta 1e7, vocabulary 248320, every 4th layer full attention (full_attention_interval 4).
struct Qwen35Sizes {
  int hidden, intermediate, layers, heads, kv_heads, linear_value_heads;
  bool tied;
};

json qwen3_5_text_config(const Qwen35Sizes& sizes) {
  json layer_types = json::array();
  for (int layer = 0; layer < sizes.layers; ++layer)
    layer_types.push_back((layer + 1) % 4 == 0 ? "full_attention" : "linear_attention");
  json config = json::parse(R"({
    "architectures": ["Qwen3_5ForCausalLM"],
    "attention_bias": false,
    "attention_dropout": 0.0,
    "bos_token_id": null,
    "eos_token_id": null,
    "head_dim": 256,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "model_type": "qwen3_5_text",
    "pad_token_id": null,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"mrope_interleaved": true, "mrope_section": [11, 11, 10],
                        "partial_rotary_factor": 0.25, "rope_theta": 10000000.0, "rope_type": "default"},
    "torch_dtype": "bfloat16",
    "use_cache": true,
    "vocab_size": 248320
  })");
  config["hidden_size"] = sizes.hidden;
  config["intermediate_size"] = sizes.intermediate;
  config["num_hidden_layers"] = sizes.layers;
  config["layer_types"] = layer_types;
  config["num_attention_heads"] = sizes.heads;
  config["num_key_value_heads"] = sizes.kv_heads;
  config["linear_num_value_heads"] = sizes.linear_value_heads;
  config["tie_word_embeddings"] = sizes.tied;
  return config;
}

// One decoder layer's tensors under `prefix`, as transformers saves them: zero-centred RMSNorm
// gains (stored w, applied as 1 + w), gated attention (q_proj carries query and gate per head) or
// a Gated DeltaNet layer with the depthwise conv weight in torch's [C, 1, K] layout, and the dense
// MLP or the sparse one (experts in the fused v5 layout).
void append_synth_layer(std::vector<SynthTensor>& tensors, const std::string& prefix, LayerKind kind, bool sparse,
                        const ModelConfig& config) {
  const int64_t hidden = config.hidden_size;
  const int64_t head_dim = config.head_dim;
  const int64_t key_width = config.linear_num_key_heads * config.linear_key_head_dim;
  const int64_t value_width = config.linear_num_value_heads * config.linear_value_head_dim;
  const int64_t conv_channels = 2 * key_width + value_width;
  const int64_t value_heads = config.linear_num_value_heads;
  const int64_t intermediate = config.intermediate_size;
  tensors.push_back({prefix + "input_layernorm.weight", {hidden}, SynthInit::Zeros});
  if (kind == LayerKind::FullAttention) {
    const std::string attention = prefix + "self_attn.";
    tensors.push_back(layer_linear(attention + "q_proj.weight", {2 * config.num_attention_heads * head_dim, hidden}));
    tensors.push_back(layer_linear(attention + "k_proj.weight", {config.num_key_value_heads * head_dim, hidden}));
    tensors.push_back(layer_linear(attention + "v_proj.weight", {config.num_key_value_heads * head_dim, hidden}));
    tensors.push_back(layer_linear(attention + "o_proj.weight", {hidden, config.num_attention_heads * head_dim}));
    tensors.push_back({attention + "q_norm.weight", {head_dim}, SynthInit::Zeros});
    tensors.push_back({attention + "k_norm.weight", {head_dim}, SynthInit::Zeros});
  } else {
    const std::string linear = prefix + "linear_attn.";
    tensors.push_back(layer_linear(linear + "in_proj_qkv.weight", {conv_channels, hidden}));
    tensors.push_back(layer_linear(linear + "in_proj_z.weight", {value_width, hidden}));
    tensors.push_back(layer_linear(linear + "in_proj_b.weight", {value_heads, hidden}));
    tensors.push_back(layer_linear(linear + "in_proj_a.weight", {value_heads, hidden}));
    tensors.push_back({linear + "conv1d.weight", {conv_channels, 1, config.linear_conv_kernel_dim}});
    tensors.push_back({linear + "dt_bias", {value_heads}, SynthInit::Ones});
    tensors.push_back({linear + "A_log", {value_heads}});
    tensors.push_back({linear + "norm.weight", {config.linear_value_head_dim}, SynthInit::Ones});
    tensors.push_back(layer_linear(linear + "out_proj.weight", {hidden, value_width}));
  }
  tensors.push_back({prefix + "post_attention_layernorm.weight", {hidden}, SynthInit::Zeros});
  if (sparse) {
    for (SynthTensor& tensor : sparse_moe_synth_layout(prefix, config, ExpertLayout::Fused))
      tensors.push_back(std::move(tensor));
    return;
  }
  tensors.push_back(layer_linear(prefix + "mlp.gate_proj.weight", {intermediate, hidden}));
  tensors.push_back(layer_linear(prefix + "mlp.up_proj.weight", {intermediate, hidden}));
  tensors.push_back(layer_linear(prefix + "mlp.down_proj.weight", {hidden, intermediate}));
}

bool sparse_layer(const ModelConfig& config, int64_t layer) {
  return config.moe.experts > 0 && config.moe.sparse_layers.at(static_cast<size_t>(layer));
}

}  // namespace

// Qwen3.5 text decoder as transformers' Qwen3_5ForCausalLM saves it (spec A).
std::vector<SynthTensor> qwen3_5_text_synth_layout(const ModelConfig& config) {
  const int64_t hidden = config.hidden_size;
  std::vector<SynthTensor> tensors;
  tensors.push_back(embedding("model.embed_tokens.weight", {config.vocab_size, hidden}));
  for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer)
    append_synth_layer(tensors, fmt::format("model.layers.{}.", layer),
                       config.layer_types.at(static_cast<size_t>(layer)), sparse_layer(config, layer), config);
  tensors.push_back({"model.norm.weight", {hidden}, SynthInit::Zeros});
  if (!config.tie_word_embeddings) tensors.push_back(head_linear("lm_head.weight", {config.vocab_size, hidden}));
  return tensors;
}

// The multi-token-prediction head as the published Qwen3.5 checkpoints store it (spec A.8): fc,
// three zero-centred norms and one full-attention layer with the MLP of the model's layer 0. fc is
// no layer matrix to synth --quantize: NVFP4 exports keep it in BF16 (vLLM's qwen3_5_mtp.py).
std::vector<SynthTensor> qwen3_5_mtp_synth_layout(const ModelConfig& config) {
  const int64_t hidden = config.hidden_size;
  std::vector<SynthTensor> tensors = {
      {"mtp.fc.weight", {hidden, 2 * hidden}},
      {"mtp.pre_fc_norm_embedding.weight", {hidden}, SynthInit::Zeros},
      {"mtp.pre_fc_norm_hidden.weight", {hidden}, SynthInit::Zeros},
      {"mtp.norm.weight", {hidden}, SynthInit::Zeros},
  };
  append_synth_layer(tensors, "mtp.layers.0.", LayerKind::FullAttention, sparse_layer(config, 0), config);
  return tensors;
}


FamilySpec qwen3_5_family() {
  return {
      .graph = "qwen3_5",
      .loop = Loop::HybridRecurrent,
      .oracle = "transformers float64 logits, fixtures/tiny/qwen3_5-text-tiny and qwen3_5-vl-tiny",
      // Qwen3NextConfig (configuration_qwen3_next.py): 512 experts, top 10 renormalised, experts and
      // shared expert of width 512, dense MLP width 5632, every layer sparse by default.
      .model_types = {hybrid_rules("qwen3_5_text"),
                      hybrid_rules("qwen3_next",
                                   MoeFieldDefaults{.experts = 512,
                                                    .experts_per_token = 10,
                                                    .expert_intermediate_size = 512,
                                                    .shared_expert_intermediate_size = 512,
                                                    .normalize_top_k = true},
                                   5632)},
      // The multimodal Qwen3.5: its text model.
      .wrappers = {{"qwen3_5", "qwen3_5_text"}},
      .graph_shaping_fields = hybrid_graph_shaping_fields(),
      // Qwen3.5 ships in two checkpoint generations (and Qwen3-Next in a third row layout).
      .sanitize = [](const Checkpoint& checkpoint, const ModelConfig& config,
                     bool keep_mtp) { return plan_qwen3_5_checkpoint(checkpoint.tensors(), config, keep_mtp); },
      .tensor_parallel = {check_qwen3_5_tensor_parallel, qwen3_5_tensor_shard},
      // The graph needs the backend's HybridOps: the CPU and CUDA have them.
      .backends = {{Device::CPU, make_qwen3_5_model}, {Device::CUDA, make_qwen3_5_model}},
      .synth_shapes = {
        // transformers' Qwen3_5TextConfig() defaults, which are the 9B model's text decoder
        // (configuration_qwen3_5.py), written as save_pretrained writes a Qwen3_5ForCausalLM.
        {"qwen3.5-9b", "transformers Qwen3_5TextConfig defaults",
         qwen3_5_text_config({.hidden = 4096, .intermediate = 12288, .layers = 32, .heads = 16, .kv_heads = 4,
                              .linear_value_heads = 32, .tied = false})},
        // A ~1.9B-parameter hybrid for 2B-class benchmarks: the published Qwen3.5-2B's hidden size
        // (2048), vocabulary and head geometry with the 3:1 linear/full schedule; the layer count
        // and MLP width are ours (the published config was not reachable), hence "-like".
        {"qwen3.5-2b-like", "kiln (Qwen3.5-2B-sized; not a published config)",
         qwen3_5_text_config({.hidden = 2048, .intermediate = 6144, .layers = 24, .heads = 8, .kv_heads = 2,
                              .linear_value_heads = 16, .tied = true})},
      },
      .synth_layout = qwen3_5_text_synth_layout,
      // Qwen3-Next stores its GDN projections in another row layout (in_proj_qkvz, in_proj_ba).
      .synth_model_types = {"qwen3_5_text"},
      .synth_mtp_layout = qwen3_5_mtp_synth_layout,
  };
}

}  // namespace kiln
