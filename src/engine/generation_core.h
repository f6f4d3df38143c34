// The one generation core: requests in cache slots, advanced a step at a time by plan → execute →
// commit. The plan (engine/step_plan.h) says which sequences prefill which chunk and which decode;
// execution runs it as one forward (or, where every sequence decodes on a backend with GraphOps,
// as a captured decode graph that samples on the device); the commit feeds the results back: the
// prompt tokens now in the cache, and each sampled token to its request with the one rule that
// ends a request (a stop id, then max_tokens). The Scheduler drives a core from its thread for
// every request in flight; generate() drives one for a single request on the calling thread.
//
// On a backend with GraphOps a decode step may be left in flight (queued on the device, its tokens
// not yet read) and the next one queued behind it, taking those tokens on the device: the device
// never waits for the host between steps (engine/decode_graph.h).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "engine/decode_graph.h"
#include "engine/finish_reason.h"
#include "engine/grammar/token_mask.h"
#include "engine/kv_block_pool.h"
#include "engine/reasoning_budget.h"
#include "engine/sampler.h"
#include "engine/speculative.h"
#include "engine/step_plan.h"
#include "model/model.h"

namespace kiln {

struct TokenEvent {
  int32_t token = -1;  // -1 on a final event that carries no token (cancelled, error, max_tokens 0)
  float logprob = 0.0f;
  std::vector<std::pair<int32_t, float>> top_logprobs;
  bool finished = false;
  FinishReason finish_reason = FinishReason::Stop;  // meaningful on the final event only
  std::string error;
};

struct GenerationRequest {
  std::vector<int32_t> prompt;
  int64_t max_tokens = 256;
  SamplingParams sampling;
  std::vector<int32_t> stop_ids;  // generation ends after emitting one of these (it is reported)
  int32_t top_logprobs = 0;       // how many alternatives to report per token (0: none)
  // Structured output: every token must continue a sentence of this grammar (a stop id only where
  // the grammar can end), and the request ends once the grammar allows nothing more. Its vocabulary
  // must have a byte string per logit row. Such a request samples on the host from logits whose
  // refused tokens are -inf: its logprobs are those of that masked distribution.
  std::shared_ptr<const grammar::CompiledGrammar> grammar = nullptr;
  // A cap on the reply's reasoning (engine/reasoning_budget.h): at it, the closing marker's tokens
  // are forced. Not with a grammar, which holds every token from the first.
  std::optional<ReasoningBudget> reasoning_budget = std::nullopt;
  // Proposals verified a step at a time (engine/speculative.h); the tokens are those of the plain
  // run. A request with a grammar or a reasoning budget decodes plainly whatever this says.
  Speculation speculation = {};
};

// Checks a request against the context its sequence has (`context_tokens`, prompt and completion)
// and the model's vocabulary, and bounds its max_tokens by the room the prompt leaves: the one
// place that decides how long a request may run.
void bound_request(GenerationRequest& request, int64_t context_tokens, int64_t vocab_size);

// The consumer side of one request: events arrive in order; the last one has finished = true.
class RequestStream {
 public:
  // Waits up to `timeout` for the next event.
  std::optional<TokenEvent> next(std::chrono::milliseconds timeout);
  // Asks the core to stop the request (its slot is freed at the next step).
  void cancel() { cancelled_.store(true); }
  bool cancelled() const { return cancelled_.load(); }
  int64_t prompt_tokens() const { return prompt_tokens_; }
  // Prompt tokens served from the prefix cache rather than prefilled (set when admitted).
  int64_t cached_tokens() const { return cached_tokens_.load(); }

