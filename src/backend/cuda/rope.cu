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

template <typename T>
__global__ void rope_kernel(T* x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t half_rotary,
                            const int32_t* positions, const float* inv_freq) {
  const int64_t pairs = tokens * heads * half_rotary;
  for (int64_t index = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; index < pairs;
       index += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t pair = index % half_rotary;
    const int64_t head_row = index / half_rotary;  // token · heads + head
    const int64_t token = head_row / heads;
    const float angle = static_cast<float>(positions[token]) * inv_freq[pair];
    float sine, cosine;
    sincosf(angle, &sine, &cosine);
    const float c = round_to<T>(cosine);
    const float s = round_to<T>(sine);
    T* head = x + head_row * head_dim;
    const float first = to_float(head[pair]);
    const float second = to_float(head[pair + half_rotary]);
    head[pair] = from_float<T>(round_to<T>(first * c) - round_to<T>(second * s));
    head[pair + half_rotary] = from_float<T>(round_to<T>(second * c) + round_to<T>(first * s));
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
    rope_kernel<T><<<grid, kThreads, 0, stream>>>(static_cast<T*>(x), tokens, heads, head_dim, rotary_dim / 2,
                                                  positions, inv_freq);
  });
  return dispatched ? cudaGetLastError() : cudaErrorInvalidValue;
}

}  // namespace kiln::cuda
