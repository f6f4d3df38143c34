// out[t, n] = Σ_k x[t, k] · w[n, k] (+ bias[n]).
//
// Per-element accumulation order (the invariance contract). Tile shapes and the kernel chosen
// vary with m (the number of rows); the order in which any one element accumulates its K never
// does, so a row's output bits are the same alone, in a batch, or in a prefill of any length.
//
// F32 activations (CUDA cores, never tf32): acc = 0; acc = fma(x[t,k], w[n,k], acc) for
// k = 0, 1, …, K-1; out = acc + bias. One kernel for every m.
//
// BF16 activations (tensor cores, f32 accumulate): w is the A operand (output columns) and x the B
// operand (rows) of every kernel. K is cut into segments of kMatmulSegmentK = 1024 (the last may be
// shorter), each cut into 32-element chunks, zero-padded past K; a chunk is two tensor-core steps
// of 16 k, the first taking the chunk's elements 0..15, the second 16..31. Within a segment one f32
// accumulator chains through every step from zero; the segment results are added in ascending
// order to a total that starts at 0; then + bias, then one rounding to the output dtype. Segment
// boundaries depend on K alone, so this is no M-dependent split-K: it is what lets decode spread
// one output's K over several warps. Where in a step a product sits does not change the step's sum
// (the Hopper tensor core adds a step's 16 products as one set: mma.sync m16n8k16 and wgmma k16
// agree bit for bit, which the CUDA invariance tests check), so the kernels only agree on which
// 16 elements form each step.
//   m ≤ kMatmulDecodeMaxRows: the decode kernel (mma.sync), a block of up to four or eight warps
//     (no more than K has segments) per 8 or 16 weight rows (the launch shape, chosen by size), the
//     warps taking the segments in turn through their own cp.async rings (the weights are read
//     exactly once), warp 0 adding the segment results in order. A matmul group's products share
//     one launch.
//   larger m: the prefill GEMM (wgmma fed by the bulk tensor copy engine), 128 weight rows × 128
//     rows per block (× 64 rows for m ≤ 64). A grid smaller than the machine spreads each block's
//     segments over several blocks, which store the segment results for a fold kernel to add in
//     the same order: more blocks, the same additions. A group's products share one launch where
//     that takes fewer waves of blocks.
#include <algorithm>

#include <cuda.h>
#include <cudaTypedefs.h>

#include "backend/cuda/device_math.cuh"
#include "backend/cuda/kernels.h"

