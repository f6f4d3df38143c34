// Tensor parallelism on the CPU backend (N simulated ranks, model/tensor_parallel.h): logits of the
// split model against the unsplit one, bit-exact determinism for a fixed N, the shard loader, the
// configuration checks and the command line.
//
// The fixtures have 4 query heads and 2 KV heads: N = 2 splits both; N = 4 gives each rank one
// query head and replicates each KV head on two ranks. Their intermediate sizes (160, 128, 256)
// divide by 4. The Qwen3.5 fixtures have 2 GDN key heads (4 value heads): they split over N = 2.
#include <algorithm>
#include <cmath>
#include <cstring>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "parameter_name.h"
#include "core/error.h"
#include "engine/generation.h"
#include "io/npy.h"
#include "model/llama.h"
#include "model/qwen3_5.h"
#include "model/loader.h"
#include "model/tensor_parallel.h"
#include "model_test_support.h"
#include "prefix_cache_support.h"
#include "test_support.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

struct SplitModel {
  std::vector<std::unique_ptr<Backend>> backends;
  std::unique_ptr<Model> model;
};

SplitModel open_split_model(const std::filesystem::path& dir, int ranks, int threads_per_rank = 1) {
  SplitModel split;
  const ModelPlan plan = plan_model(dir, Device::CPU, /*backend_present=*/true);
  std::vector<Backend*> backends;
  for (int rank = 0; rank < ranks; ++rank) {
    split.backends.push_back(make_cpu_backend());
    backends.push_back(split.backends.back().get());
  }
  split.model = build_tensor_parallel_model(plan, backends, std::nullopt, threads_per_rank);
  return split;
}

// max_v |a[r, v] − b[r, v]| / max_v |b[r, v]| over every row r.
double worst_row_relative_difference(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  double worst = 0;
  const int64_t columns = b.dim(1);
  for (int64_t row = 0; row < b.dim(0); ++row) {
    double difference = 0, magnitude = 0;
    for (int64_t column = 0; column < columns; ++column) {
      const float x = a.data<float>()[row * columns + column], y = b.data<float>()[row * columns + column];
      difference = std::isnan(x) ? INFINITY : std::max<double>(difference, std::abs(x - y));
      magnitude = std::max<double>(magnitude, std::abs(y));
    }
    worst = std::max(worst, difference / magnitude);
  }
  return worst;
}

