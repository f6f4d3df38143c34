#include "tokenizer/jinja_syntax.h"

#include <fmt/format.h>

#include <cctype>
#include <charconv>
#include <cstdlib>
#include <optional>

#include "core/error.h"
#include "tokenizer/unicode.h"

namespace kiln::jinja {

namespace {

struct Token {
  enum class Kind { Name, String, Integer, Float, Operator, End } kind = Kind::End;
  std::string text;  // name, operator, or the decoded string literal
  Value value;       // numbers
  int line = 0;
};

// One piece of the template: text, or the tokens of a {{ }} or {% %} tag.
struct Piece {
  enum class Kind { Text, Output, Statement } kind = Kind::Text;
  std::string text;
  std::vector<Token> tokens;
  int line = 0;
};

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

class ExpressionParser {
 public:
  // `outer_depth`: the blocks around the tag, which count toward `max_depth` with its expressions.
  ExpressionParser(const std::vector<Token>& tokens, size_t start, const std::string& origin, int line, int outer_depth,
                   int max_depth)
      : tokens_(tokens),
        position_(start),
        origin_(origin),
        tag_line_(line),
        outer_depth_(outer_depth),
        depth_(outer_depth),
        max_depth_(max_depth) {}

  bool at_end() const { return position_ >= tokens_.size(); }
  size_t position() const { return position_; }
  const Token& peek(size_t ahead = 0) const {
    static const Token kEnd;
    return position_ + ahead < tokens_.size() ? tokens_[position_ + ahead] : kEnd;
  }
  bool peek_operator(std::string_view op, size_t ahead = 0) const {
    return peek(ahead).kind == Token::Kind::Operator && peek(ahead).text == op;
  }
  bool peek_name(std::string_view name, size_t ahead = 0) const {
    return peek(ahead).kind == Token::Kind::Name && peek(ahead).text == name;
  }
  int line() const { return at_end() ? (tokens_.empty() ? tag_line_ : tokens_.back().line) : peek().line; }

  [[noreturn]] void error(const std::string& message) const { fail("{}: line {}: {}", origin_, line(), message); }
  [[noreturn]] void too_deep() const {
    error(fmt::format("blocks and expressions nest deeper than {} levels, the limit of the template parser",
                      max_depth_));
  }

  void expect_operator(std::string_view op) {
    if (!peek_operator(op)) error(fmt::format("expected '{}'{}", op, describe_next()));
    ++position_;
  }
  std::string expect_name() {
    if (peek().kind != Token::Kind::Name) error("expected a name" + describe_next());
    return tokens_[position_++].text;
  }
  void expect_end() {
    if (!at_end()) error("unexpected '" + peek().text + "'");
  }
  std::string describe_next() const { return at_end() ? " at the end of the tag" : ", found '" + peek().text + "'"; }

  ExpressionPtr parse_expression() { return parse_conditional(); }
  // An expression without a trailing `if ... else ...` (a for loop's iterable, where `if` filters).
  ExpressionPtr parse_expression_without_condition() { return parse_or(); }

  // A comma-separated list of expressions; more than one (or a trailing comma) makes a tuple.
  ExpressionPtr parse_tuple_or_expression() {
    ExpressionPtr first = parse_expression();
    if (!peek_operator(",")) return first;
    auto tuple = make(Expression::Kind::Tuple);
    tuple->operands.push_back(std::move(first));
    while (peek_operator(",")) {
      ++position_;
      if (at_end() || peek_operator(")") || peek_operator("=")) break;
      tuple->operands.push_back(parse_expression());
    }
    return sealed(std::move(tuple));
  }

  // Call arguments after "(": positional then keyword (name=value); consumes ")".
  void parse_call_arguments(Expression& call) {
    while (!peek_operator(")")) {
      if (peek().kind == Token::Kind::Name && peek_operator("=", 1)) {
        std::string name = expect_name();
        ++position_;
        call.keywords.emplace_back(std::move(name), parse_expression());
      } else {
        if (!call.keywords.empty()) error("a positional argument follows a keyword argument");
        call.operands.push_back(parse_expression());
      }
      if (!peek_operator(",")) break;
      ++position_;
    }
    expect_operator(")");
  }

 private:
  ExpressionPtr make(Expression::Kind kind) {
    auto expression = std::make_unique<Expression>();
    expression->kind = kind;
    expression->line = line();
    return expression;
  }

