// UTF-8 and Unicode helpers the tokenizer needs: validation, code point iteration, lossy decoding
// with Rust's `String::from_utf8_lossy` rules (what Hugging Face tokenizers emits), normalization
// forms through utf8proc, the White_Space property and GPT-2's byte <-> character map.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace kiln::unicode {

// Number of bytes of the UTF-8 sequence a lead byte starts (1-4), or 0 for a byte that cannot
// start a well-formed sequence (a continuation byte, C0, C1, F5..FF).
int utf8_sequence_length(unsigned char lead);

// Byte offset of the first ill-formed UTF-8 sequence in text, or std::string_view::npos.
size_t find_invalid_utf8(std::string_view text);

// Decodes the code point at `offset` of well-formed UTF-8 and advances `offset` past it. On other
// bytes it still stays inside `text`: a byte that starts no sequence, or one the text cuts short,
// is returned as itself and skipped.
char32_t next_code_point(std::string_view text, size_t& offset);

void append_utf8(std::string& out, char32_t code_point);

// The Unicode White_Space property (PropList.txt): what Rust's char::is_whitespace tests.
bool is_white_space(char32_t code_point);

enum class NormalForm { Nfc, Nfd, Nfkc, Nfkd };

// text in the given normalization form (text must be well-formed UTF-8).
std::string normalize(std::string_view text, NormalForm form);

// Turns a byte stream into UTF-8 text the way Rust's String::from_utf8_lossy does for the whole
// stream: every maximal prefix of an ill-formed sequence becomes one U+FFFD. Bytes can arrive in
// pieces; an incomplete but so-far valid sequence at the end is held back until more bytes or
// finish() decide it.
class LossyUtf8Decoder {
 public:
  void push(std::string_view bytes, std::string& out);
  void finish(std::string& out);

 private:
  std::string pending_;
};

// GPT-2's reversible map from bytes to printable characters (openai/gpt-2 encoder.py
// bytes_to_unicode): printable Latin-1 bytes map to themselves, the rest to U+0100 onwards.
const std::array<char32_t, 256>& byte_to_char();
std::optional<uint8_t> char_to_byte(char32_t code_point);

}  // namespace kiln::unicode
