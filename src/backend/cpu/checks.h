// What the CPU ops check beyond the op contract (backend/op_contract.h), and dtype widening shared
// by the CPU ops (internal to backend/cpu). Every failure is a kiln::Error naming the op and the
// argument.
#pragma once

#include <cstdint>
#include <string_view>

#include "backend/op_contract.h"
#include "core/tensor.h"

namespace kiln::cpu {

// The CPU backend as the op contract sees it: activations are f32.
inline constexpr OpContext kCpuOps{"cpu", DType::F32, Device::CPU};

// The tensor is defined and in host memory (the CPU's own placement rule).
void require_cpu(const Tensor& tensor, std::string_view op, std::string_view argument);

// Element `index` of a weight tensor's storage (F32, BF16 or F16, already checked) as f32; exact.
inline float weight_as_f32(const void* data, DType dtype, int64_t index) {
  if (dtype == DType::BF16) return bf16_to_f32(static_cast<const uint16_t*>(data)[index]);
  if (dtype == DType::F16) return f16_to_f32(static_cast<const uint16_t*>(data)[index]);
  return static_cast<const float*>(data)[index];
}

// `count` elements of a weight tensor's storage from `first`, widened to f32 into `out`.
void widen_to_f32(const void* data, DType dtype, int64_t first, int64_t count, float* out);

}  // namespace kiln::cpu
