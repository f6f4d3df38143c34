// Quantized weights on the CUDA backend (core/weight.h): every matmul element bit-identical to the
// dense matmul of the decoded weights (rounded to bf16 for BF16 activations, kept in f32 for F32
// activations) at decode and prefill row counts, alone and in mixed matmul groups; quantized
// embedding rows equal to the decoded table's; and the project's quantized fixtures end to end
// under the fixtures' bf16 rule.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "backend/cuda/cuda_backend_impl.h"
#include "backend/cuda/kernels.h"
#include "core/weight.h"
#include "cuda_test_support.h"
#include "engine/generation.h"
#include "test_support.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

// Rows that take the fused decode kernel (1, 3, kMatmulDecodeMaxRows, kQuantizedDecodeMaxRows) and
// the prefill GEMM (64, 300) on the decoded weight.
const std::vector<int64_t> kRowCounts = {1, 3, cuda::kMatmulDecodeMaxRows, cuda::kQuantizedDecodeMaxRows, 64, 300};

// A random host affine weight [n, k]: uniform codes; scales and biases (in `scale_dtype`) as MLX
// makes them, biases near −scale · 2^(bits−1).
Weight random_affine(int64_t n, int64_t k, int bits, int group, DType scale_dtype, std::mt19937& random) {
  Tensor values = Tensor::empty({n, k * bits / 32}, DType::U32);
  for (int64_t i = 0; i < values.numel(); ++i) values.data<uint32_t>()[i] = static_cast<uint32_t>(random());
  const Tensor scales = uniform_f32({n, k / group}, random, 0.5f / (1 << bits), 2.0f / (1 << bits));
  Tensor biases = uniform_f32({n, k / group}, random, -0.1f, 0.1f);
  for (int64_t i = 0; i < biases.numel(); ++i)
    biases.data<float>()[i] -= scales.data<float>()[i] * static_cast<float>(1 << (bits - 1));
  return Weight::affine(values, f32_as(scales, scale_dtype), f32_as(biases, scale_dtype), bits, group);
}

// A random host FP8 weight [n, k] in 128×128 blocks (edge blocks partial), no NaN codes.
Weight random_fp8(int64_t n, int64_t k, DType scale_dtype, std::mt19937& random) {
  const Tensor values = random_fp8_codes(n, k, random);
  const Tensor scales = uniform_f32({(n + 127) / 128, (k + 127) / 128}, random, 1e-4f, 1e-3f);
  return Weight::fp8_block(values, f32_as(scales, scale_dtype), 128, 128);
}

