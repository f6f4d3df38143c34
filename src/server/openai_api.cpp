#include "server/openai_api.h"

#include <algorithm>
#include <array>
#include <limits>
#include <utility>

#include "core/error.h"
#include "server/api_error.h"
#include "server/output_constraints.h"
#include "server/sse.h"
#include "tokenizer/jinja_builtins.h"

namespace kiln::server {

namespace {

// A message's content as the template sees it: a string, or text parts joined by newlines (as
// vLLM does for templates that take string content). Other part types are refused.
std::string message_text(const json& content, const std::string& param) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array())
    reject_field(param, "`{}` must be a string or an array of content parts, got {}", param, json_type_name(content));
  std::string text;
  for (size_t i = 0; i < content.size(); ++i) {
    const std::string part_param = fmt::format("{}[{}]", param, i);
    if (!content[i].is_object())
      reject_field(part_param, "`{}` must be an object, got {}", part_param, json_type_name(content[i]));
    JsonFields part(content[i], part_param);
    const auto type = part.string("type");
    if (!type) reject_field(part.param("type"), "`{}` is required", part.param("type"));
    if (*type != "text")
      reject_unsupported(part.param("type"), fmt::format("content of type \"{}\"", quote_client_text(*type)));
    const auto part_text = part.string("text");
    if (!part_text) reject_field(part.param("text"), "`{}` is required", part.param("text"));
    part.reject_unknown();
    if (i > 0) text += "\n";
    text += *part_text;
  }
  return text;
}

// The body, messages[], a message, tool_calls[], a call and its function enclose the arguments string.
constexpr int kContainersAroundToolCallArguments = 6;

json normalise_tool_calls(const json& tool_calls, const std::string& param) {
  json normalised = json::array();
  for (size_t i = 0; i < tool_calls.size(); ++i) {
    const std::string call_param = fmt::format("{}[{}]", param, i);
    if (!tool_calls[i].is_object())
      reject_field(call_param, "`{}` must be an object, got {}", call_param, json_type_name(tool_calls[i]));
    JsonFields call(tool_calls[i], call_param);
    json out = json::object();
    if (auto id = call.string("id")) out["id"] = *id;
    const auto type = call.string("type");
    if (type && *type != "function")
      reject_unsupported(call.param("type"), fmt::format("tool calls of type \"{}\"", quote_client_text(*type)));
    out["type"] = "function";
    const json* function = call.object("function");
    if (!function) reject_field(call.param("function"), "`{}` is required", call.param("function"));
    JsonFields function_fields(*function, call.param("function"));
    const auto name = function_fields.string("name");
    if (!name) reject_field(function_fields.param("name"), "`{}` is required", function_fields.param("name"));
    out["function"]["name"] = *name;
    // Templates expect the arguments as an object (Hugging Face's convention); the API sends a
    // JSON string, which is decoded when it holds an object and passed on as text otherwise.
    if (const json* arguments = function_fields.value("arguments")) {
      if (arguments->is_string()) {
        std::optional<json> decoded = parse_embedded_json(
            arguments->get<std::string>(), kContainersAroundToolCallArguments, function_fields.param("arguments"));
        out["function"]["arguments"] = decoded && decoded->is_object() ? std::move(*decoded) : *arguments;
      } else if (arguments->is_object()) {
        out["function"]["arguments"] = *arguments;
      } else {
        reject_field(function_fields.param("arguments"), "`{}` must be a string, got {}",
                     function_fields.param("arguments"), json_type_name(*arguments));
      }
    }
    function_fields.reject_unknown();
    call.reject_unknown();
    normalised.push_back(std::move(out));
  }
  return normalised;
}

