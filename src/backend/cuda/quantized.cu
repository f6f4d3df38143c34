// Quantized weights (core/weight.h's layouts and decode rule): their decode into a scratch matrix
// (the prefill GEMM, the f32 kernel and the weights the fused kernel does not take read that), the
// quantized embedding, the fused BF16 decode matmul, which streams the packed bytes, and the
// fragment order the upload gives the weights that kernel takes.
//
// The fused decode kernel is matmul.cu's decode kernel with the weight stage holding packed rows:
// the same segments of 1024, 32-element chunks and two mma steps per chunk, each lane's A
// fragment words decoded from the stage (fma(scale, code, bias) or fp8 · scale_inv in f32, then
// rounded to bf16) instead of read as bf16, so every element is what the BF16 kernels give on the
// decoded matrix (the accumulation contract at the top of matmul.cu).
#include <cuda_fp8.h>

#include <climits>
#include <cstring>
#include <iterator>
#include <type_traits>

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

// --- the fragment order (CodeOrder::Fragment) ---
// Of each 32-element chunk of weight rows g and g + 8, the fused decode kernel's lane (g, q) takes
// elements 4q..4q+3 and 16+4q..16+4q+3 (load_chunk_words' A-fragment words). The upload rearranges
// each row so that those runs are one lane's consecutive bytes: the row is cut into blocks of 64
// bytes (128 codes at 4 bits, 64 at 8 and FP8; a row's last block holds the rest, a multiple of 16
// codes), and in a block of E codes the four codes from element 32c + 16h + 4q of the block (a
// quad, kept whole) move to quad position q·E/16 + 2c + h. Lane q's quads are then the run
// q·E/16 .. (q+1)·E/16 − 1 of the block: in a whole block 16 bytes, which one 16-byte load brings:
// at 4 bits one 32-bit word per chunk holding the lane's eight codes (elements 4q.. in its low
// half, 16+4q.. in its high half), at 8 bits two words per chunk of four codes each.
constexpr int kFragmentBlockBytes = 64;

template <int kBits>
constexpr int kFragmentBlockCodes = kFragmentBlockBytes * 8 / kBits;

// Where logical column `column` of a row of k codes sits in the row's fragment order (an index
// in codes from the row's start).
template <int kBits>
__device__ __forceinline__ int64_t fragment_index(int64_t column, int64_t k) {
  constexpr int kBlock = kFragmentBlockCodes<kBits>;
  const int64_t start = column / kBlock * kBlock;
  const int lanes = static_cast<int>(k - start < kBlock ? k - start : kBlock) / 16;  // quads per lane
  const int quad = static_cast<int>(column - start) / 4;
  return start + 4 * ((quad % 4) * lanes + 2 * (quad / 8) + (quad / 4) % 2) + column % 4;
}

// Its inverse: the logical column of index `index` of a fragment-ordered row of k codes.
template <int kBits>
__device__ __forceinline__ int64_t fragment_column(int64_t index, int64_t k) {
  constexpr int kBlock = kFragmentBlockCodes<kBits>;
  const int64_t start = index / kBlock * kBlock;
  const int codes = static_cast<int>(k - start < kBlock ? k - start : kBlock);
  const int lanes = codes / 16;
  const int position = static_cast<int>(index - start) / 4;
  // A whole block divides by a power of two known here; only a row's last block needs a division.
  const int lane = codes == kBlock ? position / (kBlock / 16) : position / lanes;
  const int run = position - lane * lanes;
  return start + 32 * (run / 2) + 16 * (run % 2) + 4 * lane + index % 4;
}

// A stored-order weight's rows rearranged into the fragment order in place: a warp per 64-byte
// block of a row, each lane moving one quad (2 bytes at 4 bits, 4 at 8) after every lane has read
// its own.
template <int kBits>
__global__ void arrange_fragments_kernel(uint8_t* values, int64_t n, int64_t k) {
  using Quad = std::conditional_t<kBits == 4, uint16_t, uint32_t>;
  constexpr int kBlock = kFragmentBlockCodes<kBits>;
  const int64_t blocks_per_row = (k + kBlock - 1) / kBlock;
  const int64_t row_bytes = k * kBits / 8;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t block = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
       block < n * blocks_per_row; block += warps) {
    Quad* row = reinterpret_cast<Quad*>(values + block / blocks_per_row * row_bytes);
    const int64_t start = block % blocks_per_row * kBlock;
    const bool mine = 4 * lane < k - start && lane < kBlock / 4;
    const Quad quad = mine ? row[start / 4 + lane] : Quad{};
    __syncwarp();
    if (mine) row[fragment_index<kBits>(start + 4 * lane, k) / 4] = quad;
  }
}

// Element (row, column) of the weight, decoded to f32 as core/weight.h says.
__device__ __forceinline__ float decoded_element(const QuantizedWeightArgs& w, int64_t row, int64_t column) {
  if (w.format == QuantizedFormat::Affine) {
    const uint32_t* words = static_cast<const uint32_t*>(w.values) + row * (w.k * w.bits / 32);
    const int64_t stored = !w.fragment_order ? column
                           : w.bits == 4     ? fragment_index<4>(column, w.k)
                                             : fragment_index<8>(column, w.k);
    const int64_t bit = stored * w.bits;
    const int shift = static_cast<int>(bit % 32);
    uint64_t pair = words[bit / 32];
    if (shift + w.bits > 32) pair |= static_cast<uint64_t>(words[bit / 32 + 1]) << 32;
    const uint32_t code = static_cast<uint32_t>(pair >> shift) & ((1u << w.bits) - 1u);
    const int64_t group = row * w.scale_columns + column / w.group_size;
    return fmaf(load_element(w.scales, group, w.scale_dtype), static_cast<float>(code),
                load_element(w.biases, group, w.scale_dtype));
  }
  const int64_t stored = w.fragment_order ? fragment_index<8>(column, w.k) : column;
  const uint8_t value = static_cast<const uint8_t*>(w.values)[row * w.k + stored];
  const int64_t block = row / w.block_rows * w.scale_columns + column / w.block_columns;
  return fp8_to_float(value) * load_element(w.scales, block, w.scale_dtype);
}

