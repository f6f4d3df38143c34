#include "engine/speculative.h"

#include <algorithm>
#include <utility>

#include "core/error.h"

namespace kiln {

void check_speculative_tokens(int64_t tokens) {
  if (tokens < 1 || tokens > kMaxSpeculativeTokens)
    fail("the number of speculative tokens must be in 1..{}, got {}", kMaxSpeculativeTokens, tokens);
}

std::vector<int32_t> ngram_proposal(std::span<const int32_t> tokens, int32_t count, int32_t min_match,
                                    int32_t max_match) {
  const auto length = static_cast<int64_t>(tokens.size());
  for (int64_t n = std::min<int64_t>(max_match, length - 1); n >= min_match; --n) {
    const std::span<const int32_t> suffix = tokens.subspan(static_cast<size_t>(length - n));
    // The latest earlier occurrence: it starts before the suffix does, so a token follows it.
    for (int64_t start = length - n - 1; start >= 0; --start) {
      if (!std::equal(suffix.begin(), suffix.end(), tokens.begin() + start)) continue;
      const int64_t first = start + n;
      const int64_t last = std::min(length, first + count);
      return std::vector<int32_t>(tokens.begin() + first, tokens.begin() + last);
    }
  }
  return {};
}

namespace {

class NgramSequence final : public SequenceProposer {
 public:
  NgramSequence(int32_t min_match, int32_t max_match) : min_match_(min_match), max_match_(max_match) {}
  std::vector<int32_t> propose(std::span<const int32_t> tokens, int32_t count) override {
    return ngram_proposal(tokens, count, min_match_, max_match_);
  }

 private:
  int32_t min_match_, max_match_;
};

class ReplaySequence final : public SequenceProposer {
 public:
  ReplaySequence(size_t prompt_length, const std::vector<int32_t>& continuation)
      : prompt_length_(prompt_length), continuation_(continuation) {}
  std::vector<int32_t> propose(std::span<const int32_t> tokens, int32_t count) override {
    const size_t generated = tokens.size() - prompt_length_;
    if (generated >= continuation_.size()) return {};
    const size_t last = std::min(continuation_.size(), generated + static_cast<size_t>(count));
    return std::vector<int32_t>(continuation_.begin() + static_cast<std::ptrdiff_t>(generated),
                                continuation_.begin() + static_cast<std::ptrdiff_t>(last));
  }

 private:
  size_t prompt_length_;
  const std::vector<int32_t>& continuation_;
};

}  // namespace

void Proposer::propose_together(std::span<ProposalAsk> asks) {
  for (ProposalAsk& ask : asks) ask.proposal = ask.sequence->propose(ask.tokens, ask.count);
}

NgramProposer::NgramProposer(int32_t min_match, int32_t max_match) : min_match_(min_match), max_match_(max_match) {
  if (min_match < 1 || max_match < min_match)
    fail("an n-gram proposer needs 1 ≤ min_match ≤ max_match, got {} and {}", min_match, max_match);
}

std::unique_ptr<SequenceProposer> NgramProposer::start(std::span<const int32_t> /*prompt*/) {
  return std::make_unique<NgramSequence>(min_match_, max_match_);
}

ReplayProposer::ReplayProposer(std::vector<int32_t> prompt, std::vector<int32_t> continuation)
    : prompt_(std::move(prompt)), continuation_(std::move(continuation)) {}

std::unique_ptr<SequenceProposer> ReplayProposer::start(std::span<const int32_t> prompt) {
  if (!std::equal(prompt.begin(), prompt.end(), prompt_.begin(), prompt_.end()))
    fail("the oracle proposer replays the run of one prompt and was given another");
  return std::make_unique<ReplaySequence>(prompt_.size(), continuation_);
}

}  // namespace kiln
