// Text-level stop strings over streamed text. Text that could still be the beginning of a stop
// string is held back until the next piece decides it; at a match, the output is cut before the
// stop string. Pieces passed in are complete UTF-8, and stop strings are valid UTF-8, so a
// held-back tail always starts on a character boundary.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kiln {

class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops);

  struct Output {
    std::string text;                    // safe to show now
    std::optional<std::string> matched;  // the stop string that ended the output
  };
  // Adds generated text. After a match, further input is ignored.
  Output push(std::string_view text);
  // The end of generation: whatever is held back is output after all.
  std::string flush();

 private:
  std::vector<std::string> stops_;
  std::string pending_;
  bool matched_ = false;
};

}  // namespace kiln