namespace kiln::cuda {
namespace {

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
// F32 activations
// ------------------------------------------------------------------------------------------
constexpr int kF32Tile = 64;        // rows and columns per block
constexpr int kF32TileK = 16;
constexpr int kF32Threads = 256;    // 16 × 16 threads, each 4 rows × 4 columns

template <typename W>
__global__ void __launch_bounds__(kF32Threads)
    matmul_f32_kernel(const float* x, const W* w, const void* bias, DType bias_dtype, void* out, DType out_dtype,
                      int64_t m, int64_t n, int64_t k) {
  __shared__ float x_tile[kF32TileK][kF32Tile + 4];  // [k][row]
  __shared__ float w_tile[kF32TileK][kF32Tile + 4];  // [k][column]
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kF32Tile;
  const int64_t column0 = static_cast<int64_t>(blockIdx.x) * kF32Tile;
  const int thread_column = threadIdx.x % 16;
  const int thread_row = threadIdx.x / 16;
  float acc[4][4] = {};
  for (int64_t k0 = 0; k0 < k; k0 += kF32TileK) {
    for (int i = 0; i < kF32Tile * kF32TileK / kF32Threads; ++i) {
      const int element = threadIdx.x + i * kF32Threads;
      const int r = element / kF32TileK;
      const int kk = element % kF32TileK;
      const int64_t global_k = k0 + kk;
      const bool k_valid = global_k < k;
      x_tile[kk][r] = (k_valid && row0 + r < m) ? x[(row0 + r) * k + global_k] : 0.0f;
      w_tile[kk][r] = (k_valid && column0 + r < n) ? to_float(w[(column0 + r) * k + global_k]) : 0.0f;
    }
    __syncthreads();
    const int64_t depth = k - k0 < kF32TileK ? k - k0 : kF32TileK;
    for (int kk = 0; kk < depth; ++kk) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = x_tile[kk][thread_row * 4 + i];
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = w_tile[kk][thread_column * 4 + j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t row = row0 + thread_row * 4 + i;
    if (row >= m) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t column = column0 + thread_column * 4 + j;
      if (column < n) store_output(out, row * n + column, out_dtype, with_bias(acc[i][j], bias, bias_dtype, column));
    }
  }
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

MatmulTargets matmul_targets(const MatmulArgs* products, int count, int rows_per_block) {
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

// --- prefill GEMM (wgmma, sm_90a): a block computes 128 weight rows × 128 (or 64) x rows ---
// Warp-specialised: warpgroup 0 is the producer, one thread of which has the bulk tensor copy
// engine (TMA) bring each stage's operands into shared memory, completing on the stage's `full`
// mbarrier; warpgroups 1 and 2 do the math, 64 weight rows × all the tile's x rows each, and free
// a stage by arriving on its `empty` mbarrier once their wgmma on it retired. The math warps issue
// no loads and meet at no block barrier, and setmaxnreg moves the producer's registers to them
// (the segment totals hold 64 per thread beside the 64 accumulators of a 128-row tile).
// wgmma reads both operands from shared memory in the swizzled K-major layout of device_math.cuh,
// which is the copy engine's 128-byte swizzle: a stage's 64 k of a row fill one 128-byte line.
// Each k16 step multiplies 16 consecutive k, the elements mma_chunk's step takes; the tensor core
// sums a step's products the same whichever positions they sit in (the CUDA invariance tests hold
// this kernel to the decode kernel's bits), so the steps agree bit for bit. A 128 × 256 tile
// (segment totals in shared memory, 64-byte lines) and 64 × 64 mma.sync tiles were measured slower
// at every m from 32 to 1,024 (docs/perf.md), so this one kernel takes every m above the decode
// kernel's.
constexpr int kWgmmaRows = 128;       // weight rows per block: two math warpgroups of 64
constexpr int kWgmmaThreads = 384;    // the producer warpgroup, then the two math warpgroups
constexpr int kWgmmaMathWarps = 8;
constexpr int kWgmmaStageK = 64;      // one 128-byte line of bf16 per row
constexpr int kWgmmaLineBytes = kWgmmaStageK * 2;
static_assert(kWgmmaLineBytes == kSwizzleLineBytes, "a stage's k of one row fill one swizzled line");
constexpr int kWgmmaWeightBytes = kWgmmaRows * kWgmmaLineBytes;
constexpr int kWgmmaStagesPerSegment = static_cast<int>(kMatmulSegmentK) / kWgmmaStageK;

// x rows per block (the wgmma N): 128, or 64 where m ≤ 64 (batch-64 decode, short prompts). There
// a 128-row box would be half zero fill, and the smaller stage leaves room for nine stages of
// weights in flight instead of six: such grids stream their weights (the 8B's 14336×4096 product
// at m = 64 takes 35.8 µs with these, took 48.5 µs with 128-row tiles and 39.4 µs with the cp.async
// GEMM before; docs/perf.md).
// The stages are each 1,024-byte aligned (swizzle atoms), then a full and an empty barrier per stage.
template <int kTokens>
struct WgmmaTiling {
  static constexpr int kStageBytes = kWgmmaWeightBytes + kTokens * kWgmmaLineBytes;
  static constexpr int kStages = kTokens == 128 ? 6 : 9;
  static constexpr int kSharedBytes = kStages * kStageBytes + 1024 + 2 * kStages * 8;
  static_assert(kSharedBytes <= 227 * 1024, "an SM's opt-in shared memory per block");
};
int wgmma_tokens(int64_t m) { return m <= 64 ? 64 : 128; }
// Registers per thread after setmaxnreg: 128 × 40 + 256 × 232 fits the SM's 65,536.
constexpr int kWgmmaProducerRegisters = 40;
constexpr int kWgmmaMathRegisters = 232;

// The copy engine's view of the operands: x and each product's weights as 2-d bf16 tensors
// [rows, k], read in boxes of 64 k × 128 rows (x: × the tile's rows), zero-filled past the rows or
// K (as the decode kernel's copies are), 128-byte swizzled.
struct WgmmaOperandMaps {
  CUtensorMap x;
  CUtensorMap w[kMatmulGroupMax];
};

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encoder = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t status =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault, &found);
    return status == cudaSuccess && found == cudaDriverEntryPointSuccess
               ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function)
               : nullptr;
  }();
  return encoder;
}

