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
#include <iterator>

#include "backend/cuda/matmul_common.cuh"

namespace kiln::cuda {
namespace {

using namespace matmul_detail;

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

// An expert product with F32 activations: a block per slot of the routing (blockIdx.y) and
// kF32ExpertColumns weight rows of its expert, a thread per row, taking the expert's pairs
// kExpertPassRows at a time. Each element is matmul_f32_kernel's chain: acc = fma(x, w, acc) over
// k = 0, 1, …, K − 1 from 0, no bias.
constexpr int kF32ExpertColumns = 128;

template <typename W>
__global__ void __launch_bounds__(kF32ExpertColumns)
    expert_matmul_f32_kernel(const float* x, const W* w, void* out, DType out_dtype, int64_t n, int64_t k,
                             bool slot_weights, ExpertRouting routing) {
  __shared__ float w_tile[kF32TileK][kF32ExpertColumns + 1];  // [k][row]
  __shared__ float x_tile[kExpertPassRows][kF32TileK];
  __shared__ int32_t pass_pairs[kExpertPassRows];
  follow_previous_grid();
  const ExpertGroupsLayout layout{routing.slots, routing.pairs};
  const int64_t slot = blockIdx.y;
  if (slot >= routing.groups[layout.used()]) return;
  const int64_t matrix = slot_weights ? slot : routing.groups[layout.expert(slot)];
  const W* expert_w = w + matrix * n * k;
  const int64_t column0 = static_cast<int64_t>(blockIdx.x) * kF32ExpertColumns;
  const int thread = static_cast<int>(threadIdx.x);
  const int32_t end = routing.groups[layout.end(slot)];
  for (int32_t first = routing.groups[layout.begin(slot)]; first < end; first += kExpertPassRows) {
    const int rows = end - first < kExpertPassRows ? end - first : kExpertPassRows;
    if (thread < rows) pass_pairs[thread] = routing.groups[layout.pair(first + thread)];
    __syncthreads();
    float acc[kExpertPassRows] = {};
    for (int64_t k0 = 0; k0 < k; k0 += kF32TileK) {
      for (int i = thread; i < kF32ExpertColumns * kF32TileK; i += kF32ExpertColumns) {
        const int r = i / kF32TileK, kk = i % kF32TileK;
        const bool inside = column0 + r < n && k0 + kk < k;
        w_tile[kk][r] = inside ? to_float(expert_w[(column0 + r) * k + k0 + kk]) : 0.0f;
      }
      for (int i = thread; i < kExpertPassRows * kF32TileK; i += kF32ExpertColumns) {
        const int r = i / kF32TileK, kk = i % kF32TileK;
        float value = 0.0f;
        if (r < rows && k0 + kk < k) {
          const int64_t pair = pass_pairs[r];
          value = x[(routing.x_per_pair ? pair : pair / routing.top_k) * k + k0 + kk];
        }
        x_tile[r][kk] = value;
      }
      __syncthreads();
      const int64_t depth = k - k0 < kF32TileK ? k - k0 : kF32TileK;
      for (int kk = 0; kk < depth; ++kk) {
        const float weight = w_tile[kk][thread];
#pragma unroll
        for (int r = 0; r < kExpertPassRows; ++r) acc[r] = fmaf(x_tile[r][kk], weight, acc[r]);
      }
      __syncthreads();
    }
    const int64_t column = column0 + thread;
    if (column < n)
      for (int r = 0; r < rows; ++r)
        store_output(out, static_cast<int64_t>(pass_pairs[r]) * n + column, out_dtype, acc[r]);
    // The next pass rewrites the pairs.
    __syncthreads();
  }
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

// Where a decode block's rows of x start: row r of a matmul at x + r·k; in an expert product, the x
// row of the pass's r-th pair (its token's row, or the pair's own).
struct MatmulRows {
  const bf16* x;
  int64_t k;
  __device__ const bf16* row(int r) const { return x + r * k; }
};
struct PairRows {
  const bf16* x;
  int64_t k;
  const int32_t* pairs;  // the pass's pairs, in shared memory
  int64_t top_k;
  bool per_pair;
  __device__ const bf16* row(int r) const {
    const int64_t pair = pairs[r];
    return x + (per_pair ? pair : pair / top_k) * k;
  }
};

// Only the m real rows of x are copied: the other columns of the B fragment feed only output rows
// that are never stored (an mma element depends on its own row and column alone).
template <typename Config, typename Rows>
__device__ __forceinline__ void load_decode_inputs(uint8_t* stage, const Rows& rows, int64_t m, int64_t k,
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
    const bf16* source = valid ? rows.row(row) + global_k : rows.row(0);
    cp_async_16(chunk_unit(inputs + chunk * m * kChunkBytes, row, q), source, valid);
  }
}

// A warp of a decode block: of the block's warps (at most kWarps, and no more than K has segments),
// warp w computes segments w, w + warps, … of the block's rows: each segment an mma chain from zero
// over its 1024 k, streamed through the warp's own cp.async ring (the pipeline runs across the
// warp's segments without draining). A pass over K for m rows of x leaves each segment's sums in
// the block's shared memory, for warp 0 to add in order. The ring's layout follows m.
template <int kColumns, int kStages>
struct DecodeWarp {
  using Config = DecodeConfig<kColumns, kStages>;
  uint8_t* shared;
  int warps, warp, lane;
  WarpSegments<kDecodeStagesPerSegment> walk;
  __device__ DecodeWarp(uint8_t* shared_memory, int64_t k)
      : shared(shared_memory),
        warps(static_cast<int>(blockDim.x) / 32),
        warp(static_cast<int>(threadIdx.x) / 32),
        lane(static_cast<int>(threadIdx.x) % 32),
        walk(static_cast<int>((k + kDecodeStageK - 1) / kDecodeStageK), static_cast<int>(threadIdx.x) / 32,
             static_cast<int>(blockDim.x) / 32) {}
  __device__ uint8_t* ring(int64_t m) const { return shared + warp * kStages * Config::stage_bytes(m); }
  __device__ float* segment_sums(int64_t m) const {
    return reinterpret_cast<float*>(shared + Config::rings_bytes(warps, m));
  }
  __device__ int64_t stage_k(int i) const { return static_cast<int64_t>(walk.stage_of(i)) * kDecodeStageK; }

