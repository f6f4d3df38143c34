// rms_norm and add_rms_norm: one row of D = weight.numel() elements at a time, rows in parallel.
#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/checks.h"
#include "backend/cpu/ops.h"
#include "backend/cpu/reductions.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace kiln::cpu {
namespace {

// Elements per parallel block: enough that waking a thread is worth it.
constexpr int64_t kElementsPerBlock = 16384;

// The per-element factor: w (Plain) or 1 + w computed in f32 (ZeroCentred, as HF Qwen3_5RMSNorm).
std::vector<float> gains_of(const Tensor& weight, NormStyle style) {
  std::vector<float> gains(static_cast<size_t>(weight.numel()));
  widen_to_f32(weight.raw(), weight.dtype(), 0, weight.numel(), gains.data());
  if (style == NormStyle::ZeroCentred)
    for (float& gain : gains) gain = 1.0f + gain;
  return gains;
}

// y = gain · (x · 1/sqrt(mean(x²) + eps)): the two roundings of HF's LlamaRMSNorm in f32.
void normalize_row(const float* x, const float* gains, int64_t width, float eps, float* out) {
  const float mean_square = dot_fixed_order(x, x, width) / static_cast<float>(width);
  const float inverse_rms = 1.0f / std::sqrt(mean_square + eps);
  for (int64_t i = 0; i < width; ++i) out[i] = gains[i] * (x[i] * inverse_rms);
}

}  // namespace

void rms_norm(const Tensor& x, const Tensor& weight, float eps, NormStyle style, Tensor& out) {
  const int64_t width = check_rms_norm(kCpuOps, x, weight, out).width;
  const std::vector<float> gains = gains_of(weight, style);
  const float* input = x.data<float>();
  float* output = out.data<float>();
  ThreadPool::global().parallel_for(x.numel() / width, std::max<int64_t>(1, kElementsPerBlock / width),
                                    [&](int64_t begin, int64_t end) {
                                      for (int64_t row = begin; row < end; ++row)
                                        normalize_row(input + row * width, gains.data(), width, eps,
                                                      output + row * width);
                                    });
}

void add_rms_norm(Tensor& residual, const Tensor& delta, const Tensor& weight, float eps, NormStyle style,
                  Tensor& out) {
  const int64_t width = check_add_rms_norm(kCpuOps, residual, delta, weight, out).width;
  const std::vector<float> gains = gains_of(weight, style);
  float* sums = residual.data<float>();
  const float* addends = delta.data<float>();
  float* output = out.data<float>();
  ThreadPool::global().parallel_for(residual.numel() / width, std::max<int64_t>(1, kElementsPerBlock / width),
                                    [&](int64_t begin, int64_t end) {
                                      for (int64_t row = begin; row < end; ++row) {
                                        float* sum_row = sums + row * width;
                                        const float* delta_row = addends + row * width;
                                        for (int64_t i = 0; i < width; ++i) sum_row[i] += delta_row[i];
                                        normalize_row(sum_row, gains.data(), width, eps, output + row * width);
                                      }
                                    });
}

}  // namespace kiln::cpu
