#include "tokenizer/jinja_scanner.h"

#include <fmt/format.h>

#include <cctype>
#include <charconv>
#include <cstdlib>

#include "core/error.h"
#include "tokenizer/unicode.h"

namespace kiln::jinja {

namespace {

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

class Scanner {
 public:
  Scanner(std::string_view source, const std::string& origin) : source_(source), origin_(origin) {
    // Jinja2 drops one trailing newline of the template (keep_trailing_newline=False).
    if (!source_.empty() && source_.back() == '\n') source_.remove_suffix(1);
  }

  std::vector<Piece> scan() {
    std::vector<Piece> pieces;
    size_t position = 0;
    bool strip_leading = false, trim_newline = false;
    while (true) {
      const size_t start = find_tag_start(position);
      std::string text(
          source_.substr(position, start == std::string_view::npos ? std::string_view::npos : start - position));
      // Whether the text begins a line (what lstrip_blocks needs when the text has no newline).
      bool starts_line = position == 0;
      if (strip_leading) {
        size_t first = 0;
        while (first < text.size() && is_space(text[first])) ++first;
        text.erase(0, first);
      } else if (trim_newline && !text.empty() && text[0] == '\n') {
        text.erase(0, 1);
        starts_line = true;
      }
      if (start == std::string_view::npos) {
        push_text(pieces, std::move(text), position);
        return pieces;
      }
      const char kind = source_[start + 1];
      size_t inner = start + 2;
      const bool strip_before = inner < source_.size() && source_[inner] == '-';
      const bool keep_before = inner < source_.size() && source_[inner] == '+';
      if (strip_before || keep_before) ++inner;
      if (strip_before) {
        while (!text.empty() && is_space(text.back())) text.pop_back();
      } else if (kind != '{' && !keep_before) {
        // lstrip_blocks: spaces and tabs between the start of the line and a block or comment tag go.
        const size_t line_start = text.find_last_of('\n');
        const size_t tail = line_start == std::string::npos ? 0 : line_start + 1;
        const bool at_line_start = line_start != std::string::npos || starts_line;
        if (at_line_start && text.find_first_not_of(" \t", tail) == std::string::npos) text.erase(tail);
      }
      push_text(pieces, std::move(text), position);
      const int line = line_at(start);
      if (kind == '#') {
        const size_t end = source_.find("#}", inner);
        if (end == std::string_view::npos) fail("{}: line {}: unclosed comment", origin_, line);
        strip_leading = end > inner && source_[end - 1] == '-';
        trim_newline = !strip_leading;
        position = end + 2;
        continue;
      }
      Piece piece;
      piece.kind = kind == '{' ? Piece::Kind::Output : Piece::Kind::Statement;
      piece.line = line;
      bool strip_after = false;
      position = lex(inner, kind == '{' ? '}' : '%', line, piece.tokens, strip_after);
      strip_leading = strip_after;
      trim_newline = kind == '%' && !strip_after;
      if (piece.kind == Piece::Kind::Statement && !piece.tokens.empty() && piece.tokens[0].kind == Token::Kind::Name &&
          piece.tokens[0].text == "raw") {
        position = scan_raw(position, strip_after, line, pieces, strip_leading, trim_newline);
        continue;
      }
      pieces.push_back(std::move(piece));
    }
  }

 private:
  size_t find_tag_start(size_t from) const {
    for (size_t i = source_.find('{', from); i != std::string_view::npos; i = source_.find('{', i + 1))
      if (i + 1 < source_.size() && (source_[i + 1] == '{' || source_[i + 1] == '%' || source_[i + 1] == '#')) return i;
    return std::string_view::npos;
  }

  void push_text(std::vector<Piece>& pieces, std::string text, size_t position) const {
    if (text.empty()) return;
    Piece piece;
    piece.kind = Piece::Kind::Text;
    piece.text = std::move(text);
    piece.line = line_at(position);
    pieces.push_back(std::move(piece));
  }

  // Positions are asked in order as the scan advances, so counting resumes from the last one
  // (counting from the start each time made a template of many tags quadratic to load).
  int line_at(size_t position) const {
    position = std::min(position, source_.size());
    if (position < counted_position_) {
      counted_position_ = 0;
      counted_line_ = 1;
    }
    for (; counted_position_ < position; ++counted_position_) counted_line_ += source_[counted_position_] == '\n';
    return counted_line_;
  }

