#include "tokenizer/added_vocabulary.h"

#include <algorithm>

#include "tokenizer/unicode.h"

namespace kiln {

namespace {

// Start of the run of White_Space characters that ends at `end` (== end when there is none).
size_t whitespace_run_start(std::string_view text, size_t end) {
  size_t start = end;
  while (start > 0) {
    size_t previous = start - 1;
    while (previous > 0 && (static_cast<unsigned char>(text[previous]) & 0xC0) == 0x80) --previous;
    size_t offset = previous;
    if (!unicode::is_white_space(unicode::next_code_point(text, offset))) break;
    start = previous;
  }
  return start;
}

// End of the run of White_Space characters that starts at `begin`.
size_t whitespace_run_end(std::string_view text, size_t begin) {
  size_t end = begin;
  while (end < text.size()) {
    size_t offset = end;
    if (!unicode::is_white_space(unicode::next_code_point(text, offset))) break;
    end = offset;
  }
  return end;
}

}  // namespace

AddedTokenMatcher::AddedTokenMatcher(const std::vector<AddedToken>& tokens, const std::vector<std::string>& patterns)
    : tokens_(tokens) {
  for (size_t index = 0; index < tokens.size(); ++index) {
    const std::string& pattern = patterns[index];
    if (pattern.empty()) continue;
    int32_t node = 0;
    for (char c : pattern) {
      const auto byte = static_cast<unsigned char>(c);
      auto& children = nodes_[node].children;
      auto found =
          std::find_if(children.begin(), children.end(), [&](const auto& child) { return child.first == byte; });
      if (found != children.end()) {
        node = found->second;
      } else {
        const auto created = static_cast<int32_t>(nodes_.size());
        children.emplace_back(byte, created);
        nodes_.emplace_back();
        node = created;
      }
    }
    // A content listed twice keeps its last entry, as a map insertion would.
    nodes_[node].token = static_cast<int32_t>(index);
    can_start_[static_cast<unsigned char>(pattern[0])] = true;
  }
}

void AddedTokenMatcher::find(std::string_view text, std::vector<Match>& matches) const {
  size_t previous_end = 0;
  size_t position = 0;
  while (position < text.size()) {
    if (!can_start_[static_cast<unsigned char>(text[position])]) {
      ++position;
      continue;
    }
    // The longest token starting here.
    int32_t node = 0, token = -1;
    size_t token_end = position;
    for (size_t i = position; i < text.size(); ++i) {
      const auto byte = static_cast<unsigned char>(text[i]);
      const auto& children = nodes_[node].children;
      auto found =
          std::find_if(children.begin(), children.end(), [&](const auto& child) { return child.first == byte; });
      if (found == children.end()) break;
      node = found->second;
      if (nodes_[node].token >= 0) {
        token = nodes_[node].token;
        token_end = i + 1;
      }
    }
    if (token < 0) {
      ++position;
      continue;
    }
    const AddedToken& added = tokens_[token];
    size_t begin = position, end = token_end;
    if (added.lstrip) begin = std::max(whitespace_run_start(text, begin), previous_end);
    if (added.rstrip) end = whitespace_run_end(text, end);
    matches.push_back({begin, end, added.id});
    previous_end = end;
    position = std::max(token_end, end);
  }
}

}  // namespace kiln
