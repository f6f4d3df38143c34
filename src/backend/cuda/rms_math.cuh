// The RMSNorm arithmetic shared by the norm kernels (norm.cu) and the per-head norms fused into
// rope_kv_write (rope.cu), so that both give the same bits: a row's inverse RMS from its sum of
// squares, and an element's normalised value (the rounding points are norm.cu's file comment).
#pragma once

#include <cstdint>

#include "backend/cuda/device_math.cuh"
#include "backend/cuda/kernels.h"

namespace kiln::cuda {

// inv = 1 / sqrt(Σx² / D + eps), in f32.
__device__ __forceinline__ float rms_inverse(float square_sum, int64_t width, float eps) {
  return 1.0f / sqrtf(square_sum / static_cast<float>(width) + eps);
}

// Plain: w · ⟦x · inv⟧; ZeroCentred: x · inv · (1 + w); the caller rounds the result to T.
template <typename T>
__device__ __forceinline__ float normalise(float x, float inv, float w, bool zero_centred) {
  if (zero_centred) return (x * inv) * (1.0f + w);
  return w * round_to<T>(x * inv);
}

}  // namespace kiln::cuda
