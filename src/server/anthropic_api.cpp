#include "server/anthropic_api.h"

#include <algorithm>
#include <limits>

#include "server/api_error.h"
#include "server/output_constraints.h"
#include "server/sse.h"

namespace kiln::server {

namespace {

std::string block_text(JsonFields& block) {
  const auto text = block.string("text");
  if (!text) reject_field(block.param("text"), "`{}` is required", block.param("text"));
  // Prompt-caching hints and citations change nothing for generation here.
  block.object("cache_control");
  block.value("citations");
  return *text;
}

// A tool result's content: a string or text blocks.
std::string tool_result_text(const json& content, const std::string& param) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array())
    reject_field(param, "`{}` must be a string or an array of text blocks, got {}", param, json_type_name(content));
  std::string text;
  for (size_t i = 0; i < content.size(); ++i) {
    const std::string block_param = fmt::format("{}[{}]", param, i);
    if (!content[i].is_object())
      reject_field(block_param, "`{}` must be an object, got {}", block_param, json_type_name(content[i]));
    JsonFields block(content[i], block_param);
    const auto type = block.string("type");
    if (type != "text") reject_unsupported(block.param("type"), "tool results other than text");
    if (i > 0) text += "\n";
    text += block_text(block);
    block.reject_unknown();
  }
  return text;
}

// Appends one Anthropic message to the template conversation: text blocks become the content;
// tool_use blocks (assistant) become tool_calls; tool_result blocks (user) become tool messages.
void convert_message(const json& message_json, size_t index, json& conversation) {
  const std::string param = fmt::format("messages[{}]", index);
  if (!message_json.is_object())
    reject_field(param, "`{}` must be an object, got {}", param, json_type_name(message_json));
  JsonFields message(message_json, param);
  const auto role = message.string("role");
  if (!role) reject_field(message.param("role"), "`{}` is required", message.param("role"));
  if (*role != "user" && *role != "assistant")
    reject_field(message.param("role"), "`{}` must be \"user\" or \"assistant\", got \"{}\"", message.param("role"),
                 quote_client_text(*role));
  const json* content = message.value("content");
  if (!content) reject_field(message.param("content"), "`{}` is required", message.param("content"));
  message.reject_unknown();

  json out = {{"role", *role}};
  if (content->is_string()) {
    out["content"] = content->get<std::string>();
    conversation.push_back(std::move(out));
    return;
  }
  if (!content->is_array())
    reject_field(message.param("content"), "`{}` must be a string or an array of content blocks, got {}",
                 message.param("content"), json_type_name(*content));
  std::string text;
  json tool_calls = json::array();
  for (size_t i = 0; i < content->size(); ++i) {
    const std::string block_param = fmt::format("{}.content[{}]", param, i);
    const json& block_json = (*content)[i];
    if (!block_json.is_object())
      reject_field(block_param, "`{}` must be an object, got {}", block_param, json_type_name(block_json));
    JsonFields block(block_json, block_param);
    const auto type = block.string("type");
    if (!type) reject_field(block.param("type"), "`{}` is required", block.param("type"));
    if (*type == "text") {
      if (!text.empty()) text += "\n";
      text += block_text(block);
    } else if (*type == "tool_use" && *role == "assistant") {
      const auto id = block.string("id");
      const auto name = block.string("name");
      const json* input = block.object("input");
      if (!id || !name || !input)
        reject_field(block_param, "`{}` (tool_use) needs `id`, `name` and an object `input`", block_param);
      block.object("cache_control");
      tool_calls.push_back({{"id", *id}, {"type", "function"}, {"function", {{"name", *name}, {"arguments", *input}}}});
    } else if (*type == "tool_result" && *role == "user") {
      const auto tool_use_id = block.string("tool_use_id");
      if (!tool_use_id) reject_field(block.param("tool_use_id"), "`{}` is required", block.param("tool_use_id"));
      const json* result = block.value("content");
      block.boolean("is_error");
      block.object("cache_control");
      conversation.push_back({{"role", "tool"},
                              {"tool_call_id", *tool_use_id},
                              {"content", result ? tool_result_text(*result, block.param("content")) : ""}});
    } else {
      reject_unsupported(block.param("type"),
                         fmt::format("content blocks of type \"{}\" in {} messages", quote_client_text(*type), *role));
    }
    block.reject_unknown();
  }
  if (text.empty() && tool_calls.empty()) return;  // only tool results
  out["content"] = text;
  if (!tool_calls.empty()) out["tool_calls"] = tool_calls;
  conversation.push_back(std::move(out));
}

