// Host tensors for the op tests (tests/op_table and tests/cuda): random values, copies in any float
// dtype, and comparisons.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"

namespace kiln::testing {

// F32 values drawn from N(0, scale²).
inline Tensor random_f32(const Shape& shape, std::mt19937& random, float scale = 1.0f) {
  Tensor tensor = Tensor::empty(shape, DType::F32);
  std::normal_distribution<float> normal(0.0f, scale);
  for (int64_t i = 0; i < tensor.numel(); ++i) tensor.data<float>()[i] = normal(random);
  return tensor;
}

// A host copy of an F32 tensor in `dtype` (floats round to nearest even, FP8 saturating; integers
// truncate).
inline Tensor f32_as(const Tensor& values, DType dtype) {
  Tensor out = Tensor::empty(values.shape(), dtype);
  const float* source = values.data<float>();
  for (int64_t i = 0; i < values.numel(); ++i) {
    switch (dtype) {
      case DType::F32: out.data<float>()[i] = source[i]; break;
      case DType::BF16: out.data<uint16_t>()[i] = f32_to_bf16(source[i]); break;
      case DType::F16: out.data<uint16_t>()[i] = f32_to_f16(source[i]); break;
      case DType::I32: out.data<int32_t>()[i] = static_cast<int32_t>(source[i]); break;
      case DType::U32: out.data<uint32_t>()[i] = static_cast<uint32_t>(source[i]); break;
      case DType::F8E4M3: out.data<uint8_t>()[i] = f32_to_fp8_e4m3(source[i]); break;
    }
  }
  return out;
}

// The F32 values of a host float tensor.
inline Tensor as_f32(const Tensor& tensor) {
  Tensor out = Tensor::empty(tensor.shape(), DType::F32);
  for (int64_t i = 0; i < tensor.numel(); ++i) {
    switch (tensor.dtype()) {
      case DType::F32: out.data<float>()[i] = tensor.data<float>()[i]; break;
      case DType::BF16: out.data<float>()[i] = bf16_to_f32(tensor.data<uint16_t>()[i]); break;
      case DType::F16: out.data<float>()[i] = f16_to_f32(tensor.data<uint16_t>()[i]); break;
      case DType::I32: out.data<float>()[i] = static_cast<float>(tensor.data<int32_t>()[i]); break;
      case DType::U32: out.data<float>()[i] = static_cast<float>(tensor.data<uint32_t>()[i]); break;
      case DType::F8E4M3: out.data<float>()[i] = fp8_e4m3_to_f32(tensor.data<uint8_t>()[i]); break;
    }
  }
  return out;
}

// ‖ours − reference‖₂ / ‖reference‖₂ over the float values; infinite when ours has a NaN or the
// element counts differ.
inline double relative_error(const Tensor& ours, const Tensor& reference) {
  if (ours.numel() != reference.numel()) return INFINITY;
  const Tensor a = as_f32(ours), b = as_f32(reference);
  double difference = 0, norm = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double x = a.data<float>()[i], y = b.data<float>()[i];
    if (std::isnan(x)) return INFINITY;
    difference += (x - y) * (x - y);
    norm += y * y;
  }
  return norm > 0 ? std::sqrt(difference / norm) : std::sqrt(difference);
}

// Whether rows [row, row + count) of `a` and rows [other_row, …) of `b` (same row width) hold the
// same bytes.
inline bool same_rows(const Tensor& a, int64_t row, const Tensor& b, int64_t other_row, int64_t count) {
  const size_t row_bytes = a.nbytes() / static_cast<size_t>(a.dim(0));
  if (row_bytes != b.nbytes() / static_cast<size_t>(b.dim(0))) return false;
  return std::memcmp(static_cast<const char*>(a.raw()) + row * row_bytes,
                     static_cast<const char*>(b.raw()) + other_row * row_bytes, count * row_bytes) == 0;
}

// F32 values drawn uniformly from [low, high).
inline Tensor uniform_f32(const Shape& shape, std::mt19937& random, float low, float high) {
  Tensor tensor = Tensor::empty(shape, DType::F32);
  std::uniform_real_distribution<float> uniform(low, high);
  for (int64_t i = 0; i < tensor.numel(); ++i) tensor.data<float>()[i] = uniform(random);
  return tensor;
}

// Random float8 e4m3fn codes [n, k], none of them NaN (0x7f / 0xff).
inline Tensor random_fp8_codes(int64_t n, int64_t k, std::mt19937& random) {
  Tensor values = Tensor::empty({n, k}, DType::F8E4M3);
  for (int64_t i = 0; i < values.numel(); ++i) {
    uint8_t byte = static_cast<uint8_t>(random());
    if ((byte & 0x7f) == 0x7f) byte ^= 1;
    values.data<uint8_t>()[i] = byte;
  }
  return values;
}

// `values` with every row along the last axis scaled to unit L2 norm.
inline Tensor unit_rows(Tensor values) {
  const int64_t width = values.dim(-1);
  for (int64_t row = 0; row < values.numel() / width; ++row) {
    float* x = values.data<float>() + row * width;
    double norm = 0;
    for (int64_t i = 0; i < width; ++i) norm += static_cast<double>(x[i]) * x[i];
    for (int64_t i = 0; i < width; ++i) x[i] = static_cast<float>(x[i] / std::sqrt(norm));
  }
  return values;
}

// An I32 host tensor of `values`.
inline Tensor indices(const std::vector<int32_t>& values) {
  Tensor tensor = Tensor::empty({static_cast<int64_t>(values.size())}, DType::I32);
  std::copy(values.begin(), values.end(), tensor.data<int32_t>());
  return tensor;
}

}  // namespace kiln::testing