// Which rows a decode writes where. A matrix: every row, in place (out row r is weight row r). The
// experts of a routing (launch_dequantize_experts): blockIdx.y is a slot, and its expert's
// `rows` rows, weight rows e·rows + r, go to out rows slot·rows + r; slots past the routing's used
// ones decode nothing.
struct DecodedRows {
  const int32_t* groups = nullptr;  // null: a matrix
  ExpertGroupsLayout layout{0, 0};
  int64_t rows = 0;
  // The first weight row and out row of the block's slot (0, 0 for a matrix); false for an unused
  // slot. Read after the wait for the previous kernel, which wrote the routing.
  __device__ bool slot_rows(int64_t& weight_row, int64_t& out_row) const {
    weight_row = out_row = 0;
    if (!groups) return true;
    const int64_t slot = blockIdx.y;
    if (slot >= groups[layout.used()]) return false;
    weight_row = groups[layout.expert(slot)] * rows;
    out_row = slot * rows;
    return true;
  }
};

template <typename OutT>
__global__ void dequantize_kernel(QuantizedWeightArgs w, OutT* out, DecodedRows decoded) {
  follow_previous_grid();
  int64_t weight_row = 0, out_row = 0;
  if (!decoded.slot_rows(weight_row, out_row)) return;
  const int64_t count = (decoded.groups ? decoded.rows : w.n) * w.k;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[out_row * w.k + i] = from_float<OutT>(decoded_element(w, weight_row + i / w.k, i % w.k));
}

// The rows of 4- and 8-bit affine and FP8 weights decoded a block per row, each thread taking 32
// bits of codes at a time (8 or 4 affine elements, which always share a group: groups are 32, 64
// or 128 elements; 4 FP8 elements, inside one 128-column block) and writing their runs of outputs
// at once: in the stored order one run, in the fragment order runs of four (two at 4 bits: the
// word's halves, elements c and c + 16 of one chunk). Each element is decoded_element's value; the
// generic kernel above, an element per thread with 64-bit index arithmetic and its scale loaded
// per element, ran at a fraction of the copy bandwidth and held 4-bit prefill to 28 % of bf16's
// (docs/perf.md, 2026-12-07).
constexpr int kRowThreads = 256;

template <typename OutT, int kCount>
__device__ __forceinline__ void store_run(OutT* out, const float* values) {
  OutT rounded[kCount];
#pragma unroll
  for (int i = 0; i < kCount; ++i) rounded[i] = from_float<OutT>(values[i]);
  if constexpr (sizeof(rounded) % 16 == 0) {
    uint4 words[sizeof(rounded) / 16];
    memcpy(words, rounded, sizeof(rounded));
#pragma unroll
    for (size_t i = 0; i < std::size(words); ++i) reinterpret_cast<uint4*>(out)[i] = words[i];
  } else if constexpr (sizeof(rounded) % 8 == 0) {
    uint2 words[sizeof(rounded) / 8];
    memcpy(words, rounded, sizeof(rounded));
#pragma unroll
    for (size_t i = 0; i < std::size(words); ++i) reinterpret_cast<uint2*>(out)[i] = words[i];
  } else {
#pragma unroll
    for (int i = 0; i < kCount; ++i) out[i] = rounded[i];
  }
}

template <int kBits, typename Scale, typename OutT>
__global__ void dequantize_affine_rows_kernel(QuantizedWeightArgs w, OutT* out, DecodedRows decoded) {
  constexpr int kPerWord = 32 / kBits;
  constexpr uint32_t kMask = (1u << kBits) - 1u;
  follow_previous_grid();
  int64_t weight_row = 0, out_row = 0;
  if (!decoded.slot_rows(weight_row, out_row)) return;
  const int64_t row = weight_row + blockIdx.x;
  const int words = static_cast<int>(w.k / kPerWord);
  const uint32_t* codes = static_cast<const uint32_t*>(w.values) + row * words;
  const Scale* scales = static_cast<const Scale*>(w.scales) + row * w.scale_columns;
  const Scale* biases = static_cast<const Scale*>(w.biases) + row * w.scale_columns;
  OutT* row_out = out + (out_row + blockIdx.x) * w.k;
  for (int word = threadIdx.x; word < words; word += blockDim.x) {
    const uint32_t packed = codes[word];
    // The word's first element and, in the fragment order, where each run of four begins.
    const int64_t first = w.fragment_order ? fragment_column<kBits>(word * kPerWord, w.k) : word * kPerWord;
    const int group = static_cast<int>(first / w.group_size);
    const float scale = to_float(scales[group]), bias = to_float(biases[group]);
    float values[kPerWord];
#pragma unroll
    for (int i = 0; i < kPerWord; ++i) values[i] = fmaf(scale, code_value(packed >> (i * kBits) & kMask), bias);
    if (!w.fragment_order) {
      store_run<OutT, kPerWord>(row_out + first, values);
    } else {
#pragma unroll
      for (int run = 0; run < kPerWord / 4; ++run) store_run<OutT, 4>(row_out + first + 16 * run, values + 4 * run);
    }
  }
}