 private:
  friend class GenerationCore;
  friend class Scheduler;  // ends the requests still waiting at shutdown
  void push(TokenEvent event);

  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<TokenEvent> events_;
  std::atomic<bool> cancelled_{false};
  int64_t prompt_tokens_ = 0;
  std::atomic<int64_t> cached_tokens_{0};
};

// The paged KV cache's state as the core sees it (for metrics): blocks of kKvBlockTokens positions.
struct KvCacheStats {
  int64_t blocks = 0;         // in the pool
  int64_t free_blocks = 0;    // holding nothing
  int64_t cached_blocks = 0;  // holding a cached prefix no running request holds (reused, or evicted on demand)
  int64_t used_blocks = 0;    // held by running requests
  int64_t preemptions = 0;    // requests whose blocks were taken back to let others run, so far
  int64_t snapshots = 0;      // a hybrid model's recurrent-state snapshots held by cached blocks
};

class GenerationCore {
 public:
  // `slots` sequences of up to `context_tokens` each (on a backend with GraphOps the cache gets the
  // spare slots of decode_bucket(slots) that padded graph rows take); each step runs at most
  // `step_token_budget` tokens, a prefilling sequence at most `prefill_chunk` of them. The sizes are
  // those of a ServingSizes that passed check_serving_sizes, and the budget its step_token_budget.
  //
  // The KV cache is paged (ModelCache): `kv_blocks` blocks of kKvBlockTokens positions shared by
  // every sequence (0: a block for every position of every slot), taken as a sequence's steps need
  // them and given back when it ends. When a step needs more blocks than are free, the most
  // recently admitted running request is preempted: its blocks go back to the pool, and it waits
  // to run again, first among those waiting, prefilling its prompt and the tokens it had generated
  // (bit-identical rows: the invariance contract), then decoding on from where it stopped.
  //
  // With `prefix_cache`, every full block a sequence has written is kept in the pool's prefix index
  // (engine/kv_block_pool.h) after the sequence ends, until its room is needed, and a request
  // starts on the longest run of cached blocks that begins its prompt: it prefills only the rest.
  // Blocks are 64-token runs (the split points at which chunked prefill is bit-identical to a
  // one-shot one) and at least one prompt token is left to prefill (the first sampled token needs
  // its logits), so a cached answer is bit-identical to an uncached one.
  //
  // A cache whose state sums up the whole history (a hybrid model's Gated DeltaNet layers,
  // ModelCache::resumes_at_any_position false) resumes only from a snapshot of that state, and
  // reuses a prefix only with `prefix_snapshots` > 0: that many snapshot entries beside the slots
  // (ModelCache::allocate_snapshots). The delta rule runs whole 64-token chunks of a prefill in its
  // chunked form and every other token recurrently, which gives other bits (backend.h), so a
  // snapshot is taken only where a prefill chunk ends at a block boundary: each prompt's prefill
  // ends a chunk at its last boundary before the prompt's end (one step more where the prompt's
  // chunks would run past it) and keeps the state there, and at the prompt's end too when that is a
  // boundary — what a repeat of the prompt, and the next turn of a chat, resume from. A snapshot
  // belongs to the cached block that ends at it and goes with it; when no entry is free, the one
  // least recently taken or used is given up. A hit is cut back to its last block with a snapshot;
  // the rest is prefilled in chunks that end at the cold run's boundaries, and only blocks that a
  // prefill wrote in whole chunks are cached (never rows decode steps wrote), so the answer is the
  // cold one bit for bit here too.
  GenerationCore(Model& model, int32_t slots, int64_t context_tokens, int64_t prefill_chunk,
                 int64_t step_token_budget, bool prefix_cache = true, int64_t kv_blocks = 0,
                 int64_t prefix_snapshots = 0);
  ~GenerationCore();
  GenerationCore(const GenerationCore&) = delete;
  GenerationCore& operator=(const GenerationCore&) = delete;

  // Whether `request` (checked by bound_request) can start now: a slot is free, no preempted
  // request waits to run again, and the pool has the blocks of its prompt.
  bool can_admit(const GenerationRequest& request) const;
  // Starts a request for which can_admit holds; its events go to `stream`.
  void admit(GenerationRequest request, std::shared_ptr<RequestStream> stream);
  // One step: drops cancelled requests, runs preempted ones again where they fit, then plans,
  // executes and commits. `requests_waiting` says whether requests wait to be admitted (a decode
  // step is then not queued ahead: a newcomer needs a prefill step first). False when there was
  // nothing to run.
  bool step(const std::function<bool()>& requests_waiting);
  // Ends every running or preempted request with a Cancelled event saying `why`, leaving the core to
  // be destroyed.
  void cancel_all(const std::string& why);

