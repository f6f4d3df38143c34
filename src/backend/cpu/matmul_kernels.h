// The matmul kernels of each instruction set, behind one table (internal to backend/cpu).
//
// Reduction order (the invariance contract): x is repacked into blocks of `block_k` floats, each
// split into two halves of block_k / 2 lanes. Output element (t, n) keeps one accumulator of
// block_k / 2 lanes; for each block in k order it adds half 0's products, then half 1's (a fused
// multiply-add where the ISA has one), a zero-padded final block covers K % block_k, a fixed tree
// sums the lanes, and the bias is added last. That order depends on K alone: never on how many
// rows or columns a tile computes together, where a thread's range starts, or the thread count.
//
// A quantized weight (core/weight.h) is multiplied in exactly that order on its decoded f32 values:
// the kernels decode each half of a block in registers to the f32 values decode_rows gives
// (affine: fma(scale, q, bias); fp8: the e4m3 value times scale_inv) and use them as an f32
// weight, so the product is bit-identical to the f32 kernel on decode_rows' output.
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "core/weight.h"

namespace kiln::cpu {

struct MatmulOperands {
  const float* x_packed = nullptr;  // [rows, k_padded] in blocks (see MatmulKernels), zeros past k
  int64_t rows = 0;
  int64_t k = 0;
  int64_t k_padded = 0;             // k rounded up to block_k
  const void* w = nullptr;          // [n, k] in w_dtype (unused when quantized is set)
  DType w_dtype = DType::F32;
  const float* bias = nullptr;      // [n] or null
  float* out = nullptr;             // [rows, n]
  int64_t n = 0;
  const Weight* quantized = nullptr;  // a weight has_quantized_kernel accepts, or null
};

struct MatmulKernels {
  int64_t block_k = 0;
  // Columns a tile computes together; thread ranges start at multiples of it (for speed only).
  int64_t column_grain = 0;
  // For BF16 weights, whether each packed x block holds its even-k elements (half 0) then its
  // odd-k elements (half 1): the order in which widening 32-bit pairs of bf16 yields the weights.
  // Otherwise a block is x[k0, k0 + block_k) unchanged.
  bool bf16_pairs_split = false;
  // For affine 4-bit weights, whether each half of a packed x block holds its elements in the
  // order 0, 8, 1, 9, …, 7, 15 (the order in which one 64-bit word of codes, broadcast to every
  // lane pair, yields its codes). Each lane then accumulates the products of one natural lane, in
  // the same order, and the kernel moves the lanes back to their natural places before the lane
  // tree: the result is the natural order's, bit for bit. Otherwise as for any weight.
  bool nibbles_interleaved = false;
  // Computes out[:, n_begin:n_end]. Columns are independent, so any split over n is exact.
  void (*columns)(const MatmulOperands& operands, int64_t n_begin, int64_t n_end) = nullptr;
};

// Whether the kernels multiply this quantized weight directly: affine 4 and 8 bits, and fp8 blocks
// whose columns are a multiple of 32 (the largest block_k, so a block never straddles two scales).
// Other quantized weights are decoded to f32 rows first (matmul.cpp), with the same result.
bool has_quantized_kernel(const Weight& weight);

// e4m3 byte → its f32 value (fp8_e4m3_to_f32 of every byte), for the SIMD kernels' gathers.
const float* fp8_e4m3_table();

const MatmulKernels& matmul_kernels_scalar();
const MatmulKernels& matmul_kernels_avx2();    // only after cpu_supports(CpuIsa::Avx2)
const MatmulKernels& matmul_kernels_avx512();  // only after cpu_supports(CpuIsa::Avx512)

}  // namespace kiln::cpu