template <typename Scale, typename OutT>
__global__ void dequantize_fp8_rows_kernel(QuantizedWeightArgs w, OutT* out, DecodedRows decoded) {
  follow_previous_grid();
  int64_t weight_row = 0, out_row = 0;
  if (!decoded.slot_rows(weight_row, out_row)) return;
  const int64_t row = weight_row + blockIdx.x;
  const int words = static_cast<int>(w.k / 4);
  const uint32_t* codes = reinterpret_cast<const uint32_t*>(static_cast<const uint8_t*>(w.values) + row * w.k);
  const Scale* scales = static_cast<const Scale*>(w.scales) + row / w.block_rows * w.scale_columns;
  OutT* row_out = out + (out_row + blockIdx.x) * w.k;
  for (int word = threadIdx.x; word < words; word += blockDim.x) {
    const uint32_t four = codes[word];
    const int64_t first = w.fragment_order ? fragment_column<8>(word * 4, w.k) : word * 4;
    const float scale = to_float(scales[first / w.block_columns]);
    const float2 low = fp8_pair_to_float2(four & 0xffffu), high = fp8_pair_to_float2(four >> 16);
    const float values[4] = {low.x * scale, low.y * scale, high.x * scale, high.y * scale};
    store_run<OutT, 4>(row_out + first, values);
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
// Ring stages per warp: while one is decoded the next is in flight. A stage's decode takes far
// longer than its codes take to arrive (the kernel is bound by its instructions: docs/perf.md
// 2026-12-07), and a warp's ring is shared memory that limits the blocks per multiprocessor.
constexpr int kStages = 2;
// Hopper's opt-in limit of shared memory per block.
constexpr int kMaxSharedPerBlock = 227 * 1024;

// A stage holds kRowBytes of codes of each of the kRows rows (whole fragment blocks), then the m
// rows of x over the stage's k, each row's 32-element chunks as four 16-byte units, unit q holding
// elements 4q..4q+3 and 16+4q..16+4q+3 (lane q's B-fragment words, one load). In the odd rows of
// both, the 64-byte halves of every 128 bytes trade places: a 16-byte load instruction serves 8
// lanes at a time, four of row r and four of row r + 1 (lanes 4r..4r+7 read rows g = r, r + 1),
// which then read distinct banks. Stages are wide so that each stage's bookkeeping (copies,
// scales, the ring) is spread over many elements.
template <int kBits, int kRows_, int kRowBytes_>
struct FusedLayout {
  static_assert(kRowBytes_ % 128 == 0, "whole 128-byte swizzle spans");
  static constexpr int kRows = kRows_;
  static constexpr int kRowBytes = kRowBytes_;
  static constexpr int kBlocks = kRowBytes / kFragmentBlockBytes;
  static constexpr int kStageK = kRowBytes * 8 / kBits;
  static constexpr int kChunksPerStage = kStageK / kChunk;
  static constexpr int kChunksPerBlock = kChunksPerStage / kBlocks;
  static constexpr int kStagesPerSegment = static_cast<int>(kMatmulSegmentK) / kStageK;
  static constexpr int kWeightBytes = kRows * kRowBytes;
  static constexpr int kInputRowBytes = kStageK * 2;
  static constexpr int kSegmentBytes = 4 * 32 * 4;
  __host__ __device__ static int stage_bytes(int64_t m) { return kWeightBytes + static_cast<int>(m) * kInputRowBytes; }
  __host__ __device__ static int rings_bytes(int warps, int64_t m) { return warps * kStages * stage_bytes(m); }
};

// A stage's codes per row: 256 bytes (four fragment blocks: 512 k at 4 bits, 256 at 8), or 128
// where the stage's scales and biases would take more than 32 bytes per row (4-bit codes in groups
// of 32, f32 scales in groups of 64 or fewer): a lane holds them for two rows, of this stage and
// the next, in registers.
template <QuantizedFormat kFormat, int kBits, typename Scale, int kGroup>
constexpr int fused_row_bytes() {
  const int groups = 256 * 8 / kBits / kGroup;
  const int parts = kFormat == QuantizedFormat::Affine ? 2 : 1;
  return groups * parts * static_cast<int>(sizeof(Scale)) <= 32 ? 256 : 128;
}

// Where byte `byte` of row `row` of a stage's codes (or of x) goes: the 64-byte halves of each 128
// bytes trade places in odd rows.
__device__ __forceinline__ int swizzled(int row, int byte) { return byte ^ (row % 2 * 64); }

// A lane's share of a stage's code copies: of row lane / L (L = 32 / kRows lanes per row), the
// 16-byte units lane % L + L·j, so that each copy instruction reads whole 32-byte sectors and a
// lane's units are fixed offsets from one address. Rows past n copy row n − 1 (they feed only
// outputs that are never stored: an mma element depends on its own row and column alone); units
// past a row's end, in K's last stage, are zero-filled.
template <typename Layout>
struct FusedWeightCopies {
  static constexpr int kLanesPerRow = 32 / Layout::kRows;
  static constexpr int kCopies = Layout::kRowBytes / 16 / kLanesPerRow;
  static constexpr int kStride = 16 * kLanesPerRow;  // bytes from one of the lane's units to the next
  const uint8_t* source;  // the lane's first unit, at the row's first byte
  const uint8_t* fallback;
  int byte_limit;         // the lane's units lie inside the row while their offset in it is below this
  int target[2];          // its units' offset in a stage, less kStride·j: [whether unit j lands in
                          // the other half of its 128 bytes] (the odd rows' swizzle)
  __device__ FusedWeightCopies(const void* values, int64_t n, int row_bytes, int64_t row0) {
    const int lane = threadIdx.x % 32;
    const int row = lane / kLanesPerRow, first = lane % kLanesPerRow * 16;
    const int64_t source_row = row0 + row < n ? row0 + row : n - 1;
    source = static_cast<const uint8_t*>(values) + source_row * row_bytes + first;
    fallback = static_cast<const uint8_t*>(values);
    byte_limit = row_bytes - first;
    target[0] = row * Layout::kRowBytes + swizzled(row, first);
    target[1] = row * Layout::kRowBytes + swizzled(row, first + 64) - 64;
  }
  template <bool kLast>
  __device__ __forceinline__ void issue(uint8_t* stage, int stage_byte) const {
#pragma unroll
    for (int j = 0; j < kCopies; ++j) {
      const bool inside = !kLast || stage_byte + kStride * j < byte_limit;
      cp_async_16(stage + target[kStride * j / 64 % 2] + kStride * j,
                  inside ? source + stage_byte + kStride * j : fallback, inside);
    }
  }
};

// A lane's share of a stage's x copies: of each of the m rows, the 8-byte pieces p = lane + 32j
// (four elements each: the stage's elements 4p..4p+3) into half (p / 4) % 2 of unit p % 4 of chunk
// p / 8. Pieces past K are zero-filled: they meet zero weights or none.
template <typename Layout>
struct FusedInputCopies {
  static constexpr int kPieces = Layout::kStageK / 4 / 32;
  // Piece j + 1 lies 128 elements (four chunks) after piece j, in both x and the stage.
  static constexpr int kPieceStride = 32 * 4;
  int element;    // the lane's first piece's first element in the stage
  int target[2];  // its offset in the stage's x of an even and of an odd row
  __device__ FusedInputCopies() {
    const int lane = threadIdx.x % 32;
    element = 4 * lane;
    const int offset = lane / 8 * kChunkBytes + lane % 4 * 16 + lane / 4 % 2 * 8;
    target[0] = Layout::kWeightBytes + offset;
    target[1] = Layout::kWeightBytes + Layout::kInputRowBytes + swizzled(1, offset);
  }
  template <bool kLast>
  __device__ __forceinline__ void issue_row(uint8_t* line, const bf16* x_row, int64_t k, int stage_k) const {
#pragma unroll
    for (int j = 0; j < kPieces; ++j) {
      const bool valid = !kLast || stage_k + element + kPieceStride * j < k;
      cp_async_8(line + kPieceStride * 2 * j, valid ? x_row + stage_k + element + kPieceStride * j : x_row, valid);
    }
  }
  template <bool kLast>
  __device__ __forceinline__ void issue(uint8_t* stage, const bf16* x, int m, int64_t k, int stage_k) const {
    issue_row<kLast>(stage + target[0], x, k, stage_k);
#pragma unroll 1
    for (int row = 1; row < m; ++row)
      issue_row<kLast>(stage + (row % 2 ? target[1] : target[0]) + (row - row % 2) * Layout::kInputRowBytes,
                       x + row * k, k, stage_k);
  }
};

__device__ __forceinline__ uint32_t bf16_pair(float low, float high) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

// The 4-bit code at bits 4i..4i+3 of `word` (i ≤ 4), exactly, as f32, in two instructions: under
// the sign and exponent of 2^(23 − 4i) the code reads 2^(23 − 4i) + code (bit 4i is that float's
// units bit, and the bits of the float's fraction below and above the code are zero), and the
// subtraction of 2^(23 − 4i) is exact. Codes 5..7 of a word come from the word shifted right by 12.
template <int kPosition>
__device__ __forceinline__ float nibble_value(uint32_t word) {
  static_assert(kPosition >= 0 && kPosition <= 4, "the code lies below the exponent field");
  constexpr uint32_t kMagic = static_cast<uint32_t>(127 + 23 - 4 * kPosition) << 23;
  uint32_t bits;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(bits) : "r"(word), "n"(0xfu << (4 * kPosition)), "n"(kMagic));
  return __fsub_rn(__uint_as_float(bits), __uint_as_float(kMagic));
}

// The 8-bit code in byte i of `word`, exactly, as f32: the byte under the sign and exponent of
// 2²³ (one byte permute) reads 2²³ + code.
template <int kByte>
__device__ __forceinline__ float byte_value(uint32_t word) {
  return __fsub_rn(__uint_as_float(__byte_perm(word, 0x4b000000u, 0x7440u | kByte)), 8388608.0f);
}

// The lane's A-fragment words of one row's chunk (load_chunk_words' layout: .x, .y elements 4q..4q+3,
// .z, .w elements 16+4q..16+4q+3) from its fragment-ordered codes, each element decoded as
// core/weight.h says (fma(scale, code, bias) in f32; fp8 · scale_inv) and rounded to bf16. At 4
// bits the codes are one word; at 8 bits and FP8 two (`low`: elements 4q.., `high`: 16+4q..).
__device__ __forceinline__ uint4 decode_affine4(uint32_t word, float scale, float bias) {
  const uint32_t upper = word >> 12;
  auto value = [&](float code) { return __fmaf_rn(scale, code, bias); };
  return make_uint4(bf16_pair(value(nibble_value<0>(word)), value(nibble_value<1>(word))),
                    bf16_pair(value(nibble_value<2>(word)), value(nibble_value<3>(word))),
                    bf16_pair(value(nibble_value<4>(word)), value(nibble_value<2>(upper))),
                    bf16_pair(value(nibble_value<3>(upper)), value(nibble_value<4>(upper))));
}

__device__ __forceinline__ uint4 decode_affine8(uint32_t low, uint32_t high, float scale, float bias) {
  auto value = [&](float code) { return __fmaf_rn(scale, code, bias); };
  return make_uint4(bf16_pair(value(byte_value<0>(low)), value(byte_value<1>(low))),
                    bf16_pair(value(byte_value<2>(low)), value(byte_value<3>(low))),
                    bf16_pair(value(byte_value<0>(high)), value(byte_value<1>(high))),
                    bf16_pair(value(byte_value<2>(high)), value(byte_value<3>(high))));
}

__device__ __forceinline__ uint4 decode_fp8(uint32_t low, uint32_t high, float scale) {
  const float2 a = fp8_pair_to_float2(low & 0xffffu), b = fp8_pair_to_float2(low >> 16);
  const float2 c = fp8_pair_to_float2(high & 0xffffu), d = fp8_pair_to_float2(high >> 16);
  return make_uint4(bf16_pair(__fmul_rn(a.x, scale), __fmul_rn(a.y, scale)),
                    bf16_pair(__fmul_rn(b.x, scale), __fmul_rn(b.y, scale)),
                    bf16_pair(__fmul_rn(c.x, scale), __fmul_rn(c.y, scale)),
                    bf16_pair(__fmul_rn(d.x, scale), __fmul_rn(d.y, scale)));
}

__device__ __forceinline__ uint32_t word_of(const uint4& words, int i) {
  return i == 0 ? words.x : i == 1 ? words.y : i == 2 ? words.z : words.w;
}

// `kBytes` bytes from global memory into `target` in one load (2, 4, 8 or 16 bytes; 32 in two).
template <int kBytes>
__device__ __forceinline__ void load_bytes(void* target, const void* source) {
  if constexpr (kBytes == 2) {
    const uint16_t value = *static_cast<const uint16_t*>(source);
    memcpy(target, &value, 2);
  } else if constexpr (kBytes == 4) {
    const uint32_t value = *static_cast<const uint32_t*>(source);
    memcpy(target, &value, 4);
  } else if constexpr (kBytes == 8) {
    const uint2 value = *static_cast<const uint2*>(source);
    memcpy(target, &value, 8);
  } else {
    static_assert(kBytes % 16 == 0, "whole 16-byte loads");
    uint4 values[kBytes / 16];
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i) values[i] = static_cast<const uint4*>(source)[i];
    memcpy(target, values, kBytes);
  }
}

