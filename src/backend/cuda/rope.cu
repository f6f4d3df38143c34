// Rotate-half RoPE in place (architectures.md A.5.3 / C): for i < R/2, with φ = f32(position) ·
// inv_freq[i] (one f32 multiply, as transformers' f32 outer product), c = ⟦cos φ⟧, s = ⟦sin φ⟧:
//   x'_i       = ⟦⟦x_i · c⟧ − ⟦x_{i+R/2} · s⟧⟧
//   x'_{i+R/2} = ⟦⟦x_{i+R/2} · c⟧ + ⟦x_i · s⟧⟧
// where ⟦·⟧ rounds to the activation dtype (transformers casts cos/sin to bf16 and rotates in bf16
// elementwise ops); for f32 activations every ⟦·⟧ is the identity, and each product and the sum
// are rounded to f32 separately (no fma), as torch's elementwise ops do. cosf/sinf are the
// accurate (non-intrinsic) functions. Dims R..head_dim-1 are left unchanged.
#include "backend/cuda/device_math.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/rms_math.cuh"

namespace kiln::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kRopeDecodeMaxTokens = 16;  // at most this many tokens: one head per block
constexpr int kRopeHeadThreads = 64;           // threads per head (a thread row of the block)
constexpr int kRopeHeadsPerBlock = 8;          // heads per block above kRopeDecodeMaxTokens

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

// Rotates the pair (first, second) = (x_i, x_{i+R/2}) of one head (R/2 = half_rotary, i = pair)
// as the file comment says; the rotated values are written to `head` and, when given, to `copy`
// (the KV-cache row).
template <typename T>
__device__ __forceinline__ void write_rotated_pair(float first, float second, T* head, T* copy, int64_t pair,
                                                   int64_t half_rotary, const RopeFactors<T>& factors) {
  // __fmul_rn: each product rounded, never contracted into an fma with the sum (for f32, where
  // round_to is the identity, the compiler may otherwise pick either product to keep exact, and
  // its pick can differ between kernels that inline this).
  const float c = factors.c, s = factors.s;
  const T rotated_first = from_float<T>(round_to<T>(__fmul_rn(first, c)) - round_to<T>(__fmul_rn(second, s)));
  const T rotated_second = from_float<T>(round_to<T>(__fmul_rn(second, c)) + round_to<T>(__fmul_rn(first, s)));
  head[pair] = rotated_first;
  head[pair + half_rotary] = rotated_second;
  if (copy) {
    copy[pair] = rotated_first;
    copy[pair + half_rotary] = rotated_second;
  }
}

template <typename T>
__device__ __forceinline__ void rotate_pair(T* head, int64_t pair, int64_t half_rotary, const RopeFactors<T>& factors) {
  write_rotated_pair<T>(to_float(head[pair]), to_float(head[pair + half_rotary]), head, static_cast<T*>(nullptr), pair,
                        half_rotary, factors);
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
    rotate_pair<T>(x + head_row * head_dim, pair, half_rotary, RopeFactors<T>(positions[head_row / heads], inv_freq[pair]));
  }
}

