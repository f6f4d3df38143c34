// Weight: the matrix operand of matmul and embedding, dense or quantized.
//
// A dense weight is one Tensor [N, K]. A quantized weight keeps its stored parts and how they
// decode, and has the logical shape [N, K] of the matrix they stand for:
//   Affine (MLX's layout; AWQ and GPTQ are repacked into it at load):
//     values  U32 [N, K·bits/32]  row n's K codes as one little-endian bit stream, code i in
//                                 bits [i·bits, (i+1)·bits) (for 2, 4, 8 bits each word holds
//                                 32/bits whole codes; 3, 5 and 6 bits cross word boundaries)
//     scales, biases [N, K/G]     (BF16, F16 or F32)
//     w[n, k] = fma(scale[n, k/G], q[n, k], bias[n, k/G]) in f32
//   Fp8Block (the Hugging Face "fp8" layout with weight_block_size):
//     values  F8E4M3 [N, K]
//     scales  [⌈N/Br⌉, ⌈K/Bc⌉]     weight_scale_inv (F32 or BF16), edge blocks partial
//     w[n, k] = fp8(values[n, k]) · scale[n/Br, k/Bc] in f32
// Every backend decodes an element to exactly that f32 value, then rounds it to its activation
// dtype where its dense path would read a weight of that dtype; the quantized matmul is thus
// bit-identical to the dense matmul of the decoded weights (backend parity, invariance).
//
// The codes of a row are stored in the order above unless the weight's CodeOrder says otherwise:
// a backend may rearrange them within each row when it uploads a weight (CodeOrder::Fragment, the
// CUDA backend's), keeping every part's bytes and shape.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "core/tensor.h"

namespace kiln {

enum class WeightFormat : uint8_t { Dense, Affine, Fp8Block };

// The order of a quantized weight's codes within each of its rows.
enum class CodeOrder : uint8_t {
  Stored,    // the layouts above: checkpoints, host weights, the CPU backend
  Fragment,  // the CUDA backend's tensor-core fragment order, which only its kernels read
             // (backend/cuda/quantized.cu); given to 4- and 8-bit affine and FP8 weights at upload
};

// The bits and group sizes of MLX affine quantization kiln runs (mlx.core.quantize's own set).
constexpr bool is_affine_bits(int bits) { return bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8; }
constexpr bool is_affine_group_size(int group) { return group == 32 || group == 64 || group == 128; }

class Weight {
 public:
  Weight() = default;
  // A dense weight (implicit: every op that takes a Weight takes a plain Tensor too).
  Weight(Tensor dense);  // NOLINT(google-explicit-constructor)
  // Checks the parts against each other (shapes, dtypes, bits, group size); errors say which part.
  static Weight affine(Tensor values, Tensor scales, Tensor biases, int bits, int group_size);
  static Weight fp8_block(Tensor values, Tensor scales, int block_rows, int block_columns);

  WeightFormat format() const { return format_; }
  bool quantized() const { return format_ != WeightFormat::Dense; }
  bool defined() const { return values_.defined(); }
  // The logical [N, K].
  const Shape& shape() const { return shape_; }
  int64_t dim(int axis) const;
  Device device() const { return values_.device(); }

  // Dense: the matrix itself. Affine: the packed codes. Fp8Block: the e4m3 values.
  const Tensor& values() const { return values_; }
  const Tensor& scales() const { return scales_; }
  const Tensor& biases() const { return biases_; }  // Affine only
  int bits() const { return bits_; }                 // Affine only
  int group_size() const { return group_size_; }     // Affine only
  int block_rows() const { return block_rows_; }     // Fp8Block only
  int block_columns() const { return block_columns_; }
  CodeOrder code_order() const { return code_order_; }

  // The floating-point dtype the matrix is kept in: a dense one's own; a quantized one's scales'
  // (MLX keeps them in the model's dtype).
  DType float_dtype() const { return quantized() ? scales_.dtype() : values_.dtype(); }
  // Bytes of every part (what a pass over the whole matrix reads); 0 for an undefined weight.
  size_t nbytes() const;
  // Bytes one row (for an embedding: one token's row) reads.
  size_t row_nbytes() const;
  // "dense BF16", "affine 4-bit group 64 (scales BF16)", "fp8 e4m3 blocks 128x128 (scales F32)".
  std::string describe() const;

  // Rows [first, first + count) of the matrix, a view of every part (one expert of a stacked
  // [experts · N, K] matrix). An Fp8Block weight's rows must start and, unless they reach the last
  // row, end on a block of rows; fails naming the rows otherwise.
  Weight rows(int64_t first, int64_t count) const;
  // The same layout over other tensors of the parts' shapes and dtypes (an upload's copies).
  Weight with_parts(Tensor values, Tensor scales, Tensor biases) const;
  // The same parts, whose codes the caller has rearranged into `order` (a quantized weight only).
  Weight in_code_order(CodeOrder order) const;

 private:
  WeightFormat format_ = WeightFormat::Dense;
  Shape shape_;
  Tensor values_, scales_, biases_;
  int bits_ = 0, group_size_ = 0;
  int block_rows_ = 0, block_columns_ = 0;
  CodeOrder code_order_ = CodeOrder::Stored;
};

// The code at index `index` of a row's packed bit stream (Affine).
inline uint32_t affine_code(const uint32_t* row_words, int bits, int64_t index) {
  const int64_t bit = index * bits;
  const int64_t word = bit / 32;
  const int shift = static_cast<int>(bit % 32);
  uint64_t pair = row_words[word];
  if (shift + bits > 32) pair |= static_cast<uint64_t>(row_words[word + 1]) << 32;
  return static_cast<uint32_t>(pair >> shift) & ((1u << bits) - 1u);
}

// The decoded value of an affine element (see the top of this file).
inline float affine_value(float scale, uint32_t code, float bias) {
  return std::fma(scale, static_cast<float>(code), bias);
}

// Decodes rows [row_begin, row_end) of a host weight (any format, codes in the stored order) into
// f32, row-major [rows, K].
void decode_rows(const Weight& weight, int64_t row_begin, int64_t row_end, float* out);

}  // namespace kiln
