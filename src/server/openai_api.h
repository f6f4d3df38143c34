// The OpenAI-compatible API: request parsing and validation for /v1/chat/completions and
// /v1/completions, and the JSON bodies and stream chunks they answer with.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "server/request_fields.h"
#include "server/text_codec.h"
#include "server/text_generation.h"

namespace kiln::server {

using json = nlohmann::ordered_json;

// Most alternatives per token a request may ask for (OpenAI's limits: 20 for chat, 5 for
// the legacy completions API).
inline constexpr int64_t kMaxChatTopLogprobs = 20;
inline constexpr int64_t kMaxCompletionLogprobs = 5;

struct ChatCompletionRequest {
  json messages;  // normalised for the chat template: content as text, tool-call arguments as objects
  ChatPromptOptions prompt;
  GenerationFields generation;
  bool logprobs = false;
  int32_t top_logprobs = 0;
  bool include_usage = false;  // stream_options.include_usage
};

struct CompletionRequest {
  std::optional<std::string> prompt_text;  // a text prompt (tokenised with the tokenizer's specials)
  std::vector<int32_t> prompt_ids;         // or token ids as given
  GenerationFields generation;
  std::optional<int32_t> logprobs;  // the legacy API's integer: alternatives per token
  bool include_usage = false;
};

// Every field is type- and range-checked; an unknown field, or a known option this server does not
// implement (n > 1, json response formats, logit_bias, penalties, forced tool choice), is a 400.
// `model` must name the served model (else 404).
ChatCompletionRequest parse_chat_completion_request(const json& body, const std::string& served_model);
CompletionRequest parse_completion_request(const json& body, const std::string& served_model, int64_t vocab_size);

// Checks the request's `model` (a string naming the served model).
void check_model_field(JsonFields& fields, const std::string& served_model);

// {"error": {"message", "type", "param", "code"}}
json openai_error_body(int status, const std::string& message, const std::string& param, const std::string& code);

json openai_usage(int64_t prompt_tokens, int64_t completion_tokens);
// chat: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}
json chat_logprobs(const std::vector<GeneratedToken>& tokens, const TextCodec& codec);
// legacy completions: {tokens, token_logprobs, top_logprobs, text_offset}; `text_offset` starts at
// the length of the text already returned.
json completion_logprobs(const std::vector<GeneratedToken>& tokens, const TextCodec& codec, size_t text_offset);
// OpenAI reports finish_reason "stop" or "length"; a cancelled request has none.
json openai_finish_reason(const std::string& finish_reason);

json models_list(const std::string& served_model, int64_t context_tokens, int64_t created);

}  // namespace kiln::server