json normalise_messages(const json& messages) {
  if (messages.empty()) reject_field("messages", "`messages` must hold at least one message");
  json normalised = json::array();
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string param = fmt::format("messages[{}]", i);
    if (!messages[i].is_object())
      reject_field(param, "`{}` must be an object, got {}", param, json_type_name(messages[i]));
    JsonFields message(messages[i], param);
    const auto role = message.string("role");
    if (!role) reject_field(message.param("role"), "`{}` is required", message.param("role"));
    static const std::vector<std::string> kRoles = {"system", "developer", "user", "assistant", "tool"};
    if (std::find(kRoles.begin(), kRoles.end(), *role) == kRoles.end())
      reject_field(message.param("role"), "`{}` must be one of system, developer, user, assistant, tool; got \"{}\"",
                   message.param("role"), quote_client_text(*role));
    json out = json::object();
    // Templates know "system"; OpenAI's newer "developer" role means the same.
    out["role"] = *role == "developer" ? "system" : *role;
    const json* content = message.value("content");
    const json* tool_calls = message.array("tool_calls");
    if (tool_calls && *role != "assistant")
      reject_field(message.param("tool_calls"), "`{}` is only allowed on assistant messages",
                   message.param("tool_calls"));
    if (content)
      out["content"] = message_text(*content, message.param("content"));
    else if (!tool_calls)
      reject_field(message.param("content"), "`{}` is required", message.param("content"));
    else
      out["content"] = "";
    if (tool_calls) out["tool_calls"] = normalise_tool_calls(*tool_calls, message.param("tool_calls"));
    if (auto name = message.string("name")) out["name"] = *name;
    if (auto tool_call_id = message.string("tool_call_id")) out["tool_call_id"] = *tool_call_id;
    if (*role == "tool" && !out.contains("tool_call_id"))
      reject_field(message.param("tool_call_id"), "`{}` is required on tool messages", message.param("tool_call_id"));
    if (auto reasoning = message.string("reasoning_content")) out["reasoning_content"] = *reasoning;
    // Fields a client echoes back from an earlier response; they carry nothing for the prompt.
    message.value("refusal");
    message.value("annotations");
    message.reject_unknown();
    normalised.push_back(std::move(out));
  }
  return normalised;
}

json validate_tools(const json& tools) {
  for (size_t i = 0; i < tools.size(); ++i) {
    const std::string param = fmt::format("tools[{}]", i);
    if (!tools[i].is_object()) reject_field(param, "`{}` must be an object, got {}", param, json_type_name(tools[i]));
    JsonFields tool(tools[i], param);
    const auto type = tool.string("type");
    if (!type) reject_field(tool.param("type"), "`{}` is required", tool.param("type"));
    if (*type != "function")
      reject_unsupported(tool.param("type"), fmt::format("tools of type \"{}\"", quote_client_text(*type)));
    const json* function = tool.object("function");
    if (!function) reject_field(tool.param("function"), "`{}` is required", tool.param("function"));
    JsonFields function_fields(*function, tool.param("function"));
    const auto name = function_fields.string("name");
    if (!name || name->empty())
      reject_field(function_fields.param("name"), "`{}` must be a non-empty string", function_fields.param("name"));
    function_fields.string("description");
    function_fields.object("parameters");
    function_fields.boolean("strict");
    function_fields.reject_unknown();
    tool.reject_unknown();
  }
  return tools;
}

// Variables kiln gives every chat template (ChatTemplate::variables): validated or derived from the
// request, so chat_template_kwargs may not replace them; nor the template's global functions
// (raise_exception, strftime_now, ...). vLLM's advisories GHSA-6fvq-23cw-5628 and
// GHSA-4hw3-g54f-xfrj are this class of bug: a kwarg that replaced `messages` or a function.
constexpr std::array<std::string_view, 6> kTemplateVariablesKilnSets = {
    "messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token"};

