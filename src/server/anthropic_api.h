// The Anthropic Messages API (/v1/messages): request parsing and validation, the conversion of its
// conversation into the OpenAI-shaped messages chat templates take, and everything it answers
// with: message bodies, stream events, errors.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
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
  GenerationFields generation;  // max_tokens is required by this API; output_config.format's grammar
  // tool_choice "any" (some call) or "tool" (that call): the reply is held to the template's
  // tool-call syntax (text/tool_call_grammar.h); disable_parallel_tool_use allows one call.
  bool tool_call_required = false;
  std::optional<std::string> forced_tool;
  bool parallel_tool_calls = true;
};

// Every field is type- and range-checked; unknown fields and unsupported options are a 400. What
// the request does not set of its sampling comes from `defaults` (the server's). Structured
// outputs (output_config.format, a JSON schema) are compiled to their grammar here.
MessagesRequest parse_messages_request(const json& body, const std::string& served_model,
                                       const SamplingParams& defaults = {});
// The body of /v1/messages/count_tokens: a Messages request without max_tokens (the conversation,
// system, tools, tool_choice and thinking are what it counts).
MessagesRequest parse_count_tokens_request(const json& body, const std::string& served_model);

// {"type": "error", "error": {"type", "message"}}
json anthropic_error_body(int status, const std::string& message);

// The stop_reason of a message that ended normally: "max_tokens" at the length limit,
// "stop_sequence" at one of the request's stop strings, else "end_turn".
std::string anthropic_stop_reason(FinishReason finish_reason, const std::optional<std::string>& stop_sequence);

// A message's answer: a message body, or the event stream (message_start, content blocks each
// opened, filled and closed in turn, message_delta, message_stop; an `error` event when generation
// fails). The reply goes through `parser`: its reasoning is a `thinking` block (thinking_delta),
// each tool call a `tool_use` block (opened with its id, name and an empty input as soon as the
// name is known, its input then streamed in input_json_delta pieces) with stop_reason "tool_use"
// where every call is complete, the rest `text` blocks.
class MessagesResponse final : public GenerationResponse {
 public:
  MessagesResponse(std::string served_model, ChatOutputParser parser);
  // One choice: the Messages API has no `n`.
  json whole(std::span<const WholeGeneration> choices, const TokenUsage& usage) const override;
  std::vector<std::string> stream_start(const TokenUsage& usage) override;
  std::vector<std::string> stream_delta(size_t choice, const TextDelta& delta, const TokenUsage& usage) override;
  std::vector<std::string> stream_end(const TokenUsage& usage) override;
  std::string stream_failure(const ApiError& failure) const override;

 private:
  // The events that close the open block (if any) and open `block`, of `type` (text, thinking,
  // tool_use), as the next block.
  std::string open_block(const char* type, const json& block);
  std::string close_block();

  std::string id_;
  std::string model_;
  ChatOutputParser parser_;  // the stream's; whole() parses a copy of it
  std::string open_type_;    // the open block's type, or empty
  int64_t blocks_ = 0;       // blocks opened so far
  bool pinged_ = false;
  // The message's end, once its generation ended normally: message_delta's stop_reason and
  // stop_sequence (stream_end writes them with the final usage).
  std::optional<json> ending_;
};

}  // namespace kiln::server
