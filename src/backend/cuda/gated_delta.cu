// The Qwen3.5 hybrid ops (architectures.md A.5, A.6) on CUDA, for F32 and BF16 activations.
//
// Rounding (architectures.md D.1, the HF-Q35 column): with BF16 activations ⟦·⟧ rounds to bf16;
// with F32 activations every ⟦·⟧ is the identity and the ops compute what the CPU backend does.
//   conv + SiLU   f32 taps over the inputs, f32 SiLU, one rounding (causal_conv1d's fused kernel)
//   q, k          f32 L2 norm per head (q also × dk^−½), kept in f32 (the recurrence reads f32)
//   β, g          β = sigmoid(b) and g = −exp(A_log)·softplus(a + dt_bias), both f32. torch rounds β
//                 to bf16 (its bf16 sigmoid); kiln does not, as that rounding is what makes
//                 qwen3_5-text-tiny's least well-conditioned row 7 × less accurate (docs/numerics.md)
//   recurrence    f32 state and math, the output rounded once
//   gated norm    ⟦⟦x·rsqrt(mean x² + ε)⟧·w⟧, then ⟦· silu(z)⟧ (Qwen3_5RMSNormGated: three roundings)
//   output gate   ⟦x·⟦sigmoid(gate)⟧⟧ (torch's bf16 sigmoid and product)
//
// The delta rule takes the CPU backend's rule: the chunked form for every whole 64-token chunk
// aligned to an absolute multiple of 64, the recurrent form for every other token, each with the
// CPU's formulas and summation orders (the chunk kernel below says who sums what). Which form a
// token takes depends only on positions, and no sum depends on the batch, so a prefill split at
// multiples of 64 equals the one-shot prefill, an append of fewer than 64 tokens equals decoding
// them one at a time, and a sequence's bits never depend on the others in the batch. When no span
// of a call holds a whole aligned chunk (decode, small appends) a lighter kernel runs every token
// through the same recurrent step.
// Every per-sequence value (slot, first token, token count, first position) is read from the
// layout's device span table, so the kernels replay correctly inside a captured graph.
#include <algorithm>
#include <atomic>
#include <type_traits>

#include "backend/cuda/device_math.cuh"
#include "backend/cuda/kernels.h"

namespace kiln::cuda {
namespace {

constexpr int kElementThreads = 256;

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
// torch.nn.functional.softplus with beta 1 and threshold 20.
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

struct Span {
  int32_t slot, first_token, tokens, first_position;
};
__device__ __forceinline__ Span span_at(const int32_t* spans, int64_t index) {
  const int32_t* row = spans + 4 * index;
  return Span{row[0], row[1], row[2], row[3]};
}

template <typename T>
__global__ void split_query_gate_kernel(const T* source, T* query, T* gate, int64_t heads, int64_t head_dim) {
  follow_previous_grid();
  const int64_t count = heads * head_dim;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t head = i / head_dim, d = i % head_dim;
    query[i] = source[head * 2 * head_dim + d];
    gate[i] = source[head * 2 * head_dim + head_dim + d];
  }
}

template <typename T>
__global__ void sigmoid_gate_kernel(T* x, const T* gate, int64_t count) {
  follow_previous_grid();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] = from_float<T>(to_float(x[i]) * round_to<T>(sigmoid(to_float(gate[i]))));
}

// One thread per (span, channel): the K−1 previous inputs in registers, the tokens in order.
template <typename T, typename W, int kKernel>
__global__ void conv_silu_kernel(const T* x, const W* weight, const int32_t* spans, int64_t span_count,
                                 int64_t channels, float* conv_state, T* out) {
  follow_previous_grid();
  const int64_t channel = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t span_index = blockIdx.y;
  if (channel >= channels || span_index >= span_count) return;
  const Span span = span_at(spans, span_index);
  float taps[kKernel];
#pragma unroll
  for (int j = 0; j < kKernel; ++j) taps[j] = to_float(weight[channel * kKernel + j]);
  float* state = conv_state + static_cast<int64_t>(span.slot) * (kKernel - 1) * channels + channel;
  float window[kKernel];  // window[0..K−2]: previous inputs, oldest first
#pragma unroll
  for (int r = 0; r < kKernel - 1; ++r) window[r] = span.first_position == 0 ? 0.0f : state[r * channels];
  for (int32_t t = 0; t < span.tokens; ++t) {
    const int64_t row = static_cast<int64_t>(span.first_token) + t;
    window[kKernel - 1] = to_float(x[row * channels + channel]);
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < kKernel; ++j) acc += taps[j] * window[j];
    out[row * channels + channel] = from_float<T>(silu(acc));
#pragma unroll
    for (int j = 0; j < kKernel - 1; ++j) window[j] = window[j + 1];
  }
#pragma unroll
  for (int r = 0; r < kKernel - 1; ++r) state[r * channels] = window[r];
}

