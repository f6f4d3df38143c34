#include "tokenizer/unicode.h"

#include <utf8proc.h>

#include <cstdlib>
#include <memory>

#include "core/error.h"

namespace kiln::unicode {

namespace {

// Range of the second byte of a well-formed sequence given its lead byte (Unicode 15, Table 3-7);
// every later continuation byte is 80..BF.
struct SecondByteRange {
  unsigned char low, high;
};

SecondByteRange second_byte_range(unsigned char lead) {
  if (lead == 0xE0) return {0xA0, 0xBF};
  if (lead == 0xED) return {0x80, 0x9F};
  if (lead == 0xF0) return {0x90, 0xBF};
  if (lead == 0xF4) return {0x80, 0x8F};
  return {0x80, 0xBF};
}

// Length of the longest prefix of bytes[offset..] that a well-formed sequence could start with
// (at most the sequence length), and whether it is a whole sequence.
struct SequencePrefix {
  size_t length;
  bool complete;
};

SequencePrefix valid_prefix(std::string_view bytes, size_t offset) {
  const auto lead = static_cast<unsigned char>(bytes[offset]);
  const int expected = utf8_sequence_length(lead);
  if (expected == 0) return {0, false};
  if (expected == 1) return {1, true};
  size_t length = 1;
  const SecondByteRange second = second_byte_range(lead);
  while (length < static_cast<size_t>(expected) && offset + length < bytes.size()) {
    const auto byte = static_cast<unsigned char>(bytes[offset + length]);
    const bool fits = length == 1 ? (byte >= second.low && byte <= second.high) : (byte >= 0x80 && byte <= 0xBF);
    if (!fits) return {length, false};
    ++length;
  }
  return {length, length == static_cast<size_t>(expected)};
}

constexpr std::string_view kReplacementCharacter = "\xEF\xBF\xBD";

}  // namespace

int utf8_sequence_length(unsigned char lead) {
  if (lead < 0x80) return 1;
  if (lead < 0xC2) return 0;
  if (lead < 0xE0) return 2;
  if (lead < 0xF0) return 3;
  if (lead < 0xF5) return 4;
  return 0;
}

size_t find_invalid_utf8(std::string_view text) {
  size_t offset = 0;
  while (offset < text.size()) {
    if (static_cast<unsigned char>(text[offset]) < 0x80) {
      ++offset;
      continue;
    }
    const SequencePrefix prefix = valid_prefix(text, offset);
    if (!prefix.complete) return offset;
    offset += prefix.length;
  }
  return std::string_view::npos;
}

char32_t next_code_point(std::string_view text, size_t& offset) {
  const auto lead = static_cast<unsigned char>(text[offset]);
  const int length = utf8_sequence_length(lead);
  // A sequence the text cuts short is read as its lead byte: never past the end, whatever the input.
  if (length <= 1 || offset + static_cast<size_t>(length) > text.size()) {
    ++offset;
    return lead;
  }
  char32_t code_point = lead & (0x7F >> length);
  for (int i = 1; i < length; ++i)
    code_point = (code_point << 6) | (static_cast<unsigned char>(text[offset + i]) & 0x3F);
  offset += length;
  return code_point;
}

void append_utf8(std::string& out, char32_t code_point) {
  if (code_point < 0x80) {
    out.push_back(static_cast<char>(code_point));
  } else if (code_point < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (code_point >> 6)));
    out.push_back(static_cast<char>(0x80 | (code_point & 0x3F)));
  } else if (code_point < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (code_point >> 12)));
    out.push_back(static_cast<char>(0x80 | ((code_point >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (code_point & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (code_point >> 18)));
    out.push_back(static_cast<char>(0x80 | ((code_point >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((code_point >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (code_point & 0x3F)));
  }
}

bool is_white_space(char32_t c) {
  // Unicode 15.0 PropList.txt, White_Space.
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

std::string normalize(std::string_view text, NormalForm form) {
  // Fast path: code points below U+0300 are all NFC_Quick_Check=Yes with combining class 0, so
  // text made only of them (no lead byte >= 0xCC) is already NFC; ASCII is in every form.
  unsigned char limit = form == NormalForm::Nfc ? 0xCC : 0x80;
  bool unchanged = true;
  for (char c : text) {
    if (static_cast<unsigned char>(c) >= limit) {
      unchanged = false;
      break;
    }
  }
  if (unchanged) return std::string(text);

  int options = UTF8PROC_STABLE;
  switch (form) {
    case NormalForm::Nfc:
      options |= UTF8PROC_COMPOSE;
      break;
    case NormalForm::Nfd:
      options |= UTF8PROC_DECOMPOSE;
      break;
    case NormalForm::Nfkc:
      options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
      break;
    case NormalForm::Nfkd:
      options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
      break;
  }
  utf8proc_uint8_t* mapped = nullptr;
  const utf8proc_ssize_t length =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()), static_cast<utf8proc_ssize_t>(text.size()),
                   &mapped, static_cast<utf8proc_option_t>(options));
  std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> owned(mapped, &std::free);
  if (length < 0) fail("Unicode normalization failed: {}", utf8proc_errmsg(length));
  return std::string(reinterpret_cast<const char*>(mapped), static_cast<size_t>(length));
}

void LossyUtf8Decoder::push(std::string_view bytes, std::string& out) {
  std::string_view input = bytes;
  std::string joined;
  if (!pending_.empty()) {
    joined = pending_ + std::string(bytes);
    pending_.clear();
    input = joined;
  }
  size_t offset = 0;
  while (offset < input.size()) {
    const auto lead = static_cast<unsigned char>(input[offset]);
    if (lead < 0x80) {
      out.push_back(static_cast<char>(lead));
      ++offset;
      continue;
    }
    const SequencePrefix prefix = valid_prefix(input, offset);
    if (prefix.complete) {
      out.append(input.substr(offset, prefix.length));
      offset += prefix.length;
    } else if (prefix.length > 0 && offset + prefix.length == input.size()) {
      pending_.assign(input.substr(offset));  // may still complete with the next bytes
      return;
    } else {
      out.append(kReplacementCharacter);
      offset += prefix.length == 0 ? 1 : prefix.length;
    }
  }
}

void LossyUtf8Decoder::finish(std::string& out) {
  if (!pending_.empty()) out.append(kReplacementCharacter);
  pending_.clear();
}

const std::array<char32_t, 256>& byte_to_char() {
  static const std::array<char32_t, 256> table = [] {
    std::array<char32_t, 256> map{};
    char32_t next_unprintable = 0x100;
    for (int byte = 0; byte < 256; ++byte) {
      const bool printable = (byte >= '!' && byte <= '~') || (byte >= 0xA1 && byte <= 0xAC) || (byte >= 0xAE);
      map[byte] = printable ? static_cast<char32_t>(byte) : next_unprintable++;
    }
    return map;
  }();
  return table;
}

std::optional<uint8_t> char_to_byte(char32_t code_point) {
  // The map's image is 0x21..0x7E, 0xA1..0xAC, 0xAE..0xFF and 0x100..0x143.
  if (code_point >= 0x144) return std::nullopt;
  static const std::array<int16_t, 0x144> inverse = [] {
    std::array<int16_t, 0x144> table;
    table.fill(-1);
    const auto& forward = byte_to_char();
    for (int byte = 0; byte < 256; ++byte) table[forward[byte]] = static_cast<int16_t>(byte);
    return table;
  }();
  const int16_t byte = inverse[code_point];
  if (byte < 0) return std::nullopt;
  return static_cast<uint8_t>(byte);
}

}  // namespace kiln::unicode