bool bit_identical(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

struct SplitCase {
  std::string fixture;
  int ranks;
};

void PrintTo(const SplitCase& split, std::ostream* out) { *out << split.fixture << " over " << split.ranks << " ranks"; }

std::string case_name(const ::testing::TestParamInfo<SplitCase>& info) {
  return parameter_name(info.param.fixture + "_tp" + std::to_string(info.param.ranks));
}

class TensorParallel : public ::testing::TestWithParam<SplitCase> {
 protected:
  void SetUp() override {
    fixture_ = fixtures_dir() / GetParam().fixture;
    prompt_ = fixture_prompt(fixture_);
  }
  std::filesystem::path fixture_;
  std::vector<int32_t> prompt_;
};

TEST_P(TensorParallel, F32LogitsMatchOneRankAtEveryPosition) {
  TestModel whole = open_cpu_model(fixture_ / "f32");
  SplitModel split = open_split_model(fixture_ / "f32", GetParam().ranks);
  const Tensor expected = prompt_logits(*whole.model, prompt_, 0);
  const Tensor actual = prompt_logits(*split.model, prompt_, 0);
  ASSERT_EQ(actual.dim(0), static_cast<int64_t>(prompt_.size()));
  // Splitting only regroups the o_proj / down_proj dot products into N partial sums.
  EXPECT_LE(worst_row_relative_difference(actual, expected), 1e-5);
  EXPECT_FALSE(bit_identical(actual, expected)) << "the split model must really sum partials (regrouped rounding)";
}

TEST_P(TensorParallel, Bf16IsNoFurtherFromTruthThanTransformersBf16) {
  SplitModel split = open_split_model(fixture_ / "bf16", GetParam().ranks);
  const Tensor logits = prompt_logits(*split.model, prompt_, 0);
  const auto [ours, theirs] = bf16_row_errors(logits, fixture_ / "bf16");
  for (size_t row = 0; row < ours.size(); ++row)
    ASSERT_LE(ours[row], 1.5 * theirs[row]) << "position " << row << " (transformers bf16 error " << theirs[row] << ")";
}

TEST_P(TensorParallel, BitIdenticalAcrossRunsChunkingAndBatchComposition) {
  SplitModel split = open_split_model(fixture_ / "bf16", GetParam().ranks, /*threads_per_rank=*/2);
  Model& model = *split.model;
  const std::vector<int32_t> first(prompt_.begin(), prompt_.begin() + 100);
  const AloneAndBatched runs = alone_and_in_a_batch_of_three(model, prompt_);
  const Tensor& alone_prefill = runs.alone_prefill;
  EXPECT_TRUE(bit_identical(alone_prefill, runs.batched_prefill)) << "prefill in a batch of 3";
  EXPECT_TRUE(bit_identical(runs.alone_decode, runs.batched_decode)) << "decode in a batch of 3";

  // A second run on a fresh cache, prefilled in two chunks (split at 64: GDN chunks are aligned
  // to absolute multiples of 64).
  auto again_cache = model.make_cache(1, 128);
  const Tensor again_head =
      run_step(model, *again_cache, {SequenceStep{0, 0, std::vector<int32_t>(first.begin(), first.begin() + 64), true}});
  const Tensor again_tail =
      run_step(model, *again_cache, {SequenceStep{0, 64, std::vector<int32_t>(first.begin() + 64, first.end()), true}});
  const Tensor again_decode = run_step(model, *again_cache, {SequenceStep{0, 100, {prompt_[100]}, true}});
  EXPECT_TRUE(bit_identical(again_head, alone_prefill.slice_rows(0, 64))) << "chunked prefill, first chunk";
  EXPECT_TRUE(bit_identical(again_tail, alone_prefill.slice_rows(64, 36))) << "chunked prefill, second chunk";
  EXPECT_TRUE(bit_identical(again_decode, runs.alone_decode)) << "second run decode";

  // A freshly built split model (its own threads, pools and collective) gives the same bits.
  SplitModel rebuilt = open_split_model(fixture_ / "bf16", GetParam().ranks, /*threads_per_rank=*/1);
  auto rebuilt_cache = rebuilt.model->make_cache(1, 128);
  EXPECT_TRUE(bit_identical(run_step(*rebuilt.model, *rebuilt_cache, {SequenceStep{0, 0, first, true}}), alone_prefill))
      << "rebuilt model";
}

TEST_P(TensorParallel, AFailedStepFailsWithItsErrorAndTheModelStaysUsable) {
  SplitModel split = open_split_model(fixture_ / "f32", GetParam().ranks);
  Model& model = *split.model;
  const std::vector<int32_t> tokens(prompt_.begin(), prompt_.begin() + 20);
  auto cache = model.make_cache(1, 32);
  const Tensor before = run_step(model, *cache, {SequenceStep{0, 0, tokens, true}});
  try {
    run_step(model, *cache, {SequenceStep{0, 0, {1, 99999}, true}});
    ADD_FAILURE() << "a token outside the vocabulary was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("token id 99999"), std::string::npos) << error.what();
  }
  EXPECT_TRUE(bit_identical(run_step(model, *cache, {SequenceStep{0, 0, tokens, true}}), before));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, TensorParallel,
                         ::testing::Values(SplitCase{"llama3-tiny", 2}, SplitCase{"llama3-tiny", 4},
                                           SplitCase{"qwen3-tiny", 2}, SplitCase{"qwen3-tiny", 4},
                                           SplitCase{"qwen3_5-text-tiny", 2}, SplitCase{"qwen3_5-vl-tiny", 2}),
                         case_name);

// A hybrid split model's prefix snapshots: each rank keeps its heads' part under the same entry,
// and a snapshot put back into another slot gives the split model's one-shot logits bit for bit.
TEST(TensorParallelSnapshots, EachRankKeepsItsPartOfASnapshot) {
  const auto fixture = fixtures_dir() / "qwen3_5-text-tiny";
  SplitModel split = open_split_model(fixture / "f32", 2);
  expect_a_snapshot_resumes_with_the_one_shot_logits(*split.model, fixture_prompt(fixture));
}

TEST(TensorParallelShards, EachRankHoldsOnlyItsRowsAndColumns) {
  const ModelPlan plan = plan_model(fixtures_dir() / "llama3-tiny/f32", Device::CPU, true);
  const ModelConfig& config = plan.config;
  const Tensor q_full = plan.checkpoint.view("model.layers.1.self_attn.q_proj.weight");
  const Tensor k_full = plan.checkpoint.view("model.layers.1.self_attn.k_proj.weight");
  const Tensor o_full = plan.checkpoint.view("model.layers.1.self_attn.o_proj.weight");
  const Tensor down_full = plan.checkpoint.view("model.layers.1.mlp.down_proj.weight");
  const Tensor norm_full = plan.checkpoint.view("model.layers.1.input_layernorm.weight");
  const int64_t hidden = config.hidden_size, head_dim = config.head_dim;
  for (int ranks : {2, 4}) {
    for (int index = 0; index < ranks; ++index) {
      const TensorParallelRank rank{index, ranks, nullptr};
      WeightMap weights(plan.checkpoint, plan.load_plan);
      weights.shard([&](const std::string& canonical, const Shape& shape) {
        return llama_tensor_shard(config, rank, canonical, shape);
      });
      const int64_t heads = config.num_attention_heads / ranks;
      const int64_t ffn = config.intermediate_size / ranks;
      // Query rows: a zero-copy view of exactly this rank's heads in the mapped file.
      const Tensor q = weights.take("model.layers.1.self_attn.q_proj.weight", {heads * head_dim, hidden});
      EXPECT_EQ(q.raw(), q_full.slice_rows(index * heads * head_dim, heads * head_dim).raw());
      // KV rows: with 2 KV heads, 4 ranks hold KV head rank / 2 (replicated on two ranks).
      const int64_t kv_head = ranks == 2 ? index : index / 2;
      const Tensor k = weights.take("model.layers.1.self_attn.k_proj.weight", {head_dim, hidden});
      EXPECT_EQ(k.raw(), k_full.slice_rows(kv_head * head_dim, head_dim).raw());
      // Columns: a copy holding only this rank's input columns of every row.
      const Tensor o = weights.take("model.layers.1.self_attn.o_proj.weight", {hidden, heads * head_dim});
      const Tensor down = weights.take("model.layers.1.mlp.down_proj.weight", {hidden, ffn});
      for (int64_t row = 0; row < hidden; ++row) {
        ASSERT_EQ(std::memcmp(o.data<float>() + row * heads * head_dim,
                              o_full.data<float>() + row * o_full.dim(1) + index * heads * head_dim,
                              heads * head_dim * sizeof(float)), 0) << "o_proj row " << row;
        ASSERT_EQ(std::memcmp(down.data<float>() + row * ffn, down_full.data<float>() + row * down_full.dim(1) + index * ffn,
                              ffn * sizeof(float)), 0) << "down_proj row " << row;
      }
      // Replicated: the whole tensor, still the mapped bytes.
      EXPECT_EQ(weights.take("model.layers.1.input_layernorm.weight", {hidden}).raw(), norm_full.raw());
    }
  }
}

TEST(TensorParallelShards, GatedDeltaNetRanksHoldTheirKeyHeadsWithTheirValueHeads) {
  const ModelPlan plan = plan_model(fixtures_dir() / "qwen3_5-text-tiny/f32", Device::CPU, true);
  const ModelConfig& config = plan.config;
  const int64_t key_dim = config.linear_key_head_dim, value_dim = config.linear_value_head_dim;
  const int64_t key_width = config.linear_num_key_heads * key_dim;
  const int64_t hidden = config.hidden_size;
  const std::string qkv_name = "model.layers.0.linear_attn.in_proj_qkv.weight";
  WeightMap whole(plan.checkpoint, plan.load_plan);
  const Tensor qkv_full = whole.take(qkv_name, {2 * key_width + config.linear_num_value_heads * value_dim, hidden});
  const Tensor a_log_full = whole.take("model.layers.0.linear_attn.A_log", {config.linear_num_value_heads});
  for (int index = 0; index < 2; ++index) {
    const TensorParallelRank rank{index, 2, nullptr};
    WeightMap weights(plan.checkpoint, plan.load_plan);
    weights.shard([&](const std::string& canonical, const Shape& shape) {
      return qwen3_5_tensor_shard(config, rank, canonical, shape);
    });
    const int64_t key_heads = config.linear_num_key_heads / 2, value_heads = config.linear_num_value_heads / 2;
    const Tensor qkv = weights.take(qkv_name, {2 * key_heads * key_dim + value_heads * value_dim, hidden});
    const size_t row_bytes = hidden * sizeof(float);
    // [q rows of its key heads | k rows of its key heads | v rows of its value heads]
    const int64_t sources[] = {index * key_heads * key_dim, key_width + index * key_heads * key_dim,
                               2 * key_width + index * value_heads * value_dim};
    const int64_t counts[] = {key_heads * key_dim, key_heads * key_dim, value_heads * value_dim};
    int64_t row = 0;
    for (int block = 0; block < 3; ++block)
      for (int64_t offset = 0; offset < counts[block]; ++offset, ++row)
        ASSERT_EQ(std::memcmp(qkv.data<float>() + row * hidden, qkv_full.data<float>() + (sources[block] + offset) * hidden,
                              row_bytes), 0) << "rank " << index << " in_proj_qkv row " << row;
    const Tensor a_log = weights.take("model.layers.0.linear_attn.A_log", {value_heads});
    EXPECT_EQ(std::memcmp(a_log.raw(), a_log_full.data<float>() + index * value_heads, value_heads * sizeof(float)), 0);
  }
}

TEST(TensorParallelShards, RowAndColumnRangesOutsideTheTensorFailNamingIt) {
  const ModelPlan plan = plan_model(fixtures_dir() / "llama3-tiny/f32", Device::CPU, true);
  for (const TensorShard& shard : {TensorShard{TensorShard::Axis::Rows, {RowBlock{60, 8}}},
                                   TensorShard{TensorShard::Axis::Columns, {}, 60, 8}}) {
    WeightMap weights(plan.checkpoint, plan.load_plan);
    try {
      weights.shard([&](const std::string& canonical, const Shape&) {
        return canonical == "model.layers.0.self_attn.q_proj.weight" ? shard : TensorShard{};
      });
      ADD_FAILURE() << "an out-of-range shard was accepted";
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find("model.layers.0.self_attn.q_proj.weight"), std::string::npos) << error.what();
    }
  }
}