// One warp per (token, head) vector of q or k: the sum of squares over lanes in a fixed tree.
template <typename T>
__global__ void prepare_qkv_kernel(const T* qkv, int64_t tokens, int64_t key_heads, int64_t key_dim,
                                   int64_t value_width, float query_scale, float eps, float* q, float* k, float* v) {
  follow_previous_grid();
  const int64_t width = 2 * key_heads * key_dim + value_width;
  const int64_t warp = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  const int64_t vectors = tokens * 2 * key_heads;
  if (warp < vectors) {
    const int64_t token = warp / (2 * key_heads);
    const int64_t part = warp % (2 * key_heads);  // 0..Hk−1: q heads, Hk..2Hk−1: k heads
    const T* in = qkv + token * width + part * key_dim;
    float sum = 0.0f;
    for (int64_t i = lane; i < key_dim; i += 32) {
      const float value = to_float(in[i]);
      sum += value * value;
    }
    sum = warp_sum(sum);
    const bool is_query = part < key_heads;
    const float scale = is_query ? query_scale : 1.0f;
    const float inverse_norm = 1.0f / sqrtf(sum + eps);
    float* target = (is_query ? q : k) + (token * key_heads + (is_query ? part : part - key_heads)) * key_dim;
    for (int64_t i = lane; i < key_dim; i += 32) target[i] = to_float(in[i]) * inverse_norm * scale;
  }
  // The values: a widening copy, spread over the same threads.
  const int64_t values = tokens * value_width;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < values;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t token = i / value_width, d = i % value_width;
    v[i] = to_float(qkv[token * width + 2 * key_heads * key_dim + d]);
  }
}

template <typename T, typename W>
__global__ void gates_kernel(const T* b, const T* a, const W* a_log, const W* dt_bias, int64_t count, int64_t heads,
                             float* beta, float* g) {
  follow_previous_grid();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t h = i % heads;
    beta[i] = sigmoid(to_float(b[i]));
    g[i] = -expf(to_float(a_log[h])) * softplus(to_float(a[i]) + to_float(dt_bias[h]));
  }
}

// One recurrent token (spec A.6.4) for one value column of the state, held in registers:
//   S ← exp(g)·S;  m = Sᵀk;  δ = (v − m)·β;  S ← S + k δ;  o = Sᵀq   (Σ over dk ascending)
// Both delta-rule kernels take their recurrent tokens through here, so they agree bit for bit.
template <int kKeyDim>
__device__ __forceinline__ float delta_rule_token(float (&column)[kKeyDim], const float* query, const float* key,
                                                  float decay, float rate, float value) {
  float memory = 0.0f;
#pragma unroll
  for (int p = 0; p < kKeyDim; ++p) {
    column[p] *= decay;
    memory = fmaf(key[p], column[p], memory);
  }
  const float delta = (value - memory) * rate;
  float output = 0.0f;
#pragma unroll
  for (int p = 0; p < kKeyDim; ++p) {
    column[p] = fmaf(key[p], delta, column[p]);
    output = fmaf(query[p], column[p], output);
  }
  return output;
}

// Block (span, value head), thread j = value column j; kKeyDim state entries per thread (the
// model's key_dim of them real, the rest zero: see launch_gated_delta_rule). Every token
// recurrent: launched when no span holds a whole aligned chunk (decode, small appends).
template <typename T, int kKeyDim>
__global__ void delta_rule_kernel(const float* q, const float* k, const float* v, const float* g, const float* beta,
                                  const int32_t* spans, int64_t key_heads, int64_t key_dim, int64_t value_heads,
                                  int64_t value_dim, float* states, T* out) {
  follow_previous_grid();
  __shared__ float query[kKeyDim];
  __shared__ float key[kKeyDim];
  const Span span = span_at(spans, blockIdx.x);
  const int64_t value_head = blockIdx.y;
  const int64_t key_head = value_head / (value_heads / key_heads);
  const int j = threadIdx.x;
  const bool active = j < value_dim;
  float* state = states + (static_cast<int64_t>(span.slot) * value_heads + value_head) * key_dim * value_dim + j;
  float column[kKeyDim];
#pragma unroll
  for (int p = 0; p < kKeyDim; ++p)
    column[p] = (active && span.first_position != 0 && p < key_dim) ? state[p * value_dim] : 0.0f;
  for (int32_t t = 0; t < span.tokens; ++t) {
    const int64_t row = static_cast<int64_t>(span.first_token) + t;
    __syncthreads();  // the previous token's reads of query/key are done
    for (int p = threadIdx.x; p < kKeyDim; p += blockDim.x) {
      query[p] = p < key_dim ? q[(row * key_heads + key_head) * key_dim + p] : 0.0f;
      key[p] = p < key_dim ? k[(row * key_heads + key_head) * key_dim + p] : 0.0f;
    }
    __syncthreads();
    if (!active) continue;
    const float decay = expf(g[row * value_heads + value_head]);
    const float rate = beta[row * value_heads + value_head];
    const float value = v[(row * value_heads + value_head) * value_dim + j];
    out[(row * value_heads + value_head) * value_dim + j] =
        from_float<T>(delta_rule_token(column, query, key, decay, rate, value));
  }
  if (active)
#pragma unroll
    for (int p = 0; p < kKeyDim; ++p)
      if (p < key_dim) state[p * value_dim] = column[p];
}