std::string system_text(const json& system) {
  if (system.is_string()) return system.get<std::string>();
  if (!system.is_array())
    reject_field("system", "`system` must be a string or an array of text blocks, got {}", json_type_name(system));
  std::string text;
  for (size_t i = 0; i < system.size(); ++i) {
    const std::string param = fmt::format("system[{}]", i);
    if (!system[i].is_object()) reject_field(param, "`{}` must be an object, got {}", param, json_type_name(system[i]));
    JsonFields block(system[i], param);
    if (block.string("type") != "text") reject_field(block.param("type"), "`{}` must be \"text\"", block.param("type"));
    if (i > 0) text += "\n";
    text += block_text(block);
    block.reject_unknown();
  }
  return text;
}

// Anthropic tools ({name, description, input_schema}) in the OpenAI shape templates take.
json convert_tools(const json& tools) {
  json converted = json::array();
  for (size_t i = 0; i < tools.size(); ++i) {
    const std::string param = fmt::format("tools[{}]", i);
    if (!tools[i].is_object()) reject_field(param, "`{}` must be an object, got {}", param, json_type_name(tools[i]));
    JsonFields tool(tools[i], param);
    if (auto type = tool.string("type"); type && *type != "custom")
      reject_unsupported(tool.param("type"), fmt::format("tools of type \"{}\"", quote_client_text(*type)));
    const auto name = tool.string("name");
    if (!name || name->empty()) reject_field(tool.param("name"), "`{}` must be a non-empty string", tool.param("name"));
    json function = {{"name", *name}};
    if (auto description = tool.string("description")) function["description"] = *description;
    const json* schema = tool.object("input_schema");
    if (!schema) reject_field(tool.param("input_schema"), "`{}` is required", tool.param("input_schema"));
    function["parameters"] = *schema;
    tool.object("cache_control");
    tool.reject_unknown();
    converted.push_back({{"type", "function"}, {"function", function}});
  }
  return converted;
}

}  // namespace

namespace {

MessagesRequest parse_messages_body(const json& body, const std::string& served_model, const SamplingParams& defaults,
                                    bool count_tokens) {
  MessagesRequest request;
  request.generation.sampling = defaults;
  JsonFields fields(body, "");
  check_model_field(fields, served_model);
  if (!count_tokens) {
    const auto max_tokens = fields.integer("max_tokens", 1, kMaxTokensLimit);
    if (!max_tokens) reject_field("max_tokens", "`max_tokens` is required");
    request.generation.max_tokens = max_tokens;
  }

  request.messages = json::array();
  if (const json* system = fields.value("system")) {
    const std::string text = system_text(*system);
    if (!text.empty()) request.messages.push_back({{"role", "system"}, {"content", text}});
  }
  const json* messages = fields.array("messages");
  if (!messages) reject_field("messages", "`messages` is required");
  if (messages->empty()) reject_field("messages", "`messages` must hold at least one message");
  for (size_t i = 0; i < messages->size(); ++i) convert_message((*messages)[i], i, request.messages);

  if (!count_tokens) {
    read_sampling(fields, 1.0, request.generation.sampling);
    request.generation.speculative = read_speculative(fields);
    request.generation.stop = read_stop_strings(fields, "stop_sequences", false);
    request.generation.stream = fields.boolean("stream").value_or(false);
  }
  if (const json* tools = fields.array("tools"); tools && !tools->empty()) request.prompt.tools = convert_tools(*tools);
  if (const json* choice = fields.object("tool_choice")) {
    JsonFields choice_fields(*choice, "tool_choice");
    const auto type = choice_fields.string("type");
    if (!type) reject_field("tool_choice.type", "`tool_choice.type` is required");
    const auto name = choice_fields.string("name");
    if (*type == "tool" && !name) reject_field("tool_choice.name", "`tool_choice.name` is required for type \"tool\"");
    if (*type != "tool" && name) reject_field("tool_choice.name", "`tool_choice.name` is only for type \"tool\"");
    if (*type == "any" || *type == "tool") {
      request.tool_call_required = true;
      request.forced_tool = name;
    } else if (*type == "none") {
      request.prompt.tools = json();
    } else if (*type != "auto") {
      reject_field("tool_choice.type", "`tool_choice.type` must be auto, any, tool or none");
    }
    // With auto the model may still write several calls; only a forced reply is held to one.
    request.parallel_tool_calls = !choice_fields.boolean("disable_parallel_tool_use").value_or(false);
    choice_fields.reject_unknown();
  }
  if (request.tool_call_required && (!request.prompt.tools.is_array() || request.prompt.tools.empty()))
    reject_field("tool_choice", "`tool_choice` forces a tool call, but the request offers no `tools`");
  // Extended thinking maps onto the templates' enable_thinking switch (Qwen3-style), its
  // budget_tokens onto a cap on the reply's reasoning.
  if (const json* thinking = fields.object("thinking")) {
    JsonFields thinking_fields(*thinking, "thinking");
    const auto type = thinking_fields.string("type");
    if (type != "enabled" && type != "disabled")
      reject_field("thinking.type", "`thinking.type` must be \"enabled\" or \"disabled\"");
    const auto budget = thinking_fields.integer("budget_tokens", 0, kMaxTokensLimit);
    if (budget && *type == "disabled")
      reject_field("thinking.budget_tokens", "`thinking.budget_tokens` applies to thinking of type \"enabled\"");
    thinking_fields.reject_unknown();
    request.prompt.template_kwargs["enable_thinking"] = *type == "enabled";
    request.generation.reasoning_budget = budget;
  }
  read_anthropic_output_config(fields, request.generation);
  if (!count_tokens) {
    if (request.generation.grammar && request.tool_call_required)
      reject_field("output_config.format", "`output_config.format` cannot be combined with a `tool_choice` that forces "
                                           "a tool call");
    if (request.generation.reasoning_budget && (request.generation.grammar || request.tool_call_required))
      reject_field("thinking", "extended `thinking` cannot be combined with `output_config.format` or a forced "
                               "`tool_choice`, which hold the reply to their grammar from its first token");
    fields.object("metadata");
    fields.string("service_tier");
  }
  fields.reject_unknown();
  return request;
}

}  // namespace

