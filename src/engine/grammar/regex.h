// Regular expressions (a subset of ECMAScript's, the dialect JSON Schema's `pattern` and vLLM's
// guided_regex are written in) compiled into a grammar.
//
// Supported: literal characters; escapes \d \w \s \D \W \S, \t \n \r \f \v \0, \cX, \xHH, \uHHHH,
// \u{H…} and escaped punctuation; classes [...] with ranges, negation and class escapes ([\b] is a
// backspace); `.` (any character but a line terminator); groups, capturing, named and (?:…);
// alternation; quantifiers * + ? {n} {n,} {n,m}, lazy or not (the same language); ^ at the very
// start and $ at the very end. Anything else (lookaround, backreferences, \b word boundaries, \p
// properties, anchors elsewhere) fails, naming the construct and its byte offset.
//
// The expression becomes a Thompson automaton whose ε-closures are folded into the rules: every
// rule is a set of alternatives "one character, then the rule of the state it leads to" (plus an
// empty one where the match may end), so the grammar is right-linear, never left-recursive, and
// the matcher's stacks stay one rule deep.
#pragma once

#include <string_view>

#include "engine/grammar/char_set.h"
#include "engine/grammar/grammar.h"

namespace kiln::grammar {

struct RegexOptions {
  // The whole text must match (a request's regex: ^ and $ change nothing); else, as JSON Schema
  // reads `pattern`, any text containing a match does, unless ^ or $ pin it to an end.
  bool whole_text = true;
  CharEncoding encoding = CharEncoding::Utf8;
};

// Adds the rules of the texts `pattern` matches and returns the first. Fails (kiln::Error) with the
// byte offset and the reason for a malformed or unsupported pattern, or for one whose automaton
// would pass kMaxRequestGrammarPositions (counted repetitions copy what they repeat).
int32_t add_regex(Grammar& grammar, std::string_view pattern, const RegexOptions& options = {});
// A grammar of the whole texts `pattern` matches, checked.
Grammar regex_grammar(std::string_view pattern);

}  // namespace kiln::grammar