// --- the chunked form (spec A.6.5), in the CPU backend's formulas and summation orders
// (backend/cpu/gated_delta.h): every whole chunk of kChunk tokens aligned to an absolute multiple
// of kChunk is one chunk step, every other token a recurrent step, so which tokens take which form
// depends only on positions. Block (span, value head, tile of 32 value columns), eight warps; lane
// = the column inside the tile. The state tile [dk][32] stays in shared memory for the whole span,
// and cp.async brings chunk c + 1's k, q, v, g and β into a second buffer while chunk c computes.
// Per chunk, with i, j, m local token indices:
//   Γ_ij, D_i            threads 0..63, one row i each (the exponent summed from g_i downwards)
//   Sᵀk_i, Sᵀq_i         warp w rows 8w..8w+7, over dk ascending, against the chunk-start state
//   k_i·k_j, q_i·k_j     thread t rows t%16 + 16r, columns 4(t/16)..+3, over dk ascending
//   Δ_i                  forward substitution in 16-row blocks, Δ_i's subtractions in m order
//   o_i                  warp w rows w, w+8, …: D_i·Sᵀq_i then + (q_i·k_m·Γ_im)·Δ_m, m ascending
//   S ← D_63·S + Σ_m (k_m·Γ_63,m) Δ_mᵀ   warp w rows p of its dk/8, m ascending ---
constexpr int kChunk = static_cast<int>(kGatedDeltaChunkTokens);
constexpr int kChunkTileColumns = 32;
constexpr int kChunkWarps = 8;
static_assert(kChunk == 64, "the chunk kernel's thread maps assume 64-token chunks");

// The chunk kernel's shared memory, as offsets in floats. Rows of k and q are padded by 4 floats,
// so that 16-byte reads of eight consecutive rows fall on different banks; rows of the coefficients
// too, so that 32 threads writing one row each spread over 8 banks instead of 1.
template <int kKeyDim>
struct ChunkLayout {
  static constexpr int kRowStride = kKeyDim + 4;
  static constexpr int kCoefficientStride = kChunk + 4;
  // One chunk's inputs (two buffers: the chunk computing and the next one arriving).
  static constexpr int kKeys = 0;                                          // [64][dk + 4] k (then k·Γ_63,m)
  static constexpr int kQueries = kKeys + kChunk * kRowStride;             // [64][dk + 4] q
  static constexpr int kValues = kQueries + kChunk * kRowStride;           // [64][32] v
  static constexpr int kGates = kValues + kChunk * kChunkTileColumns;      // [64] g
  static constexpr int kRates = kGates + kChunk;                           // [64] β
  static constexpr int kBuffer = kRates + kChunk;
  // The state tile and the chunk step's intermediates.
  static constexpr int kState = 2 * kBuffer;                                      // [dk][32]
  static constexpr int kKeyCoefficients = kState + kKeyDim * kChunkTileColumns;   // [64][68] Γ, then (β_i·k_i·k_j)·Γ_ij
  static constexpr int kQueryCoefficients = kKeyCoefficients + kChunk * kCoefficientStride;  // [64][68] (q_i·k_j)·Γ_ij
  static constexpr int kCorrected = kQueryCoefficients + kChunk * kCoefficientStride;       // [64][32] Δ
  static constexpr int kKeyState = kCorrected + kChunk * kChunkTileColumns;       // [64][32] Sᵀk
  static constexpr int kQueryState = kKeyState + kChunk * kChunkTileColumns;      // [64][32] Sᵀq
  static constexpr int kDecayFromStart = kQueryState + kChunk * kChunkTileColumns;  // [64] D
  static constexpr int kDecayToEnd = kDecayFromStart + kChunk;                    // [64] Γ_63,m
  static constexpr int kScratch = kDecayToEnd + kChunk;                           // [2][dk] a recurrent token's q, k
  static constexpr int kFloats = kScratch + 2 * kKeyDim;
  static constexpr int kBytes = kFloats * static_cast<int>(sizeof(float));
};
// Hopper's opt-in limit of shared memory per block is 227 KB.
static_assert(ChunkLayout<128>::kBytes <= 227 * 1024, "the dk = 128 chunk kernel must fit one block per SM");

// What every phase of the chunk kernel reads: the op's tensors and this block's place in them.
struct ChunkBlock {
  const float *q, *k, *v, *g, *beta;
  int64_t key_heads, key_dim, value_heads, value_dim, key_head, value_head;  // key_dim ≤ kKeyDim
  int64_t tile_column0, column;  // the tile's first value column, and this lane's
  int64_t first_row;             // the span's first token in the batch
  float* shared;
};

