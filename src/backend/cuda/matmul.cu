// out[t, n] = Σ_k x[t, k] · w[n, k] (+ bias[n]).
//
// Per-element accumulation order (the invariance contract). Tile shapes and the kernel chosen
// vary with m (the number of rows); the order in which any one element accumulates its K never
// does, so a row's output bits are the same alone, in a batch, or in a prefill of any length.
//
// F32 activations (CUDA cores, never tf32): acc = 0; acc = fma(x[t,k], w[n,k], acc) for
// k = 0, 1, …, K-1; out = acc + bias. One kernel for every m.
//
// BF16 activations (tensor cores, mma.sync m16n8k16, f32 accumulate): w is the mma's A operand
// (16 output columns) and x its B operand (8 rows), so the decode and prefill kernels feed the
// tensor core identically. K is cut into segments of kMatmulSegmentK = 1024 (the last may be
// shorter), each cut into 32-element chunks, zero-padded past K. A chunk is two mma steps: with
// q = 0..3 the first takes the chunk's elements {8q .. 8q+3}, the second {8q+4 .. 8q+7} (each
// lane's 16-byte piece of a row splits into the two steps' k-pairs; see mma_chunk). Within a
// segment one f32 accumulator chains through every step from zero; the segment results are added
// in ascending order to a total that starts at 0; then + bias, then one rounding to the output
// dtype. Segment boundaries depend on K alone, so this is no M-dependent split-K: it is what lets
// decode spread one output's K over several warps.
//   m ≤ kMatmulDecodeMaxRows: the decode kernel, a block of four to eight warps per 8 or 16 weight
//     rows (the launch shape, chosen by size), the warps taking the segments in turn through their
//     own cp.async rings (the weights are read exactly once), warp 0 adding the segment results in
//     order. A matmul group's products share one launch.
//   larger m: the tiled GEMM (128×128 or 64×64 tiles of weight rows × x rows).
#include <algorithm>

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

// One chunk for one 16×8 tile: `upper`/`lower` are the lane's 16-byte pieces (k = 8q .. 8q+7 of the
// chunk) of weight rows g and g+8, `tokens` the piece of x row g; g = lane / 4, q = lane % 4.
// Word j of a piece holds k = 8q+2j, 8q+2j+1. The A/B fragments of m16n8k16 want, at lane (g, q),
// the k-pairs {2q, 2q+1} and {2q+8, 2q+9}; the first step gives them words 0 and 1, the second
// words 2 and 3. Both kernels call this, so both feed the tensor core the same products in the
// same positions.
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

// --- tiled GEMM ---
template <int kBlockColumns, int kBlockRows, int kWarpsColumns, int kWarpsRows, int kStages>
struct TiledConfig {
  static constexpr int kThreads = kWarpsColumns * kWarpsRows * 32;
  static constexpr int kWarpColumns = kBlockColumns / kWarpsColumns;
  static constexpr int kWarpRows = kBlockRows / kWarpsRows;
  static constexpr int kColumnTiles = kWarpColumns / 16;
  static constexpr int kRowTiles = kWarpRows / 8;
  static constexpr int kChunksPerStage = 2;
  static constexpr int kStageK = kChunk * kChunksPerStage;
  static constexpr int kStagesPerSegment = static_cast<int>(kMatmulSegmentK) / kStageK;
  static constexpr int kWeightStageBytes = kChunksPerStage * kBlockColumns * kChunkBytes;
  static constexpr int kInputStageBytes = kChunksPerStage * kBlockRows * kChunkBytes;
  static constexpr int kStageBytes = kWeightStageBytes + kInputStageBytes;
  static constexpr int kSharedBytes = kStages * kStageBytes;
  static constexpr int kBlockColumnsValue = kBlockColumns;
  static constexpr int kBlockRowsValue = kBlockRows;
  static constexpr int kWarpsRowsValue = kWarpsRows;
  static constexpr int kStagesValue = kStages;
};

