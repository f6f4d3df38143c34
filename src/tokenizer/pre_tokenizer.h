// tokenizer.json "pre_tokenizer": splits normalized text into the words the model encodes one by
// one. Supported: Split (String or Regex pattern, every behavior, invert), ByteLevel, Metaspace
// and Sequence of these; ByteLevel must come last, since it hands the model raw bytes.
#pragma once

#include <deque>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/regex.h"

namespace kiln {

class PreTokenizer {
 public:
  static PreTokenizer from_json(const nlohmann::json& spec, const std::string& where);

  // Appends the words of one normalized segment to `words`. `segment_at_input_start` says whether
  // the segment begins at byte 0 of the input (Metaspace's prepend_scheme "first" needs it).
  // Words that are not substrings of `segment` live in `storage`.
  void split(std::string_view segment, bool segment_at_input_start, std::vector<std::string_view>& words,
             std::deque<std::string>& storage) const;

  // Whether the words are byte-level: the model sees GPT-2's byte characters, one per byte.
  bool byte_level() const { return byte_level_; }

 private:
  enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };
  enum class Prepend { Always, First, Never };
  struct Step {
    enum class Kind { Split, ByteLevel, Metaspace } kind = Kind::Split;
    std::shared_ptr<const Regex> pattern;  // Split; ByteLevel with use_regex; Metaspace with split
    Behavior behavior = Behavior::Isolated;
    bool invert = false;
    bool add_prefix_space = false;  // ByteLevel
    std::string replacement;        // Metaspace
    Prepend prepend = Prepend::Always;
  };
  struct Piece {
    std::string_view text;
    bool at_input_start;
  };
  void add(const nlohmann::json& spec, const std::string& where);
  static void split_by_pattern(const Regex& pattern, Behavior behavior, bool invert, const Piece& piece,
                               std::vector<Piece>& out);

  std::vector<Step> steps_;
  bool byte_level_ = false;
};

}  // namespace kiln
