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
  layout.spans = {{0, 0, 2, 0}, {1, 2, 2, 63}};
  layout.total_tokens = 4;
  layout.positions = of({4}, DType::I32);
  Tensor keys = of({5, 64, 1, 16}, DType::BF16), values = of({5, 64, 1, 16}, DType::BF16);
  const Tensor table = of({2, 1}, DType::I32);
  const KvCacheView cache{keys, values, table};
  const Tensor k = of({4, 1, 16}, DType::BF16);
  expect_error_mentions([&] { check_kv_write(kBf16Backend, k, k, layout, cache); },
                        {"CUDA kv_write: span 1 reaches position 64, but the block table holds 64 positions per slot "
                         "(1 blocks of 64)"});
  layout.spans[1] = {2, 2, 2, 0};
  expect_error_mentions([&] { check_kv_write(kBf16Backend, k, k, layout, cache); },
                        {"CUDA kv_write: span 1 is in slot 2, but the block table has 2 slots"});
  layout.spans[1] = {1, 2, 2, 0};
  Tensor f32_keys = of({5, 64, 1, 16}, DType::F32), f32_values = of({5, 64, 1, 16}, DType::F32);
  expect_error_mentions([&] { check_kv_write(kBf16Backend, k, k, layout, {f32_keys, f32_values, table}); },
                        {"CUDA kv_write: k_cache has dtype F32, expected the activation dtype BF16"});
  const AttentionDims dims = check_attention(kBf16Backend, of({4, 3, 16}, DType::BF16), cache, layout,
                                             of({4, 3, 16}, DType::BF16));
  EXPECT_EQ(dims.heads, 3);
  EXPECT_EQ(dims.cache.blocks, 5);
  EXPECT_EQ(dims.cache.slots, 2);
  EXPECT_EQ(dims.cache.table_width, 1);
  EXPECT_EQ(dims.cache.capacity, 64);
  Tensor two_kv_heads = of({5, 64, 2, 16}, DType::BF16);
  expect_error_mentions(
      [&] {
        check_attention(kBf16Backend, of({4, 3, 16}, DType::BF16), {two_kv_heads, two_kv_heads, table}, layout,
                        of({4, 3, 16}, DType::BF16));
      },
      {"CUDA attention: 3 query heads are not a multiple of 2 kv heads"});
}

