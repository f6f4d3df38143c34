// The CUDA backend: the op table (tests/op_table/op_table.h) with F32 and BF16 activations against
// the CPU reference, the errors of what the CUDA kernels cannot compute, and the invariance
// contract on the GPU: a row's bits do not depend on the rows computed with it, the batch
// composition or the prefill chunking, and each fused op gives the bits of the ops it replaces.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/kernels.h"
#include "core/error.h"
#include "cuda_test_support.h"
#include "kv_cache_support.h"
#include "op_table/op_table.h"
#include "test_support.h"

namespace kiln::testing {
namespace {

class BackendOps : public ::testing::TestWithParam<DType> {};

TEST_P(BackendOps, MatchTheCpuReference) {
  KILN_REQUIRE_CUDA();
  const DType activations = GetParam();
  run_op_table({activations == DType::F32 ? "cuda_f32" : "cuda_bf16",
                [activations] { return make_cuda_backend(0, activations); }, false});
}

INSTANTIATE_TEST_SUITE_P(Cuda, BackendOps, ::testing::Values(DType::F32, DType::BF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

TEST(CudaBackendOps, Bf16PathRejectsWhatItCannotComputeExactly) {
  KILN_REQUIRE_CUDA();
  std::unique_ptr<Backend> cuda = make_cuda_backend(0, DType::BF16);
  std::mt19937 random(7);
  Tensor x = cuda->upload(f32_as(random_f32({2, 172}, random), DType::BF16));
  Tensor w = cuda->upload(f32_as(random_f32({8, 172}, random), DType::BF16));
  Tensor out = cuda->alloc({2, 8}, DType::BF16);
  EXPECT_THROW(cuda->matmul(x, w, nullptr, out), Error);  // K % 8 != 0
  Tensor x64 = cuda->upload(f32_as(random_f32({2, 64}, random), DType::BF16));
  Tensor w_f32 = cuda->upload(random_f32({8, 64}, random));
  EXPECT_THROW(cuda->matmul(x64, w_f32, nullptr, out), Error);  // f32 weights with bf16 activations
  Tensor x_f32 = cuda->upload(random_f32({2, 64}, random));
  EXPECT_THROW(cuda->matmul(x_f32, w_f32, nullptr, out), Error);  // f32 activations on a bf16 backend
  // Head dims the bf16 attention is not built for: not a multiple of 8, or over 256.
  for (int64_t head_dim : {12, 264}) {
    Tensor q = cuda->alloc({1, 2, head_dim}, DType::BF16), attended = cuda->alloc({1, 2, head_dim}, DType::BF16);
    TestKvCache cache(*cuda, 1, 4, 1, head_dim, false);
    const BatchLayout layout = cuda->make_layout({{0, 0, 1, 0}}, {0});
    expect_error_mentions([&] { cuda->attention(q, cache.view(), layout, 1.0f, attended); },
                          {fmt::format("the BF16 path supports head_dim a multiple of 8 up to 256, got {}", head_dim)});
  }
}

// The fused ops' error paths name the op and what is wrong, before any launch.
TEST(CudaBackendOps, FusedOpsRejectWhatTheyCannotCompute) {
  KILN_REQUIRE_CUDA();
  std::unique_ptr<Backend> cuda = make_cuda_backend(0, DType::BF16);
  Tensor x = cuda->alloc({1, 64}, DType::BF16), w = cuda->alloc({8, 64}, DType::BF16);
  Tensor out = cuda->alloc({1, 8}, DType::BF16);
  const Weight weight = w;
  const std::vector<MatmulTarget> five(5, MatmulTarget{&weight, nullptr, &out});
  expect_error_mentions([&] { cuda->matmul_group(x, five); }, {"CUDA matmul_group: 5 products, it takes 1 to 4"});

  const BatchLayout one = cuda->make_layout({{0, 0, 1, 0}}, {0});
  Tensor q = cuda->alloc({1, 4, 16}, DType::BF16), k = cuda->alloc({1, 3, 16}, DType::BF16);
  Tensor v = cuda->alloc({1, 3, 16}, DType::BF16);
  TestKvCache cache(*cuda, 1, 8, 2, 16, false);
  Tensor inv_freq = cuda->alloc({8}, DType::F32);
  expect_error_mentions([&] { cuda->rope_kv_write(q, k, v, one, inv_freq, 16, nullptr, cache.view()); },
                        {"CUDA rope_kv_write: k has shape [1, 3, 16], expected [1, 2, 16]"});
  Tensor k2 = cuda->alloc({1, 2, 16}, DType::BF16), v2 = cuda->alloc({1, 2, 16}, DType::BF16);
  expect_error_mentions([&] { cuda->rope_kv_write(q, k2, v2, one, inv_freq, 12, nullptr, cache.view()); },
                        {"CUDA rope_kv_write: inv_freq has 8 entries, rotary_dim 12 needs 6"});
  Tensor gain = cuda->alloc({16}, DType::BF16), short_gain = cuda->alloc({12}, DType::BF16);
  const HeadNorms mismatched{gain, short_gain, 1e-6f, NormStyle::Plain};
  expect_error_mentions(
      [&] { cuda->rope_kv_write(q, k2, v2, one, inv_freq, 16, &mismatched, cache.view()); },
      {"CUDA rope_kv_write: k norm weight has shape [12], expected [16]"});
}

// The hybrid ops' error paths: each names the op and what is wrong, before any launch.
TEST(CudaBackendOps, HybridOpsRejectWhatTheyCannotCompute) {
  KILN_REQUIRE_CUDA();
  std::unique_ptr<Backend> cuda = make_cuda_backend(0, DType::F32);
  HybridOps& hybrid = *cuda->hybrid_ops();
  auto f32 = [&](const Shape& shape) { return cuda->alloc(shape, DType::F32); };
  const BatchLayout one = cuda->make_layout({{0, 0, 2, 0}}, {0, 0});

  // Key dims the delta-rule kernel is not built for (not a multiple of 8, over 128), and a
  // value/key head mismatch.
  Tensor v = f32({2, 2, 32}), gates = f32({2, 2}), out = f32({2, 2, 32});
  for (int64_t key_dim : {12, 136}) {
    Tensor q = f32({2, 1, key_dim}), state = f32({1, 2, key_dim, 32});
    expect_error_mentions([&] { hybrid.gated_delta_rule(q, q, v, gates, gates, one, state, out); },
                          {fmt::format("CUDA gated_delta_rule: key_dim {} / value_dim 32 are not built", key_dim)});
  }
  Tensor q2 = f32({2, 2, 32}), v3 = f32({2, 3, 32}), gates3 = f32({2, 3}), out3 = f32({2, 3, 32});
  Tensor state3 = f32({1, 3, 32, 32});
  expect_error_mentions([&] { hybrid.gated_delta_rule(q2, q2, v3, gates3, gates3, one, state3, out3); },
                        {"3 value heads are not a multiple of 2 key heads"});

  // Two spans on one slot of the recurrent state (the shared span check).
  const BatchLayout shared_slot = cuda->make_layout({{0, 0, 1, 0}, {0, 1, 1, 0}}, {0, 0});
  Tensor x = f32({2, 8}), conv_out = f32({2, 8}), conv_state = f32({1, 3, 8}), weight = f32({8, 4});
  expect_error_mentions([&] { hybrid.causal_conv1d_silu(x, weight, shared_slot, conv_state, conv_out); },
                        {"CUDA causal_conv1d_silu: two spans of one batch use slot 0"});
  // A conv kernel size other than the one the kernels are built for.
  Tensor weight5 = f32({8, 5}), conv_state5 = f32({1, 4, 8});
  expect_error_mentions([&] { hybrid.causal_conv1d_silu(x, weight5, one, conv_state5, conv_out); },
                        {"CUDA causal_conv1d_silu: weight must be a float [8, 4] tensor"});
  // q/k/v must be f32 whatever the activations.
  std::unique_ptr<Backend> bf16 = make_cuda_backend(0, DType::BF16);
  Tensor qkv = bf16->alloc({2, 2 * 32 + 32}, DType::BF16);
  Tensor q_bf16 = bf16->alloc({2, 1, 32}, DType::BF16), k32 = bf16->alloc({2, 1, 32}, DType::F32);
  Tensor v32 = bf16->alloc({2, 1, 32}, DType::F32);
  expect_error_mentions([&] { bf16->hybrid_ops()->gated_delta_prepare_qkv(qkv, q_bf16, k32, v32); },
                        {"CUDA gated_delta_prepare_qkv: q has dtype BF16, expected F32"});
}

TEST(CudaBackendOps, OutOfRangeTokenIdIsReportedAtTheNextSynchronisation) {
  KILN_REQUIRE_CUDA();
  std::unique_ptr<Backend> cuda = make_cuda_backend(0, DType::F32);
  std::mt19937 random(9);
  Tensor table = cuda->upload(random_f32({10, 8}, random));
  Tensor ids = cuda->upload(indices({3, 10}));
  Tensor out = cuda->alloc({2, 8}, DType::F32);
  cuda->embedding(table, ids, out);
  EXPECT_THROW(cuda->synchronize(), Error);
  cuda->synchronize();  // the record was cleared with the report
}

// --- invariance on the GPU ---

// Each test runs on a CUDA backend of its own (`cuda`) with the parameter's activation dtype (`act`).
class CudaInvariance : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    KILN_REQUIRE_CUDA();
    cuda = make_cuda_backend(0, act);
  }

  const DType act = GetParam();
  std::unique_ptr<Backend> cuda;
};

// A device tensor holding rows [first, first + count) of a host tensor.
Tensor upload_rows(Backend& backend, const Tensor& host, int64_t first, int64_t count) {
  return backend.upload(host.slice_rows(first, count));
}

TEST_P(CudaInvariance, MatmulRowIsBitIdenticalAloneAndInAnyBatch) {
  std::mt19937 random(11);
  const int64_t rows = 300, k = 520;
  const Tensor x = f32_as(random_f32({rows, k}, random), act);
  // n = 1000 takes 8-column decode warps (and a partial last wgmma block at m = 300); n = 8192
  // takes 16-column decode warps.
  for (int64_t n : {1000, 8192}) {
    const Tensor w = cuda->upload(f32_as(random_f32({n, k}, random, 0.05f), act));
    const Tensor bias = cuda->upload(f32_as(random_f32({n}, random), act));
    auto product = [&](int64_t first, int64_t count) {
      Tensor out = cuda->alloc({count, n}, act);
      cuda->matmul(upload_rows(*cuda, x, first, count), w, &bias, out);
      return cuda->download(out);
    };
    const Tensor all = product(0, rows);
    for (auto [first, count] : std::vector<std::pair<int64_t, int64_t>>{
             {0, 1}, {1, 1}, {150, 1}, {299, 1}, {100, 8}, {0, 16}, {7, 17}, {64, 64}, {200, 100}}) {
      const Tensor part = product(first, count);
      EXPECT_TRUE(same_rows(part, 0, all, first, count))
          << "n=" << n << " rows [" << first << ", " << first + count << ") differ from the same rows in m=" << rows;
    }
  }
}

// A matmul group's products are the separate matmuls' bits, on the decode and the prefill paths.
// The second width set at m = 200 is 140 + 140 + 2 prefill blocks: one shared launch on a
// 132-multiprocessor GPU (3 waves against 4.5 one by one), so that path is held to the same bits.
TEST_P(CudaInvariance, MatmulGroupEqualsOneMatmulPerProductBitForBit) {
  std::mt19937 random(13);
  const int64_t k = 1032;  // two segments, the second partial
  const std::vector<std::vector<int64_t>> width_sets = {{4096, 1024, 1024, 40}, {8960, 8960, 72}};
  for (const std::vector<int64_t>& widths : width_sets) {
    std::vector<Weight> weights;
    for (int64_t n : widths) weights.push_back(cuda->upload(f32_as(random_f32({n, k}, random, 0.03f), act)));
    const Tensor bias = cuda->upload(f32_as(random_f32({widths[1]}, random), act));
    for (int64_t m : {1, 8, 16, 17, 200}) {
      const Tensor x = cuda->upload(f32_as(random_f32({m, k}, random), act));
      std::vector<Tensor> grouped, separate;
      for (int64_t n : widths) {
        grouped.push_back(cuda->alloc({m, n}, act));
        separate.push_back(cuda->alloc({m, n}, act));
      }
      std::vector<MatmulTarget> targets;
      for (size_t t = 0; t < widths.size(); ++t) {
        targets.push_back({&weights[t], t == 1 ? &bias : nullptr, &grouped[t]});
        cuda->matmul(x, weights[t], t == 1 ? &bias : nullptr, separate[t]);
      }
      cuda->matmul_group(x, targets);
      for (size_t t = 0; t < widths.size(); ++t) {
        const Tensor a = cuda->download(grouped[t]), b = cuda->download(separate[t]);
        EXPECT_EQ(std::memcmp(a.raw(), b.raw(), a.nbytes()), 0)
            << "widths[0]=" << widths[0] << " m=" << m << " product " << t;
      }
    }
  }
}

// Every decode launch shape (the grid layout launch_matmul_bf16 picks by size) gives the bits of
// the backend's matmul, for one to kMatmulDecodeMaxRows rows and a group of two products. K of
// three segments runs three warps in every shape; nine segments give some warps two or three.
TEST(CudaDecodeShapes, EveryLaunchShapeGivesTheSameBits) {
  KILN_REQUIRE_CUDA();
  std::unique_ptr<Backend> cuda = make_cuda_backend(0, DType::BF16);
  std::mt19937 random(15);
  const std::vector<int64_t> widths = {300, 40};
  for (int64_t k : {int64_t{2056}, int64_t{9224}}) {  // the last segment partial in both
    std::vector<Tensor> weights;
    for (int64_t n : widths) weights.push_back(cuda->upload(f32_as(random_f32({n, k}, random, 0.03f), DType::BF16)));
    for (int64_t m : {int64_t{1}, int64_t{3}, cuda::kMatmulDecodeMaxRows}) {
      const Tensor x = cuda->upload(f32_as(random_f32({m, k}, random), DType::BF16));
      std::vector<Tensor> expected;
      for (size_t t = 0; t < widths.size(); ++t) {
        expected.push_back(cuda->alloc({m, widths[t]}, DType::BF16));
        cuda->matmul(x, weights[t], nullptr, expected[t]);
        expected[t] = cuda->download(expected[t]);
      }
      for (int shape = 0; shape < cuda::decode_launch_shape_count(); ++shape) {
        std::vector<Tensor> outs;
        std::vector<cuda::MatmulArgs> products;
        for (size_t t = 0; t < widths.size(); ++t) {
          outs.push_back(cuda->alloc({m, widths[t]}, DType::BF16));
          cuda::MatmulArgs args;
          args.x = x.raw();
          args.w = weights[t].raw();
          args.out = outs[t].raw();
          args.m = m, args.n = widths[t], args.k = k;
          args.x_dtype = args.w_dtype = args.out_dtype = DType::BF16;
          products.push_back(args);
        }
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        ASSERT_EQ(cuda::launch_matmul_bf16_decode(products.data(), 2, shape, nullptr), cudaSuccess)
            << "shape " << shape;
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        for (size_t t = 0; t < widths.size(); ++t) {
          const Tensor actual = cuda->download(outs[t]);
          EXPECT_EQ(std::memcmp(actual.raw(), expected[t].raw(), actual.nbytes()), 0)
              << "k=" << k << " m=" << m << " shape " << shape << " product " << t;
        }
      }
    }
  }
}

// The prefill GEMM's rows are the decode kernel's bits (each 16-row slice goes to the decode
// kernel), with bias, bf16 and f32 output: partial blocks in both directions, a partial last
// segment and chunk. The small grids split K across blocks (3 and 2 segments, kernels.h); the
// 9 × 16-block grid of the last shape fills the H200 and does not.
TEST(CudaPrefillGemm, RowsAreTheDecodeKernelsBits) {
  KILN_REQUIRE_CUDA();
  std::unique_ptr<Backend> cuda = make_cuda_backend(0, DType::BF16);
  std::mt19937 random(17);
  const std::vector<std::tuple<int64_t, int64_t, int64_t>> shapes = {
      {17, 40, 72}, {300, 200, 2056}, {130, 520, 1032}, {1100, 2000, 1032}};
  for (const auto& [m, n, k] : shapes) {
    const Tensor x = f32_as(random_f32({m, k}, random), DType::BF16);
    const Tensor w = cuda->upload(f32_as(random_f32({n, k}, random, 0.03f), DType::BF16));
    const Tensor bias = cuda->upload(f32_as(random_f32({n}, random), DType::BF16));
    for (DType out_dtype : {DType::BF16, DType::F32}) {
      Tensor all = cuda->alloc({m, n}, out_dtype);
      cuda->matmul(cuda->upload(x), w, &bias, all);
      all = cuda->download(all);
      for (int64_t first = 0; first < m; first += cuda::kMatmulDecodeMaxRows) {
        const int64_t count = std::min<int64_t>(cuda::kMatmulDecodeMaxRows, m - first);
        Tensor part = cuda->alloc({count, n}, out_dtype);
        cuda->matmul(upload_rows(*cuda, x, first, count), w, &bias, part);
        EXPECT_TRUE(same_rows(cuda->download(part), 0, all, first, count))
            << "m=" << m << " n=" << n << " k=" << k << " out " << dtype_name(out_dtype) << " rows [" << first << ", "
            << first + count << ")";
      }
    }
  }
}

// rope_kv_write gives the bits of rope(q), rope(k), kv_write(k, v) — and, with per-head norms, of
// rms_norm(q), rms_norm(k) before them — for decode steps (a head per block) and prefills (eight),
// full and partial rotary dims, head dims under and over the block's 64 threads per head, into a
// cache whose slots' blocks are scattered over the pool.
TEST_P(CudaInvariance, RopeKvWriteEqualsItsOpsBitForBit) {
  std::mt19937 random(14);
  struct Case {
    std::vector<SequenceSpan> spans;
    int64_t head_dim, rotary_dim;
  };
  const std::vector<Case> cases = {{spans_of({{2, 0, 130}, {0, 17, 1}, {1, 255, 3}}), 128, 128},
                                   {spans_of({{2, 40, 1}, {0, 17, 1}, {1, 255, 1}}), 128, 128},
                                   {spans_of({{1, 3, 20}, {0, 9, 1}}), 80, 32},
                                   {spans_of({{0, 100, 1}}), 24, 24}};
  for (const Case& shape : cases) {
    const int64_t tokens = span_tokens(shape.spans), heads = 8, kv_heads = 2;
    const int64_t head_dim = shape.head_dim, rotary_dim = shape.rotary_dim;
    Tensor inv_freq_host = Tensor::empty({rotary_dim / 2}, DType::F32);
    for (int64_t j = 0; j < rotary_dim / 2; ++j)
      inv_freq_host.data<float>()[j] =
          static_cast<float>(1.0 / std::pow(10000.0, 2.0 * j / static_cast<double>(rotary_dim)));
    const Tensor inv_freq = cuda->upload(inv_freq_host);
    const Tensor q_host = f32_as(random_f32({tokens, heads, head_dim}, random), act);
    const Tensor k_host = f32_as(random_f32({tokens, kv_heads, head_dim}, random), act);
    const Tensor v = cuda->upload(f32_as(random_f32({tokens, kv_heads, head_dim}, random), act));
    const BatchLayout layout = cuda->make_layout(shape.spans, std::vector<int32_t>(tokens, 0));
    for (const DType gain_dtype : {act, DType::F32}) {
      const Tensor q_gain = cuda->upload(f32_as(random_f32({head_dim}, random), gain_dtype));
      const Tensor k_gain = cuda->upload(f32_as(random_f32({head_dim}, random), gain_dtype));
      for (std::optional<NormStyle> norms : {std::optional<NormStyle>{}, std::optional{NormStyle::Plain},
                                             std::optional{NormStyle::ZeroCentred}}) {
        const std::optional<HeadNorms> head_norms =
            norms ? std::optional<HeadNorms>(HeadNorms{q_gain, k_gain, 1e-6f, *norms}) : std::nullopt;
        auto run = [&](bool fused) {
          Tensor q = cuda->upload(q_host), k = cuda->upload(k_host);
          TestKvCache cache(*cuda, 3, 260, kv_heads, head_dim, true);
          if (fused) {
            cuda->rope_kv_write(q, k, v, layout, inv_freq, static_cast<int>(rotary_dim),
                                head_norms ? &*head_norms : nullptr, cache.view());
          } else {
            if (head_norms) {
              cuda->rms_norm(q, q_gain, head_norms->eps, head_norms->style, q);
              cuda->rms_norm(k, k_gain, head_norms->eps, head_norms->style, k);
            }
            cuda->rope(q, layout.positions, inv_freq, static_cast<int>(rotary_dim));
            cuda->rope(k, layout.positions, inv_freq, static_cast<int>(rotary_dim));
            cuda->kv_write(k, v, layout, cache.view());
          }
          return std::vector<Tensor>{cuda->download(q), cuda->download(k), cuda->download(cache.keys),
                                     cuda->download(cache.values)};
        };
        const std::vector<Tensor> fused = run(true), separate = run(false);
        for (size_t i = 0; i < fused.size(); ++i)
          EXPECT_EQ(std::memcmp(fused[i].raw(), separate[i].raw(), fused[i].nbytes()), 0)
              << "output " << i << ", " << tokens << " tokens, head_dim " << head_dim << ", rotary " << rotary_dim
              << ", gains " << dtype_name(gain_dtype) << ", norms "
              << (!norms ? "none" : *norms == NormStyle::Plain ? "plain" : "zero-centred");
      }
    }
  }
}

TEST_P(CudaInvariance, NormRowIsBitIdenticalAloneAndInAnyBatch) {
  std::mt19937 random(12);
  for (int64_t width : {100, 4096}) {
    const Tensor x = f32_as(random_f32({300, width}, random), act);
    const Tensor delta = f32_as(random_f32({300, width}, random), act);
    const Tensor gain = cuda->upload(f32_as(random_f32({width}, random), act));
    auto normed = [&](int64_t first, int64_t count) {
      Tensor residual = upload_rows(*cuda, x, first, count);
      Tensor out = cuda->alloc({count, width}, act);
      cuda->add_rms_norm(residual, upload_rows(*cuda, delta, first, count), gain, 1e-6f, NormStyle::Plain, out);
      return cuda->download(out);
    };
    const Tensor all = normed(0, 300);
    for (int64_t row : {0, 123, 299}) EXPECT_TRUE(same_rows(normed(row, 1), 0, all, row, 1)) << "width " << width;
  }
}

// Three sequences cached once, their blocks scattered over the pool; the reference attends every
// query of all three in one call. Each other call (alone, reordered batch, prefill chunks,
// single-token decode, multi-token append, decode batch) must reproduce the reference rows bit for
// bit.
TEST_P(CudaInvariance, AttentionRowIsBitIdenticalAloneBatchedChunkedAndDecoded) {
  std::mt19937 random(13);
  struct HeadShape {
    int64_t heads, kv_heads, head_dim;
  };
  // Head dims 24 and 80 run zero-padded on the bf16 kernels built for 32 and 128.
  for (const HeadShape shape :
       {HeadShape{8, 2, 64}, HeadShape{4, 1, 128}, HeadShape{6, 2, 24}, HeadShape{4, 2, 80}}) {
    const std::vector<int32_t> lengths = {300, 70, 1030};
    const int64_t capacity = 1100;
    std::vector<Tensor> queries;  // per slot [length, heads, head_dim], host, activation dtype
    TestKvCache cache(*cuda, 3, capacity, shape.kv_heads, shape.head_dim, true);
    const int32_t total = std::accumulate(lengths.begin(), lengths.end(), 0);
    {
      const BatchLayout fill = cuda->make_layout(spans_of({{0, 0, 300}, {1, 0, 70}, {2, 0, 1030}}),
                                                 std::vector<int32_t>(total, 0));
      const Tensor k = cuda->upload(f32_as(random_f32({total, shape.kv_heads, shape.head_dim}, random), act));
      const Tensor v = cuda->upload(f32_as(random_f32({total, shape.kv_heads, shape.head_dim}, random), act));
      cuda->kv_write(k, v, fill, cache.view());
      for (int32_t length : lengths)
        queries.push_back(f32_as(random_f32({length, shape.heads, shape.head_dim}, random), act));
    }
    const float scale = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
    // Attends the given (slot, first position, tokens) spans; returns the host output.
    auto attend = [&](const std::vector<std::array<int32_t, 3>>& request) {
      const std::vector<SequenceSpan> spans = spans_of(request);
      const int64_t tokens = span_tokens(spans);
      Tensor q = Tensor::empty({tokens, shape.heads, shape.head_dim}, act);
      for (const SequenceSpan& span : spans) {
        const Tensor& source = queries[span.slot];
        const size_t row_bytes = source.nbytes() / source.dim(0);
        std::memcpy(static_cast<char*>(q.raw()) + span.first_token * row_bytes,
                    static_cast<const char*>(source.raw()) + span.first_position * row_bytes, span.tokens * row_bytes);
      }
      const BatchLayout layout = cuda->make_layout(spans, std::vector<int32_t>(tokens, 0));
      Tensor out = cuda->alloc({tokens, shape.heads, shape.head_dim}, act);
      cuda->attention(cuda->upload(q), cache.view(), layout, scale, out);
      return std::make_pair(spans, cuda->download(out));
    };
    const auto [reference_spans, reference] = attend({{0, 0, 300}, {1, 0, 70}, {2, 0, 1030}});
    auto reference_row = [&](int32_t slot, int32_t position) { return reference_spans[slot].first_token + position; };

    const std::vector<std::vector<std::array<int32_t, 3>>> requests = {
        {{0, 0, 300}}, {{1, 0, 70}}, {{2, 0, 1030}},                  // each alone
        {{1, 0, 70}, {0, 0, 300}},                                      // another batch order
        {{0, 0, 64}}, {{0, 64, 128}}, {{0, 192, 108}},                  // prefill chunks
        {{2, 0, 1}}, {{2, 63, 1}}, {{2, 64, 1}}, {{2, 255, 1}}, {{2, 256, 1}}, {{2, 511, 1}}, {{2, 512, 1}},
        {{2, 1029, 1}}, {{0, 299, 1}},                                  // single-token decode
        {{2, 1020, 5}, {1, 60, 10}},                                    // multi-token appends
        {{0, 299, 1}, {1, 69, 1}, {2, 1029, 1}},                        // decode batch
        {{2, 700, 40}},                                                 // mid-sequence chunk
    };
    for (const auto& request : requests) {
      const auto [spans, out] = attend(request);
      for (const SequenceSpan& span : spans)
        for (int32_t i = 0; i < span.tokens; ++i)
          ASSERT_TRUE(same_rows(out, span.first_token + i, reference, reference_row(span.slot, span.first_position + i), 1))
              << "head_dim " << shape.head_dim << ": slot " << span.slot << " position " << span.first_position + i
              << " differs from the one-call reference (request of " << spans.size() << " spans, first "
              << request.front()[1] << " ×" << request.front()[2] << ")";
    }
  }
}

// The GDN conv and delta rule of three sequences give the same bits for every position, and the
// same final states, under the schedules the contract names: one shot, alone, in another order and
// in prefill chunks of 64 all equal the one-shot batch (the conv also equals it token by token);
// appends of 1..16 tokens equal decoding token by token (whole aligned chunks take the chunked
// form, so token by token differs from one shot from position 64 on).
TEST_P(CudaInvariance, GatedDeltaRowsAreBitIdenticalUnderEverySchedule) {
  HybridOps& hybrid = *cuda->hybrid_ops();
  std::mt19937 random(17);
  constexpr int64_t kKeyHeads = 2, kValueHeads = 4, kValueDim = 32;
  // Key dim 24 runs on the kernels built for 32, its q, k and state rows zero-padded.
  for (const int64_t key_dim : {int64_t{64}, int64_t{24}}) {
    SCOPED_TRACE(fmt::format("key_dim {}", key_dim));
    const int64_t channels = 2 * kKeyHeads * key_dim + kValueHeads * kValueDim;
    const std::vector<int32_t> lengths = {150, 70, 40};
    struct Sequence {
      Tensor x, q, k, v, g, beta;  // host, [length, …]
    };
    std::vector<Sequence> sequences;
    for (int32_t length : lengths)
      sequences.push_back({f32_as(random_f32({length, channels}, random), act),
                           unit_rows(random_f32({length, kKeyHeads, key_dim}, random)),
                           unit_rows(random_f32({length, kKeyHeads, key_dim}, random)),
                           random_f32({length, kValueHeads, kValueDim}, random),
                           uniform_f32({length, kValueHeads}, random, -0.5f, -0.01f),
                           uniform_f32({length, kValueHeads}, random, 0.05f, 0.95f)});
    const Tensor weight = cuda->upload(f32_as(random_f32({channels, 4}, random, 0.5f), DType::BF16));

    struct Outputs {
      std::vector<Tensor> convolved, core;  // per sequence, host
      Tensor conv_state, state;
    };
    // Each step lists (slot, first position, tokens); a schedule covers every position in order.
    auto run = [&](const std::vector<std::vector<std::array<int32_t, 3>>>& steps) {
      Outputs result;
      for (size_t slot = 0; slot < lengths.size(); ++slot) {
        result.convolved.push_back(Tensor::empty({lengths[slot], channels}, act));
        result.core.push_back(Tensor::empty({lengths[slot], kValueHeads, kValueDim}, act));
      }
      Tensor conv_state = cuda->alloc({3, 3, channels}, DType::F32);
      Tensor state = cuda->alloc({3, kValueHeads, key_dim, kValueDim}, DType::F32);
      for (const auto& step : steps) {
        const std::vector<SequenceSpan> spans = spans_of(step);
        const int64_t tokens = span_tokens(spans);
        // Gathers rows [first_position, +tokens) of each span's sequence into one batch tensor.
        auto gather = [&](Tensor Sequence::*field) {
          const Tensor& first = sequences[0].*field;
          Shape shape = first.shape();
          shape[0] = tokens;
          Tensor batch = Tensor::empty(shape, first.dtype());
          for (const SequenceSpan& span : spans) {
            const Tensor& source = sequences[span.slot].*field;
            const size_t row_bytes = source.nbytes() / source.dim(0);
            std::memcpy(static_cast<char*>(batch.raw()) + span.first_token * row_bytes,
                        static_cast<const char*>(source.raw()) + span.first_position * row_bytes, span.tokens * row_bytes);
          }
          return cuda->upload(batch);
        };
        const BatchLayout layout = cuda->make_layout(spans, std::vector<int32_t>(tokens, 0));
        Tensor convolved = cuda->alloc({tokens, channels}, act);
        hybrid.causal_conv1d_silu(gather(&Sequence::x), weight, layout, conv_state, convolved);
        Tensor core = cuda->alloc({tokens, kValueHeads, kValueDim}, act);
        hybrid.gated_delta_rule(gather(&Sequence::q), gather(&Sequence::k), gather(&Sequence::v), gather(&Sequence::g),
                                gather(&Sequence::beta), layout, state, core);
        const Tensor convolved_host = cuda->download(convolved), core_host = cuda->download(core);
        for (const SequenceSpan& span : spans)
          for (const auto& [from, to] : {std::pair{&convolved_host, &result.convolved[span.slot]},
                                         std::pair{&core_host, &result.core[span.slot]}}) {
            const size_t row_bytes = from->nbytes() / from->dim(0);
            std::memcpy(static_cast<char*>(to->raw()) + span.first_position * row_bytes,
                        static_cast<const char*>(from->raw()) + span.first_token * row_bytes, span.tokens * row_bytes);
          }
      }
      result.conv_state = cuda->download(conv_state);
      result.state = cuda->download(state);
      return result;
    };

    const Outputs one_shot = run({{{0, 0, 150}, {1, 0, 70}, {2, 0, 40}}});
    std::vector<std::vector<std::array<int32_t, 3>>> one_by_one, appends;
    for (int32_t position = 0; position < 150; ++position) {
      std::vector<std::array<int32_t, 3>> step;
      for (int32_t slot = 0; slot < 3; ++slot)
        if (position < lengths[slot]) step.push_back({slot, position, 1});
      one_by_one.push_back(step);
    }
    for (int32_t position = 0, size = 1; position < 150; position += size, size = size % 16 + 1) {
      std::vector<std::array<int32_t, 3>> step;
      for (int32_t slot = 0; slot < 3; ++slot)
        if (position < lengths[slot]) step.push_back({slot, position, std::min(size, lengths[slot] - position)});
      appends.push_back(step);
    }
    const Outputs token_by_token = run(one_by_one);
    struct Schedule {
      std::string name;
      std::vector<std::vector<std::array<int32_t, 3>>> steps;
      const Outputs* reference;
    };
    const std::vector<Schedule> schedules = {
        {"alone", {{{0, 0, 150}}, {{1, 0, 70}}, {{2, 0, 40}}}, &one_shot},
        {"other order", {{{2, 0, 40}, {0, 0, 150}, {1, 0, 70}}}, &one_shot},
        {"chunks of 64", {{{0, 0, 64}, {1, 0, 64}}, {{0, 64, 64}, {1, 64, 6}, {2, 0, 40}}, {{0, 128, 22}}}, &one_shot},
        {"appends of 1..16", appends, &token_by_token},
    };
    auto expect_same = [&](const std::string& name, const Outputs& outputs, const Outputs& reference, bool core) {
      for (size_t slot = 0; slot < lengths.size(); ++slot)
        for (int32_t position = 0; position < lengths[slot]; ++position) {
          ASSERT_TRUE(same_rows(outputs.convolved[slot], position, reference.convolved[slot], position, 1))
              << name << ": conv output of sequence " << slot << " at position " << position;
          if (core) {
            ASSERT_TRUE(same_rows(outputs.core[slot], position, reference.core[slot], position, 1))
                << name << ": delta-rule output of sequence " << slot << " at position " << position;
          }
        }
      EXPECT_EQ(std::memcmp(outputs.conv_state.raw(), reference.conv_state.raw(), reference.conv_state.nbytes()), 0)
          << name;
      if (core) {
        EXPECT_EQ(std::memcmp(outputs.state.raw(), reference.state.raw(), reference.state.nbytes()), 0) << name;
      }
    };
    for (const Schedule& schedule : schedules) expect_same(schedule.name, run(schedule.steps), *schedule.reference, true);
    expect_same("token by token against one shot (conv only)", token_by_token, one_shot, false);
    // Sequence 2 (40 tokens) holds no whole chunk: it is recurrent in every schedule.
    for (int32_t position = 0; position < lengths[2]; ++position)
      ASSERT_TRUE(same_rows(token_by_token.core[2], position, one_shot.core[2], position, 1))
          << "token by token against one shot: delta-rule output of sequence 2 at position " << position;

  }
}

// A slot's f32 state copied out and back on a bf16 backend (speculative decoding's rollback of a
// recurrent state) keeps every byte.
TEST(CudaBackendOps, CopyKeepsEveryByteOfAnF32State) {
  KILN_REQUIRE_CUDA();
  std::unique_ptr<Backend> cuda = make_cuda_backend(0, DType::BF16);
  Tensor host = Tensor::empty({3, 2, 4}, DType::F32);
  for (int i = 0; i < 24; ++i) host.data<float>()[i] = static_cast<float>(i) * 0.37f - 3.0f;
  host.data<float>()[9] = -0.0f;
  Tensor states = cuda->upload(host);
  Tensor saved = cuda->alloc({3, 2, 4}, DType::F32);
  Tensor saved_slot = saved.slice_rows(1, 1);
  cuda->copy(states.slice_rows(1, 1), saved_slot);
  cuda->zero(states);
  Tensor state_slot = states.slice_rows(1, 1);
  cuda->copy(saved_slot, state_slot);
  const Tensor back = cuda->download(states);
  EXPECT_EQ(std::memcmp(back.data<float>() + 8, host.data<float>() + 8, 8 * sizeof(float)), 0);
  Tensor bf16 = cuda->alloc({1, 2, 4}, DType::BF16);
  EXPECT_THROW(cuda->copy(state_slot, bf16), Error);
}

INSTANTIATE_TEST_SUITE_P(Activations, CudaInvariance, ::testing::Values(DType::F32, DType::BF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

}  // namespace
}  // namespace kiln::testing
