// The memory plan on the GPU: a served model's measured use of device memory stays inside what
// `kiln fit` plans for it.
#include <random>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "cuda_test_support.h"
#include "engine/memory_plan.h"
#include "engine/scheduler.h"
#include "model/synth.h"
#include "test_support.h"

using namespace kiln;
using namespace kiln::testing;
using namespace std::chrono_literals;

namespace {

double mib(uint64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

TEST(CudaMemoryPlan, AServedModelUsesNoMoreThanItsPlan) {
  KILN_REQUIRE_CUDA();
  // llama-3.2-1b's shape with 4 of its 16 layers: a real vocabulary and widths, a quick load.
  TempDir temp;
  SynthOptions synth;
  synth.shape = "llama-3.2-1b";
  synth.out = temp.path() / "model";
  synth.layers = 4;
  write_synthetic_checkpoint(synth);

  auto backend = make_cuda_backend(0, DType::BF16);
  const ModelPlan model_plan = plan_model(synth.out, Device::CUDA, /*backend_present=*/true);
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
