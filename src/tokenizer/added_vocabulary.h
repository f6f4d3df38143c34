// tokenizer.json "added_tokens": tokens matched in the raw text before anything else (special
// tokens such as <|im_start|>, and user-added ones), as Hugging Face's AddedVocabulary does:
// leftmost-longest matches, lstrip / rstrip absorbing neighbouring whitespace, and tokens marked
// `normalized` matched in the normalized text instead of the raw text.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kiln {

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool special = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
};

class AddedTokenMatcher {
 public:
  // `patterns[i]` is what token i is matched as (its content, or its normalized content).
  AddedTokenMatcher(const std::vector<AddedToken>& tokens, const std::vector<std::string>& patterns);

  struct Match {
    size_t begin, end;  // byte range of the text the token replaces, stripped whitespace included
    int32_t id;
  };
  // Appends the matches in text, left to right and non-overlapping.
  void find(std::string_view text, std::vector<Match>& matches) const;
  bool empty() const { return nodes_.size() == 1; }

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> children;
    int32_t token = -1;  // index into tokens_ of the token ending here
  };
  std::vector<Node> nodes_{Node{}};
  std::array<bool, 256> can_start_{};
  std::vector<AddedToken> tokens_;
};

}  // namespace kiln
