#include "core/weight.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/error.h"

namespace kiln {
namespace {

float float_at(const Tensor& tensor, int64_t index) {
  switch (tensor.dtype()) {
    case DType::F32: return tensor.data<float>()[index];
    case DType::BF16: return bf16_to_f32(tensor.data<uint16_t>()[index]);
    case DType::F16: return f16_to_f32(tensor.data<uint16_t>()[index]);
    default: fail("weight part of dtype {} is not floating-point", dtype_name(tensor.dtype()));
  }
}

void require_scale_dtype(const Tensor& tensor, const char* part, bool f16_allowed) {
  const DType dtype = tensor.dtype();
  if (dtype == DType::F32 || dtype == DType::BF16 || (f16_allowed && dtype == DType::F16)) return;
  fail("quantized weight: {} have dtype {}, expected {}", part, dtype_name(dtype),
       f16_allowed ? "F32, BF16 or F16" : "F32 or BF16");
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

Weight::Weight(Tensor dense) : shape_(dense.shape()), values_(std::move(dense)) {}

Weight Weight::affine(Tensor values, Tensor scales, Tensor biases, int bits, int group_size) {
  if (!is_affine_bits(bits)) fail("quantized weight: {} bits is not one of 2, 3, 4, 5, 6, 8", bits);
  if (!is_affine_group_size(group_size)) fail("quantized weight: group size {} is not one of 32, 64, 128", group_size);
  if (values.dtype() != DType::U32 || values.ndim() != 2)
    fail("quantized weight: packed values are {} {}, expected a U32 matrix", dtype_name(values.dtype()),
         shape_string(values.shape()));
  const int64_t rows = values.dim(0);
  if ((values.dim(1) * 32) % bits != 0)
    fail("quantized weight: {} packed words per row do not hold whole {}-bit codes", values.dim(1), bits);
  const int64_t columns = values.dim(1) * 32 / bits;
  if (columns % group_size != 0)
    fail("quantized weight: group size {} does not divide the input dimension {}", group_size, columns);
  const Shape group_shape{rows, columns / group_size};
  if (scales.shape() != group_shape)
    fail("quantized weight: scales are {}, expected {} for {} {}-bit codes per row in groups of {}",
         shape_string(scales.shape()), shape_string(group_shape), columns, bits, group_size);
  if (biases.shape() != group_shape)
    fail("quantized weight: biases are {}, expected {}", shape_string(biases.shape()), shape_string(group_shape));
  require_scale_dtype(scales, "scales", true);
  require_scale_dtype(biases, "biases", true);
  if (biases.dtype() != scales.dtype())
    fail("quantized weight: biases are {} but scales are {}", dtype_name(biases.dtype()), dtype_name(scales.dtype()));
  if (scales.device() != values.device() || biases.device() != values.device())
    fail("quantized weight: parts on different devices");
  Weight weight;
  weight.format_ = WeightFormat::Affine;
  weight.shape_ = {rows, columns};
  weight.values_ = std::move(values);
  weight.scales_ = std::move(scales);
  weight.biases_ = std::move(biases);
  weight.bits_ = bits;
  weight.group_size_ = group_size;
  return weight;
}

Weight Weight::fp8_block(Tensor values, Tensor scales, int block_rows, int block_columns) {
  if (values.dtype() != DType::F8E4M3 || values.ndim() != 2)
    fail("quantized weight: fp8 values are {} {}, expected an F8_E4M3 matrix", dtype_name(values.dtype()),
         shape_string(values.shape()));
  if (block_rows <= 0 || block_columns <= 0)
    fail("quantized weight: fp8 block size {}x{} is not positive", block_rows, block_columns);
  const Shape block_shape{ceil_div(values.dim(0), block_rows), ceil_div(values.dim(1), block_columns)};
  if (scales.shape() != block_shape)
    fail("quantized weight: weight_scale_inv is {}, expected {} for a {} matrix in {}x{} blocks",
         shape_string(scales.shape()), shape_string(block_shape), shape_string(values.shape()), block_rows,
         block_columns);
  require_scale_dtype(scales, "weight_scale_inv", false);
  if (scales.device() != values.device()) fail("quantized weight: parts on different devices");
  Weight weight;
  weight.format_ = WeightFormat::Fp8Block;
  weight.shape_ = values.shape();
  weight.values_ = std::move(values);
  weight.scales_ = std::move(scales);
  weight.block_rows_ = block_rows;
  weight.block_columns_ = block_columns;
  return weight;
}

int64_t Weight::dim(int axis) const {
  const int rank = static_cast<int>(shape_.size());
  if (axis < 0) axis += rank;
  if (axis < 0 || axis >= rank) fail("axis {} out of range for weight {}", axis, shape_string(shape_));
  return shape_[axis];
}

size_t Weight::nbytes() const {
  // A part the format does not have is a default tensor, whose empty shape would count one element.
  auto bytes = [](const Tensor& part) { return part.defined() ? part.nbytes() : size_t{0}; };
  return bytes(values_) + bytes(scales_) + bytes(biases_);
}

size_t Weight::row_nbytes() const {
  if (shape_.empty() || shape_[0] == 0) return 0;
  const auto rows = static_cast<size_t>(shape_[0]);
  switch (format_) {
    case WeightFormat::Dense: return values_.nbytes() / rows;
    case WeightFormat::Affine: return (values_.nbytes() + scales_.nbytes() + biases_.nbytes()) / rows;
    case WeightFormat::Fp8Block:
      return values_.nbytes() / rows + static_cast<size_t>(scales_.dim(1)) * dtype_size(scales_.dtype());
  }
  return 0;
}

std::string Weight::describe() const {
  switch (format_) {
    case WeightFormat::Dense: return fmt::format("dense {}", dtype_name(values_.dtype()));
    case WeightFormat::Affine:
      return fmt::format("affine {}-bit group {} (scales {})", bits_, group_size_, dtype_name(scales_.dtype()));
    case WeightFormat::Fp8Block:
      return fmt::format("fp8 e4m3 blocks {}x{} (scales {})", block_rows_, block_columns_, dtype_name(scales_.dtype()));
  }
  return "?";
}

Weight Weight::rows(int64_t first, int64_t count) const {
  const int64_t total = shape_.empty() ? 0 : shape_[0];
  if (first < 0 || count < 0 || first + count > total)
    fail("weight rows [{}, {}) are outside its {} rows", first, first + count, total);
  Weight view = *this;
  view.shape_[0] = count;
  view.values_ = values_.slice_rows(first, count);
  switch (format_) {
    case WeightFormat::Dense: break;
    case WeightFormat::Affine:
      view.scales_ = scales_.slice_rows(first, count);
      view.biases_ = biases_.slice_rows(first, count);
      break;
    case WeightFormat::Fp8Block:
      if (first % block_rows_ != 0 || (count % block_rows_ != 0 && first + count != total))
        fail("weight rows [{}, {}) do not fall on its FP8 blocks of {} rows", first, first + count, block_rows_);
      view.scales_ = scales_.slice_rows(first / block_rows_, ceil_div(count, block_rows_));
      break;
  }
  return view;
}

Weight Weight::with_parts(Tensor values, Tensor scales, Tensor biases) const {
  auto same = [](const Tensor& a, const Tensor& b) { return a.shape() == b.shape() && a.dtype() == b.dtype(); };
  if (!same(values, values_) || !same(scales, scales_) || !same(biases, biases_))
    fail("weight parts changed shape or dtype ({})", describe());
  Weight weight = *this;
  weight.values_ = std::move(values);
  weight.scales_ = std::move(scales);
  weight.biases_ = std::move(biases);
  return weight;
}

Weight Weight::in_code_order(CodeOrder order) const {
  if (!quantized()) fail("a dense weight has no codes to order");
  Weight weight = *this;
  weight.code_order_ = order;
  return weight;
}

void decode_rows(const Weight& weight, int64_t row_begin, int64_t row_end, float* out) {
  if (weight.device() != Device::CPU) fail("decode_rows reads host weights only");
  if (weight.code_order() != CodeOrder::Stored) fail("decode_rows reads codes in the stored order only");
  const int64_t columns = weight.dim(1);
  switch (weight.format()) {
    case WeightFormat::Dense:
      for (int64_t row = row_begin; row < row_end; ++row)
        for (int64_t k = 0; k < columns; ++k)
          *out++ = float_at(weight.values(), row * columns + k);
      return;
    case WeightFormat::Affine: {
      // The scale and bias are read once per group, not per element.
      const int64_t words = weight.values().dim(1), groups = weight.scales().dim(1);
      for (int64_t row = row_begin; row < row_end; ++row) {
        const uint32_t* codes = weight.values().data<uint32_t>() + row * words;
        for (int64_t group = 0; group < groups; ++group) {
          const float scale = float_at(weight.scales(), row * groups + group);
          const float bias = float_at(weight.biases(), row * groups + group);
          const int64_t first = group * weight.group_size();
          for (int64_t k = first; k < first + weight.group_size(); ++k)
            *out++ = affine_value(scale, affine_code(codes, weight.bits(), k), bias);
        }
      }
      return;
    }
    case WeightFormat::Fp8Block: {
      const int64_t block_columns = weight.scales().dim(1);
      for (int64_t row = row_begin; row < row_end; ++row) {
        const uint8_t* values = weight.values().data<uint8_t>() + row * columns;
        for (int64_t block = 0; block < block_columns; ++block) {
          const float scale = float_at(weight.scales(), row / weight.block_rows() * block_columns + block);
          const int64_t first = block * weight.block_columns();
          const int64_t last = std::min(columns, first + weight.block_columns());
          for (int64_t k = first; k < last; ++k) *out++ = fp8_e4m3_to_f32(values[k]) * scale;
        }
      }
      return;
    }
  }
}

}  // namespace kiln