json checked_template_kwargs(const json& kwargs, const std::string& param) {
  for (const auto& [key, value] : kwargs.items()) {
    const std::string key_param = param + "." + quote_client_text(key);
    const bool set_by_kiln =
        std::find(kTemplateVariablesKilnSets.begin(), kTemplateVariablesKilnSets.end(), key) !=
        kTemplateVariablesKilnSets.end();
    if (set_by_kiln || jinja::global_function(key))
      reject_field(key_param, "`{}` names a template variable the server sets itself; it cannot be passed in `{}`",
                   key_param, param);
    // The template's thinking switch (Qwen3's convention, as vLLM passes it).
    if (key == "enable_thinking" && !value.is_boolean())
      reject_field(key_param, "`{}` must be a boolean, got {}", key_param, json_type_name(value));
  }
  return kwargs;
}

// `n` choices; `best_of` (legacy completions) only where it keeps every choice: kiln does not rank
// choices to drop some.
void read_choices(JsonFields& fields, GenerationFields& generation) {
  generation.n = static_cast<int32_t>(fields.integer("n", 1, kMaxChoices).value_or(1));
  if (auto best_of = fields.integer("best_of", 1, kMaxChoices); best_of && *best_of != generation.n)
    reject_unsupported(fields.param("best_of"), "best_of other than n (choosing the best of several choices)");
}

void read_stream_fields(JsonFields& fields, GenerationFields& generation, bool& include_usage) {
  generation.stream = fields.boolean("stream").value_or(false);
  if (const json* options = fields.object("stream_options")) {
    if (!generation.stream)
      reject_field(fields.param("stream_options"), "`stream_options` is only allowed when `stream` is true");
    JsonFields stream_options(*options, fields.param("stream_options"));
    include_usage = stream_options.boolean("include_usage").value_or(false);
    stream_options.boolean("continuous_usage_stats");
    stream_options.reject_unknown();
  }
}

// Fields OpenAI accepts that change nothing here (client bookkeeping, caching hints); type-checked,
// then unused.
void accept_bookkeeping_fields(JsonFields& fields) {
  fields.string("user");
  fields.string("safety_identifier");
  fields.string("prompt_cache_key");
  fields.object("metadata");
  fields.boolean("store");
  fields.string("service_tier");
  fields.boolean("parallel_tool_calls");
}

}  // namespace

