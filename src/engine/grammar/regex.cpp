#include "engine/grammar/regex.h"

#include <cctype>
#include <vector>

#include "core/error.h"

namespace kiln::grammar {

namespace {

// A counted repetition copies what it repeats; past this count the automaton is refused before it
// is built.
constexpr int64_t kMaxRepeatCount = 1000;
constexpr int64_t kUnbounded = -1;
// Groups nest at most this deep (the parser recurses per group).
constexpr int kMaxGroupDepth = 200;
// Each state leads to at least one grammar position; past the positions limit there is no point.
constexpr size_t kMaxStates = kMaxRequestGrammarPositions;

struct Node {
  enum class Kind { Chars, Sequence, Alternation, Repeat };
  Kind kind = Kind::Sequence;
  CharSet chars;                // Chars
  std::vector<Node> children;   // Sequence, Alternation; Repeat: the one repeated
  int64_t min = 1, max = 1;     // Repeat; max kUnbounded for no limit

  static Node of(CharSet chars) {
    Node node;
    node.kind = Kind::Chars;
    node.chars = std::move(chars);
    return node;
  }
  static Node repeat(Node child, int64_t min, int64_t max) {
    Node node;
    node.kind = Kind::Repeat;
    node.children.push_back(std::move(child));
    node.min = min;
    node.max = max;
    return node;
  }
};

CharSet digit_chars() { return CharSet::range('0', '9'); }
CharSet word_chars() { return CharSet::range('a', 'z').add('A', 'Z').add('0', '9').add('_', '_'); }
// ECMAScript's WhiteSpace and LineTerminator characters.
CharSet space_chars() {
  CharSet set = CharSet::range('\t', '\r').add(' ', ' ').add(0xA0, 0xA0).add(0x1680, 0x1680).add(0x2000, 0x200A);
  return set.add(0x2028, 0x2029).add(0x202F, 0x202F).add(0x205F, 0x205F).add(0x3000, 0x3000).add(0xFEFF, 0xFEFF);
}
// `.`: anything but a line terminator.
CharSet dot_chars() { return CharSet::of('\n').add('\r', '\r').add(0x2028, 0x2029).complement(); }

bool is_digit(char c) { return c >= '0' && c <= '9'; }

class RegexParser {
 public:
  explicit RegexParser(std::string_view pattern) : pattern_(pattern) {}

  Node parse() {
    if (more() && peek() == '^') {
      anchored_start = true;
      ++at_;
    }
    Node node = alternation();
    if (more()) error(at_, "unmatched )");
    return node;
  }

  bool anchored_start = false, anchored_end = false;
  bool top_level_alternatives = false;

  [[noreturn]] void error(size_t at, std::string_view reason) const {
    fail("regex at offset {}: {}", at, reason);
  }

 private:
  bool more() const { return at_ < pattern_.size(); }
  char peek() const { return pattern_[at_]; }

  Node alternation() {
    Node first = sequence();
    if (!more() || peek() != '|') return first;
    if (depth_ == 0) top_level_alternatives = true;
    Node node;
    node.kind = Node::Kind::Alternation;
    node.children.push_back(std::move(first));
    while (more() && peek() == '|') {
      ++at_;
      node.children.push_back(sequence());
    }
    return node;
  }

  Node sequence() {
    Node node;
    while (more() && peek() != '|' && peek() != ')') {
      Node atom_node = atom();
      int64_t min, max;
      while (quantifier(min, max)) {
        atom_node = Node::repeat(std::move(atom_node), min, max);
        if (more() && (peek() == '*' || peek() == '+' || peek() == '?' || peek() == '{'))
          error(at_, "nothing to repeat (a quantifier follows a quantifier)");
      }
      node.children.push_back(std::move(atom_node));
    }
    return node;
  }

  // A quantifier at the cursor (and its lazy `?`): consumed, with its counts.
  bool quantifier(int64_t& min, int64_t& max) {
    if (!more()) return false;
    const size_t start = at_;
    switch (peek()) {
      case '*': min = 0, max = kUnbounded, ++at_; break;
      case '+': min = 1, max = kUnbounded, ++at_; break;
      case '?': min = 0, max = 1, ++at_; break;
      case '{': {
        ++at_;
        min = count(start);
        max = min;
        if (more() && peek() == ',') {
          ++at_;
          max = more() && is_digit(peek()) ? count(start) : kUnbounded;
        }
        if (!more() || peek() != '}') error(start, "malformed quantifier (expected {n}, {n,} or {n,m})");
        ++at_;
        if (max != kUnbounded && min > max) error(start, "quantifier {n,m} with n above m");
        break;
      }
      default: return false;
    }
    if (more() && peek() == '?') ++at_;  // lazy: the same texts
    return true;
  }