// The decoded matrix of a host weight in `dtype` (F32, or BF16 rounded to nearest even).
Tensor decoded(const Weight& weight, DType dtype) {
  Tensor values = Tensor::empty(weight.shape(), DType::F32);
  decode_rows(weight, 0, weight.dim(0), values.data<float>());
  return f32_as(values, dtype);
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

// A weight's codes [n, k] of `bits` bits (4 or 8) rearranged as the fragment order says
// (backend/cuda/quantized.cu): each row in blocks of 64 bytes (the last block the rest of the row),
// and in a block of E codes the four codes from element 32c + 16h + 4q moved to quad position
// q·E/16 + 2c + h.
Tensor fragment_ordered(const Tensor& stored, int bits, int64_t k) {
  Tensor arranged = Tensor::empty(stored.shape(), stored.dtype());
  const int64_t n = stored.dim(0), row_bytes = k * bits / 8, block = 64 * 8 / bits, quad_bytes = bits / 2;
  const auto* from = static_cast<const uint8_t*>(stored.raw());
  auto* to = static_cast<uint8_t*>(arranged.raw());
  for (int64_t row = 0; row < n; ++row)
    for (int64_t start = 0; start < k; start += block) {
      const int64_t codes = std::min(block, k - start);
      for (int64_t quad = 0; quad < codes / 4; ++quad) {
        const int64_t c = quad / 8, h = quad / 4 % 2, q = quad % 4;
        const int64_t target = q * codes / 16 + 2 * c + h;
        std::memcpy(to + row * row_bytes + (start / 4 + target) * quad_bytes,
                    from + row * row_bytes + (start / 4 + quad) * quad_bytes, static_cast<size_t>(quad_bytes));
      }
    }
  return arranged;
}

// The quantized product and the dense product of the decoded weight (with a bias), for every row
// count, give the same bytes.
void expect_decoded_bits(Backend& backend, const Weight& host, std::mt19937& random) {
  const DType activations = backend.activation_dtype();
  const Weight quantized = backend.upload_weight(host);
  const Tensor dense = backend.upload(decoded(host, activations));
  const Tensor bias = backend.upload(f32_as(random_f32({host.dim(0)}, random), activations));
  for (int64_t m : kRowCounts) {
    SCOPED_TRACE(fmt::format("{} [{}, {}], m = {}", host.describe(), host.dim(0), host.dim(1), m));
    const Tensor x = backend.upload(f32_as(random_f32({m, host.dim(1)}, random), activations));
    Tensor ours = backend.alloc({m, host.dim(0)}, activations), reference = backend.alloc({m, host.dim(0)}, activations);
    backend.matmul(x, quantized, &bias, ours);
    backend.matmul(x, dense, &bias, reference);
    EXPECT_TRUE(same_bytes(backend.download(ours), backend.download(reference)));
  }
}

// The upload gives the weights the fused decode kernel takes (4- and 8-bit affine, FP8 in
// 128-column blocks with K a multiple of 16) the fragment order, its bytes exactly as the order
// says (every K here ends in a short last block), and leaves the others stored. A weight already
// on the device is arranged in a copy: its own codes stay as they were.
TEST(CudaQuantizedUpload, TheFusedKernelsWeightsTakeTheFragmentOrder) {
  KILN_REQUIRE_CUDA();
  auto backend = make_cuda_backend(0, DType::BF16);
  std::mt19937 random(26);
  struct Case {
    Weight host;
    int bits;  // 0: stays in the stored order
  };
  const std::vector<Case> cases = {{random_affine(40, 1216, 4, 64, DType::BF16, random), 4},
                                   {random_affine(40, 1184, 8, 32, DType::F16, random), 8},
                                   {random_fp8(40, 1200, DType::F32, random), 8},
                                   {random_affine(40, 1216, 3, 64, DType::BF16, random), 0},
                                   {random_fp8(40, 328, DType::BF16, random), 0}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.host.describe());
    const Weight uploaded = backend->upload_weight(c.host);
    EXPECT_EQ(uploaded.code_order(), c.bits ? CodeOrder::Fragment : CodeOrder::Stored);
    EXPECT_TRUE(same_bytes(backend->download(uploaded.values()),
                           c.bits ? fragment_ordered(c.host.values(), c.bits, c.host.dim(1)) : c.host.values()));
    const Weight on_device = c.host.with_parts(backend->upload(c.host.values()), backend->upload(c.host.scales()),
                                               c.host.biases().defined() ? backend->upload(c.host.biases()) : Tensor());
    const Weight arranged = backend->upload_weight(on_device);
    EXPECT_EQ(arranged.code_order(), uploaded.code_order());
    EXPECT_TRUE(same_bytes(backend->download(arranged.values()), backend->download(uploaded.values())));
    EXPECT_TRUE(same_bytes(backend->download(on_device.values()), c.host.values()));
  }
}

TEST(CudaQuantizedMatmul, AffineIsBitIdenticalToTheDecodedBf16Matmul) {
  KILN_REQUIRE_CUDA();
  auto backend = make_cuda_backend(0, DType::BF16);
  std::mt19937 random(27);
  // K of 2,304 ends in a partial 1,024-element segment; 200 rows end in a partial block of rows.
  for (int bits : {2, 3, 4, 5, 6, 8})
    for (int group : {32, 64, 128})
      for (DType scale_dtype : {DType::BF16, DType::F16, DType::F32})
        expect_decoded_bits(*backend, random_affine(200, 2304, bits, group, scale_dtype, random), random);
}

TEST(CudaQuantizedMatmul, Fp8BlocksAreBitIdenticalToTheDecodedBf16Matmul) {
  KILN_REQUIRE_CUDA();
  auto backend = make_cuda_backend(0, DType::BF16);
  std::mt19937 random(28);
  // Partial edge blocks both ways; K = 328 is no multiple of 16 (decoded into scratch at every m),
  // K = 336 ends half-way into a 32-element chunk, K = 2,176 spans three segments.
  for (const auto& [n, k] : std::vector<std::pair<int64_t, int64_t>>{{200, 328}, {200, 336}, {520, 2176}})
    for (DType scale_dtype : {DType::F32, DType::BF16})
      expect_decoded_bits(*backend, random_fp8(n, k, scale_dtype, random), random);
}