ChatCompletionRequest parse_chat_completion_request(const json& body, const std::string& served_model,
                                                    const SamplingParams& defaults) {
  ChatCompletionRequest request;
  request.generation.sampling = defaults;
  JsonFields fields(body, "");
  check_model_field(fields, served_model);
  const json* messages = fields.array("messages");
  if (!messages) reject_field("messages", "`messages` is required");
  request.messages = normalise_messages(*messages);

  read_sampling(fields, 2.0, request.generation.sampling);
  read_penalties(fields, request.generation.sampling);
  request.generation.speculative = read_speculative(fields);
  read_choices(fields, request.generation);
  const auto max_tokens = fields.integer("max_tokens", 1, kMaxTokensLimit);
  const auto max_completion_tokens = fields.integer("max_completion_tokens", 1, kMaxTokensLimit);
  if (max_tokens && max_completion_tokens && *max_tokens != *max_completion_tokens)
    reject_field("max_tokens", "`max_tokens` ({}) and `max_completion_tokens` ({}) disagree; send one", *max_tokens,
                 *max_completion_tokens);
  request.generation.max_tokens = max_completion_tokens ? max_completion_tokens : max_tokens;
  request.generation.stop = read_stop_strings(fields, "stop", true);
  request.generation.ignore_eos = fields.boolean("ignore_eos").value_or(false);
  read_stream_fields(fields, request.generation, request.include_usage);

  request.logprobs = fields.boolean("logprobs").value_or(false);
  if (auto top = fields.integer("top_logprobs", 0, kMaxChatTopLogprobs)) {
    if (*top > 0 && !request.logprobs) reject_field("top_logprobs", "`top_logprobs` needs `logprobs` set to true");
    request.top_logprobs = static_cast<int32_t>(*top);
  }

  if (const json* tools = fields.array("tools")) request.prompt.tools = validate_tools(*tools);
  if (const json* tool_choice = fields.value("tool_choice")) {
    if (!tool_choice->is_string() && !tool_choice->is_object())
      reject_field("tool_choice", "`tool_choice` must be a string or an object, got {}", json_type_name(*tool_choice));
    if (tool_choice->is_object()) {
      JsonFields choice(*tool_choice, "tool_choice");
      const auto type = choice.string("type");
      if (type != "function") reject_field(choice.param("type"), "`{}` must be \"function\"", choice.param("type"));
      const json* function = choice.object("function");
      if (!function) reject_field(choice.param("function"), "`{}` is required", choice.param("function"));
      JsonFields function_fields(*function, choice.param("function"));
      const auto name = function_fields.string("name");
      if (!name) reject_field(function_fields.param("name"), "`{}` is required", function_fields.param("name"));
      function_fields.reject_unknown();
      choice.reject_unknown();
      request.tool_call_required = true;
      request.forced_tool = *name;
    } else if (*tool_choice == "required") {
      request.tool_call_required = true;
    } else if (*tool_choice == "none")
      request.prompt.tools = json();
    else if (*tool_choice != "auto")
      reject_field("tool_choice", "`tool_choice` must be \"none\", \"auto\" or \"required\", got \"{}\"",
                   quote_client_text(tool_choice->get<std::string>()));
  }
  read_openai_output_constraints(fields, request.generation);
  request.parallel_tool_calls = fields.boolean("parallel_tool_calls").value_or(true);
  if (request.tool_call_required) {
    if (!request.prompt.tools.is_array() || request.prompt.tools.empty())
      reject_field("tool_choice", "`tool_choice` forces a tool call, but the request offers no `tools`");
    if (request.generation.grammar)
      reject_field("tool_choice",
                   "`tool_choice` forcing a tool call cannot be combined with an output constraint (response_format, "
                   "grammar, structured_outputs, guided_*)");
  }
  if (const json* kwargs = fields.object("chat_template_kwargs"))
    request.prompt.template_kwargs = checked_template_kwargs(*kwargs, "chat_template_kwargs");
  request.prompt.add_generation_prompt = fields.boolean("add_generation_prompt").value_or(true);
  // vLLM's name for a cap on the reply's reasoning.
  request.generation.reasoning_budget = fields.integer("thinking_token_budget", 0, kMaxTokensLimit);
  if (request.generation.reasoning_budget && (request.generation.grammar || request.tool_call_required))
    reject_field("thinking_token_budget",
                 "`thinking_token_budget` cannot be combined with an output constraint or a forced `tool_choice`, "
                 "which hold the reply to their grammar from its first token");

  accept_bookkeeping_fields(fields);
  fields.reject_unknown();
  return request;
}