  // Requests running or preempted (admitted and not ended).
  size_t running() const { return running_.size() + preempted_.size(); }
  // Cache positions the running requests' blocks hold.
  int64_t cache_tokens_used() const;
  // Positions the KV pool holds.
  int64_t cache_tokens_total() const { return pool_blocks_ * kKvBlockTokens; }
  KvCacheStats kv_cache_stats() const;
  // Prompt tokens admitted so far, and of them those served from the prefix cache.
  int64_t prefix_query_tokens() const { return prefix_query_tokens_; }
  int64_t prefix_hit_tokens() const { return prefix_hit_tokens_; }
  // The verify steps run so far, their proposals and of them the accepted ones.
  const SpeculationCounts& speculation_counts() const { return speculation_counts_; }

  static constexpr int64_t kPrefixBlock = 64;

 private:
  struct Sequence;
  struct StepResult {
    Tensor logits;                             // host logit rows, one per planned work (empty when on the device)
    std::vector<SampledToken> device_tokens;   // the tokens a decode graph chose, one per row
    bool left_in_flight = false;               // a decode step was queued and not read
  };

  void end(Sequence& sequence, TokenEvent event);
  int64_t blocks_available() const;
  void start_in_slot(Sequence& sequence, int32_t slot);
  bool reserve_blocks(Sequence& sequence, int64_t positions);
  bool reserve_step_blocks(const StepPlan& plan);
  void cache_full_blocks(Sequence& sequence);
  void keep_snapshot(Sequence& sequence);
  void release_blocks(Sequence& sequence);
  void preempt_latest();
  void resume_preempted();
  void drop_cancelled();
  void fail_running(const std::exception& error);
  bool accept(Sequence& sequence, const SampledToken& token, std::span<const float> row, bool forced = false);
  // A row's choice in a verify step, and the logits it was made from (empty when made on the device).
  using RowChoice = std::function<std::pair<SampledToken, std::span<const float>>(size_t row)>;
  bool verify(Sequence& sequence, std::span<const float> rows);
  bool verify(Sequence& sequence, std::span<const SampledToken> chosen);
  bool verify_choices(Sequence& sequence, const RowChoice& choose);
  void propose();
  void pad_proposals_for_graph();
  bool verifies_as_graph(const StepPlan& plan) const;
  std::vector<DecodeRow> verify_rows() const;
  bool sample_on_host(Sequence& sequence, std::span<const float> logits);
  bool sampler_chooses(const PlannedWork& work, const Sequence& sequence) const;
  std::vector<DecodeRow> decode_rows(bool fed) const;
  std::vector<uint64_t> running_ids() const;
  bool queue_next_decode(const std::function<bool()>& requests_waiting) const;
  bool advance_in_flight(const std::function<bool()>& requests_waiting);
  StepPlan plan() const;
  StepResult execute(const StepPlan& plan);
  void commit(const StepPlan& plan, const StepResult& result);

  Model& model_;
  int64_t prefill_chunk_;
  int64_t step_token_budget_;
  std::unique_ptr<ModelCache> cache_;
  std::unique_ptr<DecodeGraphs> decode_graphs_;  // null on backends without GraphOps (the CPU)
  std::vector<std::unique_ptr<Sequence>> running_;
  std::deque<std::unique_ptr<Sequence>> preempted_;  // oldest preemption first
  std::vector<int32_t> free_slots_;
  bool prefix_cache_;
  // The prefix cache resumes from snapshots of the recurrent state (ModelCache::save_snapshot): the
  // cache's snapshot entries that no pool block holds are free_snapshots_.
  bool snapshots_ = false;
  std::vector<int32_t> free_snapshots_;
  int64_t pool_blocks_ = 0;
  // The cache block past the pool's: a free slot's first table entry points at it, so that the
  // padded rows of a decode graph (engine/decode_graph.h), which write a free slot's first
  // positions, write into no sequence's rows.
  int32_t scratch_block_ = 0;
  std::unique_ptr<KvBlockPool> pool_;
  int64_t preemptions_ = 0;
  int64_t prefix_query_tokens_ = 0;
  int64_t prefix_hit_tokens_ = 0;
  SpeculationCounts speculation_counts_;
  // The requests (Sequence::id, in row order) of the decode step in flight: queued on the device,
  // its tokens not yet read. Empty when none is.
  std::vector<uint64_t> in_flight_;
  uint64_t admitted_ = 0;  // requests admitted so far (the last Sequence::id)
};

}  // namespace kiln
