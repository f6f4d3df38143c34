// The memory plan on the GPU. The plan is a dry run made on the host (engine/memory_plan.h:
// the measuring backend standing in for CUDA); here the same work runs on the CUDA backend and
// each part of the plan is held to what the CUDA allocator really holds for it, for each family;
// and a served model's use of device memory stays inside the plan.
#include <cmath>
#include <cstdio>
#include <random>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "cuda_test_support.h"
#include "engine/decode_graph.h"
#include "engine/memory_plan.h"
#include "engine/scheduler.h"
#include "model/synth.h"
#include "test_support.h"

using namespace kiln;
using namespace kiln::testing;
using namespace std::chrono_literals;

namespace {

double mib(uint64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

// A part of the plan against the allocator's measure of it. The dry run follows the allocator
// block by block (the same requests, rounded and cached as device_allocator.cpp does), so the two
// are expected to be equal; the bar, 2 %, is what this holds them to.
void expect_planned(const char* part, uint64_t planned, uint64_t held) {
  const double margin = 0.02 * static_cast<double>(held);
  EXPECT_LE(std::abs(static_cast<double>(planned) - static_cast<double>(held)), margin)
      << part << ": planned " << planned << " bytes, the CUDA allocator holds " << held;
  std::printf("  %-13s planned %12llu  held %12llu bytes\n", part, static_cast<unsigned long long>(planned),
              static_cast<unsigned long long>(held));
}

// Plans `request` for the model in `dir` on the host, then runs the plan's work on CUDA with
// `activations` and compares each part with what the allocator holds after it.
void expect_the_allocator_holds_the_plan(const std::filesystem::path& dir, DType activations,
                                         const MemoryRequest& request) {
  auto backend = make_cuda_backend(0, activations);
  const auto held = [&] { return cuda_allocator_held_bytes(*backend); };
  const ModelPlan model_plan = plan_model(dir, Device::CUDA, /*backend_present=*/true);
  const uint64_t before_planning = held();
  const MemoryPlan plan = plan_memory(model_plan, *backend, std::nullopt, request);
  EXPECT_EQ(held(), before_planning) << "planning took device memory";
  ASSERT_TRUE(plan.steps_planned) << describe_memory_plan(plan, "cuda");
  std::printf("%s, %s activations, %lld x %lld tokens, %lld-token chunks:\n", dir.string().c_str(),
              std::string(dtype_name(activations)).c_str(), static_cast<long long>(request.sequences),
              static_cast<long long>(request.context), static_cast<long long>(request.prefill_chunk));

  uint64_t start = held();
  const std::unique_ptr<Model> model = build_model(model_plan, *backend);
  expect_planned("weights", plan.weights, held() - start);
  start = held();
  const std::unique_ptr<ModelCache> cache = model->make_cache(plan.cache_slots, request.context, engine_cache_blocks(request));
  expect_planned("cache", plan.cache, held() - start);
  start = held();
  cache->allocate_snapshots(request.prefix_snapshots);
  expect_planned("snapshots", plan.snapshots, held() - start);
  if (!cache->resumes_at_any_position() && request.prefix_snapshots > 0) {
    EXPECT_GT(plan.snapshots, 0u);
  }
  // The allocator gives nothing back (no request here comes near the device's memory), so what
  // it holds after a phase is that phase's peak.
  start = held();
  run_largest_step(*model, *cache, request);
  backend->synchronize();
  expect_planned("step scratch", plan.step_scratch, held() - start);
  start = held();
  {
    DecodeGraphs graphs(*model, *cache);
    capture_every_decode_graph(graphs, *cache);
    run_largest_step(*model, *cache, request);
    backend->synchronize();
    expect_planned("decode graphs", plan.graph_scratch, held() - start);
  }
  EXPECT_GT(plan.graph_scratch, 0u);
}

// llama-3.2-1b's shape with 4 of its 16 layers (a real vocabulary and widths, a quick load), written
// into `temp`; returns its folder.
std::filesystem::path write_four_layer_llama_1b(const TempDir& temp) {
  SynthOptions synth;
  synth.shape = "llama-3.2-1b";
  synth.out = temp.path() / "model";
  synth.layers = 4;
  write_synthetic_checkpoint(synth);
  return synth.out;
}

TEST(CudaMemoryPlan, TheAllocatorHoldsWhatTheDryRunPlansForEachFamily) {
  KILN_REQUIRE_CUDA();
  for (const char* family : {"llama3-tiny", "qwen3-tiny", "qwen3_5-text-tiny"}) {
    SCOPED_TRACE(family);
    const auto dir = fixtures_dir() / family;
    // Three sequences take a cache of four slots (decode_bucket) and graphs of 1, 2 and 4 rows; the
    // hybrid cache keeps prefix snapshots beside them (the others allocate none).
    MemoryRequest request{3, 1000, 64};
    request.prefix_snapshots = 6;
    expect_the_allocator_holds_the_plan(dir / "bf16", DType::BF16, request);
    expect_the_allocator_holds_the_plan(dir / "f32", DType::F32, request);
  }
}

TEST(CudaMemoryPlan, TheAllocatorHoldsWhatTheDryRunPlansForQuantizedModels) {
  KILN_REQUIRE_CUDA();
  // The project's MLX affine and FP8 fixtures: prefill decodes their weights into matmul scratch,
  // decode reads them packed (or decoded, where the fused kernel does not take the weight).
  for (const char* fixture : {"qwen3-mlx-tiny", "llama3-fp8-tiny"}) {
    SCOPED_TRACE(fixture);
    const auto dir = fixtures_dir() / fixture / "q";
    expect_the_allocator_holds_the_plan(dir, DType::BF16, {3, 1000, 64});
    expect_the_allocator_holds_the_plan(dir, DType::F32, {3, 1000, 64});
  }
}

TEST(CudaMemoryPlan, TheAllocatorHoldsWhatTheDryRunPlansAtARealModelsWidths) {
  KILN_REQUIRE_CUDA();
  // K of 8,192 splits the prefill GEMMs' K across blocks (their scratch), the vocabulary is real
  // (the sampling scratch), and decode attention splits its keys (its partials, sized for the whole
  // cache inside the graphs).
  TempDir temp;
  const std::filesystem::path model = write_four_layer_llama_1b(temp);
  expect_the_allocator_holds_the_plan(model, DType::BF16, {8, 4096, 256});
  expect_the_allocator_holds_the_plan(model, DType::BF16, {1, 2048, 8});
}

TEST(CudaMemoryPlan, AServedModelUsesNoMoreThanItsPlan) {
  KILN_REQUIRE_CUDA();
  TempDir temp;
  const std::filesystem::path model_dir = write_four_layer_llama_1b(temp);

  auto backend = make_cuda_backend(0, DType::BF16);
  const ModelPlan model_plan = plan_model(model_dir, Device::CUDA, /*backend_present=*/true);
  const MemoryRequest request{8, 4096, 256};
  const MemoryPlan plan = plan_memory(model_plan, *backend, std::nullopt, request);
  ASSERT_TRUE(plan.fits()) << describe_memory_plan(plan, "cuda");
  const uint64_t available_before = backend->memory().available;

  auto model = build_model(model_plan, *backend);
  SchedulerOptions options;
  options.max_batch = static_cast<int32_t>(request.sequences);
  options.context_tokens = request.context;
  options.prefill_chunk = request.prefill_chunk;
  uint64_t used = 0;
  {
    Scheduler scheduler(*model, options);
    // Eight prompts prefilled together in 256-token chunks, then sampled decode steps (the sorting
    // graphs), some with a decode batch of fewer rows as the shorter requests end.
    std::mt19937 random(7);
    std::vector<std::shared_ptr<RequestStream>> streams;
    for (int i = 0; i < 8; ++i) {
      GenerationRequest generation;
      for (int t = 0; t < 600 + 40 * i; ++t) generation.prompt.push_back(static_cast<int32_t>(random() % 128000));
      generation.max_tokens = 8 + 4 * i;
      generation.sampling.temperature = 1.0f;
      generation.sampling.top_k = 40;
      generation.sampling.seed = static_cast<uint64_t>(i);
      streams.push_back(scheduler.submit(generation));
    }
    for (auto& stream : streams)
      for (;;) {
        auto event = stream->next(60s);
        ASSERT_TRUE(event.has_value()) << "no event within 60 s";
        if (event->finished) break;
      }
    backend->synchronize();
    used = available_before - backend->memory().available;
  }
  const std::string report = fmt::format(
      "measured {:.1f} MiB; planned weights {:.1f}, cache {:.1f}, step scratch {:.1f}, decode graphs {:.1f}, "
      "reserve {:.1f}, total {:.1f} MiB",
      mib(used), mib(plan.weights), mib(plan.cache), mib(plan.step_scratch), mib(plan.graph_scratch),
      mib(plan.reserve), mib(plan.total()));
  std::printf("%s\n", report.c_str());
  EXPECT_LE(used, plan.total()) << report;
  EXPECT_GE(used, plan.weights + plan.cache) << report;
}

}  // namespace
