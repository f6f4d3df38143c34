// RMSNorm and the fused residual-add + RMSNorm.
//
// Reduction order: a row of width D is reduced by one warp when D ≤ kNormWarpRowMaxWidth
// (kernels.h), else by one block of kBlockThreads. Thread i sums the squares of elements i,
// i + threads, i + 2·threads, … in that order, the warp folds its lanes with a fixed xor
// butterfly (16, 8, 4, 2, 1), and in the block case thread 0 adds the warp totals in warp order.
// The choice depends on D alone, so a row's result never depends on how many rows the call has.
//
// Rounding points (architectures.md A.4, D.1), all vanishing for f32 activations:
//   add:   residual ← ⟦residual + delta⟧ₛ, and the norm reads the stored residual
//   Plain: y = ⟦w · ⟦x · inv⟧⟧            ZeroCentred: y = ⟦x · inv · (1 + w)⟧ (1 + w in f32)
// with inv = 1 / sqrt(Σx² / D + eps) in f32, ⟦·⟧ rounding to the output's dtype T and ⟦·⟧ₛ to the
// residual stream's dtype S (the input x / residual / delta): S is f32 or T (models keep the
// stream in f32, so ⟦·⟧ₛ is the identity there).
#include <type_traits>

#include "backend/cuda/device_math.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/rms_math.cuh"

