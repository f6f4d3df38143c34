// A mixture of experts on the GPU (issue 28): the routing gives the CPU's route_token bits, ties
// and extreme logits included; each expert product's row is, bit for bit, the plain matmul of its
// row with its expert's matrix — on the device path (one pass and several per expert, captured or
// not), on the host-sorted path, dense and quantized — and the experts a call reads are counted;
// and a MoE model's token gives the same logits alone and in a batch. (The op table runs the same
// ops against the CPU; tests/cuda/decode_graph_test.cpp replays MoE decode steps.)
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "backend/cuda/cuda_backend.h"
#include "core/weight.h"
#include "cuda_test_support.h"
#include "model_test_support.h"
#include "test_support.h"

namespace kiln::testing {
namespace {

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

struct RouteCase {
  int64_t tokens, experts, top_k;
  bool normalize, shared;
};

// Logits on a coarse grid (ties anywhere), whole rows equal, rows with a tie across the k-th place,
// rows far apart (probabilities that underflow and then tie at zero), and shared gates in both tails.
Tensor route_logits(const RouteCase& shape, std::mt19937& random) {
  Tensor logits = random_f32({shape.tokens, shape.experts}, random, 3.0f);
  for (int64_t t = 0; t < shape.tokens; ++t) {
    float* row = logits.data<float>() + t * shape.experts;
    switch (t % 4) {
      case 0: std::fill(row, row + shape.experts, 0.25f); break;
      case 1:
        for (int64_t e = 0; e < shape.experts; ++e) row[e] = std::round(row[e] * 2.0f) / 2.0f;
        break;
      case 2:
        for (int64_t e = 0; e < shape.experts; ++e) row[e] = -static_cast<float>((e * 37) % 23) * 9.5f;
        break;
      default: break;
    }
  }
  return logits;
}

TEST(MoeRouteOnTheGpu, IsBitIdenticalToRouteToken) {
  KILN_REQUIRE_CUDA();
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  std::mt19937 random(28);
  // Up to Qwen3-Next's 512 experts and top 10 (lanes with 16 candidates each), a single expert, k = E.
  for (const RouteCase& shape : {RouteCase{9, 8, 2, true, false}, RouteCase{9, 8, 8, true, true},
                                 RouteCase{33, 128, 8, true, false}, RouteCase{17, 256, 8, true, true},
                                 RouteCase{12, 512, 10, true, true}, RouteCase{7, 60, 4, false, true},
                                 RouteCase{3, 1, 1, true, false}}) {
    SCOPED_TRACE(fmt::format("{} tokens, {} experts, top {}{}{}", shape.tokens, shape.experts, shape.top_k,
                             shape.normalize ? ", normalized" : "", shape.shared ? ", shared" : ""));
    const Tensor logits = route_logits(shape, random);
    Tensor gates = random_f32({shape.tokens, 1}, random, 8.0f);
    gates.data<float>()[0] = -150.0f;
    const int64_t terms = shape.top_k + (shape.shared ? 1 : 0);
    for (DType activations : {DType::F32, DType::BF16}) {
      std::unique_ptr<Backend> cuda = make_cuda_backend(0, activations);
      std::vector<Tensor> results[2];
      Backend* backends[2] = {cpu.get(), cuda.get()};
      for (int b = 0; b < 2; ++b) {
        Backend& backend = *backends[b];
        const Tensor device_logits = backend.upload(logits), device_gates = backend.upload(gates);
        Tensor experts = backend.alloc({shape.tokens, shape.top_k}, DType::I32);
        Tensor weights = backend.alloc({shape.tokens, terms}, DType::F32);
        backend.moe_route(device_logits, shape.shared ? &device_gates : nullptr, shape.normalize, experts, weights);
        results[b] = {backend.download(experts), backend.download(weights)};
      }
      EXPECT_TRUE(same_bytes(results[0][0], results[1][0])) << "the experts differ";
      EXPECT_TRUE(same_bytes(results[0][1], results[1][1])) << "the weights differ";
    }
  }
}

// The stacked matrices of `experts` experts [experts · n, k], as a backend weight: dense, or MLX
// affine 4-bit g64 / 3-bit g128, or FP8 blocks.
enum class ExpertFormat { Dense, Affine4, Affine3, Fp8 };

Weight stacked_experts(Backend& backend, ExpertFormat format, int64_t rows, int64_t k, std::mt19937& random) {
  if (format == ExpertFormat::Dense) {
    const Tensor values = random_f32({rows, k}, random, 1.0f / std::sqrt(static_cast<float>(k)));
    return Weight(backend.upload(f32_as(values, backend.activation_dtype())));
  }
  if (format == ExpertFormat::Fp8) {
    const Tensor scales = uniform_f32({(rows + 127) / 128, (k + 127) / 128}, random, 1e-4f, 1e-3f);
    return backend.upload_weight(Weight::fp8_block(random_fp8_codes(rows, k, random), scales, 128, 128));
  }
  const int bits = format == ExpertFormat::Affine4 ? 4 : 3, group = format == ExpertFormat::Affine4 ? 64 : 128;
  Tensor codes = Tensor::empty({rows, k * bits / 32}, DType::U32);
  for (int64_t i = 0; i < codes.numel(); ++i) codes.data<uint32_t>()[i] = static_cast<uint32_t>(random());
  const float unit = 1.0f / static_cast<float>(1 << bits) / 8.0f;
  const Tensor scales = uniform_f32({rows, k / group}, random, 0.5f * unit, 1.5f * unit);
  Tensor biases = uniform_f32({rows, k / group}, random, -0.01f, 0.01f);
  for (int64_t i = 0; i < biases.numel(); ++i)
    biases.data<float>()[i] -= scales.data<float>()[i] * static_cast<float>(1 << (bits - 1));
  return backend.upload_weight(
      Weight::affine(codes, f32_as(scales, DType::BF16), f32_as(biases, DType::BF16), bits, group));
}

// Each token's `top_k` distinct experts, ascending (as moe_route gives them).
Tensor chosen_experts(int64_t tokens, int64_t experts, int64_t top_k, std::mt19937& random) {
  Tensor chosen = Tensor::empty({tokens, top_k}, DType::I32);
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int32_t> all(static_cast<size_t>(experts));
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), random);
    std::sort(all.begin(), all.begin() + top_k);
    std::copy(all.begin(), all.begin() + top_k, chosen.data<int32_t>() + t * top_k);
  }
  return chosen;
}

