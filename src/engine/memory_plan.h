// What a model and its context take in the backend's memory, planned before any weight is read:
// `kiln fit` prints it, and `kiln serve` refuses to load what does not fit (instead of failing
// part-way through loading, or later, in the middle of a request).
//
// The plan is a dry run of the code that allocates: the family's own construction over shape-only
// weights (WeightMap::shapes_only), its make_cache, the largest step and, where decode steps run
// as captured graphs, a capture of every graph, all on a MeasuringBackend standing in for the
// backend (backend/measuring_backend.h). Each part is what the backend's allocator would hold
// for it, every block rounded and kept as that allocator rounds and keeps it; nothing is computed
// and no memory of the planned size is taken, so a plan for any model and any device is made on
// the host in milliseconds. The backend's reserve covers what it takes that no tensor accounts for.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "backend/backend.h"
#include "core/dtype.h"
#include "engine/serving_sizes.h"
#include "model/loader.h"
#include "model/model.h"

namespace kiln {

class DecodeGraphs;

struct MemoryRequest {
  int64_t sequences = 1;        // served together (kiln serve --max-batch)
  int64_t context = 0;          // tokens per sequence, prompt and completion
  int64_t prefill_chunk = kDefaultPrefillChunk;  // prompt tokens a sequence prefills per step
  // Served for embeddings (kiln serve --embeddings, engine/embedding_scheduler.h): steps stop
  // before lm_head with a hidden-state row per token (mean pooling's), and no decode graph is made.
  bool embeddings = false;
  // Requests may speculate (engine/speculative.h): a cache whose state sums up the history (the
  // hybrid models') holds a saved copy of it per slot (ModelCache::save_slot_state).
  bool speculative = false;
  // A speculative draft model served beside the target (engine/draft_proposer.h): its weights (in
  // draft_load_dtype, nothing: as stored), its cache of `sequences` slots of `context` tokens and
  // its largest step are planned too. It runs no decode graphs.
  const ModelPlan* draft = nullptr;
  std::optional<DType> draft_load_dtype = std::nullopt;
  // The paged KV cache's blocks, shared by the sequences (ServingSizes::kv_blocks); 0: a block for
  // every position of every sequence.
  int64_t kv_blocks = 0;
  // Requests may speculate with the model's MTP head (engine/mtp_proposer.h; the model's plan holds
  // its weights, LoadOptions::mtp): its cache of `sequences` slots of `context` positions, and the
  // largest step's hidden states with the head's step over them, are planned too.
  bool mtp = false;
  // Snapshot entries of a hybrid model's prefix cache (ServingSizes::snapshots,
  // ModelCache::allocate_snapshots); a cache that resumes anywhere allocates none.
  int64_t prefix_snapshots = 0;
};

// The blocks of the cache the engine makes for `request`: its KV pool and the scratch block that
// free slots point at (engine/generation_core.h).
int64_t engine_cache_blocks(const MemoryRequest& request);

struct MemoryPlan {
  MemoryRequest request;
  int64_t cache_slots = 0;  // the cache's sequences (decode graphs need spare ones: decode_bucket)
  int64_t step_tokens = 0;  // the most tokens one step runs
  uint64_t weights = 0;        // the model's construction: its weights and what it uploads
  uint64_t cache = 0;          // make_cache(cache_slots, context)
  uint64_t snapshots = 0;      // the cache's prefix snapshots (request.prefix_snapshots)
  uint64_t step_scratch = 0;   // the largest step at its peak: its layout, logits, activations and ops' scratch
  uint64_t graph_scratch = 0;  // the decode graphs: their buffers, their captured scratch, and the step
                               // scratch they took from the allocator's cache (run_largest_step again)
  uint64_t reserve = 0;        // the backend's (Backend::reserved_bytes)
  uint64_t draft = 0;          // request.draft's weights, cache and largest step at its peak
  uint64_t mtp = 0;            // the MTP head's cache (request.mtp; its weights are in `weights`)
  // Whether the steps were planned: they are not when the weights, the cache and the reserve alone
  // exceed the memory available (the plan cannot fit, whatever they take; their dry run's host
  // time grows with the step's tokens and the decode graphs' buckets).
  bool steps_planned = false;
  DeviceMemory memory;         // what the backend reported when the plan was made

  uint64_t total() const {
    return weights + cache + snapshots + step_scratch + graph_scratch + reserve + draft + mtp;
  }
  bool fits() const { return total() <= memory.available; }
};

// `load_dtype` is the --dtype conversion (nothing: weights as stored).
MemoryPlan plan_memory(const ModelPlan& model, Backend& backend, std::optional<DType> load_dtype,
                       const MemoryRequest& request);

// The KV pool's blocks that leave the whole plan of `request` (its kv_blocks aside) within `share`
// of the backend's memory (of its total, and never more than is available): the weights, the
// steps, the graphs and the reserve are planned first and the pool takes what they leave, as
// vLLM's --gpu-memory-utilization sizes its KV cache. Blocks past the sequences' contexts are not
// wasted: the prefix cache keeps ended requests' blocks in them. Fails, saying what is needed,
// when not even one sequence's context fits in the share.
int64_t kv_blocks_for_memory_share(const ModelPlan& model, Backend& backend, std::optional<DType> load_dtype,
                                   MemoryRequest request, double share);

// The longest context, at most plan.request.context, whose plan fits the plan's sequences in the
// memory `plan` reported; 0 when not even one token does.
int64_t longest_fitting_context(const ModelPlan& model, Backend& backend, std::optional<DType> load_dtype,
                                const MemoryPlan& plan);

// The steps the plan measures, which any backend runs (the GPU test runs them on CUDA and holds
// the allocator to the plan, part by part):
//
// The largest step the scheduler runs (engine/scheduler.cpp): every sequence of `request`
// prefills a chunk of min(prefill_chunk, context) tokens (slot i for sequence i), at the end of
// its context (positions are 32-bit: a longer context, which no step reaches, is planned as if it
// ended there), with one logit row each — sampled on the device, every row with a sort, where the
// backend runs decode graphs, as the engine chooses a direct step's tokens there — or, for
// embeddings, the hidden-state row of every token.
// With request.mtp the step returns every token's hidden state too, and the MTP head then takes
// them all in, in `mtp_cache` (its make_cache of `request.sequences` slots of `context`). The
// cache needs `request.sequences` slots of `context`.
void run_largest_step(Model& model, ModelCache& cache, const MemoryRequest& request, ModelCache* mtp_cache = nullptr);
// One greedy and one sampling decode step of every batch-size bucket up to the cache's slots, at
// the cache's last position: each captures its graph, which keeps its buffers while `graphs` lives.
void capture_every_decode_graph(DecodeGraphs& graphs, const ModelCache& cache);

// The plan, one part per line, in GiB, with the verdict.
std::string describe_memory_plan(const MemoryPlan& plan, const std::string& device);

}  // namespace kiln
