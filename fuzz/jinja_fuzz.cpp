// A chat template, optionally followed by a NUL byte and a JSON list of messages: the template is
// parsed and rendered as transformers' apply_chat_template would render it
// (tokenizer/chat_template.h), with tools and a generation prompt. Without messages (or when they
// are not JSON), a fixed conversation with a tool call is rendered.
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/thread_stack.h"
#include "fuzz_support.h"
#include "server/json_fields.h"
#include "tokenizer/chat_template.h"

namespace {

using nlohmann::ordered_json;

const ordered_json& fixed_conversation() {
  static const ordered_json messages = ordered_json::parse(R"([
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
     "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "18 C"},
    {"role": "assistant", "content": "18 C."}])");
  return messages;
}

const ordered_json& tools() {
  static const ordered_json schemas = ordered_json::parse(R"([{"type": "function", "function": {
    "name": "weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])");
  return schemas;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Not a structured binding: clang 14 (the fuzz build) cannot capture one in the lambda below.
  const std::pair<std::string_view, std::string_view> parts = kiln::fuzz::split_at_nul(kiln::fuzz::as_text(data, size));
  const std::string_view source = parts.first, messages_text = parts.second;
  // Nesting is cut at the server's request limit: deeper input never reaches a template there.
  const ordered_json::parser_callback_t within_server_depth = [](int depth, ordered_json::parse_event_t,
                                                                 ordered_json&) {
    return depth <= kiln::server::kMaxJsonDepth;
  };
  ordered_json messages = ordered_json::parse(messages_text, within_server_depth, /*allow_exceptions=*/false);
  if (messages.is_discarded()) messages = fixed_conversation();
  try {
    // kiln renders templates on threads of 8 MiB, and ASan's frames are about six times larger than
    // Release's (tokenizer/jinja_limits.h measures both): on 64 MiB, a stack overflow is one that
    // Release would have too, not ASan's alone.
    kiln::run_with_stack(size_t{64} << 20, [&] {
      const kiln::ChatTemplate chat_template(source, "fuzz", "<s>", "</s>");
      kiln::ChatTemplateOptions options;
      options.add_generation_prompt = true;
      options.tools = tools();
      (void)chat_template.render(messages, options);
      options.enable_thinking = false;
      options.tools = nullptr;
      (void)chat_template.render(messages, options);
    });
  } catch (const kiln::Error&) {
    // Unsupported syntax, an undefined operation or raise_exception: an error naming the line.
  }
  return 0;
}
