#include "tokenizer/jinja_syntax.h"

#include <fmt/format.h>

#include <algorithm>
#include <initializer_list>
#include <string_view>

#include "core/error.h"
#include "tokenizer/jinja_scanner.h"

namespace kiln::jinja {

namespace {

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
  // A call of `callee`, its "(" just consumed.
  ExpressionPtr parse_call(ExpressionPtr callee) {
    auto call = make(Expression::Kind::Call);
    call->object = std::move(callee);
    parse_call_arguments(*call);
    return sealed(std::move(call));
  }

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

  // operand (op operand)*, grouped from the left, for op among `ops`: keywords (Name tokens) or
  // symbols (Operator tokens).
  template <class Operand>
  ExpressionPtr left_associative(Token::Kind op_kind, std::initializer_list<std::string_view> ops, Operand operand) {
    ExpressionPtr left = operand();
    while (peek().kind == op_kind && std::find(ops.begin(), ops.end(), peek().text) != ops.end()) {
      std::string op = tokens_[position_++].text;
      left = binary(op, std::move(left), operand());
    }
    return left;
  }

  ExpressionPtr parse_or() { return left_associative(Token::Kind::Name, {"or"}, [this] { return parse_and(); }); }

  ExpressionPtr parse_and() { return left_associative(Token::Kind::Name, {"and"}, [this] { return parse_not(); }); }

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
    return left_associative(Token::Kind::Operator, {"+", "-"}, [this] { return parse_concat(); });
  }

  ExpressionPtr parse_concat() {
    return left_associative(Token::Kind::Operator, {"~"}, [this] { return parse_math2(); });
  }

  ExpressionPtr parse_math2() {
    return left_associative(Token::Kind::Operator, {"*", "/", "//", "%"}, [this] { return parse_pow(); });
  }

  ExpressionPtr parse_pow() {
    return left_associative(Token::Kind::Operator, {"**"}, [this] { return parse_unary(true); });
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
        node = parse_call(std::move(node));
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
        node = parse_call(std::move(node));
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
  TemplateParser parser(scan_template(source, origin), origin, max_depth);
  return parser.parse();
}

}  // namespace kiln::jinja
