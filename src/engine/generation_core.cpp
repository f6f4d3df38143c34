#include "engine/generation_core.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>

#include "core/error.h"
#include "engine/generation.h"

namespace kiln {

std::optional<TokenEvent> RequestStream::next(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  if (!ready_.wait_for(lock, timeout, [&] { return !events_.empty(); })) return std::nullopt;
  TokenEvent event = std::move(events_.front());
  events_.pop_front();
  return event;
}

void RequestStream::push(TokenEvent event) {
  {
    std::lock_guard lock(mutex_);
    events_.push_back(std::move(event));
  }
  ready_.notify_all();
}

void bound_request(GenerationRequest& request, int64_t context_tokens, int64_t vocab_size) {
  const auto prompt_length = static_cast<int64_t>(request.prompt.size());
  if (prompt_length == 0) fail("the prompt is empty");
  if (prompt_length >= context_tokens)
    fail("the prompt has {} tokens but the context holds {} (prompt and completion together)", prompt_length,
         context_tokens);
  if (request.max_tokens < 0) fail("max_tokens must be ≥ 0, got {}", request.max_tokens);
  request.sampling.validate();
  for (int32_t token : request.prompt)
    if (token < 0 || token >= vocab_size)
      fail("prompt token id {} is outside the vocabulary (size {})", token, vocab_size);
  for (const auto& [token, bias] : request.sampling.logit_bias)
    if (token >= vocab_size) fail("logit_bias names token id {}, outside the vocabulary (size {})", token, vocab_size);
  request.max_tokens = std::min(request.max_tokens, context_tokens - prompt_length);
  if (request.grammar && request.grammar->vocabulary().size() != vocab_size)
    fail("the grammar was compiled for a vocabulary of {} tokens, but the model has {}",
         request.grammar->vocabulary().size(), vocab_size);
  if (request.reasoning_budget) {
    if (request.grammar) fail("a reasoning budget cannot be combined with a grammar");
    request.reasoning_budget->validate(vocab_size);
  }
  if (request.speculation.enabled()) check_speculative_tokens(request.speculation.tokens);
}

// The most tokens a sequence runs again in one append: fewer than the Gated DeltaNet chunk, so that
// the delta rule runs them through the recurrent steps that decoded them (backend.h), bit for bit.
constexpr int64_t kReplayAppendTokens = kGatedDeltaChunk - 1;

struct GenerationCore::Sequence {
  GenerationRequest request;
  std::shared_ptr<RequestStream> stream;
  Sampler sampler;
  int32_t slot = 0;
  int64_t prefilled = 0;    // prompt tokens already in the cache
  int32_t next_input = -1;  // the last sampled token, fed at the next decode step
  int64_t generated = 0;
  std::vector<int32_t> generated_tokens = {};  // every token sampled, in order
  uint64_t id = 0;  // unique among the core's requests: names its rows in a step in flight
  std::optional<grammar::GrammarMatcher> matcher = std::nullopt;  // with a grammar: where its output stands in it
  grammar::TokenMask mask = {};                    // the tokens the grammar allows next
  std::vector<float> masked_logits = {};
  std::optional<ReasoningBudgetTracker> budget = std::nullopt;  // with a reasoning budget: where the reply stands in it
  // Speculation (engine/speculative.h): the request's proposer, its sequence so far (the prompt and
  // every token generated), and the tokens proposed for the step being planned.
  std::unique_ptr<SequenceProposer> proposer = nullptr;
  std::vector<int32_t> history = {};
  std::vector<int32_t> proposal = {};
  // Generated tokens before next_input that the next decode runs again: a rejected proposal rolled a
  // recurrent state back to before the verify step, and the tokens it accepted are fed anew.
  int64_t replay = 0;
  // Its block table: the pool blocks of its positions [64·i, 64·i + 64), of which the first
  // `cached_blocks` are in the prefix index.
  std::vector<int32_t> blocks = {};
  size_t cached_blocks = 0;
  // What it prefills: its prompt, or after a preemption (`resuming`) its prompt and every token it
  // generated but the last, which it then decodes from.
  int64_t prefill_target = 0;
  bool resuming = false;

  // Where a hybrid model keeps its state for later prompts (GenerationCore's snapshots): the last
  // block boundary before the end of what it prefills, from which a request with the same prompt
  // resumes, and that end itself where it is a boundary, from which a longer prompt that begins
  // with this one (the next turn of a chat) resumes.
  int64_t last_snapshot_boundary() const { return (prefill_target - 1) / kKvBlockTokens * kKvBlockTokens; }
  bool snapshots_at(int64_t position) const {
    return position > 0 && position % kKvBlockTokens == 0 && position >= last_snapshot_boundary();
  }