  // A node whose operands are all in place: its height is checked, because loops (a|f|f|f, a+a+a)
  // build trees deeper than the parser's own recursion, and evaluating or freeing them recurses.
  ExpressionPtr sealed(ExpressionPtr node) const {
    int below = 0;
    auto see = [&below](const ExpressionPtr& child) {
      if (child) below = std::max(below, child->height);
    };
    see(node->object);
    for (const ExpressionPtr& operand : node->operands) see(operand);
    for (const auto& keyword : node->keywords) see(keyword.second);
    for (const ExpressionPtr& key : node->keys) see(key);
    node->height = below + 1;
    if (outer_depth_ + node->height > max_depth_) too_deep();
    return node;
  }

  NestingLevel nested() { return NestingLevel(depth_, max_depth_, [this] { too_deep(); }); }

  ExpressionPtr parse_conditional() {
    const NestingLevel level = nested();
    ExpressionPtr value = parse_or();
    while (peek_name("if")) {
      ++position_;
      auto conditional = make(Expression::Kind::Conditional);
      conditional->object = parse_or();
      conditional->operands.push_back(std::move(value));
      if (peek_name("else")) {
        ++position_;
        conditional->operands.push_back(parse_conditional());
      } else {
        conditional->operands.push_back(nullptr);
      }
      value = sealed(std::move(conditional));
    }
    return value;
  }

  ExpressionPtr binary(std::string op, ExpressionPtr left, ExpressionPtr right) {
    auto node = make(Expression::Kind::Binary);
    node->name = std::move(op);
    node->operands.push_back(std::move(left));
    node->operands.push_back(std::move(right));
    return sealed(std::move(node));
  }

  ExpressionPtr parse_or() {
    ExpressionPtr left = parse_and();
    while (peek_name("or")) {
      ++position_;
      left = binary("or", std::move(left), parse_and());
    }
    return left;
  }

  ExpressionPtr parse_and() {
    ExpressionPtr left = parse_not();
    while (peek_name("and")) {
      ++position_;
      left = binary("and", std::move(left), parse_not());
    }
    return left;
  }

  ExpressionPtr parse_not() {
    if (peek_name("not")) {
      const NestingLevel level = nested();
      auto node = make(Expression::Kind::Unary);
      ++position_;
      node->name = "not";
      node->object = parse_not();
      return sealed(std::move(node));
    }
    return parse_compare();
  }

  ExpressionPtr parse_compare() {
    ExpressionPtr first = parse_math1();
    ExpressionPtr compare;
    while (true) {
      std::string op;
      const Token& next = peek();
      if (next.kind == Token::Kind::Operator && (next.text == "==" || next.text == "!=" || next.text == "<" ||
                                                 next.text == ">" || next.text == "<=" || next.text == ">=")) {
        op = next.text;
        ++position_;
      } else if (peek_name("in")) {
        op = "in";
        ++position_;
      } else if (peek_name("not") && peek_name("in", 1)) {
        op = "not in";
        position_ += 2;
      } else {
        break;
      }
      if (!compare) {
        compare = make(Expression::Kind::Compare);
        compare->operands.push_back(std::move(first));
      }
      compare->names.push_back(op);
      compare->operands.push_back(parse_math1());
    }
    return compare ? sealed(std::move(compare)) : std::move(first);
  }

  ExpressionPtr parse_math1() {
    ExpressionPtr left = parse_concat();
    while (peek_operator("+") || peek_operator("-")) {
      std::string op = tokens_[position_++].text;
      left = binary(op, std::move(left), parse_concat());
    }
    return left;
  }

  ExpressionPtr parse_concat() {
    ExpressionPtr left = parse_math2();
    while (peek_operator("~")) {
      ++position_;
      left = binary("~", std::move(left), parse_math2());
    }
    return left;
  }

  ExpressionPtr parse_math2() {
    ExpressionPtr left = parse_pow();
    while (peek_operator("*") || peek_operator("/") || peek_operator("//") || peek_operator("%")) {
      std::string op = tokens_[position_++].text;
      left = binary(op, std::move(left), parse_pow());
    }
    return left;
  }

  ExpressionPtr parse_pow() {
    ExpressionPtr left = parse_unary(true);
    while (peek_operator("**")) {
      ++position_;
      left = binary("**", std::move(left), parse_unary(true));
    }
    return left;
  }

  ExpressionPtr parse_unary(bool with_filters) {
    ExpressionPtr node;
    if (peek_operator("-") || peek_operator("+")) {
      const NestingLevel level = nested();
      node = make(Expression::Kind::Unary);
      node->name = tokens_[position_++].text;
      node->object = parse_unary(false);
      node = sealed(std::move(node));
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filters) node = parse_filters(std::move(node));
    return node;
  }

