#include "engine/grammar/gbnf.h"

#include <map>
#include <optional>
#include <string>

#include "core/error.h"
#include "engine/grammar/char_set.h"

namespace kiln::grammar {

namespace {

constexpr int kMaxGroupDepth = 200;

bool is_name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
}

class GbnfParser {
 public:
  explicit GbnfParser(std::string_view text) : text_(text) {}

  Grammar parse() {
    skip_space();
    while (more()) {
      const size_t start = at_;
      if (!is_name_char(peek())) error(at_, "expected a rule name");
      const std::string name = rule_name();
      skip_space();
      if (text_.substr(at_, 3) != "::=") error(at_, fmt::format("expected ::= after the rule name {}", name));
      at_ += 3;
      if (const auto defined = defined_at_.find(name); defined != defined_at_.end())
        error(start, fmt::format("rule {} is defined twice (first at {})", name, place(defined->second)));
      defined_at_[name] = start;
      const int32_t rule = rule_named(name, start);
      for (const Sequence& alternative : alternatives(name)) grammar_.add_alternative(rule, alternative);
      check_size(start);
      if (more() && !at_rule_start()) error(at_, fmt::format("unexpected {}", describe(peek())));
      skip_space();
    }
    for (const auto& [name, used_at] : first_use_)
      if (!defined_at_.count(name)) error(used_at, fmt::format("rule {} is used but never defined", name));
    const auto root = rules_.find("root");
    if (root == rules_.end()) fail("GBNF grammar: no rule is named root (the rule the whole text must match)");
    grammar_.set_root(root->second);
    try {
      grammar_.check();
    } catch (const Error& error) {
      fail("GBNF {}", error.what());
    }
    return std::move(grammar_);
  }

 private:
  bool more() const { return at_ < text_.size(); }
  char peek() const { return text_[at_]; }

  std::string place(size_t at) const {
    size_t line = 1, line_start = 0;
    for (size_t i = 0; i < at && i < text_.size(); ++i)
      if (text_[i] == '\n') ++line, line_start = i + 1;
    return fmt::format("line {}, column {}", line, at - line_start + 1);
  }
  [[noreturn]] void error(size_t at, std::string_view reason) const {
    fail("GBNF grammar at {}: {}", place(at), reason);
  }
  static std::string describe(char c) {
    const auto byte = static_cast<unsigned char>(c);
    return byte >= 0x20 && byte < 0x7F ? fmt::format("'{}'", c) : fmt::format("byte 0x{:02X}", byte);
  }

  void skip_space() {
    while (more()) {
      if (peek() == '#') {
        while (more() && peek() != '\n') ++at_;
      } else if (peek() == ' ' || peek() == '\t' || peek() == '\n' || peek() == '\r') {
        ++at_;
      } else {
        return;
      }
    }
  }

  // A rule name then ::= at the cursor: the next rule's start.
  bool at_rule_start() const {
    size_t at = at_;
    while (at < text_.size() && is_name_char(text_[at])) ++at;
    if (at == at_) return false;
    while (at < text_.size() && (text_[at] == ' ' || text_[at] == '\t')) ++at;
    return text_.substr(at, 3) == "::=";
  }

  std::string rule_name() {
    const size_t start = at_;
    while (more() && is_name_char(peek())) ++at_;
    return std::string(text_.substr(start, at_ - start));
  }

  int32_t rule_named(const std::string& name, size_t used_at) {
    if (const auto found = rules_.find(name); found != rules_.end()) return found->second;
    first_use_[name] = used_at;
    return rules_[name] = grammar_.add_rule(name);
  }

  int32_t generated_rule(const std::string& parent, const std::vector<Sequence>& alternatives) {
    return grammar_.add_rule(fmt::format("{}-{}", parent, ++generated_), alternatives);
  }

  void check_size(size_t at) const {
    if (grammar_.positions() > kMaxRequestGrammarPositions)
      error(at, fmt::format("the grammar is too large: it passes {} positions (counted repetitions copy what they "
                            "repeat)",
                            kMaxRequestGrammarPositions));
  }

  std::vector<Sequence> alternatives(const std::string& rule) {
    std::vector<Sequence> result = {sequence(rule)};
    while (more() && peek() == '|') {
      ++at_;
      result.push_back(sequence(rule));
    }
    return result;
  }