// Shared layout per stage: weights [chunk][column][32 k], then x [chunk][row][32 k]; a warp's
// 16-byte reads of 8 consecutive lanes cover two adjacent 64-byte rows (conflict-free).
template <typename Config>
__device__ __forceinline__ void load_tiled_stage(uint8_t* stage, const bf16* x, const bf16* w, int64_t m, int64_t n,
                                                 int64_t k, int64_t row0, int64_t column0, int64_t k_base) {
  constexpr int kPiecesPerLine = Config::kChunksPerStage * 4;  // 16-byte pieces per row per stage
  for (int piece = threadIdx.x; piece < Config::kBlockColumnsValue * kPiecesPerLine; piece += Config::kThreads) {
    const int column = piece / kPiecesPerLine;
    const int chunk = (piece / 4) % Config::kChunksPerStage;
    const int q = piece % 4;
    const int64_t global_k = k_base + chunk * kChunk + q * 8;
    const bool valid = column0 + column < n && global_k < k;
    const bf16* source = valid ? w + (column0 + column) * k + global_k : w;
    cp_async_16(stage + (chunk * Config::kBlockColumnsValue + column) * kChunkBytes + q * 16, source, valid);
  }
  uint8_t* inputs = stage + Config::kWeightStageBytes;
  for (int piece = threadIdx.x; piece < Config::kBlockRowsValue * kPiecesPerLine; piece += Config::kThreads) {
    const int row = piece / kPiecesPerLine;
    const int chunk = (piece / 4) % Config::kChunksPerStage;
    const int q = piece % 4;
    const int64_t global_k = k_base + chunk * kChunk + q * 8;
    const bool valid = row0 + row < m && global_k < k;
    const bf16* source = valid ? x + (row0 + row) * k + global_k : x;
    cp_async_16(inputs + (chunk * Config::kBlockRowsValue + row) * kChunkBytes + q * 16, source, valid);
  }
}

template <typename Config>
__global__ void __launch_bounds__(Config::kThreads)
    matmul_bf16_tiled_kernel(const bf16* x, const bf16* w, const void* bias, DType bias_dtype, void* out,
                             DType out_dtype, int64_t m, int64_t n, int64_t k) {
  extern __shared__ uint4 shared_words[];
  uint8_t* shared = reinterpret_cast<uint8_t*>(shared_words);
  const int64_t column0 = static_cast<int64_t>(blockIdx.x) * Config::kBlockColumnsValue;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * Config::kBlockRowsValue;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, q = lane % 4;
  const int warp_column = (warp / Config::kWarpsRowsValue) * Config::kWarpColumns;
  const int warp_row = (warp % Config::kWarpsRowsValue) * Config::kWarpRows;

  float acc[Config::kColumnTiles][Config::kRowTiles][4] = {};
  float total[Config::kColumnTiles][Config::kRowTiles][4] = {};
  const int64_t stages = (k + Config::kStageK - 1) / Config::kStageK;
  for (int s = 0; s < Config::kStagesValue - 1; ++s) {
    if (s < stages)
      load_tiled_stage<Config>(shared + s * Config::kStageBytes, x, w, m, n, k, row0, column0,
                               static_cast<int64_t>(s) * Config::kStageK);
    cp_async_commit();
  }
  for (int64_t s = 0; s < stages; ++s) {
    cp_async_wait<Config::kStagesValue - 2>();
    __syncthreads();
    const int64_t prefetch = s + Config::kStagesValue - 1;
    if (prefetch < stages)
      load_tiled_stage<Config>(shared + (prefetch % Config::kStagesValue) * Config::kStageBytes, x, w, m, n, k, row0,
                               column0, prefetch * Config::kStageK);
    cp_async_commit();
    const uint8_t* stage = shared + (s % Config::kStagesValue) * Config::kStageBytes;
#pragma unroll
    for (int chunk = 0; chunk < Config::kChunksPerStage; ++chunk) {
      if (s * Config::kStageK + chunk * kChunk >= k) break;
      const uint8_t* weights = stage + chunk * Config::kBlockColumnsValue * kChunkBytes;
      const uint8_t* inputs = stage + Config::kWeightStageBytes + chunk * Config::kBlockRowsValue * kChunkBytes;
      uint4 upper[Config::kColumnTiles], lower[Config::kColumnTiles], tokens[Config::kRowTiles];
#pragma unroll
      for (int ct = 0; ct < Config::kColumnTiles; ++ct) {
        const int column = warp_column + ct * 16 + g;
        upper[ct] = load_shared_16(weights + column * kChunkBytes + q * 16);
        lower[ct] = load_shared_16(weights + (column + 8) * kChunkBytes + q * 16);
      }
#pragma unroll
      for (int rt = 0; rt < Config::kRowTiles; ++rt)
        tokens[rt] = load_shared_16(inputs + (warp_row + rt * 8 + g) * kChunkBytes + q * 16);
#pragma unroll
      for (int ct = 0; ct < Config::kColumnTiles; ++ct)
#pragma unroll
        for (int rt = 0; rt < Config::kRowTiles; ++rt) mma_chunk(acc[ct][rt], upper[ct], lower[ct], tokens[rt]);
    }
    if ((s + 1) % Config::kStagesPerSegment == 0 || s + 1 == stages) {
#pragma unroll
      for (int ct = 0; ct < Config::kColumnTiles; ++ct)
#pragma unroll
        for (int rt = 0; rt < Config::kRowTiles; ++rt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            total[ct][rt][e] = total[ct][rt][e] + acc[ct][rt][e];
            acc[ct][rt][e] = 0.0f;
          }
    }
  }
  cp_async_wait<0>();
#pragma unroll
  for (int ct = 0; ct < Config::kColumnTiles; ++ct)
#pragma unroll
    for (int rt = 0; rt < Config::kRowTiles; ++rt)
      store_tile(total[ct][rt], column0 + warp_column + ct * 16, row0 + warp_row + rt * 8, true, bias, bias_dtype, out,
                 out_dtype, m, n);
}