  // The weights of the warp's first kStages − 1 stages. They are constant, so a matmul requests
  // them before waiting for the previous kernel (programmatic dependent launch): their latency
  // overlaps that kernel's end. These copies join the pass's first commit group.
  __device__ void issue_first_weights(const DecodeWeightCopies<kColumns>& copies, int64_t m) const {
    for (int s = 0; s < kStages - 1; ++s)
      if (s < walk.count) copies.issue(ring(m) + s * Config::stage_bytes(m), stage_k(s));
  }

  // The rest of a pass over K for the m rows (issue_first_weights first; x and every store come
  // after the wait for the previous kernel). Returns with the block synchronised.
  template <typename Rows>
  __device__ void run(const DecodeWeightCopies<kColumns>& copies, const Rows& rows, int64_t m, int64_t k) const {
    const int my_stages = walk.count;
    const int stage_bytes = Config::stage_bytes(m);
    uint8_t* warp_ring = ring(m);
    float* sums = segment_sums(m);
    const int g = lane / 4, q = lane % 4;
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < my_stages) load_decode_inputs<Config>(warp_ring + s * stage_bytes, rows, m, k, stage_k(s));
      cp_async_commit();
    }
    const uint4 zero = make_uint4(0, 0, 0, 0);
    float acc[4] = {};
    for (int i = 0; i < my_stages; ++i) {
      cp_async_wait<kStages - 2>();
      __syncwarp();
      const int prefetch = i + kStages - 1;
      if (prefetch < my_stages) {
        uint8_t* stage = warp_ring + (prefetch % kStages) * stage_bytes;
        copies.issue(stage, stage_k(prefetch));
        load_decode_inputs<Config>(stage, rows, m, k, stage_k(prefetch));
      }
      cp_async_commit();
      const int64_t stage_index = walk.stage_of(i);
      const uint8_t* stage = warp_ring + (i % kStages) * stage_bytes;
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
      walk.end_stage(i, acc, sums, lane);
    }
    cp_async_wait<0>();
    __syncthreads();
  }