// Starts copying local tokens [begin, begin + 64) of the span into `buffer` (one commit group).
template <int kKeyDim>
__device__ void chunk_kernel_prefetch(const ChunkBlock& b, int32_t begin, float* buffer) {
  using Layout = ChunkLayout<kKeyDim>;
  constexpr int kPieces = kKeyDim / 4;  // 16-byte pieces per k or q row
  const int64_t first_row = b.first_row + begin;
  for (int index = threadIdx.x; index < kChunk * kPieces; index += blockDim.x) {
    const int i = index / kPieces, piece = index % kPieces;
    const bool real = 4 * piece < b.key_dim;  // the padding past the model's key_dim is zero-filled
    const int64_t offset = real ? ((first_row + i) * b.key_heads + b.key_head) * b.key_dim + 4 * piece : 0;
    cp_async_16(buffer + Layout::kKeys + i * Layout::kRowStride + 4 * piece, b.k + offset, real);
    cp_async_16(buffer + Layout::kQueries + i * Layout::kRowStride + 4 * piece, b.q + offset, real);
  }
  for (int index = threadIdx.x; index < kChunk * kChunkTileColumns; index += blockDim.x) {
    const int i = index / kChunkTileColumns;
    const int64_t column = b.tile_column0 + index % kChunkTileColumns;
    const bool valid = column < b.value_dim;
    const int64_t offset = valid ? ((first_row + i) * b.value_heads + b.value_head) * b.value_dim + column : 0;
    cp_async_4(buffer + Layout::kValues + index, b.v + offset, valid);
  }
  if (threadIdx.x < kChunk) {
    const int64_t offset = (first_row + threadIdx.x) * b.value_heads + b.value_head;
    cp_async_4(buffer + Layout::kGates + threadIdx.x, b.g + offset, true);
    cp_async_4(buffer + Layout::kRates + threadIdx.x, b.beta + offset, true);
  }
  cp_async_commit();
}

// Tokens [begin, end) of the span recurrently: warp 0, each lane its column of the state tile.
// Not inlined, so that its kKeyDim state registers do not crowd the chunk step's.
template <typename T, int kKeyDim>
__device__ __noinline__ void chunk_kernel_recurrent(const ChunkBlock& b, int32_t begin, int32_t end, T* out) {
  using Layout = ChunkLayout<kKeyDim>;
  if (begin >= end) return;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    float* tile = b.shared + Layout::kState;
    float* query = b.shared + Layout::kScratch;
    float* key = query + kKeyDim;
    float column[kKeyDim];
#pragma unroll
    for (int p = 0; p < kKeyDim; ++p) column[p] = tile[p * kChunkTileColumns + lane];
    const bool active = b.column < b.value_dim;
    for (int32_t t = begin; t < end; ++t) {
      const int64_t row = b.first_row + t;
      __syncwarp();
      for (int p = lane; p < kKeyDim; p += 32) {
        query[p] = p < b.key_dim ? b.q[(row * b.key_heads + b.key_head) * b.key_dim + p] : 0.0f;
        key[p] = p < b.key_dim ? b.k[(row * b.key_heads + b.key_head) * b.key_dim + p] : 0.0f;
      }
      __syncwarp();
      const float decay = expf(b.g[row * b.value_heads + b.value_head]);
      const float rate = b.beta[row * b.value_heads + b.value_head];
      const float value = active ? b.v[(row * b.value_heads + b.value_head) * b.value_dim + b.column] : 0.0f;
      const float output = delta_rule_token(column, query, key, decay, rate, value);
      if (active) out[(row * b.value_heads + b.value_head) * b.value_dim + b.column] = from_float<T>(output);
    }
#pragma unroll
    for (int p = 0; p < kKeyDim; ++p) tile[p * kChunkTileColumns + lane] = column[p];
  }
  __syncthreads();
}

