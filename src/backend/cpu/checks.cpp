#include "backend/cpu/checks.h"

#include <cstring>

#include "core/error.h"

namespace kiln::cpu {

void require_cpu(const Tensor& tensor, std::string_view op, std::string_view argument) {
  if (tensor.device() != Device::CPU) fail("{}: {} is not a host tensor", op, argument);
  if (!tensor.defined()) fail("{}: {} is an undefined tensor", op, argument);
}

void require_dtype(const Tensor& tensor, DType dtype, std::string_view op, std::string_view argument) {
  require_cpu(tensor, op, argument);
  if (tensor.dtype() != dtype)
    fail("{}: {} has dtype {}, expected {}", op, argument, dtype_name(tensor.dtype()), dtype_name(dtype));
}

void require_weight_dtype(const Tensor& tensor, std::string_view op, std::string_view argument) {
  require_cpu(tensor, op, argument);
  if (tensor.dtype() != DType::F32 && tensor.dtype() != DType::BF16 && tensor.dtype() != DType::F16)
    fail("{}: {} has dtype {}, expected F32, BF16 or F16", op, argument, dtype_name(tensor.dtype()));
}

void require_shape(const Tensor& tensor, const Shape& shape, std::string_view op, std::string_view argument) {
  if (tensor.shape() != shape)
    fail("{}: {} has shape {}, expected {}", op, argument, shape_string(tensor.shape()), shape_string(shape));
}

void require_same_numel(const Tensor& a, const Tensor& b, std::string_view op, std::string_view a_name,
                        std::string_view b_name) {
  if (a.numel() != b.numel())
    fail("{}: {} {} and {} {} differ in element count", op, a_name, shape_string(a.shape()), b_name,
         shape_string(b.shape()));
}

void widen_to_f32(const void* data, DType dtype, int64_t first, int64_t count, float* out) {
  if (dtype == DType::F32) {
    std::memcpy(out, static_cast<const float*>(data) + first, static_cast<size_t>(count) * sizeof(float));
    return;
  }
  for (int64_t i = 0; i < count; ++i) out[i] = weight_as_f32(data, dtype, first + i);
}

}  // namespace kiln::cpu
