// Launchers of the CUDA kernels (internal to backend/cuda). Plain C++: cuda_backend.cpp validates
// shapes and dtypes and then calls these; each returns the launch status (cudaGetLastError).
//
// The .cu files cannot include core/error.h (fmt's consteval format strings do not compile under
// nvcc), so every check that produces a kiln::Error happens on the host side before a launch.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "core/dtype.h"

namespace kiln::cuda {

// Kernels that find bad data (an out-of-range token id or row index) record the first such
// finding here; the backend reads it back at its next synchronisation point and fails.
struct DeviceErrorRecord {
  int32_t code = 0;   // a DeviceErrorCode, 0 when nothing went wrong
  int32_t value = 0;  // the offending index
  int32_t limit = 0;  // the extent it had to stay below
};
enum DeviceErrorCode : int32_t {
  kNoDeviceError = 0,
  kEmbeddingIdOutOfRange = 1,
  kGatherRowOutOfRange = 2,
  kSamplingRowNotSorted = 3,  // a row asked for sampling in a call made without sorting (value: the row)
  kFeedRowOutOfRange = 4,     // feed_tokens: a feed index past the previous tokens
  kExpertIdOutOfRange = 5,    // expert_matmul: an expert id outside the weights' experts
};

// out[t, :] = table[ids[t], :], converted to out_dtype.
cudaError_t launch_embedding(const void* table, DType table_dtype, int64_t table_rows, int64_t width,
                             const int32_t* ids, int64_t tokens, void* out, DType out_dtype,
                             DeviceErrorRecord* errors, cudaStream_t stream);

// out[r, :] = x[rows[r], :] for row_bytes-wide rows.
cudaError_t launch_gather_rows(const void* x, int64_t x_rows, int64_t row_bytes, const int32_t* rows,
                               int64_t count, void* out, DeviceErrorRecord* errors, cudaStream_t stream);

// tokens[i] = previous[feed[i]] where feed[i] ≥ 0 (GraphOps::feed_tokens).
cudaError_t launch_feed_tokens(const int32_t* previous, int64_t previous_count, const int32_t* feed, int64_t count,
                               int32_t* tokens, DeviceErrorRecord* errors, cudaStream_t stream);

// a += b elementwise (both `dtype`), rounded once to dtype.
cudaError_t launch_add(void* a, const void* b, int64_t count, DType dtype, cudaStream_t stream);
// out[t, :] = Σ_s weights[t, s] · term_s, one fma chain from 0 per element (Backend::moe_combine):
// term_s = routed[t·top_k + s, :] for s < top_k, else shared[t, :] (terms = top_k + 1).
cudaError_t launch_moe_combine(const float* routed, const float* shared, const float* weights, int64_t tokens,
                               int64_t top_k, int64_t terms, int64_t width, float* out, cudaStream_t stream);

// out = silu(gate) · up (all `dtype`), with silu(gate) rounded to dtype first (transformers'
// ⟦⟦silu(g)⟧·u⟧; a no-op rounding in f32). out may alias gate or up.
cudaError_t launch_swiglu(const void* gate, const void* up, void* out, int64_t count, DType dtype,
                          cudaStream_t stream);

// The paged KV cache (backend.h): pools of blocks of kKvBlockRows rows, position p of slot s at pool
// row block_table[s · table_width + p / kKvBlockRows] · kKvBlockRows + p % kKvBlockRows.
constexpr int64_t kKvBlockRows = 64;  // = kiln::kKvBlockTokens (backend.h, which this layer does not include)
struct KvBlockTable {
  const int32_t* entries = nullptr;  // [slots, table_width] on the device
  int64_t width = 0;
};

// The pool rows of slot[t], position[t] of k and v ← src[t, :] (row_bytes each).
cudaError_t launch_kv_write(const void* k, const void* v, int64_t tokens, int64_t row_bytes,
                            const int32_t* slots, const int32_t* positions, KvBlockTable table, void* k_cache,
                            void* v_cache, cudaStream_t stream);

// Norm rows up to this wide are reduced by one warp (norm.cu's file comment says in what order);
// the per-head norms that rope_kv_write applies take heads up to this wide.
constexpr int64_t kNormWarpRowMaxWidth = 1024;

struct NormArgs {
  const void* x = nullptr;        // [rows, width] in stream_dtype (rms_norm; may alias out)
  void* residual = nullptr;       // add_rms_norm: [rows, width] in stream_dtype, updated in place
  const void* delta = nullptr;    // add_rms_norm: [rows, width] in stream_dtype
  const void* weight = nullptr;   // [width] in weight_dtype
  void* out = nullptr;            // [rows, width] in act_dtype
  int64_t rows = 0;
  int64_t width = 0;
  float eps = 0;
  bool zero_centred = false;      // y = x̂ · (1 + w) instead of w · x̂
  DType act_dtype = DType::F32;     // out
  DType stream_dtype = DType::F32;  // x, residual and delta: F32 or act_dtype
  DType weight_dtype = DType::F32;
};
cudaError_t launch_rms_norm(const NormArgs& args, cudaStream_t stream);
cudaError_t launch_add_rms_norm(const NormArgs& args, cudaStream_t stream);

// Rotate-half RoPE in place on x [tokens, heads, head_dim] over the first rotary_dim dims.
cudaError_t launch_rope(void* x, DType dtype, int64_t tokens, int64_t heads, int64_t head_dim, int64_t rotary_dim,
                        const int32_t* positions, const float* inv_freq, cudaStream_t stream);

// RoPE on q and k in place, k's rotated rows and v written to the caches at (slot, position): the
// rope and kv_write kernels' arithmetic in one launch.
struct RopeKvWriteArgs {
  void* q = nullptr;        // [tokens, q_heads, head_dim]
  void* k = nullptr;        // [tokens, kv_heads, head_dim]
  const void* v = nullptr;  // [tokens, kv_heads, head_dim]
  void* k_cache = nullptr;  // [blocks, kKvBlockRows, kv_heads, head_dim]
  void* v_cache = nullptr;
  KvBlockTable table;
  const int32_t* positions = nullptr;  // [tokens]
  const int32_t* slots = nullptr;      // [tokens]
  const float* inv_freq = nullptr;     // [rotary_dim / 2]
  int64_t tokens = 0, q_heads = 0, kv_heads = 0, head_dim = 0, rotary_dim = 0;
  DType dtype = DType::F32;
  // The per-head RMSNorms applied to q and k before the rotation, as rms_norm(q, q_norm) and
  // rms_norm(k, k_norm) would (Qwen3's q_norm / k_norm): [head_dim] gains in norm_dtype, or null.
  const void* q_norm = nullptr;
  const void* k_norm = nullptr;
  DType norm_dtype = DType::F32;
  float norm_eps = 0.0f;
  bool norm_zero_centred = false;
};
cudaError_t launch_rope_kv_write(const RopeKvWriteArgs& args, cudaStream_t stream);

struct MatmulArgs {
  const void* x = nullptr;     // [m, k] in x_dtype
  const void* w = nullptr;     // [n, k] in w_dtype
  const void* bias = nullptr;  // [n] in bias_dtype, or null
  void* out = nullptr;         // [m, n] in out_dtype
  int64_t m = 0, n = 0, k = 0;
  DType x_dtype = DType::F32, w_dtype = DType::F32, bias_dtype = DType::F32, out_dtype = DType::F32;
  int multiprocessors = 0;     // the device's SM count (sizes grids; never changes arithmetic)
  float* partials = nullptr;   // scratch of matmul_bf16_partials_floats floats (BF16 prefill GEMMs)
};
// F32 activations: CUDA-core FMA chains (x F32; w F32, BF16 or F16).
cudaError_t launch_matmul_f32(const MatmulArgs& args, cudaStream_t stream);
// BF16 activations and weights: tensor-core mma (k must be a multiple of 8, at most
// kMatmulSegmentK · kMatmulMaxSegments).
cudaError_t launch_matmul_bf16(const MatmulArgs& args, cudaStream_t stream);
constexpr int kMatmulGroupMax = 4;  // = kiln::kMaxMatmulGroup (backend.h, which this layer does not include)
// Several BF16 products sharing x, m and k (up to kMatmulGroupMax): one decode launch for m ≤
// kMatmulDecodeMaxRows, else one prefill GEMM each, or one shared GEMM where that takes fewer waves
// of blocks; every element as launch_matmul_bf16 computes it.
cudaError_t launch_matmul_bf16_group(const MatmulArgs* products, int count, cudaStream_t stream);
// Floats of scratch (MatmulArgs::partials, shared by the products: they run one after another) that
// launch_matmul_bf16_group needs for these products: a prefill GEMM whose grid would leave
// multiprocessors idle splits K across blocks at segment boundaries and adds the segments' sums in
// order afterwards — the same additions, so the same bits. 0 when nothing splits.
int64_t matmul_bf16_partials_floats(const MatmulArgs* products, int count);
// The most of it over every row count m ≤ max_rows of the products (their m is not read).
int64_t matmul_bf16_most_partials_floats(const MatmulArgs* products, int count, int64_t max_rows);
// The decode kernel's launch shapes, for the kernel bench's sweep and the tests (launch_matmul_bf16
// picks one itself): shape i < decode_launch_shape_count() of a group of products with m ≤
// kMatmulDecodeMaxRows. Every shape gives the same bits.
struct DecodeLaunchShape {
  // Weight rows per block, warps per block (no more than K has segments), ring stages per warp.
  int columns, warps, stages;
};
int decode_launch_shape_count();
DecodeLaunchShape decode_launch_shape(int shape);
cudaError_t launch_matmul_bf16_decode(const MatmulArgs* products, int count, int shape, cudaStream_t stream);
// A quantized weight's parts on the device, in core/weight.h's layouts (that header's decode rule
// is what every kernel below computes, element for element).
enum class QuantizedFormat : uint8_t { Affine, Fp8Block };
struct QuantizedWeightArgs {
  QuantizedFormat format = QuantizedFormat::Affine;
  const void* values = nullptr;  // Affine: U32 [n, k·bits/32]; Fp8Block: F8E4M3 [n, k]
  const void* scales = nullptr;  // Affine: [n, k/group_size]; Fp8Block: [⌈n/block_rows⌉, scale_columns]
  const void* biases = nullptr;  // Affine only, as scales
  DType scale_dtype = DType::F32;  // of scales and biases: F32, BF16 or F16
  int64_t n = 0, k = 0;
  int64_t scale_columns = 0;       // scales' second dimension
  int bits = 0, group_size = 0;    // Affine
  int block_rows = 0, block_columns = 0;  // Fp8Block
  // Whether each row's codes are in the fragment order (CodeOrder::Fragment; quantized.cu says
  // how), which launch_arrange_fragments gives the weights fragment_order_applies to at upload.
  bool fragment_order = false;
};
// Whether the upload rearranges this weight's codes into the fragment order: 4- and 8-bit affine
// weights, FP8 weights of K a multiple of 16 in blocks of 128 columns (scales F32 or BF16).
bool fragment_order_applies(const QuantizedWeightArgs& weight);
// Rearranges the codes of every row of a weight that fragment_order_applies to from the stored
// order into the fragment order, in place.
cudaError_t launch_arrange_fragments(const QuantizedWeightArgs& weight, cudaStream_t stream);
// out = the decoded weight [n, k] in out_dtype (F32 or BF16): each element decoded in f32, then
// rounded once.
cudaError_t launch_dequantize(const QuantizedWeightArgs& weight, void* out, DType out_dtype, cudaStream_t stream);
// out[t, :] = the decoded row ids[t] of a quantized table, rounded to out_dtype.
cudaError_t launch_embedding_quantized(const QuantizedWeightArgs& table, const int32_t* ids, int64_t tokens, void* out,
                                       DType out_dtype, DeviceErrorRecord* errors, cudaStream_t stream);
// Whether the fused decode kernel takes this weight: codes in the fragment order. The others are
// decoded into a scratch matrix for the BF16 kernels. Both give the same bits.
bool quantized_decode_fused(const QuantizedWeightArgs& weight);
// The BF16 decode product (m ≤ kMatmulDecodeMaxRows) with the weight decoded inside the kernel:
// args.w is unused; every element as launch_matmul_bf16 gives on the decoded BF16 weight, in every
// launch shape (shape −1: the one chosen for the product's size; the others for benchmarks).
struct QuantizedDecodeLaunchShape {
  int rows, warps;
};
// The most rows the fused kernel takes: all of the mma's 8 columns. Its time is the decode of the
// weight, whatever the rows (up to 8), while the other path decodes the whole matrix into scratch
// and reads it back, so it takes more rows than the BF16 decode kernel (kMatmulDecodeMaxRows).
constexpr int64_t kQuantizedDecodeMaxRows = 8;
int quantized_decode_launch_shape_count();
QuantizedDecodeLaunchShape quantized_decode_launch_shape(int shape);
cudaError_t launch_matmul_quantized_decode(const MatmulArgs& args, const QuantizedWeightArgs& weight,
                                           cudaStream_t stream, int shape = -1);
// The largest m the bf16 decode (weight-streaming) kernel takes; larger m uses the prefill GEMM.
// Both give bit-identical elements (the same segments and 16-k steps per element; matmul.cu).
// At m = 8 the GEMM's 64-row tiles stream the 8B's 14336×4096 product in 35.0 µs against this
// kernel's 40.4 (70.5 at m = 16; batch-8 decode 49.8 → 58.3 % of roofline, docs/perf.md); at m = 1
// this kernel is the faster (93.8 % of the copy bandwidth for the 8B's gate/up).
constexpr int64_t kMatmulDecodeMaxRows = 4;
// The BF16 path sums K in segments of this many elements (each an mma chain from zero, the
// segments then added in order), so that decode can spread one row's K over several warps.
constexpr int64_t kMatmulSegmentK = 1024;
constexpr int64_t kMatmulMaxSegments = 64;

// --- mixtures of experts (moe.cu; the expert products in matmul.cu, their quantized weights'
// decode in quantized.cu) ---

// Each token's routing (backend/moe_routing.h, bit for bit route_token's): experts [tokens,
// top_k] ascending, weights [tokens, terms] (terms = top_k + 1 with shared_logits: the last is
// σ(shared_logits[t])). A warp per token.
cudaError_t launch_moe_route(const float* logits, const float* shared_logits, int64_t tokens, int64_t experts,
                             int64_t top_k, bool normalize, int32_t* expert_ids, float* weights, cudaStream_t stream);
// The most experts launch_moe_route takes: a token's probabilities stay in a block's static 48 KB
// of shared memory (published MoE models have up to 512).
constexpr int64_t kMoeRouteMaxExperts = 8192;

// The (token, expert) pairs of a routing grouped by expert, on the device, in an I32 buffer of
// expert_groups_ints(experts, pairs) words: the experts that have pairs take slots 0 … used − 1
// (ascending by expert), and slot s's pairs are listed in pairs[begin(s) … end(s) − 1]. A routing's
// experts are at most min(experts, pairs), the slots a launch provides for.
constexpr int64_t expert_slots(int64_t experts, int64_t pairs) { return experts < pairs ? experts : pairs; }
struct ExpertGroupsLayout {
  int64_t slots, pairs;
  // Word offsets: [used] [expert of each slot] [begin of each] [end of each] [pairs] [a counter per expert]
  // (constexpr: the kernels call them too, built with --expt-relaxed-constexpr)
  constexpr int64_t used() const { return 0; }
  constexpr int64_t expert(int64_t slot) const { return 1 + slot; }
  constexpr int64_t begin(int64_t slot) const { return 1 + slots + slot; }
  constexpr int64_t end(int64_t slot) const { return 1 + 2 * slots + slot; }
  constexpr int64_t pair(int64_t index) const { return 1 + 3 * slots + index; }
  constexpr int64_t counter(int64_t expert) const { return 1 + 3 * slots + pairs + expert; }
};
constexpr int64_t expert_groups_ints(int64_t experts, int64_t pairs) {
  return 1 + 3 * expert_slots(experts, pairs) + pairs + experts;
}
// Groups the pairs of expert_ids [pairs] (values below `experts`; another is recorded in `errors`
// and its pair left out). The order of an expert's pairs is not fixed (each output row is computed
// alone, so nothing depends on it). With experts_read, adds the number of experts used to it.
// One block.
cudaError_t launch_group_experts(const int32_t* expert_ids, int64_t pairs, int64_t experts, int32_t* groups,
                                 uint32_t* experts_read, DeviceErrorRecord* errors, cudaStream_t stream);

// How the expert products find their rows: out row p (a pair t·top_k + j) is x row p (x_per_pair)
// or t, times the matrix of the pair's expert: rows [e·n, e·n + n) of a product's w, or, for the
// products whose bit is set in slot_weights, rows [s·n, s·n + n) of a w holding each slot's
// expert (a quantized weight's experts decoded into scratch by launch_dequantize_experts).
struct ExpertRouting {
  const int32_t* groups = nullptr;  // launch_group_experts' buffer
  int64_t slots = 0, pairs = 0, top_k = 0;
  bool x_per_pair = false;
  uint32_t slot_weights = 0;
  int rows_per_pass = 0;            // pairs of one expert multiplied together, 1 … kExpertPassRows
};
// The most pairs the expert kernels take in one pass over an expert's matrix: all of the mma's 8
// columns (an expert with more takes several passes, each the same per-element arithmetic).
constexpr int kExpertPassRows = 8;
// BF16 activations: matmul.cu's decode kernel over each slot's expert (k a multiple of 8, at most
// kMatmulSegmentK · kMatmulMaxSegments): every element as launch_matmul_bf16 gives for the pair's
// row and expert, whatever the other pairs. products share x, m (unused) and k; each w is the
// stacked base and n an expert's rows; out is [pairs, n].
cudaError_t launch_expert_matmul_bf16(const MatmulArgs* products, int count, const ExpertRouting& routing,
                                      cudaStream_t stream);
// F32 activations, one product (its w holding the slots' experts when bit 0 of slot_weights is
// set): each element the fma chain of launch_matmul_f32.
cudaError_t launch_expert_matmul_f32(const MatmulArgs& product, const ExpertRouting& routing, cudaStream_t stream);
// Decodes the matrix of each used slot's expert, rows [e·rows_per_expert, (e + 1)·rows_per_expert)
// of a stacked quantized weight, into out [slots · rows_per_expert, k] (out_dtype F32 or BF16),
// each element as launch_dequantize gives it.
cudaError_t launch_dequantize_experts(const QuantizedWeightArgs& weight, int64_t rows_per_expert,
                                      const ExpertRouting& routing, void* out, DType out_dtype, cudaStream_t stream);

struct AttentionArgs {
  const void* q = nullptr;        // [tokens, heads, head_dim]
  const void* k_cache = nullptr;  // [blocks, kKvBlockRows, kv_heads, head_dim]
  const void* v_cache = nullptr;
  KvBlockTable table;
  void* out = nullptr;            // [tokens, heads, head_dim]
  const int32_t* spans = nullptr; // [span_count, 4] = {slot, first_token, tokens, first_position}
  const int32_t* slots = nullptr;      // [tokens]
  const int32_t* positions = nullptr;  // [tokens]
  int64_t tokens = 0, heads = 0, kv_heads = 0, head_dim = 0;
  int64_t span_count = 0;
  int64_t max_span_tokens = 0;    // over the spans
  int64_t max_position = 0;       // over all tokens
  float scale = 0;
  DType dtype = DType::F32;       // of q, caches and out
  float* partials = nullptr;      // split-KV scratch, attention_partials_floats() floats
};
// Keys are consumed in fixed 64-key splits from position 0 (see attention.cu); the bf16 decode
// path computes splits in parallel into `partials` and folds them in order. One 64-key tile per
// split keeps a decode block's dependent chain to one tile (256-key splits: 14.4 µs per decode
// attention at context 512 on the H200, kiln_cuda_bench decode-ops); prefill folds a split per tile.
constexpr int64_t kAttentionSplitKeys = 64;
// Calls of at most this many tokens take the bf16 decode path.
constexpr int64_t kAttentionDecodeMaxTokens = 16;
// Scratch the bf16 decode path needs (0 when the call takes the one-pass path).
int64_t attention_partials_floats(const AttentionArgs& args);
bool attention_bf16_supports_head_dim(int64_t head_dim);
cudaError_t launch_attention(const AttentionArgs& args, cudaStream_t stream);

// Token choice (sampling.cu; GraphOps::sample_tokens documents the rules). settings holds
// kSamplingWords I32 words per row (backend.h, kSamplingSettingsWords).
constexpr int64_t kSamplingWords = 6;
struct SamplingArgs {
  const float* logits = nullptr;   // [rows, vocab]
  const int32_t* settings = nullptr;
  int64_t rows = 0, vocab = 0;
  void* sort_scratch = nullptr;    // sampling_sort_scratch_bytes(rows, vocab) bytes, or null: every row greedy
  void* chunk_scratch = nullptr;   // sampling_chunk_scratch_bytes(rows, vocab) bytes
  int32_t* tokens = nullptr;       // [rows]
  float* logprobs = nullptr;       // [rows]
  DeviceErrorRecord* errors = nullptr;
};
// rows · vocab must fit an int (the radix sort's item count).
size_t sampling_sort_scratch_bytes(int64_t rows, int64_t vocab);
size_t sampling_chunk_scratch_bytes(int64_t rows, int64_t vocab);
cudaError_t launch_sample_tokens(const SamplingArgs& args, cudaStream_t stream);

// --- the Qwen3.5 hybrid ops (gated_delta.cu; the rounding of each is documented there) ---

// query/gate [heads, head_dim] each from query_and_gate [heads, 2·head_dim] (heads over all tokens).
cudaError_t launch_split_query_gate(const void* source, void* query, void* gate, int64_t heads, int64_t head_dim,
                                    DType dtype, cudaStream_t stream);
// x ← x · sigmoid(gate).
cudaError_t launch_sigmoid_gate(void* x, const void* gate, int64_t count, DType dtype, cudaStream_t stream);

// The GDN conv kernel size the kernels are built for (Qwen3.5 and Qwen3-Next: linear_conv_kernel_dim).
constexpr int64_t kGatedDeltaConvKernel = 4;
struct ConvArgs {
  const void* x = nullptr;         // [tokens, channels] in dtype
  const void* weight = nullptr;    // [channels, kernel] in weight_dtype
  const int32_t* spans = nullptr;  // [span_count, 4] = {slot, first_token, tokens, first_position}
  float* conv_state = nullptr;     // [slots, kernel − 1, channels]
  void* out = nullptr;             // [tokens, channels] in dtype
  int64_t span_count = 0, channels = 0, kernel = 0;
  DType dtype = DType::F32, weight_dtype = DType::F32;
};
cudaError_t launch_causal_conv1d_silu(const ConvArgs& args, cudaStream_t stream);

// q, k [tokens, key_heads, key_dim] and v [tokens, value_width] (f32) from the conv output.
cudaError_t launch_gated_delta_prepare_qkv(const void* qkv, DType dtype, int64_t tokens, int64_t key_heads,
                                           int64_t key_dim, int64_t value_width, float query_scale, float eps,
                                           float* q, float* k, float* v, cudaStream_t stream);
// beta, g [count] (f32) from b, a [count] (dtype) and the per-head A_log, dt_bias [heads].
cudaError_t launch_gated_delta_gates(const void* b, const void* a, DType dtype, const void* a_log,
                                     const void* dt_bias, DType weight_dtype, int64_t count, int64_t heads,
                                     float* beta, float* g, cudaStream_t stream);

// The key dims the delta-rule kernels are built for (state registers per thread: 32, 64 or 128),
// and the largest value head dimension of the recurrent kernel (one thread per value column; the
// chunk kernel takes any, in tiles of 32 columns).
constexpr int64_t kGatedDeltaMaxValueDim = 1024;
// Tokens per chunk of the chunked form (= kiln::kGatedDeltaChunk, backend.h).
constexpr int64_t kGatedDeltaChunkTokens = 64;
struct DeltaRuleArgs {
  const float* q = nullptr;        // [tokens, key_heads, key_dim]
  const float* k = nullptr;
  const float* v = nullptr;        // [tokens, value_heads, value_dim]
  const float* g = nullptr;        // [tokens, value_heads]
  const float* beta = nullptr;
  const int32_t* spans = nullptr;  // [span_count, 4]
  float* states = nullptr;         // [slots, value_heads, key_dim, value_dim]
  void* out = nullptr;             // [tokens, value_heads, value_dim] in dtype
  int64_t span_count = 0, key_heads = 0, value_heads = 0, key_dim = 0, value_dim = 0;
  DType dtype = DType::F32;
  bool whole_chunks = false;  // some span holds a whole chunk aligned to a multiple of the chunk length
};
cudaError_t launch_gated_delta_rule(const DeltaRuleArgs& args, cudaStream_t stream);
// key_dim a multiple of 8 up to 128: the chunk kernel keeps a chunk's k and q, the state tile and
// the chunk's coefficients in one block's shared memory, which for key_dim 256 exceeds Hopper's 227 KB.
constexpr int64_t kGatedDeltaMaxKeyDim = 128;
inline bool gated_delta_supports_key_dim(int64_t key_dim) {
  return key_dim > 0 && key_dim % 8 == 0 && key_dim <= kGatedDeltaMaxKeyDim;
}

// out = ⟦⟦rmsnorm(x)⟧·w⟧·silu(z) per row of `width` (x, z, out in dtype; out may alias x).
cudaError_t launch_rms_norm_gated(const void* x, const void* z, DType dtype, const void* weight, DType weight_dtype,
                                  int64_t rows, int64_t width, float eps, void* out, cudaStream_t stream);

}  // namespace kiln::cuda
