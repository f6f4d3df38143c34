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
// tensor core identically. K is consumed in 32-element chunks in ascending order, zero-padded
// past K; a chunk is two mma steps chained through one f32 accumulator: with q = 0..3 the first
// step takes the chunk's elements {8q .. 8q+3}, the second {8q+4 .. 8q+7} (each lane's 16-byte
// piece of a row splits into the two steps' k-pairs; see mma_chunk). Then + bias, then one
// rounding to the output dtype. No split-K: one accumulator chain per element over all of K.
//   m ≤ kMatmulDecodeMaxRows: the decode kernel, one warp per 8 or 16 weight rows streaming its
//     rows once through a deep cp.async ring (the weights are read exactly once).
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
  }
  cp_async_wait<0>();
#pragma unroll
  for (int ct = 0; ct < Config::kColumnTiles; ++ct)
#pragma unroll
    for (int rt = 0; rt < Config::kRowTiles; ++rt)
      store_tile(acc[ct][rt], column0 + warp_column + ct * 16, row0 + warp_row + rt * 8, true, bias, bias_dtype, out,
                 out_dtype, m, n);
}

// --- decode: one warp per kColumns weight rows, all of K, m ≤ 8·kRowTiles ---
constexpr int kDecodeChunksPerStage = 4;
constexpr int kDecodeStageK = kChunk * kDecodeChunksPerStage;

template <int kColumns, int kRowTiles, int kStages>
struct DecodeConfig {
  static constexpr int kWeightStageBytes = kDecodeChunksPerStage * kColumns * kChunkBytes;
  static constexpr int kInputStageBytes = kDecodeChunksPerStage * kRowTiles * 8 * kChunkBytes;
  static constexpr int kStageBytes = kWeightStageBytes + kInputStageBytes;
  static constexpr int kSharedBytes = kStages * kStageBytes;
};

template <int kColumns, int kRowTiles, int kStages>
__device__ __forceinline__ void load_decode_stage(uint8_t* stage, const bf16* x, const bf16* w, int64_t m, int64_t n,
                                                  int64_t k, int64_t column0, int64_t k_base) {
  using Config = DecodeConfig<kColumns, kRowTiles, kStages>;
  constexpr int kPiecesPerLine = kDecodeChunksPerStage * 4;
  const int lane = threadIdx.x;
  for (int piece = lane; piece < kColumns * kPiecesPerLine; piece += 32) {
    const int column = piece / kPiecesPerLine;
    const int chunk = (piece / 4) % kDecodeChunksPerStage;
    const int q = piece % 4;
    const int64_t global_k = k_base + chunk * kChunk + q * 8;
    const bool valid = column0 + column < n && global_k < k;
    const bf16* source = valid ? w + (column0 + column) * k + global_k : w;
    cp_async_16(stage + (chunk * kColumns + column) * kChunkBytes + q * 16, source, valid);
  }
  // Only the m real rows of x are copied: the other columns of the B fragment feed only output
  // rows that are never stored (an mma element depends on its own row and column alone).
  uint8_t* inputs = stage + Config::kWeightStageBytes;
  for (int piece = lane; piece < m * kPiecesPerLine; piece += 32) {
    const int row = piece / kPiecesPerLine;
    const int chunk = (piece / 4) % kDecodeChunksPerStage;
    const int q = piece % 4;
    const int64_t global_k = k_base + chunk * kChunk + q * 8;
    const bool valid = global_k < k;
    const bf16* source = valid ? x + row * k + global_k : x;
    cp_async_16(inputs + (chunk * kRowTiles * 8 + row) * kChunkBytes + q * 16, source, valid);
  }
}

