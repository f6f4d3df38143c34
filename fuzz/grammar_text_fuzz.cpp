// A request's grammar text (engine/grammar/regex.h, engine/grammar/gbnf.h): the same bytes parsed
// as a regex (whole-text and, as a schema's pattern inside a JSON string, unanchored) and as a GBNF
// grammar; each grammar that compiles to at most kWalkedPositions positions is compiled against a
// small vocabulary and walked through its masks for up to 32 tokens, each the allowed token a byte
// after the NUL picks. (Compiling walks the vocabulary once per position, seconds for the largest
// grammars in this build: the parsers, where the inputs' variety lies, run on every input.)
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "engine/grammar/gbnf.h"
#include "engine/grammar/regex.h"
#include "engine/grammar/token_mask.h"
#include "fuzz_support.h"

namespace {

using namespace kiln::grammar;

constexpr size_t kWalkedPositions = 800;

std::shared_ptr<const TokenVocabulary> vocabulary() {
  static const auto shared = [] {
    // Every byte below 0x80 and the bytes of é and 😀 (a two- and a four-byte character), and
    // pieces that cross escapes and markup.
    std::vector<std::string> bytes = {""};
    for (int byte = 1; byte < 0x80; ++byte) bytes.push_back(std::string(1, static_cast<char>(byte)));
    for (const char* piece : {"\xC3", "\xA9", "\xF0", "\x9F", "\x98", "\x80", "ab", "\\\"", "\\n", "\xC3\xA9",
                              "12", "yes", "\"}", "</", "]]>", "\\u00"})
      bytes.push_back(piece);
    return std::make_shared<const TokenVocabulary>(std::move(bytes));
  }();
  return shared;
}

void walk(Grammar grammar, std::string_view choices) {
  if (grammar.positions() > kWalkedPositions) return;
  const auto compiled = std::make_shared<const CompiledGrammar>(std::move(grammar), vocabulary());
  GrammarMatcher matcher(compiled);
  TokenMask mask = empty_mask(compiled->vocabulary().size());
  for (size_t step = 0; step < 32 && matcher.can_continue(); ++step) {
    matcher.fill_mask(mask);
    std::vector<int32_t> allowed;
    for (int32_t id = 0; id < compiled->vocabulary().size(); ++id)
      if (mask_allows(mask, id)) allowed.push_back(id);
    if (allowed.empty()) break;  // only bytes no token holds (NUL) may follow
    const size_t pick = step < choices.size() ? static_cast<uint8_t>(choices[step]) : 0;
    if (!matcher.accept_token(allowed[pick % allowed.size()])) std::abort();  // the mask allowed it
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto [text, choices] = kiln::fuzz::split_at_nul(kiln::fuzz::as_text(data, size));
  // Each parse refuses what it does not read with a kiln::Error: the server's 400.
  try {
    walk(regex_grammar(text), choices);
  } catch (const kiln::Error&) {
  }
  try {
    Grammar pattern;
    pattern.set_root(add_regex(pattern, text, {.whole_text = false, .encoding = CharEncoding::JsonStringMarkupSafe}));
    pattern.check();
    walk(std::move(pattern), choices);
  } catch (const kiln::Error&) {
  }
  try {
    walk(gbnf_grammar(text), choices);
  } catch (const kiln::Error&) {
  }
  return 0;
}
