#include "backend/cpu/checks.h"

#include <cstring>

#include "core/error.h"

namespace kiln::cpu {

void require_cpu(const Tensor& tensor, std::string_view op, std::string_view argument) {
  if (!tensor.defined()) fail("cpu {}: {} is an undefined tensor", op, argument);
  if (tensor.device() != Device::CPU) fail("cpu {}: {} is not a host tensor", op, argument);
}

void widen_to_f32(const void* data, DType dtype, int64_t first, int64_t count, float* out) {
  if (dtype == DType::F32) {
    std::memcpy(out, static_cast<const float*>(data) + first, static_cast<size_t>(count) * sizeof(float));
    return;
  }
  for (int64_t i = 0; i < count; ++i) out[i] = weight_as_f32(data, dtype, first + i);
}

}  // namespace kiln::cpu
