// Rotate-half RoPE in place on x [T, heads, head_dim]; tokens in parallel.
#include <cmath>
#include <vector>

#include "backend/cpu/checks.h"
#include "backend/cpu/ops.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace kiln::cpu {

void rope(Tensor& x, const Tensor& positions, const Tensor& inv_freq, int rotary_dim) {
  constexpr std::string_view op = "rope";
  const RopeDims dims = check_rope(kCpuOps, op, "x", x, positions, inv_freq, rotary_dim);
  const int64_t tokens = dims.tokens, heads = dims.heads, head_dim = dims.head_dim;
  const int64_t half = rotary_dim / 2;

  const int32_t* position = positions.data<int32_t>();
  const float* frequencies = inv_freq.data<float>();
  float* data = x.data<float>();
  ThreadPool::global().parallel_for(tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> cosines(static_cast<size_t>(half));
    std::vector<float> sines(static_cast<size_t>(half));
    for (int64_t t = begin; t < end; ++t) {
      // The angle is rounded to f32 before cos/sin, as HF computes freqs = position · inv_freq.
      const float token_position = static_cast<float>(position[t]);
      for (int64_t j = 0; j < half; ++j) {
        const float angle = token_position * frequencies[j];
        cosines[j] = std::cos(angle);
        sines[j] = std::sin(angle);
      }
      for (int64_t head = 0; head < heads; ++head) {
        float* row = data + (t * heads + head) * head_dim;
        for (int64_t j = 0; j < half; ++j) {
          const float first = row[j];
          const float second = row[j + half];
          row[j] = first * cosines[j] - second * sines[j];
          row[j + half] = second * cosines[j] + first * sines[j];
        }
      }
    }
  });
}

}  // namespace kiln::cpu
