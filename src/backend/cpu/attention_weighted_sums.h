// AttentionKernels::group_weighted_sums written once for the SIMD instruction sets (internal;
// included only by attention_avx2.cpp and attention_avx512.cpp, whose instantiations stay local to
// their file). Lanes is an instruction set's vector operations (simd_avx2.h, simd_avx512.h).
#pragma once

#include <array>
#include <cstdint>
#include <utility>

namespace kiln::cpu {
namespace {

// A pass covers Heads heads × 4 vectors of dims: 4 · Heads accumulators and 4 value vectors stay in
// registers while the pass walks every key.
constexpr int kVectorsPerPass = 4;

template <class Lanes, int Heads>
void weighted_sums_pass(const float* weights, int64_t weight_stride, int64_t count, const float* values,
                        int64_t value_stride, int64_t head_dim, int64_t d0, float* sums) {
  using Floats = typename Lanes::Floats;
  constexpr int kLanes = Lanes::kLanes;
  typename Lanes::Mask masks[kVectorsPerPass];
  for (int i = 0; i < kVectorsPerPass; ++i) masks[i] = Lanes::lanes_below(head_dim - d0 - kLanes * i);
  Floats acc[Heads][kVectorsPerPass];
  for (int g = 0; g < Heads; ++g)
    for (int i = 0; i < kVectorsPerPass; ++i)
      acc[g][i] = Lanes::masked_load(masks[i], sums + g * head_dim + d0 + kLanes * i);
  for (int64_t j = 0; j < count; ++j) {
    const float* row = values + j * value_stride + d0;
    Floats value[kVectorsPerPass];
    for (int i = 0; i < kVectorsPerPass; ++i) value[i] = Lanes::masked_load(masks[i], row + kLanes * i);
    for (int g = 0; g < Heads; ++g) {
      const Floats weight = Lanes::broadcast(weights[g * weight_stride + j]);
      for (int i = 0; i < kVectorsPerPass; ++i) acc[g][i] = Lanes::add(acc[g][i], Lanes::mul(weight, value[i]));
    }
  }
  for (int g = 0; g < Heads; ++g)
    for (int i = 0; i < kVectorsPerPass; ++i)
      Lanes::masked_store(sums + g * head_dim + d0 + kLanes * i, masks[i], acc[g][i]);
}

using WeightedSumsPass = void (*)(const float* weights, int64_t weight_stride, int64_t count, const float* values,
                                  int64_t value_stride, int64_t head_dim, int64_t d0, float* sums);

// weighted_sums_pass<Lanes, h> at index h - 1, for h = 1 .. sizeof...(Index).
template <class Lanes, int... Index>
constexpr std::array<WeightedSumsPass, sizeof...(Index)> weighted_sums_passes(std::integer_sequence<int, Index...>) {
  return {&weighted_sums_pass<Lanes, Index + 1>...};
}

// Up to MaxHeadsPerPass heads per pass, as many as the registers hold.
template <class Lanes, int MaxHeadsPerPass>
void simd_group_weighted_sums(const float* weights, int64_t weight_stride, int64_t heads, const float* values,
                              int64_t value_stride, int64_t count, int64_t head_dim, float* sums) {
  static constexpr auto passes = weighted_sums_passes<Lanes>(std::make_integer_sequence<int, MaxHeadsPerPass>{});
  constexpr int64_t kDimsPerPass = int64_t{kVectorsPerPass} * Lanes::kLanes;
  for (int64_t g = 0; g < heads; g += MaxHeadsPerPass) {
    const int64_t pass_heads = heads - g < MaxHeadsPerPass ? heads - g : MaxHeadsPerPass;
    const float* pass_weights = weights + g * weight_stride;
    float* pass_sums = sums + g * head_dim;
    for (int64_t d0 = 0; d0 < head_dim; d0 += kDimsPerPass)
      passes[pass_heads - 1](pass_weights, weight_stride, count, values, value_stride, head_dim, d0, pass_sums);
  }
}

}  // namespace
}  // namespace kiln::cpu