MessagesRequest parse_messages_request(const json& body, const std::string& served_model,
                                       const SamplingParams& defaults) {
  return parse_messages_body(body, served_model, defaults, false);
}

MessagesRequest parse_count_tokens_request(const json& body, const std::string& served_model) {
  return parse_messages_body(body, served_model, {}, true);
}

json anthropic_error_body(int status, const std::string& message) {
  const std::string type = error_type_for(status,
                                          {{401, "authentication_error"},
                                           {403, "permission_error"},
                                           {404, "not_found_error"},
                                           {413, "request_too_large"},
                                           {429, "rate_limit_error"},
                                           {503, "overloaded_error"}},
                                          "api_error");
  return {{"type", "error"}, {"error", {{"type", type}, {"message", message}}}};
}

std::string anthropic_stop_reason(FinishReason finish_reason, const std::optional<std::string>& stop_sequence) {
  if (finish_reason == FinishReason::Length) return "max_tokens";
  if (stop_sequence) return "stop_sequence";
  return "end_turn";
}

namespace {

// Anthropic counts the prompt in parts: input_tokens are those processed now, cache_read_input_tokens
// those read from the cache (kiln's prefix cache writes as it goes: no cache_creation charge).
json anthropic_usage(const TokenUsage& usage) {
  return {{"input_tokens", usage.prompt_tokens - usage.cached_tokens},
          {"cache_creation_input_tokens", 0},
          {"cache_read_input_tokens", usage.cached_tokens},
          {"output_tokens", usage.completion_tokens}};
}

json stop_sequence_field(const TextDelta& end) { return end.stop_sequence ? json(*end.stop_sequence) : json(); }

}  // namespace

MessagesResponse::MessagesResponse(std::string served_model, ChatOutputParser parser)
    : id_(random_id("msg_")), model_(std::move(served_model)), parser_(std::move(parser)) {}

namespace {

// A tool call's stop reason: tool_use where the reply made calls, each complete, and ended by itself.
std::string stop_reason_of(const TextDelta& end, const ChatOutput& output) {
  const bool calls_complete = std::all_of(output.tool_calls.begin(), output.tool_calls.end(),
                                          [](const ToolCall& call) { return call.complete; });
  if (end.finish_reason == FinishReason::Stop && !end.stop_sequence && !output.tool_calls.empty() && calls_complete)
    return "tool_use";
  return anthropic_stop_reason(end.finish_reason, end.stop_sequence);
}

// A tool_use block; its input streams in input_json_delta events.
json tool_use_block(const std::string& name) {
  return {{"type", "tool_use"}, {"id", random_id("toolu_")}, {"name", name}, {"input", json::object()}};
}

}  // namespace

