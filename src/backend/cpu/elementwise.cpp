// add, swiglu and the gated-attention helpers: independent elements, split into large contiguous blocks.
#include <algorithm>
#include <cmath>

#include "backend/cpu/checks.h"
#include "backend/cpu/ops.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace kiln::cpu {
namespace {

constexpr int64_t kElementsPerBlock = 32768;

}  // namespace

void add(Tensor& a, const Tensor& b) {
  check_add(kCpuOps, a, b);
  float* sums = a.data<float>();
  const float* addends = b.data<float>();
  ThreadPool::global().parallel_for(a.numel(), kElementsPerBlock, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) sums[i] += addends[i];
  });
}

void swiglu(const Tensor& gate, const Tensor& up, Tensor& out) {
  check_swiglu(kCpuOps, gate, up, out);
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

void split_query_gate(const Tensor& query_and_gate, Tensor& query, Tensor& gate) {
  check_split_query_gate(kCpuOps, query_and_gate, query, gate);
  const int64_t head_dim = query.dim(2);
  const int64_t heads = query.numel() / head_dim;  // over all tokens
  const float* source = query_and_gate.data<float>();
  float* queries = query.data<float>();
  float* gates = gate.data<float>();
  ThreadPool::global().parallel_for(heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t head = begin; head < end; ++head) {
      std::copy_n(source + head * 2 * head_dim, head_dim, queries + head * head_dim);
      std::copy_n(source + head * 2 * head_dim + head_dim, head_dim, gates + head * head_dim);
    }
  });
}

void sigmoid_gate(Tensor& x, const Tensor& gate) {
  check_sigmoid_gate(kCpuOps, x, gate);
  float* values = x.data<float>();
  const float* gates = gate.data<float>();
  ThreadPool::global().parallel_for(x.numel(), kElementsPerBlock, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) values[i] *= 1.0f / (1.0f + std::exp(-gates[i]));
  });
}

}  // namespace kiln::cpu
