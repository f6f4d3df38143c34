// The matmul kernels of each instruction set, behind one table (internal to backend/cpu).
//
// Reduction order (the invariance contract): x is repacked into blocks of `block_k` floats, each
// split into two halves of block_k / 2 lanes. Output element (t, n) keeps one accumulator of
// block_k / 2 lanes; for each block in k order it adds half 0's products, then half 1's (a fused
// multiply-add where the ISA has one), a zero-padded final block covers K % block_k, a fixed tree
// sums the lanes, and the bias is added last. That order depends on K alone: never on how many
// rows or columns a tile computes together, where a thread's range starts, or the thread count.
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace kiln::cpu {

struct MatmulOperands {
  const float* x_packed = nullptr;  // [rows, k_padded] in blocks (see MatmulKernels), zeros past k
  int64_t rows = 0;
  int64_t k = 0;
  int64_t k_padded = 0;             // k rounded up to block_k
  const void* w = nullptr;          // [n, k] in w_dtype
  DType w_dtype = DType::F32;
  const float* bias = nullptr;      // [n] or null
  float* out = nullptr;             // [rows, n]
  int64_t n = 0;
};

struct MatmulKernels {
  int64_t block_k = 0;
  // Columns a tile computes together; thread ranges start at multiples of it (for speed only).
  int64_t column_grain = 0;
  // For BF16 weights, whether each packed x block holds its even-k elements (half 0) then its
  // odd-k elements (half 1): the order in which widening 32-bit pairs of bf16 yields the weights.
  // Otherwise a block is x[k0, k0 + block_k) unchanged.
  bool bf16_pairs_split = false;
  // Computes out[:, n_begin:n_end]. Columns are independent, so any split over n is exact.
  void (*columns)(const MatmulOperands& operands, int64_t n_begin, int64_t n_end) = nullptr;
};

const MatmulKernels& matmul_kernels_scalar();
const MatmulKernels& matmul_kernels_avx2();    // only after cpu_supports(CpuIsa::Avx2)
const MatmulKernels& matmul_kernels_avx512();  // only after cpu_supports(CpuIsa::Avx512)

}  // namespace kiln::cpu
