// A POST /v1/chat/completions body: parsed and validated as the server does
// (server/openai_api.h), then the conversation is rendered with a fixed chat template and encoded,
// as Server::chat_prompt does.
#include <cstddef>
#include <cstdint>

#include "api_fuzz_support.h"
#include "core/error.h"
#include "server/api_error.h"
#include "server/json_fields.h"
#include "server/openai_api.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto& codec = kiln::fuzz::api_codec();
  try {
    const auto request = kiln::server::parse_chat_completion_request(
        kiln::server::parse_request_json(kiln::fuzz::as_text(data, size)), kiln::fuzz::kServedModel);
    (void)codec.encode(codec.render_chat(request.messages, request.prompt), false);
  } catch (const kiln::server::ApiError&) {
    // A 4xx answer is the expected outcome for a bad request.
  } catch (const kiln::Error&) {
    // The template's rejection, which the server answers with a 400.
  }
  return 0;
}