// The scales (and affine biases) of a stage for the lane's kRowsRead rows (g, and g + 8), as
// stored: the kGroups groups (FP8: blocks of 128 columns) of kGroup elements the stage's k covers.
template <QuantizedFormat kFormat, typename Scale, int kGroup, int kStageK, int kRowsRead>
struct StageScales {
  static constexpr bool kAffine = kFormat == QuantizedFormat::Affine;
  static constexpr int kGroups = kStageK / kGroup;
  Scale scale[kRowsRead][kGroups];
  Scale bias[kAffine ? kRowsRead : 1][kGroups];
};

// A lane's chunks of a stage: its codes of rows g and g + 8 read (16 bytes per row and fragment
// block), decoded into A fragments and multiplied with x's B fragments, chunk after chunk.
template <QuantizedFormat kFormat, int kBits, typename Scale, int kGroup, int kRows>
struct FusedChunks {
  using Layout = FusedLayout<kBits, kRows, fused_row_bytes<kFormat, kBits, Scale, kGroup>()>;
  static constexpr bool kAffine = kFormat == QuantizedFormat::Affine;
  static constexpr int kRowsRead = kRows == 16 ? 2 : 1;  // rows g and, in 16-row blocks, g + 8
  using Scales = StageScales<kFormat, Scale, kGroup, Layout::kStageK, kRowsRead>;
  static constexpr int kBlocks = Layout::kBlocks, kChunksPerBlock = Layout::kChunksPerBlock;
  static constexpr int kRowBytes = Layout::kRowBytes;
  static constexpr int kFragmentCodes = kFragmentBlockCodes<kBits>;
  int block_offset[kBlocks];  // row g's fragment block b in a stage (row g + 8: 8 rows on, the same parity)
  int input_offset[2];        // the lane's x unit of row min(g, m − 1) in the stage's first two chunks
  int q;
  int tail_codes;             // the codes of K's last stage, when K ends inside one (else 0)
  __device__ FusedChunks(int m, int tail_codes_) : tail_codes(tail_codes_) {
    const int lane = threadIdx.x % 32, g = lane / 4;
    q = lane % 4;
#pragma unroll
    for (int b = 0; b < kBlocks; ++b) block_offset[b] = g * kRowBytes + swizzled(g, b * kFragmentBlockBytes);
    // B columns past m repeat row m − 1: they only feed outputs that are never stored.
    const int input_row = g < m ? g : m - 1;
#pragma unroll
    for (int c = 0; c < 2; ++c)
      input_offset[c] = Layout::kWeightBytes + input_row * Layout::kInputRowBytes +
                        swizzled(input_row, c * kChunkBytes + q * 16);
  }