// Local tokens [begin, begin + 64) of the span, already in `buffer`, as one chunk step.
template <typename T, int kKeyDim>
__device__ void chunk_kernel_step(const ChunkBlock& b, int32_t begin, const float* buffer, T* out) {
  using Layout = ChunkLayout<kKeyDim>;
  constexpr int kStride = Layout::kRowStride;
  constexpr int kCStride = Layout::kCoefficientStride;
  float* keys = const_cast<float*>(buffer) + Layout::kKeys;
  const float* queries = buffer + Layout::kQueries;
  const float* values = buffer + Layout::kValues;
  const float* gates = buffer + Layout::kGates;
  const float* rates = buffer + Layout::kRates;
  float* tile = b.shared + Layout::kState;
  float* key_coefficients = b.shared + Layout::kKeyCoefficients;
  float* query_coefficients = b.shared + Layout::kQueryCoefficients;
  float* corrected = b.shared + Layout::kCorrected;
  float* key_state = b.shared + Layout::kKeyState;
  float* query_state = b.shared + Layout::kQueryState;
  float* decay_from_start = b.shared + Layout::kDecayFromStart;
  float* decay_to_end = b.shared + Layout::kDecayToEnd;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t first_row = b.first_row + begin;
  auto row4 = [](const float* base, int row, int p) { return *reinterpret_cast<const float4*>(base + row * kStride + p); };

  // Γ (into the key-coefficient rows, which it becomes) and D.
  if (threadIdx.x < kChunk) {
    const int i = threadIdx.x;
    float exponent = 0.0f;
    key_coefficients[i * kCStride + i] = 1.0f;
    for (int j = i - 1; j >= 0; --j) {
      exponent += gates[j + 1];
      key_coefficients[i * kCStride + j] = expf(exponent);
    }
    decay_from_start[i] = expf(exponent + gates[0]);
  }
  // Sᵀk_i and Sᵀq_i against the chunk-start state.
  {
    constexpr int kRows = kChunk / kChunkWarps;
    float by_key[kRows] = {}, by_query[kRows] = {};
#pragma unroll 2
    for (int p = 0; p < kKeyDim; p += 4) {
      float entry[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) entry[e] = tile[(p + e) * kChunkTileColumns + lane];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float4 key4 = row4(keys, kRows * warp + r, p), query4 = row4(queries, kRows * warp + r, p);
        by_key[r] = fmaf(key4.x, entry[0], by_key[r]);
        by_key[r] = fmaf(key4.y, entry[1], by_key[r]);
        by_key[r] = fmaf(key4.z, entry[2], by_key[r]);
        by_key[r] = fmaf(key4.w, entry[3], by_key[r]);
        by_query[r] = fmaf(query4.x, entry[0], by_query[r]);
        by_query[r] = fmaf(query4.y, entry[1], by_query[r]);
        by_query[r] = fmaf(query4.z, entry[2], by_query[r]);
        by_query[r] = fmaf(query4.w, entry[3], by_query[r]);
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      key_state[(kRows * warp + r) * kChunkTileColumns + lane] = by_key[r];
      query_state[(kRows * warp + r) * kChunkTileColumns + lane] = by_query[r];
    }
  }
  // k_i·k_j and q_i·k_j for this thread's 4 × 4 pairs: rows a, a+16, a+32, a+48 (lanes read 16
  // consecutive rows, which fall on distinct banks), columns 4b..4b+3.
  const int pair_row = threadIdx.x % 16, pair_column = 4 * (threadIdx.x / 16);
  float key_dots[4][4] = {}, query_dots[4][4] = {};
#pragma unroll 2
  for (int p = 0; p < kKeyDim; p += 4) {
    float4 key_i[4], query_i[4], key_j[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      key_i[r] = row4(keys, pair_row + 16 * r, p);
      query_i[r] = row4(queries, pair_row + 16 * r, p);
      key_j[r] = row4(keys, pair_column + r, p);
    }
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        key_dots[r][s] = fmaf(key_i[r].x, key_j[s].x, key_dots[r][s]);
        key_dots[r][s] = fmaf(key_i[r].y, key_j[s].y, key_dots[r][s]);
        key_dots[r][s] = fmaf(key_i[r].z, key_j[s].z, key_dots[r][s]);
        key_dots[r][s] = fmaf(key_i[r].w, key_j[s].w, key_dots[r][s]);
        query_dots[r][s] = fmaf(query_i[r].x, key_j[s].x, query_dots[r][s]);
        query_dots[r][s] = fmaf(query_i[r].y, key_j[s].y, query_dots[r][s]);
        query_dots[r][s] = fmaf(query_i[r].z, key_j[s].z, query_dots[r][s]);
        query_dots[r][s] = fmaf(query_i[r].w, key_j[s].w, query_dots[r][s]);
      }
  }
  __syncthreads();

  // The coefficients from Γ (pairs j ≤ i), and k·Γ_63,m in place of k (only the state update reads
  // k from here on).
