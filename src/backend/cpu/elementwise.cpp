// add and swiglu: independent elements, split into large contiguous blocks.
#include <cmath>

#include "backend/cpu/checks.h"
#include "backend/cpu/ops.h"
#include "core/thread_pool.h"

namespace kiln::cpu {
namespace {

constexpr int64_t kElementsPerBlock = 32768;

}  // namespace

void add(Tensor& a, const Tensor& b) {
  require_dtype(a, DType::F32, "add", "a");
  require_dtype(b, DType::F32, "add", "b");
  require_same_numel(a, b, "add", "a", "b");
  float* sums = a.data<float>();
  const float* addends = b.data<float>();
  ThreadPool::global().parallel_for(a.numel(), kElementsPerBlock, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) sums[i] += addends[i];
  });
}

void swiglu(const Tensor& gate, const Tensor& up, Tensor& out) {
  require_dtype(gate, DType::F32, "swiglu", "gate");
  require_dtype(up, DType::F32, "swiglu", "up");
  require_dtype(out, DType::F32, "swiglu", "out");
  require_same_numel(gate, up, "swiglu", "gate", "up");
  require_same_numel(gate, out, "swiglu", "gate", "out");
  const float* gates = gate.data<float>();
  const float* ups = up.data<float>();
  float* outputs = out.data<float>();
  ThreadPool::global().parallel_for(gate.numel(), kElementsPerBlock, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float g = gates[i];
      // silu(g) = g / (1 + e^-g) (torch's formula); e^-g overflows to inf for g < -88, giving -0.
      outputs[i] = g / (1.0f + std::exp(-g)) * ups[i];
    }
  });
}

}  // namespace kiln::cpu
