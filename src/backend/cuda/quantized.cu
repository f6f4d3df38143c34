// Quantized weights (core/weight.h's layouts and decode rule): their decode into a scratch matrix
// (the prefill GEMM, the f32 kernel and the weights the fused kernel does not take read that), the
// quantized embedding, and the fused BF16 decode matmul, which streams the packed bytes.
//
// The fused decode kernel is matmul.cu's decode kernel with the weight stage holding packed rows:
// the same segments of 1024, 32-element chunks and two mma steps per chunk, each lane's A
// fragment words decoded from the stage (fma(scale, code, bias) or fp8 · scale_inv in f32, then
// rounded to bf16) instead of read as bf16, so every element is what the BF16 kernels give on the
// decoded matrix (the accumulation contract at the top of matmul.cu).
#include <cuda_fp8.h>

#include <climits>
#include <iterator>

#include "backend/cuda/matmul_common.cuh"

namespace kiln::cuda {
namespace {

using namespace matmul_detail;

constexpr int kThreads = 256;

// e4m3fn → f32, exact: every e4m3 value (subnormals included) is an f16 value.
__device__ __forceinline__ float fp8_to_float(uint8_t bits) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(bits), __NV_E4M3)));
}

__device__ __forceinline__ float2 fp8_pair_to_float2(uint32_t two_bytes) {
  return __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_bytes), __NV_E4M3)));
}

// f32 of a code below 2²³, exactly (float(code) without the conversion unit).
__device__ __forceinline__ float code_value(uint32_t code) { return __uint_as_float(0x4b000000u | code) - 8388608.0f; }

// Element (row, column) of the weight, decoded to f32 as core/weight.h says.
__device__ __forceinline__ float decoded_element(const QuantizedWeightArgs& w, int64_t row, int64_t column) {
  if (w.format == QuantizedFormat::Affine) {
    const uint32_t* words = static_cast<const uint32_t*>(w.values) + row * (w.k * w.bits / 32);
    const int64_t bit = column * w.bits;
    const int shift = static_cast<int>(bit % 32);
    uint64_t pair = words[bit / 32];
    if (shift + w.bits > 32) pair |= static_cast<uint64_t>(words[bit / 32 + 1]) << 32;
    const uint32_t code = static_cast<uint32_t>(pair >> shift) & ((1u << w.bits) - 1u);
    const int64_t group = row * w.scale_columns + column / w.group_size;
    return fmaf(load_element(w.scales, group, w.scale_dtype), static_cast<float>(code),
                load_element(w.biases, group, w.scale_dtype));
  }
  const uint8_t value = static_cast<const uint8_t*>(w.values)[row * w.k + column];
  const int64_t block = row / w.block_rows * w.scale_columns + column / w.block_columns;
  return fp8_to_float(value) * load_element(w.scales, block, w.scale_dtype);
}

template <typename OutT>
__global__ void dequantize_kernel(QuantizedWeightArgs w, OutT* out) {
  follow_previous_grid();
  const int64_t count = w.n * w.k;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = from_float<OutT>(decoded_element(w, i / w.k, i % w.k));
}

// The rows of 4- and 8-bit affine and FP8 weights decoded a block per row, each thread taking 32
// bits of codes at a time (8 or 4 affine elements, which always share a group: groups are 32, 64
// or 128 elements; 4 FP8 elements, inside one 128-column block) and writing their run of outputs
// at once. Each element is decoded_element's value; the generic kernel above, an element per
// thread with 64-bit index arithmetic and its scale loaded per element, ran at a fraction of the
// copy bandwidth and held 4-bit prefill to 28 % of bf16's (docs/perf.md, 2026-12-07).
constexpr int kRowThreads = 256;

template <typename OutT, int kCount>
__device__ __forceinline__ void store_run(OutT* out, const float (&values)[kCount]) {
  if constexpr (sizeof(OutT) * kCount % 16 == 0) {
    constexpr int kWords = static_cast<int>(sizeof(OutT)) * kCount / 4;
    uint32_t words[kWords];
    OutT rounded[kCount];
#pragma unroll
    for (int i = 0; i < kCount; ++i) rounded[i] = from_float<OutT>(values[i]);
    memcpy(words, rounded, sizeof(rounded));
#pragma unroll
    for (int i = 0; i < kWords; i += 4)
      reinterpret_cast<uint4*>(out)[i / 4] = make_uint4(words[i], words[i + 1], words[i + 2], words[i + 3]);
  } else {
#pragma unroll
    for (int i = 0; i < kCount; ++i) out[i] = from_float<OutT>(values[i]);
  }
}

