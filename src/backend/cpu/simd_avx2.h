// AVX2 helpers shared by the *_avx2.cpp kernels (internal; include only from those files, so every
// function here is compiled for AVX2 and stays local to its file).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace kiln::cpu {
namespace {

// A maskload/maskstore mask selecting lanes [0, valid) of 8.
inline __m256i lane_mask(int64_t valid) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid < 8 ? valid : 8)), lane);
}

// The fixed lane tree 8 → 4 → 2 → 1, each step adding lane i and lane i + width (the last three
// steps of the tree in reductions.h).
inline float sum_lanes(__m256 v) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

// The 8-lane operations in which the kernel templates shared by both instruction sets
// (matmul_tiles.h, attention_weighted_sums.h) are written.
struct Avx2Lanes {
  using Floats = __m256;
  using Mask = __m256i;
  static constexpr int kLanes = 8;
  static Floats zero() { return _mm256_setzero_ps(); }
  static Floats broadcast(float value) { return _mm256_set1_ps(value); }
  static Floats load(const float* from) { return _mm256_loadu_ps(from); }
  static Floats masked_load(Mask mask, const float* from) { return _mm256_maskload_ps(from, mask); }
  static void masked_store(float* to, Mask mask, Floats v) { _mm256_maskstore_ps(to, mask, v); }
  static Floats add(Floats a, Floats b) { return _mm256_add_ps(a, b); }
  static Floats mul(Floats a, Floats b) { return _mm256_mul_ps(a, b); }
  static Floats fmadd(Floats a, Floats b, Floats c) { return _mm256_fmadd_ps(a, b, c); }
  static Mask lanes_below(int64_t valid) { return lane_mask(valid); }
  static float sum(Floats v) { return sum_lanes(v); }
};

}  // namespace
}  // namespace kiln::cpu
