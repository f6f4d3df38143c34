// The Anthropic Messages API (/v1/messages): request parsing and validation, the conversion of its
// conversation into the OpenAI-shaped messages chat templates take, and its response bodies.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "server/request_fields.h"
#include "server/text_codec.h"

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

// "end_turn" | "max_tokens" | "stop_sequence"
std::string anthropic_stop_reason(const std::string& finish_reason, const std::optional<std::string>& stop_sequence);

json anthropic_usage(int64_t input_tokens, int64_t output_tokens);

}  // namespace kiln::server
