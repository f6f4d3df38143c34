// AVX-512 helpers shared by the *_avx512.cpp kernels (internal; include only from those files, so
// every function here is compiled for AVX-512 and stays local to its file).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace kiln::cpu {
namespace {

// GCC 12 compiles many unmasked intrinsics (_mm512_slli_epi32, _mm512_cvtph_ps, the shuffles and
// permutes) through _mm512_undefined_*, which trips a false -Wuninitialized (GCC bug 105593);
// their zero-masked forms with every lane selected are the same instructions.
constexpr __mmask16 kAllLanes = 0xffff;

// Lanes [0, valid) of 16 (none when valid <= 0, all when valid >= 16).
inline __mmask16 lane_mask(int64_t valid) {
  return valid >= 16 ? kAllLanes : valid <= 0 ? __mmask16(0) : __mmask16((1u << valid) - 1);
}

// The fixed lane tree: 16 → 8 → 4 → 2 → 1, each step adding lane i and lane i + width (the tree
// of reductions.h, so a sum here equals the portable one for the same lanes).
inline float sum_lanes(__m512 v) {
  const __m256 eight = _mm256_add_ps(_mm512_extractf32x8_ps(v, 0), _mm512_extractf32x8_ps(v, 1));
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

// The 16-lane operations in which the kernel templates shared by both instruction sets
// (matmul_tiles.h, attention_weighted_sums.h) are written.
struct Avx512Lanes {
  using Floats = __m512;
  using Mask = __mmask16;
  static constexpr int kLanes = 16;
  static Floats zero() { return _mm512_setzero_ps(); }
  static Floats broadcast(float value) { return _mm512_set1_ps(value); }
  static Floats load(const float* from) { return _mm512_loadu_ps(from); }
  static Floats masked_load(Mask mask, const float* from) { return _mm512_maskz_loadu_ps(mask, from); }
  static void masked_store(float* to, Mask mask, Floats v) { _mm512_mask_storeu_ps(to, mask, v); }
  static Floats add(Floats a, Floats b) { return _mm512_add_ps(a, b); }
  static Floats mul(Floats a, Floats b) { return _mm512_mul_ps(a, b); }
  static Floats fmadd(Floats a, Floats b, Floats c) { return _mm512_fmadd_ps(a, b, c); }
  static Mask lanes_below(int64_t valid) { return lane_mask(valid); }
  static float sum(Floats v) { return sum_lanes(v); }
};

}  // namespace
}  // namespace kiln::cpu
