// Helpers shared by the GPU tests (tests/cuda): skipping without a device, loading a fixture on the
// GPU, host tensors in any dtype, and comparisons.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>

#include <gtest/gtest.h>

#include "backend/cuda/cuda_backend.h"
#include "core/dtype.h"
#include "core/tensor.h"
#include "model/loader.h"
#include "model_test_support.h"

// Skips the test, saying why, when this process sees no CUDA device (CI builds the GPU tests
// with nvcc but runs them without a GPU).
#define KILN_REQUIRE_CUDA()                                                                     \
  if (::kiln::cuda_device_count() == 0)                                                         \
  GTEST_SKIP() << "no CUDA device visible (cudaGetDeviceCount reports none): GPU test skipped"

namespace kiln::testing {

// A fixture checkpoint loaded through the CLI's path onto a CUDA backend with `activations`.
inline TestModel open_cuda_model(const std::filesystem::path& dir, DType activations) {
  TestModel loaded;
  loaded.backend = make_cuda_backend(0, activations);
  loaded.model = load_model(dir, *loaded.backend, LoadOptions{});
  return loaded;
}

// F32 values drawn from N(0, scale²).
inline Tensor random_f32(const Shape& shape, std::mt19937& random, float scale = 1.0f) {
  Tensor tensor = Tensor::empty(shape, DType::F32);
  std::normal_distribution<float> normal(0.0f, scale);
  for (int64_t i = 0; i < tensor.numel(); ++i) tensor.data<float>()[i] = normal(random);
  return tensor;
}

// A host copy of an F32 tensor in `dtype` (F32, BF16 or F16; round to nearest even).
inline Tensor f32_as(const Tensor& values, DType dtype) {
  Tensor out = Tensor::empty(values.shape(), dtype);
  const float* source = values.data<float>();
  for (int64_t i = 0; i < values.numel(); ++i) {
    switch (dtype) {
      case DType::F32: out.data<float>()[i] = source[i]; break;
      case DType::BF16: out.data<uint16_t>()[i] = f32_to_bf16(source[i]); break;
      case DType::F16: out.data<uint16_t>()[i] = f32_to_f16(source[i]); break;
      case DType::I32: out.data<int32_t>()[i] = static_cast<int32_t>(source[i]); break;
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

}  // namespace kiln::testing