template <int kColumns, int kRowTiles, int kStages>
__global__ void __launch_bounds__(32)
    matmul_bf16_decode_kernel(const bf16* x, const bf16* w, const void* bias, DType bias_dtype, void* out,
                              DType out_dtype, int64_t m, int64_t n, int64_t k) {
  using Config = DecodeConfig<kColumns, kRowTiles, kStages>;
  extern __shared__ uint4 shared_words[];
  uint8_t* shared = reinterpret_cast<uint8_t*>(shared_words);
  const int64_t column0 = static_cast<int64_t>(blockIdx.x) * kColumns;
  const int lane = threadIdx.x;
  const int g = lane / 4, q = lane % 4;
  float acc[kRowTiles][4] = {};
  const int64_t stages = (k + kDecodeStageK - 1) / kDecodeStageK;
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < stages)
      load_decode_stage<kColumns, kRowTiles, kStages>(shared + s * Config::kStageBytes, x, w, m, n, k, column0,
                                                      static_cast<int64_t>(s) * kDecodeStageK);
    cp_async_commit();
  }
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int64_t s = 0; s < stages; ++s) {
    cp_async_wait<kStages - 2>();
    __syncwarp();
    const int64_t prefetch = s + kStages - 1;
    if (prefetch < stages)
      load_decode_stage<kColumns, kRowTiles, kStages>(shared + (prefetch % kStages) * Config::kStageBytes, x, w, m,
                                                      n, k, column0, prefetch * kDecodeStageK);
    cp_async_commit();
    const uint8_t* stage = shared + (s % kStages) * Config::kStageBytes;
#pragma unroll
    for (int chunk = 0; chunk < kDecodeChunksPerStage; ++chunk) {
      if (s * kDecodeStageK + chunk * kChunk >= k) break;
      const uint8_t* weights = stage + chunk * kColumns * kChunkBytes;
      const uint8_t* inputs = stage + Config::kWeightStageBytes + chunk * kRowTiles * 8 * kChunkBytes;
      const uint4 upper = load_shared_16(weights + g * kChunkBytes + q * 16);
      const uint4 lower = kColumns == 16 ? load_shared_16(weights + (g + 8) * kChunkBytes + q * 16) : zero;
#pragma unroll
      for (int rt = 0; rt < kRowTiles; ++rt)
        mma_chunk(acc[rt], upper, lower, load_shared_16(inputs + (rt * 8 + g) * kChunkBytes + q * 16));
    }
  }
  cp_async_wait<0>();
#pragma unroll
  for (int rt = 0; rt < kRowTiles; ++rt)
    store_tile(acc[rt], column0, rt * 8, kColumns == 16, bias, bias_dtype, out, out_dtype, m, n);
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

template <int kColumns, int kRowTiles>
cudaError_t launch_decode(const MatmulArgs& args, cudaStream_t stream) {
  // Eight 4 KB-or-smaller weight stages in flight per warp: enough bytes in flight for HBM with a
  // few warps per multiprocessor.
  constexpr int kStages = 8;
  using Config = DecodeConfig<kColumns, kRowTiles, kStages>;
  auto* kernel = &matmul_bf16_decode_kernel<kColumns, kRowTiles, kStages>;
  static std::atomic<uint64_t> opted_in{0};
  if (cudaError_t status = allow_dynamic_shared(kernel, Config::kSharedBytes, opted_in); status != cudaSuccess)
    return status;
  kernel<<<blocks_for(args.n, kColumns), 32, Config::kSharedBytes, stream>>>(
      static_cast<const bf16*>(args.x), static_cast<const bf16*>(args.w), args.bias, args.bias_dtype, args.out,
      args.out_dtype, args.m, args.n, args.k);
  return cudaGetLastError();
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
  if (args.m == 0 || args.n == 0) return cudaSuccess;
  if (args.m <= kMatmulDecodeMaxRows) {
    // Halve the rows per warp when 16-row warps would leave multiprocessors without two warps.
    const bool narrow = (args.n + 15) / 16 < 2 * static_cast<int64_t>(args.multiprocessors);
    if (args.m <= 8) return narrow ? launch_decode<8, 1>(args, stream) : launch_decode<16, 1>(args, stream);
    return narrow ? launch_decode<8, 2>(args, stream) : launch_decode<16, 2>(args, stream);
  }
  const int64_t large_blocks = ((args.n + 127) / 128) * ((args.m + 127) / 128);
  if (large_blocks >= args.multiprocessors) return launch_tiled<LargeTiles>(args, stream);
  return launch_tiled<SmallTiles>(args, stream);
}

}  // namespace kiln::cuda
