// A model directory: config.json, a NUL byte, then model.safetensors. The whole pre-weight path of
// model/loader.h runs on it (config, profile resolution, implementation selection, checkpoint,
// the family's load plan), then the memory plan's dry run (the family's construction over
// shape-only weights, its cache and a step, on the measuring backend), then the plan is
// materialised (fix-ups included), sharded over two tensor-parallel ranks when the graph and config
// allow, and converted.
#include <cstddef>
#include <cstdint>
#include <memory>

#include "backend/backend.h"
#include "core/error.h"
#include "engine/memory_plan.h"
#include "fuzz_support.h"
#include "model/load_plan.h"
#include "model/loader.h"
#include "model/tensor_parallel_rank.h"

namespace {

constexpr int kRanks = 2;

// Two sequences of 256 tokens prefilling 64 at a time, with the weights converted to BF16.
constexpr kiln::MemoryRequest kRequest{2, 256, 64};

void materialise(const kiln::ModelPlan& plan) {
  (void)plan.to_json();
  static const std::unique_ptr<kiln::Backend> cpu = kiln::make_cpu_backend();
  (void)kiln::plan_memory(plan, *cpu, kiln::DType::BF16, kRequest);
  kiln::WeightMap whole(plan.checkpoint, plan.load_plan);
  whole.convert_to(kiln::DType::BF16);
  const kiln::TensorParallelSupport& split = plan.implementation->tensor_parallel;
  if (!split.supported()) return;
  split.check(plan.config, kRanks);
  for (int rank = 0; rank < kRanks; ++rank) {
    kiln::WeightMap part(plan.checkpoint, plan.load_plan);
    const kiln::TensorParallelRank position{rank, kRanks, nullptr};
    part.shard([&](const std::string& canonical, const kiln::Shape& shape) {
      return split.shard(plan.config, position, canonical, shape);
    });
    part.convert_to(kiln::DType::F32);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto [config, checkpoint] = kiln::fuzz::split_at_nul(kiln::fuzz::as_text(data, size));
  const auto& scratch = kiln::fuzz::ScratchDirectory::instance();
  scratch.write("config.json", config);
  scratch.write("model.safetensors", checkpoint);
  try {
    materialise(kiln::plan_model(scratch.path(), kiln::Device::CPU, /*backend_present=*/true));
  } catch (const kiln::Error&) {
    // A rejected model is the expected outcome; any other exception or a crash is a finding.
  }
  return 0;
}
