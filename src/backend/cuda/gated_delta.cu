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
// The delta rule runs in its recurrent form for every token, one block per (sequence, value head)
// with one thread per value column holding that column of the state in registers; a token's
// reductions over dk run in ascending order inside one thread. So a token's result depends on the
// tokens before it and never on the batch, the chunking of a prefill or the size of an append:
// one-shot, chunked and token-by-token runs are bit-identical. (The CPU's chunked form for aligned
// 64-token chunks is not implemented here yet: prefill pays one sequential step per token.)
// Every per-sequence value (slot, first token, token count, first position) is read from the
// layout's device span table, so the kernels replay correctly inside a captured graph.
#include <algorithm>

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

// Block (span, value head), thread j = value column j; kKeyDim state entries per thread.
template <typename T, int kKeyDim>
__global__ void delta_rule_kernel(const float* q, const float* k, const float* v, const float* g, const float* beta,
                                  const int32_t* spans, int64_t key_heads, int64_t value_heads, int64_t value_dim,
                                  float* states, T* out) {
  follow_previous_grid();
  __shared__ float query[kKeyDim];
  __shared__ float key[kKeyDim];
  const Span span = span_at(spans, blockIdx.x);
  const int64_t value_head = blockIdx.y;
  const int64_t key_head = value_head / (value_heads / key_heads);
  const int j = threadIdx.x;
  const bool active = j < value_dim;
  float* state = states + (static_cast<int64_t>(span.slot) * value_heads + value_head) * kKeyDim * value_dim + j;
  float column[kKeyDim];
#pragma unroll
  for (int p = 0; p < kKeyDim; ++p) column[p] = (active && span.first_position != 0) ? state[p * value_dim] : 0.0f;
  for (int32_t t = 0; t < span.tokens; ++t) {
    const int64_t row = static_cast<int64_t>(span.first_token) + t;
    __syncthreads();  // the previous token's reads of query/key are done
    for (int p = threadIdx.x; p < kKeyDim; p += blockDim.x) {
      query[p] = q[(row * key_heads + key_head) * kKeyDim + p];
      key[p] = k[(row * key_heads + key_head) * kKeyDim + p];
    }
    __syncthreads();
    if (!active) continue;
    const float decay = expf(g[row * value_heads + value_head]);
    const float rate = beta[row * value_heads + value_head];
    float memory = 0.0f;
#pragma unroll
    for (int p = 0; p < kKeyDim; ++p) {
      column[p] *= decay;
      memory += key[p] * column[p];
    }
    const float delta = (v[(row * value_heads + value_head) * value_dim + j] - memory) * rate;
    float output = 0.0f;
#pragma unroll
    for (int p = 0; p < kKeyDim; ++p) {
      column[p] += key[p] * delta;
      output += query[p] * column[p];
    }
    out[(row * value_heads + value_head) * value_dim + j] = from_float<T>(output);
  }
  if (active)
#pragma unroll
    for (int p = 0; p < kKeyDim; ++p) state[p * value_dim] = column[p];
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
  if (args.value_dim > kGatedDeltaMaxValueDim) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(args.span_count), static_cast<unsigned>(args.value_heads));
  const int threads = static_cast<int>((args.value_dim + 31) / 32 * 32);
  bool dispatched = false;
  dispatch_activation(args.dtype, [&](auto tag) {
    using T = decltype(tag);
    auto run = [&](auto kernel) {
      launch_after_previous(kernel, grid, threads, 0, stream, args.q, args.k, args.v, args.g, args.beta, args.spans,
                            args.key_heads, args.value_heads, args.value_dim, args.states, static_cast<T*>(args.out));
      dispatched = true;
    };
    switch (args.key_dim) {
      case 32: run(delta_rule_kernel<T, 32>); break;
      case 64: run(delta_rule_kernel<T, 64>); break;
      case 128: run(delta_rule_kernel<T, 128>); break;
      default: break;
    }
  });
  return dispatched ? cudaGetLastError() : cudaErrorInvalidValue;
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
