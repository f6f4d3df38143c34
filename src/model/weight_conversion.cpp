// WeightMap::convert_to: the load-time dtype conversion behind LoadOptions::dtype.
#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "model/load_plan.h"

namespace kiln {
namespace {

float element_as_f32(const Tensor& tensor, int64_t index) {
  switch (tensor.dtype()) {
    case DType::F32: return tensor.data<const float>()[index];
    case DType::F16: return f16_to_f32(tensor.data<const uint16_t>()[index]);
    case DType::BF16: return bf16_to_f32(tensor.data<const uint16_t>()[index]);
    case DType::I32: break;
  }
  fail("an {} tensor has no floating-point value", dtype_name(tensor.dtype()));
}

}  // namespace

void WeightMap::convert_to(DType dtype) {
  if (dtype == DType::I32) fail("{}: weights cannot be converted to {}", checkpoint_name_, dtype_name(dtype));
  for (auto& [canonical, tensor] : tensors_) {
    if (tensor.dtype() == dtype) continue;
    if (tensor.dtype() == DType::I32)
      fail("{}: tensor '{}' is {}, not a floating-point weight to convert to {}", checkpoint_name_,
           sources_.at(canonical), dtype_name(tensor.dtype()), dtype_name(dtype));
    const Tensor stored = tensor;
    Tensor converted = Tensor::empty(stored.shape(), dtype);
    // Widening F16/BF16 to f32 is exact, so each element is rounded once, from its stored value.
    ThreadPool::global().parallel_for(stored.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
      for (int64_t index = begin; index < end; ++index) {
        const float value = element_as_f32(stored, index);
        if (dtype == DType::F32) converted.data<float>()[index] = value;
        else if (dtype == DType::F16) converted.data<uint16_t>()[index] = f32_to_f16(value);
        else converted.data<uint16_t>()[index] = f32_to_bf16(value);
      }
    });
    tensor = std::move(converted);
  }
}

}  // namespace kiln
