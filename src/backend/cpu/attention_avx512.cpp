// AVX-512 attention loops: the bits of the portable ones (attention_kernels.h), 16 lanes at a time.
#include "backend/cpu/attention_kernels.h"
#include "backend/cpu/attention_weighted_sums.h"
#include "backend/cpu/simd_avx512.h"

namespace kiln::cpu {
namespace {

// [a's quarters i0, i1 | b's quarters i2, i3] for Pattern = i0 | i1 << 2 | i2 << 4 | i3 << 6.
template <int Pattern>
__m512 quarters(__m512 a, __m512 b) { return _mm512_maskz_shuffle_f32x4(kAllLanes, a, b, Pattern); }

// In each 128-bit quarter: [a[i0], a[i1], b[i2], b[i3]] for Pattern = _MM_SHUFFLE(i3, i2, i1, i0).
template <int Pattern>
__m512 within_quarters(__m512 a, __m512 b) { return _mm512_maskz_shuffle_ps(kAllLanes, a, b, Pattern); }

// The sums of 16 vectors' lanes at once, each through the tree of sum_lanes (lane l plus lane l + 8,
// then + 4, + 2, + 1), so sums[i] equals sum_lanes(lanes[i]) bit for bit.
__m512 sum_lanes_of_16(const __m512 (&lanes)[16]) {
  // Step 1: eights[i] = [x.lo8 + x.hi8 | y.lo8 + y.hi8] for x, y = lanes[2i], lanes[2i + 1].
  __m512 eights[8];
  for (int i = 0; i < 8; ++i)
    eights[i] = _mm512_add_ps(quarters<0x44>(lanes[2 * i], lanes[2 * i + 1]),
                              quarters<0xee>(lanes[2 * i], lanes[2 * i + 1]));
  // Step 2: quarter q of fours[i] holds lanes[4i + q]'s sums of lanes l and l + 4.
  __m512 fours[4];
  for (int i = 0; i < 4; ++i)
    fours[i] = _mm512_add_ps(quarters<0x88>(eights[2 * i], eights[2 * i + 1]),
                             quarters<0xdd>(eights[2 * i], eights[2 * i + 1]));
  // Step 3: quarter q of twos[i] holds lanes[8i + q] then lanes[8i + 4 + q], two sums (l, l + 2) each.
  __m512 twos[2];
  for (int i = 0; i < 2; ++i)
    twos[i] = _mm512_add_ps(within_quarters<_MM_SHUFFLE(1, 0, 1, 0)>(fours[2 * i], fours[2 * i + 1]),
                            within_quarters<_MM_SHUFFLE(3, 2, 3, 2)>(fours[2 * i], fours[2 * i + 1]));
  // Step 4: lane 4q + p holds the whole sum of lanes[q + 4p]; a permutation puts it at lane q + 4p.
  const __m512 ones = _mm512_add_ps(within_quarters<_MM_SHUFFLE(2, 0, 2, 0)>(twos[0], twos[1]),
                                    within_quarters<_MM_SHUFFLE(3, 1, 3, 1)>(twos[0], twos[1]));
  const __m512i natural_order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_maskz_permutexvar_ps(kAllLanes, natural_order, ones);
}

void group_scores(const float* q, int64_t heads, const float* keys, int64_t key_stride, int64_t count,
                  int64_t head_dim, float scale, float* scores, int64_t score_stride) {
  const int64_t full_end = head_dim / 16 * 16;
  const __mmask16 tail = lane_mask(head_dim - full_end);
  // Masked-off lanes add +0 · +0 = +0, which leaves any lane unchanged (a lane that starts at +0
  // never becomes -0), matching the portable loop that skips them.
  auto lanes_of = [&](const float* query, const float* key) {
    __m512 lanes = _mm512_setzero_ps();
    for (int64_t d = 0; d < full_end; d += 16)
      lanes = _mm512_add_ps(lanes, _mm512_mul_ps(_mm512_loadu_ps(query + d), _mm512_loadu_ps(key + d)));
    if (tail)
      lanes = _mm512_add_ps(lanes, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, query + full_end),
                                                 _mm512_maskz_loadu_ps(tail, key + full_end)));
    return lanes;
  };
  const __m512 scales = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < heads; ++g) {
    const float* query = q + g * head_dim;
    float* head_scores = scores + g * score_stride;
    int64_t j = 0;
    // 16 keys at a time, so one transposing tree sums all their lanes.
    for (; j + 16 <= count; j += 16) {
      __m512 lanes[16];
      for (int i = 0; i < 16; ++i) lanes[i] = lanes_of(query, keys + (j + i) * key_stride);
      _mm512_storeu_ps(head_scores + j, _mm512_mul_ps(scales, sum_lanes_of_16(lanes)));
    }
    for (; j < count; ++j) head_scores[j] = scale * sum_lanes(lanes_of(query, keys + j * key_stride));
  }
}

// Up to 4 heads × 64 dims per pass: 16 accumulators and 4 value vectors stay in the 32 registers.
constexpr int kHeadsPerPass = 4;

}  // namespace

const AttentionKernels& attention_kernels_avx512() {
  static const AttentionKernels kernels{&group_scores, &simd_group_weighted_sums<Avx512Lanes, kHeadsPerPass>};
  return kernels;
}

}  // namespace kiln::cpu