#pragma unroll
  for (int r = 0; r < 4; ++r)
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const int i = pair_row + 16 * r, j = pair_column + s;
      if (j <= i) {
        const float decay = key_coefficients[i * kCStride + j];
        key_coefficients[i * kCStride + j] = rates[i] * key_dots[r][s] * decay;
        query_coefficients[i * kCStride + j] = query_dots[r][s] * decay;
        if (i == kChunk - 1) decay_to_end[j] = decay;
      }
    }
  // The substitution's right-hand sides β_i·(v_i − D_i·Sᵀk_i), in place of Δ.
  for (int i = warp; i < kChunk; i += kChunkWarps)
    corrected[i * kChunkTileColumns + lane] =
        rates[i] * (values[i * kChunkTileColumns + lane] - decay_from_start[i] * key_state[i * kChunkTileColumns + lane]);
  __syncthreads();
  for (int index = threadIdx.x; index < kChunk * kKeyDim; index += blockDim.x) {
    const int m = index / kKeyDim, p = index % kKeyDim;
    keys[m * kStride + p] *= decay_to_end[m];
  }

  // Δ by forward substitution in blocks of 16 rows, each row's subtractions in m order: warp 0
  // solves a block's rows among themselves, then every warp subtracts that block's Δ from the
  // rows below it (rows w, w + 8, …).
  constexpr int kBlock = 16;
  for (int block = 0; block < kChunk; block += kBlock) {
    if (warp == 0) {
      float delta[kBlock];
#pragma unroll
      for (int r = 0; r < kBlock; ++r) delta[r] = corrected[(block + r) * kChunkTileColumns + lane];
#pragma unroll
      for (int m = 0; m < kBlock; ++m)
#pragma unroll
        for (int r = m + 1; r < kBlock; ++r)
          delta[r] -= key_coefficients[(block + r) * kCStride + block + m] * delta[m];
#pragma unroll
      for (int r = 0; r < kBlock; ++r) corrected[(block + r) * kChunkTileColumns + lane] = delta[r];
    }
    __syncthreads();
    for (int i = block + kBlock + warp; i < kChunk; i += kChunkWarps) {
      float delta = corrected[i * kChunkTileColumns + lane];
#pragma unroll
      for (int m = 0; m < kBlock; ++m)
        delta -= key_coefficients[i * kCStride + block + m] * corrected[(block + m) * kChunkTileColumns + lane];
      corrected[i * kChunkTileColumns + lane] = delta;
    }
    __syncthreads();
  }

  // The outputs (rows w, w + 8, …) and the chunk-end state (rows p of this warp's share).
  {
    constexpr int kRows = kChunk / kChunkWarps;
    float output[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int i = warp + kChunkWarps * r;
      output[r] = decay_from_start[i] * query_state[i * kChunkTileColumns + lane];
    }
    for (int m = 0; m < kChunk; m += 4) {
      float delta[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) delta[e] = corrected[(m + e) * kChunkTileColumns + lane];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int i = warp + kChunkWarps * r;
        const float4 coefficient = *reinterpret_cast<const float4*>(query_coefficients + i * kCStride + m);
        if (m + 0 <= i) output[r] += coefficient.x * delta[0];
        if (m + 1 <= i) output[r] += coefficient.y * delta[1];
        if (m + 2 <= i) output[r] += coefficient.z * delta[2];
        if (m + 3 <= i) output[r] += coefficient.w * delta[3];
      }
    }
    if (b.column < b.value_dim)
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int64_t row = first_row + warp + kChunkWarps * r;
        out[(row * b.value_heads + b.value_head) * b.value_dim + b.column] = from_float<T>(output[r]);
      }
  }
  {
    // At least 4 state rows per warp (one float4 of k): with dk = 16 only warps 0..3 take part.
    constexpr int kRows = kKeyDim / kChunkWarps >= 4 ? kKeyDim / kChunkWarps : 4;
    const int p0 = warp * kRows;
    if (p0 < kKeyDim) {
      const float decay_whole = decay_from_start[kChunk - 1];
      float entry[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) entry[r] = tile[(p0 + r) * kChunkTileColumns + lane] * decay_whole;
      for (int m = 0; m < kChunk; ++m) {
        const float delta = corrected[m * kChunkTileColumns + lane];
#pragma unroll
        for (int r = 0; r < kRows; r += 4) {
          const float4 scaled = row4(keys, m, p0 + r);
          entry[r + 0] += scaled.x * delta;
          entry[r + 1] += scaled.y * delta;
          entry[r + 2] += scaled.z * delta;
          entry[r + 3] += scaled.w * delta;
        }
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) tile[(p0 + r) * kChunkTileColumns + lane] = entry[r];
    }
  }
  __syncthreads();
}