std::string error_of(const std::function<void()>& action) {
  try {
    action();
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

TEST(TensorParallelChecks, IndivisibleConfigsFailNamingTheFieldAndN) {
  ModelConfig config;
  config.num_attention_heads = 4;
  config.num_key_value_heads = 2;
  config.intermediate_size = 160;
  EXPECT_EQ(error_of([&] { check_llama_tensor_parallel(config, 2); }), "");
  EXPECT_EQ(error_of([&] { check_llama_tensor_parallel(config, 4); }), "");
  EXPECT_EQ(error_of([&] { check_llama_tensor_parallel(config, 3); }),
            "tensor parallelism over 3 ranks: num_attention_heads = 4 is not divisible by 3");
  EXPECT_EQ(error_of([&] { check_llama_tensor_parallel(config, 0); }), "tensor parallelism needs at least 1 rank, got 0");
  config.num_attention_heads = 12;
  config.num_key_value_heads = 3;
  EXPECT_EQ(error_of([&] { check_llama_tensor_parallel(config, 2); }),
            "tensor parallelism over 2 ranks: num_key_value_heads = 3 is neither divisible by 2 nor a divisor of it");
  config.num_key_value_heads = 4;
  config.intermediate_size = 162;
  EXPECT_EQ(error_of([&] { check_llama_tensor_parallel(config, 4); }),
            "tensor parallelism over 4 ranks: intermediate_size = 162 is not divisible by 4");
}

TEST(TensorParallelChecks, UnsplittableModelsFailBeforeLoading) {
  auto backend_a = make_cpu_backend(), backend_b = make_cpu_backend(), backend_c = make_cpu_backend();
  const ModelPlan llama = plan_model(fixtures_dir() / "llama3-tiny/f32", Device::CPU, true);
  EXPECT_EQ(error_of([&] { build_tensor_parallel_model(llama, {backend_a.get(), backend_b.get(), backend_c.get()}, std::nullopt, 1); }),
            "tensor parallelism over 3 ranks: num_attention_heads = 4 is not divisible by 3");
  auto backend_d = make_cpu_backend();
  const ModelPlan hybrid = plan_model(fixtures_dir() / "qwen3_5-text-tiny/f32", Device::CPU, true);
  EXPECT_EQ(error_of([&] {
              build_tensor_parallel_model(hybrid, {backend_a.get(), backend_b.get(), backend_c.get(), backend_d.get()},
                                          std::nullopt, 1);
            }),
            "tensor parallelism over 4 ranks: linear_num_key_heads = 2 is not divisible by 4");
  const ModelPlan quantized = plan_model(fixtures_dir() / "qwen3-mlx-tiny/q", Device::CPU, true);
  expect_error_mentions([&] { build_tensor_parallel_model(quantized, {backend_a.get(), backend_b.get()}, std::nullopt, 1); },
                        {"tensor parallelism over quantized weights (mlx) is not supported"});
}

TEST(TensorParallelCli, LogitsSplitOverTwoRanksMatchOneRank) {
  TempDir temp;
  const std::string model = (fixtures_dir() / "qwen3-tiny/f32").string();
  std::string ids = " --ids 1";
  for (int id = 2; id <= 100; ++id) ids += fmt::format(",{}", id);
  ids += " --prefill-chunk 64 --threads 2";
  const CommandResult whole = run_command(kiln_command("logits --model " + model + ids + " --out " + (temp.path() / "1.npy").string()));
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  const CommandResult split =
      run_command(kiln_command("logits --model " + model + ids + " --tensor-parallel 2 --out " + (temp.path() / "2.npy").string()));
  ASSERT_EQ(split.exit_code, 0) << split.output;
  const NpyArray expected = read_npy(temp.path() / "1.npy");
  const NpyArray actual = read_npy(temp.path() / "2.npy");
  ASSERT_EQ(actual.shape, expected.shape);
  Tensor actual_tensor = Tensor::empty(actual.shape, DType::F32);
  std::transform(actual.values.begin(), actual.values.end(), actual_tensor.data<float>(),
                 [](double v) { return static_cast<float>(v); });
  for (double error : row_relative_errors(actual_tensor, expected)) EXPECT_LE(error, 1e-5);
}

TEST(TensorParallelCli, CudaAndIndivisibleSplitsFailWithOneLine) {
  const std::string model = (fixtures_dir() / "llama3-tiny/f32").string();
  const FailingCommand cases[] = {
      {"generate --model " + model + " --ids 1 --device cuda --tensor-parallel 2",
       "--tensor-parallel 2 on cuda: NCCL tensor parallelism is not built yet"},
      {"generate --model " + model + " --ids 1 --tensor-parallel 3", "num_attention_heads = 4 is not divisible by 3"},
      {"generate --model " + model + " --ids 1 --tensor-parallel 0", "--tensor-parallel"},
  };
  for (const FailingCommand& command : cases) expect_one_line_error(command);
}

}  // namespace