  ExpressionPtr parse_primary() {
    const Token& token = peek();
    if (at_end()) error("expected an expression at the end of the tag");
    switch (token.kind) {
      case Token::Kind::Name: {
        ++position_;
        if (token.text == "true" || token.text == "True") return literal(Value(true), token.line);
        if (token.text == "false" || token.text == "False") return literal(Value(false), token.line);
        if (token.text == "none" || token.text == "None") return literal(Value::none(), token.line);
        auto name = make(Expression::Kind::Name);
        name->line = token.line;
        name->name = token.text;
        return name;
      }
      case Token::Kind::String: {
        // Adjacent string literals join, as in Python.
        std::string text;
        const int line_number = token.line;
        while (peek().kind == Token::Kind::String) text += tokens_[position_++].text;
        return literal(Value(std::move(text)), line_number);
      }
      case Token::Kind::Integer:
      case Token::Kind::Float:
        ++position_;
        return literal(token.value, token.line);
      case Token::Kind::Operator:
        break;
      case Token::Kind::End:
        break;
    }
    if (peek_operator("(")) {
      ++position_;
      if (peek_operator(")")) {
        ++position_;
        return make(Expression::Kind::Tuple);
      }
      ExpressionPtr inner = parse_tuple_or_expression();
      expect_operator(")");
      return inner;
    }
    if (peek_operator("[")) {
      auto list = make(Expression::Kind::List);
      ++position_;
      while (!peek_operator("]")) {
        list->operands.push_back(parse_expression());
        if (!peek_operator(",")) break;
        ++position_;
      }
      expect_operator("]");
      return sealed(std::move(list));
    }
    if (peek_operator("{")) {
      auto dict = make(Expression::Kind::Dict);
      ++position_;
      while (!peek_operator("}")) {
        dict->keys.push_back(parse_expression());
        expect_operator(":");
        dict->operands.push_back(parse_expression());
        if (!peek_operator(",")) break;
        ++position_;
      }
      expect_operator("}");
      return sealed(std::move(dict));
    }
    error("unexpected '" + token.text + "'");
  }

  ExpressionPtr literal(Value value, int line_number) {
    auto node = make(Expression::Kind::Literal);
    node->line = line_number;
    node->literal = std::move(value);
    return node;
  }

  ExpressionPtr parse_postfix(ExpressionPtr node) {
    while (true) {
      if (peek_operator(".")) {
        ++position_;
        auto attribute = make(Expression::Kind::Attribute);
        if (peek().kind == Token::Kind::Integer) {  // foo.0 is foo[0]
          attribute->kind = Expression::Kind::Item;
          attribute->operands.push_back(literal(tokens_[position_++].value, attribute->line));
        } else {
          attribute->name = expect_name();
        }
        attribute->object = std::move(node);
        node = sealed(std::move(attribute));
      } else if (peek_operator("[")) {
        ++position_;
        node = parse_subscript(std::move(node));
      } else if (peek_operator("(")) {
        ++position_;
        auto call = make(Expression::Kind::Call);
        call->object = std::move(node);
        parse_call_arguments(*call);
        node = sealed(std::move(call));
      } else {
        return node;
      }
    }
  }

  ExpressionPtr parse_subscript(ExpressionPtr object) {
    std::vector<ExpressionPtr> parts(1);
    bool is_slice = false;
    while (true) {
      if (peek_operator(":")) {
        ++position_;
        is_slice = true;
        if (parts.size() == 3) error("too many ':' in a slice");
        parts.emplace_back();
      } else if (peek_operator("]")) {
        ++position_;
        break;
      } else {
        if (parts.back()) error("expected ':' or ']'" + describe_next());
        parts.back() = parse_expression();
      }
    }
    auto node = make(is_slice ? Expression::Kind::Slice : Expression::Kind::Item);
    node->object = std::move(object);
    if (!is_slice && !parts[0]) error("empty subscript");
    if (is_slice) parts.resize(3);
    node->operands = std::move(parts);
    return sealed(std::move(node));
  }