template <int kBits, typename Scale, typename OutT>
__global__ void dequantize_affine_rows_kernel(QuantizedWeightArgs w, OutT* out) {
  constexpr int kPerWord = 32 / kBits;
  constexpr uint32_t kMask = (1u << kBits) - 1u;
  follow_previous_grid();
  const int64_t row = blockIdx.x;
  const int words = static_cast<int>(w.k / kPerWord);
  const uint32_t* codes = static_cast<const uint32_t*>(w.values) + row * words;
  const Scale* scales = static_cast<const Scale*>(w.scales) + row * w.scale_columns;
  const Scale* biases = static_cast<const Scale*>(w.biases) + row * w.scale_columns;
  OutT* row_out = out + row * w.k;
  for (int word = threadIdx.x; word < words; word += blockDim.x) {
    const uint32_t packed = codes[word];
    const int group = word * kPerWord / w.group_size;
    const float scale = to_float(scales[group]), bias = to_float(biases[group]);
    float values[kPerWord];
#pragma unroll
    for (int i = 0; i < kPerWord; ++i) values[i] = fmaf(scale, code_value(packed >> (i * kBits) & kMask), bias);
    store_run(row_out + static_cast<int64_t>(word) * kPerWord, values);
  }
}

template <typename Scale, typename OutT>
__global__ void dequantize_fp8_rows_kernel(QuantizedWeightArgs w, OutT* out) {
  follow_previous_grid();
  const int64_t row = blockIdx.x;
  const int words = static_cast<int>(w.k / 4);
  const uint32_t* codes = reinterpret_cast<const uint32_t*>(static_cast<const uint8_t*>(w.values) + row * w.k);
  const Scale* scales = static_cast<const Scale*>(w.scales) + row / w.block_rows * w.scale_columns;
  OutT* row_out = out + row * w.k;
  for (int word = threadIdx.x; word < words; word += blockDim.x) {
    const uint32_t four = codes[word];
    const float scale = to_float(scales[word * 4 / w.block_columns]);
    const float2 low = fp8_pair_to_float2(four & 0xffffu), high = fp8_pair_to_float2(four >> 16);
    const float values[4] = {low.x * scale, low.y * scale, high.x * scale, high.y * scale};
    store_run(row_out + static_cast<int64_t>(word) * 4, values);
  }
}

template <typename OutT>
__global__ void embedding_quantized_kernel(QuantizedWeightArgs table, const int32_t* ids, OutT* out,
                                           DeviceErrorRecord* errors) {
  follow_previous_grid();
  const int64_t token = blockIdx.x;
  const int32_t id = ids[token];
  if (id < 0 || id >= table.n) {
    if (threadIdx.x == 0 && blockIdx.y == 0 && atomicCAS(&errors->code, 0, kEmbeddingIdOutOfRange) == 0) {
      errors->value = id;
      errors->limit = static_cast<int32_t>(table.n);
    }
    return;
  }
  for (int64_t column = blockIdx.y * blockDim.x + threadIdx.x; column < table.k; column += gridDim.y * blockDim.x)
    out[token * table.k + column] = from_float<OutT>(decoded_element(table, id, column));
}

// --- the fused decode kernel: a block per kRows weight rows (16, or 8 with the mma's lower half
// zero), its kWarps warps taking K segments in turn ---
constexpr int kStages = 6;
// Hopper's opt-in limit of shared memory per block.
constexpr int kMaxSharedPerBlock = 227 * 1024;

// A stage holds each of the kRows rows' packed bytes for its 128 k (rows padded by 16 bytes, so
// that the eight rows one load instruction reads fall in distinct banks), then the m rows of x
// [chunk][row][32 k] as matmul.cu's decode kernel lays them out. At 4 bits a stage carries a
// quarter of the BF16 kernel's weight bytes; stages of 256 bytes per row at every width (512 k at
// 4 bits, five stages) were measured and were slower at batch 1 (114 against 123 tok/s on the 8B,
// docs/perf.md 2026-12-07): the bytes in flight are not what holds this kernel back.
template <int kBitsPerElement, int kRows>
struct FusedLayout {
  static constexpr int kStageK = 128;  // four chunks
  static constexpr int kChunksPerStage = kStageK / kChunk;
  static constexpr int kStagesPerSegment = static_cast<int>(kMatmulSegmentK) / kStageK;
  static constexpr int kRowBytes = kStageK * kBitsPerElement / 8;
  static constexpr int kRowStride = kRowBytes + 16;
  static constexpr int kUnitsPerRow = kRowBytes / 16;
  static constexpr int kWeightBytes = kRows * kRowStride;
  static constexpr int kSegmentBytes = 4 * 32 * 4;
  __host__ __device__ static int stage_bytes(int64_t m) {
    return kWeightBytes + kChunksPerStage * static_cast<int>(m) * kChunkBytes;
  }
  __host__ __device__ static int rings_bytes(int warps, int64_t m) { return warps * kStages * stage_bytes(m); }
};

