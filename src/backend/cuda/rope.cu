// Rotate-half RoPE in place (architectures.md A.5.3 / C): for i < R/2, with φ = f32(position) ·
// inv_freq[i] (one f32 multiply, as transformers' f32 outer product), c = ⟦cos φ⟧, s = ⟦sin φ⟧:
//   x'_i       = ⟦⟦x_i · c⟧ − ⟦x_{i+R/2} · s⟧⟧
//   x'_{i+R/2} = ⟦⟦x_{i+R/2} · c⟧ + ⟦x_i · s⟧⟧
// where ⟦·⟧ rounds to the activation dtype (transformers casts cos/sin to bf16 and rotates in bf16
// elementwise ops); for f32 activations every ⟦·⟧ is the identity. cosf/sinf are the accurate
// (non-intrinsic) functions. Dims R..head_dim-1 are left unchanged.
#include "backend/cuda/device_math.cuh"
#include "backend/cuda/kernels.h"

namespace kiln::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kRopeDecodeMaxTokens = 16;  // at most this many tokens: one head per block

// ⟦cos φ⟧ and ⟦sin φ⟧ of pair i at `position`, as the file comment says.
template <typename T>
struct RopeFactors {
  float c, s;
  __device__ __forceinline__ RopeFactors(int32_t position, float inv_freq) {
    float sine, cosine;
    sincosf(static_cast<float>(position) * inv_freq, &sine, &cosine);
    c = round_to<T>(cosine);
    s = round_to<T>(sine);
  }
};

// Rotates the pair (i, i + R/2) of one head (R/2 = half_rotary, i = pair) as the file comment says;
// the rotated values are written to `head` and, when given, to `copy` (the KV-cache row).
template <typename T>
__device__ __forceinline__ void rotate_pair(T* head, T* copy, int64_t pair, int64_t half_rotary,
                                            const RopeFactors<T>& factors) {
  const float c = factors.c, s = factors.s;
  const float first = to_float(head[pair]);
  const float second = to_float(head[pair + half_rotary]);
  const T rotated_first = from_float<T>(round_to<T>(first * c) - round_to<T>(second * s));
  const T rotated_second = from_float<T>(round_to<T>(second * c) + round_to<T>(first * s));
  head[pair] = rotated_first;
  head[pair + half_rotary] = rotated_second;
  if (copy) {
    copy[pair] = rotated_first;
    copy[pair + half_rotary] = rotated_second;
  }
}

template <typename T>
__global__ void rope_kernel(T* x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t half_rotary,
                            const int32_t* positions, const float* inv_freq) {
  follow_previous_grid();
  const int64_t pairs = tokens * heads * half_rotary;
  for (int64_t index = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; index < pairs;
       index += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t head_row = index / half_rotary;  // token · heads + head
    const int64_t pair = index % half_rotary;
    rotate_pair<T>(x + head_row * head_dim, static_cast<T*>(nullptr), pair, half_rotary,
                   RopeFactors<T>(positions[head_row / heads], inv_freq[pair]));
  }
}

