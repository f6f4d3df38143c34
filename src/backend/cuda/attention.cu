// Causal GQA attention over the KV cache.
//
// Invariance: a query's output depends only on its own q, its position p and the cache rows
// 0..p of its slot — never on the other tokens of the call, so one token decoded alone, the same
// token inside a batch, and the same token inside any chunking of a prefill give the same bits.
//
// The cache is paged (backend.h): a slot's positions [64·i, 64·i + 64) are one pool block, named by
// entry i of the slot's block table. Every key tile below (32 keys in f32, 64 in bf16) starts at a
// multiple of its size, so it lies inside one block: a tile reads one table entry, and which block
// holds its rows changes no arithmetic.
//
// F32 activations (CUDA cores): one warp per (token, head) walks the keys 0..p in 32-key tiles in
// order (lane j scores key j of the tile with an f32 FMA chain over head_dim), with an online
// softmax; the same kernel serves every call.
//
// BF16 activations (tensor cores, mma.sync m16n8k16, f32 accumulate). The canonical computation of
// one query row: keys are cut into fixed splits of kAttentionSplitKeys = 64 keys from position 0,
// each cut into 64-key tiles (one today). Within a split, tiles are taken in order with an online softmax
// (scores s = q·k · scale·log2 e, p = 2^(s − running max), P rounded to bf16 for P·V); a split
// yields a partial (m, l, o). Partials are folded left to right, starting from (−∞, 0, 0):
// M' = max(M, m), L' = L·2^(M−M') + l·2^(m−M'), O' = O·2^(M−M') + o·2^(m−M'); out = O / L.
//   prefill (many tokens): a block folds every split of its rows itself;
//   decode (≤ kAttentionDecodeMaxTokens tokens): one block per split writes its partial, and a second
//   kernel folds them in split order — the same fold, so the same bits.
// Tiles or splits lying wholly past a row's position are exact no-ops for that row (their p are
// 0 and the guards below keep −∞ − −∞ out), so processing them or not changes nothing. Rows of a
// block are (token, head) pairs of one sequence that share a KV head; mma rows never mix, so which
// rows share a block does not matter. Expressions shared by both paths use explicit _rn
// intrinsics so that the compiler cannot contract them differently in the two kernels.
#include <cmath>

#include "backend/cuda/device_math.cuh"
#include "backend/cuda/kernels.h"

