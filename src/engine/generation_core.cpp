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

  int64_t prompt_length() const { return static_cast<int64_t>(request.prompt.size()); }
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
  // What its next decode appends: the tokens it runs again, the last sampled token, its proposals.
  std::vector<int32_t> decode_input() const {
    std::vector<int32_t> input(generated_tokens.end() - 1 - replay, generated_tokens.end());
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
                               int64_t step_token_budget, bool prefix_cache)
    : model_(model), prefill_chunk_(prefill_chunk), step_token_budget_(step_token_budget) {
  if (!model_.computes_logits())
    fail("the model has no lm_head to generate with (a bare decoder that does not tie it to the embedding): it "
         "serves embeddings only (kiln serve --embeddings)");
  // Decode steps run as captured graphs where the backend can; their padded rows need the spare
  // slots of decode_bucket(slots) (engine/decode_graph.h), which requests never hold.
  const bool graphs = DecodeGraphs::supported(model_);
  cache_ = model_.make_cache(graphs ? decode_bucket(slots) : slots, context_tokens);
  if (graphs) decode_graphs_ = std::make_unique<DecodeGraphs>(model_, *cache_);
  for (int32_t slot = slots - 1; slot >= 0; --slot) free_slots_.push_back(slot);
  prefix_cache_ = prefix_cache && cache_->resumes_at_any_position();
  slot_tokens_.resize(static_cast<size_t>(slots));
  slot_released_.assign(static_cast<size_t>(slots), 0);
}

GenerationCore::~GenerationCore() = default;

void GenerationCore::admit(GenerationRequest request, std::shared_ptr<RequestStream> stream) {
  if (free_slots_.empty()) fail("no free cache slot for a new request");
  const std::vector<int32_t>& prompt = request.prompt;
  // A proposer that reads the target's hidden states must see those of every prompt position, so
  // its request reuses no prefix.
  const bool reuses = prefix_cache_ && !(request.speculation.enabled() &&
                                         request.speculation.proposer->reads_hidden_states());
  // The free slot to take: the longest reusable run, else the one released longest ago.
  size_t chosen = 0;
  int64_t reused = 0;
  for (size_t i = 0; i < free_slots_.size(); ++i) {
    const std::vector<int32_t>& held = slot_tokens_[static_cast<size_t>(free_slots_[i])];
    int64_t run = 0;
    if (reuses) {
      const auto limit = static_cast<int64_t>(std::min(held.size(), prompt.size() - 1));
      while (run < limit && held[static_cast<size_t>(run)] == prompt[static_cast<size_t>(run)]) ++run;
      run -= run % kPrefixBlock;
    }
    const bool older = slot_released_[static_cast<size_t>(free_slots_[i])] <
                       slot_released_[static_cast<size_t>(free_slots_[chosen])];
    if (run > reused || (run == reused && reused == 0 && older)) {
      chosen = i;
      reused = run;
    }
  }
  const int32_t slot = free_slots_[chosen];
  free_slots_.erase(free_slots_.begin() + static_cast<std::ptrdiff_t>(chosen));
  slot_tokens_[static_cast<size_t>(slot)].clear();
  if (reused == 0) cache_->reset_slot(slot);
  prefix_query_tokens_ += static_cast<int64_t>(prompt.size());
  prefix_hit_tokens_ += reused;
  stream->cached_tokens_.store(reused);

  Sampler sampler(request.sampling, request.prompt);
  auto sequence =
      std::make_unique<Sequence>(Sequence{std::move(request), std::move(stream), std::move(sampler), slot});
  sequence->prefilled = reused;
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
  running_.push_back(std::move(sequence));
}

int64_t GenerationCore::cache_tokens_used() const {
  int64_t used = 0;
  for (const auto& sequence : running_) used += sequence->prefilled + sequence->generated;
  return used;
}

void GenerationCore::cancel_all(const std::string& why) {
  for (auto& sequence : running_) sequence->stream->push(final_event(FinishReason::Cancelled, why));
}