bool encode_operand_map(CUtensorMap& map, const void* matrix, int64_t rows, int64_t k, int box_rows) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (!encode) return false;
  const cuuint64_t sizes[2] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(rows)};
  const cuuint64_t row_bytes[1] = {static_cast<cuuint64_t>(k) * 2};
  const cuuint32_t box[2] = {kWgmmaStageK, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  return encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(matrix), sizes, row_bytes, box,
                element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// d (64 × 128, f32) = a (64 × 16) · b (128 × 16)ᵀ (+ d when `accumulate`), bf16 in shared memory,
// K-major.
__device__ __forceinline__ void wgmma_step(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, "
      "%8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, "
      "%40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, "
      "%56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, accumulate, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(a), "l"(b), "r"(accumulate));
}

// The same with b 64 × 16: d is 64 × 64.
__device__ __forceinline__ void wgmma_step(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, "
      "%8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31"
      "}, %32, %33, accumulate, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a), "l"(b), "r"(accumulate));
}

// Which output tile a block computes. Blocks start in launch order (x fastest), so the plain
// (blockIdx.x, blockIdx.y) mapping has each wave cover every weight tile of a wide product for one
// or two x tiles: the 8B's 14336-row gate projection is 117 MB of weights, more than the L2 holds,
// and was streamed from memory once per x tile. Launch order here walks kWgmmaTileGroup x tiles
// for each weight tile before the next weight tile, so a wave of 132 blocks touches 8 x tiles and
// about 17 weight tiles (~25 MB at K = 4,096), which stay in the L2 for the waves that follow.
// Which block computes a tile does not change its arithmetic. 32-bit index math: with 64-bit
// divisions here ptxas gave the kernel 250 registers and the GEMM ran 10–15 % slower (docs/perf.md).
constexpr unsigned kWgmmaTileGroup = 8;
struct WgmmaTile {
  int64_t column, row;
};
__device__ __forceinline__ WgmmaTile wgmma_tile() {
  const unsigned launch_index = blockIdx.y * gridDim.x + blockIdx.x;
  const unsigned group = launch_index / (kWgmmaTileGroup * gridDim.x);
  const unsigned first_row = group * kWgmmaTileGroup;
  const unsigned rows_in_group = min(gridDim.y - first_row, kWgmmaTileGroup);
  const unsigned in_group = launch_index - group * kWgmmaTileGroup * gridDim.x;
  return {in_group / rows_in_group, first_row + in_group % rows_in_group};
}

// Split (partials non-null): block z takes segments [z·P, z·P + P) with P = segments_per_block
// and writes each segment's sums to its plane of `partials`; fold_segments_kernel then adds the
// planes in segment order from +0 and stores — the additions the unsplit kernel makes in registers.
template <int kTokens>
__global__ void __launch_bounds__(kWgmmaThreads, 1)
    matmul_bf16_wgmma_kernel(const __grid_constant__ WgmmaOperandMaps maps, MatmulTargets targets, int64_t m,
                             int64_t k, float* partials, int segments_per_block) {
  constexpr int kStages = WgmmaTiling<kTokens>::kStages;
  constexpr int kStageBytes = WgmmaTiling<kTokens>::kStageBytes;
  constexpr int kAccumulators = kTokens / 2;  // per thread: 64 weight rows × kTokens over 128 threads
  extern __shared__ uint4 shared_words[];
  const uint32_t base = (static_cast<uint32_t>(__cvta_generic_to_shared(shared_words)) + 1023u) & ~1023u;
  const uint32_t full_barriers = base + kStages * kStageBytes;
  const uint32_t empty_barriers = full_barriers + kStages * 8;
  const WgmmaTile tile = wgmma_tile();
  const int target = target_of(targets, static_cast<int>(tile.column));
  const int64_t n = targets.n[target];
  const int64_t column0 = (tile.column - targets.first_block[target]) * kWgmmaRows;
  const int64_t row0 = tile.row * kTokens;
  const int all_stages = static_cast<int>((k + kWgmmaStageK - 1) / kWgmmaStageK);
  const int first_stage = static_cast<int>(blockIdx.z) * segments_per_block * kWgmmaStagesPerSegment;
  const int end_stage = min(first_stage + segments_per_block * kWgmmaStagesPerSegment, all_stages);
  if (threadIdx.x == 0) {
    prefetch_tensor_map(&maps.x);
    prefetch_tensor_map(&maps.w[target]);
    for (int slot = 0; slot < kStages; ++slot) {
      mbarrier_init(full_barriers + 8 * slot, 1);
      mbarrier_init(empty_barriers + 8 * slot, kWgmmaMathWarps);
    }
    fence_barrier_init();
  }
  __syncthreads();

  if (threadIdx.x < 128) {
    set_max_registers_decrease<kWgmmaProducerRegisters>();
    if (threadIdx.x != 0) return;
    // Stage i of the block uses slot i % kStages; its j-th use (j = i / kStages) waits
    // for the math warps' j-th release of the slot (a fresh barrier counts as released once).
    const void* weights = &maps.w[target];
    for (int i = 0; i < end_stage - first_stage; ++i) {
      const int slot = i % kStages;
      mbarrier_wait(empty_barriers + 8 * slot, ((i / kStages) & 1) ^ 1);
      const uint32_t full = full_barriers + 8 * slot;
      const uint32_t destination = base + slot * kStageBytes;
      const int k_base = (first_stage + i) * kWgmmaStageK;
      mbarrier_arrive_expect_bytes(full, kStageBytes);
      tma_load_2d(destination, weights, k_base, static_cast<int>(column0), full);
      tma_load_2d(destination + kWgmmaWeightBytes, &maps.x, k_base, static_cast<int>(row0), full);
    }
  } else {
    set_max_registers_increase<kWgmmaMathRegisters>();
    const int warpgroup = static_cast<int>(threadIdx.x) / 128 - 1;
    const int warp_in_group = (static_cast<int>(threadIdx.x) % 128) / 32;
    const bool signals = threadIdx.x % 32 == 0;
    auto release = [&](int i) {
      if (signals) mbarrier_arrive(empty_barriers + 8 * (i % kStages));
    };
    float acc[kAccumulators], total[kAccumulators];
#pragma unroll
    for (int e = 0; e < kAccumulators; ++e) total[e] = 0.0f;
    // A segment's first step overwrites the accumulators (scale-d 0) instead of adding to zeroed
    // ones: the same sum, except that a step of zero products could leave -0 where 0 + (-0) is +0,
    // and the segment result is added to a total that starts at +0, which erases that difference.
    // No instruction but wgmma then writes the accumulators inside the loop, so ptxas never has to
    // drain the wgmma pipeline there.
    int i = 0;  // the block's stage count so far
    for (int segment_start = first_stage; segment_start < end_stage; segment_start += kWgmmaStagesPerSegment) {
      const int segment_end = min(segment_start + kWgmmaStagesPerSegment, end_stage);
      for (int s = segment_start; s < segment_end; ++s, ++i) {
        mbarrier_wait(full_barriers + 8 * (i % kStages), (i / kStages) & 1);
        const uint32_t slot = base + static_cast<uint32_t>(i % kStages) * kStageBytes;
        const uint64_t a = wgmma_descriptor(slot + warpgroup * 64 * kWgmmaLineBytes);
        const uint64_t b = wgmma_descriptor(slot + kWgmmaWeightBytes);
        // Past K both operands are zero-filled: a step there adds only zero products, which leaves
        // a nonzero accumulator as it is, so it needs no skipping.
        fence_accumulators(acc);
        wgmma_fence();
#pragma unroll
        for (int step = 0; step < kWgmmaStageK / 16; ++step)  // each step 32 bytes further along the lines
          wgmma_step(acc, a + 2 * step, b + 2 * step, s == segment_start && step == 0 ? 0 : 1);
        wgmma_commit();
        wgmma_wait<1>();
        fence_accumulators(acc);
        if (s > segment_start) release(i - 1);  // that stage's wgmma has retired
      }
      wgmma_wait<0>();
      fence_accumulators(acc);
      release(i - 1);
      if (partials) {
        float* partial = partials + static_cast<int64_t>(segment_start / kWgmmaStagesPerSegment) * m * n;
#pragma unroll
        for (int j = 0; j < kTokens / 8; ++j) {
          const float tile_sums[4] = {acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]};
          store_partial_tile(tile_sums, column0 + warpgroup * 64 + warp_in_group * 16, row0 + 8 * j, partial, m, n);
        }
      } else {
#pragma unroll
        for (int e = 0; e < kAccumulators; ++e) total[e] = total[e] + acc[e];
      }
    }
    if (partials) return;
#pragma unroll
    for (int j = 0; j < kTokens / 8; ++j) {
      const float tile_sums[4] = {total[4 * j], total[4 * j + 1], total[4 * j + 2], total[4 * j + 3]};
      store_tile(tile_sums, column0 + warpgroup * 64 + warp_in_group * 16, row0 + 8 * j, true, targets.bias[target],
                 targets.bias_dtype[target], targets.out[target], targets.out_dtype[target], m, n);
    }
  }
}

