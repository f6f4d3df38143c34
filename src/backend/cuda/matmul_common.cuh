// What the matmul kernels share (matmul.cu: the f32 kernel, the decode kernel and the dispatch;
// matmul_prefill.cu: the prefill GEMM): element loads and stores, the 32-element chunk layout and
// its tensor-core step, the 16x8 tile stores, and the products one launch computes. The
// accumulation contract they all keep is written at the top of matmul.cu.
#pragma once

#include <cuda.h>

#include "backend/cuda/device_math.cuh"
#include "backend/cuda/kernels.h"

namespace kiln::cuda::matmul_detail {

__device__ __forceinline__ float load_element(const void* data, int64_t index, DType dtype) {
  switch (dtype) {
    case DType::F32: return static_cast<const float*>(data)[index];
    case DType::BF16: return to_float(static_cast<const bf16*>(data)[index]);
    case DType::F16: return to_float(static_cast<const __half*>(data)[index]);
    default: return 0.0f;
  }
}

__device__ __forceinline__ void store_output(void* out, int64_t index, DType dtype, float value) {
  if (dtype == DType::BF16)
    static_cast<bf16*>(out)[index] = from_float<bf16>(value);
  else
    static_cast<float*>(out)[index] = value;
}

__device__ __forceinline__ float with_bias(float acc, const void* bias, DType bias_dtype, int64_t column) {
  return bias ? acc + load_element(bias, column, bias_dtype) : acc;
}

// ------------------------------------------------------------------------------------------
// BF16 activations
// ------------------------------------------------------------------------------------------
constexpr int kChunk = 32;          // k elements per chunk (two mma steps)
constexpr int kChunkBytes = kChunk * 2;

// Shared memory holds a row's 32-element chunk as a 64-byte line of four 16-byte units; unit u of
// line l sits at unit u ^ (l & 2). The eight rows that one load instruction reads then cover every
// bank twice (two wavefronts for the 8-byte reads below; unswizzled lines 128 bytes apart would
// share banks four ways).
__device__ __forceinline__ uint8_t* chunk_unit(uint8_t* lines, int line, int unit) {
  return lines + line * kChunkBytes + ((unit ^ (line & 2)) * 16);
}

// A lane's words of line `line`, q = lane % 4: .x, .y hold k = 4q .. 4q + 3 (the first mma step's),
// .z, .w hold k = 16 + 4q .. 16 + 4q + 3 (the second's).
__device__ __forceinline__ uint4 load_chunk_words(const uint8_t* lines, int line, int q) {
  const uint8_t* base = lines + line * kChunkBytes + (q & 1) * 8;
  const uint2 first = *reinterpret_cast<const uint2*>(base + (((q >> 1) ^ (line & 2)) * 16));
  const uint2 second = *reinterpret_cast<const uint2*>(base + (((2 + (q >> 1)) ^ (line & 2)) * 16));
  return make_uint4(first.x, first.y, second.x, second.y);
}

// One chunk for one 16×8 tile: `upper`/`lower` are the lane's chunk words (load_chunk_words) of
// weight rows g and g+8, `tokens` those of x row g; g = lane / 4, q = lane % 4. The A/B fragments
// of m16n8k16 take, at lane (g, q), two k-pairs per row; the first step gives them words x and y,
// the second z and w, so step s multiplies exactly the chunk's elements 16s .. 16s + 15 — the
// elements the prefill GEMM's wgmma step takes, in other positions (see the contract above).
__device__ __forceinline__ void mma_chunk(float (&acc)[4], const uint4& upper, const uint4& lower, const uint4& tokens) {
  const uint32_t first[4] = {upper.x, lower.x, upper.y, lower.y};
  mma_bf16_16816(acc, first, tokens.x, tokens.y);
  const uint32_t second[4] = {upper.z, lower.z, upper.w, lower.w};
  mma_bf16_16816(acc, second, tokens.z, tokens.w);
}

// A decode warp's share of K in the decode kernels: segments warp, warp + warps, … of the K's
// `segments` (kMatmulSegmentK each, kStagesPerSegment stages of it), their stages flattened so that
// the warp's i-th stage is stage stage_of(i) of K, `count` of them.
// Stage indices are 32-bit: K is at most kMatmulSegmentK · kMatmulMaxSegments.
template <int kStagesPerSegment>
struct WarpSegments {
  int warp, warps, segments;
  int count = 0;
  __device__ WarpSegments(int total_stages, int warp_, int warps_) : warp(warp_), warps(warps_) {
    segments = (total_stages + kStagesPerSegment - 1) / kStagesPerSegment;
    for (int segment = warp; segment < segments; segment += warps) {
      const int first = segment * kStagesPerSegment;
      count += (total_stages - first < kStagesPerSegment ? total_stages - first : kStagesPerSegment);
    }
  }
  __device__ int segment_of(int i) const { return warp + i / kStagesPerSegment * warps; }
  __device__ int stage_of(int i) const { return segment_of(i) * kStagesPerSegment + i % kStagesPerSegment; }
  // After the warp's i-th stage: whether its segment is complete. Then the accumulators go to the
  // block's segment sums ([segment][element][lane]) and start again from zero.
  __device__ void end_stage(int i, float (&acc)[4], float* segment_sums, int lane) const {
    if ((i + 1) % kStagesPerSegment != 0 && i + 1 != count) return;
    const int segment = segment_of(i);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      segment_sums[(segment * 4 + e) * 32 + lane] = acc[e];
      acc[e] = 0.0f;
    }
  }
};