// A lane's share of a stage's packed-row copies: units lane % U of rows lane / U + i · (32 / U).
template <int kBitsPerElement, int kRows>
struct FusedWeightCopies {
  using Layout = FusedLayout<kBitsPerElement, kRows>;
  static_assert(32 % Layout::kUnitsPerRow == 0 && kRows % (32 / Layout::kUnitsPerRow) == 0,
                "a warp's copies cover whole rows of the stage");
  static constexpr int kRowStep = 32 / Layout::kUnitsPerRow;
  static constexpr int kCopies = kRows / kRowStep;
  const uint8_t* source;  // the lane's unit of its first row, at the row's first byte
  const uint8_t* fallback;
  int64_t row_step_bytes;
  int64_t byte_limit;     // the lane's unit lies inside the row while the stage's byte offset is below this
  uint32_t rows_inside;
  int target;             // the unit's offset in a stage
  __device__ FusedWeightCopies(const void* values, int64_t n, int64_t row_bytes, int64_t row0) {
    const int lane = threadIdx.x % 32;
    const int first_row = lane / Layout::kUnitsPerRow, unit = lane % Layout::kUnitsPerRow;
    source = static_cast<const uint8_t*>(values) + (row0 + first_row) * row_bytes + unit * 16;
    fallback = static_cast<const uint8_t*>(values);
    row_step_bytes = kRowStep * row_bytes;
    byte_limit = row_bytes - unit * 16;
    rows_inside = 0;
    for (int i = 0; i < kCopies; ++i)
      if (row0 + first_row + i * kRowStep < n) rows_inside |= 1u << i;
    target = first_row * Layout::kRowStride + unit * 16;
  }
  __device__ __forceinline__ void issue(uint8_t* stage, int64_t stage_byte) const {
    const bool inside = stage_byte < byte_limit;
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const bool valid = inside && (rows_inside >> i & 1u);
      cp_async_16(stage + target + i * kRowStep * Layout::kRowStride,
                  valid ? source + stage_byte + i * row_step_bytes : fallback, valid);
    }
  }
};

template <int kBitsPerElement, int kRows>
__device__ __forceinline__ void load_fused_inputs(uint8_t* stage, const bf16* x, int64_t m, int64_t k, int64_t k_base) {
  using Layout = FusedLayout<kBitsPerElement, kRows>;
  constexpr int kChunksPerStage = Layout::kChunksPerStage;
  constexpr int kPiecesPerLine = kChunksPerStage * 4;
  const int lane = threadIdx.x % 32;
  uint8_t* inputs = stage + Layout::kWeightBytes;
  for (int piece = lane; piece < m * kPiecesPerLine; piece += 32) {
    const int row = piece / kPiecesPerLine;
    const int chunk = (piece / 4) % kChunksPerStage;
    const int q = piece % 4;
    const int64_t global_k = k_base + chunk * kChunk + q * 8;
    const bool valid = global_k < k;
    cp_async_16(chunk_unit(inputs + chunk * m * kChunkBytes, row, q), valid ? x + row * k + global_k : x, valid);
  }
}

__device__ __forceinline__ uint32_t bf16_pair(float low, float high) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

