// The syntax of kiln's Jinja interpreter: the template is cut into text and tags (with Jinja2's
// whitespace control, and transformers' trim_blocks / lstrip_blocks settings), and tags are parsed
// into a tree. Anything this subset does not know is an error naming the template line.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tokenizer/jinja_value.h"

namespace kiln::jinja {

struct Expression;
using ExpressionPtr = std::unique_ptr<Expression>;

struct Expression {
  enum class Kind {
    Literal,      // literal
    Name,         // name
    Attribute,    // object.name
    Item,         // object[operands[0]]
    Slice,        // object[operands[0]:operands[1]:operands[2]] (each may be null)
    Call,         // object(operands..., keywords...)
    Filter,       // object | name(operands..., keywords...)
    Test,         // object is [not] name(operands...)
    Unary,        // name ("-", "+", "not") applied to object
    Binary,       // operands[0] name operands[1]: + - * / // % ** ~ and or
    Compare,      // operands[0] names[0] operands[1] names[1] ...: == != < > <= >= in "not in"
    Conditional,  // operands[0] if object else operands[1] (operands[1] may be null)
    List,         // [operands...]
    Tuple,        // (operands...)
    Dict,         // {keys[i]: operands[i]}
  };
  Kind kind = Kind::Literal;
  int line = 0;
  Value literal;
  std::string name;
  ExpressionPtr object;
  std::vector<ExpressionPtr> operands;
  std::vector<std::string> names;
  std::vector<std::pair<std::string, ExpressionPtr>> keywords;
  std::vector<ExpressionPtr> keys;
  bool negated = false;  // Test: "is not"
  int height = 1;        // this node and the deepest chain of operands below it
};

struct Node;
using NodePtr = std::unique_ptr<Node>;
using Body = std::vector<NodePtr>;

struct Node {
  enum class Kind {
    Text,      // text
    Output,    // {{ expression }}
    If,        // conditions[i] -> bodies[i]; else_body
    For,       // for targets in expression [if condition]: body; else_body
    Set,       // set targets = expression, or set targets[0].attribute = expression
    SetBlock,  // set targets[0]: body
    Macro,     // macro name(parameters): body
    Break,
    Continue,
    FilterBlock,  // filter: `filter` applied to the body (its object is left empty)
    Generation,   // generation: body (rendered as is)
  };
  Kind kind = Kind::Text;
  int line = 0;
  std::string text;
  ExpressionPtr expression;
  std::vector<ExpressionPtr> conditions;
  std::vector<Body> bodies;
  Body body;
  Body else_body;
  std::vector<std::string> targets;
  std::string attribute;
  ExpressionPtr condition;
  std::string name;
  std::vector<std::pair<std::string, ExpressionPtr>> parameters;  // default may be null
  ExpressionPtr filter;
};

// Parses a template; errors are kiln::Error "<origin>: line N: ...". Blocks and expressions nest at
// most `max_depth` levels (Limits::parse_depth), so the tree can be walked and freed recursively.
Body parse_template(std::string_view source, const std::string& origin, int max_depth);

}  // namespace kiln::jinja