namespace kiln::cuda {
namespace {

constexpr float kLog2E = 1.4426950408889634f;

// ------------------------------------------------------------------------------------------
// F32 activations
// ------------------------------------------------------------------------------------------
constexpr int kF32WarpsPerBlock = 4;
constexpr int64_t kF32KeyTile = 32;  // a lane per key
static_assert(kKvBlockRows % kF32KeyTile == 0, "a 32-key tile must lie inside one cache block");

template <int kDimsPerLane>
__global__ void __launch_bounds__(kF32WarpsPerBlock * 32)
    attention_f32_kernel(const float* q, const float* k_cache, const float* v_cache, KvBlockTable table,
                         const int32_t* slots, const int32_t* positions, int64_t heads, int64_t kv_heads,
                         int64_t head_dim, float scale, float* out) {
  follow_previous_grid();
  extern __shared__ float query_rows[];  // [warps][head_dim]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t token = blockIdx.x;
  const int64_t head = static_cast<int64_t>(blockIdx.y) * kF32WarpsPerBlock + warp;
  if (head >= heads) return;
  const int64_t kv_head = head / (heads / kv_heads);
  const int64_t slot = slots[token];
  const int64_t position = positions[token];
  float* query = query_rows + warp * head_dim;
  for (int64_t d = lane; d < head_dim; d += 32) query[d] = q[(token * heads + head) * head_dim + d];
  __syncwarp();
  const int64_t key_stride = kv_heads * head_dim;
  const float* keys = k_cache + kv_head * head_dim;
  const float* values = v_cache + kv_head * head_dim;

  float running_max = -INFINITY, running_sum = 0.0f;
  float acc[kDimsPerLane] = {};
  for (int64_t tile = 0; tile <= position; tile += kF32KeyTile) {
    const int64_t tile_row = kv_pool_row(table, slot, tile);
    const int64_t key = tile + lane;
    float score = -INFINITY;
    if (key <= position) {
      const float* row = keys + (tile_row + lane) * key_stride;
      float dot = 0.0f;
      for (int64_t d = 0; d < head_dim; ++d) dot = fmaf(query[d], row[d], dot);
      score = dot * scale;
    }
    const float tile_max = warp_max(score);  // finite: key `tile` ≤ position
    const float new_max = fmaxf(running_max, tile_max);
    const float rescale = expf(running_max - new_max);
    const float p = key <= position ? expf(score - new_max) : 0.0f;
    running_sum = running_sum * rescale + warp_sum(p);
    running_max = new_max;
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i) acc[i] *= rescale;
    const int64_t tile_keys = position - tile + 1 < 32 ? position - tile + 1 : 32;
    for (int j = 0; j < tile_keys; ++j) {
      const float weight = __shfl_sync(0xffffffffu, p, j);
      const float* row = values + (tile_row + j) * key_stride;
#pragma unroll
      for (int i = 0; i < kDimsPerLane; ++i) {
        const int64_t d = lane + 32 * i;
        if (d < head_dim) acc[i] = fmaf(weight, row[d], acc[i]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i) {
    const int64_t d = lane + 32 * i;
    if (d < head_dim) out[(token * heads + head) * head_dim + d] = acc[i] / running_sum;
  }
}

template <int kDimsPerLane>
cudaError_t launch_f32(const AttentionArgs& args, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(args.tokens), blocks_for(args.heads, kF32WarpsPerBlock));
  const size_t shared = kF32WarpsPerBlock * args.head_dim * sizeof(float);
  launch_after_previous(&attention_f32_kernel<kDimsPerLane>, grid, kF32WarpsPerBlock * 32, shared, stream,
                        static_cast<const float*>(args.q), static_cast<const float*>(args.k_cache),
                        static_cast<const float*>(args.v_cache), args.table, args.slots, args.positions, args.heads,
                        args.kv_heads, args.head_dim, args.scale, static_cast<float*>(args.out));
  return cudaGetLastError();
}

// ------------------------------------------------------------------------------------------
// BF16 activations
// ------------------------------------------------------------------------------------------
constexpr int kKeyTile = 64;
constexpr int kTilesPerSplit = static_cast<int>(kAttentionSplitKeys) / kKeyTile;
static_assert(kKeyTile == kKvBlockRows && kAttentionSplitKeys % kKvBlockRows == 0,
              "a key tile must be one cache block, and a split whole blocks");
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kBlockRows = kWarps * 16;  // (token, head) rows per block

template <int kHeadDim>
struct Bf16Config {
  static constexpr int kStride = kHeadDim + 8;  // bf16 elements per shared row (16-byte pad: no bank conflicts)
  static constexpr int kKeyBuffers = kHeadDim <= 128 ? 2 : 1;
  static constexpr int kQueryBytes = kBlockRows * kStride * 2;
  static constexpr int kTileBytes = kKeyTile * kStride * 2;
  // Prefill's running O per row: in registers up to head_dim 128 (a second set of accumulators,
  // so the fold after every 64-key split touches no shared memory); at 256 that would spill, so
  // it lives in shared memory there.
  static constexpr bool kFoldInRegisters = kHeadDim <= 128;
  static constexpr int kFoldBytes = kFoldInRegisters ? 0 : kBlockRows * kHeadDim * 4;
  static constexpr int kSharedBytes(bool split_kv) {
    return kQueryBytes + kKeyBuffers * 2 * kTileBytes + (split_kv ? 0 : kFoldBytes);
  }
};

// The state of one warp's 16 rows inside a split. Lane (g, q) holds rows g and g + 8.
template <int kHeadDim>
struct SplitState {
  float max[2];
  float sum[2];  // this lane's share of the row sums (summed over the quad at the split's end)
  float acc[kHeadDim / 8][4];

  __device__ __forceinline__ void reset() {
    max[0] = max[1] = -INFINITY;
    sum[0] = sum[1] = 0.0f;
#pragma unroll
    for (int t = 0; t < kHeadDim / 8; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;
  }
};

// One 64-key tile for a warp's 16 rows: queries [16][stride], keys/values [64][stride] in shared
// memory. positions[r] is the position of row g (r = 0) and g + 8 (r = 1), −1 for padding rows.
template <int kHeadDim>
__device__ __forceinline__ void attend_tile(SplitState<kHeadDim>& state, const bf16* queries, const bf16* keys,
                                            const bf16* values, int64_t key_base, const int64_t (&positions)[2],
                                            float scale_log2) {
  constexpr int kStride = Bf16Config<kHeadDim>::kStride;
  const int lane = threadIdx.x % 32;
  const int q = lane % 4;
  float scores[8][4];
#pragma unroll
  for (int t = 0; t < 8; ++t) scores[t][0] = scores[t][1] = scores[t][2] = scores[t][3] = 0.0f;
  // Fragments by ldmatrix: lane ℓ addresses row ℓ % 8 of matrix ℓ / 8. The query A fragment's
  // matrices are rows 0–7 / 8–15 by dims d / d + 8; two key tiles' B fragments are keys 8t / 8t + 8
  // by dims d / d + 8 (the same operand values as 32-bit loads of the same elements).
  const int matrix = lane / 8, matrix_row = lane % 8;
#pragma unroll
  for (int d = 0; d < kHeadDim; d += 16) {
    uint32_t a[4];
    ldmatrix_x4(a, queries + ((matrix % 2) * 8 + matrix_row) * kStride + d + (matrix / 2) * 8);
#pragma unroll
    for (int t = 0; t < 8; t += 2) {
      uint32_t b[4];
      ldmatrix_x4(b, keys + ((t + matrix / 2) * 8 + matrix_row) * kStride + d + (matrix % 2) * 8);
      mma_bf16_16816(scores[t], a, b[0], b[1]);
      mma_bf16_16816(scores[t + 1], a, b[2], b[3]);
    }
  }
  // Scale into log2 units and mask keys past each row's position.
#pragma unroll
  for (int t = 0; t < 8; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t key = key_base + t * 8 + 2 * q + (i & 1);
      scores[t][i] = key <= positions[i >> 1] ? __fmul_rn(scores[t][i], scale_log2) : -INFINITY;
    }
  float offset[2], rescale[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float tile_max = -INFINITY;
#pragma unroll
    for (int t = 0; t < 8; ++t) tile_max = fmaxf(tile_max, fmaxf(scores[t][2 * r], scores[t][2 * r + 1]));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    const float new_max = fmaxf(state.max[r], tile_max);
    // A row with nothing unmasked yet keeps max −∞; offset 0 keeps 2^(−∞ − offset) = 0 exact.
    offset[r] = new_max == -INFINITY ? 0.0f : new_max;
    rescale[r] = exp2f(__fsub_rn(state.max[r], offset[r]));
    state.max[r] = new_max;
  }
  float tile_sum[2] = {0.0f, 0.0f};
#pragma unroll
  for (int t = 0; t < 8; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      scores[t][i] = exp2f(__fsub_rn(scores[t][i], offset[i >> 1]));
      tile_sum[i >> 1] = __fadd_rn(tile_sum[i >> 1], scores[t][i]);
    }
#pragma unroll
  for (int r = 0; r < 2; ++r) state.sum[r] = __fmaf_rn(state.sum[r], rescale[r], tile_sum[r]);
#pragma unroll
  for (int t = 0; t < kHeadDim / 8; ++t) {
    state.acc[t][0] = __fmul_rn(state.acc[t][0], rescale[0]);
    state.acc[t][1] = __fmul_rn(state.acc[t][1], rescale[0]);
    state.acc[t][2] = __fmul_rn(state.acc[t][2], rescale[1]);
    state.acc[t][3] = __fmul_rn(state.acc[t][3], rescale[1]);
  }
  // O += P·V, P as the A operand straight from the score registers.
#pragma unroll
  for (int step = 0; step < kKeyTile / 16; ++step) {
    uint32_t a[4];
    a[0] = pack_bf16x2(scores[2 * step][0], scores[2 * step][1]);
    a[1] = pack_bf16x2(scores[2 * step][2], scores[2 * step][3]);
    a[2] = pack_bf16x2(scores[2 * step + 1][0], scores[2 * step + 1][1]);
    a[3] = pack_bf16x2(scores[2 * step + 1][2], scores[2 * step + 1][3]);
    const bf16* value_rows = values + (step * 16 + lane % 16) * kStride + (lane / 16) * 8;
#pragma unroll
    for (int t = 0; t < kHeadDim / 8; t += 2) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, value_rows + t * 8);
      mma_bf16_16816(state.acc[t], a, b[0], b[1]);
      mma_bf16_16816(state.acc[t + 1], a, b[2], b[3]);
    }
  }
}

// The row sums of a finished split: the quad's shares added with a fixed butterfly.
__device__ __forceinline__ float quad_sum(float value) {
  value = __fadd_rn(value, __shfl_xor_sync(0xffffffffu, value, 1));
  return __fadd_rn(value, __shfl_xor_sync(0xffffffffu, value, 2));
}

// One step of the left fold of split partials (see the file comment). Returns the new max.
__device__ __forceinline__ void fold_weights(float total_max, float split_max, float& new_max, float& total_weight,
                                             float& split_weight) {
  new_max = fmaxf(total_max, split_max);
  const float offset = new_max == -INFINITY ? 0.0f : new_max;
  total_weight = exp2f(__fsub_rn(total_max, offset));
  split_weight = exp2f(__fsub_rn(split_max, offset));
}
__device__ __forceinline__ float fold_value(float total, float total_weight, float split, float split_weight) {
  return __fmaf_rn(total, total_weight, __fmul_rn(split, split_weight));
}

struct RowTile {
  int64_t first_token, first_position, row_begin, rows, group;
  __device__ __forceinline__ int64_t position(int row) const {
    return row_begin + row < rows ? first_position + (row_begin + row) / group : -1;
  }
  __device__ __forceinline__ int64_t token(int row) const { return first_token + (row_begin + row) / group; }
  __device__ __forceinline__ int64_t head_in_group(int row) const { return (row_begin + row) % group; }
};

// Copies keys [key_base + first_row, key_base + end_row) of (slot, kv_head) into shared rows
// first_row..end_row − 1, zeros past kv_length and past the model's head_dim (≤ kHeadDim). The
// tile's keys are the block whose first pool row is tile_row (key_base is a multiple of kKeyTile).
template <int kHeadDim>
__device__ __forceinline__ void load_key_tile(bf16* destination, const bf16* cache, int64_t tile_row,
                                              int64_t kv_heads, int64_t kv_head, int64_t head_dim, int64_t key_base,
                                              int64_t kv_length, int first_row = 0, int end_row = kKeyTile) {
  constexpr int kStride = Bf16Config<kHeadDim>::kStride;
  constexpr int kPieces = kHeadDim / 8;
  for (int piece = first_row * kPieces + threadIdx.x; piece < end_row * kPieces; piece += kThreads) {
    const int key = piece / kPieces, part = piece % kPieces;
    const bool valid = key_base + key < kv_length && part * 8 < head_dim;
    const bf16* source = valid ? cache + ((tile_row + key) * kv_heads + kv_head) * head_dim + part * 8 : cache;
    cp_async_16(destination + key * kStride + part * 8, source, valid);
  }
}

// kSplitKV false: prefill, grid (row tiles, spans, kv heads), each block folds all its splits.
// kSplitKV true: decode, grid (row tiles × max splits, spans, kv heads), one split per block.
// head_dim is the model's (a multiple of 8, ≤ kHeadDim, the row stride of q, the cache and out); a
// smaller one is zero-padded to kHeadDim in shared memory, and zeros add nothing to q·k or P·V.
template <int kHeadDim, bool kSplitKV>
__global__ void __launch_bounds__(kThreads)
    attention_bf16_kernel(const bf16* q, const bf16* k_cache, const bf16* v_cache, KvBlockTable table,
                          const int32_t* spans, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t max_splits,
                          float scale_log2, bf16* out, float* partials) {
  using Config = Bf16Config<kHeadDim>;
  constexpr int kStride = Config::kStride;
  extern __shared__ uint4 shared_words[];
  bf16* queries = reinterpret_cast<bf16*>(shared_words);
  bf16* key_tiles = queries + kBlockRows * kStride;  // [buffers][keys, values][64][stride]
  float* fold = reinterpret_cast<float*>(key_tiles + Config::kKeyBuffers * 2 * kKeyTile * kStride);

  const int64_t group = heads / kv_heads;
  const int64_t kv_head = blockIdx.z;
  const int32_t* span = spans + 4 * static_cast<int64_t>(blockIdx.y);
  const int64_t slot = span[0];
  const int64_t split = kSplitKV ? blockIdx.x % max_splits : 0;
  // Prefill takes its row tiles last first: later rows attend to more keys, and blocks start in
  // launch order, so the long tiles start early and the short ones fill the last wave.
  const int64_t tile_index = kSplitKV ? blockIdx.x / max_splits : gridDim.x - 1 - blockIdx.x;
  RowTile tile{span[1], span[3], tile_index * kBlockRows, static_cast<int64_t>(span[2]) * group, group};
  const int64_t last_row = (tile.rows - tile.row_begin < kBlockRows ? tile.rows - tile.row_begin : kBlockRows) - 1;
  const int64_t kv_length = tile.position(static_cast<int>(last_row)) + 1;
  const int64_t key_begin = kSplitKV ? split * kAttentionSplitKeys : 0;
  const bool has_work = tile.row_begin < tile.rows && key_begin < kv_length;
  const int64_t key_end = kSplitKV && key_begin + kAttentionSplitKeys < kv_length ? key_begin + kAttentionSplitKeys
                                                                                 : kv_length;
  const int64_t tiles = (key_end - key_begin + kKeyTile - 1) / kKeyTile;
  // The first tile's pool rows (its block from the table), read once for its prefetch and its load.
  const int64_t first_tile_row = has_work ? kv_pool_row(table, slot, key_begin) : 0;
  // Decode: cache rows before the span's first position were written by earlier steps, so a split
  // requests them before waiting for the kernel before it (which writes this step's rows); their
  // latency then overlaps that kernel's end. Every block still waits before it exits.
  int prefetched_rows = 0;
  if (kSplitKV && has_work) {
    const int64_t earlier_rows = tile.first_position - key_begin;
    prefetched_rows = static_cast<int>(earlier_rows < 0 ? 0 : (earlier_rows < kKeyTile ? earlier_rows : kKeyTile));
    load_key_tile<kHeadDim>(key_tiles, k_cache, first_tile_row, kv_heads, kv_head, head_dim, key_begin, kv_length, 0,
                            prefetched_rows);
    load_key_tile<kHeadDim>(key_tiles + kKeyTile * kStride, v_cache, first_tile_row, kv_heads, kv_head, head_dim,
                            key_begin, kv_length, 0, prefetched_rows);
  }
  follow_previous_grid();
  if (!has_work) return;

  // Queries of the block's rows (zeros for padding rows).
  for (int piece = threadIdx.x; piece < kBlockRows * (kHeadDim / 8); piece += kThreads) {
    const int row = piece / (kHeadDim / 8), part = piece % (kHeadDim / 8);
    const bool valid = tile.position(row) >= 0 && part * 8 < head_dim;
    const int64_t head = kv_head * group + tile.head_in_group(row);
    const bf16* source = valid ? q + (tile.token(row) * heads + head) * head_dim + part * 8 : q;
    cp_async_16(queries + row * kStride + part * 8, source, valid);
  }
  auto issue_tile = [&](int64_t index) {
    bf16* buffer = key_tiles + (index % Config::kKeyBuffers) * 2 * kKeyTile * kStride;
    const int64_t key_base = key_begin + index * kKeyTile;
    const int first_row = index == 0 ? prefetched_rows : 0;
    const int64_t tile_row = index == 0 ? first_tile_row : kv_pool_row(table, slot, key_base);
    load_key_tile<kHeadDim>(buffer, k_cache, tile_row, kv_heads, kv_head, head_dim, key_base, kv_length, first_row);
    load_key_tile<kHeadDim>(buffer + kKeyTile * kStride, v_cache, tile_row, kv_heads, kv_head, head_dim, key_base,
                            kv_length, first_row);
    cp_async_commit();
  };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, q4 = lane % 4;
  const int64_t positions[2] = {tile.position(warp * 16 + g), tile.position(warp * 16 + g + 8)};
  const bool warp_has_rows = tile.position(warp * 16) >= 0;
  SplitState<kHeadDim> state;
  state.reset();
  float total_max[2] = {-INFINITY, -INFINITY}, total_sum[2] = {0.0f, 0.0f};
  // The prefill fold of O: lane (g, q4) owns the same elements as its accumulators, whether they
  // sit in folded_registers or in this warp's shared rows.
  constexpr bool kFoldInRegisters = Config::kFoldInRegisters;
  float folded_registers[kFoldInRegisters ? kHeadDim / 8 : 1][4] = {};
  float* warp_fold = fold + warp * 16 * kHeadDim;
  auto folded = [&](int t, int i) -> float& {
    if constexpr (kFoldInRegisters)
      return folded_registers[t][i];
    else
      return warp_fold[(g + 8 * (i >> 1)) * kHeadDim + t * 8 + 2 * q4 + (i & 1)];
  };
  if constexpr (!kSplitKV && !kFoldInRegisters) {
    for (int i = lane; i < 16 * kHeadDim; i += 32) warp_fold[i] = 0.0f;
  }

  // Ends a split: its partial goes to the fold (prefill) or to the partials buffer (decode).
  auto finish_split = [&](int64_t split_index) {
    float sums[2] = {quad_sum(state.sum[0]), quad_sum(state.sum[1])};
    if constexpr (kSplitKV) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = warp * 16 + g + 8 * r;
        if (positions[r] < 0) continue;
        const int64_t head = kv_head * group + tile.head_in_group(row);
        const int64_t base = (tile.token(row) * heads + head) * max_splits + split_index;
        float* o = partials + base * (kHeadDim + 2);
        if (q4 == 0) {
          o[kHeadDim] = state.max[r];
          o[kHeadDim + 1] = sums[r];
        }
#pragma unroll
        for (int t = 0; t < kHeadDim / 8; ++t) {
          o[t * 8 + 2 * q4] = state.acc[t][2 * r];
          o[t * 8 + 2 * q4 + 1] = state.acc[t][2 * r + 1];
        }
      }
    } else {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float new_max, total_weight, split_weight;
        fold_weights(total_max[r], state.max[r], new_max, total_weight, split_weight);
        total_sum[r] = fold_value(total_sum[r], total_weight, sums[r], split_weight);
        total_max[r] = new_max;
#pragma unroll
        for (int t = 0; t < kHeadDim / 8; ++t)
#pragma unroll
          for (int i = 2 * r; i < 2 * r + 2; ++i)
            folded(t, i) = fold_value(folded(t, i), total_weight, state.acc[t][i], split_weight);
      }
    }
    state.reset();
  };

  issue_tile(0);
  for (int64_t index = 0; index < tiles; ++index) {
    const bool prefetch = Config::kKeyBuffers == 2 && index + 1 < tiles;
    if (prefetch) issue_tile(index + 1);
    if (prefetch)
      cp_async_wait<1>();
    else
      cp_async_wait<0>();
    __syncthreads();
    const bf16* buffer = key_tiles + (index % Config::kKeyBuffers) * 2 * kKeyTile * kStride;
    const int64_t key_base = key_begin + index * kKeyTile;
    if (warp_has_rows) {
      attend_tile<kHeadDim>(state, queries + warp * 16 * kStride, buffer, buffer + kKeyTile * kStride, key_base,
                            positions, scale_log2);
      const bool split_ends = (index + 1) % kTilesPerSplit == 0 || index + 1 == tiles;
      if (split_ends) finish_split(key_base / kAttentionSplitKeys);
    }
    __syncthreads();
    if (Config::kKeyBuffers == 1 && index + 1 < tiles) issue_tile(index + 1);
  }

  if constexpr (!kSplitKV) {
    if (!warp_has_rows) return;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = warp * 16 + g + 8 * r;
      if (positions[r] < 0) continue;
      const int64_t head = kv_head * group + tile.head_in_group(row);
      bf16* destination = out + (tile.token(row) * heads + head) * head_dim;
#pragma unroll
      for (int t = 0; t < kHeadDim / 8; ++t) {
        if (t * 8 >= head_dim) break;
#pragma unroll
        for (int i = 0; i < 2; ++i)
          destination[t * 8 + 2 * q4 + i] = from_float<bf16>(__fdiv_rn(folded(t, 2 * r + i), total_sum[r]));
      }
    }
  }
}

