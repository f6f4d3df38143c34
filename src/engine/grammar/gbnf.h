// GBNF, llama.cpp's grammar language (its grammars/README.md), compiled into the engine's grammar.
//
//   root ::= "Answer: " answer "\n"        # rules: name ::= alternatives; the root is `root`
//   answer ::= ("yes" | "no") [.!]? | num  # sequences, | alternatives, ( ) groups
//   num ::= [1-9] [0-9]{0,3}               # [ranges], [^negated], `.`, * + ? {m} {m,} {m,n} {,n}
//
// Rule names are letters, digits, `-` and `_`. Terminals are Unicode characters, in "literals" and
// [classes], with the escapes \xHH \uHHHH \UHHHHHHHH \t \r \n \\ \" \[ \] \-. Whitespace, line
// breaks and `#` comments may stand between any two symbols: a rule ends where the next one
// (`name ::=`) begins, which llama.cpp's newline rules always imply. llama.cpp's token references
// (<…>, <[id]>) are not supported. Rules may recurse, but not on the left (nor may a repetition
// repeat what can match nothing): the matcher expands rules top-down.
#pragma once

#include <string_view>

#include "engine/grammar/grammar.h"

namespace kiln::grammar {

// Fails (kiln::Error) with the line, column and reason for a malformed grammar, a rule used and
// never defined, a missing root, left recursion, or a grammar past kMaxRequestGrammarPositions.
Grammar gbnf_grammar(std::string_view text);

}  // namespace kiln::grammar