// Every launch shape of the fused decode kernel (16- or 8-row blocks, four or eight warps) gives
// the bits of the dense product of the decoded weight: K of nine segments (so eight warps share
// them unevenly) with a partial last one, 200 rows ending in a partial block of either height.
TEST(CudaQuantizedMatmul, EveryFusedLaunchShapeGivesTheDecodedBits) {
  KILN_REQUIRE_CUDA();
  auto backend = make_cuda_backend(0, DType::BF16);
  std::mt19937 random(29);
  const int64_t n = 200, k = 8 * 1024 + 512;
  for (const Weight& host : {random_affine(n, k, 4, 64, DType::BF16, random),
                             random_affine(n, k, 8, 32, DType::F16, random), random_fp8(n, k, DType::F32, random)}) {
    const Weight quantized = backend->upload_weight(host);
    const Tensor dense = backend->upload(decoded(host, DType::BF16));
    for (int64_t m : {int64_t{1}, int64_t{3}, cuda::kQuantizedDecodeMaxRows}) {
      const Tensor x = backend->upload(f32_as(random_f32({m, k}, random), DType::BF16));
      Tensor reference = backend->alloc({m, n}, DType::BF16);
      backend->matmul(x, dense, nullptr, reference);
      const Tensor expected = backend->download(reference);
      for (int shape = 0; shape < cuda::quantized_decode_launch_shape_count(); ++shape) {
        SCOPED_TRACE(fmt::format("{}, m = {}, shape {}", host.describe(), m, shape));
        Tensor out = backend->alloc({m, n}, DType::BF16);
        cuda::MatmulArgs args;
        args.x = x.raw();
        args.out = out.raw();
        args.m = m, args.n = n, args.k = k;
        args.x_dtype = args.out_dtype = DType::BF16;
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        ASSERT_EQ(cuda::launch_matmul_quantized_decode(args, quantized_weight_args(quantized), nullptr, shape),
                  cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        EXPECT_TRUE(same_bytes(backend->download(out), expected));
      }
    }
  }
}

TEST(CudaQuantizedMatmul, F32ActivationsAreBitIdenticalToTheDecodedF32Matmul) {
  KILN_REQUIRE_CUDA();
  auto backend = make_cuda_backend(0, DType::F32);
  std::mt19937 random(29);
  for (int bits : {3, 4, 8}) expect_decoded_bits(*backend, random_affine(200, 512, bits, 64, DType::BF16, random), random);
  // K = 328 stays in the stored order; K = 336 takes the fragment order, decoded into scratch.
  expect_decoded_bits(*backend, random_fp8(200, 328, DType::F32, random), random);
  expect_decoded_bits(*backend, random_fp8(200, 336, DType::F32, random), random);
}

TEST(CudaQuantizedMatmul, MixedGroupsGiveEachProductsOwnBits) {
  KILN_REQUIRE_CUDA();
  std::mt19937 random(30);
  for (DType activations : {DType::BF16, DType::F32}) {
    auto backend = make_cuda_backend(0, activations);
    const int64_t k = 1152;
    const std::vector<Weight> hosts = {random_affine(192, k, 4, 64, DType::BF16, random),
                                       Weight(f32_as(random_f32({96, k}, random, 0.03f), activations)),
                                       random_fp8(136, k, DType::F32, random),
                                       random_affine(64, k, 3, 32, DType::F16, random)};
    std::vector<Weight> quantized, dense;
    for (const Weight& host : hosts) {
      quantized.push_back(backend->upload_weight(host));
      dense.push_back(backend->upload(decoded(host, activations)));
    }
    const Tensor bias = backend->upload(f32_as(random_f32({136}, random), activations));
    for (int64_t m : kRowCounts) {
      SCOPED_TRACE(fmt::format("{} activations, m = {}", dtype_name(activations), m));
      const Tensor x = backend->upload(f32_as(random_f32({m, k}, random), activations));
      std::vector<Tensor> outs;
      std::vector<MatmulTarget> targets;
      for (size_t t = 0; t < hosts.size(); ++t) outs.push_back(backend->alloc({m, hosts[t].dim(0)}, activations));
      for (size_t t = 0; t < hosts.size(); ++t) targets.push_back({&quantized[t], t == 2 ? &bias : nullptr, &outs[t]});
      backend->matmul_group(x, targets);
      for (size_t t = 0; t < hosts.size(); ++t) {
        Tensor reference = backend->alloc({m, hosts[t].dim(0)}, activations);
        backend->matmul(x, dense[t], t == 2 ? &bias : nullptr, reference);
        EXPECT_TRUE(same_bytes(backend->download(outs[t]), backend->download(reference))) << "product " << t;
      }
    }
  }
}

TEST(CudaQuantizedEmbedding, RowsAreTheDecodedRowsRoundedToTheOutput) {
  KILN_REQUIRE_CUDA();
  std::mt19937 random(31);
  // 4- and 8-bit and FP8 with K = 208 in the fragment order (the last 64-byte blocks of the 8-bit
  // and FP8 rows short); 6-bit and FP8 with K = 200 stored.
  const std::vector<Weight> tables = {random_affine(50, 256, 4, 64, DType::BF16, random),
                                      random_affine(50, 224, 8, 32, DType::BF16, random),
                                      random_affine(50, 192, 6, 32, DType::F32, random),
                                      random_fp8(50, 208, DType::F32, random),
                                      random_fp8(50, 200, DType::F32, random)};
  std::vector<int32_t> ids(40);
  for (auto& id : ids) id = static_cast<int32_t>(random() % 50);
  for (DType activations : {DType::BF16, DType::F32}) {
    auto backend = make_cuda_backend(0, activations);
    const Tensor tokens = backend->upload(indices(ids));
    for (const Weight& table : tables) {
      const Weight quantized = backend->upload_weight(table);
      const Tensor dense = backend->upload(decoded(table, DType::F32));
      for (DType out_dtype : {activations, DType::F32}) {
        SCOPED_TRACE(fmt::format("{} into {}", table.describe(), dtype_name(out_dtype)));
        Tensor ours = backend->alloc({40, table.dim(1)}, out_dtype), reference = backend->alloc({40, table.dim(1)}, out_dtype);
        backend->embedding(quantized, tokens, ours);
        backend->embedding(dense, tokens, reference);
        EXPECT_TRUE(same_bytes(backend->download(ours), backend->download(reference)));
      }
    }
  }
}

class CudaQuantizedFixture : public ::testing::TestWithParam<std::string> {};

// The fixtures' bf16 rule (../shared/fixtures/README.md): against the float64 logits of the
// dequantized weights, kiln's mean row error within 1.1 × transformers' bf16 mean and its worst
// row within 1.5 × transformers' worst.
TEST_P(CudaQuantizedFixture, Bf16ActivationsMeetTheFixturesBf16Rule) {
  KILN_REQUIRE_CUDA();
  const auto fixture = fixtures_dir() / GetParam();
  TestModel loaded = open_cuda_model(fixture / "q", DType::BF16);
  const Tensor logits = prompt_logits(*loaded.model, fixture_prompt(fixture), kWholePrompt);
  const auto [ours, theirs] = bf16_row_errors(logits, fixture / "q");
  ASSERT_EQ(ours.size(), theirs.size());
  const auto mean = [](const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0) / v.size(); };
  const double our_worst = *std::max_element(ours.begin(), ours.end());
  const double their_worst = *std::max_element(theirs.begin(), theirs.end());
  std::printf("%s bf16 error: mean %.5f (transformers %.5f), worst row %.5f (transformers %.5f)\n",
              GetParam().c_str(), mean(ours), mean(theirs), our_worst, their_worst);
  EXPECT_LE(mean(ours), 1.1 * mean(theirs));
  EXPECT_LE(our_worst, 1.5 * their_worst);
}

