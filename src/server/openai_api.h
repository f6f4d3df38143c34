// The OpenAI-compatible API: request parsing and validation for /v1/chat/completions and
// /v1/completions, and everything they answer with: JSON bodies, stream chunks, errors, /v1/models.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/finish_reason.h"
#include "server/generation_response.h"
#include "server/request_fields.h"
#include "text/text_codec.h"
#include "text/text_generation.h"

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
  // tool_choice "required" (some call) or naming a function (that call): the reply is held to the
  // template's tool-call syntax (text/tool_call_grammar.h).
  bool tool_call_required = false;
  std::optional<std::string> forced_tool;
  bool parallel_tool_calls = true;  // "required" allows several calls
};

struct CompletionRequest {
  std::optional<std::string> prompt_text;  // a text prompt (tokenised with the tokenizer's specials)
  std::vector<int32_t> prompt_ids;         // or token ids as given
  GenerationFields generation;
  std::optional<int32_t> logprobs;  // the legacy API's integer: alternatives per token
  bool include_usage = false;
};

// Every field is type- and range-checked; an unknown field, or a known option this server does not
// implement (best_of other than n), is a 400. An output constraint (response_format, grammar,
// structured_outputs, guided_*: server/output_constraints.h) is compiled to its grammar here (one
// the compiler refuses is a 400 naming the keyword or the position); a forced tool_choice is
// recorded, its grammar made once the template's call syntax is known (Server::chat_completions).
// `model` must name the served model (else 404). What the request does not set of its sampling
// comes from `defaults` (the server's: the model's generation_config.json).
ChatCompletionRequest parse_chat_completion_request(const json& body, const std::string& served_model,
                                                    const SamplingParams& defaults = {});
CompletionRequest parse_completion_request(const json& body, const std::string& served_model, int64_t vocab_size,
                                           const SamplingParams& defaults = {});

// vLLM's /tokenize: a prompt (tokenised with the tokenizer's specials unless add_special_tokens is
// false) or a conversation (`messages`, rendered by the chat template with add_generation_prompt,
// chat_template_kwargs and tools as a chat completion renders them; no specials added unless
// add_special_tokens, as the template writes them). `model` is optional.
struct TokenizeRequest {
  std::optional<std::string> prompt;
  json messages;
  ChatPromptOptions chat;
  bool add_special_tokens = true;
  bool return_token_strs = false;
};
TokenizeRequest parse_tokenize_request(const json& body, const std::string& served_model);
// vLLM's /detokenize: {"tokens": [ids]} (each within the vocabulary); `model` is optional.
std::vector<int32_t> parse_detokenize_request(const json& body, const std::string& served_model, int64_t vocab_size);

// {"error": {"message", "type", "param", "code"}}
json openai_error_body(int status, const std::string& message, const std::string& param, const std::string& code);

// The finish_reason OpenAI's answers carry: "stop" or "length", kiln's own names for the two ends
// it sends (a request that was cancelled or failed gets an error instead).
std::string openai_finish_reason(FinishReason reason);

// /v1/models: the served model, with its context length.
json models_list(const std::string& served_model, int64_t context_tokens, int64_t created);

// A chat completion's answer: a chat.completion body, or chat.completion.chunk events (the first
// of each choice carrying the role) ending with [DONE]. Each choice's reply goes through its copy
// of `parser`: its reasoning is message.reasoning_content (delta.reasoning_content), its tool calls
// message.tool_calls (streamed as OpenAI and vLLM stream them: a delta with the call's index, id,
// type, name and empty arguments, then deltas with its index and the next piece of its arguments),
// with finish_reason "tool_calls" where every call is complete; the rest is content.
class ChatCompletionResponse final : public GenerationResponse {
 public:
  ChatCompletionResponse(const ChatCompletionRequest& request, std::string served_model, const TextCodec& codec,
                         const ChatOutputParser& parser);
  json whole(std::span<const WholeGeneration> choices, const TokenUsage& usage) const override;
  std::vector<std::string> stream_start(const TokenUsage& usage) override;
  std::vector<std::string> stream_delta(size_t choice, const TextDelta& delta, const TokenUsage& usage) override;
  std::vector<std::string> stream_end(const TokenUsage& usage) override;
  std::string stream_failure(const ApiError& failure) const override;

 private:
  json whole_choice(size_t index, const WholeGeneration& whole) const;
  std::string chunk(size_t index, json delta, json logprobs, json finish_reason) const;
  // The finish_reason of a reply that ended normally: tool_calls where it made calls and stopped.
  std::string finish_reason(FinishReason reason, const ChatOutput& output) const;

  const TextCodec& codec_;
  std::vector<ChatOutputParser> parsers_;  // one per choice, the stream's; whole() parses with them
  std::string id_;
  int64_t created_;
  std::string model_;
  bool logprobs_;
  bool include_usage_;
};

// A legacy completion's answer: a text_completion body, or text_completion events ending with [DONE].
class CompletionResponse final : public GenerationResponse {
 public:
  CompletionResponse(const CompletionRequest& request, std::string served_model, const TextCodec& codec);
  json whole(std::span<const WholeGeneration> choices, const TokenUsage& usage) const override;
  std::vector<std::string> stream_start(const TokenUsage& usage) override;
  std::vector<std::string> stream_delta(size_t choice, const TextDelta& delta, const TokenUsage& usage) override;
  std::vector<std::string> stream_end(const TokenUsage& usage) override;
  std::string stream_failure(const ApiError& failure) const override;

 private:
  json body(json choices) const;

  const TextCodec& codec_;
  std::string id_;
  int64_t created_;
  std::string model_;
  bool logprobs_;
  bool include_usage_;
  // Per choice, bytes of text streamed so far (where the next logprobs' text_offset starts).
  std::vector<size_t> text_offsets_;
};

}  // namespace kiln::server