// The element-wise end of a split GEMM: each output element's segment planes added in order from
// +0, then bias and rounding as store_tile does them.
__global__ void fold_segments_kernel(const float* partials, int segments, const void* bias, DType bias_dtype,
                                     void* out, DType out_dtype, int64_t m, int64_t n) {
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= m * n) return;
  float total = 0.0f;
  for (int segment = 0; segment < segments; ++segment) total = total + partials[segment * m * n + index];
  store_output(out, index, out_dtype, with_bias(total, bias, bias_dtype, index % n));
}

// How a prefill GEMM launch splits K: grids of fewer blocks than multiprocessors take K in groups
// of whole segments on as many blocks as still fit in one wave (batch-64 decode and short prompts
// of small models leave most of the machine idle otherwise). segments_per_block = all segments: no
// split.
struct WgmmaSplit {
  int segments, segments_per_block, blocks_along_k;
};
WgmmaSplit wgmma_split(int64_t blocks, int64_t k, int multiprocessors) {
  const int segments = static_cast<int>((k + kMatmulSegmentK - 1) / kMatmulSegmentK);
  const int64_t fit = multiprocessors / blocks;
  const int splits = static_cast<int>(fit < segments ? fit : segments);
  if (splits < 2) return {segments, segments, 1};
  const int per_block = (segments + splits - 1) / splits;
  return {segments, per_block, (segments + per_block - 1) / per_block};
}
int64_t wgmma_blocks(const MatmulArgs& args) {
  return static_cast<int64_t>(blocks_for(args.n, kWgmmaRows)) * blocks_for(args.m, wgmma_tokens(args.m));
}
WgmmaSplit wgmma_split(const MatmulArgs& args) { return wgmma_split(wgmma_blocks(args), args.k, args.multiprocessors); }

