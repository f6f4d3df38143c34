// The op contract: every shape and dtype rule of the ops of Backend, HybridOps and GraphOps that
// holds on every backend, stated once. Each backend calls an op's check first, then checks only
// what is its own (device placement, host values its kernels read, the limits of its kernels) and
// launches with the dimensions the check returns.
//
// Every tensor a check names must be defined and on the backend's device.
//
// Dtypes are named by role: the backend's activation dtype (F32 on the CPU; F32 or BF16 on CUDA),
// the f32 residual stream (F32 or the activation dtype, model/model.h), a stored weight (F32, BF16
// or F16), or a fixed dtype (I32 indices, F32 recurrent state and gates). Failures are a
// kiln::Error "<backend> <op>: <tensor> ..." naming the tensor and what was expected.
//
// Where the backends disagreed before this layer, the rule below is the stricter one (every model
// graph runs on the CPU in the tests, so its calls meet the CPU's rules); each such place says
// which backend had which rule.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "backend/backend.h"
#include "core/tensor.h"

namespace kiln {

// The backend a check speaks for: its name in messages, its activation dtype, and the device its
// kernels read and write (every tensor an op takes must be there).
struct OpContext {
  std::string_view backend;
  DType activations;
  Device device;
};

// --- dense transformer ops ---

struct EmbeddingDims {
  int64_t vocab, hidden, tokens;
};
// table [vocab, hidden] a weight (dense or quantized); ids I32 [T]; out [T, hidden] in the stream dtype.
EmbeddingDims check_embedding(const OpContext& context, const Weight& table, const Tensor& ids, const Tensor& out);

struct MatmulDims {
  int64_t rows, n, k;
};
// w [N, K > 0] a weight (dense, or quantized with every part on the device); x [..., K]
// activations; out [..., N] of x's rows, stream dtype; bias [N] a weight, or null.
MatmulDims check_matmul(const OpContext& context, const Tensor& x, const Weight& w, const Tensor* bias,
                        const Tensor& out);

// 1 to kMaxMatmulGroup products, each one matmul's rules.
void check_matmul_group(const OpContext& context, const Tensor& x, std::span<const MatmulTarget> targets);

struct NormDims {
  int64_t rows, width;
};
// weight [D > 0] a weight; x [..., D] in the stream dtype; out as many elements in activations
// (in place only when x is in the activation dtype too).
NormDims check_rms_norm(const OpContext& context, const Tensor& x, const Tensor& weight, const Tensor& out);
// rms_norm's rules on (residual, weight, out), and delta like residual in dtype and elements.
NormDims check_add_rms_norm(const OpContext& context, const Tensor& residual, const Tensor& delta, const Tensor& weight,
                            const Tensor& out);

// a and b activations of as many elements.
int64_t check_add(const OpContext& context, const Tensor& a, const Tensor& b);
// gate, up and out activations of as many elements.
int64_t check_swiglu(const OpContext& context, const Tensor& gate, const Tensor& up, const Tensor& out);

// from and to of one dtype (any) and element count; not the same bytes. Returns the bytes.
int64_t check_copy(const OpContext& context, const Tensor& from, const Tensor& to);

struct GatherDims {
  int64_t rows, available, row_elements;
};
// x [X, ...] in the stream dtype (F32 or activations); rows I32 [R]; out [R, ...] of R · (x's row)
// elements in x's dtype.
GatherDims check_gather_rows(const OpContext& context, const Tensor& x, const Tensor& rows, const Tensor& out);

// --- mixtures of experts ---

struct RouteDims {
  int64_t tokens, experts, top_k, terms;  // terms: weights' columns, top_k (+ 1 with a shared expert)
};
// logits F32 [T, E > 0]; experts I32 [T, k] with 0 < k ≤ E; weights F32 [T, k], or [T, k + 1]
// with shared_logits F32 [T, 1].
RouteDims check_moe_route(const OpContext& context, const Tensor& logits, const Tensor* shared_logits,
                          const Tensor& experts, const Tensor& weights);

struct ExpertMatmulDims {
  int64_t tokens, top_k, x_rows, k;                      // T, experts per token, x's rows (T or T·k), K
  int64_t experts[kMaxMatmulGroup], n[kMaxMatmulGroup];  // each target's E and N
};
// x [T or T·k, K] activations; experts I32 [T, k > 0]; 1 to kMaxMatmulGroup targets, each with no
// bias, w [E·N, K > 0] a weight (dense or quantized) and out [T·k, N > 0] F32 or activations, N
// dividing w's rows; experts_read U32 [1] or null.
ExpertMatmulDims check_expert_matmul(const OpContext& context, const Tensor& x, const Tensor& experts,
                                     std::span<const MatmulTarget> targets, const Tensor* experts_read);

struct CombineDims {
  int64_t tokens, top_k, terms, width;
};
// weights F32 [T, S]; routed F32 [T·k, H] with k = S, or k = S − 1 with shared F32 [T, H]; k ≥ 1;
// out F32 [T, H].
CombineDims check_moe_combine(const OpContext& context, const Tensor& routed, const Tensor* shared,
                              const Tensor& weights, const Tensor& out);

struct RopeDims {
  int64_t tokens, heads, head_dim;
};
// x [T, heads, head_dim] activations; rotary_dim even in (0, head_dim]; positions I32 [T];
// inv_freq F32 [rotary_dim / 2]. `name` is x's name in messages (q and k in rope_kv_write).
RopeDims check_rope(const OpContext& context, std::string_view op, std::string_view name, const Tensor& x,
                    const Tensor& positions, const Tensor& inv_freq, int rotary_dim);

struct CacheDims {
  int64_t blocks, kv_heads, head_dim;  // the pool of each of keys and values
  int64_t slots, table_width;          // the block table
  int64_t capacity;                    // the positions a slot's table addresses: table_width · kKvBlockTokens
};
// cache.keys and cache.values: two [blocks, kKvBlockTokens, kv_heads, head_dim] tensors in the
// activation dtype; cache.block_table I32 [slots, table_width].
CacheDims check_caches(const OpContext& context, std::string_view op, const KvCacheView& cache);

// The layout describes `tokens` tokens, and every span's slot and positions lie inside the block
// table. (Which blocks the entries name is a host value only the CPU reads: check_block_ids.)
void check_cache_layout(const OpContext& context, std::string_view op, const BatchLayout& layout, int64_t tokens,
                        const CacheDims& cache);

// The entries of `slot`'s row of a host block table that hold positions [first_position,
// last_position] (inside the table) each name a block of the pool (below cache.blocks); fails
// naming the op, slot, position and block. For backends whose kernels read the table on the host
// (the CPU); the others trust the cache that wrote it (ModelCache::assign_blocks checks every id).
void check_block_ids(const OpContext& context, std::string_view op, const Tensor& block_table, int64_t slot,
                     int64_t first_position, int64_t last_position, const CacheDims& cache);

// k and v [layout tokens, kv_heads, head_dim] activations; the cache and layout as above.
CacheDims check_kv_write(const OpContext& context, const Tensor& k, const Tensor& v, const BatchLayout& layout,
                         const KvCacheView& cache);

struct RopeKvWriteDims {
  int64_t tokens, q_heads;
  CacheDims cache;
};
// rope's rules on q and k, kv_write's on k, v and the cache, q's head_dim the cache's; with
// head_norms, each gain a weight [head_dim].
RopeKvWriteDims check_rope_kv_write(const OpContext& context, const Tensor& q, const Tensor& k, const Tensor& v,
                                    const BatchLayout& layout, const Tensor& inv_freq, int rotary_dim,
                                    const HeadNorms* head_norms, const KvCacheView& cache);

struct AttentionDims {
  int64_t tokens, heads;
  CacheDims cache;
};
// q [layout tokens, heads, head_dim] activations with heads a positive multiple of kv_heads; out
// like q; the cache and layout as above.
AttentionDims check_attention(const OpContext& context, const Tensor& q, const KvCacheView& cache,
                              const BatchLayout& layout, const Tensor& out);

// --- HybridOps ---

// query and gate [T, heads, head_dim] activations; query_and_gate activations of twice the elements.
void check_split_query_gate(const OpContext& context, const Tensor& query_and_gate, const Tensor& query,
                            const Tensor& gate);
// x and gate activations of as many elements.
int64_t check_sigmoid_gate(const OpContext& context, const Tensor& x, const Tensor& gate);

struct ConvDims {
  int64_t tokens, channels, kernel, slots;
};
// x [T, C] activations; weight [C, K ≥ 1] a weight; conv_state F32 [slots, K − 1, C]; out like x
// and not x itself (earlier inputs are re-read); spans checked by check_recurrent_spans.
ConvDims check_causal_conv1d_silu(const OpContext& context, const Tensor& x, const Tensor& weight,
                                  std::span<const SequenceSpan> spans, const Tensor& conv_state, const Tensor& out);

struct PrepareQkvDims {
  int64_t tokens, key_heads, key_dim, value_heads, value_dim;
};
// q and k F32 [T, Hk, dk], v F32 [T, Hv, dv], all positive; qkv activations [T, 2·Hk·dk + Hv·dv].
PrepareQkvDims check_gated_delta_prepare_qkv(const OpContext& context, const Tensor& qkv, const Tensor& q,
                                             const Tensor& k, const Tensor& v);

struct GatesDims {
  int64_t tokens, heads;
};
// b and a activations [T, Hv]; a_log and dt_bias weights [Hv]; beta and g F32 [T, Hv].
GatesDims check_gated_delta_gates(const OpContext& context, const Tensor& b, const Tensor& a, const Tensor& a_log,
                                  const Tensor& dt_bias, const Tensor& beta, const Tensor& g);

struct DeltaRuleDims {
  int64_t tokens, key_heads, value_heads, key_dim, value_dim, slots;
};
// q and k F32 [T, Hk, dk]; v F32 [T, Hv, dv] with Hv a positive multiple of Hk; g and beta F32
// [T, Hv]; state F32 [slots, Hv, dk, dv]; out activations like v; spans by check_recurrent_spans.
// `op` names the caller (the CPU's recurrent and chunked forms share these rules).
DeltaRuleDims check_gated_delta_rule(const OpContext& context, std::string_view op, const Tensor& q, const Tensor& k,
                                     const Tensor& v, const Tensor& g, const Tensor& beta,
                                     std::span<const SequenceSpan> spans, const Tensor& state, const Tensor& out);

// weight [D > 0] a weight; x [..., D] activations; z and out activations of x's shape.
NormDims check_rms_norm_gated(const OpContext& context, const Tensor& x, const Tensor& z, const Tensor& weight,
                              const Tensor& out);

// --- GraphOps ---

struct SamplingDims {
  int64_t rows, vocab;
};
// logits F32 [rows, vocab > 0]; settings I32 of rows · kSamplingSettingsWords; tokens I32 and
// logprobs F32 of rows elements.
SamplingDims check_sample_tokens(const OpContext& context, const Tensor& logits, const Tensor& settings,
                                 const Tensor& tokens, const Tensor& logprobs);
// previous, feed and token_ids I32, one feed entry per token id.
void check_feed_tokens(const OpContext& context, const Tensor& previous, const Tensor& feed, const Tensor& token_ids);

}  // namespace kiln
