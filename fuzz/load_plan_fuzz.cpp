// A model directory: config.json, a NUL byte, then model.safetensors. The whole pre-weight path of
// model/loader.h runs on it (config, profile resolution, implementation selection, checkpoint,
// the family's load plan), then the plan is materialised (fix-ups included), sharded over two
// tensor-parallel ranks when the graph and config allow, and converted.
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "fuzz_support.h"
#include "model/load_plan.h"
#include "model/loader.h"
#include "model/tensor_parallel_rank.h"

namespace {

constexpr int kRanks = 2;

void materialise(const kiln::ModelPlan& plan) {
  (void)plan.to_json();
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