  int64_t count(size_t quantifier_start) {
    if (!more() || !is_digit(peek())) error(quantifier_start, "malformed quantifier (expected {n}, {n,} or {n,m})");
    int64_t value = 0;
    while (more() && is_digit(peek())) {
      value = value * 10 + (peek() - '0');
      if (value > kMaxRepeatCount)
        error(quantifier_start, fmt::format("repetition count above {} is not supported", kMaxRepeatCount));
      ++at_;
    }
    return value;
  }

  Node atom() {
    const size_t start = at_;
    switch (peek()) {
      case '(': return group();
      case '[': return Node::of(char_class());
      case '.': ++at_; return Node::of(dot_chars());
      case '\\': {
        const ClassAtom escaped = escape(false);
        return Node::of(escaped.chars);
      }
      case '^': error(start, "^ is supported only at the start of the pattern");
      case '$':
        if (at_ + 1 != pattern_.size() || depth_ > 0) error(start, "$ is supported only at the end of the pattern");
        anchored_end = true;
        ++at_;
        return Node();
      case '*':
      case '+':
      case '?': error(start, "nothing to repeat");
      case '{': error(start, "a { that starts no quantifier must be escaped (\\{)");
      default: return Node::of(CharSet::of(character()));
    }
  }

  // A literal character (UTF-8) at the cursor.
  uint32_t character() {
    const size_t start = at_;
    const std::optional<uint32_t> decoded = next_utf8(pattern_, at_);
    if (!decoded) error(start, "invalid UTF-8");
    return *decoded;
  }

  Node group() {
    const size_t start = at_;
    ++at_;
    if (more() && peek() == '?') {
      ++at_;
      if (more() && peek() == ':') {
        ++at_;
      } else if (more() && (peek() == '=' || peek() == '!')) {
        error(start, "lookahead assertions are not supported");
      } else if (more() && peek() == '<' && at_ + 1 < pattern_.size() &&
                 (pattern_[at_ + 1] == '=' || pattern_[at_ + 1] == '!')) {
        error(start, "lookbehind assertions are not supported");
      } else if (more() && peek() == '<') {
        // A named group: its name changes nothing.
        const size_t close = pattern_.find('>', at_);
        if (close == std::string_view::npos || close == at_ + 1) error(start, "malformed group name");
        at_ = close + 1;
      } else {
        error(start, "unknown group syntax (?…); supported: (…), (?:…) and (?<name>…)");
      }
    }
    if (++depth_ > kMaxGroupDepth) error(start, fmt::format("groups nest deeper than {}", kMaxGroupDepth));
    Node inner = alternation();
    --depth_;
    if (!more() || peek() != ')') error(start, "unterminated group");
    ++at_;
    return inner;
  }

  struct ClassAtom {
    CharSet chars;
    bool single = true;  // one character (may bound a range)
    uint32_t character = 0;
  };
  static ClassAtom one(uint32_t character) { return {CharSet::of(character), true, character}; }
  static ClassAtom many(CharSet chars) { return {std::move(chars), false, 0}; }

  uint32_t hex_digits(size_t start, int digits) {
    uint32_t value = 0;
    for (int i = 0; i < digits; ++i) {
      if (!more() || hex_digit_value(peek()) < 0) error(start, "malformed hexadecimal escape");
      value = value * 16 + static_cast<uint32_t>(hex_digit_value(peek()));
      ++at_;
    }
    return value;
  }

