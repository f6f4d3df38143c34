// tokenizer.json "normalizer": the text rewrites applied to every span between added tokens before
// pre-tokenization. Supported: NFC, NFD, NFKC, NFKD, Prepend, Replace (String or Regex pattern)
// and Sequence of these; anything else is an error naming the type.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/regex.h"
#include "tokenizer/unicode.h"

namespace kiln {

class Normalizer {
 public:
  // `spec` is the "normalizer" value (null for none); `where` names it in errors.
  static Normalizer from_json(const nlohmann::json& spec, const std::string& where);

  std::string apply(std::string_view text) const;
  bool empty() const { return steps_.empty(); }

 private:
  enum class Kind { Normalize, Prepend, Replace };
  struct Step {
    Kind kind = Kind::Normalize;
    unicode::NormalForm form = unicode::NormalForm::Nfc;
    std::string text;                      // Prepend: what to prepend; Replace: the replacement
    std::string literal;                   // Replace with a String pattern: the string replaced
    std::shared_ptr<const Regex> pattern;  // Replace with a Regex pattern
  };
  void add(const nlohmann::json& spec, const std::string& where);

  std::vector<Step> steps_;
};

// Replaces every match of `pattern` in text with `replacement` (no group references).
std::string replace_all(const Regex& pattern, std::string_view text, std::string_view replacement);

// Replaces every occurrence of the non-empty string `from` in text with `to`, left to right.
std::string replace_literal(std::string_view text, std::string_view from, std::string_view to);

// The Regex a tokenizer.json pattern object ({"String": s} or {"Regex": r}) describes.
std::shared_ptr<const Regex> pattern_from_json(const nlohmann::json& pattern, const std::string& where);

}  // namespace kiln