namespace kiln::cuda {
namespace {

// 1024 threads: a decode step normalises one row of 2–8 k elements, so the row's latency, not
// bandwidth, is the cost, and more threads issue its loads at once (256 threads took ~6.7 µs per
// 4096-wide add_rms_norm on the H200, kiln_cuda_bench decode-ops).
constexpr int kBlockThreads = 1024;
constexpr int kWarpRowsPerBlock = 8;

// Elements per thread held in registers: a block row (D ≤ 8 × 1024 — hidden sizes up to 8 k) or
// a warp row (D ≤ 4 × 32, per-head norms, or D ≤ 32 × 32). Wider rows (kHeld = 0) are read twice.
constexpr int kBlockHeld = 8;
constexpr int kNarrowWarpHeld = 4;
constexpr int kWarpHeld = static_cast<int>(kNormWarpRowMaxWidth) / 32;

// A thread's weights: the weights are constant during the step, so they are read before waiting
// for the previous kernel (device_math.cuh) and their latency overlaps its end.
template <int kHeld, typename W>
__device__ __forceinline__ void load_weights(float (&held)[kHeld > 0 ? kHeld : 1], const W* weight, int64_t width,
                                             int first, int stride) {
#pragma unroll
  for (int i = 0; i < kHeld; ++i) {
    const int64_t column = first + static_cast<int64_t>(i) * stride;
    held[i] = column < width ? to_float(weight[column]) : 0.0f;
  }
}

// Folds per-thread sums into the row total (every thread gets it), as the file comment says.
template <bool kWholeBlock>
__device__ __forceinline__ float row_total(float partial) {
  float total = warp_sum(partial);
  if constexpr (kWholeBlock) {
    __shared__ float warp_totals[kBlockThreads / 32];
    __shared__ float block_total;
    if (threadIdx.x % 32 == 0) warp_totals[threadIdx.x / 32] = total;
    __syncthreads();
    if (threadIdx.x == 0) {
      float sum = 0.0f;
      for (int warp = 0; warp < kBlockThreads / 32; ++warp) sum += warp_totals[warp];
      block_total = sum;
    }
    __syncthreads();
    total = block_total;
  }
  return total;
}

// Reduces the row's sum of squares and writes ⟦normalise(x_i)⟧ for the thread's elements: the
// values and weights it holds (kHeld > 0, unrolled so they stay in registers), or the row read
// again through `source` and `weight`.
template <bool kWholeBlock, int kHeld, typename S, typename T, typename W>
__device__ __forceinline__ void normalise_row(float partial, const float* values, const float* weights,
                                              const S* source, const W* weight, T* destination, int64_t width,
                                              float eps, bool zero_centred, int lane, int stride) {
  const float total = row_total<kWholeBlock>(partial);
  const float inv = rms_inverse(total, width, eps);
  if constexpr (kHeld > 0) {
#pragma unroll
    for (int i = 0; i < kHeld; ++i) {
      const int64_t column = lane + static_cast<int64_t>(i) * stride;
      if (column < width) destination[column] = from_float<T>(normalise<T>(values[i], inv, weights[i], zero_centred));
    }
  } else {
    for (int64_t column = lane; column < width; column += stride)
      destination[column] =
          from_float<T>(normalise<T>(to_float(source[column]), inv, to_float(weight[column]), zero_centred));
  }
}

// One row per warp (kWholeBlock false) or per block (true). kAdd: the row is first updated to
// ⟦x + delta⟧ₛ in place (the residual stream) and the norm reads the stored sum; otherwise x is
// only read. With kHeld > 0 the row's width is at most kHeld × the threads per row, and each
// thread keeps its elements in registers between the sum of squares and the normalisation;
// otherwise it reads them again (same arithmetic). Each thread rewrites only the elements it read,
// so out may alias x.
template <typename S, typename T, typename W, bool kWholeBlock, int kHeld, bool kAdd>
__global__ void norm_kernel(S* x, const S* delta, const W* weight, T* out, int64_t rows, int64_t width, float eps,
                            bool zero_centred) {
  const int lane = kWholeBlock ? threadIdx.x : threadIdx.x % 32;
  const int stride = kWholeBlock ? kBlockThreads : 32;
  float weights[kHeld > 0 ? kHeld : 1];
  load_weights<kHeld>(weights, weight, width, lane, stride);
  follow_previous_grid();  // launched after the previous kernel (device_math.cuh)
  const int64_t row = kWholeBlock ? blockIdx.x : blockIdx.x * static_cast<int64_t>(kWarpRowsPerBlock) + threadIdx.x / 32;
  if (!kWholeBlock && row >= rows) return;
  S* source = x + row * width;
  T* destination = out + row * width;
  auto element = [&](int64_t column) {
    if constexpr (kAdd) {
      const S sum = from_float<S>(to_float(source[column]) + to_float(delta[row * width + column]));
      source[column] = sum;
      return to_float(sum);
    } else {
      return to_float(source[column]);
    }
  };
  float values[kHeld > 0 ? kHeld : 1];
  float partial = 0.0f;
  if constexpr (kHeld > 0) {
#pragma unroll
    for (int i = 0; i < kHeld; ++i) {
      const int64_t column = lane + static_cast<int64_t>(i) * stride;
      if (column >= width) continue;
      values[i] = element(column);
      partial = fmaf(values[i], values[i], partial);
    }
  } else {
    for (int64_t column = lane; column < width; column += stride) {
      const float value = element(column);
      partial = fmaf(value, value, partial);
    }
  }
  normalise_row<kWholeBlock, kHeld>(partial, values, weights, static_cast<const S*>(source), weight, destination,
                                    width, eps, zero_centred, lane, stride);
}

template <typename Launch>
cudaError_t dispatch_norm(const NormArgs& args, Launch&& launch) {
  bool dispatched = false;
  if (args.stream_dtype != DType::F32 && args.stream_dtype != args.act_dtype) return cudaErrorInvalidValue;
  dispatch_activation(args.stream_dtype, [&](auto stream_tag) {
    dispatch_activation(args.act_dtype, [&](auto act_tag) {
      dispatched = dispatch_float(args.weight_dtype, [&](auto weight_tag) {
        launch(decltype(stream_tag){}, decltype(act_tag){}, decltype(weight_tag){});
      });
    });
  });
  return dispatched ? cudaGetLastError() : cudaErrorInvalidValue;
}

dim3 norm_grid(const NormArgs& args, bool whole_block) {
  if (whole_block) return dim3(static_cast<unsigned>(args.rows));
  return dim3(blocks_for(args.rows, kWarpRowsPerBlock));
}

// Calls launch(kernel-choosing tag) with the row layout and register-held width for args.width.
template <typename Launch>
void dispatch_held(int64_t width, Launch&& launch) {
  if (width > kNormWarpRowMaxWidth) {
    if (width <= kBlockHeld * kBlockThreads)
      launch(std::true_type{}, std::integral_constant<int, kBlockHeld>{});
    else
      launch(std::true_type{}, std::integral_constant<int, 0>{});
  } else if (width <= kNarrowWarpHeld * 32) {
    launch(std::false_type{}, std::integral_constant<int, kNarrowWarpHeld>{});
  } else {
    launch(std::false_type{}, std::integral_constant<int, kWarpHeld>{});
  }
}

// The plain norm (kAdd false) normalises args.x and never writes it; the fused one first adds
// args.delta into args.residual and normalises that.
template <bool kAdd>
cudaError_t launch_norm(const NormArgs& args, cudaStream_t stream) {
  if (args.rows == 0) return cudaSuccess;
  return dispatch_norm(args, [&](auto stream_tag, auto act_tag, auto weight_tag) {
    using S = decltype(stream_tag);
    using T = decltype(act_tag);
    using W = decltype(weight_tag);
    auto* residual = kAdd ? static_cast<S*>(args.residual) : const_cast<S*>(static_cast<const S*>(args.x));
    const auto* delta = kAdd ? static_cast<const S*>(args.delta) : nullptr;
    const auto* weight = static_cast<const W*>(args.weight);
    auto* out = static_cast<T*>(args.out);
    dispatch_held(args.width, [&](auto whole_block, auto held) {
      constexpr bool kWholeBlock = decltype(whole_block)::value;
      launch_after_previous(&norm_kernel<S, T, W, kWholeBlock, decltype(held)::value, kAdd>,
                            norm_grid(args, kWholeBlock), kWholeBlock ? kBlockThreads : kWarpRowsPerBlock * 32, 0,
                            stream, residual, delta, weight, out, args.rows, args.width, args.eps, args.zero_centred);
    });
  });
}

}  // namespace

cudaError_t launch_rms_norm(const NormArgs& args, cudaStream_t stream) { return launch_norm<false>(args, stream); }

cudaError_t launch_add_rms_norm(const NormArgs& args, cudaStream_t stream) { return launch_norm<true>(args, stream); }

}  // namespace kiln::cuda