  // Warp 0, after a pass: the segments added in order (the contract's fold).
  __device__ void fold(int64_t m, float (&total)[4]) const { fold_segments(segment_sums(m), walk.segments, lane, total); }
};

// Stores a 16×8 accumulator tile (weight rows × the pass's pairs) as out[pair][column] (store_tile's
// element mapping; expert products have no bias).
__device__ __forceinline__ void store_pair_tile(const float (&acc)[4], int64_t column_base, bool lower_rows, void* out,
                                                DType out_dtype, int64_t n, int rows, const int32_t* pairs) {
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, q = lane % 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (i >= 2 && !lower_rows) break;
    const int64_t column = column_base + g + (i >= 2 ? 8 : 0);
    const int row = 2 * q + (i & 1);
    if (column < n && row < rows) store_output(out, static_cast<int64_t>(pairs[row]) * n + column, out_dtype, acc[i]);
  }
}

// A block per kColumns weight rows of a product. A matmul (kExperts false): the m rows of x, one
// pass. An expert product: blockIdx.y is a slot of the routing (ExpertRouting); the block takes
// its expert's kColumns rows and that expert's pairs, routing.rows_per_pass at a time, a pass over
// K each. Every element is the same arithmetic either way (the contract at the top of this file).
template <int kColumns, int kStages, int kWarps, bool kExperts>
__global__ void __launch_bounds__(kWarps * 32)
    matmul_bf16_decode_kernel(const bf16* x, MatmulTargets targets, int64_t m, int64_t k, ExpertRouting routing) {
  extern __shared__ uint4 shared_words[];
  const int target = target_of(targets, static_cast<int>(blockIdx.x));
  const bf16* w = targets.w[target];
  void* out = targets.out[target];
  const DType out_dtype = targets.out_dtype[target];
  const int64_t n = targets.n[target];
  const int64_t column0 = static_cast<int64_t>(static_cast<int>(blockIdx.x) - targets.first_block[target]) * kColumns;
  const DecodeWarp<kColumns, kStages> block(reinterpret_cast<uint8_t*>(shared_words), k);
  if constexpr (!kExperts) {
    const DecodeWeightCopies<kColumns> copies(w, n, k, column0);
    block.issue_first_weights(copies, m);
    follow_previous_grid();
    block.run(copies, MatmulRows{x, k}, m, k);
    if (block.warp != 0) return;
    float total[4] = {};
    block.fold(m, total);
    store_tile(total, column0, 0, kColumns == 16, targets.bias[target], targets.bias_dtype[target], out, out_dtype, m,
               n);
  } else {
    // The slot's expert was written by the kernel before: no weight is requested before the wait.
    __shared__ int32_t pass_pairs[kExpertPassRows];
    follow_previous_grid();
    const ExpertGroupsLayout layout{routing.slots, routing.pairs};
    const int64_t slot = blockIdx.y;
    if (slot >= routing.groups[layout.used()]) return;
    const int64_t matrix = (routing.slot_weights >> target & 1u) ? slot : routing.groups[layout.expert(slot)];
    const DecodeWeightCopies<kColumns> copies(w + matrix * n * k, n, k, column0);
    const int32_t end = routing.groups[layout.end(slot)];
    for (int32_t first = routing.groups[layout.begin(slot)]; first < end; first += routing.rows_per_pass) {
      const int rows = end - first < routing.rows_per_pass ? end - first : routing.rows_per_pass;
      const int thread = static_cast<int>(threadIdx.x);
      if (thread < rows) pass_pairs[thread] = routing.groups[layout.pair(first + thread)];
      __syncthreads();
      block.issue_first_weights(copies, rows);
      block.run(copies, PairRows{x, k, pass_pairs, routing.top_k, routing.x_per_pair}, rows, k);
      if (block.warp == 0) {
        float total[4] = {};
        block.fold(rows, total);
        store_pair_tile(total, column0, kColumns == 16, out, out_dtype, n, rows, pass_pairs);
      }
      // The next pass rewrites the pairs, the rings and the segment sums.
      __syncthreads();
    }
  }
}