// --- decode: a block per kColumns weight rows; its warps take K segments in turn ---
constexpr int kDecodeChunksPerStage = 4;
constexpr int kDecodeStageK = kChunk * kDecodeChunksPerStage;
constexpr int kDecodeStagesPerSegment = static_cast<int>(kMatmulSegmentK) / kDecodeStageK;

// Shared memory: kWarps per-warp rings of kStages stages, each stage the weights [chunk][column][32 k]
// then the m rows of x [chunk][row][32 k] (only as many rows as there are: m is small), then each
// segment's partial sums [segment][row tile][element][lane].
template <int kColumns, int kRowTiles, int kStages, int kWarps>
struct DecodeConfig {
  static constexpr int kWeightStageBytes = kDecodeChunksPerStage * kColumns * kChunkBytes;
  static constexpr int kSegmentBytes = kRowTiles * 4 * 32 * 4;
  __host__ __device__ static int stage_bytes(int64_t m) {
    return kWeightStageBytes + kDecodeChunksPerStage * static_cast<int>(m) * kChunkBytes;
  }
  __host__ __device__ static int rings_bytes(int64_t m) { return kWarps * kStages * stage_bytes(m); }
};

template <int kColumns>
__device__ __forceinline__ void load_decode_weights(uint8_t* stage, const bf16* w, int64_t n, int64_t k,
                                                    int64_t column0, int64_t k_base) {
  constexpr int kPiecesPerLine = kDecodeChunksPerStage * 4;
  const int lane = threadIdx.x % 32;
  for (int piece = lane; piece < kColumns * kPiecesPerLine; piece += 32) {
    const int column = piece / kPiecesPerLine;
    const int chunk = (piece / 4) % kDecodeChunksPerStage;
    const int q = piece % 4;
    const int64_t global_k = k_base + chunk * kChunk + q * 8;
    const bool valid = column0 + column < n && global_k < k;
    const bf16* source = valid ? w + (column0 + column) * k + global_k : w;
    cp_async_16(stage + (chunk * kColumns + column) * kChunkBytes + q * 16, source, valid);
  }
}

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
    cp_async_16(inputs + (chunk * m + row) * kChunkBytes + q * 16, source, valid);
  }
}

