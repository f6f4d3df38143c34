// Exact speculative decoding: a proposer guesses the next tokens of a sequence, one append of the
// last sampled token and the k guesses runs them through the target model, and the guesses are
// taken while each equals the token the target itself chooses at its position.
//
// Why the output is the plain run's, token for token: a (k+1)-token append gives each row the logits
// a one-token decode gives it (DEVELOPERS.md's invariance contract; the Gated DeltaNet rule runs an
// append of fewer than 64 tokens through its recurrent steps, as decode does), and the choice at
// each row is the plain run's rule: greedy's argmax, or the request's own Sampler, which takes the
// next draw of its stream for every token it emits and for no other (engine/sampler.h). The n-th
// token of a request is therefore chosen from the same logits with the same draw whether it was
// reached by decode or by verification, and a proposal counts only when it equals that choice.
//
// Rollback (engine/generation_core.cpp): the rows after the accepted tokens are simply not part of
// the sequence any more. A KV cache needs nothing more (rows past a sequence's length are written
// before they are read); a recurrent state (ModelCache::resumes_at_any_position false: the hybrid
// Qwen3.5 family's conv and delta-rule states) is saved before a verify step and, when part of it is
// rejected, put back; the accepted tokens then run again at the front of the sequence's next step,
// which proposes nothing (what it appends is known), so the state is again that of single steps.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace kiln {

// The most tokens proposed for one verify step (`--num-speculative-tokens`).
inline constexpr int32_t kMaxSpeculativeTokens = 16;

// Fails, saying the range, unless 1 ≤ tokens ≤ kMaxSpeculativeTokens.
void check_speculative_tokens(int64_t tokens);

// A proposer's view of one request.
class SequenceProposer {
 public:
  virtual ~SequenceProposer() = default;
  // Up to `count` tokens expected to follow `tokens`: the prompt, then every token generated so far.
  // Between calls `tokens` grows by what was accepted (the proposals taken and the target's own
  // token); what was proposed and rejected is not in it.
  virtual std::vector<int32_t> propose(std::span<const int32_t> tokens, int32_t count) = 0;
  // For a proposer that reads hidden states (Proposer::reads_hidden_states): the target's final
  // hidden states [rows, hidden_size] (on the device) of the positions first_position … that the
  // step just run appended for the request — a prefill chunk, or a decode's tokens, of which those
  // past the tokens accepted are not the sequence's. Every step that runs the request calls it
  // before the next proposal.
  virtual void observe(int64_t /*first_position*/, const Tensor& /*hidden*/) {}
};

// One request's part of a step's proposals: what SequenceProposer::propose takes, and its answer.
// A proposer that reads hidden states is asked at every step, with count 0 while the request may
// not propose (it prefills, runs accepted tokens again, or has no room left): it takes in what it
// observed, and proposes nothing.
struct ProposalAsk {
  SequenceProposer* sequence = nullptr;
  std::span<const int32_t> tokens;
  int32_t count = 0;
  std::vector<int32_t> proposal;  // filled by Proposer::propose_together
};

// A method of proposing, shared by the requests that use it; used on the thread that steps the
// generation core.
class Proposer {
 public:
  virtual ~Proposer() = default;
  // How the method is named in metrics and flags ("ngram", "draft", "mtp", "oracle").
  virtual std::string name() const = 0;
  // Whether its sequences read the target's final hidden states (SequenceProposer::observe): the
  // steps that run such a request return them (and run directly, not as captured decode graphs).
  virtual bool reads_hidden_states() const { return false; }
  // The proposer of a request whose prompt is `prompt`.
  virtual std::unique_ptr<SequenceProposer> start(std::span<const int32_t> prompt) = 0;
  // The proposals of one step's requests that use this method (each asker started by it). By
  // default each is asked on its own; a proposer that runs a model runs them in one batch.
  virtual void propose_together(std::span<ProposalAsk> asks);
};

// A request's speculation: none without a proposer.
struct Speculation {
  std::shared_ptr<Proposer> proposer;
  int32_t tokens = 4;  // most tokens proposed per verify step

  bool enabled() const { return proposer != nullptr; }
};

// Counts over the verify steps a core ran: each verify step of a sequence appends `proposed`
// guesses, of which `accepted` equalled the target's choice (every verify step emits accepted + 1
// tokens unless the request ends in it).
struct SpeculationCounts {
  int64_t verify_steps = 0;
  int64_t proposed = 0;
  int64_t accepted = 0;
};

// Prompt lookup (vLLM's ngram proposer, llama.cpp's lookup decoding): the last n tokens, for n from
// `max_match` down to `min_match`, are looked for earlier in the sequence, the latest occurrence
// first; the tokens that followed it are proposed.
std::vector<int32_t> ngram_proposal(std::span<const int32_t> tokens, int32_t count, int32_t min_match,
                                    int32_t max_match);

class NgramProposer final : public Proposer {
 public:
  static constexpr int32_t kDefaultMinMatch = 1;
  static constexpr int32_t kDefaultMaxMatch = 4;
  explicit NgramProposer(int32_t min_match = kDefaultMinMatch, int32_t max_match = kDefaultMaxMatch);
  std::string name() const override { return "ngram"; }
  std::unique_ptr<SequenceProposer> start(std::span<const int32_t> prompt) override;

 private:
  int32_t min_match_, max_match_;
};

// For benchmarks only: proposes, after a prompt, the tokens a plain run generated from it, so every
// proposal is accepted (while the run is replayed exactly) and a benchmark measures what the
// machinery costs beyond the verify steps themselves. Its figures are labelled "oracle".
class ReplayProposer final : public Proposer {
 public:
  ReplayProposer(std::vector<int32_t> prompt, std::vector<int32_t> continuation);
  std::string name() const override { return "oracle"; }
  std::unique_ptr<SequenceProposer> start(std::span<const int32_t> prompt) override;

 private:
  std::vector<int32_t> prompt_, continuation_;
};

}  // namespace kiln