CompletionRequest parse_completion_request(const json& body, const std::string& served_model, int64_t vocab_size,
                                           const SamplingParams& defaults) {
  CompletionRequest request;
  request.generation.sampling = defaults;
  JsonFields fields(body, "");
  check_model_field(fields, served_model);
  const json* prompt = fields.value("prompt");
  if (!prompt) reject_field("prompt", "`prompt` is required");
  // One prompt per request: a string, an array of one string, or an array of token ids.
  const json* single = prompt;
  if (prompt->is_array() && prompt->size() == 1 && ((*prompt)[0].is_string() || (*prompt)[0].is_array()))
    single = &(*prompt)[0];
  if (single->is_string()) {
    request.prompt_text = single->get<std::string>();
  } else if (single->is_array() && !single->empty() &&
             std::all_of(single->begin(), single->end(), [](const json& item) { return item.is_number_integer(); })) {
    for (const json& id : *single) {
      const int64_t value = id.is_number_unsigned() && id.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)
                                ? INT64_MAX
                                : id.get<int64_t>();
      if (value < 0 || value >= vocab_size)
        reject_field("prompt", "prompt token id {} is outside the vocabulary (0 to {})", id.dump(), vocab_size - 1);
      request.prompt_ids.push_back(static_cast<int32_t>(value));
    }
  } else if (prompt->is_array() && prompt->size() > 1 &&
             std::all_of(prompt->begin(), prompt->end(),
                         [](const json& item) { return item.is_string() || item.is_array(); })) {
    reject_unsupported("prompt", "more than one prompt per request");
  } else {
    reject_field("prompt", "`prompt` must be a string, an array of one string, or a non-empty array of token ids");
  }

  read_sampling(fields, 2.0, request.generation.sampling);
  read_penalties(fields, request.generation.sampling);
  request.generation.speculative = read_speculative(fields);
  read_choices(fields, request.generation);
  request.generation.max_tokens = fields.integer("max_tokens", 1, kMaxTokensLimit);
  // OpenAI's legacy API generates 16 tokens when max_tokens is not given.
  request.generation.default_max_tokens = 16;
  request.generation.stop = read_stop_strings(fields, "stop", true);
  request.generation.ignore_eos = fields.boolean("ignore_eos").value_or(false);
  read_stream_fields(fields, request.generation, request.include_usage);
  if (auto logprobs = fields.integer("logprobs", 0, kMaxCompletionLogprobs))
    request.logprobs = static_cast<int32_t>(*logprobs);
  read_openai_output_constraints(fields, request.generation);
  if (fields.boolean("echo").value_or(false)) reject_unsupported("echo", "echo");
  if (fields.string("suffix")) reject_unsupported("suffix", "suffix");
  accept_bookkeeping_fields(fields);
  fields.reject_unknown();
  return request;
}

TokenizeRequest parse_tokenize_request(const json& body, const std::string& served_model) {
  TokenizeRequest request;
  JsonFields fields(body, "");
  if (fields.has("model")) check_model_field(fields, served_model);
  const auto prompt = fields.string("prompt");
  const json* messages = fields.array("messages");
  if (prompt.has_value() == (messages != nullptr))
    reject_field(prompt ? "messages" : "prompt", "send one of `prompt` (text) and `messages` (a conversation)");
  if (prompt) {
    request.prompt = *prompt;
  } else {
    request.messages = normalise_messages(*messages);
    if (const json* tools = fields.array("tools")) request.chat.tools = validate_tools(*tools);
    if (const json* kwargs = fields.object("chat_template_kwargs"))
      request.chat.template_kwargs = checked_template_kwargs(*kwargs, "chat_template_kwargs");
    request.chat.add_generation_prompt = fields.boolean("add_generation_prompt").value_or(true);
  }
  request.add_special_tokens = fields.boolean("add_special_tokens").value_or(prompt.has_value());
  request.return_token_strs = fields.boolean("return_token_strs").value_or(false);
  fields.reject_unknown();
  return request;
}

std::vector<int32_t> parse_detokenize_request(const json& body, const std::string& served_model, int64_t vocab_size) {
  JsonFields fields(body, "");
  if (fields.has("model")) check_model_field(fields, served_model);
  const json* tokens = fields.array("tokens");
  if (!tokens) reject_field("tokens", "`tokens` is required");
  std::vector<int32_t> ids;
  for (size_t i = 0; i < tokens->size(); ++i) {
    const json& id = (*tokens)[i];
    const std::string param = fmt::format("tokens[{}]", i);
    if (!id.is_number_integer()) reject_field(param, "`{}` must be a token id, got {}", param, json_type_name(id));
    const bool too_large = id.is_number_unsigned() && id.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX);
    const int64_t value = too_large ? INT64_MAX : id.get<int64_t>();
    if (value < 0 || value >= vocab_size)
      reject_field(param, "token id {} is outside the vocabulary (0 to {})", id.dump(), vocab_size - 1);
    ids.push_back(static_cast<int32_t>(value));
  }
  fields.reject_unknown();
  return ids;
}

