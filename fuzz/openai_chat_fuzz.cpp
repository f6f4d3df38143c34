// A POST /v1/chat/completions body: parsed and validated as the server does
// (server/openai_api.h), then the conversation is rendered with a fixed chat template and encoded,
// as Server::chat_prompt does. The same bytes also go to the /tokenize and /detokenize parsers,
// whose bodies share the chat request's fields.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "api_fuzz_support.h"
#include "core/error.h"
#include "server/api_error.h"
#include "server/json_fields.h"
#include "server/openai_api.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto& codec = kiln::fuzz::api_codec();
  const std::string_view text = kiln::fuzz::as_text(data, size);
  for (int endpoint = 0; endpoint < 2; ++endpoint) {
    try {
      const auto body = kiln::server::parse_request_json(text);
      if (endpoint == 0)
        (void)kiln::server::parse_tokenize_request(body, kiln::fuzz::kServedModel);
      else
        (void)kiln::server::parse_detokenize_request(body, kiln::fuzz::kServedModel, 512);
    } catch (const kiln::server::ApiError&) {
      // A 4xx answer is the expected outcome for a bad request.
    }
  }
  try {
    const auto request = kiln::server::parse_chat_completion_request(
        kiln::server::parse_request_json(text), kiln::fuzz::kServedModel);
    (void)codec.encode(codec.render_chat(request.messages, request.prompt), false);
  } catch (const kiln::server::ApiError&) {
    // A 4xx answer is the expected outcome for a bad request.
  } catch (const kiln::Error&) {
    // The template's rejection, which the server answers with a 400.
  }
  return 0;
}
