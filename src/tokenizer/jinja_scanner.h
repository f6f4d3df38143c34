// The first stage of kiln's Jinja interpreter: a template cut into pieces (text, and the tokens of
// each {{ }} or {% %} tag), with Jinja2's whitespace control and transformers' trim_blocks /
// lstrip_blocks settings applied. jinja_syntax.cpp parses the pieces into a tree.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/jinja_value.h"

namespace kiln::jinja {

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

// The pieces of `source`; a malformed tag or literal is an error naming `origin` and the line.
std::vector<Piece> scan_template(std::string_view source, const std::string& origin);

}  // namespace kiln::jinja