json openai_error_body(int status, const std::string& message, const std::string& param, const std::string& code) {
  const std::string type = error_type_for(status,
                                          {{401, "authentication_error"},
                                           {404, "not_found_error"},
                                           {429, "rate_limit_error"},
                                           {503, "service_unavailable_error"}},
                                          "server_error");
  return {{"error",
           {{"message", message},
            {"type", type},
            {"param", param.empty() ? json() : json(param)},
            {"code", code.empty() ? json() : json(code)}}}};
}

namespace {

json openai_usage(const TokenUsage& usage) {
  return {{"prompt_tokens", usage.prompt_tokens},
          {"completion_tokens", usage.completion_tokens},
          {"total_tokens", usage.prompt_tokens + usage.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", usage.cached_tokens}}}};
}

json utf8_bytes(const std::string& text) {
  json bytes = json::array();
  for (unsigned char byte : text) bytes.push_back(byte);
  return bytes;
}

// chat: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}
json chat_logprobs(const std::vector<GeneratedToken>& tokens, const TextCodec& codec) {
  json content = json::array();
  for (const auto& token : tokens) {
    const std::string& text = token.text;
    json top = json::array();
    for (const auto& [id, logprob] : token.top) {
      const std::string alternative = codec.token_text(id);
      top.push_back({{"token", alternative}, {"logprob", logprob}, {"bytes", utf8_bytes(alternative)}});
    }
    content.push_back(
        {{"token", text}, {"logprob", token.logprob}, {"bytes", utf8_bytes(text)}, {"top_logprobs", top}});
  }
  return {{"content", content}};
}

// legacy completions: {tokens, token_logprobs, top_logprobs, text_offset}; `text_offset` starts at
// the length of the text already returned.
json completion_logprobs(const std::vector<GeneratedToken>& tokens, const TextCodec& codec, size_t text_offset) {
  json result = {{"tokens", json::array()},
                 {"token_logprobs", json::array()},
                 {"top_logprobs", json::array()},
                 {"text_offset", json::array()}};
  for (const auto& token : tokens) {
    const std::string& text = token.text;
    result["tokens"].push_back(text);
    result["token_logprobs"].push_back(token.logprob);
    json top = json::object();
    for (const auto& [id, logprob] : token.top) top[codec.token_text(id)] = logprob;
    result["top_logprobs"].push_back(top);
    result["text_offset"].push_back(text_offset);
    text_offset += text.size();
  }
  return result;
}

bool finished_normally(const TextDelta& delta) { return ended_normally(delta.finish_reason); }

// A generation that failed mid-stream: an error chunk (OpenAI's streams have no error event).
std::string error_chunk(const ApiError& failure) {
  return sse_data(openai_error_body(failure.status(), failure.what(), "", failure.code()));
}

}  // namespace

std::string openai_finish_reason(FinishReason reason) { return std::string(finish_reason_name(reason)); }

json models_list(const std::string& served_model, int64_t context_tokens, int64_t created) {
  return {{"object", "list"},
          {"data",
           {{{"id", served_model},
             {"object", "model"},
             {"created", created},
             {"owned_by", "kiln"},
             {"max_model_len", context_tokens}}}}};
}

ChatCompletionResponse::ChatCompletionResponse(const ChatCompletionRequest& request, std::string served_model,
                                               const TextCodec& codec, const ChatOutputParser& parser)
    : codec_(codec),
      parsers_(static_cast<size_t>(request.generation.n), parser),
      id_(random_id("chatcmpl-")),
      created_(unix_seconds()),
      model_(std::move(served_model)),
      logprobs_(request.logprobs),
      include_usage_(request.include_usage) {}

std::string ChatCompletionResponse::finish_reason(FinishReason reason, const ChatOutput& output) const {
  const bool calls_complete = std::all_of(output.tool_calls.begin(), output.tool_calls.end(),
                                          [](const ToolCall& call) { return call.complete; });
  return reason == FinishReason::Stop && !output.tool_calls.empty() && calls_complete ? "tool_calls"
                                                                                      : openai_finish_reason(reason);
}

json ChatCompletionResponse::whole(std::span<const WholeGeneration> choices, const TokenUsage& usage) const {
  json choices_json = json::array();
  for (size_t index = 0; index < choices.size(); ++index)
    choices_json.push_back(whole_choice(index, choices[index]));
  return {{"id", id_},
          {"object", "chat.completion"},
          {"created", created_},
          {"model", model_},
          {"choices", std::move(choices_json)},
          {"usage", openai_usage(usage)}};
}

json ChatCompletionResponse::whole_choice(size_t index, const WholeGeneration& whole) const {
  const ChatOutput output = parsers_[index].parse(whole.text);
  json message = {{"role", "assistant"},
                  {"content", output.content.empty() && !output.tool_calls.empty() ? json() : json(output.content)}};
  if (!output.reasoning.empty()) message["reasoning_content"] = output.reasoning;
  if (!output.tool_calls.empty()) {
    message["tool_calls"] = json::array();
    for (const ToolCall& call : output.tool_calls)
      message["tool_calls"].push_back({{"id", random_id("call_")},
                                       {"type", "function"},
                                       {"function", {{"name", call.name}, {"arguments", call.arguments}}}});
  }
  return {{"index", index},
          {"message", std::move(message)},
          {"logprobs", logprobs_ ? chat_logprobs(whole.tokens, codec_) : json()},
          {"finish_reason", finish_reason(whole.last.finish_reason, output)}};
}

std::string ChatCompletionResponse::chunk(size_t index, json delta, json logprobs, json finish_reason) const {
  json body = {{"id", id_},
               {"object", "chat.completion.chunk"},
               {"created", created_},
               {"model", model_},
               {"choices", json::array({{{"index", index},
                                         {"delta", std::move(delta)},
                                         {"logprobs", std::move(logprobs)},
                                         {"finish_reason", std::move(finish_reason)}}})}};
  if (include_usage_) body["usage"] = nullptr;
  return sse_data(body);
}

std::vector<std::string> ChatCompletionResponse::stream_start(const TokenUsage&) {
  std::vector<std::string> events;
  for (size_t index = 0; index < parsers_.size(); ++index)
    events.push_back(chunk(index, {{"role", "assistant"}, {"content", ""}}, json(), json()));
  return events;
}

std::vector<std::string> ChatCompletionResponse::stream_delta(size_t index, const TextDelta& delta,
                                                              const TokenUsage&) {
  std::vector<std::string> events;
  ChatOutputParser& parser = parsers_[index];
  std::vector<ChatOutputEvent> parsed = parser.push(delta.text);
  if (delta.finished)
    for (ChatOutputEvent& event : parser.finish()) parsed.push_back(std::move(event));
  // The delta's logprobs ride on its first chunk (held-back text may leave it none of its own).
  json logprobs = logprobs_ && !delta.tokens.empty() ? chat_logprobs(delta.tokens, codec_) : json();
  for (const ChatOutputEvent& event : parsed) {
    json fields;
    switch (event.kind) {
      case ChatOutputEvent::Kind::Content: fields = {{"content", event.text}}; break;
      case ChatOutputEvent::Kind::Reasoning: fields = {{"reasoning_content", event.text}}; break;
      // A call as OpenAI streams one: its index, id, type and name first, then its arguments in
      // pieces under the same index.
      case ChatOutputEvent::Kind::ToolCallStart:
        fields = {{"tool_calls",
                   json::array({{{"index", event.call_index},
                                 {"id", random_id("call_")},
                                 {"type", "function"},
                                 {"function", {{"name", event.text}, {"arguments", ""}}}}})}};
        break;
      case ChatOutputEvent::Kind::ToolCallArguments:
        fields = {{"tool_calls",
                   json::array({{{"index", event.call_index}, {"function", {{"arguments", event.text}}}}})}};
        break;
      case ChatOutputEvent::Kind::ToolCallEnd: continue;
    }
    events.push_back(chunk(index, std::move(fields), std::exchange(logprobs, json()), json()));
  }
  if (!logprobs.is_null()) events.push_back(chunk(index, {{"content", ""}}, std::move(logprobs), json()));
  if (!delta.finished) return events;
  if (finished_normally(delta))
    events.push_back(chunk(index, json::object(), json(), finish_reason(delta.finish_reason, parser.output())));
  else
    events.push_back(error_chunk(generation_failure(delta)));
  return events;
}

std::vector<std::string> ChatCompletionResponse::stream_end(const TokenUsage& usage) {
  std::vector<std::string> events;
  if (include_usage_)
    events.push_back(sse_data({{"id", id_},
                               {"object", "chat.completion.chunk"},
                               {"created", created_},
                               {"model", model_},
                               {"choices", json::array()},
                               {"usage", openai_usage(usage)}}));
  events.push_back(kSseDone);
  return events;
}

std::string ChatCompletionResponse::stream_failure(const ApiError& failure) const {
  return error_chunk(failure) + kSseDone;
}

CompletionResponse::CompletionResponse(const CompletionRequest& request, std::string served_model,
                                       const TextCodec& codec)
    : codec_(codec),
      id_(random_id("cmpl-")),
      created_(unix_seconds()),
      model_(std::move(served_model)),
      logprobs_(request.logprobs.has_value()),
      include_usage_(request.include_usage),
      text_offsets_(static_cast<size_t>(request.generation.n), 0) {}

json CompletionResponse::body(json choices) const {
  return {{"id", id_},
          {"object", "text_completion"},
          {"created", created_},
          {"model", model_},
          {"choices", std::move(choices)}};
}

json CompletionResponse::whole(std::span<const WholeGeneration> choices, const TokenUsage& usage) const {
  json choices_json = json::array();
  for (size_t index = 0; index < choices.size(); ++index) {
    const WholeGeneration& whole = choices[index];
    choices_json.push_back({{"index", index},
                            {"text", whole.text},
                            {"logprobs", logprobs_ ? completion_logprobs(whole.tokens, codec_, 0) : json()},
                            {"finish_reason", openai_finish_reason(whole.last.finish_reason)}});
  }
  json response = body(std::move(choices_json));
  response["usage"] = openai_usage(usage);
  return response;
}

std::vector<std::string> CompletionResponse::stream_start(const TokenUsage&) { return {}; }

std::vector<std::string> CompletionResponse::stream_delta(size_t index, const TextDelta& delta, const TokenUsage&) {
  std::vector<std::string> events;
  const bool ended = delta.finished && finished_normally(delta);
  size_t& text_offset = text_offsets_[index];
  if (!delta.text.empty() || ended) {
    const json logprobs = logprobs_ ? completion_logprobs(delta.tokens, codec_, text_offset) : json();
    json chunk = body(json::array({{{"index", index},
                                    {"text", delta.text},
                                    {"logprobs", logprobs},
                                    {"finish_reason", ended ? json(openai_finish_reason(delta.finish_reason)) : json()}}}));
    if (include_usage_) chunk["usage"] = nullptr;
    text_offset += delta.text.size();
    events.push_back(sse_data(chunk));
  }
  if (delta.finished && !ended) events.push_back(error_chunk(generation_failure(delta)));
  return events;
}

std::vector<std::string> CompletionResponse::stream_end(const TokenUsage& usage) {
  std::vector<std::string> events;
  if (include_usage_) {
    json usage_chunk = body(json::array());
    usage_chunk["usage"] = openai_usage(usage);
    events.push_back(sse_data(usage_chunk));
  }
  events.push_back(kSseDone);
  return events;
}

std::string CompletionResponse::stream_failure(const ApiError& failure) const {
  return error_chunk(failure) + kSseDone;
}

}  // namespace kiln::server