  // {% raw %}...{% endraw %}: everything between is text.
  size_t scan_raw(size_t position, bool strip_after_raw, int line, std::vector<Piece>& pieces, bool& strip_leading,
                  bool& trim_newline) {
    for (size_t start = find_tag_start(position); start != std::string_view::npos; start = find_tag_start(start + 1)) {
      if (source_[start + 1] != '%') continue;
      size_t inner = start + 2;
      const bool strip_before = source_[inner] == '-';
      if (strip_before || source_[inner] == '+') ++inner;
      std::vector<Token> tokens;
      bool strip_after = false;
      const size_t end = lex(inner, '%', line, tokens, strip_after);
      if (tokens.size() != 1 || tokens[0].text != "endraw") continue;
      std::string text(source_.substr(position, start - position));
      if (strip_after_raw) {
        size_t first = 0;
        while (first < text.size() && is_space(text[first])) ++first;
        text.erase(0, first);
      } else if (!text.empty() && text[0] == '\n') {
        text.erase(0, 1);
      }
      if (strip_before) {
        while (!text.empty() && is_space(text.back())) text.pop_back();
      }
      push_text(pieces, std::move(text), position);
      strip_leading = strip_after;
      trim_newline = !strip_after;
      return end;
    }
    fail("{}: line {}: {{% raw %}} without {{% endraw %}}", origin_, line);
  }

  // Lexes the inside of a tag up to its closing delimiter ("}}" or "%}", optionally "-" first);
  // returns the position after it.
  size_t lex(size_t position, char closing, int line, std::vector<Token>& tokens, bool& strip_after) const {
    int depth = 0;  // open brackets: "}}" inside {'a': {'b': 1}} closes dicts, not the tag
    while (true) {
      while (position < source_.size() && is_space(source_[position])) {
        line += source_[position] == '\n';
        ++position;
      }
      if (position >= source_.size()) fail("{}: line {}: unclosed tag", origin_, line);
      const std::string_view rest = source_.substr(position);
      const std::string close = std::string(1, closing) + "}";
      if (depth == 0 && rest.substr(0, 2) == close) {
        strip_after = false;
        return position + 2;
      }
      if (depth == 0 && rest.substr(0, 3) == "-" + close) {
        strip_after = true;
        return position + 3;
      }
      Token token;
      token.line = line;
      const char c = rest[0];
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t length = 1;
        while (length < rest.size() && (std::isalnum(static_cast<unsigned char>(rest[length])) || rest[length] == '_'))
          ++length;
        token.kind = Token::Kind::Name;
        token.text = std::string(rest.substr(0, length));
        position += length;
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        position += lex_number(rest, token, line);
      } else if (c == '\'' || c == '"') {
        position += lex_string(rest, token, line);
      } else {
        static const std::vector<std::string_view> kOperators = {"**", "//", "==", "!=", "<=", ">=", "+", "-", "*",
                                                                 "/",  "%",  "~",  "<",  ">",  "=",  "(", ")", "[",
                                                                 "]",  "{",  "}",  ",",  ".",  ":",  "|"};
        const auto found = std::find_if(kOperators.begin(), kOperators.end(),
                                        [&](std::string_view op) { return rest.substr(0, op.size()) == op; });
        if (found == kOperators.end()) fail("{}: line {}: unexpected character '{}' in a tag", origin_, line, c);
        token.kind = Token::Kind::Operator;
        token.text = std::string(*found);
        position += found->size();
        if (token.text == "(" || token.text == "[" || token.text == "{") ++depth;
        if ((token.text == ")" || token.text == "]" || token.text == "}") && depth > 0) --depth;
      }
      tokens.push_back(std::move(token));
    }
  }