// Whether a group's products share one prefill launch: when that takes fewer waves of blocks than
// launching them one by one (each with its own split). The 8B's gate and up projections at 512
// rows are 448 blocks each, 4 waves apiece on 132 multiprocessors, and 7 waves together; q, k and
// v at 512 rows (128 + 32 + 32 blocks) take 1 + ¼ + ¼ waves alone, split, and 2 together.
bool wgmma_shares_launch(const MatmulArgs* products, int count) {
  if (count < 2) return false;
  const int64_t sms = products[0].multiprocessors;
  int64_t blocks = 0;
  double alone = 0.0;
  for (int t = 0; t < count; ++t) {
    const int64_t product_blocks = wgmma_blocks(products[t]);
    if (product_blocks == 0) continue;
    const int splits = wgmma_split(products[t]).blocks_along_k;
    alone += static_cast<double>((product_blocks * splits + sms - 1) / sms) / splits;
    blocks += product_blocks;
  }
  return blocks >= sms && static_cast<double>((blocks + sms - 1) / sms) < alone;
}

// One launch for products[0..count) (a shared launch never splits: it only exists when its grid
// fills the machine).
template <int kTokens>
cudaError_t launch_wgmma_tiled(const MatmulArgs* products, int count, cudaStream_t stream) {
  auto* kernel = &matmul_bf16_wgmma_kernel<kTokens>;
  constexpr int kSharedBytes = WgmmaTiling<kTokens>::kSharedBytes;
  static std::atomic<uint64_t> opted_in{0};
  if (cudaError_t status = allow_dynamic_shared(kernel, kSharedBytes, opted_in); status != cudaSuccess)
    return status;
  const MatmulArgs& args = products[0];  // x, m and k are shared
  const MatmulTargets targets = matmul_targets(products, count, kWgmmaRows);
  const unsigned column_blocks = static_cast<unsigned>(targets.first_block[count]);
  const unsigned row_blocks = blocks_for(args.m, kTokens);
  const WgmmaSplit split = wgmma_split(int64_t{column_blocks} * row_blocks, args.k, args.multiprocessors);
  const bool splits = split.blocks_along_k > 1;
  // A split needs the scratch the caller lends (matmul_bf16_partials_floats), for one product.
  if (splits && (count > 1 || !args.partials)) return cudaErrorInvalidValue;
  WgmmaOperandMaps maps;
  if (!encode_operand_map(maps.x, args.x, args.m, args.k, kTokens)) return cudaErrorInvalidValue;
  for (int t = 0; t < count; ++t)
    if (!encode_operand_map(maps.w[t], products[t].w, products[t].n, args.k, kWgmmaRows)) return cudaErrorInvalidValue;
  const dim3 grid(column_blocks, row_blocks, static_cast<unsigned>(split.blocks_along_k));
  kernel<<<grid, kWgmmaThreads, kSharedBytes, stream>>>(maps, targets, args.m, args.k,
                                                             splits ? args.partials : nullptr,
                                                             split.segments_per_block);
  if (!splits) return cudaGetLastError();
  constexpr int kFoldThreads = 256;
  fold_segments_kernel<<<blocks_for(args.m * args.n, kFoldThreads), kFoldThreads, 0, stream>>>(
      args.partials, split.segments, args.bias, args.bias_dtype, args.out, args.out_dtype, args.m, args.n);
  return cudaGetLastError();
}
cudaError_t launch_wgmma(const MatmulArgs* products, int count, cudaStream_t stream) {
  return wgmma_tokens(products[0].m) == 64 ? launch_wgmma_tiled<64>(products, count, stream)
                                           : launch_wgmma_tiled<128>(products, count, stream);
}

// --- decode: a block per kColumns weight rows; its warps take K segments in turn ---
constexpr int kDecodeChunksPerStage = 4;
constexpr int kDecodeStageK = kChunk * kDecodeChunksPerStage;
constexpr int kDecodeStagesPerSegment = static_cast<int>(kMatmulSegmentK) / kDecodeStageK;

// Shared memory: one ring of kStages stages per warp, each stage the weights [chunk][column][32 k]
// then the m rows of x [chunk][row][32 k] (only as many rows as there are: m is small), then each
// segment's partial sums [segment][element][lane].
template <int kColumns, int kStages>
struct DecodeConfig {
  static constexpr int kWeightStageBytes = kDecodeChunksPerStage * kColumns * kChunkBytes;
  static constexpr int kSegmentBytes = 4 * 32 * 4;
  __host__ __device__ static int stage_bytes(int64_t m) {
    return kWeightStageBytes + kDecodeChunksPerStage * static_cast<int>(m) * kChunkBytes;
  }
  __host__ __device__ static int rings_bytes(int warps, int64_t m) { return warps * kStages * stage_bytes(m); }
};

