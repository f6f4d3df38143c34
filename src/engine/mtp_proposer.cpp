#include "engine/mtp_proposer.h"

#include <algorithm>

#include "core/error.h"
#include "engine/sampler.h"

namespace kiln {
namespace {

DraftHead& loaded_head(Model& target) {
  DraftHead* head = target.draft_head();
  if (!head)
    fail("--speculative mtp: the model was loaded without its multi-token-prediction head (LoadOptions::mtp)");
  return *head;
}

}  // namespace

DraftHeadStep run_draft_head_step(Model& target, ModelCache& head_cache, const std::vector<SequenceStep>& steps,
                                  const Tensor& hidden) {
  Backend& backend = target.backend();
  DraftHead& head = loaded_head(target);
  const StepBatch batch = step_batch(steps, head_cache, "draft head's");
  std::vector<int32_t> last_rows;
  for (const SequenceSpan& span : batch.spans) last_rows.push_back(span.first_token + span.tokens - 1);
  if (hidden.dim(0) != static_cast<int64_t>(batch.token_ids.size()))
    fail("a draft head step of {} tokens was given {} hidden states", batch.token_ids.size(), hidden.dim(0));
  const BatchLayout layout = backend.make_layout(batch.spans, batch.token_ids);
  const auto rows = static_cast<int64_t>(last_rows.size());
  Tensor logits = backend.alloc({rows, target.config().vocab_size}, DType::F32);
  DraftHeadStep step{Tensor(), backend.alloc({rows, target.config().hidden_size}, backend.activation_dtype())};
  head.forward(layout, hidden, upload_row_indices(backend, last_rows), head_cache, logits, step.hidden);
  step.logits = backend.download(logits);
  return step;
}

class MtpProposer::Sequence final : public SequenceProposer {
 public:
  Sequence(MtpProposer& owner, int32_t slot) : owner_(owner), slot_(slot), free_slots_(owner.free_slots_) {}
  ~Sequence() override { free_slots_->push_back(slot_); }

  std::vector<int32_t> propose(std::span<const int32_t> tokens, int32_t count) override {
    ProposalAsk ask{this, tokens, count, {}};
    owner_.propose_together({&ask, 1});
    return std::move(ask.proposal);
  }

  int32_t slot() const { return slot_; }

  void observe(int64_t first_position, const Tensor& hidden) override {
    observed_first_ = first_position;
    observed_ = hidden;
  }

  // The head's step for a request of `tokens` that proposes `count` tokens (0: it only takes in
  // what it observed): the observed positions from `taken_` whose next token is known, or, when
  // it proposes with nothing new to take in, the last of them again (its KV row is rewritten with
  // the same values). Empty when there is nothing to run; `hidden` gets the rows' hidden states.
  SequenceStep intake(std::span<const int32_t> tokens, int32_t count, Tensor& hidden) {
    const auto end = static_cast<int64_t>(tokens.size()) - 1;  // positions p < end know x_{p+1}
    SequenceStep step{slot_, 0, {}, false, 1, false};
    if (observed_.defined()) {
      const int64_t observed_end = observed_first_ + observed_.dim(0);
      if (observed_first_ > taken_)
        fail("the MTP head missed the target's hidden states of positions {} to {} of a request", taken_,
             observed_first_ - 1);
      const int64_t stop = std::min(observed_end, end);
      if (stop > taken_) {
        step.first_position = static_cast<int32_t>(taken_);
        step.tokens.assign(tokens.begin() + taken_ + 1, tokens.begin() + stop + 1);
        hidden = observed_.slice_rows(taken_ - observed_first_, stop - taken_);
        last_hidden_ = observed_.slice_rows(stop - 1 - observed_first_, 1);
        taken_ = stop;
      }
      // An observation is let go once every row of it is taken (a rejected proposal's never is:
      // the next observation replaces it).
      if (observed_end <= taken_) observed_ = Tensor();
    }
    if (count < 1) return step;
    if (taken_ != end)
      fail("the MTP head holds {} positions of a request of {} tokens, not the {} a proposal needs", taken_,
           tokens.size(), end);
    if (!step.tokens.empty()) return step;
    step.first_position = static_cast<int32_t>(end - 1);
    step.tokens = {tokens.back()};
    hidden = last_hidden_;
    return step;
  }

