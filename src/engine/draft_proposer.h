// A draft model as a proposer (`--speculative draft:DIR`): a smaller model sharing the target's
// tokenizer runs greedily for k steps from each request's tokens, in a cache of its own.
//
// Its slot holds the tokens it has run; before proposing it keeps the longest run of them that
// begins the request's tokens now and appends the rest, so what the target rejected is rolled back
// with it (truncation, which a KV cache allows: a draft whose state sums up the history is refused).
// The requests of a step draft together, one batched forward per proposed token, on the target's
// backend (invariance: a request's draft tokens do not depend on the batch).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/serving_sizes.h"
#include "engine/speculative.h"
#include "model/model.h"

namespace kiln {

// Fails, in one line saying why, unless `draft` can propose for `target`: the same vocabulary size
// (the tokenizers themselves are compared by whoever has their files) and a computed lm_head.
void check_draft_model(const ModelConfig& target, const Model& draft);

class DraftModelProposer final : public Proposer {
 public:
  // Room for `slots` requests at once of up to `context_tokens` tokens each; the prompt runs in
  // chunks of `prefill_chunk`.
  DraftModelProposer(Model& draft, int32_t slots, int64_t context_tokens,
                     int64_t prefill_chunk = kDefaultPrefillChunk);
  ~DraftModelProposer() override;
  std::string name() const override { return "draft"; }
  std::unique_ptr<SequenceProposer> start(std::span<const int32_t> prompt) override;
  // The requests' drafts run together: one draft step per chunk of what their slots have not run,
  // then one per proposed token, each step a batch of every request still drafting.
  void propose_together(std::span<ProposalAsk> asks) override;

 private:
  class Sequence;

  Model& draft_;
  std::unique_ptr<ModelCache> cache_;
  int64_t prefill_chunk_;
  std::shared_ptr<std::vector<int32_t>> free_slots_;  // shared with the sequences, which give theirs back
};

}  // namespace kiln