// Four consecutive elements (from `element`, a multiple of 4, of a chunk whose packed bytes start
// at `bytes`) decoded and rounded to bf16: two words, elements in ascending order (low half first).
template <QuantizedFormat kFormat, int kBits>
__device__ __forceinline__ uint2 decode_four(const uint8_t* bytes, int element, float scale, float bias) {
  if constexpr (kFormat == QuantizedFormat::Fp8Block) {
    const uint32_t four = *reinterpret_cast<const uint32_t*>(bytes + element);
    const float2 low = fp8_pair_to_float2(four & 0xffffu), high = fp8_pair_to_float2(four >> 16);
    return make_uint2(bf16_pair(low.x * scale, low.y * scale), bf16_pair(high.x * scale, high.y * scale));
  } else {
    constexpr uint32_t kMask = (1u << kBits) - 1u;
    uint32_t four;
    if constexpr (kBits == 4)
      four = *reinterpret_cast<const uint16_t*>(bytes + element / 2);
    else
      four = *reinterpret_cast<const uint32_t*>(bytes + element);
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = fmaf(scale, code_value(four >> (i * kBits) & kMask), bias);
    return make_uint2(bf16_pair(v[0], v[1]), bf16_pair(v[2], v[3]));
  }
}

// The lane's A-fragment words of one row's chunk (load_chunk_words' layout): elements 4q..4q+3
// and 16 + 4q..16 + 4q + 3, the second half zero past K.
template <QuantizedFormat kFormat, int kBits>
__device__ __forceinline__ uint4 decode_chunk_words(const uint8_t* bytes, int q, bool second_inside, float scale,
                                                    float bias) {
  const uint2 first = decode_four<kFormat, kBits>(bytes, 4 * q, scale, bias);
  const uint2 second = second_inside ? decode_four<kFormat, kBits>(bytes, 16 + 4 * q, scale, bias) : make_uint2(0, 0);
  return make_uint4(first.x, first.y, second.x, second.y);
}

