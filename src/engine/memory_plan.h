// What a model and its context take in the backend's memory, planned before any weight is read:
// `kiln fit` prints it, and `kiln serve` refuses to load what does not fit (instead of failing
// part-way through loading, or later, in the middle of a request).
//
// Every part is the sum of the tensors that will be allocated, each rounded as the backend's
// allocator rounds it: the weights (the load plan's tensors, converted to the load dtype), the
// cache (the family's cache_tensor_bytes for the slots the engine gives it), and the scratch of
// the largest step (every sequence prefilling a chunk) plus, where decode steps run as captured
// graphs, each graph's own scratch (a graph keeps its buffers for as long as it exists). The
// backend's reserve covers what it allocates that no plan lists.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "backend/backend.h"
#include "core/dtype.h"
#include "engine/serving_sizes.h"
#include "model/loader.h"

namespace kiln {

struct MemoryRequest {
  int64_t sequences = 1;        // served together (kiln serve --max-batch)
  int64_t context = 0;          // tokens per sequence, prompt and completion
  int64_t prefill_chunk = kDefaultPrefillChunk;  // prompt tokens a sequence prefills per step
};

struct MemoryPlan {
  MemoryRequest request;
  int64_t cache_slots = 0;  // the cache's sequences (decode graphs need spare ones: decode_bucket)
  int64_t step_tokens = 0;  // the most tokens one step runs
  uint64_t weights = 0;
  uint64_t cache = 0;
  uint64_t step_scratch = 0;   // activations, logits and attention scratch of the largest step
  uint64_t graph_scratch = 0;  // the decode graphs' own buffers, one set per batch-size bucket
  uint64_t reserve = 0;        // the backend's (Backend::reserved_bytes)
  DeviceMemory memory;         // what the backend reported when the plan was made

  uint64_t total() const { return weights + cache + step_scratch + graph_scratch + reserve; }
  bool fits() const { return total() <= memory.available; }
};

// `load_dtype` is the --dtype conversion (nothing: weights as stored).
MemoryPlan plan_memory(const ModelPlan& model, Backend& backend, std::optional<DType> load_dtype,
                       const MemoryRequest& request);

// The longest context, at most plan.request.context, whose plan fits the plan's sequences in the
// memory `plan` reported; 0 when not even one token does.
int64_t longest_fitting_context(const ModelPlan& model, Backend& backend, std::optional<DType> load_dtype,
                                const MemoryPlan& plan);

// The plan, one part per line, in GiB, with the verdict.
std::string describe_memory_plan(const MemoryPlan& plan, const std::string& device);

}  // namespace kiln