struct ExpertCase {
  std::string name;
  int64_t tokens, experts, top_k, n, k;
  bool per_pair;  // x a row per pair (a down projection), else a row per token with two products
  ExpertFormat format;
  bool captured;  // run inside captured work (the device path whatever the pairs)
};

class ExpertMatmulOnTheGpu : public ::testing::TestWithParam<std::tuple<ExpertCase, DType>> {};

// out[t·k + j] against matmul(x[r], W_e) of one row: the decode kernel's (or, quantized, the fused
// kernel's) bits, which every kernel gives. The experts each call read are counted.
TEST_P(ExpertMatmulOnTheGpu, EachPairIsTheMatmulOfItsRowAndItsExpert) {
  KILN_REQUIRE_CUDA();
  const auto& [shape, activations] = GetParam();
  std::unique_ptr<Backend> cuda = make_cuda_backend(0, activations);
  std::mt19937 random(static_cast<uint32_t>(shape.tokens * 131 + shape.n));
  const int64_t pairs = shape.tokens * shape.top_k;
  const int64_t x_rows = shape.per_pair ? pairs : shape.tokens;
  const int products = shape.per_pair ? 1 : 2;
  const Tensor x = cuda->upload(f32_as(random_f32({x_rows, shape.k}, random), activations));
  const Tensor host_experts = chosen_experts(shape.tokens, shape.experts, shape.top_k, random);
  const Tensor experts = cuda->upload(host_experts);
  std::vector<Weight> weights;
  std::vector<Tensor> outs;
  const DType out_dtype = shape.per_pair ? DType::F32 : activations;
  for (int p = 0; p < products; ++p) {
    weights.push_back(stacked_experts(*cuda, shape.format, shape.experts * shape.n, shape.k, random));
    outs.push_back(cuda->alloc({pairs, shape.n}, out_dtype));
  }
  std::vector<MatmulTarget> targets;
  for (int p = 0; p < products; ++p) targets.push_back({&weights[p], nullptr, &outs[p]});
  Tensor experts_read = cuda->alloc({1}, DType::U32);
  cuda->zero(experts_read);
  auto work = [&] { cuda->expert_matmul(x, experts, targets, &experts_read); };
  std::unique_ptr<CapturedWork> captured;
  if (shape.captured) {
    captured = cuda->graph_ops()->capture(work);  // its real run, then the recording
    for (Tensor& out : outs) cuda->zero(out);
    captured->replay();
  } else {
    work();
  }
  const std::set<int32_t> used(host_experts.data<int32_t>(), host_experts.data<int32_t>() + pairs);
  EXPECT_EQ(cuda->download(experts_read).data<uint32_t>()[0], (shape.captured ? 2 : 1) * used.size())
      << "the experts read (a captured call counts its real run and its replay)";
  for (int p = 0; p < products; ++p) {
    const Tensor got = cuda->download(outs[p]);
    for (int64_t pair = 0; pair < pairs; ++pair) {
      const int32_t expert = host_experts.data<int32_t>()[pair];
      const Weight matrix = weights[p].rows(expert * shape.n, shape.n);
      Tensor one = cuda->alloc({1, shape.n}, out_dtype);
      cuda->matmul(x.slice_rows(shape.per_pair ? pair : pair / shape.top_k, 1), matrix, nullptr, one);
      ASSERT_TRUE(same_rows(got, pair, cuda->download(one), 0, 1))
          << "product " << p << ", pair " << pair << " (token " << pair / shape.top_k << ", expert " << expert << ")";
    }
  }
}