  // An escape at the cursor (its backslash), outside a class or inside one.
  ClassAtom escape(bool in_class) {
    const size_t start = at_;
    ++at_;
    if (!more()) error(start, "\\ at the end of the pattern");
    const char c = peek();
    ++at_;
    switch (c) {
      case 'd': return many(digit_chars());
      case 'D': return many(digit_chars().complement());
      case 'w': return many(word_chars());
      case 'W': return many(word_chars().complement());
      case 's': return many(space_chars());
      case 'S': return many(space_chars().complement());
      case 't': return one('\t');
      case 'n': return one('\n');
      case 'v': return one('\v');
      case 'f': return one('\f');
      case 'r': return one('\r');
      case '0':
        if (more() && is_digit(peek())) error(start, "octal escapes are not supported");
        return one(0);
      case 'b':
        if (in_class) return one('\b');
        error(start, "word boundaries (\\b) are not supported");
      case 'B': error(start, "word boundaries (\\B) are not supported");
      case 'c':
        if (more() && ((peek() >= 'a' && peek() <= 'z') || (peek() >= 'A' && peek() <= 'Z')))
          return one(static_cast<uint32_t>(pattern_[at_++]) % 32);
        error(start, "\\c must be followed by a letter");
      case 'x': return one(hex_digits(start, 2));
      case 'u': {
        uint32_t value;
        if (more() && peek() == '{') {
          ++at_;
          value = 0;
          int digits = 0;
          while (more() && hex_digit_value(peek()) >= 0) {
            value = value * 16 + static_cast<uint32_t>(hex_digit_value(pattern_[at_++]));
            if (++digits > 6) error(start, "malformed \\u{…} escape");
          }
          if (digits == 0 || !more() || peek() != '}') error(start, "malformed \\u{…} escape");
          ++at_;
        } else {
          value = hex_digits(start, 4);
          // A surrogate pair written as two escapes is one character.
          if (value >= 0xD800 && value <= 0xDBFF && pattern_.substr(at_, 2) == "\\u") {
            const size_t low_start = at_;
            at_ += 2;
            const uint32_t low = hex_digits(low_start, 4);
            if (low < 0xDC00 || low > 0xDFFF) error(low_start, "a high surrogate must be followed by a low one");
            value = 0x10000 + ((value - 0xD800) << 10) + (low - 0xDC00);
          }
        }
        if (value > kMaxCodePoint || (value >= 0xD800 && value <= 0xDFFF))
          error(start, "the escape is not a Unicode scalar value");
        return one(value);
      }
      case 'k': error(start, "named backreferences are not supported");
      case 'p':
      case 'P': error(start, "Unicode property escapes (\\p, \\P) are not supported");
      default: break;
    }
    if (is_digit(c)) error(start, "backreferences are not supported");
    // Escaped punctuation stands for itself.
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x80 && !std::isalnum(byte) && c != '_' && byte >= 0x20) return one(byte);
    error(start, fmt::format("unknown escape \\{}", byte < 0x80 && byte >= 0x20 ? std::string(1, c) : "…"));
  }

  CharSet char_class() {
    const size_t start = at_;
    ++at_;
    const bool negated = more() && peek() == '^';
    if (negated) ++at_;
    CharSet set;
    while (true) {
      if (!more()) error(start, "unterminated character class");
      if (peek() == ']') {
        ++at_;
        break;
      }
      const size_t atom_start = at_;
      const ClassAtom first = class_atom();
      if (more() && peek() == '-' && at_ + 1 < pattern_.size() && pattern_[at_ + 1] != ']') {
        ++at_;
        const ClassAtom last = class_atom();
        if (!first.single || !last.single) error(atom_start, "a class escape (\\d, \\w, \\s…) cannot bound a range");
        if (first.character > last.character) error(atom_start, "character class range out of order");
        set.add(first.character, last.character);
      } else {
        set.add(first.chars);
      }
    }
    return negated ? set.complement() : set;
  }

  ClassAtom class_atom() {
    if (peek() == '\\') return escape(true);
    return one(character());
  }

  std::string_view pattern_;
  size_t at_ = 0;
  int depth_ = 0;
};

// A Thompson automaton: states joined by ε moves and by character sets.
class Automaton {
 public:
  struct Edge {
    CharSet chars;
    int32_t to;
  };
  struct State {
    std::vector<int32_t> empty_moves;
    std::vector<Edge> edges;
  };

  int32_t add_state() {
    if (states_.size() >= kMaxStates)
      fail("regex: the pattern is too large: its automaton passes {} states (counted repetitions copy what they "
           "repeat)",
           kMaxStates);
    states_.emplace_back();
    return static_cast<int32_t>(states_.size() - 1);
  }

  // Adds the texts of `node` from state `from`; returns the state where they end.
  int32_t build(const Node& node, int32_t from) {
    switch (node.kind) {
      case Node::Kind::Chars: {
        const int32_t to = add_state();
        states_[from].edges.push_back({node.chars, to});
        return to;
      }
      case Node::Kind::Sequence:
        for (const Node& child : node.children) from = build(child, from);
        return from;
      case Node::Kind::Alternation: {
        const int32_t end = add_state();
        for (const Node& child : node.children) {
          const int32_t start = add_state();
          states_[from].empty_moves.push_back(start);
          states_[build(child, start)].empty_moves.push_back(end);
        }
        return end;
      }
      case Node::Kind::Repeat: {
        const Node& child = node.children.front();
        for (int64_t i = 0; i < node.min; ++i) from = build(child, from);
        if (node.max == kUnbounded) {
          const int32_t loop = add_state();
          states_[from].empty_moves.push_back(loop);
          states_[build(child, loop)].empty_moves.push_back(loop);
          return loop;
        }
        const int32_t end = add_state();
        for (int64_t i = node.min; i < node.max; ++i) {
          states_[from].empty_moves.push_back(end);
          from = build(child, from);
        }
        states_[from].empty_moves.push_back(end);
        return end;
      }
    }
    return from;
  }

