// A chat model's output split into what the APIs return separately: the reply's content, its
// reasoning (`<think>…</think>`), and its tool calls in the model's own syntax. The syntax comes
// from the model's chat template (chat_output_syntax), never from a request:
//
//   Hermes      (Qwen3, Qwen2.5)      <tool_call>\n{"name": N, "arguments": {…}}\n</tool_call>
//   Qwen XML    (Qwen3.5, Qwen3-Coder) <tool_call>\n<function=N>\n<parameter=K>\nV\n</parameter>\n…</function>\n</tool_call>
//                                      (each value typed by the tool's JSON schema: a string as
//                                      written, anything else parsed as JSON)
//   Llama JSON  (Llama-3.1 / 3.2)      the whole reply is {"name": N, "parameters": {…}} (the
//                                      <|python_tag|> before it is a special token, not text)
//   MiniCPM XML (MiniCPM5)             <function name="N"><param name="K">V</param>…</function>
//                                      (a value with <, & or a newline in <![CDATA[…]]>; typed
//                                      by the tool's schema as Qwen XML's are)
//
// The parser is incremental: text goes in as it streams, and what can be told apart comes out as
// events — content and reasoning as soon as no marker could still begin in them, a tool call once
// its closing marker arrives. A call that never closes, or whose body does not parse, comes out as
// content (its markers included): malformed output is returned as text, never an error.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/grammar/grammar.h"

namespace kiln {

enum class ToolCallSyntax { None, Hermes, QwenXml, LlamaJson, MiniCpmXml };

struct ChatOutputSyntax {
  ToolCallSyntax tool_calls = ToolCallSyntax::None;
  bool reasoning = false;  // <think>…</think> is split out
};

// The syntax a chat template makes its model write: Qwen XML where the template describes
// `<function=` calls inside `<tool_call>`, Hermes where it describes `<tool_call>` alone, Llama JSON
// where it offers tools as `{"name": …, "parameters": …}` (Llama 3.1's `<|python_tag|>` templates),
// MiniCPM XML where it describes `<function name=` calls; reasoning where it mentions `<think>`.
ChatOutputSyntax chat_output_syntax(std::string_view chat_template);
// Whether a rendered chat prompt ends inside reasoning (its last <think> is not closed): the
// template opened it for the model, whose reply then starts as reasoning (ChatOutputParser's
// `in_reasoning`).
bool prompt_opens_reasoning(std::string_view prompt);
// "hermes", "qwen_xml", "llama_json", "minicpm_xml", "none" (kiln inspect).
const char* tool_call_syntax_name(ToolCallSyntax syntax);

struct ToolCall {
  std::string name;
  std::string arguments;  // a JSON object, as text
};

struct ChatOutputEvent {
  enum class Kind { Content, Reasoning, ToolCall };
  Kind kind = Kind::Content;
  std::string text;          // Content, Reasoning
  ToolCall call;             // ToolCall
  size_t call_index = 0;     // ToolCall: its index among the reply's calls
};

// The whole reply once parsed: events joined.
struct ChatOutput {
  std::string content;
  std::string reasoning;
  std::vector<ToolCall> tool_calls;
};

class ChatOutputParser {
 public:
  // `tools`: the request's tools in OpenAI's shape (for the Qwen XML value types), or null.
  // `in_reasoning`: the prompt already opened <think> (the generation prompt ends inside it).
  ChatOutputParser(ChatOutputSyntax syntax, nlohmann::ordered_json tools, bool in_reasoning = false);

  std::vector<ChatOutputEvent> push(std::string_view text);
  // The text held back (a marker's possible beginning, an unclosed call) as what it is.
  std::vector<ChatOutputEvent> finish();

  // Everything the events so far said.
  const ChatOutput& output() const { return output_; }

  // One call's body (the text between the call's opening and closing markers, or a Llama reply)
  // as a call, or nothing when it does not parse.
  std::optional<ToolCall> parse_call(std::string_view body) const;

 private:
  enum class State { Content, Reasoning, ToolCall, WholeReply };
  void emit(std::vector<ChatOutputEvent>& events, ChatOutputEvent::Kind kind, std::string text);
  void emit_call(std::vector<ChatOutputEvent>& events, ToolCall call);

  ChatOutputSyntax syntax_;
  nlohmann::ordered_json tools_;
  State state_;
  std::string pending_;  // text not yet told apart
  bool started_ = false;  // any non-space text seen (Llama: a reply opening with '{' is a call)
  bool skip_spaces_ = false;  // after </think> or a call: the spaces before the next content are layout
  ChatOutput output_;
};

// The grammar of a reply made only of tool calls in `syntax` (OpenAI's tool_choice "required", or
// one naming a function): with `forced`, one call of that tool; without, one call of any of
// `tools`, or one or more where `several` (not in Llama JSON, whose replies hold one call). Each call is written compactly, its
// arguments held to its tool's `parameters` schema (engine/grammar/json_schema.h): Hermes
// `<tool_call>\n{"name":"…","arguments":{…}}\n</tool_call>`, calls separated by a newline; Llama
// `{"name":"…","parameters":{…}}`. Fails (kiln::Error) for Qwen XML and no syntax, a name that is
// not a tool's, or a schema the compiler refuses.
grammar::Grammar tool_call_grammar(ToolCallSyntax syntax, const nlohmann::ordered_json& tools,
                                   const std::optional<std::string>& forced, bool several);

// The arguments of a Qwen XML call typed by its tool's schema: each parameter whose property type
// is not "string" parsed as JSON when it parses, else kept a string.
nlohmann::ordered_json typed_xml_arguments(const std::vector<std::pair<std::string, std::string>>& parameters,
                                           const nlohmann::ordered_json& tools, const std::string& function);

}  // namespace kiln
