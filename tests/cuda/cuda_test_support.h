// Helpers shared by the GPU tests (tests/cuda): skipping without a device and loading a fixture on
// the GPU (host tensors in any dtype and comparisons are in tensor_test_support.h).
#pragma once

#include <gtest/gtest.h>

#include "backend/cuda/cuda_backend.h"
#include "core/dtype.h"
#include "core/tensor.h"
#include "model/loader.h"
#include "model_test_support.h"
#include "tensor_test_support.h"

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

}  // namespace kiln::testing