// Folds the decode partials of each (token, head) in split order; one thread per head dim (of
// kHeadDim: the partials' stride; only the model's head_dim are written out). The positions are
// step inputs no kernel writes, so the split count is read before waiting for the split kernel
// (device_math.cuh).
template <int kHeadDim>
__global__ void __launch_bounds__(kHeadDim)
    attention_combine_kernel(const float* partials, const int32_t* positions, int64_t heads, int64_t head_dim,
                             int64_t max_splits, bf16* out) {
  const int64_t token = blockIdx.x, head = blockIdx.y;
  const int d = threadIdx.x;
  const int64_t splits = positions[token] / kAttentionSplitKeys + 1;
  follow_previous_grid();
  const float* row = partials + (token * heads + head) * max_splits * (kHeadDim + 2);
  float total_max = -INFINITY, total_sum = 0.0f, total = 0.0f;
  // The partials of kBatch splits are read before any of them is folded, so that their loads can
  // be in flight together (the fold of one split no longer sits between the loads of the next).
  constexpr int kBatch = 8;
  for (int64_t first = 0; first < splits; first += kBatch) {
    float maxima[kBatch], sums[kBatch], values[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      if (first + i >= splits) break;
      const float* partial = row + (first + i) * (kHeadDim + 2);
      maxima[i] = partial[kHeadDim];
      sums[i] = partial[kHeadDim + 1];
      values[i] = partial[d];
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      if (first + i >= splits) break;
      float new_max, total_weight, split_weight;
      fold_weights(total_max, maxima[i], new_max, total_weight, split_weight);
      total_sum = fold_value(total_sum, total_weight, sums[i], split_weight);
      total = fold_value(total, total_weight, values[i], split_weight);
      total_max = new_max;
    }
  }
  if (d < head_dim) out[(token * heads + head) * head_dim + d] = from_float<bf16>(__fdiv_rn(total, total_sum));
}