// A lane's share of a stage's weight copies. The stage holds kColumns rows × 4 chunks × 4 16-byte
// units; lane l copies unit l % 4 of chunk (l / 4) % 4 of rows l / 16 + 2i (i < kColumns / 2), so
// everything but the stage's k is fixed per lane and computed once: per stage, one k bound and
// kColumns / 2 addresses a fixed stride apart. (Recomputing the indices for every copy made the
// decode matmul slower, docs/perf.md.)
template <int kColumns>
struct DecodeWeightCopies {
  static constexpr int kCopies = kColumns / 2;
  const bf16* row_start;   // the lane's unit of its first row, at k = 0
  const bf16* fallback;    // a valid address for the copies that read nothing
  int64_t row_pair;        // elements from one of the lane's rows to the next (two weight rows)
  int64_t k_limit;         // the lane's unit lies inside K while the stage's k is below this
  uint32_t rows_inside;    // bit i: the lane's row i is one of the n rows
  uint32_t line;           // byte offset of the lane's first line in a stage
  uint32_t unit_even;      // its unit's offset in lines l with l & 2 clear (chunk_unit's swizzle)…
  uint32_t unit_odd;       // …and set: the lane's rows 2i + l / 16 have it set exactly for odd i
  __device__ DecodeWeightCopies(const bf16* w, int64_t n, int64_t k, int64_t column0) {
    const int lane = threadIdx.x % 32;
    const int chunk = (lane / 4) % kDecodeChunksPerStage, unit = lane % 4, first_row = lane / 16;
    const int64_t offset = chunk * kChunk + unit * 8;
    row_start = w + (column0 + first_row) * k + offset;
    fallback = w;
    row_pair = 2 * k;
    k_limit = k - offset;
    rows_inside = 0;
    for (int i = 0; i < kCopies; ++i)
      if (column0 + first_row + 2 * i < n) rows_inside |= 1u << i;
    line = chunk * kColumns * kChunkBytes + first_row * kChunkBytes;
    unit_even = unit * 16;
    unit_odd = (unit ^ 2) * 16;
  }
  __device__ __forceinline__ void issue(uint8_t* stage, int64_t k_base) const {
    const bool k_inside = k_base < k_limit;
    const bf16* source = row_start + k_base;
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const bool valid = k_inside && (rows_inside >> i & 1u);
      uint8_t* target = stage + line + 2 * i * kChunkBytes + (i % 2 ? unit_odd : unit_even);
      cp_async_16(target, valid ? source + i * row_pair : fallback, valid);
    }
  }
};

// Only the m real rows of x are copied: the other columns of the B fragment feed only output rows
// that are never stored (an mma element depends on its own row and column alone).
template <typename Config>
__device__ __forceinline__ void load_decode_inputs(uint8_t* stage, const bf16* x, int64_t m, int64_t k,
                                                   int64_t k_base) {
  constexpr int kPiecesPerLine = kDecodeChunksPerStage * 4;
  const int lane = threadIdx.x % 32;
  uint8_t* inputs = stage + Config::kWeightStageBytes;
  for (int piece = lane; piece < m * kPiecesPerLine; piece += 32) {
    const int row = piece / kPiecesPerLine;
    const int chunk = (piece / 4) % kDecodeChunksPerStage;
    const int q = piece % 4;
    const int64_t global_k = k_base + chunk * kChunk + q * 8;
    const bool valid = global_k < k;
    const bf16* source = valid ? x + row * k + global_k : x;
    cp_async_16(chunk_unit(inputs + chunk * m * kChunkBytes, row, q), source, valid);
  }
}

