// The inner loops of attention for one token and the query heads sharing one kv head (internal).
//
// Every instruction set computes the same bits: a score is scale · (q · k) with the dot product of
// reductions.h (16 lanes over d mod 16, the tree 16 → 8 → 4 → 2 → 1, a separate multiply and add
// — no fused multiply-add), and a weighted sum adds w_j · v_j[d] over keys j in order, again with a
// separate multiply and add. So attention results do not depend on the instruction set; SIMD only
// makes them faster, and heads sharing a kv head read each key and value row once.
#pragma once

#include <cstdint>

namespace kiln::cpu {

// A call covers the keys of one cache block (attention.cpp walks a sequence's blocks in order): the
// scores and weights of a head are rows of `stride` floats, of which the call reads or writes the
// `count` from where the pointer starts.
struct AttentionKernels {
  // scores[g · score_stride + j] = scale · (q_g · k_j) for g < heads, j < count, where
  // q_g = q + g · head_dim and k_j = keys + j · key_stride.
  void (*group_scores)(const float* q, int64_t heads, const float* keys, int64_t key_stride, int64_t count,
                       int64_t head_dim, float scale, float* scores, int64_t score_stride) = nullptr;
  // sums[g · head_dim + d] += weights[g · weight_stride + j] · values[j · value_stride + d], for
  // j = 0, 1, ..., count - 1 in that order, every g < heads and d < head_dim.
  void (*group_weighted_sums)(const float* weights, int64_t weight_stride, int64_t heads, const float* values,
                              int64_t value_stride, int64_t count, int64_t head_dim, float* sums) = nullptr;
};

const AttentionKernels& attention_kernels_scalar();
const AttentionKernels& attention_kernels_avx2();    // only after cpu_supports(CpuIsa::Avx2)
const AttentionKernels& attention_kernels_avx512();  // only after cpu_supports(CpuIsa::Avx512)

}  // namespace kiln::cpu