  Sequence sequence(const std::string& rule) {
    Sequence symbols;
    while (true) {
      skip_space();
      if (!more() || peek() == '|' || peek() == ')' || at_rule_start()) return symbols;
      const size_t start = at_;
      Sequence item = element(rule);
      skip_space();
      while (more() && (peek() == '*' || peek() == '+' || peek() == '?' || peek() == '{')) {
        item = repetition(std::move(item), start, rule);
        skip_space();
      }
      symbols = concat(std::move(symbols), item);
    }
  }

  Sequence element(const std::string& rule) {
    const size_t start = at_;
    const char c = peek();
    if (c == '"') {
      ++at_;
      std::string bytes;
      while (true) {
        if (!more()) error(start, "unterminated string literal");
        if (peek() == '"') break;
        append_utf8(bytes, character(true));
      }
      ++at_;
      return literal(bytes);
    }
    if (c == '[') return chars(char_class(), rule);
    if (c == '.') {
      ++at_;
      return chars(CharSet::any(), rule);
    }
    if (c == '(') {
      ++at_;
      if (++depth_ > kMaxGroupDepth) error(start, fmt::format("groups nest deeper than {}", kMaxGroupDepth));
      const std::vector<Sequence> inner = alternatives(rule);
      --depth_;
      if (!more() || peek() != ')') error(start, "unterminated group (");
      ++at_;
      if (inner.size() == 1) return inner.front();
      return {Symbol::reference(generated_rule(rule, inner))};
    }
    if (is_name_char(c)) return {Symbol::reference(rule_named(rule_name(), start))};
    if (c == '<') error(start, "token references (<…>, <[id]>) are not supported");
    error(start, fmt::format("unexpected {}", describe(c)));
  }

  // A character set as one byte-set symbol where it is one, else a rule of its UTF-8 texts.
  Sequence chars(const CharSet& set, const std::string& rule) {
    std::vector<Sequence> texts = char_set_sequences(set, CharEncoding::Utf8);
    if (texts.size() == 1 && texts.front().size() == 1) return texts.front();
    const int32_t chars_rule = generated_rule(rule, texts);
    char_texts_[chars_rule] = std::move(texts);
    return {Symbol::reference(chars_rule)};
  }

  // The alternatives of "one copy of `once`, then `next`". A character set's texts are written in
  // place of a reference to their rule: the matcher's token tables then follow a run of
  // characters within one rule ([^"]* as a JSON string's characters are), instead of finding
  // the rule finished after every character and each token's rest depending on what follows.
  std::vector<Sequence> copy_then(const Symbol& once, int32_t next) const {
    if (once.kind == Symbol::Kind::Rule)
      if (const auto texts = char_texts_.find(once.rule); texts != char_texts_.end()) {
        std::vector<Sequence> alternatives;
        for (const Sequence& text : texts->second) alternatives.push_back(concat(text, {Symbol::reference(next)}));
        return alternatives;
      }
    return {{once, Symbol::reference(next)}};
  }

  CharSet char_class() {
    const size_t start = at_;
    ++at_;
    const bool negated = more() && peek() == '^';
    if (negated) ++at_;
    CharSet set;
    while (true) {
      if (!more()) error(start, "unterminated character class [");
      if (peek() == ']') break;
      const size_t range_start = at_;
      const uint32_t first = character(false);
      uint32_t last = first;
      if (more() && peek() == '-' && at_ + 1 < text_.size() && text_[at_ + 1] != ']') {
        ++at_;
        last = character(false);
        if (last < first) error(range_start, "character range out of order");
      }
      set.add(first, last);
    }
    ++at_;
    return negated ? set.complement() : set;
  }

  // One character of a literal or a class, escapes decoded.
  uint32_t character(bool in_literal) {
    const size_t start = at_;
    if (peek() != '\\') {
      const std::optional<uint32_t> decoded = next_utf8(text_, at_);
      if (!decoded) error(start, "invalid UTF-8");
      if (!in_literal && *decoded == '\n') error(start, "a line break in a character class (write \\n)");
      return *decoded;
    }
    ++at_;
    if (!more()) error(start, "\\ at the end of the grammar");
    const char c = text_[at_++];
    int digits = 0;
    switch (c) {
      case 'x': digits = 2; break;
      case 'u': digits = 4; break;
      case 'U': digits = 8; break;
      case 't': return '\t';
      case 'r': return '\r';
      case 'n': return '\n';
      case '\\':
      case '"':
      case '[':
      case ']':
      case '-': return static_cast<uint32_t>(c);
      default: error(start, fmt::format("unknown escape \\{}", describe(c)));
    }
    uint64_t value = 0;
    for (int i = 0; i < digits; ++i) {
      if (!more() || hex_digit_value(peek()) < 0) error(start, "malformed hexadecimal escape");
      value = value * 16 + static_cast<uint64_t>(hex_digit_value(text_[at_++]));
    }
    if (value > kMaxCodePoint || (value >= 0xD800 && value <= 0xDFFF))
      error(start, "the escape is not a Unicode scalar value");
    return static_cast<uint32_t>(value);
  }