// Of the block's `warps` (at most kWarps, and no more than K has segments), warp w computes
// segments w, w + warps, … of the block's rows: each segment is an mma chain from zero over its
// 1024 k, streamed through the warp's own cp.async ring (the pipeline runs across the warp's
// segments without draining). Warp 0 then adds the segments in order.
template <int kColumns, int kStages, int kWarps>
__global__ void __launch_bounds__(kWarps * 32)
    matmul_bf16_decode_kernel(const bf16* x, MatmulTargets targets, int64_t m, int64_t k) {
  using Config = DecodeConfig<kColumns, kStages>;
  extern __shared__ uint4 shared_words[];
  const int target = target_of(targets, static_cast<int>(blockIdx.x));
  const bf16* w = targets.w[target];
  const void* bias = targets.bias[target];
  const DType bias_dtype = targets.bias_dtype[target];
  void* out = targets.out[target];
  const DType out_dtype = targets.out_dtype[target];
  const int64_t n = targets.n[target];
  const int stage_bytes = Config::stage_bytes(m);
  const int warps = static_cast<int>(blockDim.x) / 32;
  float* segment_sums =
      reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(shared_words) + Config::rings_bytes(warps, m));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint8_t* ring = reinterpret_cast<uint8_t*>(shared_words) + warp * kStages * stage_bytes;
  const int64_t column0 = static_cast<int64_t>(static_cast<int>(blockIdx.x) - targets.first_block[target]) * kColumns;
  const int g = lane / 4, q = lane % 4;
  const int64_t total_stages = (k + kDecodeStageK - 1) / kDecodeStageK;
  const int segments = static_cast<int>((total_stages + kDecodeStagesPerSegment - 1) / kDecodeStagesPerSegment);
  // The warp's stages, flattened over its segments: the i-th is stage stage_of(i) of K.
  const int my_segments = segments > warp ? (segments - warp + warps - 1) / warps : 0;
  auto segment_of = [&](int64_t i) { return warp + static_cast<int>(i / kDecodeStagesPerSegment) * warps; };
  auto stage_of = [&](int64_t i) {
    return static_cast<int64_t>(segment_of(i)) * kDecodeStagesPerSegment + i % kDecodeStagesPerSegment;
  };
  int64_t my_stages = 0;
  for (int i = 0; i < my_segments; ++i) {
    const int64_t first = static_cast<int64_t>(warp + i * warps) * kDecodeStagesPerSegment;
    my_stages += (total_stages - first < kDecodeStagesPerSegment ? total_stages - first : kDecodeStagesPerSegment);
  }
  // The first stages' weights are requested before waiting for the previous kernel (they are
  // constant), so with programmatic dependent launch their latency overlaps that kernel's end; x
  // and every store come after. The first commit group holds all those weights.
  const DecodeWeightCopies<kColumns> weight_copies(w, n, k, column0);
  for (int s = 0; s < kStages - 1; ++s)
    if (s < my_stages) weight_copies.issue(ring + s * stage_bytes, stage_of(s) * kDecodeStageK);
  follow_previous_grid();
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < my_stages) load_decode_inputs<Config>(ring + s * stage_bytes, x, m, k, stage_of(s) * kDecodeStageK);
    cp_async_commit();
  }
  const uint4 zero = make_uint4(0, 0, 0, 0);
  float acc[4] = {};
  for (int64_t i = 0; i < my_stages; ++i) {
    cp_async_wait<kStages - 2>();
    __syncwarp();
    const int64_t prefetch = i + kStages - 1;
    if (prefetch < my_stages) {
      uint8_t* stage = ring + (prefetch % kStages) * stage_bytes;
      weight_copies.issue(stage, stage_of(prefetch) * kDecodeStageK);
      load_decode_inputs<Config>(stage, x, m, k, stage_of(prefetch) * kDecodeStageK);
    }
    cp_async_commit();
    const int64_t stage_index = stage_of(i);
    const uint8_t* stage = ring + (i % kStages) * stage_bytes;
#pragma unroll
    for (int chunk = 0; chunk < kDecodeChunksPerStage; ++chunk) {
      if (stage_index * kDecodeStageK + chunk * kChunk >= k) break;
      const uint8_t* weights = stage + chunk * kColumns * kChunkBytes;
      const uint8_t* inputs = stage + Config::kWeightStageBytes + chunk * m * kChunkBytes;
      const uint4 upper = load_chunk_words(weights, g, q);
      const uint4 lower = kColumns == 16 ? load_chunk_words(weights, g + 8, q) : zero;
      // B columns past m repeat row m − 1: they only feed outputs that are never stored.
      const int row = g < m ? g : static_cast<int>(m) - 1;
      mma_chunk(acc, upper, lower, load_chunk_words(inputs, row, q));
    }
    const bool segment_ends = (i + 1) % kDecodeStagesPerSegment == 0 || i + 1 == my_stages;
    if (segment_ends) {
      const int segment = segment_of(i);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        segment_sums[(segment * 4 + e) * 32 + lane] = acc[e];
        acc[e] = 0.0f;
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();
  if (warp != 0) return;
  float total[4] = {};
  for (int segment = 0; segment < segments; ++segment)
#pragma unroll
    for (int e = 0; e < 4; ++e) total[e] = total[e] + segment_sums[(segment * 4 + e) * 32 + lane];
  store_tile(total, column0, 0, kColumns == 16, bias, bias_dtype, out, out_dtype, m, n);
}

template <int kColumns, int kStages, int kWarps>
cudaError_t launch_decode(const MatmulArgs* products, int count, cudaStream_t stream) {
  const MatmulArgs& args = products[0];  // x, m and k are shared
  using Config = DecodeConfig<kColumns, kStages>;
  auto* kernel = &matmul_bf16_decode_kernel<kColumns, kStages, kWarps>;
  static std::atomic<uint64_t> opted_in{0};
  const int max_shared = Config::rings_bytes(kWarps, kMatmulDecodeMaxRows) +
                         static_cast<int>(kMatmulMaxSegments) * Config::kSegmentBytes;
  if (cudaError_t status = allow_dynamic_shared(kernel, max_shared, opted_in); status != cudaSuccess) return status;
  const int segments = static_cast<int>((args.k + kMatmulSegmentK - 1) / kMatmulSegmentK);
  // A warp without a segment would hold an idle ring: shorter K runs fewer warps per block, so
  // that more blocks (and more bytes in flight) fit on a multiprocessor.
  const int warps = std::max(1, std::min(kWarps, segments));
  const int shared = Config::rings_bytes(warps, args.m) + segments * Config::kSegmentBytes;
  const MatmulTargets targets = matmul_targets(products, count, kColumns);
  // The blocks may start (and request their first weights) while the previous kernel on the stream
  // finishes; the kernel waits for it before touching x or out.
  return launch_after_previous(kernel, dim3(static_cast<unsigned>(targets.first_block[count])), dim3(warps * 32),
                               static_cast<size_t>(shared), stream, static_cast<const bf16*>(args.x), targets, args.m,
                               args.k);
}

// The decode launch shapes (weight rows per block, warps per block, ring stages per warp). Every
// shape gives the same bits; they differ in how the grid fills the multiprocessors.
constexpr DecodeLaunchShape kDecodeShapes[] = {{16, 4, 6}, {8, 4, 6}, {16, 4, 3}, {8, 4, 3}, {16, 8, 3}, {8, 8, 4}};

cudaError_t launch_decode_shape(const MatmulArgs* products, int count, int shape, cudaStream_t stream) {
  switch (shape) {
    case 0: return launch_decode<16, 6, 4>(products, count, stream);
    case 1: return launch_decode<8, 6, 4>(products, count, stream);
    case 2: return launch_decode<16, 3, 4>(products, count, stream);
    case 3: return launch_decode<8, 3, 4>(products, count, stream);
    case 4: return launch_decode<16, 3, 8>(products, count, stream);
    case 5: return launch_decode<8, 4, 8>(products, count, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_matmul_f32(const MatmulArgs& args, cudaStream_t stream) {
  if (args.m == 0 || args.n == 0) return cudaSuccess;
  const dim3 grid(blocks_for(args.n, kF32Tile), blocks_for(args.m, kF32Tile));
  const bool dispatched = dispatch_float(args.w_dtype, [&](auto tag) {
    using W = decltype(tag);
    matmul_f32_kernel<W><<<grid, kF32Threads, 0, stream>>>(static_cast<const float*>(args.x),
                                                          static_cast<const W*>(args.w), args.bias, args.bias_dtype,
                                                          args.out, args.out_dtype, args.m, args.n, args.k);
  });
  return dispatched ? cudaGetLastError() : cudaErrorInvalidValue;
}

cudaError_t launch_matmul_bf16(const MatmulArgs& args, cudaStream_t stream) {
  return launch_matmul_bf16_group(&args, 1, stream);
}

int64_t matmul_bf16_partials_floats(const MatmulArgs* products, int count) {
  if (wgmma_shares_launch(products, count)) return 0;  // a shared launch never splits
  int64_t floats = 0;
  for (int t = 0; t < count; ++t) {
    const MatmulArgs& args = products[t];
    if (args.m <= kMatmulDecodeMaxRows || args.n == 0) continue;
    const WgmmaSplit split = wgmma_split(args);
    if (split.blocks_along_k > 1) floats = std::max<int64_t>(floats, split.segments * args.m * args.n);
  }
  return floats;
}

int decode_launch_shape_count() { return static_cast<int>(std::size(kDecodeShapes)); }
DecodeLaunchShape decode_launch_shape(int shape) { return kDecodeShapes[shape]; }

cudaError_t launch_matmul_bf16_decode(const MatmulArgs* products, int count, int shape, cudaStream_t stream) {
  if (count < 1 || count > kMatmulGroupMax || products[0].m < 1 || products[0].m > kMatmulDecodeMaxRows ||
      shape < 0 || shape >= decode_launch_shape_count())
    return cudaErrorInvalidValue;
  return launch_decode_shape(products, count, shape, stream);
}

cudaError_t launch_matmul_bf16_group(const MatmulArgs* products, int count, cudaStream_t stream) {
  if (count < 1 || count > kMatmulGroupMax) return cudaErrorInvalidValue;
  const MatmulArgs& first = products[0];
  int64_t total_n = 0;
  for (int t = 0; t < count; ++t) {
    if (products[t].x != first.x || products[t].m != first.m || products[t].k != first.k)
      return cudaErrorInvalidValue;
    total_n += products[t].n;
  }
  if (first.m == 0 || total_n == 0) return cudaSuccess;
  if (first.m <= kMatmulDecodeMaxRows) {
    const int64_t sms = first.multiprocessors;
    const int64_t wide_blocks = (total_n + 15) / 16;
    // From the launch-shape sweep on the H200 (kiln_cuda_bench decode-shapes, docs/perf.md): K of
    // eight or more segments wants eight warps per block (16 rows when 16-row blocks are fewer
    // than the multiprocessors, else 8); shorter K wants four warps with three stages, in 8-row
    // blocks when 16-row ones would be few (under 1.5 per multiprocessor) or many (over 8 per
    // multiprocessor, where narrower blocks balance the last wave better) — except for the many
    // waves of an lm head (over 24 per multiprocessor), where 16-row blocks with six stages
    // stream at ~98 % of the copy bandwidth and the narrow shape at ~91 %.
    const int64_t segments = (first.k + kMatmulSegmentK - 1) / kMatmulSegmentK;
    if (segments >= 8) return launch_decode_shape(products, count, wide_blocks < sms ? 4 : 5, stream);
    if (wide_blocks > 24 * sms) return launch_decode_shape(products, count, 0, stream);
    const bool narrow = 2 * wide_blocks < 3 * sms || wide_blocks > 8 * sms;
    return launch_decode_shape(products, count, narrow ? 3 : 2, stream);
  }
  if (wgmma_shares_launch(products, count)) return launch_wgmma(products, count, stream);
  for (int t = 0; t < count; ++t) {
    if (products[t].n == 0) continue;
    if (const cudaError_t status = launch_wgmma(&products[t], 1, stream); status != cudaSuccess) return status;
  }
  return cudaSuccess;
}

}  // namespace kiln::cuda
