#include "engine/draft_proposer.h"

#include <algorithm>

#include "core/error.h"
#include "engine/generation.h"
#include "engine/sampler.h"
#include "engine/step_plan.h"

namespace kiln {

void check_draft_model(const ModelConfig& target, const Model& draft) {
  if (draft.config().vocab_size != target.vocab_size)
    fail("the draft model's vocabulary has {} tokens but the target's has {}: a draft must share the target's "
         "tokenizer", draft.config().vocab_size, target.vocab_size);
  if (!draft.computes_logits()) fail("the draft model has no lm_head to propose tokens with");
}

class DraftModelProposer::Sequence final : public SequenceProposer {
 public:
  Sequence(DraftModelProposer& owner, int32_t slot) : owner_(owner), slot_(slot), free_slots_(owner.free_slots_) {}
  ~Sequence() override { free_slots_->push_back(slot_); }

  std::vector<int32_t> propose(std::span<const int32_t> tokens, int32_t count) override {
    ProposalAsk ask{this, tokens, count, {}};
    owner_.propose_together({&ask, 1});
    return std::move(ask.proposal);
  }

  // Keeps the run of the slot's tokens that begins `tokens`, less the last one, whose logits give
  // the first proposal; returns how many tokens may be proposed before the cache is full.
  int32_t keep_common_run(std::span<const int32_t> tokens, int32_t count) {
    const auto mismatch = std::mismatch(ran_.begin(), ran_.end(), tokens.begin(), tokens.end());
    ran_.resize(std::min(static_cast<size_t>(mismatch.first - ran_.begin()), tokens.size() - 1));
    const int64_t room = owner_.cache_->capacity() - static_cast<int64_t>(tokens.size()) + 1;
    return static_cast<int32_t>(std::min<int64_t>(count, room));
  }
  // The step that appends `tokens` at the end of the slot's run (its last token's logits asked).
  SequenceStep append(std::vector<int32_t> tokens) {
    SequenceStep step{slot_, static_cast<int32_t>(ran_.size()), tokens, false};
    ran_.insert(ran_.end(), tokens.begin(), tokens.end());
    return step;
  }
  size_t ran() const { return ran_.size(); }

 private:
  DraftModelProposer& owner_;
  int32_t slot_;
  std::shared_ptr<std::vector<int32_t>> free_slots_;
  std::vector<int32_t> ran_;  // the tokens whose rows the slot holds
};

void DraftModelProposer::propose_together(std::span<ProposalAsk> asks) {
  struct Drafting {
    Sequence* sequence;
    ProposalAsk* ask;
    int32_t count;
  };
  std::vector<Drafting> drafting;
  for (ProposalAsk& ask : asks) {
    ask.proposal.clear();
    if (ask.tokens.empty() || ask.count < 1) continue;
    auto* sequence = static_cast<Sequence*>(ask.sequence);
    const int32_t count = sequence->keep_common_run(ask.tokens, ask.count);
    if (count >= 1) drafting.push_back({sequence, &ask, count});
  }
  const auto vocab = static_cast<size_t>(draft_.config().vocab_size);
  // Runs one step of the draft over `who`'s `inputs` and gives each the argmax of its last row when
  // `done(i)` says its input ended what it had to append.
  const auto run = [&](const std::vector<size_t>& who, std::vector<SequenceStep> steps, const auto& done) {
    const Tensor logits = run_step(draft_, *cache_, steps);
    for (size_t row = 0; row < who.size(); ++row)
      if (done(who[row]))
        drafting[who[row]].ask->proposal.push_back(
            argmax(std::span<const float>(logits.data<float>() + row * vocab, vocab)));
  };
  // Every request first appends what its slot has not run (a prompt in chunks), all in one step per
  // chunk; the chunk that ends it gives its first proposal. Then each proposed token is appended in
  // turn, one token per request and step, until each has its count.
  for (;;) {
    std::vector<size_t> who;
    std::vector<SequenceStep> steps;
    for (size_t i = 0; i < drafting.size(); ++i) {
      const std::span<const int32_t> tokens = drafting[i].ask->tokens;
      const auto begin = static_cast<int64_t>(drafting[i].sequence->ran());
      const auto length = static_cast<int64_t>(tokens.size());
      if (begin == length) continue;
      const int64_t end = prefill_chunk_end(length, begin, prefill_chunk_);
      who.push_back(i);
      steps.push_back(
          drafting[i].sequence->append(std::vector<int32_t>(tokens.begin() + begin, tokens.begin() + end)));
    }
    if (who.empty()) break;
    run(who, std::move(steps),
        [&](size_t i) { return drafting[i].sequence->ran() == drafting[i].ask->tokens.size(); });
  }
  for (;;) {
    std::vector<size_t> who;
    std::vector<SequenceStep> steps;
    for (size_t i = 0; i < drafting.size(); ++i) {
      const std::vector<int32_t>& proposal = drafting[i].ask->proposal;
      if (static_cast<int32_t>(proposal.size()) >= drafting[i].count) continue;
      who.push_back(i);
      steps.push_back(drafting[i].sequence->append({proposal.back()}));
    }
    if (who.empty()) break;
    run(who, std::move(steps), [](size_t) { return true; });
  }
}

DraftModelProposer::DraftModelProposer(Model& draft, int32_t slots, int64_t context_tokens, int64_t prefill_chunk)
    : draft_(draft), prefill_chunk_(prefill_chunk), free_slots_(std::make_shared<std::vector<int32_t>>()) {
  check_prefill_chunk(prefill_chunk);
  cache_ = draft_.make_cache(slots, context_tokens);
  if (!cache_->resumes_at_any_position())
    fail("the draft model keeps a recurrent state, which cannot be rolled back by truncation: draft with a "
         "model whose layers are all attention");
  for (int32_t slot = slots - 1; slot >= 0; --slot) free_slots_->push_back(slot);
}

DraftModelProposer::~DraftModelProposer() = default;

std::unique_ptr<SequenceProposer> DraftModelProposer::start(std::span<const int32_t> /*prompt*/) {
  if (free_slots_->empty()) fail("the draft model has no free cache slot for another request");
  const int32_t slot = free_slots_->back();
  free_slots_->pop_back();
  return std::make_unique<Sequence>(*this, slot);
}

}  // namespace kiln
