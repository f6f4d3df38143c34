// tokenizer.json, optionally followed by a NUL byte and a text: the tokenizer is loaded
// (tokenizer/tokenizer.h), the text is encoded with and without the special tokens, and the ids are
// decoded back, at once and streaming. Every id of the vocabulary (up to a bound) is decoded too.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"
#include "fuzz_support.h"
#include "tokenizer/tokenizer.h"

namespace {

// Ids decoded one by one per input: enough for the seed vocabularies, bounded for speed.
constexpr int32_t kIdsDecodedAlone = 1024;

void round_trip(const kiln::Tokenizer& tokenizer, std::string_view text) {
  for (bool add_special_tokens : {false, true}) {
    const std::vector<int32_t> ids = tokenizer.encode(text, add_special_tokens);
    for (bool skip_special_tokens : {false, true}) {
      (void)tokenizer.decode(ids, skip_special_tokens);
      kiln::StreamingDecoder stream(tokenizer, skip_special_tokens);
      for (int32_t id : ids) (void)stream.push(id);
      (void)stream.finish();
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto [spec, text] = kiln::fuzz::split_at_nul(kiln::fuzz::as_text(data, size));
  const auto file = kiln::fuzz::ScratchDirectory::instance().write("tokenizer.json", spec);
  try {
    const kiln::Tokenizer tokenizer = kiln::Tokenizer::load(file);
    for (int32_t id = 0; id < std::min(tokenizer.vocab_size(), kIdsDecodedAlone); ++id) {
      (void)tokenizer.id_to_token(id);
      (void)tokenizer.decode(std::span<const int32_t>(&id, 1), false);
    }
    round_trip(tokenizer, text);
  } catch (const kiln::Error&) {
    // A rejected tokenizer.json or text (invalid UTF-8) is the expected outcome.
  }
  return 0;
}