  ExpressionPtr parse_filters(ExpressionPtr node) {
    while (true) {
      if (peek_operator("|")) {
        ++position_;
        auto filter = make(Expression::Kind::Filter);
        filter->name = expect_name();
        while (peek_operator(".")) {  // dotted filter names
          ++position_;
          filter->name += "." + expect_name();
        }
        if (peek_operator("(")) {
          ++position_;
          parse_call_arguments(*filter);
        }
        filter->object = std::move(node);
        node = sealed(std::move(filter));
      } else if (peek_name("is")) {
        ++position_;
        auto test = make(Expression::Kind::Test);
        if (peek_name("not")) {
          ++position_;
          test->negated = true;
        }
        test->name = expect_name();
        if (peek_operator("(")) {
          ++position_;
          parse_call_arguments(*test);
        } else if (!at_end() && !peek_name("else") && !peek_name("or") && !peek_name("and") && !peek_name("if") &&
                   !peek_name("is") &&
                   (peek().kind == Token::Kind::Name || peek().kind == Token::Kind::String ||
                    peek().kind == Token::Kind::Integer || peek().kind == Token::Kind::Float || peek_operator("[") ||
                    peek_operator("{") || peek_operator("("))) {
          // One argument without parentheses: `x is divisibleby 3`, `x is sameas false`.
          test->operands.push_back(parse_postfix(parse_primary()));
        }
        test->object = std::move(node);
        node = sealed(std::move(test));
      } else if (peek_operator("(")) {
        ++position_;
        auto call = make(Expression::Kind::Call);
        call->object = std::move(node);
        parse_call_arguments(*call);
        node = sealed(std::move(call));
      } else {
        return node;
      }
    }
  }

  const std::vector<Token>& tokens_;
  size_t position_;
  const std::string& origin_;
  int tag_line_;
  int outer_depth_;
  int depth_;
  int max_depth_;
};

class TemplateParser {
 public:
  TemplateParser(std::vector<Piece> pieces, const std::string& origin, int max_depth)
      : pieces_(std::move(pieces)), origin_(origin), max_depth_(max_depth) {}

  Body parse() {
    Body body;
    const std::string end = parse_body(body, {});
    if (!end.empty()) fail("{}: line {}: unexpected {{% {} %}}", origin_, pieces_[index_ - 1].line, end);
    return body;
  }

 private:
  // Parses nodes until a statement whose keyword is in `terminators` (returned, its tag consumed
  // up to the keyword: the caller reads the rest from `terminator_parser_`), or the end ("").
  std::string parse_body(Body& body, const std::vector<std::string_view>& terminators) {
    while (index_ < pieces_.size()) {
      Piece& piece = pieces_[index_++];
      if (piece.kind == Piece::Kind::Text) {
        auto node = std::make_unique<Node>();
        node->kind = Node::Kind::Text;
        node->line = piece.line;
        node->text = std::move(piece.text);
        body.push_back(std::move(node));
        continue;
      }
      if (piece.tokens.empty()) fail("{}: line {}: empty tag", origin_, piece.line);
      ExpressionParser parser(piece.tokens, 0, origin_, piece.line, depth_, max_depth_);
      if (piece.kind == Piece::Kind::Output) {
        auto node = std::make_unique<Node>();
        node->kind = Node::Kind::Output;
        node->line = piece.line;
        node->expression = parser.parse_expression();
        parser.expect_end();
        body.push_back(std::move(node));
        continue;
      }
      if (piece.tokens[0].kind != Token::Kind::Name) parser.error("expected a statement keyword");
      const std::string keyword = parser.expect_name();
      if (std::find(terminators.begin(), terminators.end(), keyword) != terminators.end()) {
        current_tag_ = &piece;
        terminator_position_ = parser.position();
        return keyword;
      }
      body.push_back(parse_statement(keyword, parser, piece.line));
    }
    return "";
  }

  // The parser for the rest of the terminator tag that ended the last parse_body.
  ExpressionParser rest_of_terminator() const {
    return ExpressionParser(current_tag_->tokens, terminator_position_, origin_, current_tag_->line, depth_,
                            max_depth_);
  }

  std::string expect_terminator(Body& body, const std::vector<std::string_view>& terminators, std::string_view opener,
                                int line) {
    const std::string end = parse_body(body, terminators);
    if (end.empty()) fail("{}: line {}: {{% {} %}} is never closed", origin_, line, opener);
    return end;
  }

