// A cap on a reply's reasoning (Anthropic's thinking.budget_tokens, vLLM's thinking_token_budget,
// llama-server's --reasoning-budget): once the reasoning a reply opened (or its prompt opened for
// it) has run `max_tokens` tokens without closing, the request's next tokens are forced to the
// closing marker and the layout the chat template puts around it ("\n</think>\n\n"), after which
// the model answers as it will.
//
// Reasoning is told by token ids, not by decoded text: a marker is the token sequence that encodes
// it (one added token in Qwen3's vocabulary, several where a vocabulary has no such token), matched
// against the tokens as they are generated (a model that spells a marker with other tokens than
// its encoding goes unseen: where the marker is one token, as in Qwen3, it cannot). The first
// reasoning block is the one capped; what follows its end is not watched.
//
// A forced token is not sampled: it takes no draw from the request's random stream (on either
// sampling path), its logprob is 0 and it is its own only alternative (the distribution that
// allows nothing else, as a grammar's mask would), and the penalties count it as generated. So a
// request's tokens stay the same alone or in a batch, on every backend.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace kiln {

struct ReasoningBudget {
  std::vector<int32_t> open;   // the tokens that open reasoning (<think>)
  std::vector<int32_t> close;  // the tokens that close it (</think>)
  // What ends reasoning at the cap: the layout the template writes before the close, the close,
  // the layout after it (`close` must stand in it).
  std::vector<int32_t> forced;
  int64_t max_tokens = 0;         // reasoning tokens generated before the close is forced
  bool opened_by_prompt = false;  // the prompt ends inside reasoning: the reply starts in it

  // Throws kiln::Error naming what is wrong: an empty marker, `forced` without `close` in it, a
  // negative max_tokens, a token outside the vocabulary.
  void validate(int64_t vocab_size) const;
};

// Where one request's generated tokens stand against its budget.
class ReasoningBudgetTracker {
 public:
  explicit ReasoningBudgetTracker(ReasoningBudget budget);

  // The token the next step must produce, when it is forced.
  std::optional<int32_t> forced_next() const;
  // Whether neither of the next two tokens can be forced, whatever the first of them is: a decode
  // step may then be queued before the next token is read (engine/generation_core.h).
  bool next_two_free() const;
  // Takes a token the request generated (sampled, or the one forced_next() named).
  void accept(int32_t token);

  int64_t reasoning_tokens() const { return reasoning_tokens_; }

 private:
  enum class Phase { Waiting, Reasoning, Forcing, Done };
  // Reasoning reached its cap: forcing starts, skipping the part of `close` the last tokens began.
  void start_forcing();
  bool recent_end_with(const std::vector<int32_t>& marker) const;

  ReasoningBudget budget_;
  Phase phase_;
  int64_t reasoning_tokens_ = 0;
  size_t forced_at_ = 0;         // Forcing: the index in `forced` of the next token
  std::vector<int32_t> recent_;  // the last generated tokens, as many as the longest marker
};

}  // namespace kiln
