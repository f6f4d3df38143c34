// The prefill GEMM of out[t, n] = Σ_k x[t, k] · w[n, k] (+ bias[n]) for m above the decode
// kernel's rows, keeping the per-element accumulation order that the top of matmul.cu states.
#include <algorithm>

#include <cuda.h>
#include <cudaTypedefs.h>

#include "backend/cuda/matmul_common.cuh"

namespace kiln::cuda {
namespace matmul_detail {
namespace {

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

}  // namespace

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

namespace {

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
}  // namespace

cudaError_t launch_wgmma(const MatmulArgs* products, int count, cudaStream_t stream) {
  return wgmma_tokens(products[0].m) == 64 ? launch_wgmma_tiled<64>(products, count, stream)
                                           : launch_wgmma_tiled<128>(products, count, stream);
}

}  // namespace matmul_detail

int64_t matmul_bf16_partials_floats(const MatmulArgs* products, int count) {
  if (matmul_detail::wgmma_shares_launch(products, count)) return 0;  // a shared launch never splits
  int64_t floats = 0;
  for (int t = 0; t < count; ++t) {
    const MatmulArgs& args = products[t];
    if (args.m <= kMatmulDecodeMaxRows || args.n == 0) continue;
    const matmul_detail::WgmmaSplit split = matmul_detail::wgmma_split(args);
    if (split.blocks_along_k > 1) floats = std::max<int64_t>(floats, split.segments * args.m * args.n);
  }
  return floats;
}

int64_t matmul_bf16_most_partials_floats(const MatmulArgs* products, int count, int64_t max_rows) {
  // Only a grid of at most half the machine's blocks splits (wgmma_split), and past 64 rows per
  // multiprocessor the 128-row tiles alone make more blocks than that.
  const int64_t last = std::min<int64_t>(max_rows, 64 * static_cast<int64_t>(products[0].multiprocessors));
  MatmulArgs at[kMatmulGroupMax];
  std::copy(products, products + count, at);
  int64_t most = 0;
  for (int64_t m = kMatmulDecodeMaxRows + 1; m <= last; ++m) {
    for (int t = 0; t < count; ++t) at[t].m = m;
    most = std::max(most, matmul_bf16_partials_floats(at, count));
  }
  return most;
}

}  // namespace kiln::cuda
