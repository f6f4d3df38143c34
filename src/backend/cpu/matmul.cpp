// matmul: argument checks, packing x, the split over output columns, and the portable kernel.
#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "backend/cpu/checks.h"
#include "backend/cpu/ops.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace kiln::cpu {
namespace {

// How a packed x block orders its elements (see MatmulKernels).
enum class BlockOrder { Natural, Bf16PairsSplit, NibblesInterleaved };

// x rows → blocks of block_k floats, zeros past k, in `order`.
void pack_rows(const float* x, int64_t row_begin, int64_t row_end, int64_t k, int64_t k_padded, int64_t block_k,
               BlockOrder order, float* packed) {
  const int64_t half = block_k / 2;
  auto at = [k](const float* source, int64_t index) { return index < k ? source[index] : 0.0f; };
  for (int64_t row = row_begin; row < row_end; ++row) {
    const float* source = x + row * k;
    float* target = packed + row * k_padded;
    switch (order) {
      case BlockOrder::Natural:
        std::memcpy(target, source, static_cast<size_t>(k) * sizeof(float));
        std::fill(target + k, target + k_padded, 0.0f);
        break;
      case BlockOrder::Bf16PairsSplit:
        for (int64_t block = 0; block < k_padded; block += block_k)
          for (int64_t i = 0; i < half; ++i) {
            target[block + i] = at(source, block + 2 * i);
            target[block + half + i] = at(source, block + 2 * i + 1);
          }
        break;
      case BlockOrder::NibblesInterleaved:
        for (int64_t start = 0; start < k_padded; start += half)
          for (int64_t i = 0; i < half / 2; ++i) {
            target[start + 2 * i] = at(source, start + i);
            target[start + 2 * i + 1] = at(source, start + half / 2 + i);
          }
        break;
    }
  }
}

// Floats of x a packing thread takes at least: below that, waking a thread costs more than it saves.
constexpr int64_t kPackFloatsPerBlock = 65536;

// The portable kernel: 8 lanes, blocks of 16 (half 0 = k0..k0+7, half 1 = k0+8..k0+15), a
// separate multiply and add per product, the lane tree 8 → 4 → 2 → 1.
constexpr int64_t kScalarBlockK = 16;
constexpr int kScalarLanes = 8;

// Column `column`'s product with every row of x, block by block: Weights::read(column, k0, valid,
// weights) writes the column's f32 weights k0 .. k0 + valid - 1.
template <class Weights>
void scalar_columns_of(const MatmulOperands& op, const Weights& w, int64_t n_begin, int64_t n_end) {
  for (int64_t column = n_begin; column < n_end; ++column) {
    for (int64_t row = 0; row < op.rows; ++row) {
      const float* x = op.x_packed + row * op.k_padded;
      float acc[kScalarLanes] = {};
      for (int64_t k0 = 0; k0 < op.k; k0 += kScalarBlockK) {
        float weights[kScalarBlockK] = {};
        w.read(column, k0, std::min(kScalarBlockK, op.k - k0), weights);
        for (int h = 0; h < 2; ++h)
          for (int lane = 0; lane < kScalarLanes; ++lane)
            acc[lane] += x[k0 + h * kScalarLanes + lane] * weights[h * kScalarLanes + lane];
      }
      for (int width = kScalarLanes / 2; width >= 1; width /= 2)
        for (int lane = 0; lane < width; ++lane) acc[lane] += acc[lane + width];
      op.out[row * op.n + column] = op.bias ? acc[0] + op.bias[column] : acc[0];
    }
  }
}

template <class Element, float (*widen)(Element)>
struct DenseRows {
  const Element* w;
  int64_t k;
  void read(int64_t column, int64_t k0, int64_t valid, float* weights) const {
    for (int64_t i = 0; i < valid; ++i) weights[i] = widen(w[column * k + k0 + i]);
  }
};

float widen_at(const Tensor& tensor, int64_t index) {
  switch (tensor.dtype()) {
    case DType::BF16: return bf16_to_f32(tensor.data<uint16_t>()[index]);
    case DType::F16: return f16_to_f32(tensor.data<uint16_t>()[index]);
    default: return tensor.data<float>()[index];  // Weight admits F32, BF16 and F16 scales only
  }
}

// An affine weight's elements decoded as core/weight.h defines them.
struct AffineRows {
  const Weight& w;
  void read(int64_t column, int64_t k0, int64_t valid, float* weights) const {
    const uint32_t* codes = w.values().data<uint32_t>() + column * w.values().dim(1);
    const int64_t groups = w.scales().dim(1);
    for (int64_t i = 0; i < valid; ++i) {
      const int64_t group = column * groups + (k0 + i) / w.group_size();
      weights[i] = affine_value(widen_at(w.scales(), group), affine_code(codes, w.bits(), k0 + i),
                                widen_at(w.biases(), group));
    }
  }
};

// An fp8 block weight's elements decoded as core/weight.h defines them.
struct Fp8BlockRows {
  const Weight& w;
  void read(int64_t column, int64_t k0, int64_t valid, float* weights) const {
    const uint8_t* values = w.values().data<uint8_t>() + column * w.dim(1);
    const int64_t scale_row = column / w.block_rows() * w.scales().dim(1);
    for (int64_t i = 0; i < valid; ++i)
      weights[i] = fp8_e4m3_to_f32(values[k0 + i]) * widen_at(w.scales(), scale_row + (k0 + i) / w.block_columns());
  }
};

float identity(float value) { return value; }

void scalar_columns(const MatmulOperands& op, int64_t n_begin, int64_t n_end) {
  if (op.quantized) {
    if (op.quantized->format() == WeightFormat::Fp8Block)
      return scalar_columns_of(op, Fp8BlockRows{*op.quantized}, n_begin, n_end);
    return scalar_columns_of(op, AffineRows{*op.quantized}, n_begin, n_end);
  }
  switch (op.w_dtype) {
    case DType::F32:
      return scalar_columns_of(op, DenseRows<float, identity>{static_cast<const float*>(op.w), op.k}, n_begin, n_end);
    case DType::BF16:
      return scalar_columns_of(op, DenseRows<uint16_t, bf16_to_f32>{static_cast<const uint16_t*>(op.w), op.k},
                               n_begin, n_end);
    case DType::F16:
      return scalar_columns_of(op, DenseRows<uint16_t, f16_to_f32>{static_cast<const uint16_t*>(op.w), op.k},
                               n_begin, n_end);
    default: return;  // rejected by matmul() before any kernel runs
  }
}

// Weight rows a quantized matmul decodes at a time (per thread): the f32 block stays in L2.
constexpr int64_t kDecodedRowsPerBlock = 64;

// out[:, n_begin:n_end] for a quantized w no kernel multiplies directly (has_quantized_kernel):
// each block of rows is decoded to f32 (core/weight.h) and multiplied by the f32 kernel, whose
// per-element order depends on K alone, so the result is the dense f32 matmul of the decoded
// weights.
void decoded_columns(const MatmulKernels& kernels, const MatmulOperands& dense, const Weight& w, int64_t n_begin,
                     int64_t n_end) {
  thread_local std::vector<float> decoded;
  for (int64_t begin = n_begin; begin < n_end; begin += kDecodedRowsPerBlock) {
    const int64_t end = std::min(n_end, begin + kDecodedRowsPerBlock);
    decoded.resize(static_cast<size_t>((end - begin) * dense.k));
    decode_rows(w, begin, end, decoded.data());
    MatmulOperands block = dense;
    block.w = decoded.data();
    block.w_dtype = DType::F32;
    block.out = dense.out + begin;  // out keeps its row stride n; column c of the block is begin + c
    block.bias = dense.bias ? dense.bias + begin : nullptr;
    kernels.columns(block, 0, end - begin);
  }
}

}  // namespace