bool uses_split_kv(const AttentionArgs& args) { return args.tokens <= kAttentionDecodeMaxTokens; }
int64_t max_splits(const AttentionArgs& args) { return args.max_position / kAttentionSplitKeys + 1; }

template <int kHeadDim>
cudaError_t launch_bf16(const AttentionArgs& args, cudaStream_t stream) {
  using Config = Bf16Config<kHeadDim>;
  const int64_t group = args.heads / args.kv_heads;
  const int64_t row_tiles = (args.max_span_tokens * group + kBlockRows - 1) / kBlockRows;
  const float scale_log2 = args.scale * kLog2E;
  const auto* q = static_cast<const bf16*>(args.q);
  const auto* k_cache = static_cast<const bf16*>(args.k_cache);
  const auto* v_cache = static_cast<const bf16*>(args.v_cache);
  auto* out = static_cast<bf16*>(args.out);
  const dim3 block(kThreads);
  if (uses_split_kv(args)) {
    const int64_t splits = max_splits(args);
    constexpr int kShared = Config::kSharedBytes(true);
    auto* kernel = &attention_bf16_kernel<kHeadDim, true>;
    static std::atomic<uint64_t> opted_in{0};
    if (cudaError_t status = allow_dynamic_shared(kernel, kShared, opted_in); status != cudaSuccess) return status;
    const dim3 grid(static_cast<unsigned>(row_tiles * splits), static_cast<unsigned>(args.span_count),
                    static_cast<unsigned>(args.kv_heads));
    launch_after_previous(kernel, grid, block, kShared, stream, q, k_cache, v_cache, args.table, args.spans,
                          args.heads, args.kv_heads, args.head_dim, splits, scale_log2, out, args.partials);
    if (cudaError_t status = cudaGetLastError(); status != cudaSuccess) return status;
    launch_after_previous(&attention_combine_kernel<kHeadDim>,
                          dim3(static_cast<unsigned>(args.tokens), static_cast<unsigned>(args.heads)), kHeadDim, 0,
                          stream, args.partials, args.positions, args.heads, args.head_dim, splits, out);
    return cudaGetLastError();
  }
  constexpr int kShared = Config::kSharedBytes(false);
  auto* kernel = &attention_bf16_kernel<kHeadDim, false>;
  static std::atomic<uint64_t> opted_in{0};
  if (cudaError_t status = allow_dynamic_shared(kernel, kShared, opted_in); status != cudaSuccess) return status;
  const dim3 grid(static_cast<unsigned>(row_tiles), static_cast<unsigned>(args.span_count),
                  static_cast<unsigned>(args.kv_heads));
  launch_after_previous(kernel, grid, block, kShared, stream, q, k_cache, v_cache, args.table, args.spans,
                        args.heads, args.kv_heads, args.head_dim, 1, scale_log2, out, nullptr);
  return cudaGetLastError();
}