void GenerationCore::end(Sequence& sequence, TokenEvent event) {
  sequence.stream->push(std::move(event));
  // What the slot now holds for sure: the prompt as far as it was prefilled, then every sampled
  // token but the last, which no step has fed yet (a step in flight may have written it, and
  // rows past what is recorded are never read before being written again).
  std::vector<int32_t>& held = slot_tokens_[static_cast<size_t>(sequence.slot)];
  const std::vector<int32_t>& prompt = sequence.request.prompt;
  held.assign(prompt.begin(), prompt.begin() + static_cast<std::ptrdiff_t>(sequence.prefilled));
  if (sequence.prefilled == sequence.prompt_length() && !sequence.generated_tokens.empty())
    held.insert(held.end(), sequence.generated_tokens.begin(), sequence.generated_tokens.end() - 1);
  slot_released_[static_cast<size_t>(sequence.slot)] = ++releases_;
  free_slots_.push_back(sequence.slot);
}

// Drops cancelled requests (a disconnected client) before spending compute on them.
void GenerationCore::drop_cancelled() {
  std::erase_if(running_, [&](const std::unique_ptr<Sequence>& sequence) {
    if (!sequence->stream->cancelled()) return false;
    end(*sequence, final_event(FinishReason::Cancelled, ""));
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
    end(*sequence, final_event(FinishReason::Error, error.what()));
    slot_tokens_[static_cast<size_t>(sequence->slot)].clear();  // what the failed step wrote is unknown
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
  const std::vector<int32_t> proposal = std::move(sequence.proposal);
  sequence.proposal.clear();
  ++speculation_counts_.verify_steps;
  speculation_counts_.proposed += static_cast<int64_t>(proposal.size());
  size_t accepted = 0;
  for (size_t row = 0; row <= proposal.size(); ++row) {
    const std::span<const float> logits = rows.subspan(row * vocab, vocab);
    const SampledToken token = sequence.sampler.sample(logits);
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
    if (sequence->prefilled == sequence->prompt_length() && sequence->replay == 0)
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
  return every_request_decodes_again && !(has_free_slot() && requests_waiting());
}

// A decode step is in flight (queued, its tokens not yet read): queues the next one where it may,
// then reads the tokens of the one in flight. False when the step failed.
bool GenerationCore::advance_in_flight(const std::function<bool()>& requests_waiting) {
  const bool queue_next = queue_next_decode(requests_waiting);
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
    progress.push_back({sequence->prompt_length(), sequence->prefilled,
                        sequence->replay + 1 + static_cast<int64_t>(sequence->proposal.size())});
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
      steps.push_back({sequence.slot, static_cast<int32_t>(work.begin),
                       std::vector<int32_t>(sequence.request.prompt.begin() + work.begin,
                                            sequence.request.prompt.begin() + work.end),
                       false, 1, sequence.reads_hidden_states()});
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
      if (!work.decodes) sequence.prefilled = work.end;
      if (work.samples && sequence.request.max_tokens == 0) {
        end(sequence, final_event(FinishReason::Length, ""));
        continue;
      }
      if (work.decodes && !sequence.proposal.empty()) {
        const std::span<const float> rows(result.logits.data<float>() + first_logit_row * vocab,
                                          logit_rows * static_cast<size_t>(vocab));
        if (!verify(sequence, rows)) continue;
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
          const SampledToken token = sampled_on_device && !sequence.samples_on_host() ? result.device_tokens[work_row]
                                                                                       : sequence.sampler.sample(logits);
          if (!accept(sequence, token, logits)) continue;
        }
      }
    }
    still_running.push_back(std::move(running_[index]));
  }
  running_ = std::move(still_running);
}

bool GenerationCore::step(const std::function<bool()>& requests_waiting) {
  drop_cancelled();
  if (!in_flight_.empty()) return advance_in_flight(requests_waiting);
  if (running_.empty()) return false;
  StepPlan step_plan;
  StepResult result;
  try {
    propose();
    step_plan = plan();
    result = execute(step_plan);
  } catch (const std::exception& error) {
    fail_running(error);
    return false;
  }
  if (!result.left_in_flight) commit(step_plan, result);
  return true;
}

}  // namespace kiln