// The products one decode launch computes (a matmul group, or one matmul): blocks
// [first_block[t], first_block[t + 1]) take product t's weight rows.
struct DecodeTargets {
  const bf16* w[kMatmulGroupMax];
  const void* bias[kMatmulGroupMax];
  void* out[kMatmulGroupMax];
  int64_t n[kMatmulGroupMax];
  DType bias_dtype[kMatmulGroupMax];
  DType out_dtype[kMatmulGroupMax];
  int first_block[kMatmulGroupMax + 1];
  int count;
};

// Warp w computes segments w, w + kWarps, … of the block's rows: each segment is an mma
// chain from zero over its 1024 k, streamed through the warp's own cp.async ring (the pipeline runs
// across the warp's segments without draining). Warp 0 then adds the segments in order.
template <int kColumns, int kRowTiles, int kStages, int kWarps>
__global__ void __launch_bounds__(kWarps * 32)
    matmul_bf16_decode_kernel(const bf16* x, DecodeTargets targets, int64_t m, int64_t k) {
  using Config = DecodeConfig<kColumns, kRowTiles, kStages, kWarps>;
  extern __shared__ uint4 shared_words[];
  int target = 0;
  while (target + 1 < targets.count && static_cast<int>(blockIdx.x) >= targets.first_block[target + 1]) ++target;
  const bf16* w = targets.w[target];
  const void* bias = targets.bias[target];
  const DType bias_dtype = targets.bias_dtype[target];
  void* out = targets.out[target];
  const DType out_dtype = targets.out_dtype[target];
  const int64_t n = targets.n[target];
  const int stage_bytes = Config::stage_bytes(m);
  float* segment_sums = reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(shared_words) + Config::rings_bytes(m));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint8_t* ring = reinterpret_cast<uint8_t*>(shared_words) + warp * kStages * stage_bytes;
  const int64_t column0 = static_cast<int64_t>(static_cast<int>(blockIdx.x) - targets.first_block[target]) * kColumns;
  const int g = lane / 4, q = lane % 4;
  const int64_t total_stages = (k + kDecodeStageK - 1) / kDecodeStageK;
  const int segments = static_cast<int>((total_stages + kDecodeStagesPerSegment - 1) / kDecodeStagesPerSegment);
  // The warp's stages, flattened over its segments: the i-th is stage stage_of(i) of K.
  const int my_segments = segments > warp ? (segments - warp + kWarps - 1) / kWarps : 0;
  auto segment_of = [&](int64_t i) { return warp + static_cast<int>(i / kDecodeStagesPerSegment) * kWarps; };
  auto stage_of = [&](int64_t i) {
    return static_cast<int64_t>(segment_of(i)) * kDecodeStagesPerSegment + i % kDecodeStagesPerSegment;
  };
  int64_t my_stages = 0;
  for (int i = 0; i < my_segments; ++i) {
    const int64_t first = static_cast<int64_t>(warp + i * kWarps) * kDecodeStagesPerSegment;
    my_stages += (total_stages - first < kDecodeStagesPerSegment ? total_stages - first : kDecodeStagesPerSegment);
  }
  // The first stages' weights are requested before waiting for the previous kernel (they are
  // constant), so with programmatic dependent launch their latency overlaps that kernel's end; x
  // and every store come after. The first commit group holds all those weights.
  for (int s = 0; s < kStages - 1; ++s)
    if (s < my_stages) load_decode_weights<kColumns>(ring + s * stage_bytes, w, n, k, column0, stage_of(s) * kDecodeStageK);
  follow_previous_grid();
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < my_stages) load_decode_inputs<Config>(ring + s * stage_bytes, x, m, k, stage_of(s) * kDecodeStageK);
    cp_async_commit();
  }
  const uint4 zero = make_uint4(0, 0, 0, 0);
  float acc[kRowTiles][4] = {};
  for (int64_t i = 0; i < my_stages; ++i) {
    cp_async_wait<kStages - 2>();
    __syncwarp();
    const int64_t prefetch = i + kStages - 1;
    if (prefetch < my_stages) {
      uint8_t* stage = ring + (prefetch % kStages) * stage_bytes;
      load_decode_weights<kColumns>(stage, w, n, k, column0, stage_of(prefetch) * kDecodeStageK);
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
      const uint4 upper = load_shared_16(weights + g * kChunkBytes + q * 16);
      const uint4 lower = kColumns == 16 ? load_shared_16(weights + (g + 8) * kChunkBytes + q * 16) : zero;
#pragma unroll
      for (int rt = 0; rt < kRowTiles; ++rt) {
        // B columns past m repeat row m − 1: they only feed outputs that are never stored.
        const int64_t row = rt * 8 + g < m ? rt * 8 + g : m - 1;
        mma_chunk(acc[rt], upper, lower, load_shared_16(inputs + row * kChunkBytes + q * 16));
      }
    }
    const bool segment_ends = (i + 1) % kDecodeStagesPerSegment == 0 || i + 1 == my_stages;
    if (segment_ends) {
      const int segment = segment_of(i);
#pragma unroll
      for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          segment_sums[((segment * kRowTiles + rt) * 4 + e) * 32 + lane] = acc[rt][e];
          acc[rt][e] = 0.0f;
        }
    }
  }
  cp_async_wait<0>();
  __syncthreads();
  if (warp != 0) return;
  float total[kRowTiles][4] = {};
  for (int segment = 0; segment < segments; ++segment)