json MessagesResponse::whole(std::span<const WholeGeneration> choices, const TokenUsage& usage) const {
  const WholeGeneration& whole = choices.front();
  const ChatOutput output = parser_.parse(whole.text);
  json content = json::array();
  if (!output.reasoning.empty())
    content.push_back({{"type", "thinking"}, {"thinking", output.reasoning}, {"signature", ""}});
  if (!output.content.empty() || output.tool_calls.empty()) content.push_back({{"type", "text"}, {"text", output.content}});
  // Calls come out of parse() only once their arguments parsed as an object.
  for (const ToolCall& call : output.tool_calls) {
    json block = tool_use_block(call.name);
    block["input"] = json::parse(call.arguments);
    content.push_back(std::move(block));
  }
  return {{"id", id_},
          {"type", "message"},
          {"role", "assistant"},
          {"model", model_},
          {"content", std::move(content)},
          {"stop_reason", stop_reason_of(whole.last, output)},
          {"stop_sequence", stop_sequence_field(whole.last)},
          {"usage", anthropic_usage(usage)}};
}

std::vector<std::string> MessagesResponse::stream_start(const TokenUsage& usage) {
  const json start = {{"type", "message_start"},
                      {"message",
                       {{"id", id_},
                        {"type", "message"},
                        {"role", "assistant"},
                        {"model", model_},
                        {"content", json::array()},
                        {"stop_reason", nullptr},
                        {"stop_sequence", nullptr},
                        {"usage", anthropic_usage({usage.prompt_tokens, 0, usage.cached_tokens})}}}};
  // Blocks open as the reply's parts arrive (the ping follows the first).
  return {sse_event("message_start", start)};
}

std::string MessagesResponse::close_block() {
  if (open_type_.empty()) return "";
  open_type_.clear();
  return sse_event("content_block_stop", {{"type", "content_block_stop"}, {"index", blocks_ - 1}});
}

std::string MessagesResponse::open_block(const char* type, const json& block) {
  std::string events = close_block();
  events += sse_event("content_block_start", {{"type", "content_block_start"}, {"index", blocks_++}, {"content_block", block}});
  if (!pinged_) {
    events += sse_event("ping", {{"type", "ping"}});
    pinged_ = true;
  }
  open_type_ = type;
  return events;
}

std::vector<std::string> MessagesResponse::stream_delta(size_t, const TextDelta& delta, const TokenUsage&) {
  std::vector<std::string> events;
  std::vector<ChatOutputEvent> parsed = parser_.push(delta.text);
  if (delta.finished)
    for (ChatOutputEvent& event : parser_.finish()) parsed.push_back(std::move(event));
  for (const ChatOutputEvent& event : parsed) {
    std::string written;
    // A call is a tool_use block, opened with an empty input that input_json_delta events fill.
    if (event.kind == ChatOutputEvent::Kind::ToolCallStart) {
      written = open_block("tool_use", tool_use_block(event.text));
    } else if (event.kind == ChatOutputEvent::Kind::ToolCallArguments) {
      written = sse_event("content_block_delta",
                          {{"type", "content_block_delta"},
                           {"index", blocks_ - 1},
                           {"delta", {{"type", "input_json_delta"}, {"partial_json", event.text}}}});
    } else if (event.kind == ChatOutputEvent::Kind::ToolCallEnd) {
      written = close_block();
    } else {
      const bool thinking = event.kind == ChatOutputEvent::Kind::Reasoning;
      const char* type = thinking ? "thinking" : "text";
      if (open_type_ != type)
        written = open_block(type, thinking ? json{{"type", "thinking"}, {"thinking", ""}, {"signature", ""}}
                                            : json{{"type", "text"}, {"text", ""}});
      written += sse_event("content_block_delta",
                           {{"type", "content_block_delta"},
                            {"index", blocks_ - 1},
                            {"delta", thinking ? json{{"type", "thinking_delta"}, {"thinking", event.text}}
                                               : json{{"type", "text_delta"}, {"text", event.text}}}});
    }
    events.push_back(std::move(written));
  }
  if (!delta.finished) return events;
  if (!ended_normally(delta.finish_reason)) {
    events.push_back(stream_failure(generation_failure(delta)));
    return events;
  }
  // A reply with no part at all still has its (empty) text block.
  std::string closing = blocks_ == 0 ? open_block("text", {{"type", "text"}, {"text", ""}}) : "";
  closing += close_block();
  events.push_back(closing);
  ending_ = json{{"stop_reason", stop_reason_of(delta, parser_.output())}, {"stop_sequence", stop_sequence_field(delta)}};
  return events;
}

std::vector<std::string> MessagesResponse::stream_end(const TokenUsage& usage) {
  if (!ending_) return {};  // the generation failed: its error event ended the stream
  return {sse_event("message_delta", {{"type", "message_delta"},
                                      {"delta", *ending_},
                                      {"usage", anthropic_usage(usage)}}) +
          sse_event("message_stop", {{"type", "message_stop"}})};
}

std::string MessagesResponse::stream_failure(const ApiError& failure) const {
  return sse_event("error", anthropic_error_body(failure.status(), failure.what()));
}

}  // namespace kiln::server
