#include "engine/memory_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <memory>

#include "backend/measuring_backend.h"
#include "core/error.h"
#include "engine/decode_graph.h"
#include "engine/embedding.h"
#include "engine/generation.h"
#include "engine/mtp_proposer.h"
#include "engine/sampler.h"
#include "model/load_plan.h"

namespace kiln {
namespace {

double gib(uint64_t bytes) { return static_cast<double>(bytes) / static_cast<double>(uint64_t{1} << 30); }

int64_t chunk_tokens(const MemoryRequest& request) { return std::min(request.prefill_chunk, request.context); }

int64_t kv_blocks(const MemoryRequest& request) {
  return request.kv_blocks > 0 ? request.kv_blocks : request.sequences * kv_table_width(request.context);
}

}  // namespace

int64_t engine_cache_blocks(const MemoryRequest& request) { return kv_blocks(request) + 1; }

namespace {

// The end of the positions a step can reach in a cache of `capacity` positions (BatchLayout's
// positions are 32-bit).
int64_t reachable_end(int64_t capacity) { return std::min<int64_t>(capacity, std::numeric_limits<int32_t>::max()); }

// Every part of the plan but the memory, judged against `available` bytes (read once by the
// callers): the dry run.
MemoryPlan plan_parts(const ModelPlan& model, Backend& backend, std::optional<DType> load_dtype,
                      const MemoryRequest& request, uint64_t available) {
  if (request.sequences < 1) fail("memory plan: at least one sequence is needed, got {}", request.sequences);
  if (request.context < 1) fail("memory plan: the context must be at least one token, got {}", request.context);
  if (request.prefill_chunk < 1) fail("memory plan: the prefill chunk must be positive, got {}", request.prefill_chunk);
  MemoryPlan plan;
  plan.request = request;
  plan.step_tokens = request.sequences * chunk_tokens(request);
  plan.reserve = backend.reserved_bytes();

  MeasuringBackend measuring(backend);
  const auto held = [&measuring] { return measuring.measured().held; };
  const auto peak_since = [&measuring](uint64_t start) { return measuring.measured().peak_held - start; };
  WeightMap weights = WeightMap::shapes_only(model.checkpoint, model.load_plan, load_dtype);
  const std::unique_ptr<Model> dry = model.implementation->create(weights, model.config, model.resolved, measuring);
  if (!dry) fail("model implementation {} returned no model to plan", model.implementation->id);
  plan.weights = held();

  // The engine's cache has decode_bucket(sequences) slots where decode steps run as graphs
  // (engine/decode_graph.h: padded rows take spare slots); embeddings decode nothing.
  const bool graphs = !request.embeddings && DecodeGraphs::supported(*dry);
  plan.cache_slots = graphs ? decode_bucket(request.sequences) : request.sequences;
  const std::unique_ptr<ModelCache> cache =
      dry->make_cache(plan.cache_slots, request.context, engine_cache_blocks(request));
  if (request.speculative) cache->save_slot_state(0);  // allocates the saved states of every slot
  plan.cache = held() - plan.weights;
  cache->allocate_snapshots(request.prefix_snapshots);
  plan.snapshots = held() - plan.weights - plan.cache;
  std::unique_ptr<ModelCache> mtp_cache;
  if (request.mtp) {
    DraftHead* head = dry->draft_head();
    if (!head) fail("memory plan: the requests speculate with the MTP head, but the model's plan holds none");
    const uint64_t start = held();
    mtp_cache = head->make_cache(request.sequences, request.context);
    plan.mtp = held() - start;
  }
  // The draft's parts stay held while the target's steps are planned, as they are while it serves.
  std::unique_ptr<Model> draft;
  std::unique_ptr<ModelCache> draft_cache;
  if (request.draft) {
    const uint64_t start = held();
    measuring.restart_peak();
    WeightMap draft_weights =
        WeightMap::shapes_only(request.draft->checkpoint, request.draft->load_plan, request.draft_load_dtype);
    draft = request.draft->implementation->create(draft_weights, request.draft->config, request.draft->resolved,
                                                  measuring);
    if (!draft) fail("model implementation {} returned no draft model to plan", request.draft->implementation->id);
    draft_cache = draft->make_cache(request.sequences, request.context);
    const MemoryRequest draft_step{request.sequences, request.context, request.prefill_chunk};
    run_largest_step(*draft, *draft_cache, draft_step);
    plan.draft = peak_since(start);
  }
  if (plan.weights + plan.cache + plan.snapshots + plan.draft + plan.mtp + plan.reserve > available) return plan;

  plan.steps_planned = true;
  uint64_t start = held();
  measuring.restart_peak();
  run_largest_step(*dry, *cache, request, mtp_cache.get());
  plan.step_scratch = peak_since(start);
  if (graphs) {
    start = held();
    measuring.restart_peak();
    DecodeGraphs decode_graphs(*dry, *cache);
    capture_every_decode_graph(decode_graphs, *cache);
    // Blocks a capture took from the allocator's cache are the graphs' now: the next largest step
    // allocates them again.
    run_largest_step(*dry, *cache, request, mtp_cache.get());
    plan.graph_scratch = peak_since(start);
  }
  return plan;
}

}  // namespace

void run_largest_step(Model& model, ModelCache& cache, const MemoryRequest& request, ModelCache* mtp_cache) {
  const int64_t tokens = chunk_tokens(request);
  std::vector<SequenceStep> steps;
  for (int64_t sequence = 0; sequence < request.sequences; ++sequence)
    steps.push_back({static_cast<int32_t>(sequence), static_cast<int32_t>(reachable_end(request.context) - tokens),
                     std::vector<int32_t>(static_cast<size_t>(tokens), 0), false, 1, request.mtp});
  if (request.mtp) {
    if (!mtp_cache) fail("memory plan: the largest step of MTP speculation needs the head's cache");
    // The step's hidden states stay held while the head takes them in (engine/mtp_proposer.h).
    Tensor hidden;
    run_step(model, cache, steps, &hidden);
    run_draft_head_step(model, *mtp_cache, steps, hidden);
    return;
  }
  if (!request.embeddings && DecodeGraphs::supported(model)) {
    // The engine chooses such a step's tokens on the device (engine/decode_graph.h's
    // sample_rows_on_device): every row samples here, so the sort's scratch is planned too.
    SamplingParams sampling;
    sampling.temperature = 1.0f;
    Sampler sampler(sampling);
    const std::vector<Sampler*> samplers(static_cast<size_t>(request.sequences), &sampler);
    sample_rows_on_device(model.backend(), forward_step(model, cache, steps), samplers);
    return;
  }
  if (!request.embeddings) {
    run_step(model, cache, steps);
    return;
  }
  std::vector<int32_t> every_row(static_cast<size_t>(request.sequences * tokens));
  for (size_t row = 0; row < every_row.size(); ++row) every_row[row] = static_cast<int32_t>(row);
  run_hidden_step(model, cache, steps, every_row);
}

void capture_every_decode_graph(DecodeGraphs& graphs, const ModelCache& cache) {
  SamplingParams sampling;
  sampling.temperature = 1.0f;
  Sampler sampler(sampling);
  const auto position = static_cast<int32_t>(reachable_end(cache.capacity()) - 1);
  for (int64_t rows = 1; rows <= cache.slots(); rows = decode_bucket(rows + 1))
    for (Sampler* row_sampler : {static_cast<Sampler*>(nullptr), &sampler}) {
      std::vector<DecodeRow> decode_rows;
      for (int64_t row = 0; row < rows; ++row)
        decode_rows.push_back({static_cast<int32_t>(row), position, 0, row_sampler});
      graphs.step(decode_rows);
    }
}

MemoryPlan plan_memory(const ModelPlan& model, Backend& backend, std::optional<DType> load_dtype,
                       const MemoryRequest& request) {
  const DeviceMemory memory = backend.memory();
  MemoryPlan plan = plan_parts(model, backend, load_dtype, request, memory.available);
  plan.memory = memory;
  return plan;
}

int64_t kv_blocks_for_memory_share(const ModelPlan& model, Backend& backend, std::optional<DType> load_dtype,
                                   MemoryRequest request, double share) {
  if (!(share > 0.0 && share <= 1.0)) fail("the memory share must be above 0 and at most 1, got {}", share);
  const DeviceMemory memory = backend.memory();
  const auto budget = std::min(memory.available, static_cast<uint64_t>(share * static_cast<double>(memory.total)));
  constexpr uint64_t kUnbounded = std::numeric_limits<uint64_t>::max();
  // The pool is the one part that grows with its blocks: two plans a context apart give its bytes
  // per block, and every other part stays as the smaller plan has it.
  const int64_t context_blocks = kv_table_width(request.context);
  request.kv_blocks = context_blocks;
  const MemoryPlan one_context = plan_parts(model, backend, load_dtype, request, kUnbounded);
  if (one_context.total() > budget)
    fail("{} sequences with one {}-token context of KV cache need {:.3f} GiB, more than the memory share's {:.3f} "
         "GiB ({} of {:.3f} GiB, {:.3f} GiB available)",
         request.sequences, request.context, gib(one_context.total()), gib(budget), share, gib(memory.total),
         gib(memory.available));
  request.kv_blocks = 2 * context_blocks;
  const uint64_t block_bytes =
      std::max<uint64_t>(1, (plan_parts(model, backend, load_dtype, request, kUnbounded).cache - one_context.cache) /
                                static_cast<uint64_t>(context_blocks));
  request.kv_blocks = context_blocks + static_cast<int64_t>((budget - one_context.total()) / block_bytes);
  // The allocator rounds what it keeps: step down until the plan itself is within the budget.
  for (uint64_t total; (total = plan_parts(model, backend, load_dtype, request, kUnbounded).total()) > budget;)
    request.kv_blocks = std::max(context_blocks, request.kv_blocks - static_cast<int64_t>((total - budget) / block_bytes) - 1);
  return request.kv_blocks;
}

int64_t longest_fitting_context(const ModelPlan& model, Backend& backend, std::optional<DType> load_dtype,
                                const MemoryPlan& plan) {
  // Memory grows with the context, so the longest one that fits is found by bisection, against
  // the memory the plan was judged by.
  MemoryRequest probe = plan.request;
  int64_t fits = 0, too_long = plan.request.context + 1;
  while (too_long - fits > 1) {
    probe.context = fits + (too_long - fits) / 2;
    const uint64_t available = plan.memory.available;
    const bool probe_fits = plan_parts(model, backend, load_dtype, probe, available).total() <= available;
    (probe_fits ? fits : too_long) = probe.context;
  }
  return fits;
}

std::string describe_memory_plan(const MemoryPlan& plan, const std::string& device) {
  const MemoryRequest& request = plan.request;
  std::string text;
  text += fmt::format("weights          {:9.3f} GiB\n", gib(plan.weights));
  const int64_t blocks = kv_blocks(request);
  text += fmt::format("cache            {:9.3f} GiB  ({} blocks of {} tokens: {} tokens, {} sequences of the whole "
                      "{}-token context at once; {} slots)\n",
                      gib(plan.cache), blocks, kKvBlockTokens, blocks * kKvBlockTokens,
                      blocks / kv_table_width(request.context), request.context, plan.cache_slots);
  if (plan.snapshots)
    text += fmt::format("prefix snapshots {:9.3f} GiB  ({} of the recurrent state, {:.1f} MiB each)\n",
                        gib(plan.snapshots), request.prefix_snapshots,
                        static_cast<double>(plan.snapshots) / static_cast<double>(request.prefix_snapshots) /
                            static_cast<double>(1 << 20));
  if (plan.steps_planned)
    text += fmt::format("step scratch     {:9.3f} GiB  ({} tokens a step: {} x {}-token prefill chunks)\n",
                        gib(plan.step_scratch), plan.step_tokens, request.sequences, chunk_tokens(request));
  else
    text += "step scratch     not planned: the weights and the cache alone do not fit\n";
  if (plan.graph_scratch) text += fmt::format("decode graphs    {:9.3f} GiB\n", gib(plan.graph_scratch));
  if (plan.draft)
    text += fmt::format("draft model      {:9.3f} GiB  (weights, {} slots x {} tokens of cache, its largest step)\n",
                        gib(plan.draft), request.sequences, request.context);
  if (request.mtp)
    text += fmt::format("mtp head cache   {:9.3f} GiB  ({} slots x {} tokens; its weights are counted above)\n",
                        gib(plan.mtp), request.sequences, request.context);
  text += fmt::format("backend reserve  {:9.3f} GiB\n", gib(plan.reserve));
  text += fmt::format("total            {:9.3f} GiB\n", gib(plan.total()));
  text += fmt::format("available        {:9.3f} GiB of {:.3f} GiB on {}\n", gib(plan.memory.available),
                      gib(plan.memory.total), device);
  const int64_t context_blocks = request.sequences * kv_table_width(request.context);
  if (!plan.fits())
    text += fmt::format("does not fit: {}{:.3f} GiB short", plan.steps_planned ? "" : "at least ",
                        gib(plan.total() - plan.memory.available));
  else if (blocks < context_blocks)
    text += fmt::format("fits: {} sequences of up to {} tokens, sharing {} KV positions", request.sequences,
                        request.context, blocks * kKvBlockTokens);
  else if (blocks > context_blocks)
    text += fmt::format("fits: {} sequences of {} tokens, with {} KV positions (those past their contexts keep ended "
                        "requests' prefixes cached)",
                        request.sequences, request.context, blocks * kKvBlockTokens);
  else
    text += fmt::format("fits: {} sequences of {} tokens", request.sequences, request.context);
  return text;
}

}  // namespace kiln