#pragma unroll
    for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
      for (int e = 0; e < 4; ++e) total[rt][e] = total[rt][e] + segment_sums[((segment * kRowTiles + rt) * 4 + e) * 32 + lane];
#pragma unroll
  for (int rt = 0; rt < kRowTiles; ++rt)
    store_tile(total[rt], column0, rt * 8, kColumns == 16, bias, bias_dtype, out, out_dtype, m, n);
}

template <typename Config>
cudaError_t launch_tiled(const MatmulArgs& args, cudaStream_t stream) {
  auto* kernel = &matmul_bf16_tiled_kernel<Config>;
  static std::atomic<uint64_t> opted_in{0};
  if (cudaError_t status = allow_dynamic_shared(kernel, Config::kSharedBytes, opted_in); status != cudaSuccess)
    return status;
  const dim3 grid(blocks_for(args.n, Config::kBlockColumnsValue), blocks_for(args.m, Config::kBlockRowsValue));
  kernel<<<grid, Config::kThreads, Config::kSharedBytes, stream>>>(
      static_cast<const bf16*>(args.x), static_cast<const bf16*>(args.w), args.bias, args.bias_dtype, args.out,
      args.out_dtype, args.m, args.n, args.k);
  return cudaGetLastError();
}

template <int kColumns, int kRowTiles, int kStages, int kWarps>
cudaError_t launch_decode(const MatmulArgs* products, int count, cudaStream_t stream) {
  const MatmulArgs& args = products[0];  // x, m and k are shared
  using Config = DecodeConfig<kColumns, kRowTiles, kStages, kWarps>;
  auto* kernel = &matmul_bf16_decode_kernel<kColumns, kRowTiles, kStages, kWarps>;
  static std::atomic<uint64_t> opted_in{0};
  const int max_shared =
      Config::rings_bytes(kRowTiles * 8) + static_cast<int>(kMatmulMaxSegments) * Config::kSegmentBytes;
  if (cudaError_t status = allow_dynamic_shared(kernel, max_shared, opted_in); status != cudaSuccess) return status;
  const int segments = static_cast<int>((args.k + kMatmulSegmentK - 1) / kMatmulSegmentK);
  const int shared = Config::rings_bytes(args.m) + segments * Config::kSegmentBytes;
  DecodeTargets targets{};
  targets.count = count;
  for (int t = 0; t < count; ++t) {
    targets.w[t] = static_cast<const bf16*>(products[t].w);
    targets.bias[t] = products[t].bias;
    targets.bias_dtype[t] = products[t].bias_dtype;
    targets.out[t] = products[t].out;
    targets.out_dtype[t] = products[t].out_dtype;
    targets.n[t] = products[t].n;
    targets.first_block[t + 1] = targets.first_block[t] + static_cast<int>(blocks_for(products[t].n, kColumns));
  }
  // The blocks may start (and request their first weights) while the previous kernel on the stream
  // finishes; the kernel waits for it before touching x or out.
  return launch_after_previous(kernel, dim3(static_cast<unsigned>(targets.first_block[count])), dim3(kWarps * 32),
                               static_cast<size_t>(shared), stream, static_cast<const bf16*>(args.x), targets, args.m,
                               args.k);
}

