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
  require_dtype(x, DType::F32, op, "x");
  if (x.ndim() != 3) fail("rope: x has shape {}, expected [T, heads, head_dim]", shape_string(x.shape()));
  const int64_t tokens = x.dim(0);
  const int64_t heads = x.dim(1);
  const int64_t head_dim = x.dim(2);
  if (rotary_dim <= 0 || rotary_dim % 2 != 0 || rotary_dim > head_dim)
    fail("rope: rotary_dim {} must be even and in (0, head_dim = {}]", rotary_dim, head_dim);
  const int64_t half = rotary_dim / 2;
  require_dtype(positions, DType::I32, op, "positions");
  require_shape(positions, {tokens}, op, "positions");
  require_dtype(inv_freq, DType::F32, op, "inv_freq");
  require_shape(inv_freq, {half}, op, "inv_freq");

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