// Prompt logits the same bits in one prefill as in 64-token chunks (the prefill GEMM on the
// decoded scratch and, for the last positions, one token at a time through the fused decode kernel).
TEST_P(CudaQuantizedFixture, Bf16LogitsAreBitIdenticalOneShotChunkedAndDecoded) {
  KILN_REQUIRE_CUDA();
  const auto fixture = fixtures_dir() / GetParam();
  TestModel loaded = open_cuda_model(fixture / "q", DType::BF16);
  const std::vector<int32_t> prompt = fixture_prompt(fixture);
  const Tensor whole = prompt_logits(*loaded.model, prompt, kWholePrompt);
  std::vector<size_t> chunks_of_64, token_by_token;
  for (size_t position = 64; position < prompt.size(); position += 64) chunks_of_64.push_back(position);
  for (size_t position = 1; position < prompt.size(); ++position) token_by_token.push_back(position);
  EXPECT_TRUE(same_bytes(whole, logits_with_cuts(*loaded.model, prompt, chunks_of_64)));
  EXPECT_TRUE(same_bytes(whole, logits_with_cuts(*loaded.model, prompt, token_by_token)));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaQuantizedFixture, ::testing::Values("qwen3-mlx-tiny", "llama3-fp8-tiny"));

}  // namespace