// The decode launch shapes (weight rows per block, warps per block, ring stages per warp) for m ≤ 8;
// m = 9..16 use the first two with 4 stages (their x rows double a stage's size). Every shape
// gives the same bits; they differ in how the grid fills the multiprocessors.
constexpr DecodeLaunchShape kDecodeShapes[] = {{16, 4, 6}, {8, 4, 6}, {16, 4, 3}, {8, 4, 3}, {16, 8, 3}, {8, 8, 4}};

cudaError_t launch_decode_shape(const MatmulArgs* products, int count, int shape, cudaStream_t stream) {
  if (products[0].m > 8) {
    if (shape == 0) return launch_decode<16, 2, 4, 4>(products, count, stream);
    if (shape == 1) return launch_decode<8, 2, 4, 4>(products, count, stream);
    return cudaErrorInvalidValue;
  }
  switch (shape) {
    case 0: return launch_decode<16, 1, 6, 4>(products, count, stream);
    case 1: return launch_decode<8, 1, 6, 4>(products, count, stream);
    case 2: return launch_decode<16, 1, 3, 4>(products, count, stream);
    case 3: return launch_decode<8, 1, 3, 4>(products, count, stream);
    case 4: return launch_decode<16, 1, 3, 8>(products, count, stream);
    case 5: return launch_decode<8, 1, 4, 8>(products, count, stream);
    default: return cudaErrorInvalidValue;
  }
}

using LargeTiles = TiledConfig<128, 128, 2, 4, 4>;
using SmallTiles = TiledConfig<64, 64, 2, 2, 4>;

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

int decode_launch_shape_count(int64_t m) { return m > 8 ? 2 : static_cast<int>(std::size(kDecodeShapes)); }
DecodeLaunchShape decode_launch_shape(int64_t m, int shape) {
  DecodeLaunchShape result = kDecodeShapes[shape];
  if (m > 8) result.stages = 4;
  return result;
}

cudaError_t launch_matmul_bf16_decode(const MatmulArgs* products, int count, int shape, cudaStream_t stream) {
  if (count < 1 || count > kMatmulGroupMax || products[0].m < 1 || products[0].m > kMatmulDecodeMaxRows ||
      shape < 0 || shape >= decode_launch_shape_count(products[0].m))
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
    if (first.m > 8) return launch_decode_shape(products, count, wide_blocks < sms ? 1 : 0, stream);
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
  for (int t = 0; t < count; ++t) {
    const MatmulArgs& args = products[t];
    if (args.n == 0) continue;
    const int64_t large_blocks = ((args.n + 127) / 128) * ((args.m + 127) / 128);
    const cudaError_t status = large_blocks >= args.multiprocessors ? launch_tiled<LargeTiles>(args, stream)
                                                                    : launch_tiled<SmallTiles>(args, stream);
    if (status != cudaSuccess) return status;
  }
  return cudaSuccess;
}

}  // namespace kiln::cuda