// A block per token and blockDim.y heads (thread row y takes head blockIdx.y · blockDim.y + y),
// query heads first: a query head is rotated in place; a key head is rotated in place and into the
// cache row (slot, position), whose other dims and the head's value row are copied.
// Positions, slots and inverse frequencies are step inputs that no kernel writes (uploaded before
// the step), so each thread reads them and computes its first pair's factors before waiting for
// the previous kernel (device_math.cuh): that latency overlaps the kernel before it.
template <typename T>
__global__ void rope_kv_write_kernel(T* q, T* k, const T* v, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                     int64_t half_rotary, const int32_t* positions, const int32_t* slots,
                                     const float* inv_freq, int64_t capacity, T* k_cache, T* v_cache) {
  const int64_t token = blockIdx.x;
  const int64_t head = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y;
  const bool has_head = head < q_heads + kv_heads;
  const int32_t position = has_head ? positions[token] : 0;
  const int64_t first_pair = threadIdx.x;
  const RopeFactors<T> first_factors(position, has_head && first_pair < half_rotary ? inv_freq[first_pair] : 0.0f);
  auto factors = [&](int64_t pair) {
    return pair == first_pair ? first_factors : RopeFactors<T>(position, inv_freq[pair]);
  };
  follow_previous_grid();
  if (!has_head) return;
  if (head < q_heads) {
    T* q_head = q + (token * q_heads + head) * head_dim;
    for (int64_t pair = threadIdx.x; pair < half_rotary; pair += blockDim.x)
      rotate_pair<T>(q_head, static_cast<T*>(nullptr), pair, half_rotary, factors(pair));
    return;
  }
  const int64_t kv_head = head - q_heads;
  const int64_t row_elements = kv_heads * head_dim;
  const int64_t cache_offset =
      (static_cast<int64_t>(slots[token]) * capacity + position) * row_elements + kv_head * head_dim;
  T* k_head = k + token * row_elements + kv_head * head_dim;
  const T* v_head = v + token * row_elements + kv_head * head_dim;
  for (int64_t dim = threadIdx.x; dim < head_dim; dim += blockDim.x) {
    if (dim < half_rotary)
      rotate_pair<T>(k_head, k_cache + cache_offset, dim, half_rotary, factors(dim));
    else if (dim >= 2 * half_rotary)
      k_cache[cache_offset + dim] = k_head[dim];  // past the rotary dims (the pair's owner wrote the others)
    v_cache[cache_offset + dim] = v_head[dim];
  }
}

}  // namespace

cudaError_t launch_rope(void* x, DType dtype, int64_t tokens, int64_t heads, int64_t head_dim, int64_t rotary_dim,
                        const int32_t* positions, const float* inv_freq, cudaStream_t stream) {
  const int64_t pairs = tokens * heads * (rotary_dim / 2);
  if (pairs == 0) return cudaSuccess;
  const int64_t blocks = (pairs + kThreads - 1) / kThreads;
  const unsigned grid = static_cast<unsigned>(blocks < 65536 ? blocks : 65536);
  const bool dispatched = dispatch_activation(dtype, [&](auto tag) {
    using T = decltype(tag);
    launch_after_previous(&rope_kernel<T>, grid, kThreads, 0, stream, static_cast<T*>(x), tokens, heads, head_dim,
                          rotary_dim / 2, positions, inv_freq);
  });
  return dispatched ? cudaGetLastError() : cudaErrorInvalidValue;
}

cudaError_t launch_rope_kv_write(const RopeKvWriteArgs& args, cudaStream_t stream) {
  if (args.tokens == 0) return cudaSuccess;
  constexpr int kHeadThreads = 64;
  // A decode step's few tokens spread over the device by head, one head per block. A prefill has
  // tokens enough: eight heads per block there (one per block made ~330,000 blocks of 64 threads
  // for 8,192 tokens of Llama-3-8B, whose scheduling, not their memory traffic, set the time:
  // ~400 µs a layer on the H200 under ncu, where the ~200 MB it moves take ~50 µs; docs/perf.md).
  const int64_t heads = args.q_heads + args.kv_heads;
  const unsigned heads_per_block = args.tokens > kRopeDecodeMaxTokens ? 8 : 1;
  const dim3 grid(static_cast<unsigned>(args.tokens), blocks_for(heads, static_cast<int>(heads_per_block)));
  const dim3 block(kHeadThreads, heads_per_block);
  const bool dispatched = dispatch_activation(args.dtype, [&](auto tag) {
    using T = decltype(tag);
    launch_after_previous(&rope_kv_write_kernel<T>, grid, block, 0, stream, static_cast<T*>(args.q),
                          static_cast<T*>(args.k), static_cast<const T*>(args.v), args.q_heads, args.kv_heads,
                          args.head_dim, args.rotary_dim / 2, args.positions, args.slots, args.inv_freq, args.capacity,
                          static_cast<T*>(args.k_cache), static_cast<T*>(args.v_cache));
  });
  return dispatched ? cudaGetLastError() : cudaErrorInvalidValue;
}

}  // namespace kiln::cuda
