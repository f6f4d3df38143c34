#include "engine/stop_matcher.h"

#include <algorithm>

namespace kiln {

StopMatcher::StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {
  std::erase_if(stops_, [](const std::string& stop) { return stop.empty(); });
}

StopMatcher::Output StopMatcher::push(std::string_view text) {
  Output output;
  if (matched_) return output;
  pending_ += text;
  // Everything before pending_ was already proven free of every stop string's start, so the
  // earliest match (the longest at equal positions) can only begin inside pending_.
  size_t best_position = std::string::npos;
  const std::string* best = nullptr;
  for (const auto& stop : stops_) {
    const size_t position = pending_.find(stop);
    if (position == std::string::npos) continue;
    if (position < best_position || (position == best_position && stop.size() > best->size())) {
      best_position = position;
      best = &stop;
    }
  }
  if (best) {
    matched_ = true;
    output.text = pending_.substr(0, best_position);
    output.matched = *best;
    pending_.clear();
    return output;
  }
  // Hold back the longest tail of pending_ that is a proper prefix of some stop string.
  size_t hold = 0;
  for (const auto& stop : stops_) {
    const size_t longest = std::min(stop.size() - 1, pending_.size());
    for (size_t length = longest; length > hold; --length)
      if (pending_.compare(pending_.size() - length, length, stop, 0, length) == 0) {
        hold = length;
        break;
      }
  }
  output.text = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return output;
}

std::string StopMatcher::flush() {
  std::string rest;
  if (!matched_) rest.swap(pending_);
  return rest;
}

}  // namespace kiln