  int64_t count(size_t quantifier_start) {
    if (!more() || peek() < '0' || peek() > '9') error(quantifier_start, "malformed repetition {m,n}");
    int64_t value = 0;
    while (more() && peek() >= '0' && peek() <= '9') {
      value = value * 10 + (peek() - '0');
      if (value > static_cast<int64_t>(kMaxRequestGrammarPositions))
        error(quantifier_start, fmt::format("repetition count above {}", kMaxRequestGrammarPositions));
      ++at_;
    }
    return value;
  }

  Sequence repetition(Sequence item, size_t item_start, const std::string& rule) {
    const size_t start = at_;
    constexpr int64_t kUnbounded = -1;
    int64_t min = 0, max = kUnbounded;
    const char c = text_[at_++];
    if (c == '+') {
      min = 1;
    } else if (c == '?') {
      max = 1;
    } else if (c == '{') {
      skip_space();
      min = more() && peek() == ',' ? 0 : count(start);
      max = min;
      skip_space();
      if (more() && peek() == ',') {
        ++at_;
        skip_space();
        max = more() && peek() == '}' ? kUnbounded : count(start);
        skip_space();
      }
      if (!more() || peek() != '}') error(start, "malformed repetition {m,n}");
      ++at_;
      if (max != kUnbounded && min > max) error(start, "repetition {m,n} with m above n");
    }
    if (item.empty()) error(item_start, "nothing to repeat (the expression matches only the empty text)");
    // Each copy is one symbol: the item itself, or a rule holding it.
    const Symbol once = item.size() == 1 ? item.front() : Symbol::reference(generated_rule(rule, {item}));
    // Checked before anything is built. Each copy becomes a position of the finished grammar, but
    // may still sit in a sequence not yet added to it: the copies are counted on their own, and
    // the rules of the optional copies (added at once) with the grammar's positions.
    const int64_t optional = max == kUnbounded ? 1 : max - min;
    size_t copy_positions = 2;  // a rule's empty alternative, and the End of the copy's last one
    for (const Sequence& alternative : copy_then(once, 0)) copy_positions += alternative.size() + 1;
    copies_ += static_cast<size_t>(min) + 1;
    if (copies_ > kMaxRequestGrammarPositions ||
        grammar_.positions() + static_cast<size_t>(optional) * copy_positions > kMaxRequestGrammarPositions)
      error(start, fmt::format("the grammar is too large: it passes {} positions (counted repetitions copy what "
                               "they repeat)",
                               kMaxRequestGrammarPositions));
    Sequence result(static_cast<size_t>(min), once);
    if (max == kUnbounded) {
      // more ::= | once more (right recursion: the matcher's stack stays flat)
      const int32_t more_rule = grammar_.add_rule(fmt::format("{}-{}", rule, ++generated_));
      grammar_.add_alternative(more_rule, {});
      for (const Sequence& alternative : copy_then(once, more_rule)) grammar_.add_alternative(more_rule, alternative);
      result.push_back(Symbol::reference(more_rule));
    } else if (optional > 0) {
      // up_to[k] ::= | once up_to[k-1]: at most k more copies (up_to[0] matches nothing more).
      int32_t up_to = generated_rule(rule, {{}});
      for (int64_t k = 1; k <= optional; ++k) {
        std::vector<Sequence> alternatives = copy_then(once, up_to);
        alternatives.insert(alternatives.begin(), Sequence{});
        up_to = generated_rule(rule, alternatives);
      }
      result.push_back(Symbol::reference(up_to));
    }
    check_size(start);
    return result;
  }

  std::string_view text_;
  size_t at_ = 0;
  int depth_ = 0;
  int generated_ = 0;
  size_t copies_ = 0;  // symbols written by counted repetitions so far
  std::map<int32_t, std::vector<Sequence>> char_texts_;  // the texts of each character-set rule
  Grammar grammar_;
  std::map<std::string, int32_t> rules_;
  std::map<std::string, size_t> first_use_, defined_at_;
};

}  // namespace

Grammar gbnf_grammar(std::string_view text) { return GbnfParser(text).parse(); }

}  // namespace kiln::grammar
