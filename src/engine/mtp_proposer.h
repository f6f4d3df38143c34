// Speculation with the target's own multi-token-prediction head (`--speculative mtp`: Qwen3.5's MTP
// layers, model/model.h's DraftHead; docs/speculative.md).
//
// The head's KV cache holds, at each position p of a request, the pair (x_{p+1}, h_p): the token
// that follows p and the target's final hidden state at p, as vLLM's proposer keeps it. The target
// returns its hidden states from every step that runs the request (SequenceProposer::observe: a
// prefill chunk's, a verify step's); before the next proposal the head takes in the positions whose
// next token is now known — the prompt's chunk by chunk, then the tokens each verify step accepted
// and the target's own — in one head step, whose last row (position n − 2 of n tokens) gives the
// first proposal. Each further proposal chains, as vLLM's does: the last proposed token with the
// head's own output hidden state, one position on.
//
// Rollback: the chained rows lie past the positions that hold the target's hidden states, and are
// written over when the verified tokens are taken in (a KV cache's rows past a sequence's end are
// never read before they are written again). The requests of a step draft together: one head step
// for what they take in, then one per further proposed token, each a batch of every request still
// drafting (invariance: a request's proposals do not depend on the batch).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/generation.h"
#include "engine/speculative.h"
#include "model/model.h"

namespace kiln {

// One step of a draft head: `steps`' tokens (their slots and positions in `head_cache`), token t of
// the flattened batch with row t of `hidden` [tokens, hidden_size] (the activation dtype, on the
// device). The last token of each step gives its logits (host f32 [steps, vocab]) and its output
// hidden state (on the device, [steps, hidden_size]): what a chained step takes.
struct DraftHeadStep {
  Tensor logits;
  Tensor hidden;
};
DraftHeadStep run_draft_head_step(Model& target, ModelCache& head_cache, const std::vector<SequenceStep>& steps,
                                  const Tensor& hidden);

class MtpProposer final : public Proposer {
 public:
  // Room for `slots` requests at once of up to `context_tokens` tokens each, in a cache of the
  // target's draft head; fails, in one line, when the target was loaded without one.
  MtpProposer(Model& target, int32_t slots, int64_t context_tokens);
  ~MtpProposer() override;
  std::string name() const override { return "mtp"; }
  bool reads_hidden_states() const override { return true; }
  std::unique_ptr<SequenceProposer> start(std::span<const int32_t> prompt) override;
  void propose_together(std::span<ProposalAsk> asks) override;

 private:
  class Sequence;

  Model& target_;
  std::unique_ptr<ModelCache> cache_;  // the draft head's
  std::shared_ptr<std::vector<int32_t>> free_slots_;  // shared with the sequences, which give theirs back
};

}  // namespace kiln
