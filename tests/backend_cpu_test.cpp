// What only the CPU backend has: the invariance contract on its threads (a row's result is
// bit-identical alone or inside a larger batch, and for 1, 2 or 3 threads), the default fused ops,
// the errors of its host-side checks, its batch layouts and its memory. Its ops against exact
// arithmetic, on every instruction set, are cases of the op table (tests/backend_ops_test.cpp).
#include <cmath>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "core/weight.h"
#include "kv_cache_support.h"
#include "tensor_test_support.h"
#include "test_support.h"

using namespace kiln;
using kiln::cpu::CpuIsa;
using kiln::testing::expect_error_mentions;
using kiln::testing::same_rows;
using kiln::testing::TestKvCache;

namespace {

// Every instruction set this CPU supports (scalar always).
std::vector<CpuIsa> supported_isas() {
  std::vector<CpuIsa> isas;
  for (CpuIsa isa : {CpuIsa::Scalar, CpuIsa::Avx2, CpuIsa::Avx512})
    if (cpu::cpu_supports(isa)) isas.push_back(isa);
  return isas;
}

// Sets the global pool's thread count for one scope, restoring the default after.
class GlobalThreads {
 public:
  explicit GlobalThreads(int threads) { ThreadPool::set_global_threads(threads); }
  ~GlobalThreads() { ThreadPool::set_global_threads(std::max(1u, std::thread::hardware_concurrency())); }
};

Tensor random_f32(const Shape& shape, uint32_t seed, float low = -1.0f, float high = 1.0f) {
  Tensor tensor = Tensor::empty(shape, DType::F32);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(low, high);
  for (int64_t i = 0; i < tensor.numel(); ++i) tensor.data<float>()[i] = dist(rng);
  return tensor;
}

// A weight tensor in `dtype` holding random values that the dtype represents exactly.
Tensor random_weight(const Shape& shape, DType dtype, uint32_t seed, float low = -1.0f, float high = 1.0f) {
  Tensor values = random_f32(shape, seed, low, high);
  if (dtype == DType::F32) return values;
  Tensor tensor = Tensor::empty(shape, dtype);
  for (int64_t i = 0; i < tensor.numel(); ++i) {
    const float value = values.data<float>()[i];
    tensor.data<uint16_t>()[i] = dtype == DType::BF16 ? f32_to_bf16(value) : f32_to_f16(value);
  }
  return tensor;
}

Tensor i32_tensor(const std::vector<int32_t>& values) {
  Tensor tensor = Tensor::empty({static_cast<int64_t>(values.size())}, DType::I32);
  std::copy(values.begin(), values.end(), tensor.data<int32_t>());
  return tensor;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

bool same_bits(const float* a, const float* b, int64_t count) {
  return std::memcmp(a, b, static_cast<size_t>(count) * sizeof(float)) == 0;
}

std::string isa_label(CpuIsa isa) { return std::string(cpu::isa_name(isa)); }

// ---------------------------------------------------------------------------------------------
// matmul

TEST(CpuMatmul, RowsAreBitIdenticalAloneInABatchAndForAnyThreadCount) {
  const int64_t rows = 65, k = 1000, n = 130;
  const Tensor x = random_f32({rows, k}, 4);
  for (CpuIsa isa : supported_isas()) {
    auto backend = cpu::make_cpu_backend(isa);
    for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
      SCOPED_TRACE(isa_label(isa) + " " + std::string(dtype_name(dtype)));
      const Tensor w = random_weight({n, k}, dtype, 5);
      const Tensor bias = random_weight({n}, DType::F32, 6);
      Tensor full = Tensor::empty({rows, n}, DType::F32);
      {
        GlobalThreads one(1);
        backend->matmul(x, w, &bias, full);
      }
      for (int threads : {2, 3}) {
        GlobalThreads scope(threads);
        Tensor again = Tensor::empty({rows, n}, DType::F32);
        backend->matmul(x, w, &bias, again);
        EXPECT_TRUE(same_bits(full, again)) << threads << " threads";
      }
      // Single rows (decode), and a 5-row batch starting at an odd row (another tiling of rows).
      for (int64_t row : {int64_t{0}, int64_t{13}, rows - 1}) {
        Tensor alone = Tensor::empty({1, n}, DType::F32);
        backend->matmul(x.slice_rows(row, 1), w, &bias, alone);
        EXPECT_TRUE(same_bits(alone.data<float>(), full.data<float>() + row * n, n)) << "row " << row;
      }
      Tensor five = Tensor::empty({5, n}, DType::F32);
      backend->matmul(x.slice_rows(3, 5), w, &bias, five);
      EXPECT_TRUE(same_bits(five.data<float>(), full.data<float>() + 3 * n, 5 * n));
      // A slice of the weight's rows: columns fall in other tiles and thread blocks.
      Tensor some_columns = Tensor::empty({rows, 50}, DType::F32);
      Tensor bias_slice = bias.slice_rows(7, 50);
      backend->matmul(x, w.slice_rows(7, 50), &bias_slice, some_columns);
      for (int64_t t = 0; t < rows; ++t)
        ASSERT_TRUE(same_bits(some_columns.data<float>() + t * 50, full.data<float>() + t * n + 7, 50)) << "row " << t;
    }
  }
}

TEST(CpuMatmul, RejectsMismatchedShapesAndDtypes) {
  auto backend = make_cpu_backend();
  const Tensor x = random_f32({2, 8}, 7);
  const Tensor w = random_f32({3, 8}, 8);
  Tensor out = Tensor::empty({2, 3}, DType::F32);
  Tensor wrong_k = random_f32({3, 9}, 9);
  EXPECT_THROW(backend->matmul(x, wrong_k, nullptr, out), Error);
  Tensor wrong_out = Tensor::empty({2, 4}, DType::F32);
  EXPECT_THROW(backend->matmul(x, w, nullptr, wrong_out), Error);
  Tensor bad_bias = random_f32({4}, 10);
  EXPECT_THROW(backend->matmul(x, w, &bad_bias, out), Error);
  Tensor int_weight = Tensor::zeros({3, 8}, DType::I32);
  try {
    backend->matmul(x, int_weight, nullptr, out);
    FAIL() << "an I32 weight was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("weight has dtype I32"), std::string::npos) << error.what();
  }
}

// The default matmul_group (backend.cpp) is one matmul per product; more than kMaxMatmulGroup
// products (or none) is an error that names the op.
TEST(CpuMatmul, GroupEqualsOneMatmulPerProductAndRejectsTooManyProducts) {
  auto backend = make_cpu_backend();
  const Tensor x = random_f32({3, 40}, 21);
  const Weight w0 = random_f32({24, 40}, 22), w1 = random_f32({8, 40}, 23);
  const Tensor bias1 = random_f32({8}, 24);
  Tensor grouped0 = Tensor::empty({3, 24}, DType::F32), grouped1 = Tensor::empty({3, 8}, DType::F32);
  Tensor alone0 = Tensor::empty({3, 24}, DType::F32), alone1 = Tensor::empty({3, 8}, DType::F32);
  const MatmulTarget targets[] = {{&w0, nullptr, &grouped0}, {&w1, &bias1, &grouped1}};
  backend->matmul_group(x, targets);
  backend->matmul(x, w0, nullptr, alone0);
  backend->matmul(x, w1, &bias1, alone1);
  EXPECT_TRUE(same_bits(grouped0.data<float>(), alone0.data<float>(), grouped0.numel()));
  EXPECT_TRUE(same_bits(grouped1.data<float>(), alone1.data<float>(), grouped1.numel()));
  const std::vector<MatmulTarget> too_many(kMaxMatmulGroup + 1, MatmulTarget{&w0, nullptr, &grouped0});
  try {
    backend->matmul_group(x, too_many);
    FAIL() << "a group of " << too_many.size() << " products was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("matmul_group: 5 products, it takes 1 to 4"), std::string::npos)
        << error.what();
  }
}

// ---------------------------------------------------------------------------------------------
// quantized matmul: bit-identical to the dense f32 matmul of decode_rows' weights (core/weight.h)

// The quantized weight's rows decoded to a dense f32 [N, K] tensor.
Tensor decoded(const Weight& w) {
  Tensor dense = Tensor::empty({w.dim(0), w.dim(1)}, DType::F32);
  decode_rows(w, 0, w.dim(0), dense.data<float>());
  return dense;
}

Tensor random_affine_codes(int64_t n, int64_t k, int bits, uint32_t seed) {
  Tensor words = Tensor::empty({n, k * bits / 32}, DType::U32);
  std::mt19937 rng(seed);
  for (int64_t i = 0; i < words.numel(); ++i) words.data<uint32_t>()[i] = static_cast<uint32_t>(rng());
  return words;
}

// Every e4m3 byte but the two NaNs, whose payloads no order of operations promises to keep.
Tensor random_fp8(int64_t n, int64_t k, uint32_t seed) {
  Tensor values = Tensor::empty({n, k}, DType::F8E4M3);
  std::mt19937 rng(seed);
  for (int64_t i = 0; i < values.numel(); ++i) {
    uint8_t byte = static_cast<uint8_t>(rng());
    if ((byte & 0x7f) == 0x7f) byte ^= 1;
    values.data<uint8_t>()[i] = byte;
  }
  return values;
}

// out of the quantized w on `isa` against the dense f32 matmul of its decoded rows, for 1, 3 and
// 17 rows of x (tiles of every height), with and without a bias.
void expect_decoded_bits(Backend& backend, const Weight& w, uint32_t seed) {
  const Tensor dense = decoded(w);
  const int64_t n = w.dim(0), k = w.dim(1);
  const Tensor bias = random_f32({n}, seed + 1);
  for (int64_t rows : {1, 3, 17}) {
    const Tensor x = random_f32({rows, k}, seed + 2);
    for (const Tensor* with_bias : {static_cast<const Tensor*>(nullptr), &bias}) {
      Tensor quantized_out = Tensor::empty({rows, n}, DType::F32), dense_out = Tensor::empty({rows, n}, DType::F32);
      backend.matmul(x, w, with_bias, quantized_out);
      backend.matmul(x, dense, with_bias, dense_out);
      EXPECT_TRUE(same_bits(quantized_out, dense_out)) << rows << " rows, bias " << (with_bias != nullptr);
    }
  }
}

TEST(CpuQuantizedMatmul, AffineEqualsDenseMatmulOfDecodedRowsBitForBit) {
  const int64_t n = 37, k = 384;  // n fills no tile width; k holds 3 to 12 groups
  uint32_t seed = 100;
  for (CpuIsa isa : supported_isas()) {
    auto backend = cpu::make_cpu_backend(isa);
    for (int bits : {2, 3, 4, 5, 6, 8})
      for (int group : {32, 64, 128})
        for (DType scale_dtype : {DType::BF16, DType::F16, DType::F32}) {
          SCOPED_TRACE(isa_label(isa) + " " + std::to_string(bits) + "-bit group " + std::to_string(group) +
                       " scales " + std::string(dtype_name(scale_dtype)));
          seed += 3;
          const Weight w = Weight::affine(random_affine_codes(n, k, bits, seed),
                                          random_weight({n, k / group}, scale_dtype, seed + 1, -0.05f, 0.05f),
                                          random_weight({n, k / group}, scale_dtype, seed + 2, -0.5f, 0.5f), bits, group);
          expect_decoded_bits(*backend, w, seed);
        }
  }
}

TEST(CpuQuantizedMatmul, Fp8BlocksEqualDenseMatmulOfDecodedRowsBitForBit) {
  // k = 200 leaves partial scale blocks and a partial final block of every block_k; block columns
  // of 48 are no multiple of 32 and take the decode-then-f32 path.
  const int64_t n = 37, k = 200;
  const int blocks[][2] = {{128, 128}, {16, 32}, {7, 64}, {5, 48}};
  uint32_t seed = 300;
  for (CpuIsa isa : supported_isas()) {
    auto backend = cpu::make_cpu_backend(isa);
    for (const auto& block : blocks)
      for (DType scale_dtype : {DType::F32, DType::BF16}) {
        SCOPED_TRACE(isa_label(isa) + " blocks " + std::to_string(block[0]) + "x" + std::to_string(block[1]) +
                     " scales " + std::string(dtype_name(scale_dtype)));
        seed += 3;
        const Shape scale_shape{(n + block[0] - 1) / block[0], (k + block[1] - 1) / block[1]};
        const Weight w = Weight::fp8_block(random_fp8(n, k, seed), random_weight(scale_shape, scale_dtype, seed + 1, -0.01f, 0.01f),
                                           block[0], block[1]);
        expect_decoded_bits(*backend, w, seed);
      }
  }
}

TEST(CpuQuantizedMatmul, SameBitsForAnyThreadCount) {
  const int64_t rows = 5, n = 61, k = 256;
  const Weight weights[] = {
      Weight::affine(random_affine_codes(n, k, 4, 401), random_weight({n, 4}, DType::BF16, 402, -0.05f, 0.05f),
                     random_weight({n, 4}, DType::BF16, 403, -0.5f, 0.5f), 4, 64),
      Weight::affine(random_affine_codes(n, k, 8, 404), random_weight({n, 8}, DType::F16, 405, -0.05f, 0.05f),
                     random_weight({n, 8}, DType::F16, 406, -0.5f, 0.5f), 8, 32),
      Weight::affine(random_affine_codes(n, k, 3, 407), random_weight({n, 8}, DType::F32, 408, -0.05f, 0.05f),
                     random_weight({n, 8}, DType::F32, 409, -0.5f, 0.5f), 3, 32),
      Weight::fp8_block(random_fp8(n, k - 7, 410), random_weight({1, 2}, DType::F32, 411, -0.01f, 0.01f), 128, 128)};
  for (CpuIsa isa : supported_isas()) {
    auto backend = cpu::make_cpu_backend(isa);
    for (const Weight& w : weights) {
      SCOPED_TRACE(isa_label(isa) + " " + w.describe());
      const Tensor x = random_f32({rows, w.dim(1)}, 412);
      Tensor one_thread = Tensor::empty({rows, n}, DType::F32);
      {
        GlobalThreads one(1);
        backend->matmul(x, w, nullptr, one_thread);
      }
      for (int threads : {2, 3}) {
        GlobalThreads scope(threads);
        Tensor out = Tensor::empty({rows, n}, DType::F32);
        backend->matmul(x, w, nullptr, out);
        EXPECT_TRUE(same_bits(out, one_thread)) << threads << " threads";
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// rms_norm / add_rms_norm

TEST(CpuNorm, AddRmsNormEqualsAddThenNormBitForBit) {
  auto backend = make_cpu_backend();
  const Tensor x = random_f32({9, 100}, 13);
  const Tensor delta = random_f32({9, 100}, 14);
  const Tensor weight = random_weight({100}, DType::BF16, 15);
  Tensor residual = backend->download(x);
  Tensor fused = Tensor::empty({9, 100}, DType::F32);
  backend->add_rms_norm(residual, delta, weight, 1e-5f, NormStyle::ZeroCentred, fused);
  Tensor separate = backend->download(x);
  backend->add(separate, delta);
  EXPECT_TRUE(same_bits(residual, separate));
  Tensor normed = Tensor::empty({9, 100}, DType::F32);
  backend->rms_norm(separate, weight, 1e-5f, NormStyle::ZeroCentred, normed);
  EXPECT_TRUE(same_bits(fused, normed));
}

TEST(CpuNorm, RowsAreBitIdenticalAloneInABatchAndForAnyThreadCount) {
  auto backend = make_cpu_backend();
  const Tensor x = random_f32({40, 4, 64}, 16);
  const Tensor weight = random_weight({64}, DType::F32, 17);
  Tensor full = Tensor::empty({40, 4, 64}, DType::F32);
  {
    GlobalThreads one(1);
    backend->rms_norm(x, weight, 1e-6f, NormStyle::Plain, full);
  }
  for (int threads : {2, 3}) {
    GlobalThreads scope(threads);
    Tensor again = Tensor::empty({40, 4, 64}, DType::F32);
    backend->rms_norm(x, weight, 1e-6f, NormStyle::Plain, again);
    EXPECT_TRUE(same_bits(full, again)) << threads << " threads";
  }
  Tensor alone = Tensor::empty({1, 4, 64}, DType::F32);
  backend->rms_norm(x.slice_rows(21, 1), weight, 1e-6f, NormStyle::Plain, alone);
  EXPECT_TRUE(same_bits(alone.data<float>(), full.data<float>() + 21 * 4 * 64, 4 * 64));
}

TEST(CpuNorm, WorksInPlaceAndRejectsAWrongWidth) {
  auto backend = make_cpu_backend();
  const Tensor x = random_f32({3, 2, 16}, 18);
  const Tensor weight = random_weight({16}, DType::F32, 19);
  Tensor expected = Tensor::empty({3, 2, 16}, DType::F32);
  backend->rms_norm(x, weight, 1e-6f, NormStyle::Plain, expected);
  Tensor in_place = backend->download(x);
  backend->rms_norm(in_place, weight, 1e-6f, NormStyle::Plain, in_place);
  EXPECT_TRUE(same_bits(expected, in_place));
  const Tensor wide_weight = random_weight({32}, DType::F32, 20);
  EXPECT_THROW(backend->rms_norm(x, wide_weight, 1e-6f, NormStyle::Plain, expected), Error);
}

// ---------------------------------------------------------------------------------------------
// rope, swiglu, embedding, gather_rows

TEST(CpuRope, RejectsAnOddRotaryDim) {
  auto backend = make_cpu_backend();
  Tensor x = random_f32({1, 1, 8}, 22);
  Tensor inv_freq = random_f32({3}, 23);
  EXPECT_THROW(backend->rope(x, i32_tensor({0}), inv_freq, 7), Error);
}

TEST(CpuElementwise, SwigluRejectsInputsOfOtherSizes) {
  auto backend = make_cpu_backend();
  const Tensor gate = random_f32({7, 133}, 24, -100.0f, 100.0f);
  Tensor out = Tensor::empty({7, 133}, DType::F32);
  Tensor short_up = random_f32({7, 132}, 26);
  EXPECT_THROW(backend->swiglu(gate, short_up, out), Error);
}

TEST(CpuEmbedding, NamesABadId) {
  auto backend = make_cpu_backend();
  const Tensor table = random_weight({11, 37}, DType::BF16, 28);
  Tensor out = Tensor::empty({2, 37}, DType::F32);
  for (int32_t bad : {11, -1}) {
    try {
      backend->embedding(table, i32_tensor({1, bad}), out);
      FAIL() << "id " << bad << " was accepted";
    } catch (const Error& error) {
      const std::string message = error.what();
      EXPECT_NE(message.find("token id " + std::to_string(bad)), std::string::npos) << message;
      EXPECT_NE(message.find("11 tokens"), std::string::npos) << message;
    }
  }
}

TEST(CpuGatherRows, RejectsARowOutsideX) {
  auto backend = make_cpu_backend();
  const Tensor x = random_f32({6, 5}, 29);
  Tensor out = Tensor::empty({3, 5}, DType::F32);
  EXPECT_THROW(backend->gather_rows(x, i32_tensor({0, 6, 1}), out), Error);
}

// ---------------------------------------------------------------------------------------------
// layout, kv_write, attention

TEST(CpuLayout, FillsPositionsAndSlotsFromSpans) {
  auto backend = make_cpu_backend();
  // Spans may be listed in any order; together they tile the batch.
  const BatchLayout layout = backend->make_layout({{2, 3, 2, 40}, {0, 0, 3, 0}}, {7, 8, 9, 10, 11});
  EXPECT_EQ(layout.total_tokens, 5);
  const std::vector<int32_t> positions(layout.positions.data<int32_t>(), layout.positions.data<int32_t>() + 5);
  const std::vector<int32_t> slots(layout.slots.data<int32_t>(), layout.slots.data<int32_t>() + 5);
  EXPECT_EQ(positions, (std::vector<int32_t>{0, 1, 2, 40, 41}));
  EXPECT_EQ(slots, (std::vector<int32_t>{0, 0, 0, 2, 2}));
  EXPECT_EQ(layout.token_ids.data<int32_t>()[4], 11);
  EXPECT_EQ(layout.spans_device.shape(), (Shape{2, 4}));
  EXPECT_EQ(layout.spans_device.data<int32_t>()[3], 40);
}

TEST(CpuLayout, RejectsGapsOverlapsRepeatedSlotsAndNegativeFields) {
  auto backend = make_cpu_backend();
  const std::vector<int32_t> ids = {1, 2, 3, 4};
  auto error_of = [&](const std::vector<SequenceSpan>& spans) -> std::string {
    try {
      backend->make_layout(spans, ids);
    } catch (const Error& error) {
      return error.what();
    }
    return "";
  };
  EXPECT_NE(error_of({{0, 0, 2, 0}, {1, 3, 1, 0}}).find("starts at token 3"), std::string::npos);  // gap
  EXPECT_NE(error_of({{0, 0, 3, 0}, {1, 2, 2, 0}}).find("starts at token 2"), std::string::npos);  // overlap
  EXPECT_NE(error_of({{0, 0, 2, 0}, {1, 2, 1, 0}}).find("cover 3 tokens"), std::string::npos);  // short
  EXPECT_NE(error_of({{0, 0, 2, 0}, {0, 2, 2, 5}}).find("slot 0 appears"), std::string::npos);
  EXPECT_NE(error_of({{0, 0, 4, -1}}).find("first position >= 0"), std::string::npos);
  EXPECT_NE(error_of({{-1, 0, 4, 0}}).find("needs a slot"), std::string::npos);
}

// A sequence for the attention tests: its q and k/v rows, and where it sits in a cache.
struct Sequence {
  int32_t slot;
  int32_t length;
};

struct AttentionShape {
  int64_t heads, kv_heads, head_dim;
};

// Writes every token's k/v rows, then runs attention for all of them in one batch.
Tensor run_attention(Backend& backend, const AttentionShape& shape, const std::vector<Sequence>& sequences,
                     const std::vector<Tensor>& q, const std::vector<Tensor>& k, const std::vector<Tensor>& v,
                     const KvCacheView& cache) {
  std::vector<SequenceSpan> spans;
  int32_t total = 0;
  for (const Sequence& sequence : sequences) {
    spans.push_back({sequence.slot, total, sequence.length, 0});
    total += sequence.length;
  }
  const BatchLayout layout = backend.make_layout(spans, std::vector<int32_t>(static_cast<size_t>(total), 0));
  Tensor q_all = Tensor::empty({total, shape.heads, shape.head_dim}, DType::F32);
  Tensor k_all = Tensor::empty({total, shape.kv_heads, shape.head_dim}, DType::F32);
  Tensor v_all = Tensor::empty({total, shape.kv_heads, shape.head_dim}, DType::F32);
  int64_t row = 0;
  for (size_t s = 0; s < sequences.size(); ++s) {
    std::memcpy(q_all.data<float>() + row * shape.heads * shape.head_dim, q[s].raw(), q[s].nbytes());
    std::memcpy(k_all.data<float>() + row * shape.kv_heads * shape.head_dim, k[s].raw(), k[s].nbytes());
    std::memcpy(v_all.data<float>() + row * shape.kv_heads * shape.head_dim, v[s].raw(), v[s].nbytes());
    row += sequences[s].length;
  }
  backend.kv_write(k_all, v_all, layout, cache);
  Tensor out = Tensor::empty({total, shape.heads, shape.head_dim}, DType::F32);
  backend.attention(q_all, cache, layout, 1.0f / std::sqrt(float(shape.head_dim)), out);
  return out;
}

// GQA ratios 1, 2, 3, 4, 5, 8; head sizes with and without a remainder of 16 lanes.
const std::vector<AttentionShape> kAttentionShapes = {{4, 4, 8},  {4, 2, 16}, {8, 2, 64}, {4, 1, 128},
                                                      {6, 2, 24}, {10, 2, 40}, {8, 1, 80}};

TEST(CpuAttention, ASequenceGivesTheSameBitsAloneInABatchOneTokenAtATimeAndOnAnyThreads) {
  auto backend = make_cpu_backend();
  for (const AttentionShape& shape : kAttentionShapes) {
    SCOPED_TRACE("heads " + std::to_string(shape.heads) + " kv " + std::to_string(shape.kv_heads) + " dh " +
                 std::to_string(shape.head_dim));
    const int32_t length = 37;
    const Tensor q = random_f32({length, shape.heads, shape.head_dim}, 60);
    const Tensor k = random_f32({length, shape.kv_heads, shape.head_dim}, 61);
    const Tensor v = random_f32({length, shape.kv_heads, shape.head_dim}, 62);
    Tensor alone;
    {
      GlobalThreads one(1);
      TestKvCache cache(*backend, 4, 64, shape.kv_heads, shape.head_dim, false);
      alone = run_attention(*backend, shape, {{0, length}}, {q}, {k}, {v}, cache.view());
    }
    // In a batch of three sequences of other lengths, in another slot and at another batch offset.
    std::vector<Tensor> qs = {random_f32({5, shape.heads, shape.head_dim}, 63), q,
                              random_f32({50, shape.heads, shape.head_dim}, 64)};
    std::vector<Tensor> ks = {random_f32({5, shape.kv_heads, shape.head_dim}, 65), k,
                              random_f32({50, shape.kv_heads, shape.head_dim}, 66)};
    std::vector<Tensor> vs = {random_f32({5, shape.kv_heads, shape.head_dim}, 67), v,
                              random_f32({50, shape.kv_heads, shape.head_dim}, 68)};
    const int64_t row_width = shape.heads * shape.head_dim;
    for (int threads : {1, 2, 3}) {
      GlobalThreads scope(threads);
      TestKvCache batch_cache(*backend, 4, 64, shape.kv_heads, shape.head_dim, true);
      const Tensor batched =
          run_attention(*backend, shape, {{3, 5}, {2, length}, {0, 50}}, qs, ks, vs, batch_cache.view());
      EXPECT_TRUE(same_bits(alone.data<float>(), batched.data<float>() + 5 * row_width, length * row_width))
          << threads << " threads";
    }
    // Decode: the same sequence appended one token per step into a fresh slot.
    TestKvCache step_cache(*backend, 4, 64, shape.kv_heads, shape.head_dim, true);
    for (int32_t t = 0; t < length; ++t) {
      const BatchLayout layout = backend->make_layout({{1, 0, 1, t}}, {0});
      backend->kv_write(k.slice_rows(t, 1), v.slice_rows(t, 1), layout, step_cache.view());
      Tensor out = Tensor::empty({1, shape.heads, shape.head_dim}, DType::F32);
      backend->attention(q.slice_rows(t, 1), step_cache.view(), layout, 1.0f / std::sqrt(float(shape.head_dim)), out);
      ASSERT_TRUE(same_bits(out.data<float>(), alone.data<float>() + t * row_width, row_width)) << "token " << t;
    }
  }
}

// A sequence whose blocks are scattered over the pool attends to the bits of the same sequence in
// contiguous blocks: prefill across several blocks, and decode steps at and around block edges.
TEST(CpuAttention, ScatteredBlocksGiveTheBitsOfContiguousOnes) {
  auto backend = make_cpu_backend();
  const AttentionShape shape{8, 2, 40};
  const int32_t length = 200;  // blocks 0..3, the last partial
  const Tensor q = random_f32({length, shape.heads, shape.head_dim}, 80);
  const Tensor k = random_f32({length, shape.kv_heads, shape.head_dim}, 81);
  const Tensor v = random_f32({length, shape.kv_heads, shape.head_dim}, 82);
  TestKvCache contiguous(*backend, 3, 256, shape.kv_heads, shape.head_dim, false);
  TestKvCache scattered(*backend, 3, 256, shape.kv_heads, shape.head_dim, true);
  const Tensor expected = run_attention(*backend, shape, {{1, length}}, {q}, {k}, {v}, contiguous.view());
  EXPECT_TRUE(same_rows(run_attention(*backend, shape, {{1, length}}, {q}, {k}, {v}, scattered.view()), 0, expected, 0,
                        length));
  const int64_t row_width = shape.heads * shape.head_dim;
  for (int32_t t : {63, 64, 127, 128, 199}) {
    const BatchLayout layout = backend->make_layout({{1, 0, 1, t}}, {0});
    Tensor out = Tensor::empty({1, shape.heads, shape.head_dim}, DType::F32);
    backend->attention(q.slice_rows(t, 1), scattered.view(), layout, 1.0f / std::sqrt(float(shape.head_dim)), out);
    EXPECT_TRUE(same_bits(out.data<float>(), expected.data<float>() + t * row_width, row_width)) << "position " << t;
  }
}

// kv_write puts position p of slot s in row p % 64 of the block the table names for p / 64.
TEST(CpuKvWrite, WritesEachPositionToTheBlockItsTableEntryNames) {
  auto backend = make_cpu_backend();
  TestKvCache cache(*backend, 2, 192, 1, 4, true);
  const Tensor k = random_f32({130, 1, 4}, 83), v = random_f32({130, 1, 4}, 84);
  backend->kv_write(k, v, backend->make_layout({{1, 0, 130, 60}}, std::vector<int32_t>(130, 0)), cache.view());
  const int32_t* table = cache.block_table.data<int32_t>();
  for (int64_t t = 0; t < 130; ++t) {
    const int64_t position = 60 + t;
    const int64_t row = table[1 * 3 + position / 64] * 64 + position % 64;
    EXPECT_TRUE(same_rows(cache.keys.reshape({cache.keys.numel() / 4, 4}), row, k, t, 1)) << "position " << position;
    EXPECT_TRUE(same_rows(cache.values.reshape({cache.values.numel() / 4, 4}), row, v, t, 1))
        << "position " << position;
  }
}

TEST(CpuKvWrite, RejectsAPositionPastTheBlockTableNamingIt) {
  auto backend = make_cpu_backend();
  TestKvCache cache(*backend, 2, 64, 1, 4, false);
  const Tensor k = random_f32({2, 1, 4}, 70), v = random_f32({2, 1, 4}, 71);
  const BatchLayout layout = backend->make_layout({{1, 0, 2, 63}}, {0, 0});
  expect_error_mentions([&] { backend->kv_write(k, v, layout, cache.view()); },
                        {"span 0 reaches position 64", "64 positions per slot"});
  const BatchLayout bad_slot = backend->make_layout({{2, 0, 2, 0}}, {0, 0});
  EXPECT_THROW(backend->kv_write(k, v, bad_slot, cache.view()), Error);
}

// Block ids the CPU kernels would read outside the pool are refused, naming the op, slot, position
// and block: a write's own block, and every block an attention reads up to its position.
TEST(CpuKvWrite, RejectsABlockIdOutsideThePool) {
  auto backend = make_cpu_backend();
  TestKvCache cache(*backend, 2, 192, 1, 4, false);  // 2 · 3 + 3 blocks
  cache.block_table.data<int32_t>()[1 * 3 + 1] = 9;
  const Tensor k = random_f32({1, 1, 4}, 72), v = random_f32({1, 1, 4}, 73);
  expect_error_mentions([&] { backend->kv_write(k, v, backend->make_layout({{1, 0, 1, 70}}, {0}), cache.view()); },
                        {"cpu kv_write: slot 1 position 70 is in block 9 (block_table entry 1), but the pool has 9 "
                         "blocks"});
  backend->kv_write(k, v, backend->make_layout({{1, 0, 1, 20}}, {0}), cache.view());  // entry 0 is fine
  Tensor q = random_f32({1, 2, 4}, 74), out = Tensor::empty({1, 2, 4}, DType::F32);
  cache.block_table.data<int32_t>()[1 * 3 + 1] = -1;
  expect_error_mentions(
      [&] { backend->attention(q, cache.view(), backend->make_layout({{1, 0, 1, 150}}, {0}), 1.0f, out); },
      {"cpu attention: slot 1 position 64 is in block -1 (block_table entry 1)"});
}

// ---------------------------------------------------------------------------------------------
// memory

TEST(CpuMemory, UploadSharesStorageDownloadCopiesZeroClears) {
  auto backend = make_cpu_backend();
  EXPECT_EQ(backend->activation_dtype(), DType::F32);
  Tensor host = random_f32({3, 4}, 72);
  EXPECT_EQ(backend->upload(host).raw(), host.raw());
  Tensor copy = backend->download(host);
  EXPECT_NE(copy.raw(), host.raw());
  EXPECT_TRUE(same_bits(copy, host));
  backend->zero(host);
  for (int64_t i = 0; i < host.numel(); ++i) EXPECT_EQ(host.data<float>()[i], 0.0f);
  Tensor made = backend->alloc({5, 2}, DType::BF16);
  EXPECT_EQ(made.shape(), (Shape{5, 2}));
  EXPECT_EQ(made.dtype(), DType::BF16);
}

TEST(CpuMemory, MemoryComesFromMeminfoAndAMissingLineIsAnError) {
  std::istringstream meminfo("MemTotal:       32000000 kB\nMemFree:         1000 kB\nMemAvailable:   20000000 kB\n");
  const DeviceMemory memory = kiln::cpu::parse_meminfo(meminfo);
  EXPECT_EQ(memory.total, uint64_t{32000000} * 1024);
  EXPECT_EQ(memory.available, uint64_t{20000000} * 1024);
  std::istringstream without_available("MemTotal:       32000000 kB\nMemFree:         1000 kB\n");
  try {
    kiln::cpu::parse_meminfo(without_available);
    ADD_FAILURE() << "a meminfo without MemAvailable was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("no MemAvailable or MemTotal line"), std::string::npos) << error.what();
  }
  // The machine's own /proc/meminfo has both, and no more is available than there is.
  const DeviceMemory machine = make_cpu_backend()->memory();
  EXPECT_GT(machine.available, 0u);
  EXPECT_LE(machine.available, machine.total);
}

// A slot's rows copied out and back (speculative decoding's rollback of a recurrent state) keep
// every byte, a negative zero and a NaN's payload included; copy refuses another dtype or size.
TEST(CpuBackend, CopyKeepsEveryByte) {
  auto backend = make_cpu_backend();
  Tensor states = Tensor::empty({3, 2, 4}, DType::F32);
  float* values = states.data<float>();
  for (int i = 0; i < 24; ++i) values[i] = static_cast<float>(i) * 0.37f - 3.0f;
  values[9] = -0.0f;
  const uint32_t payload_nan = 0x7fc12345u;
  std::memcpy(&values[10], &payload_nan, sizeof payload_nan);
  const Tensor original = backend->download(states);
  Tensor saved = backend->alloc({3, 2, 4}, DType::F32);
  Tensor saved_slot = saved.slice_rows(1, 1);
  backend->copy(states.slice_rows(1, 1), saved_slot);
  backend->zero(states);
  Tensor state_slot = states.slice_rows(1, 1);
  backend->copy(saved_slot, state_slot);
  EXPECT_EQ(std::memcmp(states.data<float>() + 8, original.data<float>() + 8, 8 * sizeof(float)), 0);
  Tensor other_dtype = Tensor::empty({1, 2, 4}, DType::I32);
  EXPECT_THROW(backend->copy(state_slot, other_dtype), Error);
  Tensor other_size = Tensor::empty({1, 2, 3}, DType::F32);
  EXPECT_THROW(backend->copy(state_slot, other_size), Error);
}

}  // namespace