// A block per token and blockDim.y heads (thread row y takes head blockIdx.y · blockDim.y + y),
// query heads first: a query head is rotated in place; a key head is rotated in place and into the
// cache's pool row of (slot, position), whose other dims and the head's value row are copied.
// With kHeadNorms, each head is first normalised in place as rms_norm(q, q_norm) and
// rms_norm(k, k_norm) do (norm.cu's warp rows, head_dim ≤ kNormWarpRowMaxWidth): the row's first
// warp reduces the sum of squares in that order, and every element is rounded to T after the norm,
// as the separate op stores it, before it is rotated.
// Positions, slots and inverse frequencies are step inputs that no kernel writes (uploaded before
// the step), so each thread reads them and computes its first pair's factors before waiting for
// the previous kernel (device_math.cuh): that latency overlaps the kernel before it. The block
// table, read once per key head, is such an input too (kv_pool_row).
template <typename T, typename W, bool kHeadNorms>
__global__ void rope_kv_write_kernel(T* q, T* k, const T* v, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                     int64_t half_rotary, const int32_t* positions, const int32_t* slots,
                                     const float* inv_freq, KvBlockTable table, T* k_cache, T* v_cache,
                                     const W* q_norm, const W* k_norm, float norm_eps, bool norm_zero_centred) {
  const int64_t token = blockIdx.x;
  const int64_t head = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y;
  const bool has_head = head < q_heads + kv_heads;
  const int32_t position = has_head ? positions[token] : 0;
  const int64_t first_pair = threadIdx.x;
  const RopeFactors<T> first_factors(position, has_head && first_pair < half_rotary ? inv_freq[first_pair] : 0.0f);
  auto factors = [&](int64_t pair) {
    return pair == first_pair ? first_factors : RopeFactors<T>(position, inv_freq[pair]);
  };
  const bool query = head < q_heads;
  const int64_t kv_head = head - q_heads;
  const int64_t row_elements = kv_heads * head_dim;
  T* row = query ? q + (token * q_heads + head) * head_dim : k + token * row_elements + kv_head * head_dim;
  const W* gain = query ? q_norm : k_norm;
  follow_previous_grid();
  // The value of element d going into the rotation: x_d, or ⟦normalise(x_d)⟧ with the head's inv.
  float inv = 1.0f;
  if constexpr (kHeadNorms) {
    __shared__ float row_inv[kRopeHeadsPerBlock];
    if (has_head && threadIdx.x < 32) {
      float partial = 0.0f;
      for (int64_t dim = threadIdx.x; dim < head_dim; dim += 32) {
        const float value = to_float(row[dim]);
        partial = fmaf(value, value, partial);
      }
      const float total = warp_sum(partial);
      if (threadIdx.x == 0) row_inv[threadIdx.y] = rms_inverse(total, head_dim, norm_eps);
    }
    __syncthreads();  // every thread reads its elements only after the warp above has read them all
    inv = row_inv[threadIdx.y];
  }
  auto input = [&](int64_t dim) {
    const float value = to_float(row[dim]);
    if constexpr (kHeadNorms) return round_to<T>(normalise<T>(value, inv, to_float(gain[dim]), norm_zero_centred));
    return value;
  };
  if (!has_head) return;
  if (query) {
    for (int64_t pair = threadIdx.x; pair < half_rotary; pair += blockDim.x)
      write_rotated_pair<T>(input(pair), input(pair + half_rotary), row, static_cast<T*>(nullptr), pair, half_rotary,
                            factors(pair));
    if constexpr (kHeadNorms)
      for (int64_t dim = 2 * half_rotary + threadIdx.x; dim < head_dim; dim += blockDim.x)
        row[dim] = from_float<T>(input(dim));
    return;
  }
  const int64_t cache_offset = kv_pool_row(table, slots[token], position) * row_elements + kv_head * head_dim;
  const T* v_head = v + token * row_elements + kv_head * head_dim;
  for (int64_t dim = threadIdx.x; dim < head_dim; dim += blockDim.x) {
    if (dim < half_rotary) {
      write_rotated_pair<T>(input(dim), input(dim + half_rotary), row, k_cache + cache_offset, dim, half_rotary,
                            factors(dim));
    } else if (dim >= 2 * half_rotary) {  // past the rotary dims (the pair's owner wrote the others)
      if constexpr (kHeadNorms) {
        row[dim] = from_float<T>(input(dim));
      }
      k_cache[cache_offset + dim] = row[dim];
    }
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
  const bool head_norms = args.q_norm != nullptr;
  if (head_norms != (args.k_norm != nullptr) || (head_norms && args.head_dim > kNormWarpRowMaxWidth))
    return cudaErrorInvalidValue;
  // A decode step's few tokens spread over the device by head, one head per block. A prefill has
  // tokens enough: kRopeHeadsPerBlock heads per block there (one per block made ~330,000 blocks of
  // 64 threads for 8,192 tokens of Llama-3-8B, whose scheduling, not their memory traffic, set the
  // time: ~400 µs a layer on the H200 under ncu, where the ~200 MB it moves take ~50 µs; docs/perf.md).
  const int64_t heads = args.q_heads + args.kv_heads;
  const unsigned heads_per_block = args.tokens > kRopeDecodeMaxTokens ? kRopeHeadsPerBlock : 1;
  const dim3 grid(static_cast<unsigned>(args.tokens), blocks_for(heads, static_cast<int>(heads_per_block)));
  const dim3 block(kRopeHeadThreads, heads_per_block);
  bool dispatched = false;
  dispatch_activation(args.dtype, [&](auto tag) {
    using T = decltype(tag);
    auto launch = [&](auto* kernel, const auto* q_norm, const auto* k_norm) {
      launch_after_previous(kernel, grid, block, 0, stream, static_cast<T*>(args.q), static_cast<T*>(args.k),
                            static_cast<const T*>(args.v), args.q_heads, args.kv_heads, args.head_dim,
                            args.rotary_dim / 2, args.positions, args.slots, args.inv_freq, args.table,
                            static_cast<T*>(args.k_cache), static_cast<T*>(args.v_cache), q_norm, k_norm,
                            args.norm_eps, args.norm_zero_centred);
    };
    if (!head_norms) {
      launch(&rope_kv_write_kernel<T, T, false>, static_cast<const T*>(nullptr), static_cast<const T*>(nullptr));
      dispatched = true;
      return;
    }
    dispatched = dispatch_float(args.norm_dtype, [&](auto weight_tag) {
      using W = decltype(weight_tag);
      launch(&rope_kv_write_kernel<T, W, true>, static_cast<const W*>(args.q_norm),
             static_cast<const W*>(args.k_norm));
    });
  });
  return dispatched ? cudaGetLastError() : cudaErrorInvalidValue;
}

}  // namespace kiln::cuda
