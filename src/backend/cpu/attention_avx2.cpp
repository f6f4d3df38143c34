// AVX2 attention loops: the bits of the portable ones (attention_kernels.h), 8 lanes at a time.
#include "backend/cpu/attention_kernels.h"
#include "backend/cpu/attention_weighted_sums.h"
#include "backend/cpu/simd_avx2.h"

namespace kiln::cpu {
namespace {

void group_scores(const float* q, int64_t heads, const float* keys, int64_t key_stride, int64_t count,
                  int64_t head_dim, float scale, float* scores, int64_t score_stride) {
  const int64_t full_end = head_dim / 16 * 16;
  const int64_t tail = head_dim - full_end;
  const __m256i low_mask = lane_mask(tail), high_mask = lane_mask(tail - 8);
  for (int64_t j = 0; j < count; ++j) {
    const float* key = keys + j * key_stride;
    for (int64_t g = 0; g < heads; ++g) {
      const float* query = q + g * head_dim;
      // Lanes 0-7 and 8-15 of the 16 in reductions.h.
      __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();
      for (int64_t d = 0; d < full_end; d += 16) {
        low = _mm256_add_ps(low, _mm256_mul_ps(_mm256_loadu_ps(query + d), _mm256_loadu_ps(key + d)));
        high = _mm256_add_ps(high, _mm256_mul_ps(_mm256_loadu_ps(query + d + 8), _mm256_loadu_ps(key + d + 8)));
      }
      // Masked-off lanes add +0 · +0 = +0, which leaves any lane unchanged (a lane that starts at +0
      // never becomes -0), matching the portable loop that skips them.
      if (tail) {
        low = _mm256_add_ps(low, _mm256_mul_ps(_mm256_maskload_ps(query + full_end, low_mask),
                                               _mm256_maskload_ps(key + full_end, low_mask)));
        high = _mm256_add_ps(high, _mm256_mul_ps(_mm256_maskload_ps(query + full_end + 8, high_mask),
                                                 _mm256_maskload_ps(key + full_end + 8, high_mask)));
      }
      scores[g * score_stride + j] = scale * sum_lanes(_mm256_add_ps(low, high));
    }
  }
}

// Up to 2 heads × 32 dims per pass: 8 accumulators and 4 value vectors stay in the 16 registers.
constexpr int kHeadsPerPass = 2;

}  // namespace

const AttentionKernels& attention_kernels_avx2() {
  static const AttentionKernels kernels{&group_scores, &simd_group_weighted_sums<Avx2Lanes, kHeadsPerPass>};
  return kernels;
}

}  // namespace kiln::cpu