  NodePtr parse_statement(const std::string& keyword, ExpressionParser& parser, int line) {
    // Blocks nest by recursion here, and again when rendered.
    const NestingLevel level(depth_, max_depth_, [&] {
      fail("{}: line {}: blocks and expressions nest deeper than {} levels, the limit of the template parser",
           origin_, line, max_depth_);
    });
    auto node = std::make_unique<Node>();
    node->line = line;
    if (keyword == "if") {
      node->kind = Node::Kind::If;
      node->conditions.push_back(parser.parse_expression());
      parser.expect_end();
      while (true) {
        node->bodies.emplace_back();
        const std::string end = expect_terminator(node->bodies.back(), {"elif", "else", "endif"}, "if", line);
        ExpressionParser rest = rest_of_terminator();
        if (end == "elif") {
          node->conditions.push_back(rest.parse_expression());
          rest.expect_end();
          continue;
        }
        rest.expect_end();
        if (end == "else") {
          expect_terminator(node->else_body, {"endif"}, "if", line);
          rest_of_terminator().expect_end();
        }
        break;
      }
    } else if (keyword == "for") {
      node->kind = Node::Kind::For;
      do {
        node->targets.push_back(parser.expect_name());
        if (!parser.peek_operator(",")) break;
        parser.expect_operator(",");
      } while (true);
      if (!parser.peek_name("in")) parser.error("expected 'in'" + parser.describe_next());
      parser.expect_name();
      node->expression = parser.parse_expression_without_condition();
      if (parser.peek_name("if")) {
        parser.expect_name();
        node->condition = parser.parse_expression();
      }
      if (parser.peek_name("recursive")) parser.error("recursive loops are not supported");
      parser.expect_end();
      const std::string end = expect_terminator(node->body, {"else", "endfor"}, "for", line);
      rest_of_terminator().expect_end();
      if (end == "else") {
        expect_terminator(node->else_body, {"endfor"}, "for", line);
        rest_of_terminator().expect_end();
      }
    } else if (keyword == "set") {
      node->targets.push_back(parser.expect_name());
      if (parser.peek_operator(".")) {
        parser.expect_operator(".");
        node->attribute = parser.expect_name();
      } else {
        while (parser.peek_operator(",")) {
          parser.expect_operator(",");
          node->targets.push_back(parser.expect_name());
        }
      }
      if (parser.at_end()) {
        if (node->targets.size() != 1 || !node->attribute.empty()) parser.error("a block set takes one name");
        node->kind = Node::Kind::SetBlock;
        expect_terminator(node->body, {"endset"}, "set", line);
        rest_of_terminator().expect_end();
      } else {
        node->kind = Node::Kind::Set;
        parser.expect_operator("=");
        node->expression = parser.parse_tuple_or_expression();
        parser.expect_end();
      }
    } else if (keyword == "macro") {
      node->kind = Node::Kind::Macro;
      node->name = parser.expect_name();
      parser.expect_operator("(");
      while (!parser.peek_operator(")")) {
        std::string parameter = parser.expect_name();
        ExpressionPtr default_value;
        if (parser.peek_operator("=")) {
          parser.expect_operator("=");
          default_value = parser.parse_expression();
        }
        node->parameters.emplace_back(std::move(parameter), std::move(default_value));
        if (!parser.peek_operator(",")) break;
        parser.expect_operator(",");
      }
      parser.expect_operator(")");
      parser.expect_end();
      expect_terminator(node->body, {"endmacro"}, "macro", line);
      rest_of_terminator().expect_end();
    } else if (keyword == "break" || keyword == "continue") {
      node->kind = keyword == "break" ? Node::Kind::Break : Node::Kind::Continue;
      parser.expect_end();
    } else if (keyword == "filter") {
      node->kind = Node::Kind::FilterBlock;
      auto filter = std::make_unique<Expression>();
      filter->kind = Expression::Kind::Filter;
      filter->line = line;
      filter->name = parser.expect_name();
      if (parser.peek_operator("(")) {
        parser.expect_operator("(");
        parser.parse_call_arguments(*filter);
      }
      parser.expect_end();
      node->filter = std::move(filter);
      expect_terminator(node->body, {"endfilter"}, "filter", line);
      rest_of_terminator().expect_end();
    } else if (keyword == "generation") {
      // transformers' AssistantTracker extension: marks assistant text, renders it unchanged.
      node->kind = Node::Kind::Generation;
      parser.expect_end();
      expect_terminator(node->body, {"endgeneration"}, "generation", line);
      rest_of_terminator().expect_end();
    } else {
      fail("{}: line {}: unsupported tag {{% {} %}}", origin_, line, keyword);
    }
    return node;
  }

  std::vector<Piece> pieces_;
  const std::string& origin_;
  size_t index_ = 0;
  const Piece* current_tag_ = nullptr;
  size_t terminator_position_ = 0;
  int max_depth_;
  int depth_ = 0;  // blocks open around the tag being parsed
};

}  // namespace

Body parse_template(std::string_view source, const std::string& origin, int max_depth) {
  Scanner scanner(source, origin);
  TemplateParser parser(scanner.scan(), origin, max_depth);
  return parser.parse();
}

}  // namespace kiln::jinja