template <QuantizedFormat kFormat, int kBits, typename Scale, int kRows, int kWarps>
__global__ void __launch_bounds__(kWarps * 32)
    matmul_quantized_decode_kernel(const bf16* x, QuantizedWeightArgs w, const void* bias, DType bias_dtype, void* out,
                                   DType out_dtype, int64_t m) {
  using Layout = FusedLayout<kBits, kRows>;
  constexpr bool kLowerRows = kRows == 16;  // whether the mma's rows g + 8 are weight rows
  constexpr int kStageK = Layout::kStageK, kChunksPerStage = Layout::kChunksPerStage;
  constexpr int kStagesPerSegment = Layout::kStagesPerSegment;
  extern __shared__ uint4 shared_words[];
  const int64_t n = w.n, k = w.k;
  const int stage_bytes = Layout::stage_bytes(m);
  const int warps = static_cast<int>(blockDim.x) / 32;
  float* segment_sums =
      reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(shared_words) + Layout::rings_bytes(warps, m));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint8_t* ring = reinterpret_cast<uint8_t*>(shared_words) + warp * kStages * stage_bytes;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int g = lane / 4, q = lane % 4;
  const WarpSegments<kStagesPerSegment> walk((k + kStageK - 1) / kStageK, warp, warps);
  const int64_t my_stages = walk.count;
  auto stage_of = [&](int64_t i) { return walk.stage_of(i); };
  // The scales of the lane's two rows (rows past n read row n − 1's: their outputs are never stored).
  const Scale* scales = static_cast<const Scale*>(w.scales);
  const Scale* biases = static_cast<const Scale*>(w.biases);
  const int64_t upper_row = row0 + g < n ? row0 + g : n - 1;
  const int64_t lower_row = row0 + g + 8 < n ? row0 + g + 8 : n - 1;
  const int64_t upper_scales = kFormat == QuantizedFormat::Affine ? upper_row * w.scale_columns
                                                                  : upper_row / w.block_rows * w.scale_columns;
  const int64_t lower_scales = kFormat == QuantizedFormat::Affine ? lower_row * w.scale_columns
                                                                  : lower_row / w.block_rows * w.scale_columns;
  const int scale_width = kFormat == QuantizedFormat::Affine ? w.group_size : w.block_columns;

  const FusedWeightCopies<kBits, kRows> weight_copies(w.values, n, k * kBits / 8, row0);
  for (int s = 0; s < kStages - 1; ++s)
    if (s < my_stages) weight_copies.issue(ring + s * stage_bytes, stage_of(s) * Layout::kRowBytes);
  follow_previous_grid();
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < my_stages) load_fused_inputs<kBits, kRows>(ring + s * stage_bytes, x, m, k, stage_of(s) * kStageK);
    cp_async_commit();
  }
  // A stage's scales (and affine biases) of the lane's two rows, as stored: requested one stage
  // ahead, so that their latency (from memory at each segment's first stage) overlaps a stage of
  // decoding instead of stalling it.
  struct StageScales {
    Scale upper_scale[kChunksPerStage], upper_bias[kChunksPerStage], lower_scale[kChunksPerStage],
        lower_bias[kChunksPerStage];
  };
  auto request_scales = [&](int64_t stage_index, StageScales& out) {
#pragma unroll
    for (int chunk = 0; chunk < kChunksPerStage; ++chunk) {
      const int64_t chunk_k = stage_index * kStageK + chunk * kChunk;
      const int64_t column = (chunk_k < k ? chunk_k : k - 1) / scale_width;
      out.upper_scale[chunk] = scales[upper_scales + column];
      if constexpr (kLowerRows) out.lower_scale[chunk] = scales[lower_scales + column];
      if constexpr (kFormat == QuantizedFormat::Affine) {
        out.upper_bias[chunk] = biases[upper_scales + column];
        if constexpr (kLowerRows) out.lower_bias[chunk] = biases[lower_scales + column];
      }
    }
  };
  StageScales next_scales;
  if (my_stages > 0) request_scales(stage_of(0), next_scales);
  float acc[4] = {};
  for (int64_t i = 0; i < my_stages; ++i) {
    const int64_t stage_index = stage_of(i);
    float upper_scale[kChunksPerStage], upper_bias[kChunksPerStage], lower_scale[kChunksPerStage],
        lower_bias[kChunksPerStage];
#pragma unroll
    for (int chunk = 0; chunk < kChunksPerStage; ++chunk) {
      upper_scale[chunk] = to_float(next_scales.upper_scale[chunk]);
      lower_scale[chunk] = kLowerRows ? to_float(next_scales.lower_scale[chunk]) : 0.0f;
      const bool affine = kFormat == QuantizedFormat::Affine;
      upper_bias[chunk] = affine ? to_float(next_scales.upper_bias[chunk]) : 0.0f;
      lower_bias[chunk] = affine && kLowerRows ? to_float(next_scales.lower_bias[chunk]) : 0.0f;
    }
    if (i + 1 < my_stages) request_scales(stage_of(i + 1), next_scales);
    cp_async_wait<kStages - 2>();
    __syncwarp();
    const int64_t prefetch = i + kStages - 1;
    if (prefetch < my_stages) {
      uint8_t* stage = ring + (prefetch % kStages) * stage_bytes;
      weight_copies.issue(stage, stage_of(prefetch) * Layout::kRowBytes);
      load_fused_inputs<kBits, kRows>(stage, x, m, k, stage_of(prefetch) * kStageK);
    }
    cp_async_commit();
    const uint8_t* stage = ring + (i % kStages) * stage_bytes;
#pragma unroll
    for (int chunk = 0; chunk < kChunksPerStage; ++chunk) {
      const int64_t chunk_k = stage_index * kStageK + chunk * kChunk;
      if (chunk_k >= k) break;
      const bool second_inside = chunk_k + 16 < k;
      const int chunk_byte = chunk * kChunk * kBits / 8;
      const uint4 upper = decode_chunk_words<kFormat, kBits>(stage + g * Layout::kRowStride + chunk_byte, q,
                                                             second_inside, upper_scale[chunk], upper_bias[chunk]);
      const uint4 lower = kLowerRows ? decode_chunk_words<kFormat, kBits>(stage + (g + 8) * Layout::kRowStride +
                                                                              chunk_byte,
                                                                          q, second_inside, lower_scale[chunk],
                                                                          lower_bias[chunk])
                                     : make_uint4(0, 0, 0, 0);
      const uint8_t* inputs = stage + Layout::kWeightBytes + chunk * m * kChunkBytes;
      const int row = g < m ? g : static_cast<int>(m) - 1;
      mma_chunk(acc, upper, lower, load_chunk_words(inputs, row, q));
    }
    walk.end_stage(i, acc, segment_sums, lane);
  }
  cp_async_wait<0>();
  __syncthreads();
  if (warp != 0) return;
  float total[4] = {};
  fold_segments(segment_sums, walk.segments, lane, total);
  store_tile(total, row0, 0, kLowerRows, bias, bias_dtype, out, out_dtype, m, n);
}

