// The routing of a mixture of experts (model/moe.h's formula; transformers' Qwen3MoeSparseMoeBlock
// and its kin, ../shared/specs/architectures.md A.7), as every backend's moe_route computes it:
//
//   p = softmax(ℓ) in f32: exp(ℓ_e − max ℓ), summed in ascending expert id, each divided by the sum
//   top = the k largest p, the lower expert id first among equal p (torch.topk leaves ties to its
//         kernel: kiln fixes one rule on every backend)
//   w = p_top / Σ p_top (summed in rank order, as torch sums the top-k values) when normalize,
//       else p_top; the experts are then listed ascending by id with their weights
//   a shared expert's gate: σ(g) = 1 / (1 + exp(−g))
//
// These functions are compiled for the host and for the CUDA device. Each arithmetic step is one
// IEEE f32 operation (nvcc's device code would otherwise fuse a·b + c, and the host build has
// -ffp-contract=off), and e^x is computed here from those operations rather than by a math
// library (glibc's expf and CUDA's differ in their last bits), so the host's route_token (the CPU
// backend's moe_route) and the CUDA kernel give the same bits for logits without NaN. The CUDA
// kernel runs the exponentials and the top-k search over a warp; the sums stay sequential.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__CUDACC__)
#define KILN_ROUTING_FUNCTION __host__ __device__ __forceinline__
#else
#define KILN_ROUTING_FUNCTION inline
#endif

namespace kiln {
namespace routing {

// One rounded f32 operation each, never fused with a neighbour.
KILN_ROUTING_FUNCTION float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
KILN_ROUTING_FUNCTION float subtract(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
KILN_ROUTING_FUNCTION float multiply(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
KILN_ROUTING_FUNCTION float divide(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

KILN_ROUTING_FUNCTION float float_from_bits(uint32_t bits) {
  float value;
  memcpy(&value, &bits, sizeof value);
  return value;
}

// 2^n for −126 ≤ n ≤ 127, exactly.
KILN_ROUTING_FUNCTION float power_of_two(int n) { return float_from_bits(static_cast<uint32_t>(n + 127) << 23); }

// e^x in f32, within about 1 ulp: x = n·ln 2 + r with n the nearest integer to x·log₂e and
// |r| ≤ ~0.347 (Cody and Waite's two-part ln 2: n·ln2_hi is exact for |n| < 2⁸), e^r by its
// Taylor polynomial of degree 7 (truncation below 10⁻⁸ relative on that interval) in Horner's
// form, and 2ⁿ applied in two exact halves so that only the last multiplication rounds (into the
// subnormals, or to infinity).
KILN_ROUTING_FUNCTION float exponential(float x) {
  if (x != x) return x;
  if (x < -104.0f) return 0.0f;                     // e^x below half the least subnormal
  if (x > 89.0f) return float_from_bits(0x7f800000u);  // beyond the largest float
  // Adding and removing 1.5 · 2²³ rounds to the nearest integer (ties to even) in f32.
  constexpr float kRound = 12582912.0f;
  const float n = subtract(add(multiply(x, 1.44269504f), kRound), kRound);
  constexpr float kLn2High = 0.693145751953125f;  // 0x3f317200: 16 significant bits
  constexpr float kLn2Low = 1.42860677e-06f;      // ln 2 − kLn2High, rounded
  const float r = subtract(subtract(x, multiply(n, kLn2High)), multiply(n, kLn2Low));
  constexpr float kCoefficients[] = {1.0f / 5040.0f, 1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f,
                                     1.0f / 6.0f,    0.5f,          1.0f,          1.0f};  // 1/7!, …, 1/0!
  float p = kCoefficients[0];
  for (int i = 1; i < 8; ++i) p = add(multiply(p, r), kCoefficients[i]);
  const int exponent = static_cast<int>(n);
  const int half = exponent / 2;
  return multiply(multiply(p, power_of_two(half)), power_of_two(exponent - half));
}

KILN_ROUTING_FUNCTION float sigmoid(float x) { return divide(1.0f, add(1.0f, exponential(-x))); }

// Whether expert a (probability pa) ranks before expert b: the larger probability, then the lower id.
KILN_ROUTING_FUNCTION bool ranks_before(float pa, int32_t a, float pb, int32_t b) { return pa != pb ? pa > pb : a < b; }

// e^(ℓ − largest), a softmax numerator.
KILN_ROUTING_FUNCTION float shifted_exp(float logit, float largest) { return exponential(subtract(logit, largest)); }

// Σ values[0 … count − 1] from 0 in ascending order.
KILN_ROUTING_FUNCTION float sequential_sum(const float* values, int64_t count) {
  float total = 0.0f;
  for (int64_t i = 0; i < count; ++i) total = add(total, values[i]);
  return total;
}

// From the top k in rank order (`ids` with their probabilities, both rearranged here): the experts
// ascending by id and their weights, renormalised by the rank-order sum when `normalize`.
KILN_ROUTING_FUNCTION void finish_route(int32_t* ids, float* probabilities, int64_t k, bool normalize, int32_t* experts,
                                        float* weights) {
  const float selected = sequential_sum(probabilities, k);
  for (int64_t i = 1; i < k; ++i)
    for (int64_t j = i; j > 0 && ids[j - 1] > ids[j]; --j) {
      const int32_t id = ids[j];
      ids[j] = ids[j - 1];
      ids[j - 1] = id;
      const float p = probabilities[j];
      probabilities[j] = probabilities[j - 1];
      probabilities[j - 1] = p;
    }
  for (int64_t j = 0; j < k; ++j) {
    experts[j] = ids[j];
    weights[j] = normalize ? divide(probabilities[j], selected) : probabilities[j];
  }
}

}  // namespace routing

// One token's experts, ascending by id, with their routing weights.
struct TokenRoute {
  std::vector<int32_t> experts;
  std::vector<float> weights;
};
// The routing of one token from its f32 router logits (the formula at the top of this file): the
// CPU backend's moe_route, and the reference the CUDA kernel is held to bit for bit.
TokenRoute route_token(const float* logits, int64_t experts, int64_t top_k, bool normalize);

}  // namespace kiln