template <int kColumns, int kStages, int kWarps, bool kExperts>
cudaError_t launch_decode(const MatmulArgs* products, int count, const ExpertRouting& routing, cudaStream_t stream) {
  const MatmulArgs& args = products[0];  // x, m and k are shared
  using Config = DecodeConfig<kColumns, kStages>;
  auto* kernel = &matmul_bf16_decode_kernel<kColumns, kStages, kWarps, kExperts>;
  static std::atomic<uint64_t> opted_in{0};
  constexpr int64_t kMostRows = kExperts ? kExpertPassRows : kMatmulDecodeMaxRows;
  const int max_shared =
      Config::rings_bytes(kWarps, kMostRows) + static_cast<int>(kMatmulMaxSegments) * Config::kSegmentBytes;
  if (cudaError_t status = allow_dynamic_shared(kernel, max_shared, opted_in); status != cudaSuccess) return status;
  const int segments = static_cast<int>((args.k + kMatmulSegmentK - 1) / kMatmulSegmentK);
  // A warp without a segment would hold an idle ring: shorter K runs fewer warps per block, so
  // that more blocks (and more bytes in flight) fit on a multiprocessor.
  const int warps = std::max(1, std::min(kWarps, segments));
  const int64_t rows = kExperts ? routing.rows_per_pass : args.m;
  const int shared = Config::rings_bytes(warps, rows) + segments * Config::kSegmentBytes;
  const MatmulTargets targets = matmul_targets(products, count, kColumns);
  const dim3 grid(static_cast<unsigned>(targets.first_block[count]), kExperts ? static_cast<unsigned>(routing.slots) : 1u);
  // The blocks may start (and a matmul's request its first weights) while the previous kernel on
  // the stream finishes; the kernel waits for it before touching x or out.
  return launch_after_previous(kernel, grid, dim3(warps * 32), static_cast<size_t>(shared), stream,
                               static_cast<const bf16*>(args.x), targets, args.m, args.k, routing);
}

// The decode launch shapes (weight rows per block, warps per block, ring stages per warp). Every
// shape gives the same bits; they differ in how the grid fills the multiprocessors.
constexpr DecodeLaunchShape kDecodeShapes[] = {{16, 4, 6}, {8, 4, 6}, {16, 4, 3}, {8, 4, 3}, {16, 8, 3}, {8, 8, 4}};

template <bool kExperts>
cudaError_t launch_decode_shape(const MatmulArgs* products, int count, int shape, const ExpertRouting& routing,
                                cudaStream_t stream) {
  switch (shape) {
    case 0: return launch_decode<16, 6, 4, kExperts>(products, count, routing, stream);
    case 1: return launch_decode<8, 6, 4, kExperts>(products, count, routing, stream);
    case 2: return launch_decode<16, 3, 4, kExperts>(products, count, routing, stream);
    case 3: return launch_decode<8, 3, 4, kExperts>(products, count, routing, stream);
    case 4: return launch_decode<16, 3, 8, kExperts>(products, count, routing, stream);
    case 5: return launch_decode<8, 4, 8, kExperts>(products, count, routing, stream);
    default: return cudaErrorInvalidValue;
  }
}