template <typename T, int kKeyDim>
__global__ void __launch_bounds__(kChunkWarps * 32)
    delta_rule_chunked_kernel(const float* q, const float* k, const float* v, const float* g, const float* beta,
                              const int32_t* spans, int64_t key_heads, int64_t key_dim, int64_t value_heads,
                              int64_t value_dim, float* states, T* out) {
  follow_previous_grid();
  extern __shared__ float4 shared_words[];
  using Layout = ChunkLayout<kKeyDim>;
  const Span span = span_at(spans, blockIdx.x);
  ChunkBlock b;
  b.q = q;
  b.k = k;
  b.v = v;
  b.g = g;
  b.beta = beta;
  b.key_heads = key_heads;
  b.key_dim = key_dim;
  b.value_heads = value_heads;
  b.value_dim = value_dim;
  b.value_head = blockIdx.y;
  b.key_head = b.value_head / (value_heads / key_heads);
  b.tile_column0 = static_cast<int64_t>(blockIdx.z) * kChunkTileColumns;
  b.column = b.tile_column0 + threadIdx.x % 32;
  b.first_row = span.first_token;
  b.shared = reinterpret_cast<float*>(shared_words);
  auto buffer = [&](int32_t c) { return b.shared + (c % 2) * Layout::kBuffer; };

  // Recurrent up to the first absolute chunk boundary, whole aligned chunks, recurrent tail.
  const int32_t to_boundary = (kChunk - span.first_position % kChunk) % kChunk;
  const int32_t head = min(span.tokens, to_boundary);
  const int32_t chunks = (span.tokens - head) / kChunk;
  if (chunks > 0) chunk_kernel_prefetch<kKeyDim>(b, head, buffer(0));

  float* tile = b.shared + Layout::kState;
  float* state = states + (static_cast<int64_t>(span.slot) * value_heads + b.value_head) * key_dim * value_dim;
  for (int index = threadIdx.x; index < kKeyDim * kChunkTileColumns; index += blockDim.x) {
    const int64_t p = index / kChunkTileColumns, column = b.tile_column0 + index % kChunkTileColumns;
    tile[index] = (column < value_dim && p < key_dim && span.first_position != 0) ? state[p * value_dim + column] : 0.0f;
  }
  __syncthreads();

  chunk_kernel_recurrent<T, kKeyDim>(b, 0, head, out);
  for (int32_t c = 0; c < chunks; ++c) {
    if (c + 1 < chunks) {
      chunk_kernel_prefetch<kKeyDim>(b, head + (c + 1) * kChunk, buffer(c + 1));
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    chunk_kernel_step<T, kKeyDim>(b, head + c * kChunk, buffer(c), out);
  }
  chunk_kernel_recurrent<T, kKeyDim>(b, head + chunks * kChunk, span.tokens, out);

  for (int index = threadIdx.x; index < kKeyDim * kChunkTileColumns; index += blockDim.x) {
    const int64_t p = index / kChunkTileColumns, column = b.tile_column0 + index % kChunkTileColumns;
    if (column < value_dim && p < key_dim) state[p * value_dim + column] = tile[index];
  }
}

// One warp per row of `width`.
template <typename T, typename W>
__global__ void rms_norm_gated_kernel(const T* x, const T* z, const W* weight, int64_t rows, int64_t width, float eps,
                                      T* out) {
  follow_previous_grid();
  const int64_t row = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const T* in = x + row * width;
  float sum = 0.0f;
  for (int64_t i = lane; i < width; i += 32) {
    const float value = to_float(in[i]);
    sum += value * value;
  }
  sum = warp_sum(sum);
  const float inverse_rms = 1.0f / sqrtf(sum / static_cast<float>(width) + eps);
  for (int64_t i = lane; i < width; i += 32) {
    const float normalised = round_to<T>(round_to<T>(to_float(in[i]) * inverse_rms) * to_float(weight[i]));
    out[row * width + i] = from_float<T>(normalised * silu(to_float(z[row * width + i])));
  }
}

unsigned grid_for(int64_t items) {
  const int64_t blocks = (items + kElementThreads - 1) / kElementThreads;
  return static_cast<unsigned>(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
}

}  // namespace

cudaError_t launch_split_query_gate(const void* source, void* query, void* gate, int64_t heads, int64_t head_dim,
                                    DType dtype, cudaStream_t stream) {
  if (heads * head_dim == 0) return cudaSuccess;
  const bool dispatched = dispatch_activation(dtype, [&](auto tag) {
    using T = decltype(tag);
    launch_after_previous(&split_query_gate_kernel<T>, grid_for(heads * head_dim), kElementThreads, 0, stream,
                          static_cast<const T*>(source), static_cast<T*>(query), static_cast<T*>(gate), heads,
                          head_dim);
  });
  return dispatched ? cudaGetLastError() : cudaErrorInvalidValue;
}

cudaError_t launch_sigmoid_gate(void* x, const void* gate, int64_t count, DType dtype, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const bool dispatched = dispatch_activation(dtype, [&](auto tag) {
    using T = decltype(tag);
    launch_after_previous(&sigmoid_gate_kernel<T>, grid_for(count), kElementThreads, 0, stream, static_cast<T*>(x),
                          static_cast<const T*>(gate), count);
  });
  return dispatched ? cudaGetLastError() : cudaErrorInvalidValue;
}

cudaError_t launch_causal_conv1d_silu(const ConvArgs& args, cudaStream_t stream) {
  if (args.span_count == 0 || args.channels == 0) return cudaSuccess;
  if (args.kernel != kGatedDeltaConvKernel) return cudaErrorInvalidValue;
  const dim3 grid(blocks_for(args.channels, kElementThreads), static_cast<unsigned>(args.span_count));
  bool dispatched = false;
  dispatch_activation(args.dtype, [&](auto tag) {
    using T = decltype(tag);
    dispatched = dispatch_float(args.weight_dtype, [&](auto weight_tag) {
      using W = decltype(weight_tag);
      launch_after_previous(&conv_silu_kernel<T, W, kGatedDeltaConvKernel>, grid, kElementThreads, 0, stream,
                            static_cast<const T*>(args.x), static_cast<const W*>(args.weight), args.spans,
                            args.span_count, args.channels, args.conv_state, static_cast<T*>(args.out));
    });
  });
  return dispatched ? cudaGetLastError() : cudaErrorInvalidValue;
}

cudaError_t launch_gated_delta_prepare_qkv(const void* qkv, DType dtype, int64_t tokens, int64_t key_heads,
                                           int64_t key_dim, int64_t value_width, float query_scale, float eps,
                                           float* q, float* k, float* v, cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  const int64_t threads = std::max<int64_t>(tokens * 2 * key_heads * 32, tokens * value_width);
  const bool dispatched = dispatch_activation(dtype, [&](auto tag) {
    using T = decltype(tag);
    launch_after_previous(&prepare_qkv_kernel<T>, blocks_for(threads, kElementThreads), kElementThreads, 0, stream,
                          static_cast<const T*>(qkv), tokens, key_heads, key_dim, value_width, query_scale, eps, q, k,
                          v);
  });
  return dispatched ? cudaGetLastError() : cudaErrorInvalidValue;
}

cudaError_t launch_gated_delta_gates(const void* b, const void* a, DType dtype, const void* a_log,
                                     const void* dt_bias, DType weight_dtype, int64_t count, int64_t heads,
                                     float* beta, float* g, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  bool dispatched = false;
  dispatch_activation(dtype, [&](auto tag) {
    using T = decltype(tag);
    dispatched = dispatch_float(weight_dtype, [&](auto weight_tag) {
      using W = decltype(weight_tag);
      launch_after_previous(&gates_kernel<T, W>, grid_for(count), kElementThreads, 0, stream, static_cast<const T*>(b),
                            static_cast<const T*>(a), static_cast<const W*>(a_log), static_cast<const W*>(dt_bias),
                            count, heads, beta, g);
    });
  });
  return dispatched ? cudaGetLastError() : cudaErrorInvalidValue;
}

cudaError_t launch_gated_delta_rule(const DeltaRuleArgs& args, cudaStream_t stream) {
  if (args.span_count == 0) return cudaSuccess;
  if (!args.whole_chunks && args.value_dim > kGatedDeltaMaxValueDim) return cudaErrorInvalidValue;
  cudaError_t status = cudaErrorInvalidValue;
  dispatch_activation(args.dtype, [&](auto tag) {
    using T = decltype(tag);
    auto run = [&](auto key_dim_tag) {
      constexpr int kKeyDim = decltype(key_dim_tag)::value;
      if (args.whole_chunks) {
        auto* kernel = &delta_rule_chunked_kernel<T, kKeyDim>;
        static std::atomic<uint64_t> opted_in{0};
        status = allow_dynamic_shared(kernel, ChunkLayout<kKeyDim>::kBytes, opted_in);
        if (status != cudaSuccess) return;
        const dim3 grid(static_cast<unsigned>(args.span_count), static_cast<unsigned>(args.value_heads),
                        blocks_for(args.value_dim, kChunkTileColumns));
        status = launch_after_previous(kernel, grid, kChunkWarps * 32, ChunkLayout<kKeyDim>::kBytes, stream, args.q,
                                       args.k, args.v, args.g, args.beta, args.spans, args.key_heads, args.key_dim,
                                       args.value_heads, args.value_dim, args.states, static_cast<T*>(args.out));
      } else {
        const dim3 grid(static_cast<unsigned>(args.span_count), static_cast<unsigned>(args.value_heads));
        const int threads = static_cast<int>((args.value_dim + 31) / 32 * 32);
        status = launch_after_previous(&delta_rule_kernel<T, kKeyDim>, grid, threads, 0, stream, args.q, args.k,
                                       args.v, args.g, args.beta, args.spans, args.key_heads, args.key_dim,
                                       args.value_heads, args.value_dim, args.states, static_cast<T*>(args.out));
      }
    };
    // Built for key_dim 16, 32, 64 and 128 (the published models' 128 unpadded); any other multiple
    // of 8 runs on the next one up, its q, k and state rows zero-padded in registers and shared
    // memory: zero entries stay zero through the update and add nothing to any dot product.
    if (!gated_delta_supports_key_dim(args.key_dim)) return;
    if (args.key_dim <= 16)
      run(std::integral_constant<int, 16>{});
    else if (args.key_dim <= 32)
      run(std::integral_constant<int, 32>{});
    else if (args.key_dim <= 64)
      run(std::integral_constant<int, 64>{});
    else
      run(std::integral_constant<int, 128>{});
  });
  return status == cudaSuccess ? cudaGetLastError() : status;
}

cudaError_t launch_rms_norm_gated(const void* x, const void* z, DType dtype, const void* weight, DType weight_dtype,
                                  int64_t rows, int64_t width, float eps, void* out, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  bool dispatched = false;
  dispatch_activation(dtype, [&](auto tag) {
    using T = decltype(tag);
    dispatched = dispatch_float(weight_dtype, [&](auto weight_tag) {
      using W = decltype(weight_tag);
      launch_after_previous(&rms_norm_gated_kernel<T, W>, blocks_for(rows * 32, kElementThreads), kElementThreads, 0,
                            stream, static_cast<const T*>(x), static_cast<const T*>(z), static_cast<const W*>(weight),
                            rows, width, eps, static_cast<T*>(out));
    });
  });
  return dispatched ? cudaGetLastError() : cudaErrorInvalidValue;
}

}  // namespace kiln::cuda
