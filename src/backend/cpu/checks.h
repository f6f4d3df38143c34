// Argument checks and dtype widening shared by the CPU ops (internal to backend/cpu).
// Every failure is a kiln::Error naming the op and the argument.
#pragma once

#include <cstdint>
#include <string_view>

#include "core/tensor.h"

namespace kiln::cpu {

void require_cpu(const Tensor& tensor, std::string_view op, std::string_view argument);
void require_dtype(const Tensor& tensor, DType dtype, std::string_view op, std::string_view argument);
// F32, BF16 or F16: the dtypes a weight may be stored in.
void require_weight_dtype(const Tensor& tensor, std::string_view op, std::string_view argument);
void require_shape(const Tensor& tensor, const Shape& shape, std::string_view op, std::string_view argument);
void require_same_numel(const Tensor& a, const Tensor& b, std::string_view op, std::string_view a_name,
                        std::string_view b_name);

// Element `index` of a weight tensor's storage (F32, BF16 or F16, already checked) as f32; exact.
inline float weight_as_f32(const void* data, DType dtype, int64_t index) {
  if (dtype == DType::BF16) return bf16_to_f32(static_cast<const uint16_t*>(data)[index]);
  if (dtype == DType::F16) return f16_to_f32(static_cast<const uint16_t*>(data)[index]);
  return static_cast<const float*>(data)[index];
}

// `count` elements of a weight tensor's storage from `first`, widened to f32 into `out`.
void widen_to_f32(const void* data, DType dtype, int64_t first, int64_t count, float* out);

}  // namespace kiln::cpu
