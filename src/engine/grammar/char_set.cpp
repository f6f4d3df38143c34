#include "engine/grammar/char_set.h"

#include <algorithm>
#include <array>


namespace kiln::grammar {

namespace {

constexpr uint32_t kSurrogateFirst = 0xD800, kSurrogateLast = 0xDFFF;

Symbol byte_range(uint8_t first, uint8_t last) { return Symbol::byte_set(ByteSet::range(first, last)); }

// The UTF-8 bytes of [first, last] (scalar values of one encoded length and no surrogates) as
// alternatives, each a byte range per byte. The range is cut until, in each alternative, every
// continuation byte past the first differing one spans all of 80..BF, so that the product of the
// byte ranges is exactly the range.
void utf8_sequences(uint32_t first, uint32_t last, std::vector<Sequence>& out) {
  for (uint32_t end : {0x7Fu, 0x7FFu, 0xFFFFu}) {
    if (first <= end && last > end) {
      utf8_sequences(first, end, out);
      utf8_sequences(end + 1, last, out);
      return;
    }
  }
  const int length = first <= 0x7F ? 1 : first <= 0x7FF ? 2 : first <= 0xFFFF ? 3 : 4;
  for (int trailing = 1; trailing < length; ++trailing) {
    const uint32_t low = (uint32_t{1} << (6 * trailing)) - 1;  // the bits of the last `trailing` bytes
    if ((first & ~low) == (last & ~low)) continue;
    if ((first & low) != 0) {
      utf8_sequences(first, first | low, out);
      utf8_sequences((first | low) + 1, last, out);
      return;
    }
    if ((last & low) != low) {
      utf8_sequences(first, (last & ~low) - 1, out);
      utf8_sequences(last & ~low, last, out);
      return;
    }
  }
  std::string low_bytes, high_bytes;
  append_utf8(low_bytes, first);
  append_utf8(high_bytes, last);
  Sequence sequence;
  for (size_t i = 0; i < low_bytes.size(); ++i)
    sequence.push_back(byte_range(static_cast<uint8_t>(low_bytes[i]), static_cast<uint8_t>(high_bytes[i])));
  out.push_back(std::move(sequence));
}

// JSON's two-character escape of `c`, or nothing.
std::string_view json_short_escape(char c) {
  switch (c) {
    case '"': return "\\\"";
    case '\\': return "\\\\";
    case '\b': return "\\b";
    case '\f': return "\\f";
    case '\n': return "\\n";
    case '\r': return "\\r";
    case '\t': return "\\t";
    default: return {};
  }
}

void append_sequences(const CharSet& set, std::vector<Sequence>& out) {
  for (const CharSet::Range& range : set.ranges()) utf8_sequences(range.first, range.last, out);
}

}  // namespace

CharSet& CharSet::add(uint32_t first, uint32_t last) {
  last = std::min(last, kMaxCodePoint);
  if (first > last) return *this;
  if (first < kSurrogateFirst && last > kSurrogateLast) {
    add(first, kSurrogateFirst - 1);
    return add(kSurrogateLast + 1, last);
  }
  if (first >= kSurrogateFirst && first <= kSurrogateLast) first = kSurrogateLast + 1;
  if (last >= kSurrogateFirst && last <= kSurrogateLast) last = kSurrogateFirst - 1;
  if (first > last) return *this;
  // Merge with every range it overlaps or touches.
  std::vector<Range> merged;
  Range added{first, last};
  for (const Range& range : ranges_) {
    if (range.last + 1 < added.first || added.last + 1 < range.first) {
      merged.push_back(range);
    } else {
      added.first = std::min(added.first, range.first);
      added.last = std::max(added.last, range.last);
    }
  }
  merged.push_back(added);
  std::sort(merged.begin(), merged.end(), [](const Range& a, const Range& b) { return a.first < b.first; });
  ranges_ = std::move(merged);
  return *this;
}

CharSet& CharSet::add(const CharSet& other) {
  for (const Range& range : other.ranges_) add(range.first, range.last);
  return *this;
}

CharSet CharSet::complement() const {
  CharSet result;
  uint32_t next = 0;
  for (const Range& range : ranges_) {
    if (range.first > next) result.add(next, range.first - 1);
    next = range.last + 1;
  }
  if (next <= kMaxCodePoint) result.add(next, kMaxCodePoint);
  return result;
}

bool CharSet::contains(uint32_t character) const {
  return std::any_of(ranges_.begin(), ranges_.end(),
                     [&](const Range& range) { return range.first <= character && character <= range.last; });
}

std::vector<Sequence> char_set_sequences(const CharSet& set, CharEncoding encoding) {
  std::vector<Sequence> out;
  if (encoding == CharEncoding::Utf8) {
    append_sequences(set, out);
    return out;
  }
  // Written as themselves: printable ASCII and DEL except the quote and the backslash (and, markup
  // safe, < > &), and everything past ASCII as UTF-8. The rest as escapes: the short ones where
  // JSON has them, else \u00XX, gathered by their third hex digit (\u000 or \u001 then a set of
  // last digits, \u002 …) so that a wide set costs a few alternatives, not one per character.
  static constexpr std::string_view kHex = "0123456789abcdef";
  const bool markup_safe = encoding == CharEncoding::JsonStringMarkupSafe;
  CharSet plain;
  std::array<ByteSet, 8> by_third_digit;  // \u00XY: X's set of Y digits, for X < 8
  for (const CharSet::Range& range : set.ranges()) {
    for (uint32_t character = range.first; character <= std::min<uint32_t>(range.last, 0x7F); ++character) {
      const char c = static_cast<char>(character);
      const std::string_view short_escape = json_short_escape(c);
      if (!short_escape.empty()) {
        out.push_back(literal(short_escape));
      } else if (character < 0x20 || (markup_safe && (c == '<' || c == '>' || c == '&'))) {
        const auto last_digit = static_cast<uint8_t>(kHex[character & 15]);
        by_third_digit[character >> 4].add(last_digit, last_digit);
      } else {
        plain.add(character, character);
      }
    }
    if (range.last > 0x7F) plain.add(std::max<uint32_t>(range.first, 0x80), range.last);
  }
  for (size_t digit = 0; digit < by_third_digit.size(); ++digit)
    if (!by_third_digit[digit].empty())
      out.push_back(concat(literal(std::string("\\u00") + kHex[digit]), {Symbol::byte_set(by_third_digit[digit])}));
  append_sequences(plain, out);
  return out;
}

void append_utf8(std::string& text, uint32_t character) {
  if (character <= 0x7F) {
    text += static_cast<char>(character);
  } else if (character <= 0x7FF) {
    text += static_cast<char>(0xC0 | (character >> 6));
    text += static_cast<char>(0x80 | (character & 0x3F));
  } else if (character <= 0xFFFF) {
    text += static_cast<char>(0xE0 | (character >> 12));
    text += static_cast<char>(0x80 | ((character >> 6) & 0x3F));
    text += static_cast<char>(0x80 | (character & 0x3F));
  } else {
    text += static_cast<char>(0xF0 | (character >> 18));
    text += static_cast<char>(0x80 | ((character >> 12) & 0x3F));
    text += static_cast<char>(0x80 | ((character >> 6) & 0x3F));
    text += static_cast<char>(0x80 | (character & 0x3F));
  }
}

std::optional<uint32_t> next_utf8(std::string_view text, size_t& at) {
  if (at >= text.size()) return std::nullopt;
  const auto byte = [&](size_t i) { return static_cast<uint8_t>(text[i]); };
  const uint8_t lead = byte(at);
  if (lead < 0x80) return text[at++];
  int length;
  uint32_t character, minimum;
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2, character = lead & 0x1F, minimum = 0x80;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3, character = lead & 0x0F, minimum = 0x800;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4, character = lead & 0x07, minimum = 0x10000;
  } else {
    return std::nullopt;
  }
  if (at + length > text.size()) return std::nullopt;
  for (int i = 1; i < length; ++i) {
    if ((byte(at + i) & 0xC0) != 0x80) return std::nullopt;
    character = (character << 6) | (byte(at + i) & 0x3F);
  }
  if (character < minimum || character > kMaxCodePoint || (character >= kSurrogateFirst && character <= kSurrogateLast))
    return std::nullopt;
  at += length;
  return character;
}

int hex_digit_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace kiln::grammar
