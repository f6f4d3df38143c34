// The op contract (backend/op_contract.h) on its own: the rules every backend shares, checked here
// for a backend with BF16 activations too (named "CUDA" but placed in host memory, so that CUDA's
// side of each shape and dtype rule runs without a GPU; placement has its own test below).
#include <vector>

#include <gtest/gtest.h>

#include "backend/op_contract.h"
#include "test_support.h"

namespace kiln::testing {
namespace {

const OpContext kBf16Backend{"CUDA", DType::BF16, Device::CPU};
const OpContext kF32Backend{"cpu", DType::F32, Device::CPU};

Tensor of(const Shape& shape, DType dtype) { return Tensor::zeros(shape, dtype); }

TEST(OpContract, MatmulTakesActivationsAndWritesTheStreamOrActivations) {
  const Tensor x = of({3, 64}, DType::BF16), w = of({8, 64}, DType::BF16);
  const MatmulDims dims = check_matmul(kBf16Backend, x, w, nullptr, of({3, 8}, DType::F32));
  EXPECT_EQ(dims.rows, 3);
  EXPECT_EQ(dims.n, 8);
  EXPECT_EQ(dims.k, 64);
  check_matmul(kBf16Backend, x, w, nullptr, of({3, 8}, DType::BF16));
  expect_error_mentions(
      [&] {
        check_matmul(kBf16Backend, of({3, 64}, DType::F32), w, nullptr, of({3, 8}, DType::F32));
      },
      {"CUDA matmul: x has dtype F32, expected the activation dtype BF16"});
  expect_error_mentions(
      [&] {
        check_matmul(kBf16Backend, x, w, nullptr, of({3, 8}, DType::F16));
      },
      {"CUDA matmul: out has dtype F16, expected F32 or the activation dtype BF16"});
  expect_error_mentions(
      [&] {
        check_matmul(kF32Backend, of({2, 8}, DType::F32), of({3, 8}, DType::I32), nullptr, of({2, 3}, DType::F32));
      },
      {"cpu matmul: weight has dtype I32, expected F32, BF16 or F16"});
  const Tensor bias = of({1, 8}, DType::BF16);
  expect_error_mentions(
      [&] {
        check_matmul(kBf16Backend, x, w, &bias, of({3, 8}, DType::BF16));
      },
      {"CUDA matmul: bias has shape [1, 8], expected [8]"});
}

// Every tensor an op names must be on the backend's device, whichever argument it is.
TEST(OpContract, EveryTensorMustBeOnTheBackendsDevice) {
  const OpContext cuda{"CUDA", DType::BF16, Device::CUDA};
  expect_error_mentions(
      [&] {
        check_add(cuda, of({4}, DType::BF16), of({4}, DType::BF16));
      },
      {"CUDA add: a is in host memory, but this backend's kernels read CUDA device memory"});
  // A tensor tagged as a CUDA one (never dereferenced: the check fails before any kernel runs).
  const Tensor host = of({8}, DType::F32);
  const Tensor on_cuda = Tensor::borrow(host.raw(), {8}, DType::F32, nullptr, Device::CUDA);
  expect_error_mentions(
      [&] {
        check_add(kF32Backend, host, on_cuda);
      },
      {"cpu add: b is in CUDA device memory, but this backend's kernels read host memory"});
  const Tensor w = of({8, 4}, DType::F32), out = of({1, 8}, DType::F32);
  expect_error_mentions(
      [&] {
        check_matmul(kF32Backend, of({1, 4}, DType::F32), w, &on_cuda, out);
      },
      {"cpu matmul: bias is in CUDA device memory"});
}

// Where the backends disagreed, the stricter rule holds on both: rows are the last axis.
TEST(OpContract, NormsNeedTheWidthAsTheLastAxis) {
  const Tensor weight = of({32}, DType::BF16);
  expect_error_mentions(
      [&] {
        check_rms_norm(kBf16Backend, of({3, 2, 16}, DType::F32), weight, of({3, 2, 16}, DType::BF16));
      },
      {"CUDA rms_norm: x has shape [3, 2, 16], expected its last axis to be D = 32"});
  const NormDims dims = check_rms_norm(kBf16Backend, of({3, 2, 32}, DType::F32), weight, of({6, 32}, DType::BF16));
  EXPECT_EQ(dims.rows, 6);
  EXPECT_EQ(dims.width, 32);
  const Tensor residual = of({4, 32}, DType::F32);
  expect_error_mentions(
      [&] {
        check_add_rms_norm(kBf16Backend, residual, of({4, 32}, DType::BF16), weight, of({4, 32}, DType::BF16));
      },
      {"CUDA add_rms_norm: delta has dtype BF16, expected F32"});
}

TEST(OpContract, CachesAndLayoutsNameTheSpanThatDoesNotFit) {
  BatchLayout layout;
  layout.spans = {{0, 0, 2, 0}, {1, 2, 2, 7}};
  layout.total_tokens = 4;
  layout.positions = of({4}, DType::I32);
  const Tensor cache = of({2, 8, 1, 16}, DType::BF16);
  const Tensor k = of({4, 1, 16}, DType::BF16);
  expect_error_mentions([&] { check_kv_write(kBf16Backend, k, k, layout, cache, cache); },
                        {"CUDA kv_write: span 1 reaches position 8, but the cache holds 8 positions per slot"});
  layout.spans[1] = {2, 2, 2, 0};
  expect_error_mentions([&] { check_kv_write(kBf16Backend, k, k, layout, cache, cache); },
                        {"CUDA kv_write: span 1 is in slot 2, but the cache has 2 slots"});
  layout.spans[1] = {1, 2, 2, 0};
  const Tensor f32_cache = of({2, 8, 1, 16}, DType::F32);
  expect_error_mentions([&] { check_kv_write(kBf16Backend, k, k, layout, f32_cache, f32_cache); },
                        {"CUDA kv_write: k_cache has dtype F32, expected the activation dtype BF16"});
  const AttentionDims dims =
      check_attention(kBf16Backend, of({4, 3, 16}, DType::BF16), cache, cache, layout, of({4, 3, 16}, DType::BF16));
  EXPECT_EQ(dims.heads, 3);
  EXPECT_EQ(dims.cache.capacity, 8);
  const Tensor two_kv_heads = of({2, 8, 2, 16}, DType::BF16);
  expect_error_mentions(
      [&] {
        check_attention(kBf16Backend, of({4, 3, 16}, DType::BF16), two_kv_heads, two_kv_heads, layout,
                        of({4, 3, 16}, DType::BF16));
      },
      {"CUDA attention: 3 query heads are not a multiple of 2 kv heads"});
}

TEST(OpContract, RecurrentOpsCheckTheirSpansAndStates) {
  const std::vector<SequenceSpan> shared_slot = {{0, 0, 1, 0}, {0, 1, 1, 0}};
  expect_error_mentions(
      [&] {
        check_causal_conv1d_silu(kBf16Backend, of({2, 8}, DType::BF16), of({8, 4}, DType::BF16), shared_slot,
                                 of({1, 3, 8}, DType::F32), of({2, 8}, DType::BF16));
      },
      {"CUDA causal_conv1d_silu: two spans of one batch use slot 0"});
  const std::vector<SequenceSpan> one_span = {{0, 0, 2, 0}};
  const Tensor x = of({2, 8}, DType::F32);
  expect_error_mentions(
      [&] {
        check_causal_conv1d_silu(kF32Backend, x, of({8, 4}, DType::F32), one_span, of({1, 3, 8}, DType::F32), x);
      },
      {"cpu causal_conv1d_silu: out must not alias x"});
  const Tensor q = of({2, 2, 32}, DType::F32), v = of({2, 3, 32}, DType::F32), gates = of({2, 3}, DType::F32);
  expect_error_mentions(
      [&] {
        check_gated_delta_rule(kBf16Backend, "gated_delta_rule", q, q, v, gates, gates, one_span,
                               of({1, 3, 32, 32}, DType::F32), of({2, 3, 32}, DType::BF16));
      },
      {"CUDA gated_delta_rule: 3 value heads are not a multiple of 2 key heads"});
}

TEST(OpContract, SamplingRowsMustAgree) {
  const SamplingDims dims = check_sample_tokens(kBf16Backend, of({2, 10}, DType::F32), of({2, 6}, DType::I32),
                                                of({2}, DType::I32), of({2}, DType::F32));
  EXPECT_EQ(dims.rows, 2);
  EXPECT_EQ(dims.vocab, 10);
  expect_error_mentions(
      [&] {
        check_sample_tokens(kBf16Backend, of({2, 10}, DType::F32), of({2, 6}, DType::I32), of({3}, DType::I32),
                            of({2}, DType::F32));
      },
      {"CUDA sample_tokens: settings [2, 6], tokens [3] and logprobs [2] do not fit 2 rows"});
  expect_error_mentions(
      [&] { check_feed_tokens(kBf16Backend, of({3}, DType::I32), of({3}, DType::I32), of({2}, DType::I32)); },
      {"CUDA feed_tokens: feed [3] and token_ids [2] must have one entry per row"});
}

}  // namespace
}  // namespace kiln::testing