// The head_dim a bf16 kernel is built for: the published models' 64, 128 and 256 (and 16, 32) run
// unpadded; any other multiple of 8 runs on the next one up, zero-padded.
int64_t padded_bf16_head_dim(int64_t head_dim) {
  for (int64_t built : {16, 32, 64, 128, 256})
    if (head_dim <= built) return built;
  return 0;
}

}  // namespace

bool attention_bf16_supports_head_dim(int64_t head_dim) {
  return head_dim > 0 && head_dim % 8 == 0 && head_dim <= 256;
}

int64_t attention_partials_floats(const AttentionArgs& args) {
  if (args.dtype != DType::BF16 || !uses_split_kv(args)) return 0;
  return args.tokens * args.heads * max_splits(args) * (padded_bf16_head_dim(args.head_dim) + 2);
}

cudaError_t launch_attention(const AttentionArgs& args, cudaStream_t stream) {
  if (args.tokens == 0) return cudaSuccess;
  if (args.dtype == DType::F32) {
    if (args.head_dim <= 32) return launch_f32<1>(args, stream);
    if (args.head_dim <= 64) return launch_f32<2>(args, stream);
    if (args.head_dim <= 128) return launch_f32<4>(args, stream);
    if (args.head_dim <= 256) return launch_f32<8>(args, stream);
    return launch_f32<16>(args, stream);
  }
  if (!attention_bf16_supports_head_dim(args.head_dim)) return cudaErrorInvalidValue;
  switch (padded_bf16_head_dim(args.head_dim)) {
    case 16: return launch_bf16<16>(args, stream);
    case 32: return launch_bf16<32>(args, stream);
    case 64: return launch_bf16<64>(args, stream);
    case 128: return launch_bf16<128>(args, stream);
    case 256: return launch_bf16<256>(args, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace kiln::cuda