// Pairs per expert: up to 16 on average runs on the device (pass of up to 8 pairs); more runs
// sorted on the host outside captured work. K of three segments with a short last one; N not a
// multiple of 16.
INSTANTIATE_TEST_SUITE_P(
    Shapes, ExpertMatmulOnTheGpu,
    ::testing::Combine(
        ::testing::Values(ExpertCase{"decode_one_token", 1, 8, 2, 40, 2560, false, ExpertFormat::Dense, false},
                          ExpertCase{"decode_down", 3, 8, 2, 72, 768, true, ExpertFormat::Dense, false},
                          ExpertCase{"passes", 60, 8, 2, 48, 200, false, ExpertFormat::Dense, false},
                          ExpertCase{"passes_down", 60, 8, 2, 200, 48, true, ExpertFormat::Dense, false},
                          ExpertCase{"host_sorted", 100, 4, 2, 48, 1032, false, ExpertFormat::Dense, false},
                          ExpertCase{"captured_many_pairs", 100, 4, 2, 48, 1032, false, ExpertFormat::Dense, true},
                          ExpertCase{"captured_decode", 2, 16, 4, 64, 512, false, ExpertFormat::Dense, true},
                          ExpertCase{"affine4", 2, 4, 2, 64, 256, false, ExpertFormat::Affine4, false},
                          ExpertCase{"affine4_host_sorted", 40, 2, 2, 64, 256, false, ExpertFormat::Affine4, false},
                          ExpertCase{"affine3", 5, 4, 2, 48, 384, true, ExpertFormat::Affine3, false},
                          ExpertCase{"fp8", 3, 3, 2, 128, 256, false, ExpertFormat::Fp8, true}),
        ::testing::Values(DType::F32, DType::BF16)),
    [](const auto& info) {
      return std::get<0>(info.param).name + "_" + std::string(dtype_name(std::get<1>(info.param)));
    });

// A token's logits alone and as the middle sequence of a batch of three, prefill and decode (the
// prefills take the host-sorted path, the decode steps the device path).
class MoeModelOnTheGpu : public ::testing::TestWithParam<std::tuple<std::string, DType>> {};

TEST_P(MoeModelOnTheGpu, ATokensLogitsAreTheSameAloneAndInABatch) {
  KILN_REQUIRE_CUDA();
  const auto& [name, activations] = GetParam();
  const auto fixture = fixtures_dir() / name;
  TestModel loaded = open_cuda_model(fixture / (activations == DType::F32 ? "f32" : "bf16"), activations);
  std::vector<int32_t> prompt = fixture_prompt(fixture);
  prompt.resize(150);
  const AloneAndBatched runs = alone_and_in_a_batch_of_three(*loaded.model, prompt);
  EXPECT_TRUE(same_bytes(runs.alone_prefill, runs.batched_prefill)) << "prefill in a batch of 3";
  EXPECT_TRUE(same_bytes(runs.alone_decode, runs.batched_decode)) << "decode in a batch of 3";
}

INSTANTIATE_TEST_SUITE_P(Fixtures, MoeModelOnTheGpu,
                         ::testing::Combine(::testing::Values("qwen3-moe-tiny", "qwen3_5-moe-tiny"),
                                            ::testing::Values(DType::F32, DType::BF16)),
                         [](const auto& info) {
                           std::string name = std::get<0>(info.param) + "_" +
                                              std::string(dtype_name(std::get<1>(info.param)));
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

}  // namespace
}  // namespace kiln::testing