  // The stage's chunks: all of them, or (kLast) those of K's last stage up to K, with the stage's
  // scales of rows g and g + 8 (each widened where a chunk first takes it).
  template <bool kLast>
  __device__ __forceinline__ void run(float (&acc)[4], const uint8_t* stage, const Scales& scales) const {
    float scale[kRowsRead] = {}, offset[kRowsRead] = {};  // of the current chunk's group
#pragma unroll
    for (int b = 0; b < kBlocks; ++b) {
      if (kLast && b * kFragmentCodes >= tail_codes) break;
      uint4 codes[2];  // [row g, g + 8]: the lane's 16-byte unit of a whole block
      if constexpr (!kLast) {
#pragma unroll
        for (int r = 0; r < kRowsRead; ++r)
          codes[r] = *reinterpret_cast<const uint4*>(stage + block_offset[b] + r * 8 * kRowBytes + q * 16);
      }
      // A row's last block holds E codes (the rest of K), lane q's quads from quad q·E/16.
      const int block_codes = kLast ? min(kFragmentCodes, tail_codes - b * kFragmentCodes) : kFragmentCodes;
#pragma unroll
      for (int c = 0; c < kChunksPerBlock; ++c) {
        const int chunk = b * kChunksPerBlock + c;
        if (kLast && c * kChunk >= block_codes) break;
        // The chunk's words of row r: [r][0] its codes (at 8 bits elements 4q..), [r][1] at 8 bits
        // elements 16+4q.. (zero where K ends half-way through the chunk).
        uint32_t words[2][2] = {};
#pragma unroll
        for (int r = 0; r < kRowsRead; ++r) {
          if constexpr (!kLast) {
            words[r][0] = word_of(codes[r], kBits == 4 ? c : 2 * c);
            if (kBits == 8) words[r][1] = word_of(codes[r], 2 * c + 1);
          } else {
            const uint8_t* unit =
                stage + block_offset[b] + r * 8 * kRowBytes + (q * (block_codes / 16) + 2 * c) * (kBits / 2);
            words[r][0] = *reinterpret_cast<const uint32_t*>(unit);
            if (kBits == 8 && c * kChunk + 16 < block_codes) words[r][1] = *reinterpret_cast<const uint32_t*>(unit + 4);
          }
        }
        uint4 a[2] = {};
#pragma unroll
        for (int r = 0; r < kRowsRead; ++r) {
          if (chunk * kChunk % kGroup == 0) {
            scale[r] = to_float(scales.scale[r][chunk * kChunk / kGroup]);
            if constexpr (kAffine) offset[r] = to_float(scales.bias[r][chunk * kChunk / kGroup]);
          }
          if constexpr (!kAffine)
            a[r] = decode_fp8(words[r][0], words[r][1], scale[r]);
          else if constexpr (kBits == 4)
            a[r] = decode_affine4(words[r][0], scale[r], offset[r]);
          else
            a[r] = decode_affine8(words[r][0], words[r][1], scale[r], offset[r]);
          // Where K ends half-way through the chunk, the second step's elements are zero.
          if (kLast && kBits == 8 && c * kChunk + 16 >= block_codes) a[r].z = a[r].w = 0;
        }
        const uint4 tokens =
            *reinterpret_cast<const uint4*>(stage + input_offset[chunk % 2] + chunk / 2 * 2 * kChunkBytes);
        mma_chunk(acc, a[0], a[1], tokens);
      }
    }
  }
};

