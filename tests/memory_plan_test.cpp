// The memory plan (engine/memory_plan.h) that `kiln fit` prints and `kiln serve` checks: each
// family's cache plan equals what make_cache allocates, and the verdict and the longest fitting
// context follow from the parts.
#include <gtest/gtest.h>

#include "core/error.h"
#include "engine/memory_plan.h"
#include "model/loader.h"
#include "profile_support.h"
#include "test_support.h"

using namespace kiln;

namespace {

TEST(MemoryPlan, EachFamilysCachePlanIsWhatMakeCacheAllocates) {
  KILN_REQUIRE_SHARED(shared);
  for (const char* family : {"llama3-tiny", "qwen3-tiny", "qwen3_5-text-tiny"}) {
    for (const char* dtype : {"f32", "bf16"}) {
      SCOPED_TRACE(std::string(family) + " " + dtype);
      const auto dir = shared / "fixtures/tiny" / family / dtype;
      auto backend = make_cpu_backend();
      const ModelPlan model_plan = plan_model(dir, Device::CPU, /*backend_present=*/true);
      const MemoryPlan plan = plan_memory(model_plan, *backend, std::nullopt, {3, 200, 64});
      EXPECT_EQ(plan.cache_slots, 3);  // the CPU backend runs no decode graphs
      EXPECT_EQ(plan.graph_scratch, 0u);
      EXPECT_EQ(plan.step_tokens, 3 * 64);
      auto model = build_model(model_plan, *backend);
      EXPECT_EQ(plan.cache, model->make_cache(plan.cache_slots, 200)->bytes());
      EXPECT_GT(plan.step_scratch, 0u);
      // The weights as stored: every planned tensor, none twice.
      uint64_t stored = 0;
      for (const PlannedTensor& planned : model_plan.load_plan.tensors)
        stored += model_plan.checkpoint.info(planned.source).nbytes;
      EXPECT_EQ(plan.weights, stored);
    }
  }
}

TEST(MemoryPlan, ConvertedWeightsArePlannedInTheLoadDtype) {
  KILN_REQUIRE_SHARED(shared);
  auto backend = make_cpu_backend();
  const ModelPlan bf16 = plan_model(shared / "fixtures/tiny/llama3-tiny/bf16", Device::CPU, true);
  const MemoryPlan as_stored = plan_memory(bf16, *backend, std::nullopt, {1, 64, 64});
  const MemoryPlan widened = plan_memory(bf16, *backend, DType::F32, {1, 64, 64});
  EXPECT_EQ(widened.weights, 2 * as_stored.weights);
}

TEST(MemoryPlan, TheVerdictAndTheLongestContextFollowFromTheParts) {
  KILN_REQUIRE_SHARED(shared);
  auto backend = make_cpu_backend();
  const ModelPlan model = plan_model(shared / "fixtures/tiny/qwen3-tiny/bf16", Device::CPU, true);
  const MemoryPlan small = plan_memory(model, *backend, std::nullopt, {2, 512, 256});
  EXPECT_TRUE(small.fits()) << describe_memory_plan(small, "cpu");
  EXPECT_NE(describe_memory_plan(small, "cpu").find("fits: 2 sequences of 512 tokens"), std::string::npos);

  // A context no machine holds: the cache alone is beyond the memory available.
  const MemoryRequest huge{4, int64_t{1} << 40, 256};
  const MemoryPlan too_big = plan_memory(model, *backend, std::nullopt, huge);
  EXPECT_FALSE(too_big.fits());
  EXPECT_GT(too_big.cache, too_big.memory.available);
  EXPECT_NE(describe_memory_plan(too_big, "cpu").find("does not fit"), std::string::npos);
  const int64_t longest = longest_fitting_context(model, *backend, std::nullopt, too_big);
  ASSERT_GT(longest, 0);
  // Judged against the memory too_big was judged by (what is available moves between readings).
  MemoryRequest at = huge;
  at.context = longest;
  EXPECT_LE(plan_memory(model, *backend, std::nullopt, at).total(), too_big.memory.available);
  at.context = longest + 1;
  EXPECT_GT(plan_memory(model, *backend, std::nullopt, at).total(), too_big.memory.available);
  // The cache grows linearly with the context: twice the sequences cost twice the cache.
  const MemoryPlan doubled = plan_memory(model, *backend, std::nullopt, {4, 512, 256});
  EXPECT_EQ(doubled.cache, 2 * small.cache);
}

TEST(MemoryPlan, ABadRequestIsAnError) {
  KILN_REQUIRE_SHARED(shared);
  auto backend = make_cpu_backend();
  const ModelPlan model = plan_model(shared / "fixtures/tiny/qwen3-tiny/bf16", Device::CPU, true);
  EXPECT_FAILS_MENTIONING(plan_memory(model, *backend, std::nullopt, {0, 64, 64}), "at least one sequence");
  EXPECT_FAILS_MENTIONING(plan_memory(model, *backend, std::nullopt, {1, 0, 64}), "context");
  EXPECT_FAILS_MENTIONING(plan_memory(model, *backend, std::nullopt, {1, 64, 0}), "prefill chunk must be positive");
}

}  // namespace
