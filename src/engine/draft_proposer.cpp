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
    if (tokens.empty() || count < 1) return {};
    const auto context = owner_.cache_->capacity();
    // The run the slot keeps: its tokens that begin `tokens`, less the last one, whose logits give the
    // first proposal.
    const auto mismatch = std::mismatch(ran_.begin(), ran_.end(), tokens.begin(), tokens.end());
    size_t kept = static_cast<size_t>(mismatch.first - ran_.begin());
    kept = std::min(kept, tokens.size() - 1);
    ran_.resize(kept);
    const auto length = static_cast<int64_t>(tokens.size());
    if (length + count - 1 > context) count = static_cast<int32_t>(context - length + 1);
    if (count < 1) return {};
    Tensor logits;
    for (auto begin = static_cast<int64_t>(kept); begin < length;) {
      const int64_t end = prefill_chunk_end(length, begin, owner_.prefill_chunk_);
      logits = run(std::vector<int32_t>(tokens.begin() + begin, tokens.begin() + end));
      begin = end;
    }
    std::vector<int32_t> proposal;
    for (;;) {
      const int32_t token = argmax(std::span<const float>(logits.data<float>(), static_cast<size_t>(logits.dim(1))));
      proposal.push_back(token);
      if (static_cast<int32_t>(proposal.size()) == count) return proposal;
      logits = run({token});
    }
  }

 private:
  Tensor run(std::vector<int32_t> tokens) {
    const SequenceStep step{slot_, static_cast<int32_t>(ran_.size()), tokens, false};
    Tensor logits = run_step(owner_.draft_, *owner_.cache_, {step});
    ran_.insert(ran_.end(), tokens.begin(), tokens.end());
    return logits;
  }

  DraftModelProposer& owner_;
  int32_t slot_;
  std::shared_ptr<std::vector<int32_t>> free_slots_;
  std::vector<int32_t> ran_;  // the tokens whose rows the slot holds
};

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