 private:
  MtpProposer& owner_;
  int32_t slot_;
  std::shared_ptr<std::vector<int32_t>> free_slots_;
  int64_t taken_ = 0;        // positions 0 … taken_ − 1 hold the target's hidden states
  Tensor last_hidden_;       // the target's hidden state at taken_ − 1 (on the device)
  int64_t observed_first_ = 0;
  Tensor observed_;          // the target's hidden states from observed_first_ on, not yet all taken
};

void MtpProposer::propose_together(std::span<ProposalAsk> asks) {
  Backend& backend = target_.backend();
  const auto vocab = static_cast<size_t>(target_.config().vocab_size);
  struct Drafting {
    ProposalAsk* ask;
    int32_t count;
    int64_t row;  // its row in the last head step
  };
  std::vector<Drafting> drafting;
  std::vector<SequenceStep> steps;
  std::vector<Tensor> hidden_parts;
  for (ProposalAsk& ask : asks) {
    ask.proposal.clear();
    if (ask.tokens.empty()) continue;
    // The chained rows reach position n − 3 + count of the head's cache.
    const int64_t room = cache_->capacity() - static_cast<int64_t>(ask.tokens.size()) + 2;
    const auto count = static_cast<int32_t>(std::min<int64_t>(ask.count, room));
    Tensor hidden;
    SequenceStep step = static_cast<Sequence*>(ask.sequence)->intake(ask.tokens, count, hidden);
    if (step.tokens.empty()) continue;
    if (count >= 1) drafting.push_back({&ask, count, static_cast<int64_t>(steps.size())});
    steps.push_back(std::move(step));
    hidden_parts.push_back(hidden);
  }
  if (steps.empty()) return;
  // Every request's rows in one head step: their hidden states copied into one tensor, in order.
  int64_t total = 0;
  for (const Tensor& part : hidden_parts) total += part.dim(0);
  Tensor hidden = backend.alloc({total, target_.config().hidden_size}, backend.activation_dtype());
  for (int64_t at = 0; const Tensor& part : hidden_parts) {
    Tensor rows = hidden.slice_rows(at, part.dim(0));
    backend.copy(part, rows);
    at += part.dim(0);
  }
  DraftHeadStep last = run_draft_head_step(target_, *cache_, steps, hidden);
  const auto propose_from = [&](const DraftHeadStep& step, Drafting& request) {
    request.ask->proposal.push_back(
        argmax(std::span<const float>(step.logits.data<float>() + request.row * vocab, vocab)));
  };
  for (Drafting& request : drafting) propose_from(last, request);
  // Then each further token: the last proposal with the head's own output hidden state, at the
  // next position, for every request still short of its count.
  for (;;) {
    std::vector<SequenceStep> chained;
    std::vector<int32_t> rows;
    std::vector<Drafting*> who;
    for (Drafting& request : drafting) {
      const std::vector<int32_t>& proposal = request.ask->proposal;
      if (static_cast<int32_t>(proposal.size()) >= request.count) continue;
      const auto position = static_cast<int32_t>(request.ask->tokens.size() - 2 + proposal.size());
      chained.push_back({static_cast<Sequence*>(request.ask->sequence)->slot(), position, {proposal.back()}});
      rows.push_back(static_cast<int32_t>(request.row));
      who.push_back(&request);
    }
    if (chained.empty()) break;
    Tensor inputs = backend.alloc({static_cast<int64_t>(rows.size()), target_.config().hidden_size},
                                  backend.activation_dtype());
    backend.gather_rows(last.hidden, upload_row_indices(backend, rows), inputs);
    last = run_draft_head_step(target_, *cache_, chained, inputs);
    for (size_t i = 0; i < who.size(); ++i) {
      who[i]->row = static_cast<int64_t>(i);
      propose_from(last, *who[i]);
    }
  }
}

MtpProposer::MtpProposer(Model& target, int32_t slots, int64_t context_tokens)
    : target_(target), free_slots_(std::make_shared<std::vector<int32_t>>()) {
  cache_ = loaded_head(target).make_cache(slots, context_tokens);
  for (int32_t slot = slots - 1; slot >= 0; --slot) free_slots_->push_back(slot);
}

MtpProposer::~MtpProposer() = default;

std::unique_ptr<SequenceProposer> MtpProposer::start(std::span<const int32_t> /*prompt*/) {
  if (free_slots_->empty()) fail("the MTP head has no free cache slot for another request");
  const int32_t slot = free_slots_->back();
  free_slots_->pop_back();
  return std::make_unique<Sequence>(*this, slot);
}

}  // namespace kiln
