// A POST /v1/completions body: parsed and validated as the server does (server/openai_api.h), then
// a text prompt is encoded with the special tokens, the prompt is checked against the context
// budget and primes the stream that decodes generated tokens. The same bytes also go to the
// /v1/embeddings parser (server/openai_embeddings.h), whose `input` takes the prompt's forms, and
// its text inputs are encoded as the server encodes them.
#include <cstddef>
#include <cstdint>

#include "api_fuzz_support.h"
#include "core/error.h"
#include "server/api_error.h"
#include "server/json_fields.h"
#include "server/openai_api.h"
#include "server/openai_embeddings.h"

namespace {

// A context of this many tokens, as `kiln serve --max-context` gives one.
constexpr int64_t kContextTokens = 4096;
// An embedding model's hidden size (the bound of `dimensions`).
constexpr int64_t kHiddenSize = 1024;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto& codec = kiln::fuzz::api_codec();
  try {
    const auto request = kiln::server::parse_embedding_request(
        kiln::server::parse_request_json(kiln::fuzz::as_text(data, size)), kiln::fuzz::kServedModel,
        codec.tokenizer().vocab_size(), kHiddenSize);
    for (const auto& input : request.inputs)
      if (input.text) (void)codec.encode(*input.text, true);
  } catch (const kiln::server::ApiError&) {
    // A 4xx answer is the expected outcome for a bad request.
  } catch (const kiln::Error&) {
    // A text the tokenizer refuses, which the server answers with a 400.
  }
  try {
    const auto request = kiln::server::parse_completion_request(
        kiln::server::parse_request_json(kiln::fuzz::as_text(data, size)), kiln::fuzz::kServedModel,
        codec.tokenizer().vocab_size());
    const std::vector<int32_t> prompt = request.prompt_text ? codec.encode(*request.prompt_text, true) : request.prompt_ids;
    (void)kiln::server::completion_budget(static_cast<int64_t>(prompt.size()), request.generation.max_tokens,
                                          kContextTokens, "prompt", "max_tokens");
    // Generation decodes its tokens after the prompt's last ones (TextGeneration primes its stream).
    (void)codec.text_stream(prompt)->finish();
  } catch (const kiln::server::ApiError&) {
    // A 4xx answer is the expected outcome for a bad request.
  } catch (const kiln::Error&) {
    // A prompt the tokenizer refuses (invalid UTF-8), which the server answers with a 400.
  }
  return 0;
}