template <QuantizedFormat kFormat, int kBits, typename Scale, int kRows, int kWarps>
cudaError_t launch_fused(const MatmulArgs& args, const QuantizedWeightArgs& w, cudaStream_t stream) {
  using Layout = FusedLayout<kBits, kRows>;
  auto* kernel = &matmul_quantized_decode_kernel<kFormat, kBits, Scale, kRows, kWarps>;
  static std::atomic<uint64_t> opted_in{0};
  const int max_shared = std::min(Layout::rings_bytes(kWarps, kQuantizedDecodeMaxRows) +
                                      static_cast<int>(kMatmulMaxSegments) * Layout::kSegmentBytes,
                                  kMaxSharedPerBlock);
  if (cudaError_t status = allow_dynamic_shared(kernel, max_shared, opted_in); status != cudaSuccess) return status;
  const int segments = static_cast<int>((args.k + kMatmulSegmentK - 1) / kMatmulSegmentK);
  const int warps = std::max(1, std::min(kWarps, segments));
  const int shared = Layout::rings_bytes(warps, args.m) + segments * Layout::kSegmentBytes;
  if (shared > max_shared) return cudaErrorInvalidValue;
  return launch_after_previous(kernel, dim3(blocks_for(args.n, kRows)), dim3(warps * 32), static_cast<size_t>(shared),
                               stream, static_cast<const bf16*>(args.x), w, args.bias, args.bias_dtype, args.out,
                               args.out_dtype, args.m);
}

// The launch shapes (weight rows per block, warps per block). Every shape gives the same bits; they
// differ in how many warps the grid puts on a multiprocessor to hide the decode's latency.
constexpr QuantizedDecodeLaunchShape kFusedShapes[] = {{16, 4}, {8, 4}, {16, 8}, {8, 8}};