  int64_t prompt_length() const { return static_cast<int64_t>(request.prompt.size()); }
  // Token i of the sequence: the prompt, then what it generated.
  int32_t token_at(int64_t i) const {
    return i < prompt_length() ? request.prompt[static_cast<size_t>(i)]
                               : generated_tokens[static_cast<size_t>(i - prompt_length())];
  }
  std::vector<int32_t> tokens(int64_t begin, int64_t end) const {
    std::vector<int32_t> run;
    for (int64_t i = begin; i < end; ++i) run.push_back(token_at(i));
    return run;
  }
  bool decoding() const { return !resuming && prefilled == prompt_length(); }
  // The positions whose rows it holds for sure: what it prefilled, then (decoding) every sampled
  // token but the last, which no step has fed yet (a step in flight may have written it, and rows
  // past what is recorded are never read before being written again).
  int64_t known_positions() const { return decoding() ? prompt_length() + generated - 1 - replay : prefilled; }
  // The device sampler (GraphOps::sample_tokens) applies no bias, penalty or grammar mask, so such a
  // request's tokens are always chosen by its host Sampler from the step's logits, which are the
  // same bits on either path: the one rule in every step, alone or in any batch.
  bool samples_on_host() const { return request.sampling.processes_logits() || matcher.has_value(); }
  // Its logits come back to the host: for logprobs, or to sample there.
  bool needs_logits() const { return request.top_logprobs > 0 || samples_on_host(); }
  // The token its next step must produce (its reasoning budget's forced close), if any.
  std::optional<int32_t> forced_next() const { return budget ? budget->forced_next() : std::nullopt; }
  // A grammar's mask and a reasoning budget's forced tokens decide a token at a time: such a request
  // decodes plainly.
  bool speculates() const { return proposer != nullptr && !matcher && !budget; }
  // Its proposer reads the target's hidden states: every step that runs it returns them.
  bool reads_hidden_states() const { return proposer && request.speculation.proposer->reads_hidden_states(); }
  // The position of the first token its next decode appends.
  int64_t decode_position() const { return prompt_length() + generated - 1 - replay; }
  // How many tokens its next decode appends: the tokens it runs again, the last sampled token and
  // its proposals; or, while more than kReplayAppendTokens are to run again, that many of them.
  int64_t decode_tokens() const {
    return replay + 1 > kReplayAppendTokens ? kReplayAppendTokens
                                            : replay + 1 + static_cast<int64_t>(proposal.size());
  }
  std::vector<int32_t> decode_input() const {
    const auto first = generated_tokens.end() - 1 - replay;
    if (replay + 1 > kReplayAppendTokens) return {first, first + kReplayAppendTokens};
    std::vector<int32_t> input(first, generated_tokens.end());
    input.insert(input.end(), proposal.begin(), proposal.end());
    return input;
  }
};

namespace {

std::vector<std::pair<int32_t, float>> top_logprobs(std::span<const float> logits, int32_t count) {
  const double maximum = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (float logit : logits) sum += std::exp(static_cast<double>(logit) - maximum);
  const double log_sum = std::log(sum);
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  const size_t keep = std::min<size_t>(count, order.size());
  std::partial_sort(order.begin(), order.begin() + keep, order.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  std::vector<std::pair<int32_t, float>> top;
  for (size_t i = 0; i < keep; ++i)
    top.emplace_back(order[i], static_cast<float>(logits[order[i]] - maximum - log_sum));
  return top;
}

TokenEvent final_event(FinishReason reason, std::string error) {
  TokenEvent event;
  event.finished = true;
  event.finish_reason = reason;
  event.error = std::move(error);
  return event;
}

}  // namespace

GenerationCore::GenerationCore(Model& model, int32_t slots, int64_t context_tokens, int64_t prefill_chunk,
                               int64_t step_token_budget, bool prefix_cache, int64_t kv_blocks,
                               int64_t prefix_snapshots)
    : model_(model), prefill_chunk_(prefill_chunk), step_token_budget_(step_token_budget) {
  if (!model_.computes_logits())
    fail("the model has no lm_head to generate with (a bare decoder that does not tie it to the embedding): it "
         "serves embeddings only (kiln serve --embeddings)");
  const int64_t table_width = kv_table_width(context_tokens);
  pool_blocks_ = kv_blocks > 0 ? kv_blocks : slots * table_width;
  if (pool_blocks_ < table_width)
    fail("a KV pool of {} blocks ({} tokens) cannot hold one sequence of the context's {} tokens", pool_blocks_,
         pool_blocks_ * kKvBlockTokens, context_tokens);
  if (prefix_snapshots < 0 || prefix_snapshots > std::numeric_limits<int32_t>::max())
    fail("the prefix cache keeps 0 to {} snapshots, not {}", std::numeric_limits<int32_t>::max(), prefix_snapshots);
  // Decode steps run as captured graphs where the backend can; their padded rows need the spare
  // slots of decode_bucket(slots) (engine/decode_graph.h), which requests never hold.
  const bool graphs = DecodeGraphs::supported(model_);
  const int64_t cache_slots = graphs ? decode_bucket(slots) : slots;
  scratch_block_ = static_cast<int32_t>(pool_blocks_);
  cache_ = model_.make_cache(cache_slots, context_tokens, pool_blocks_ + 1);
  const std::vector<int32_t> scratch_table(static_cast<size_t>(table_width), scratch_block_);
  for (int32_t slot = 0; slot < cache_slots; ++slot) cache_->assign_blocks(slot, 0, scratch_table);
  // One pool per cache, and a cache serves one model: the identity need not tell models apart.
  // The handles of the snapshots it lets go of are free entries again.
  pool_ = std::make_unique<KvBlockPool>(KvBlockPoolOptions{
      pool_blocks_, kKvBlockTokens, 0, [this](int32_t snapshot) { free_snapshots_.push_back(snapshot); }});
  if (graphs) decode_graphs_ = std::make_unique<DecodeGraphs>(model_, *cache_);
  for (int32_t slot = slots - 1; slot >= 0; --slot) free_slots_.push_back(slot);
  const bool resumes_anywhere = cache_->resumes_at_any_position();
  prefix_cache_ = prefix_cache && (resumes_anywhere || prefix_snapshots > 0);
  snapshots_ = prefix_cache_ && !resumes_anywhere;
  if (snapshots_) {
    cache_->allocate_snapshots(prefix_snapshots);
    for (auto entry = static_cast<int32_t>(prefix_snapshots) - 1; entry >= 0; --entry) free_snapshots_.push_back(entry);
  }
}

GenerationCore::~GenerationCore() = default;

// Blocks the pool can hand out: the free ones and the cached ones no sequence holds.
int64_t GenerationCore::blocks_available() const {
  const KvBlockPoolStats stats = pool_->stats();
  return stats.free_blocks + stats.cached_unreferenced_blocks;
}

bool GenerationCore::can_admit(const GenerationRequest& request) const {
  const auto prompt_blocks = kv_table_width(static_cast<int64_t>(request.prompt.size()));
  return !free_slots_.empty() && preempted_.empty() && prompt_blocks <= blocks_available();
}

// Puts a sequence (new, or preempted) into a free slot on the longest cached run of blocks that
// begins what it prefills, leaving at least one token of it to run; with snapshots, the run is cut
// back to its last block that has one, and the slot's recurrent state resumes from it.
void GenerationCore::start_in_slot(Sequence& sequence, int32_t slot) {
  sequence.slot = slot;
  sequence.prefilled = 0;
  sequence.blocks.clear();
  sequence.cached_blocks = 0;
  std::optional<int32_t> snapshot;
  // A proposer that reads the target's hidden states must see those of every position it runs
  // over, so its request reuses no prefix.
  if (prefix_cache_ && !sequence.reads_hidden_states()) {
    const std::vector<int32_t> target = sequence.tokens(0, sequence.prefill_target);
    PrefixMatch match = pool_->match_prefix(target, sequence.prefill_target - 1,
                                            snapshots_ ? PrefixResume::kSnapshotBlock : PrefixResume::kAnyBlock);
    sequence.blocks = std::move(match.blocks);
    sequence.cached_blocks = sequence.blocks.size();
    sequence.prefilled = static_cast<int64_t>(sequence.blocks.size()) * kKvBlockTokens;
    snapshot = match.snapshot;
  }
  if (sequence.blocks.empty()) {
    cache_->reset_slot(slot);
    return;
  }
  cache_->assign_blocks(slot, 0, sequence.blocks);
  // Queued before any later save can reuse the entry (ModelCache::restore_snapshot).
  if (snapshots_) cache_->restore_snapshot(*snapshot, slot);
}

void GenerationCore::admit(GenerationRequest request, std::shared_ptr<RequestStream> stream) {
  if (!can_admit(request))
    fail("no room for a new request: {} free slots, {} preempted requests waiting, {} blocks available for a prompt "
         "of {} tokens",
         free_slots_.size(), preempted_.size(), blocks_available(), request.prompt.size());
  const int32_t slot = free_slots_.back();
  free_slots_.pop_back();
  Sampler sampler(request.sampling, request.prompt);
  auto sequence =
      std::make_unique<Sequence>(Sequence{std::move(request), std::move(stream), std::move(sampler), slot});
  sequence->id = ++admitted_;
  if (sequence->request.grammar) {
    sequence->matcher.emplace(sequence->request.grammar);
    sequence->mask = grammar::empty_mask(sequence->request.grammar->vocabulary().size());
  }
  if (sequence->request.reasoning_budget) sequence->budget.emplace(*sequence->request.reasoning_budget);
  if (sequence->request.speculation.enabled() && !sequence->matcher && !sequence->budget) {
    sequence->proposer = sequence->request.speculation.proposer->start(sequence->request.prompt);
    sequence->history = sequence->request.prompt;
  }
  sequence->prefill_target = sequence->prompt_length();
  start_in_slot(*sequence, slot);
  prefix_query_tokens_ += sequence->prompt_length();
  prefix_hit_tokens_ += sequence->prefilled;
  sequence->stream->cached_tokens_.store(sequence->prefilled);
  running_.push_back(std::move(sequence));
}

// Makes sure a sequence's blocks cover its positions [0, positions), taking the missing ones from
// the pool; false (taking none) when the pool has too few.
bool GenerationCore::reserve_blocks(Sequence& sequence, int64_t positions) {
  const int64_t needed = kv_table_width(positions) - static_cast<int64_t>(sequence.blocks.size());
  if (needed <= 0) return true;
  std::optional<std::vector<int32_t>> taken = pool_->allocate(needed);
  if (!taken) return false;
  cache_->assign_blocks(sequence.slot, static_cast<int64_t>(sequence.blocks.size()), *taken);
  sequence.blocks.insert(sequence.blocks.end(), taken->begin(), taken->end());
  return true;
}

// The blocks a step's works write: a prefill's chunk, a decode's tokens.
bool GenerationCore::reserve_step_blocks(const StepPlan& plan) {
  for (const PlannedWork& work : plan.work) {
    Sequence& sequence = *running_[work.sequence];
    const int64_t end = work.decodes ? sequence.decode_position() + work.decode_tokens : work.end;
    if (!reserve_blocks(sequence, end)) return false;
  }
  return true;
}

// Puts a sequence's full blocks that it holds for sure into the prefix index, in order. Where the
// index has the same block already (another sequence prefilled the same tokens), the sequence takes
// that one instead: the rows are the same bits (one model, the same tokens at the same positions).
//
// A hybrid model's attention rows depend on how its Gated DeltaNet layers ran the positions before
// them (whole 64-token chunks, or token by token: backend.h), so of its blocks only those its
// prompt's prefill wrote in whole chunks are cached — the blocks below the last boundary it
// prefilled, the rows a cold prefill of a longer prompt writes — never those its decode steps
// (or the token-by-token tail of its prompt) wrote.
void GenerationCore::cache_full_blocks(Sequence& sequence) {
  if (!prefix_cache_) return;
  const int64_t positions = snapshots_ ? sequence.prefilled : sequence.known_positions();
  const auto full = static_cast<size_t>(positions / kKvBlockTokens);
  for (size_t i = sequence.cached_blocks; i < std::min(full, sequence.blocks.size()); ++i) {
    const auto begin = static_cast<int64_t>(i) * kKvBlockTokens;
    const std::optional<int32_t> parent = i == 0 ? std::nullopt : std::optional<int32_t>(sequence.blocks[i - 1]);
    const int32_t cached =
        pool_->cache_block(parent, sequence.blocks[i], sequence.tokens(begin, begin + kKvBlockTokens));
    if (cached != sequence.blocks[i]) {
      sequence.blocks[i] = cached;
      cache_->assign_blocks(sequence.slot, static_cast<int64_t>(i), std::span<const int32_t>(&cached, 1));
    }
    sequence.cached_blocks = i + 1;
  }
}

// Keeps the recurrent state of a hybrid sequence whose prefill chunk has just ended at one of its
// snapshot boundaries as the snapshot of the block that ends there, cached first (the blocks it
// prefilled) — unless that block has one already (the same state: one model, the same tokens, the
// same chunks). The entry is a free one, or else the one least recently given or used.
void GenerationCore::keep_snapshot(Sequence& sequence) {
  cache_full_blocks(sequence);
  const int32_t block = sequence.blocks[static_cast<size_t>(sequence.prefilled / kKvBlockTokens) - 1];
  if (pool_->snapshot(block)) return;
  if (free_snapshots_.empty()) pool_->drop_least_recently_used_snapshot();
  if (free_snapshots_.empty()) fail("the prefix cache's snapshot entries are neither free nor held by blocks");
  const int32_t entry = free_snapshots_.back();
  free_snapshots_.pop_back();
  cache_->save_snapshot(sequence.slot, entry);
  pool_->add_snapshot(block, entry);
}

// Gives a sequence's blocks back (the cached ones stay in the index) and frees its slot, whose first
// table entry goes back to the scratch block.
void GenerationCore::release_blocks(Sequence& sequence) {
  pool_->release(sequence.blocks);
  sequence.blocks.clear();
  sequence.cached_blocks = 0;
  cache_->assign_blocks(sequence.slot, 0, std::span<const int32_t>(&scratch_block_, 1));
  free_slots_.push_back(sequence.slot);
}

// Takes the most recently admitted running request's blocks back (vLLM's recompute preemption): it
// keeps its tokens and its sampler, and runs again, first of all, when a slot and the blocks of
// what it prefills are free; its full blocks stay cached meanwhile, so it may find them again.
void GenerationCore::preempt_latest() {
  const auto latest = std::max_element(running_.begin(), running_.end(),
                                       [](const auto& a, const auto& b) { return a->id < b->id; });
  Sequence& sequence = **latest;
  cache_full_blocks(sequence);
  release_blocks(sequence);
  sequence.resuming = sequence.generated > 0;
  // A KV cache takes back its generated tokens as prompt (attention's rows are the same bits however
  // they are split); a recurrent state runs them again as decode did (the resuming commit).
  sequence.prefill_target = sequence.prompt_length();
  if (cache_->resumes_at_any_position()) sequence.prefill_target += std::max<int64_t>(sequence.generated - 1, 0);
  sequence.prefilled = 0;
  sequence.replay = 0;
  sequence.proposal.clear();
  ++preemptions_;
  preempted_.push_back(std::move(*latest));
  running_.erase(latest);
}

void GenerationCore::resume_preempted() {
  while (!preempted_.empty() && !free_slots_.empty() &&
         kv_table_width(preempted_.front()->prefill_target) <= blocks_available()) {
    const int32_t slot = free_slots_.back();
    free_slots_.pop_back();
    start_in_slot(*preempted_.front(), slot);
    running_.push_back(std::move(preempted_.front()));
    preempted_.pop_front();
  }
}

KvCacheStats GenerationCore::kv_cache_stats() const {
  const KvBlockPoolStats pool = pool_->stats();
  return {pool.total_blocks, pool.free_blocks, pool.cached_unreferenced_blocks, pool.in_use_blocks, preemptions_,
          pool.snapshots};
}

int64_t GenerationCore::cache_tokens_used() const {
  int64_t used = 0;
  for (const auto& sequence : running_) used += static_cast<int64_t>(sequence->blocks.size()) * kKvBlockTokens;
  return used;
}

void GenerationCore::cancel_all(const std::string& why) {
  for (auto& sequence : running_) sequence->stream->push(final_event(FinishReason::Cancelled, why));
  for (auto& sequence : preempted_) sequence->stream->push(final_event(FinishReason::Cancelled, why));
}

// Ends a running request: what its blocks hold for sure stays cached for later prompts.
void GenerationCore::end(Sequence& sequence, TokenEvent event) {
  sequence.stream->push(std::move(event));
  cache_full_blocks(sequence);
  release_blocks(sequence);
}

// Drops cancelled requests (a disconnected client) before spending compute on them.
void GenerationCore::drop_cancelled() {
  std::erase_if(running_, [&](const std::unique_ptr<Sequence>& sequence) {
    if (!sequence->stream->cancelled()) return false;
    end(*sequence, final_event(FinishReason::Cancelled, ""));
    return true;
  });
  std::erase_if(preempted_, [&](const std::unique_ptr<Sequence>& sequence) {
    if (!sequence->stream->cancelled()) return false;
    sequence->stream->push(final_event(FinishReason::Cancelled, ""));  // it holds no slot or block
    return true;
  });
}

// A step that fails ends every running request with the error; the caller keeps serving.
void GenerationCore::fail_running(const std::exception& error) {
  while (decode_graphs_ && decode_graphs_->queued() > 0) {
    try {
      decode_graphs_->collect();
    } catch (const std::exception&) {
      // the step's own error is the one reported
    }
  }
  in_flight_.clear();
  for (auto& sequence : running_) {
    sequence->stream->push(final_event(FinishReason::Error, error.what()));
    release_blocks(*sequence);  // what the failed step wrote is unknown: nothing more is cached
  }
  running_.clear();
}

// Takes a sampled token into its request (row: its logits, for top logprobs; `forced`: the token
// was forced, not sampled, and is its own only alternative); false when the request ends with it:
// at a stop id, else at max_tokens.
bool GenerationCore::accept(Sequence& sequence, const SampledToken& token, std::span<const float> row, bool forced) {
  ++sequence.generated;
  sequence.generated_tokens.push_back(token.token);
  sequence.next_input = token.token;
  if (sequence.proposer) sequence.history.push_back(token.token);
  sequence.sampler.accept(token.token);
  if (sequence.budget) sequence.budget->accept(token.token);
  TokenEvent event{token.token, token.logprob, {}, false, FinishReason::Stop, ""};
  if (sequence.request.top_logprobs > 0)
    event.top_logprobs = forced ? std::vector<std::pair<int32_t, float>>{{token.token, 0.0f}}
                                : top_logprobs(row, sequence.request.top_logprobs);
  const auto& stops = sequence.request.stop_ids;
  const bool stop_id = std::find(stops.begin(), stops.end(), token.token) != stops.end();
  // The mask allowed the token, so the matcher takes it.
  if (sequence.matcher && !stop_id) sequence.matcher->accept_token(token.token);
  if (stop_id || (sequence.matcher && !sequence.matcher->can_continue())) {
    event.finished = true;
    event.finish_reason = FinishReason::Stop;
  } else if (sequence.generated >= sequence.request.max_tokens) {
    event.finished = true;
    event.finish_reason = FinishReason::Length;
  }
  if (event.finished) {
    end(sequence, std::move(event));
    return false;
  }
  sequence.stream->push(std::move(event));
  return true;
}

// Samples a constrained request's token from its logits with every token its grammar refuses at
// -inf (a stop id only where the grammar can end), then takes it as accept() does. The masked row
// depends only on the request's own logits and grammar state, so its tokens are the same alone or
// in a batch, on every backend.
bool GenerationCore::sample_on_host(Sequence& sequence, std::span<const float> logits) {
  grammar::GrammarMatcher& matcher = *sequence.matcher;
  matcher.fill_mask(sequence.mask);
  if (matcher.can_end())
    for (int32_t stop : sequence.request.stop_ids) sequence.mask[stop >> 6] |= uint64_t{1} << (stop & 63);
  // A word of the mask at a time: most words are all refused or all allowed.
  constexpr float kRefused = -std::numeric_limits<float>::infinity();
  sequence.masked_logits.assign(logits.size(), kRefused);
  bool any_allowed = false;
  for (size_t word = 0; word < sequence.mask.size(); ++word) {
    const uint64_t bits = sequence.mask[word];
    if (bits == 0) continue;
    any_allowed = true;
    const size_t first = word * 64, last = std::min(first + 64, logits.size());
    for (size_t id = first; id < last; ++id)
      if ((bits >> (id - first)) & 1) sequence.masked_logits[id] = logits[id];
  }
  if (!any_allowed) {
    end(sequence, final_event(FinishReason::Error,
                              "no token of the vocabulary continues the output as its grammar requires"));
    return false;
  }
  return accept(sequence, sequence.sampler.sample(sequence.masked_logits), sequence.masked_logits);
}

// Takes the target's choices at the rows of a verify step (`rows`: one logit row per appended token
// from the last sampled one on, each row the distribution of the token after it), while the
// proposal at a row equals the choice there: each choice is made as a plain decode step makes it
// (the same logits, the request's next draw), so what is emitted is the plain run's tokens. Then
// rolls back what was rejected. False when the request ended.
bool GenerationCore::verify(Sequence& sequence, std::span<const float> rows) {
  const auto vocab = static_cast<size_t>(model_.config().vocab_size);
  return verify_choices(sequence, [&](size_t row) {
    const std::span<const float> logits = rows.subspan(row * vocab, vocab);
    return std::pair{sequence.sampler.sample(logits), logits};
  });
}

// verify() with the choices a verify graph made on the device (`chosen`: one per row, each with the
// draw its row takes if emitted, read ahead of the stream): every emitted token takes its draw.
bool GenerationCore::verify(Sequence& sequence, std::span<const SampledToken> chosen) {
  return verify_choices(sequence, [&](size_t row) {
    if (sequence.sampler.params().temperature != 0.0f) sequence.sampler.next_uniform();
    return std::pair{chosen[row], std::span<const float>()};
  });
}

bool GenerationCore::verify_choices(Sequence& sequence, const RowChoice& choose) {
  const std::vector<int32_t> proposal = std::move(sequence.proposal);
  sequence.proposal.clear();
  ++speculation_counts_.verify_steps;
  speculation_counts_.proposed += static_cast<int64_t>(proposal.size());
  size_t accepted = 0;
  for (size_t row = 0; row <= proposal.size(); ++row) {
    const auto [token, logits] = choose(row);
    const bool matches = row < proposal.size() && token.token == proposal[row];
    if (matches) ++accepted;
    if (!accept(sequence, token, logits)) {
      speculation_counts_.accepted += static_cast<int64_t>(accepted);
      return false;
    }
    if (!matches) break;
  }
  speculation_counts_.accepted += static_cast<int64_t>(accepted);
  sequence.replay = 0;
  if (accepted < proposal.size() && !cache_->resumes_at_any_position()) {
    // The state holds the rejected tokens too: back to before the step, and the token it started
    // from and the accepted proposals run again.
    cache_->restore_slot_state(sequence.slot);
    sequence.replay = static_cast<int64_t>(accepted) + 1;
  }
  return true;
}

// Asks each speculating request that decodes this step for its proposals: at most its speculation's
// tokens, and fewer than its max_tokens leave (a verify step emits up to one token more than it
// proposes). A request that runs tokens again proposes nothing: its state is saved before the step
// that proposes, and must first hold every token it emitted. A request whose proposer reads hidden
// states is asked at every step, for none when it may not propose (ProposalAsk).
// The requests of one method are asked together (a draft model runs them as one batch).
void GenerationCore::propose() {
  const auto vocab = static_cast<int32_t>(model_.config().vocab_size);
  std::map<Proposer*, std::vector<ProposalAsk>> asks;
  std::map<Proposer*, std::vector<Sequence*>> askers;
  for (auto& sequence : running_) {
    sequence->proposal.clear();
    if (!sequence->speculates()) continue;
    const int64_t room = sequence->request.max_tokens - sequence->generated - 1;
    int32_t count = 0;
    if (sequence->decoding() && sequence->replay == 0)
      count = static_cast<int32_t>(std::max<int64_t>(0, std::min<int64_t>(sequence->request.speculation.tokens, room)));
    if (count == 0 && !sequence->reads_hidden_states()) continue;
    Proposer* method = sequence->request.speculation.proposer.get();
    asks[method].push_back({sequence->proposer.get(), sequence->history, count, {}});
    askers[method].push_back(sequence.get());
  }
  for (auto& [method, method_asks] : asks) {
    method->propose_together(method_asks);
    for (size_t i = 0; i < method_asks.size(); ++i) {
      std::vector<int32_t>& proposal = method_asks[i].proposal;
      // A proposal past its count or outside the vocabulary is cut there: it could never be accepted.
      if (proposal.size() > static_cast<size_t>(method_asks[i].count))
        proposal.resize(static_cast<size_t>(method_asks[i].count));
      const auto invalid =
          std::find_if(proposal.begin(), proposal.end(), [&](int32_t t) { return t < 0 || t >= vocab; });
      proposal.erase(invalid, proposal.end());
      askers[method][i]->proposal = std::move(proposal);
    }
  }
  if (decode_graphs_) pad_proposals_for_graph();
}

// A verify graph runs a step whose rows all append as many tokens (engine/decode_graph.h): where
// every running request verifies proposals, the shorter ones are filled up to the longest with
// their own last token, while each stays within its speculation's tokens and its max_tokens. A
// filler is a proposal like any other — accepted only if it is the target's own choice — so the
// output is unchanged; it only lets the step run as a graph.
void GenerationCore::pad_proposals_for_graph() {
  size_t longest = 0;
  for (const auto& sequence : running_) {
    if (sequence->proposal.empty()) return;
    longest = std::max(longest, sequence->proposal.size());
  }
  for (const auto& sequence : running_) {
    const int64_t room = std::min<int64_t>(sequence->request.speculation.tokens,
                                           sequence->request.max_tokens - sequence->generated - 1);
    if (static_cast<int64_t>(longest) > room) return;
  }
  for (auto& sequence : running_) sequence->proposal.resize(longest, sequence->proposal.back());
}

// The rows of a decode step for every running request, each taking its last token (from the
// host, or fed on the device from the step in flight).
std::vector<DecodeRow> GenerationCore::decode_rows(bool fed) const {
  std::vector<DecodeRow> rows;
  for (const auto& sequence : running_) {
    // A row sampled on the host, or whose token is forced, is greedy on the device: its device
    // token is not used, and it takes no draw from the request's stream.
    const bool device_token_unused = sequence->samples_on_host() || sequence->forced_next();
    DecodeRow row{sequence->slot, static_cast<int32_t>(sequence->prompt_length() + sequence->generated - 1),
                  sequence->next_input, device_token_unused ? nullptr : &sequence->sampler};
    if (fed) {
      row.position += 1;
      row.fed_from = static_cast<int32_t>(std::find(in_flight_.begin(), in_flight_.end(), sequence->id) -
                                          in_flight_.begin());
    }
    rows.push_back(row);
  }
  return rows;
}

// Whether a step is a verify graph's (engine/decode_graph.h): every running request decodes in it,
// each appending its last sampled token and as many proposals as the others (nothing to run again
// after a rollback). Its recurrent states are saved first, as for a direct verify step.
bool GenerationCore::verifies_as_graph(const StepPlan& plan) const {
  if (plan.work.size() != running_.size() || running_.empty()) return false;
  const size_t proposals = running_.front()->proposal.size();
  for (const PlannedWork& work : plan.work) {
    const Sequence& sequence = *running_[work.sequence];
    if (!work.decodes || sequence.replay > 0 || sequence.proposal.empty() || sequence.proposal.size() != proposals)
      return false;
  }
  return true;
}

// The rows of a verify graph's step: each request's last sampled token and its proposals.
std::vector<DecodeRow> GenerationCore::verify_rows() const {
  std::vector<DecodeRow> rows;
  for (const auto& sequence : running_) {
    rows.push_back({sequence->slot, static_cast<int32_t>(sequence->decode_position()), sequence->next_input,
                    &sequence->sampler, -1, sequence->proposal});
  }
  return rows;
}

std::vector<uint64_t> GenerationCore::running_ids() const {
  std::vector<uint64_t> ids;
  for (const auto& sequence : running_) ids.push_back(sequence->id);
  return ids;
}

// The next decode step is queued before reading the tokens of the one in flight — it takes them on
// the device — when every running request was in that step and decodes again, none needs its
// logits (logprobs, a grammar's mask: its next token depends on the one in flight), none may have
// either token forced (a reasoning budget's close: the step would feed the device's token, and
// draw for it), each has room for two more tokens, and no waiting request could be admitted now
// (it would need a prefill step first). A speculating request proposes from its tokens on the host.
bool GenerationCore::queue_next_decode(const std::function<bool()>& requests_waiting) const {
  const bool every_request_decodes_again = std::all_of(running_.begin(), running_.end(), [&](const auto& sequence) {
    return std::find(in_flight_.begin(), in_flight_.end(), sequence->id) != in_flight_.end() &&
           !sequence->needs_logits() && !sequence->speculates() &&
           (!sequence->budget || sequence->budget->next_two_free()) &&
           sequence->generated + 2 <= sequence->request.max_tokens;
  });
  return every_request_decodes_again && preempted_.empty() && !(!free_slots_.empty() && requests_waiting());
}

// A decode step is in flight (queued, its tokens not yet read): queues the next one where it may,
// then reads the tokens of the one in flight. False when the step failed.
bool GenerationCore::advance_in_flight(const std::function<bool()>& requests_waiting) {
  // The next step writes each row's next position: its block must be there before it is queued.
  bool queue_next = queue_next_decode(requests_waiting);
  for (auto& sequence : running_)
    queue_next = queue_next && reserve_blocks(*sequence, sequence->prompt_length() + sequence->generated + 1);
  std::vector<uint64_t> next;
  std::vector<SampledToken> tokens;
  try {
    if (queue_next && !running_.empty()) {
      decode_graphs_->launch(decode_rows(true));
      next = running_ids();
    }
    tokens = decode_graphs_->collect();
  } catch (const std::exception& error) {
    fail_running(error);
    return false;
  }
  // Rows of requests that ended meanwhile (a stop, a cancellation) are dropped.
  std::vector<std::unique_ptr<Sequence>> still_running;
  for (auto& sequence : running_) {
    const auto row = std::find(in_flight_.begin(), in_flight_.end(), sequence->id);
    if (row == in_flight_.end()) {
      still_running.push_back(std::move(sequence));
      continue;
    }
    const std::optional<int32_t> forced = sequence->forced_next();
    const SampledToken token = forced ? SampledToken{*forced, 0.0f} : tokens[row - in_flight_.begin()];
    if (accept(*sequence, token, {}, forced.has_value())) still_running.push_back(std::move(sequence));
  }
  running_ = std::move(still_running);
  for (auto& sequence : running_) cache_full_blocks(*sequence);
  in_flight_ = std::move(next);
  if (running_.empty() && !in_flight_.empty()) {
    try {
      decode_graphs_->collect();  // every request of the queued step has ended
    } catch (const std::exception& error) {
      fail_running(error);
      return false;
    }
    in_flight_.clear();
  }
  return true;
}

StepPlan GenerationCore::plan() const {
  std::vector<SequenceProgress> progress;
  for (const auto& sequence : running_)
    progress.push_back({sequence->prefill_target, sequence->prefilled, sequence->decode_tokens(),
                        snapshots_ ? sequence->last_snapshot_boundary() : 0});
  return plan_step(progress, prefill_chunk_, step_token_budget_);
}

// A step in which every sequence decodes runs as a captured graph and samples on the device; the
// logits come back only when a request asks for top logprobs or samples on the host, and otherwise
// the step is left in flight: the next step() queues the following step before reading its tokens.
GenerationCore::StepResult GenerationCore::execute(const StepPlan& plan) {
  StepResult result;
  const bool reads_hidden_states = std::any_of(running_.begin(), running_.end(),
                                               [](const auto& sequence) { return sequence->reads_hidden_states(); });
  const bool on_device = decode_graphs_ && plan.every_sequence_decodes && !reads_hidden_states;
  const bool wants_logits =
      std::any_of(running_.begin(), running_.end(), [](const auto& sequence) { return sequence->needs_logits(); });
  if (on_device && !wants_logits) {
    decode_graphs_->launch(decode_rows(false));
    in_flight_ = running_ids();
    result.left_in_flight = true;
    return result;
  }
  if (on_device) {
    result.device_tokens = decode_graphs_->step(decode_rows(false));
    result.logits = model_.backend().download(decode_graphs_->last_logits());
    return result;
  }
  if (decode_graphs_ && !wants_logits && !reads_hidden_states && verifies_as_graph(plan)) {
    if (!cache_->resumes_at_any_position())
      for (const auto& sequence : running_) cache_->save_slot_state(sequence->slot);
    result.device_tokens = decode_graphs_->step(verify_rows());
    return result;
  }
  // A step with prefill chunks (or a preempted request's tokens run again) runs directly. Where no
  // request needs its logits on the host and none verifies proposals (a row per work), its tokens
  // are still chosen on the device: only they come back, not [rows, vocab] logits sampled a row at
  // a time on the host.
  const bool verifies = std::any_of(plan.work.begin(), plan.work.end(), [&](const PlannedWork& work) {
    return work.decodes && !running_[work.sequence]->proposal.empty();
  });
  const bool chooses_on_device = decode_graphs_ && !wants_logits && !reads_hidden_states && !verifies;
  std::vector<SequenceStep> steps;
  for (const PlannedWork& work : plan.work) {
    const Sequence& sequence = *running_[work.sequence];
    if (work.decodes) {
      // A verify step's rows: from the last sampled token's on. A recurrent state is saved first,
      // to be put back if a proposal is rejected.
      if (!sequence.proposal.empty() && !cache_->resumes_at_any_position()) cache_->save_slot_state(sequence.slot);
      steps.push_back({sequence.slot, static_cast<int32_t>(sequence.decode_position()), sequence.decode_input(),
                       false, static_cast<int32_t>(1 + sequence.proposal.size()), sequence.reads_hidden_states()});
    } else
      steps.push_back({sequence.slot, static_cast<int32_t>(work.begin), sequence.tokens(work.begin, work.end), false,
                       1, sequence.reads_hidden_states()});
  }
  if (chooses_on_device) {
    const Tensor logits = forward_step(model_, *cache_, steps);
    std::vector<Sampler*> samplers;
    for (const PlannedWork& work : plan.work) {
      Sequence& sequence = *running_[work.sequence];
      samplers.push_back(sampler_chooses(work, sequence) ? &sequence.sampler : nullptr);
    }
    result.device_tokens = sample_rows_on_device(model_.backend(), logits, samplers);
    return result;
  }
  Tensor hidden;
  result.logits = run_step(model_, *cache_, steps, &hidden);
  // Each proposer that reads hidden states gets its request's rows, in the order run_step wrote them.
  int64_t hidden_row = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    if (!steps[i].hidden_states) continue;
    const auto rows = static_cast<int64_t>(steps[i].tokens.size());
    running_[plan.work[i].sequence]->proposer->observe(steps[i].first_position, hidden.slice_rows(hidden_row, rows));
    hidden_row += rows;
  }
  return result;
}

// Whether `work` ends with a token that its request's sampler chooses from the step's last logit row:
// commit's last case, the one that takes a draw from the request's stream (a prefill chunk before the
// prompt's end, a preempted request's tokens run again, max_tokens 0, a verify step, a grammar, a
// forced token or a request sampled on the host choose otherwise or not at all).
bool GenerationCore::sampler_chooses(const PlannedWork& work, const Sequence& sequence) const {
  if (!work.samples || sequence.resuming || sequence.request.max_tokens == 0) return false;
  if (work.decodes && (work.decode_tokens < sequence.replay + 1 || !sequence.proposal.empty())) return false;
  return !sequence.matcher && !sequence.forced_next() && !sequence.samples_on_host();
}

// Feeds a step's results back: the prompt tokens now in the cache, and each sampled token to its
// request (the logit rows are the planned works' in order, one each but a verify step's one per
// token it verifies; row w of the device's tokens is planned work w's).
void GenerationCore::commit(const StepPlan& plan, const StepResult& result) {
  const int64_t vocab = model_.config().vocab_size;
  const bool sampled_on_device = !result.device_tokens.empty();
  std::vector<std::unique_ptr<Sequence>> still_running;
  size_t row = 0;
  size_t logit_row = 0;
  for (size_t index = 0; index < running_.size(); ++index) {
    Sequence& sequence = *running_[index];
    if (row < plan.work.size() && plan.work[row].sequence == index) {
      const PlannedWork& work = plan.work[row];
      const size_t work_row = row++;
      const size_t first_logit_row = logit_row;
      const size_t logit_rows = 1 + sequence.proposal.size();
      logit_row += work.decodes ? logit_rows : 1;
      if (!work.decodes) {
        sequence.prefilled = work.end;
        // The state after the chunk, before the next step runs on from it.
        if (snapshots_ && sequence.snapshots_at(work.end)) keep_snapshot(sequence);
      }
      if (work.samples && sequence.resuming) {
        // A preempted request has prefilled again what it had (a KV cache: its prompt and every
        // token it generated but the last), or its prompt (a recurrent state: its generated tokens
        // run again as appends, the recurrent steps that decoded them): it decodes on from its last
        // token, which it already sampled.
        sequence.resuming = false;
        if (sequence.prefill_target > sequence.prompt_length())
          sequence.prefill_target = sequence.prefilled = sequence.prompt_length();
        else
          sequence.replay = sequence.generated - 1;
        still_running.push_back(std::move(running_[index]));
        continue;
      }
      if (work.decodes && work.decode_tokens < sequence.replay + 1) {
        sequence.replay -= work.decode_tokens;  // part of what it runs again: nothing is sampled
        still_running.push_back(std::move(running_[index]));
        continue;
      }
      if (work.samples && sequence.request.max_tokens == 0) {
        end(sequence, final_event(FinishReason::Length, ""));
        continue;
      }
      if (work.decodes && !sequence.proposal.empty()) {
        const bool verified = sampled_on_device
                                  ? verify(sequence, std::span<const SampledToken>(result.device_tokens).subspan(
                                                         first_logit_row, logit_rows))
                                  : verify(sequence, std::span<const float>(
                                                         result.logits.data<float>() + first_logit_row * vocab,
                                                         logit_rows * static_cast<size_t>(vocab)));
        if (!verified) continue;
        still_running.push_back(std::move(running_[index]));
        continue;
      }
      if (work.decodes) sequence.replay = 0;  // the tokens it ran again are in the cache now
      if (work.samples) {
        const std::span<const float> logits =
            result.logits.defined() ? std::span<const float>(result.logits.data<float>() + first_logit_row * vocab,
                                                             static_cast<size_t>(vocab))
                                    : std::span<const float>();
        if (sequence.matcher) {
          if (!sample_on_host(sequence, logits)) continue;
        } else if (const std::optional<int32_t> forced = sequence.forced_next()) {
          if (!accept(sequence, {*forced, 0.0f}, logits, true)) continue;
        } else {
          // sampler_chooses(work, sequence) holds here.
          const SampledToken token = sampled_on_device && !sequence.samples_on_host() ? result.device_tokens[work_row]
                                                                                       : sequence.sampler.sample(logits);
          if (!accept(sequence, token, logits)) continue;
        }
      }
    }
    still_running.push_back(std::move(running_[index]));
  }
  running_ = std::move(still_running);
  for (auto& sequence : running_) cache_full_blocks(*sequence);
}

bool GenerationCore::step(const std::function<bool()>& requests_waiting) {
  drop_cancelled();
  if (!in_flight_.empty()) return advance_in_flight(requests_waiting);
  resume_preempted();
  if (running_.empty()) return false;
  StepPlan step_plan;
  StepResult result;
  try {
    propose();
    step_plan = plan();
    // The pool is short of the step's blocks: the latest request gives its blocks back and the step
    // is planned again without it (a lone request always fits: the pool holds a whole context).
    while (!reserve_step_blocks(step_plan)) {
      if (running_.size() == 1)
        fail("the KV pool's {} blocks cannot hold one request's step (positions up to {})", pool_blocks_,
             running_.front()->known_positions() + step_plan.tokens);
      preempt_latest();
      step_plan = plan();
    }
    result = execute(step_plan);
  } catch (const std::exception& error) {
    fail_running(error);
    return false;
  }
  if (!result.left_in_flight) commit(step_plan, result);
  return true;
}

}  // namespace kiln