bool has_quantized_kernel(const Weight& weight) {
  switch (weight.format()) {
    case WeightFormat::Affine: return weight.bits() == 4 || weight.bits() == 8;
    case WeightFormat::Fp8Block: return weight.block_columns() % 32 == 0;
    case WeightFormat::Dense: return false;
  }
  return false;
}

const float* fp8_e4m3_table() {
  static const auto table = [] {
    std::array<float, 256> values{};
    for (int byte = 0; byte < 256; ++byte) values[byte] = fp8_e4m3_to_f32(static_cast<uint8_t>(byte));
    return values;
  }();
  return table.data();
}

const MatmulKernels& matmul_kernels_scalar() {
  static const MatmulKernels kernels{kScalarBlockK, 1, false, false, &scalar_columns};
  return kernels;
}

void matmul(const MatmulKernels& kernels, const Tensor& x, const Weight& w, const Tensor* bias, Tensor& out,
            MatmulScratch& scratch) {
  const MatmulDims dims = check_matmul(kCpuOps, x, w, bias, out);
  const int64_t rows = dims.rows, n = dims.n, k = dims.k;
  if (rows == 0 || n == 0) return;

  const int64_t k_padded = (k + kernels.block_k - 1) / kernels.block_k * kernels.block_k;
  if (!scratch.packed_x.defined() || scratch.packed_x.numel() < rows * k_padded)
    scratch.packed_x = Tensor::empty({rows * k_padded}, DType::F32);
  float* packed = scratch.packed_x.data<float>();
  const DType w_dtype = w.quantized() ? DType::F32 : w.values().dtype();
  const bool nibbles = w.format() == WeightFormat::Affine && w.bits() == 4;
  const BlockOrder order = kernels.bf16_pairs_split && w_dtype == DType::BF16 ? BlockOrder::Bf16PairsSplit
                           : kernels.nibbles_interleaved && nibbles         ? BlockOrder::NibblesInterleaved
                                                                              : BlockOrder::Natural;
  ThreadPool& pool = ThreadPool::global();
  pool.parallel_for(rows, std::max<int64_t>(1, kPackFloatsPerBlock / k_padded), [&](int64_t begin, int64_t end) {
    pack_rows(x.data<float>(), begin, end, k, k_padded, kernels.block_k, order, packed);
  });

  const float* bias_f32 = nullptr;
  if (bias && bias->dtype() == DType::F32) {
    bias_f32 = bias->data<float>();
  } else if (bias) {
    scratch.bias.resize(static_cast<size_t>(n));
    widen_to_f32(bias->raw(), bias->dtype(), 0, n, scratch.bias.data());
    bias_f32 = scratch.bias.data();
  }

  MatmulOperands operands{packed, rows, k, k_padded, w.values().raw(), w_dtype, bias_f32, out.data<float>(), n};
  if (w.quantized() && has_quantized_kernel(w)) operands.quantized = &w;
  if (w.quantized() && !operands.quantized) {
    pool.parallel_for(n, std::max(kernels.column_grain, kDecodedRowsPerBlock),
                      [&](int64_t begin, int64_t end) { decoded_columns(kernels, operands, w, begin, end); });
    return;
  }
  pool.parallel_for(n, kernels.column_grain,
                    [&](int64_t begin, int64_t end) { kernels.columns(operands, begin, end); });
}

}  // namespace kiln::cpu