// The decode launch shape for products of `total_n` weight rows in all over K = k. From the
// launch-shape sweep on the H200 (kiln_cuda_bench decode-shapes, docs/perf.md): K of eight or more
// segments wants eight warps per block (16 rows when 16-row blocks are fewer than the
// multiprocessors, else 8); shorter K wants four warps with three stages, in 8-row blocks when
// 16-row ones would be few (under 1.5 per multiprocessor) or many (over 8 per multiprocessor, where
// narrower blocks balance the last wave better) — except for the many waves of an lm head (over 24
// per multiprocessor), where 16-row blocks with six stages stream at ~98 % of the copy bandwidth and
// the narrow shape at ~91 %.
int default_decode_shape(int64_t total_n, int64_t k, int64_t multiprocessors) {
  const int64_t wide_blocks = (total_n + 15) / 16;
  const int64_t segments = (k + kMatmulSegmentK - 1) / kMatmulSegmentK;
  if (segments >= 8) return wide_blocks < multiprocessors ? 4 : 5;
  if (wide_blocks > 24 * multiprocessors) return 0;
  const bool narrow = 2 * wide_blocks < 3 * multiprocessors || wide_blocks > 8 * multiprocessors;
  return narrow ? 3 : 2;
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

cudaError_t launch_expert_matmul_f32(const MatmulArgs& product, const ExpertRouting& routing, cudaStream_t stream) {
  if (routing.slots > 65535) return cudaErrorInvalidValue;
  if (routing.slots == 0 || product.n == 0) return cudaSuccess;
  const dim3 grid(blocks_for(product.n, kF32ExpertColumns), static_cast<unsigned>(routing.slots));
  cudaError_t status = cudaErrorInvalidValue;
  dispatch_float(product.w_dtype, [&](auto tag) {
    using W = decltype(tag);
    status = launch_after_previous(&expert_matmul_f32_kernel<W>, grid, dim3(kF32ExpertColumns), 0, stream,
                                   static_cast<const float*>(product.x), static_cast<const W*>(product.w), product.out,
                                   product.out_dtype, product.n, product.k, (routing.slot_weights & 1u) != 0, routing);
  });
  return status;
}

cudaError_t launch_matmul_bf16(const MatmulArgs& args, cudaStream_t stream) {
  return launch_matmul_bf16_group(&args, 1, stream);
}

int decode_launch_shape_count() { return static_cast<int>(std::size(kDecodeShapes)); }
DecodeLaunchShape decode_launch_shape(int shape) { return kDecodeShapes[shape]; }

cudaError_t launch_matmul_bf16_decode(const MatmulArgs* products, int count, int shape, cudaStream_t stream) {
  if (count < 1 || count > kMatmulGroupMax || products[0].m < 1 || products[0].m > kMatmulDecodeMaxRows ||
      shape < 0 || shape >= decode_launch_shape_count())
    return cudaErrorInvalidValue;
  return launch_decode_shape<false>(products, count, shape, ExpertRouting{}, stream);
}

cudaError_t launch_expert_matmul_bf16(const MatmulArgs* products, int count, const ExpertRouting& routing,
                                      cudaStream_t stream) {
  if (count < 1 || count > kMatmulGroupMax || routing.rows_per_pass < 1 || routing.rows_per_pass > kExpertPassRows ||
      routing.slots > 65535)
    return cudaErrorInvalidValue;
  int64_t total_n = 0;
  for (int t = 0; t < count; ++t) {
    if (products[t].x != products[0].x || products[t].k != products[0].k) return cudaErrorInvalidValue;
    total_n += products[t].n;
  }
  if (routing.slots == 0 || total_n == 0) return cudaSuccess;
  // Shaped as one product of every slot's rows (at batch 1 each slot is a used expert).
  const int shape = default_decode_shape(total_n * routing.slots, products[0].k, products[0].multiprocessors);
  return launch_decode_shape<true>(products, count, shape, routing, stream);
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
  if (first.m <= kMatmulDecodeMaxRows)
    return launch_decode_shape<false>(products, count, default_decode_shape(total_n, first.k, first.multiprocessors),
                                      ExpertRouting{}, stream);
  if (wgmma_shares_launch(products, count)) return launch_wgmma(products, count, stream);
  for (int t = 0; t < count; ++t) {
    if (products[t].n == 0) continue;
    if (const cudaError_t status = launch_wgmma(&products[t], 1, stream); status != cudaSuccess) return status;
  }
  return cudaSuccess;
}

}  // namespace kiln::cuda
