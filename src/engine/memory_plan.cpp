#include "engine/memory_plan.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/error.h"
#include "engine/decode_graph.h"

namespace kiln {
namespace {

uint64_t allocated(const Backend& backend, const std::vector<uint64_t>& tensors) {
  uint64_t total = 0;
  for (uint64_t bytes : tensors) total += backend.allocation_bytes(bytes);
  return total;
}

// One step's scratch: the family's tensors, the f32 logits of `logit_rows` rows, and what the
// attention allocates for itself.
uint64_t step_bytes(const ModelPlan& model, const Backend& backend, int64_t tokens, int64_t logit_rows,
                    int64_t capacity) {
  const ModelConfig& config = model.config;
  const DType activation = backend.activation_dtype();
  return allocated(backend, model.implementation->step_tensor_bytes(config, tokens, logit_rows, activation)) +
         backend.allocation_bytes(static_cast<uint64_t>(logit_rows * config.vocab_size) * dtype_size(DType::F32)) +
         backend.attention_scratch_bytes(tokens, config.num_attention_heads, config.head_dim, capacity);
}

double gib(uint64_t bytes) { return static_cast<double>(bytes) / static_cast<double>(uint64_t{1} << 30); }

// Every part of the plan but the memory available (read once by its callers).
MemoryPlan plan_parts(const ModelPlan& model, Backend& backend, std::optional<DType> load_dtype,
                      const MemoryRequest& request) {
  if (request.sequences < 1) fail("memory plan: at least one sequence is needed, got {}", request.sequences);
  if (request.context < 1) fail("memory plan: the context must be at least one token, got {}", request.context);
  if (request.prefill_chunk < 1) fail("memory plan: the prefill chunk must be positive, got {}", request.prefill_chunk);
  MemoryPlan plan;
  plan.request = request;
  for (const PlannedTensor& planned : model.load_plan.tensors) {
    const TensorInfo& info = model.checkpoint.info(planned.source);
    int64_t elements = 1;
    for (int64_t extent : planned.canonical_shape) elements *= extent;
    const DType dtype = load_dtype ? *load_dtype : info.dtype;
    plan.weights += backend.allocation_bytes(static_cast<uint64_t>(elements) * dtype_size(dtype));
  }
  // The engine's cache has decode_bucket(sequences) slots where decode steps run as graphs
  // (engine/decode_graph.h: padded rows take spare slots).
  GraphOps* graphs = backend.graph_ops();
  plan.cache_slots = graphs ? decode_bucket(request.sequences) : request.sequences;
  const DType activation = backend.activation_dtype();
  plan.cache = allocated(backend, model.implementation->cache_tensor_bytes(model.config, plan.cache_slots,
                                                                           request.context, activation));
  // Every sequence may prefill a chunk in the same step (engine/scheduler.cpp).
  plan.step_tokens = request.sequences * std::min(request.prefill_chunk, request.context);
  plan.step_scratch = step_bytes(model, backend, plan.step_tokens, request.sequences, request.context);
  if (graphs) {
    // One captured graph per bucket up to the cache's slots, each with its own step scratch and
    // the sampler's sort buffers.
    for (int64_t rows = 1; rows <= plan.cache_slots; rows = decode_bucket(rows + 1))
      plan.graph_scratch += step_bytes(model, backend, rows, rows, request.context) +
                            graphs->sampling_scratch_bytes(rows, model.config.vocab_size);
  }
  plan.reserve = backend.reserved_bytes();
  return plan;
}

}  // namespace

MemoryPlan plan_memory(const ModelPlan& model, Backend& backend, std::optional<DType> load_dtype,
                       const MemoryRequest& request) {
  MemoryPlan plan = plan_parts(model, backend, load_dtype, request);
  plan.memory = backend.memory();
  return plan;
}

int64_t longest_fitting_context(const ModelPlan& model, Backend& backend, std::optional<DType> load_dtype,
                                const MemoryPlan& plan) {
  // Memory grows with the context, so the longest one that fits is found by bisection, against
  // the memory the plan was judged by.
  MemoryRequest probe = plan.request;
  int64_t fits = 0, too_long = plan.request.context + 1;
  while (too_long - fits > 1) {
    probe.context = fits + (too_long - fits) / 2;
    const bool probe_fits = plan_parts(model, backend, load_dtype, probe).total() <= plan.memory.available;
    (probe_fits ? fits : too_long) = probe.context;
  }
  return fits;
}

std::string describe_memory_plan(const MemoryPlan& plan, const std::string& device) {
  const MemoryRequest& request = plan.request;
  std::string text;
  text += fmt::format("weights          {:9.3f} GiB\n", gib(plan.weights));
  text += fmt::format("cache            {:9.3f} GiB  ({} slots x {} tokens)\n", gib(plan.cache), plan.cache_slots,
                      request.context);
  text += fmt::format("step scratch     {:9.3f} GiB  ({} tokens a step: {} x {}-token prefill chunks)\n",
                      gib(plan.step_scratch), plan.step_tokens, request.sequences,
                      std::min(request.prefill_chunk, request.context));
  if (plan.graph_scratch) text += fmt::format("decode graphs    {:9.3f} GiB\n", gib(plan.graph_scratch));
  text += fmt::format("backend reserve  {:9.3f} GiB\n", gib(plan.reserve));
  text += fmt::format("total            {:9.3f} GiB\n", gib(plan.total()));
  text += fmt::format("available        {:9.3f} GiB of {:.3f} GiB on {}\n", gib(plan.memory.available),
                      gib(plan.memory.total), device);
  text += plan.fits() ? fmt::format("fits: {} sequences of {} tokens", request.sequences, request.context)
                      : fmt::format("does not fit: {:.3f} GiB short", gib(plan.total() - plan.memory.available));
  return text;
}

}  // namespace kiln
