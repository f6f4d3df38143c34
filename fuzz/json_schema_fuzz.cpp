// A response_format JSON schema: compiled to a grammar (engine/grammar/json_schema.h), compiled
// against a small vocabulary of bytes and JSON pieces, then walked through its masks for up to 64
// tokens, each the allowed token a byte after the NUL picks (the first allowed without one).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "engine/grammar/json_schema.h"
#include "engine/grammar/token_mask.h"
#include "fuzz_support.h"

namespace {

std::shared_ptr<const kiln::grammar::TokenVocabulary> vocabulary() {
  static const auto shared = [] {
    std::vector<std::string> bytes = {""};
    for (int byte = 1; byte < 256; ++byte) bytes.push_back(std::string(1, static_cast<char>(byte)));
    for (const char* piece : {"{\"", "\"}", "\":", "\",", "true", "null", "12", "\"]", "]}", "\xC3\xA9", ",\""})
      bytes.push_back(piece);
    return std::make_shared<const kiln::grammar::TokenVocabulary>(std::move(bytes));
  }();
  return shared;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto [schema_text, choices] = kiln::fuzz::split_at_nul(kiln::fuzz::as_text(data, size));
  const auto schema = nlohmann::ordered_json::parse(schema_text, nullptr, false);
  if (schema.is_discarded()) return 0;
  try {
    const auto compiled = std::make_shared<const kiln::grammar::CompiledGrammar>(
        kiln::grammar::json_schema_grammar(schema), vocabulary());
    kiln::grammar::GrammarMatcher matcher(compiled);
    kiln::grammar::TokenMask mask = kiln::grammar::empty_mask(compiled->vocabulary().size());
    for (size_t step = 0; step < 64 && matcher.can_continue(); ++step) {
      matcher.fill_mask(mask);
      std::vector<int32_t> allowed;
      for (int32_t id = 0; id < compiled->vocabulary().size(); ++id)
        if (kiln::grammar::mask_allows(mask, id)) allowed.push_back(id);
      if (allowed.empty()) break;
      const size_t pick = step < choices.size() ? static_cast<uint8_t>(choices[step]) : 0;
      if (!matcher.accept_token(allowed[pick % allowed.size()])) std::abort();  // the mask allowed it
    }
  } catch (const kiln::Error&) {
    // An unsupported or malformed schema: the server's 400.
  }
  return 0;
}
