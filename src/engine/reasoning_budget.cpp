#include "engine/reasoning_budget.h"

#include <algorithm>

#include "core/error.h"

namespace kiln {

namespace {

// Where `part` stands in `whole`, or whole.size().
size_t find_run(const std::vector<int32_t>& whole, const std::vector<int32_t>& part) {
  return static_cast<size_t>(std::search(whole.begin(), whole.end(), part.begin(), part.end()) - whole.begin());
}

}  // namespace

void ReasoningBudget::validate(int64_t vocab_size) const {
  if (open.empty() || close.empty()) fail("a reasoning budget needs the tokens that open and close reasoning");
  if (find_run(forced, close) == forced.size())
    fail("a reasoning budget's forced tokens must hold the tokens that close reasoning");
  if (max_tokens < 0) fail("a reasoning budget must be ≥ 0 tokens, got {}", max_tokens);
  for (const auto* tokens : {&open, &close, &forced})
    for (int32_t token : *tokens)
      if (token < 0 || token >= vocab_size)
        fail("a reasoning marker's token id {} is outside the vocabulary (size {})", token, vocab_size);
}

ReasoningBudgetTracker::ReasoningBudgetTracker(ReasoningBudget budget)
    : budget_(std::move(budget)), phase_(budget_.opened_by_prompt ? Phase::Reasoning : Phase::Waiting) {
  if (phase_ == Phase::Reasoning && budget_.max_tokens == 0) start_forcing();
}

std::optional<int32_t> ReasoningBudgetTracker::forced_next() const {
  if (phase_ != Phase::Forcing) return std::nullopt;
  return budget_.forced[forced_at_];
}

bool ReasoningBudgetTracker::next_two_free() const {
  switch (phase_) {
    case Phase::Done: return true;
    case Phase::Forcing: return false;
    // The next token may open reasoning, which a budget of 0 closes at once.
    case Phase::Waiting: return budget_.max_tokens > 0;
    // The next token may be the one that reaches the cap.
    case Phase::Reasoning: return reasoning_tokens_ + 1 < budget_.max_tokens;
  }
  return false;
}

bool ReasoningBudgetTracker::recent_end_with(const std::vector<int32_t>& marker) const {
  return recent_.size() >= marker.size() && std::equal(marker.begin(), marker.end(), recent_.end() - marker.size());
}

void ReasoningBudgetTracker::start_forcing() {
  phase_ = Phase::Forcing;
  forced_at_ = 0;
  // Where the last tokens began the closing marker (a marker of several tokens), forcing goes on
  // from there rather than writing it again.
  const size_t close_at = find_run(budget_.forced, budget_.close);
  for (size_t begun = budget_.close.size() - 1; begun > 0; --begun)
    if (recent_end_with(std::vector<int32_t>(budget_.close.begin(), budget_.close.begin() + begun))) {
      forced_at_ = close_at + begun;
      break;
    }
}

void ReasoningBudgetTracker::accept(int32_t token) {
  if (phase_ == Phase::Done) return;
  if (phase_ == Phase::Forcing) {
    if (++forced_at_ == budget_.forced.size()) phase_ = Phase::Done;
    return;
  }
  recent_.push_back(token);
  const size_t longest = std::max(budget_.open.size(), budget_.close.size());
  if (recent_.size() > longest) recent_.erase(recent_.begin());
  if (phase_ == Phase::Waiting) {
    if (!recent_end_with(budget_.open)) return;
    phase_ = Phase::Reasoning;
    recent_.clear();  // the open marker's tokens are no part of a close
    if (budget_.max_tokens == 0) start_forcing();
    return;
  }
  if (recent_end_with(budget_.close)) {
    phase_ = Phase::Done;
    return;
  }
  if (++reasoning_tokens_ >= budget_.max_tokens) start_forcing();
}

}  // namespace kiln