  size_t lex_number(std::string_view rest, Token& token, int line) const {
    size_t length = 0;
    std::string digits;
    auto take_digits = [&] {
      while (length < rest.size() && (std::isdigit(static_cast<unsigned char>(rest[length])) || rest[length] == '_')) {
        if (rest[length] != '_') digits += rest[length];
        ++length;
      }
    };
    take_digits();
    bool is_float = false;
    if (length + 1 < rest.size() && rest[length] == '.' && std::isdigit(static_cast<unsigned char>(rest[length + 1]))) {
      is_float = true;
      digits += '.';
      ++length;
      take_digits();
    }
    if (length < rest.size() && (rest[length] == 'e' || rest[length] == 'E')) {
      size_t exponent = length + 1;
      if (exponent < rest.size() && (rest[exponent] == '+' || rest[exponent] == '-')) ++exponent;
      if (exponent < rest.size() && std::isdigit(static_cast<unsigned char>(rest[exponent]))) {
        is_float = true;
        digits += 'e';
        digits += rest.substr(length + 1, exponent - length - 1);
        length = exponent;
        take_digits();
      }
    }
    if (is_float) {
      token.kind = Token::Kind::Float;
      token.value = Value(std::strtod(digits.c_str(), nullptr));
    } else {
      int64_t value = 0;
      const auto result = std::from_chars(digits.data(), digits.data() + digits.size(), value);
      if (result.ec != std::errc()) fail("{}: line {}: integer literal {} is out of range", origin_, line, digits);
      token.kind = Token::Kind::Integer;
      token.value = Value(value);
    }
    return length;
  }

  // A string literal with Python's escapes (Jinja2 decodes literals as 'unicode-escape').
  size_t lex_string(std::string_view rest, Token& token, int line) const {
    const char quote = rest[0];
    std::string value;
    size_t i = 1;
    auto hex_value = [&](size_t digits) -> char32_t {
      if (i + digits > rest.size()) fail("{}: line {}: truncated escape in a string literal", origin_, line);
      char32_t code = 0;
      for (size_t k = 0; k < digits; ++k) {
        const char h = rest[i + k];
        if (!std::isxdigit(static_cast<unsigned char>(h)))
          fail("{}: line {}: bad escape in a string literal", origin_, line);
        code = code * 16 + static_cast<char32_t>(
                               std::isdigit(static_cast<unsigned char>(h)) ? h - '0' : (std::tolower(h) - 'a' + 10));
      }
      i += digits;
      return code;
    };
    while (true) {
      if (i >= rest.size()) fail("{}: line {}: unterminated string literal", origin_, line);
      const char c = rest[i];
      if (c == quote) break;
      if (c != '\\') {
        value += c;
        ++i;
        continue;
      }
      if (i + 1 >= rest.size()) fail("{}: line {}: unterminated string literal", origin_, line);
      const char escape = rest[i + 1];
      i += 2;
      switch (escape) {
        case 'n':
          value += '\n';
          break;
        case 't':
          value += '\t';
          break;
        case 'r':
          value += '\r';
          break;
        case '\\':
          value += '\\';
          break;
        case '\'':
          value += '\'';
          break;
        case '"':
          value += '"';
          break;
        case 'a':
          value += '\a';
          break;
        case 'b':
          value += '\b';
          break;
        case 'f':
          value += '\f';
          break;
        case 'v':
          value += '\v';
          break;
        case '\n':
          break;  // a backslash-newline continues the line
        case 'x':
          unicode::append_utf8(value, hex_value(2));
          break;
        case 'u':
          unicode::append_utf8(value, hex_value(4));
          break;
        case 'U':
          unicode::append_utf8(value, hex_value(8));
          break;
        default:
          if (escape >= '0' && escape <= '7') {
            char32_t code = static_cast<char32_t>(escape - '0');
            for (int k = 0; k < 2 && i < rest.size() && rest[i] >= '0' && rest[i] <= '7'; ++k, ++i)
              code = code * 8 + static_cast<char32_t>(rest[i] - '0');
            unicode::append_utf8(value, code);
          } else {
            value += '\\';  // Python keeps unknown escapes as written
            value += escape;
          }
      }
    }
    token.kind = Token::Kind::String;
    token.text = std::move(value);
    return i + 1;
  }

  std::string_view source_;
  const std::string& origin_;
  mutable size_t counted_position_ = 0;
  mutable int counted_line_ = 1;
};

}  // namespace

std::vector<Piece> scan_template(std::string_view source, const std::string& origin) {
  return Scanner(source, origin).scan();
}

}  // namespace kiln::jinja
