// Fixed-order f32 reductions for the portable ops (internal; used only by baseline-compiled files).
//
// A dot product keeps 16 lane sums: lane l adds the products of elements i ≡ l (mod 16) in index
// order, then the lanes meet in the tree 16 → 8 → 4 → 2 → 1 (lane l adds lane l + width). The
// order depends on the length alone, so a row gives the same bits in any batch or thread split; a
// compiler that vectorises the lane loop keeps each lane's own sequence of operations.
#pragma once

#include <cstdint>

namespace kiln::cpu {

constexpr int kReductionLanes = 16;

inline float dot_fixed_order(const float* a, const float* b, int64_t count) {
  float lanes[kReductionLanes] = {};
  int64_t i = 0;
  for (; i + kReductionLanes <= count; i += kReductionLanes)
    for (int lane = 0; lane < kReductionLanes; ++lane) lanes[lane] += a[i + lane] * b[i + lane];
  for (int lane = 0; i + lane < count; ++lane) lanes[lane] += a[i + lane] * b[i + lane];
  for (int width = kReductionLanes / 2; width >= 1; width /= 2)
    for (int lane = 0; lane < width; ++lane) lanes[lane] += lanes[lane + width];
  return lanes[0];
}

}  // namespace kiln::cpu