template <QuantizedFormat kFormat, int kBits, typename Scale, int kGroup, int kRows, int kWarps>
__global__ void __launch_bounds__(kWarps * 32)
    matmul_quantized_decode_kernel(const bf16* x, QuantizedWeightArgs w, const void* bias, DType bias_dtype, void* out,
                                   DType out_dtype, int64_t m_rows) {
  using Chunks = FusedChunks<kFormat, kBits, Scale, kGroup, kRows>;
  using Layout = typename Chunks::Layout;
  constexpr bool kAffine = kFormat == QuantizedFormat::Affine;
  constexpr bool kLowerRows = kRows == 16;  // whether the mma's rows g + 8 are weight rows
  constexpr int kStageK = Layout::kStageK, kRowBytes = Layout::kRowBytes;
  using Scales = typename Chunks::Scales;
  constexpr int kGroups = Scales::kGroups;
  extern __shared__ uint4 shared_words[];
  const int64_t n = w.n, k = w.k;
  const int m = static_cast<int>(m_rows);
  const int stage_bytes = Layout::stage_bytes(m);
  const int warps = static_cast<int>(blockDim.x) / 32;
  float* segment_sums =
      reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(shared_words) + Layout::rings_bytes(warps, m));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint8_t* ring = reinterpret_cast<uint8_t*>(shared_words) + warp * kStages * stage_bytes;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int g = lane / 4;
  const int total_stages = static_cast<int>((k + kStageK - 1) / kStageK);
  const WarpSegments<Layout::kStagesPerSegment> walk(total_stages, warp, warps);
  const int my_stages = walk.count;
  // K's last stage when K ends inside it: its codes, x and scales are read up to K only.
  const int tail_codes = static_cast<int>(k % kStageK);
  const int tail_stage = tail_codes != 0 ? total_stages - 1 : -1;

  // The scales of the lane's two rows (rows past n read row n − 1's: their outputs are never
  // stored). A stage's groups are one load per row and part where the rows' groups are a multiple
  // of the stage's (they then lie on multiples of kGroups), else one load per group, inside the row.
  const Scale* scales = static_cast<const Scale*>(w.scales);
  const Scale* biases = static_cast<const Scale*>(w.biases);
  const int64_t upper_row = row0 + g < n ? row0 + g : n - 1;
  const int64_t lower_row = row0 + g + 8 < n ? row0 + g + 8 : n - 1;
  const int64_t upper_scales = kAffine ? upper_row * w.scale_columns : upper_row / w.block_rows * w.scale_columns;
  const int64_t lower_scales = kAffine ? lower_row * w.scale_columns : lower_row / w.block_rows * w.scale_columns;
  const bool whole_groups = w.scale_columns % kGroups == 0 &&
                            reinterpret_cast<uintptr_t>(scales) % (kGroups * sizeof(Scale)) == 0 &&
                            (!kAffine || reinterpret_cast<uintptr_t>(biases) % (kGroups * sizeof(Scale)) == 0);
  auto request_scales = [&](int stage, Scales& next) {
    const int64_t first = static_cast<int64_t>(stage) * kGroups;
    const int64_t rows[2] = {upper_scales, lower_scales};
#pragma unroll
    for (int r = 0; r < Chunks::kRowsRead; ++r) {
      if (whole_groups && stage != tail_stage) {
        load_bytes<kGroups * sizeof(Scale)>(next.scale[r], scales + rows[r] + first);
        if constexpr (kAffine) load_bytes<kGroups * sizeof(Scale)>(next.bias[r], biases + rows[r] + first);
      } else {
#pragma unroll
        for (int i = 0; i < kGroups; ++i) {
          const int64_t column = first + i < w.scale_columns ? first + i : w.scale_columns - 1;
          next.scale[r][i] = scales[rows[r] + column];
          if constexpr (kAffine) next.bias[r][i] = biases[rows[r] + column];
        }
      }
    }
  };

  // The first stage's codes and scales are requested before waiting for the previous kernel
  // (they are constant), so with programmatic dependent launch their latency overlaps that
  // kernel's end; x and every store come after.
  const FusedWeightCopies<Layout> weight_copies(w.values, n, static_cast<int>(k * kBits / 8), row0);
  const FusedInputCopies<Layout> input_copies;
  // Stage `stage` of K into the ring's slot `slot`: its codes, then (after the previous kernel) x.
  auto issue_codes = [&](int stage, int slot) {
    uint8_t* target = ring + slot * stage_bytes;
    if (stage == tail_stage)
      weight_copies.template issue<true>(target, stage * kRowBytes);
    else
      weight_copies.template issue<false>(target, stage * kRowBytes);
  };
  auto issue_inputs = [&](int stage, int slot) {
    uint8_t* target = ring + slot * stage_bytes;
    if (stage == tail_stage)
      input_copies.template issue<true>(target, x, m, k, stage * kStageK);
    else
      input_copies.template issue<false>(target, x, m, k, stage * kStageK);
  };
  static_assert(kStages == 2, "one stage in flight while the other is decoded");
  int stage_index = walk.stage_of(0);
  Scales next_scales;
  if (my_stages > 0) {
    issue_codes(stage_index, 0);
    request_scales(stage_index, next_scales);
  }
  follow_previous_grid();
  if (my_stages > 0) issue_inputs(stage_index, 0);
  cp_async_commit();

  const Chunks chunks(m, tail_codes);
  float acc[4] = {};
  for (int i = 0; i < my_stages; ++i) {
    const Scales scales_now = next_scales;
    cp_async_wait<0>();
    __syncwarp();
    const int next_stage = walk.stage_of(i + 1);
    if (i + 1 < my_stages) {
      request_scales(next_stage, next_scales);
      issue_codes(next_stage, (i + 1) % kStages);
      issue_inputs(next_stage, (i + 1) % kStages);
    }
    cp_async_commit();
    const uint8_t* stage = ring + i % kStages * stage_bytes;
    if (stage_index == tail_stage)
      chunks.template run<true>(acc, stage, scales_now);
    else
      chunks.template run<false>(acc, stage, scales_now);
    walk.end_stage(i, acc, segment_sums, lane);
    stage_index = next_stage;
  }
  __syncthreads();
  if (warp != 0) return;
  float total[4] = {};
  fold_segments(segment_sums, walk.segments, lane, total);
  store_tile(total, row0, 0, kLowerRows, bias, bias_dtype, out, out_dtype, m, n);
}