// The pools are blocks of kKvBlockTokens positions; the block table is I32 [slots, table_width];
// a host table's entries are blocks of the pool.
TEST(OpContract, ThePagedCacheTakesBlocksOf64AndAnI32BlockTable) {
  BatchLayout layout;
  layout.spans = {{0, 0, 1, 0}};
  layout.total_tokens = 1;
  const Tensor k = of({1, 1, 16}, DType::BF16);
  Tensor keys = of({4, 64, 1, 16}, DType::BF16), values = of({4, 64, 1, 16}, DType::BF16);
  Tensor short_blocks = of({4, 32, 1, 16}, DType::BF16);
  expect_error_mentions(
      [&] { check_kv_write(kBf16Backend, k, k, layout, {short_blocks, short_blocks, of({1, 2}, DType::I32)}); },
      {"CUDA kv_write: k_cache has shape [4, 32, 1, 16], expected [blocks, 64, kv_heads, head_dim]"});
  expect_error_mentions(
      [&] { check_kv_write(kBf16Backend, k, k, layout, {keys, short_blocks, of({1, 2}, DType::I32)}); },
      {"CUDA kv_write: v_cache has shape [4, 32, 1, 16], expected [4, 64, 1, 16]"});
  expect_error_mentions([&] { check_kv_write(kBf16Backend, k, k, layout, {keys, values, of({1, 2}, DType::F32)}); },
                        {"CUDA kv_write: block_table has dtype F32, expected I32"});
  expect_error_mentions([&] { check_kv_write(kBf16Backend, k, k, layout, {keys, values, of({2}, DType::I32)}); },
                        {"CUDA kv_write: block_table has shape [2], expected [slots, table_width]"});
  Tensor undefined;
  expect_error_mentions([&] { check_kv_write(kBf16Backend, k, k, layout, {keys, values, undefined}); },
                        {"CUDA kv_write: block_table is an undefined tensor"});

  const Tensor table = of({2, 3}, DType::I32);
  const CacheDims dims = check_caches(kBf16Backend, "attention", {keys, values, table});
  table.data<int32_t>()[3 + 2] = 4;
  check_block_ids(kBf16Backend, "attention", table, 1, 0, 127, dims);  // entries 0 and 1 only
  expect_error_mentions([&] { check_block_ids(kBf16Backend, "attention", table, 1, 0, 150, dims); },
                        {"CUDA attention: slot 1 position 128 is in block 4 (block_table entry 2), but the pool has 4 "
                         "blocks"});
  table.data<int32_t>()[0] = -3;
  expect_error_mentions([&] { check_block_ids(kBf16Backend, "kv_write", table, 0, 5, 5, dims); },
                        {"CUDA kv_write: slot 0 position 5 is in block -3 (block_table entry 0)"});
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

// A mixture's ops: the routing's k within the experts and a weights column per term; the expert
// products' stacked weights a whole number of experts of out's width, with a row of x per token or
// per pair; the combine's routed rows a multiple of the tokens.
TEST(OpContract, MixtureOpsAgreeOnTokensExpertsAndTerms) {
  const RouteDims route = check_moe_route(kBf16Backend, of({3, 8}, DType::F32), nullptr, of({3, 2}, DType::I32),
                                          of({3, 2}, DType::F32));
  EXPECT_EQ(route.experts, 8);
  EXPECT_EQ(route.terms, 2);
  const Tensor shared_logits = of({3, 1}, DType::F32);
  EXPECT_EQ(check_moe_route(kBf16Backend, of({3, 8}, DType::F32), &shared_logits, of({3, 2}, DType::I32),
                            of({3, 3}, DType::F32)).terms, 3);
  expect_error_mentions(
      [&] {
        check_moe_route(kBf16Backend, of({3, 8}, DType::F32), nullptr, of({3, 9}, DType::I32), of({3, 9}, DType::F32));
      },
      {"CUDA moe_route: experts has shape [3, 9], expected [3, k] with 0 < k <= 8 experts"});
  expect_error_mentions(
      [&] {
        check_moe_route(kBf16Backend, of({3, 8}, DType::F32), &shared_logits, of({3, 2}, DType::I32),
                        of({3, 2}, DType::F32));
      },
      {"CUDA moe_route: weights has shape [3, 2], expected [3, 3]"});

  const Tensor x = of({3, 64}, DType::BF16), pair_rows = of({6, 48}, DType::BF16), experts = of({3, 2}, DType::I32);
  const Weight gate = of({4 * 48, 64}, DType::BF16), down = of({4 * 64, 48}, DType::BF16);
  Tensor gate_out = of({6, 48}, DType::BF16), down_out = of({6, 64}, DType::F32);
  const MatmulTarget gate_target{&gate, nullptr, &gate_out}, down_target{&down, nullptr, &down_out};
  const ExpertMatmulDims dims = check_expert_matmul(kBf16Backend, x, experts, {&gate_target, 1}, nullptr);
  EXPECT_EQ(dims.experts[0], 4);
  EXPECT_EQ(dims.n[0], 48);
  EXPECT_EQ(check_expert_matmul(kBf16Backend, pair_rows, experts, {&down_target, 1}, nullptr).x_rows, 6);
  const Weight ragged = of({4 * 48 + 8, 64}, DType::BF16);
  const MatmulTarget ragged_target{&ragged, nullptr, &gate_out};
  expect_error_mentions([&] { check_expert_matmul(kBf16Backend, x, experts, {&ragged_target, 1}, nullptr); },
                        {"CUDA expert_matmul: weight has shape [200, 64], expected experts' [N, K] = [48, 64] "
                         "matrices stacked into [E·48, 64]"});
  expect_error_mentions(
      [&] { check_expert_matmul(kBf16Backend, of({4, 64}, DType::BF16), experts, {&gate_target, 1}, nullptr); },
      {"CUDA expert_matmul: x has shape [4, 64], expected [3 or 6, K]"});
  const Tensor counter = of({1}, DType::I32);
  expect_error_mentions([&] { check_expert_matmul(kBf16Backend, x, experts, {&gate_target, 1}, &counter); },
                        {"CUDA expert_matmul: experts_read has dtype I32, expected U32"});

  const Tensor shared = of({3, 64}, DType::F32);
  EXPECT_EQ(check_moe_combine(kBf16Backend, down_out, &shared, of({3, 3}, DType::F32), of({3, 64}, DType::F32)).top_k,
            2);
  expect_error_mentions(
      [&] { check_moe_combine(kBf16Backend, down_out, nullptr, of({3, 3}, DType::F32), of({3, 64}, DType::F32)); },
      {"CUDA moe_combine: routed has shape [6, 64], expected [9, H]"});
}

}  // namespace
}  // namespace kiln::testing