// The segment sums added in ascending segment order from zero (the contract's fold), by warp 0
// once the block has synchronised.
__device__ __forceinline__ void fold_segments(const float* segment_sums, int segments, int lane, float (&total)[4]) {
  for (int segment = 0; segment < segments; ++segment)
#pragma unroll
    for (int e = 0; e < 4; ++e) total[e] = total[e] + segment_sums[(segment * 4 + e) * 32 + lane];
}

// Stores a 16×8 accumulator tile (weight rows × x rows) as out[row][column].
__device__ __forceinline__ void store_tile(const float (&acc)[4], int64_t column_base, int64_t row_base, bool lower_rows,
                                           const void* bias, DType bias_dtype, void* out, DType out_dtype, int64_t m,
                                           int64_t n) {
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, q = lane % 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (i >= 2 && !lower_rows) break;
    const int64_t column = column_base + g + (i >= 2 ? 8 : 0);
    const int64_t row = row_base + 2 * q + (i & 1);
    if (column < n && row < m) store_output(out, row * n + column, out_dtype, with_bias(acc[i], bias, bias_dtype, column));
  }
}

// Stores a 16×8 tile of one segment's sums, unbiased and unrounded, into that segment's
// [m][n] plane of the split GEMM's scratch (the element mapping of store_tile).
__device__ __forceinline__ void store_partial_tile(const float (&acc)[4], int64_t column_base, int64_t row_base,
                                                   float* partial, int64_t m, int64_t n) {
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, q = lane % 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t column = column_base + g + (i >= 2 ? 8 : 0);
    const int64_t row = row_base + 2 * q + (i & 1);
    if (column < n && row < m) partial[row * n + column] = acc[i];
  }
}

// The products one launch computes (a matmul group, or one matmul): column blocks
// [first_block[t], first_block[t + 1]) take product t's weight rows, `rows_per_block` rows each.
struct MatmulTargets {
  const bf16* w[kMatmulGroupMax];
  const void* bias[kMatmulGroupMax];
  void* out[kMatmulGroupMax];
  int64_t n[kMatmulGroupMax];
  DType bias_dtype[kMatmulGroupMax];
  DType out_dtype[kMatmulGroupMax];
  int first_block[kMatmulGroupMax + 1];
  int count;
};

inline MatmulTargets matmul_targets(const MatmulArgs* products, int count, int rows_per_block) {
  MatmulTargets targets{};
  targets.count = count;
  for (int t = 0; t < count; ++t) {
    targets.w[t] = static_cast<const bf16*>(products[t].w);
    targets.bias[t] = products[t].bias;
    targets.bias_dtype[t] = products[t].bias_dtype;
    targets.out[t] = products[t].out;
    targets.out_dtype[t] = products[t].out_dtype;
    targets.n[t] = products[t].n;
    targets.first_block[t + 1] = targets.first_block[t] + static_cast<int>(blocks_for(products[t].n, rows_per_block));
  }
  return targets;
}

__device__ __forceinline__ int target_of(const MatmulTargets& targets, int column_block) {
  int target = 0;
  while (target + 1 < targets.count && column_block >= targets.first_block[target + 1]) ++target;
  return target;
}

// The prefill GEMM (matmul_prefill.cu), for every m above kMatmulDecodeMaxRows.
// Whether a group's products share one launch (fewer waves of blocks than one launch each).
bool wgmma_shares_launch(const MatmulArgs* products, int count);
// One launch for products[0..count).
cudaError_t launch_wgmma(const MatmulArgs* products, int count, cudaStream_t stream);

}  // namespace kiln::cuda::matmul_detail