template <QuantizedFormat kFormat, int kBits, typename Scale, int kGroup, int kRows, int kWarps>
cudaError_t launch_fused(const MatmulArgs& args, const QuantizedWeightArgs& w, cudaStream_t stream) {
  using Layout = typename FusedChunks<kFormat, kBits, Scale, kGroup, kRows>::Layout;
  auto* kernel = &matmul_quantized_decode_kernel<kFormat, kBits, Scale, kGroup, kRows, kWarps>;
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

template <QuantizedFormat kFormat, int kBits, typename Scale, int kGroup>
cudaError_t launch_fused_shape(const MatmulArgs& args, const QuantizedWeightArgs& w, int shape, cudaStream_t stream) {
  switch (shape) {
    case 0: return launch_fused<kFormat, kBits, Scale, kGroup, 16, 4>(args, w, stream);
    case 1: return launch_fused<kFormat, kBits, Scale, kGroup, 8, 4>(args, w, stream);
    case 2: return launch_fused<kFormat, kBits, Scale, kGroup, 16, 8>(args, w, stream);
    case 3: return launch_fused<kFormat, kBits, Scale, kGroup, 8, 8>(args, w, stream);
    default: return cudaErrorInvalidValue;
  }
}

// Affine kernels are built per group size: a stage's groups, and which of them each chunk takes,
// are then known to the compiler (one load per row for the stage's scales and one for its biases).
template <int kBits, typename Scale>
cudaError_t launch_fused_group(const MatmulArgs& args, const QuantizedWeightArgs& w, int shape, cudaStream_t stream) {
  switch (w.group_size) {
    case 32: return launch_fused_shape<QuantizedFormat::Affine, kBits, Scale, 32>(args, w, shape, stream);
    case 64: return launch_fused_shape<QuantizedFormat::Affine, kBits, Scale, 64>(args, w, shape, stream);
    case 128: return launch_fused_shape<QuantizedFormat::Affine, kBits, Scale, 128>(args, w, shape, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename Scale>
cudaError_t launch_fused_format(const MatmulArgs& args, const QuantizedWeightArgs& w, int shape, cudaStream_t stream) {
  if (w.format == QuantizedFormat::Fp8Block) {
    // weight_scale_inv is F32 or BF16 (Weight::fp8_block).
    if constexpr (std::is_same_v<Scale, __half>) return cudaErrorInvalidValue;
    else return launch_fused_shape<QuantizedFormat::Fp8Block, 8, Scale, 128>(args, w, shape, stream);
  }
  if (w.bits == 4) return launch_fused_group<4, Scale>(args, w, shape, stream);
  return launch_fused_group<8, Scale>(args, w, shape, stream);
}

// The shape for a product, from the shape sweep on the 8B's products (kiln_cuda_bench
// quantized-shapes, docs/perf.md 2026-12-07, on the kernel before the fragment order): 8-row
// blocks only where 16-row ones would be fewer than the multiprocessors (a 1024-row product: 16 %
// faster; at 4096 rows 8-row blocks were 5–25 % slower); eight warps where K has eight or more
// segments (so that no warp walks several: the 4-bit down product 54 → 45 µs), then in 8-row
// blocks for 8-bit codes, which decode faster and want more bytes in flight (58 against 65 µs).
// Eight warps with eight rows of x can need more shared memory than a block may have: then four.
int default_fused_shape(const MatmulArgs& args, const QuantizedWeightArgs& w) {
  const int64_t segments = (args.k + kMatmulSegmentK - 1) / kMatmulSegmentK;
  const int64_t wide_blocks = (args.n + 15) / 16;
  const int bits = w.format == QuantizedFormat::Fp8Block ? 8 : w.bits;
  const bool narrow = wide_blocks < args.multiprocessors;
  if (segments >= 8) {
    const int rows = narrow || bits == 8 ? 8 : 16;
    // Bounded by the widest stages (256 bytes of codes per row).
    using Widest4 = FusedLayout<4, 16, 256>;
    using Widest8 = FusedLayout<8, 16, 256>;
    const int64_t input_row_bytes = bits == 4 ? Widest4::kInputRowBytes : Widest8::kInputRowBytes;
    const int64_t stage = rows * Widest4::kRowBytes + args.m * input_row_bytes;
    if (8 * kStages * stage + segments * Widest4::kSegmentBytes <= kMaxSharedPerBlock) return rows == 8 ? 3 : 2;
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

// `grid`: a block per row of the matrix, or per row of an expert and slot.
template <typename Scale>
cudaError_t launch_dequantize_rows(const QuantizedWeightArgs& w, void* out, DType out_dtype, const DecodedRows& decoded,
                                   dim3 grid, cudaStream_t stream) {
  cudaError_t status = cudaErrorInvalidValue;
  dispatch_activation(out_dtype, [&](auto tag) {
    using OutT = decltype(tag);
    auto* kernel = w.format == QuantizedFormat::Fp8Block ? &dequantize_fp8_rows_kernel<Scale, OutT>
                   : w.bits == 4                         ? &dequantize_affine_rows_kernel<4, Scale, OutT>
                                                         : &dequantize_affine_rows_kernel<8, Scale, OutT>;
    status = launch_after_previous(kernel, grid, dim3(kRowThreads), 0, stream, w, static_cast<OutT*>(out), decoded);
  });
  return status;
}

// A weight's rows decoded as `decoded` says, over `grid` (the generic kernel: grid-stride over
// each block row's elements).
cudaError_t launch_decode_rows(const QuantizedWeightArgs& weight, void* out, DType out_dtype, const DecodedRows& decoded,
                               int64_t rows, unsigned slots, cudaStream_t stream) {
  if (decoded_by_rows(weight)) {
    const dim3 grid(static_cast<unsigned>(rows), slots);
    switch (weight.scale_dtype) {
      case DType::BF16: return launch_dequantize_rows<bf16>(weight, out, out_dtype, decoded, grid, stream);
      case DType::F16: return launch_dequantize_rows<__half>(weight, out, out_dtype, decoded, grid, stream);
      case DType::F32: return launch_dequantize_rows<float>(weight, out, out_dtype, decoded, grid, stream);
      default: return cudaErrorInvalidValue;
    }
  }
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(blocks_for(rows * weight.k, kThreads), 65536));
  cudaError_t status = cudaErrorInvalidValue;
  dispatch_activation(out_dtype, [&](auto tag) {
    using OutT = decltype(tag);
    status = launch_after_previous(&dequantize_kernel<OutT>, dim3(blocks, slots), dim3(kThreads), 0, stream, weight,
                                   static_cast<OutT*>(out), decoded);
  });
  return status;
}

bool fragment_order_applies(const QuantizedWeightArgs& weight) {
  if (weight.fragment_order || weight.n * weight.k == 0) return false;
  if (weight.format == QuantizedFormat::Fp8Block)
    return weight.k % 16 == 0 && weight.block_columns == 128 && weight.scale_dtype != DType::F16;
  // Groups of 32 or more codes: every row holds whole 16-code quad runs.
  return weight.bits == 4 || weight.bits == 8;
}

cudaError_t launch_arrange_fragments(const QuantizedWeightArgs& weight, cudaStream_t stream) {
  if (!fragment_order_applies(weight)) return cudaErrorInvalidValue;
  const int bits = weight.format == QuantizedFormat::Fp8Block ? 8 : weight.bits;
  const int64_t warps = weight.n * ((weight.k * bits / 8 + kFragmentBlockBytes - 1) / kFragmentBlockBytes);
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((warps + 7) / 8, int64_t{1} << 20));
  uint8_t* values = static_cast<uint8_t*>(const_cast<void*>(weight.values));
  if (bits == 4)
    arrange_fragments_kernel<4><<<blocks, 256, 0, stream>>>(values, weight.n, weight.k);
  else
    arrange_fragments_kernel<8><<<blocks, 256, 0, stream>>>(values, weight.n, weight.k);
  return cudaGetLastError();
}

cudaError_t launch_dequantize(const QuantizedWeightArgs& weight, void* out, DType out_dtype, cudaStream_t stream) {
  if (weight.n * weight.k == 0) return cudaSuccess;
  return launch_decode_rows(weight, out, out_dtype, DecodedRows{}, weight.n, 1, stream);
}

cudaError_t launch_dequantize_experts(const QuantizedWeightArgs& weight, int64_t rows_per_expert,
                                      const ExpertRouting& routing, void* out, DType out_dtype, cudaStream_t stream) {
  if (routing.slots > 65535 || rows_per_expert > INT32_MAX) return cudaErrorInvalidValue;
  if (routing.slots == 0 || rows_per_expert * weight.k == 0) return cudaSuccess;
  const DecodedRows decoded{routing.groups, ExpertGroupsLayout{routing.slots, routing.pairs}, rows_per_expert};
  return launch_decode_rows(weight, out, out_dtype, decoded, rows_per_expert, static_cast<unsigned>(routing.slots),
                            stream);
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

bool quantized_decode_fused(const QuantizedWeightArgs& weight) { return weight.fragment_order; }

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
