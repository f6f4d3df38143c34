// The Anthropic Messages API (/v1/messages): request parsing and validation, the conversion of its
// conversation into the OpenAI-shaped messages chat templates take, and everything it answers
// with: message bodies, stream events, errors.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "server/generation_response.h"
#include "server/request_fields.h"
#include "engine/finish_reason.h"
#include "text/text_codec.h"

namespace kiln::server {

using json = nlohmann::ordered_json;

struct MessagesRequest {
  json messages;  // converted for the chat template (system first, tool results as tool messages)
  ChatPromptOptions prompt;
  GenerationFields generation;  // max_tokens is required by this API
};

// Every field is type- and range-checked; unknown fields and unsupported options are a 400.
MessagesRequest parse_messages_request(const json& body, const std::string& served_model);

// {"type": "error", "error": {"type", "message"}}
json anthropic_error_body(int status, const std::string& message);

// The stop_reason of a message that ended normally: "max_tokens" at the length limit,
// "stop_sequence" at one of the request's stop strings, else "end_turn".
std::string anthropic_stop_reason(FinishReason finish_reason, const std::optional<std::string>& stop_sequence);

// A message's answer: a message body, or the event stream (message_start, one text content block,
// message_delta, message_stop; an `error` event when generation fails).
class MessagesResponse final : public GenerationResponse {
 public:
  explicit MessagesResponse(std::string served_model);
  json whole(const WholeGeneration& whole, const TokenUsage& usage) const override;
  std::vector<std::string> stream_start(const TokenUsage& usage) override;
  std::vector<std::string> stream_delta(const TextDelta& delta, const TokenUsage& usage) override;
  std::string stream_failure(const ApiError& failure) const override;

 private:
  std::string id_;
  std::string model_;
};

}  // namespace kiln::server