  // The states reachable from `state` by ε moves, itself included.
  std::vector<int32_t> closure(int32_t state) {
    ++stamp_;
    seen_.resize(states_.size(), 0);
    std::vector<int32_t> found = {state}, pending = {state};
    seen_[state] = stamp_;
    while (!pending.empty()) {
      const int32_t next = pending.back();
      pending.pop_back();
      for (int32_t to : states_[next].empty_moves)
        if (seen_[to] != stamp_) {
          seen_[to] = stamp_;
          found.push_back(to);
          pending.push_back(to);
        }
    }
    return found;
  }

  // Whether some text leads from `start` to `accept`.
  bool reaches(int32_t start, int32_t accept) {
    std::vector<bool> visited(states_.size(), false);
    std::vector<int32_t> pending = {start};
    visited[start] = true;
    while (!pending.empty()) {
      const int32_t state = pending.back();
      pending.pop_back();
      if (state == accept) return true;
      for (int32_t to : states_[state].empty_moves)
        if (!visited[to]) visited[to] = true, pending.push_back(to);
      for (const Edge& edge : states_[state].edges)
        if (!edge.chars.empty() && !visited[edge.to]) visited[edge.to] = true, pending.push_back(edge.to);
    }
    return false;
  }

  // The rules: one per state that starts or ends a character move, ε-closures folded in.
  int32_t emit(Grammar& grammar, int32_t start, int32_t accept, CharEncoding encoding) {
    std::vector<int32_t> rule_of(states_.size(), -1);
    std::vector<int32_t> pending;
    const auto rule_for = [&](int32_t state) {
      if (rule_of[state] < 0) {
        rule_of[state] = grammar.add_rule(fmt::format("regex state {}", state));
        pending.push_back(state);
      }
      return rule_of[state];
    };
    // Each edge's character texts, made once however many closures hold it.
    std::vector<std::vector<std::vector<Sequence>>> texts(states_.size());
    const int32_t first = rule_for(start);
    while (!pending.empty()) {
      const int32_t state = pending.back();
      pending.pop_back();
      bool can_end = false;
      for (int32_t member : closure(state)) {
        can_end = can_end || member == accept;
        const std::vector<Edge>& edges = states_[member].edges;
        if (texts[member].empty())
          for (const Edge& edge : edges) texts[member].push_back(char_set_sequences(edge.chars, encoding));
        for (size_t i = 0; i < edges.size(); ++i)
          for (const Sequence& text : texts[member][i])
            grammar.add_alternative(rule_of[state], concat(text, {Symbol::reference(rule_for(edges[i].to))}));
        if (grammar.positions() > kMaxRequestGrammarPositions)
          fail("regex: the pattern is too large: its grammar passes {} positions", kMaxRequestGrammarPositions);
      }
      if (can_end) grammar.add_alternative(rule_of[state], {});
    }
    return first;
  }

 private:
  std::vector<State> states_;
  std::vector<uint32_t> seen_;
  uint32_t stamp_ = 0;
};

}  // namespace

int32_t add_regex(Grammar& grammar, std::string_view pattern, const RegexOptions& options) {
  RegexParser parser(pattern);
  Node node = parser.parse();
  if (!options.whole_text) {
    if (parser.top_level_alternatives && (parser.anchored_start || parser.anchored_end))
      parser.error(0, "^ or $ beside alternatives at the top level is ambiguous here; group them: ^(a|b)$");
    // Unanchored ends: any text before and after the match.
    const Node any_text = Node::repeat(Node::of(CharSet::any()), 0, kUnbounded);
    Node searched;
    if (!parser.anchored_start) searched.children.push_back(any_text);
    searched.children.push_back(std::move(node));
    if (!parser.anchored_end) searched.children.push_back(any_text);
    node = std::move(searched);
  }
  Automaton automaton;
  const int32_t start = automaton.add_state();
  const int32_t accept = automaton.build(node, start);
  if (!automaton.reaches(start, accept)) fail("regex: the pattern matches no text");
  return automaton.emit(grammar, start, accept, options.encoding);
}

Grammar regex_grammar(std::string_view pattern) {
  Grammar grammar;
  grammar.set_root(add_regex(grammar, pattern));
  grammar.check();
  return grammar;
}

}  // namespace kiln::grammar
