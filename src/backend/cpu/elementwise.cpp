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

void split_query_gate(const Tensor& query_and_gate, Tensor& query, Tensor& gate) {
  require_dtype(query_and_gate, DType::F32, "split_query_gate", "query_and_gate");
  require_dtype(query, DType::F32, "split_query_gate", "query");
  require_dtype(gate, DType::F32, "split_query_gate", "gate");
  require_same_numel(query, gate, "split_query_gate", "query", "gate");
  if (query.ndim() != 3 || query_and_gate.numel() != 2 * query.numel())
    fail("split_query_gate: query must be [T, heads, head_dim] and query_and_gate twice its size, got {} and {}",
         shape_string(query.shape()), shape_string(query_and_gate.shape()));
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
  require_dtype(x, DType::F32, "sigmoid_gate", "x");
  require_dtype(gate, DType::F32, "sigmoid_gate", "gate");
  require_same_numel(x, gate, "sigmoid_gate", "x", "gate");
  float* values = x.data<float>();
  const float* gates = gate.data<float>();
  ThreadPool::global().parallel_for(x.numel(), kElementsPerBlock, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) values[i] *= 1.0f / (1.0f + std::exp(-gates[i]));
  });
}

}  // namespace kiln::cpu
