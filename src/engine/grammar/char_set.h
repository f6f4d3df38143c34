// Sets of Unicode characters (scalar values: code points without the surrogates) and their texts as
// grammar alternatives: as UTF-8 bytes (a regex or GBNF grammar over raw text), or as a JSON
// string writes them (a schema's `pattern`, which constrains a string's value, not its JSON text).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/grammar/grammar.h"

namespace kiln::grammar {

inline constexpr uint32_t kMaxCodePoint = 0x10FFFF;

class CharSet {
 public:
  struct Range {
    uint32_t first, last;
  };
  static CharSet of(uint32_t character) { return CharSet().add(character, character); }
  static CharSet range(uint32_t first, uint32_t last) { return CharSet().add(first, last); }
  // Every scalar value.
  static CharSet any() { return range(0, kMaxCodePoint); }

  // Adds [first, last] (clipped to scalar values: surrogates are never members).
  CharSet& add(uint32_t first, uint32_t last);
  CharSet& add(const CharSet& other);
  // The scalar values not in the set.
  CharSet complement() const;
  bool contains(uint32_t character) const;
  bool empty() const { return ranges_.empty(); }
  // Sorted, disjoint and not adjacent.
  const std::vector<Range>& ranges() const { return ranges_; }

 private:
  std::vector<Range> ranges_;
};

// How characters are written in the text a grammar matches.
enum class CharEncoding {
  Utf8,  // as UTF-8 bytes
  // Inside a JSON string, one way per character: `"` and `\` escaped, control characters as
  // \b \f \n \r \t or \u00XX, everything else as UTF-8.
  JsonString,
  // As JsonString, and <, > and & as \u003c, \u003e and \u0026 (as Go's encoder escapes HTML):
  // JSON inside XML-like tool-call markup then never holds a closing tag or a CDATA end.
  JsonStringMarkupSafe,
};

// The texts of the set's characters, as alternatives of byte sets (UTF-8 ranges are split so that
// each alternative is a product of byte ranges: few alternatives for wide sets).
std::vector<Sequence> char_set_sequences(const CharSet& set, CharEncoding encoding);

// Appends the UTF-8 encoding of a scalar value.
void append_utf8(std::string& text, uint32_t character);
// Decodes the well-formed UTF-8 character at text[at] and moves `at` past it; nothing (and `at`
// unchanged) where the bytes there are not one.
std::optional<uint32_t> next_utf8(std::string_view text, size_t& at);

// The value of a hexadecimal digit (either case), or −1: the escapes of regexes and GBNF texts.
int hex_digit_value(char c);

}  // namespace kiln::grammar