template <QuantizedFormat kFormat, int kBits, typename Scale>
cudaError_t launch_fused_shape(const MatmulArgs& args, const QuantizedWeightArgs& w, int shape, cudaStream_t stream) {
  switch (shape) {
    case 0: return launch_fused<kFormat, kBits, Scale, 16, 4>(args, w, stream);
    case 1: return launch_fused<kFormat, kBits, Scale, 8, 4>(args, w, stream);
    case 2: return launch_fused<kFormat, kBits, Scale, 16, 8>(args, w, stream);
    case 3: return launch_fused<kFormat, kBits, Scale, 8, 8>(args, w, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename Scale>
cudaError_t launch_fused_format(const MatmulArgs& args, const QuantizedWeightArgs& w, int shape, cudaStream_t stream) {
  if (w.format == QuantizedFormat::Fp8Block)
    return launch_fused_shape<QuantizedFormat::Fp8Block, 8, Scale>(args, w, shape, stream);
  if (w.bits == 4) return launch_fused_shape<QuantizedFormat::Affine, 4, Scale>(args, w, shape, stream);
  return launch_fused_shape<QuantizedFormat::Affine, 8, Scale>(args, w, shape, stream);
}

// The shape for a product, from the shape sweep on the 8B's products (kiln_cuda_bench
// quantized-shapes, docs/perf.md 2026-12-07): 8-row blocks only where 16-row ones would be fewer
// than the multiprocessors (a 1024-row product: 16 % faster; at 4096 rows 8-row blocks were 5–25 %
// slower); eight warps where K has eight or more segments (so that no warp walks several: the
// 4-bit down product 54 → 45 µs), then in 8-row blocks for 8-bit codes, which decode faster and
// want more bytes in flight (58 against 65 µs). Eight warps with eight rows of x and 8-bit codes
// can need more shared memory than a block may have: then four.
int default_fused_shape(const MatmulArgs& args, const QuantizedWeightArgs& w) {
  const int64_t segments = (args.k + kMatmulSegmentK - 1) / kMatmulSegmentK;
  const int64_t wide_blocks = (args.n + 15) / 16;
  const int bits = w.format == QuantizedFormat::Fp8Block ? 8 : w.bits;
  const bool narrow = wide_blocks < args.multiprocessors;
  if (segments >= 8) {
    const int rows = narrow || bits == 8 ? 8 : 16;
    const int64_t stage = rows * (FusedLayout<8, 16>::kStageK * bits / 8 + 16) +
                          FusedLayout<8, 16>::kChunksPerStage * args.m * kChunkBytes;
    if (8 * kStages * stage + segments * FusedLayout<8, 16>::kSegmentBytes <= kMaxSharedPerBlock)
      return rows == 8 ? 3 : 2;
  }
  return narrow ? 1 : 0;
}

}  // namespace

// Whether dequantize_*_rows_kernel takes the weight: whole 32-bit words per row (a row of FP8
// starting on a word), FP8 blocks of whole words, rows of fewer than 2³¹ words.
bool decoded_by_rows(const QuantizedWeightArgs& w) {
  if (w.k / 4 > INT32_MAX || w.n > INT32_MAX) return false;
  if (w.format == QuantizedFormat::Fp8Block) return w.k % 4 == 0 && w.block_columns % 4 == 0;
  return w.bits == 4 || w.bits == 8;
}

template <typename Scale>
cudaError_t launch_dequantize_rows(const QuantizedWeightArgs& w, void* out, DType out_dtype, cudaStream_t stream) {
  cudaError_t status = cudaErrorInvalidValue;
  dispatch_activation(out_dtype, [&](auto tag) {
    using OutT = decltype(tag);
    auto* kernel = w.format == QuantizedFormat::Fp8Block ? &dequantize_fp8_rows_kernel<Scale, OutT>
                   : w.bits == 4                         ? &dequantize_affine_rows_kernel<4, Scale, OutT>
                                                         : &dequantize_affine_rows_kernel<8, Scale, OutT>;
    status = launch_after_previous(kernel, dim3(static_cast<unsigned>(w.n)), dim3(kRowThreads), 0, stream, w,
                                   static_cast<OutT*>(out));
  });
  return status;
}

cudaError_t launch_dequantize(const QuantizedWeightArgs& weight, void* out, DType out_dtype, cudaStream_t stream) {
  const int64_t count = weight.n * weight.k;
  if (count == 0) return cudaSuccess;
  if (decoded_by_rows(weight)) {
    switch (weight.scale_dtype) {
      case DType::BF16: return launch_dequantize_rows<bf16>(weight, out, out_dtype, stream);
      case DType::F16: return launch_dequantize_rows<__half>(weight, out, out_dtype, stream);
      case DType::F32: return launch_dequantize_rows<float>(weight, out, out_dtype, stream);
      default: return cudaErrorInvalidValue;
    }
  }
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(blocks_for(count, kThreads), 65536));
  cudaError_t status = cudaErrorInvalidValue;
  dispatch_activation(out_dtype, [&](auto tag) {
    using OutT = decltype(tag);
    status = launch_after_previous(&dequantize_kernel<OutT>, dim3(blocks), dim3(kThreads), 0, stream, weight,
                                   static_cast<OutT*>(out));
  });
  return status;
}

cudaError_t launch_embedding_quantized(const QuantizedWeightArgs& table, const int32_t* ids, int64_t tokens, void* out,
                                       DType out_dtype, DeviceErrorRecord* errors, cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(tokens), std::max(1u, std::min(blocks_for(table.k, kThreads), 8u)));
  cudaError_t status = cudaErrorInvalidValue;
  dispatch_activation(out_dtype, [&](auto tag) {
    using OutT = decltype(tag);
    status = launch_after_previous(&embedding_quantized_kernel<OutT>, grid, dim3(kThreads), 0, stream, table, ids,
                                   static_cast<OutT*>(out), errors);
  });
  return status;
}

bool quantized_decode_fused(const QuantizedWeightArgs& weight) {
  if (weight.format == QuantizedFormat::Fp8Block) return weight.k % 16 == 0 && weight.block_columns % kChunk == 0;
  return (weight.bits == 4 || weight.bits == 8) && (weight.k * weight.bits) % 128 == 0;
}

int quantized_decode_launch_shape_count() { return static_cast<int>(std::size(kFusedShapes)); }
QuantizedDecodeLaunchShape quantized_decode_launch_shape(int shape) { return kFusedShapes[shape]; }

cudaError_t launch_matmul_quantized_decode(const MatmulArgs& args, const QuantizedWeightArgs& weight,
                                           cudaStream_t stream, int shape) {
  if (args.m < 1 || args.m > kQuantizedDecodeMaxRows || !quantized_decode_fused(weight) ||
      shape >= quantized_decode_launch_shape_count())
    return cudaErrorInvalidValue;
  if (args.n == 0) return cudaSuccess;
  if (shape < 0) shape = default_fused_shape(args, weight);
  switch (weight.scale_dtype) {
    case DType::BF16: return launch_fused_format<bf16>(args, weight, shape, stream);
    case DType::F16: return launch_fused_format<__half>(args, weight, shape, stream);
    case DType::F32: return launch_fused_format<float>(args, weight, shape, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace kiln::cuda
