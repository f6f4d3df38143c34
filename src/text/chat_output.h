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
// events — content and reasoning as soon as no marker could still begin in them; a tool call's
// start (its index and name) as soon as its text names the function, then its arguments in pieces
// as they are read (text/tool_call_reader.h: the pieces joined are the arguments' JSON text, the
// same however the text was cut), then its end. A call whose text is cut short (the length limit)
// after its start went out ends there, its arguments as far as they were read; one whose text
// turns out malformed after its start ends at the first byte that cannot continue it, and the rest
// of its text, to its closing marker, is dropped: what was streamed cannot be taken back, and what
// was streamed is always a prefix of a JSON object (vLLM, too, keeps a streamed call that then
// fails to parse). Such a call is not `complete`, and the APIs do not call the reply's end a tool
// call (finish_reason "stop" or "length"). A call that breaks before its name is known comes
// out as content, markers included. parse() reads a whole reply at once (a non-streamed answer): a
// call comes out only once its whole text parsed, else as content, so malformed output is returned
// as text, never an error; for a well-formed reply it gives what the stream's events give.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "text/tool_call_reader.h"

namespace kiln {

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
// The text a chat template writes to close reasoning: `</think>` with the line breaks it puts
// around it where it writes a reasoning block (Qwen3, Qwen3.5, MiniCPM5: "\n</think>\n\n"), the
// occurrence with the most of them; a reasoning budget forces it (engine/reasoning_budget.h).
std::string reasoning_close_text(std::string_view chat_template);
// "hermes", "qwen_xml", "llama_json", "minicpm_xml", "none" (kiln inspect).
const char* tool_call_syntax_name(ToolCallSyntax syntax);

struct ToolCall {
  std::string name;
  std::string arguments;  // a JSON object's text, compact (while a call streams: as far as it was read)
  // Its whole text parsed. Not so for a streamed call whose text broke off or went wrong after
  // its start went out: its arguments stop where the valid text did.
  bool complete = false;
};

struct ChatOutputEvent {
  enum class Kind { Content, Reasoning, ToolCallStart, ToolCallArguments, ToolCallEnd };
  Kind kind = Kind::Content;
  // Content, Reasoning: the text; ToolCallStart: the function's name; ToolCallArguments: the next
  // piece of the call's arguments.
  std::string text;
  size_t call_index = 0;  // the tool-call kinds: the call's index among the reply's calls
};

// The whole reply once parsed: events joined.
struct ChatOutput {
  std::string content;
  std::string reasoning;
  std::vector<ToolCall> tool_calls;
};

class ChatOutputParser {
 public:
  // `tools`: the request's tools in OpenAI's shape (for the XML syntaxes' value types), or null.
  // `in_reasoning`: the prompt already opened <think> (the generation prompt ends inside it).
  ChatOutputParser(ChatOutputSyntax syntax, nlohmann::ordered_json tools, bool in_reasoning = false);

  std::vector<ChatOutputEvent> push(std::string_view text);
  // The reply ended: the text held back (a marker's possible beginning, an unfinished call) as
  // what it is. A call whose closing marker is missing or cut short counts when the rest of its
  // text is one whole call.
  std::vector<ChatOutputEvent> finish();

  // Everything the events so far said.
  const ChatOutput& output() const { return output_; }

  // A whole reply, read from where this parser stands (a fresh one: from the start), without
  // streaming calls: each call comes out once its whole text parsed, else as content.
  ChatOutput parse(std::string_view reply) const;

 private:
  enum class State { Content, Reasoning, ToolCall, WholeReply };
  void emit(std::vector<ChatOutputEvent>& events, ChatOutputEvent::Kind kind, std::string text);
  void emit_call_event(std::vector<ChatOutputEvent>& events, ChatOutputEvent::Kind kind, std::string text);
  void start_call(State state);
  // Reads the open call's text; true when the call ended (its closing marker came).
  bool read_call(std::vector<ChatOutputEvent>& events);
  // Gives the reader the call's text up to `end` and, when streaming, sends what it made of it.
  void feed_call(std::vector<ChatOutputEvent>& events, size_t end);
  // Where the open call's closing marker starts in its text (past CDATA sections in MiniCPM XML),
  // or npos; resumes where the last search stopped.
  size_t find_call_close();
  // `closed`: at its closing marker (else the reply ended).
  void end_call(std::vector<ChatOutputEvent>& events, bool closed);

  ChatOutputSyntax syntax_;
  std::shared_ptr<const nlohmann::ordered_json> tools_;
  bool stream_calls_ = true;  // a call's start and arguments go out as they are read
  State state_;
  std::string pending_;  // text not yet told apart
  bool started_ = false;  // any non-space text seen (Llama: a reply opening with '{' is a call)
  bool skip_spaces_ = false;  // after </think> or a call: the spaces before the next content are layout
  ChatOutput output_;

  // The call being read: its text (after the opening marker), how much of it the reader has,
  // where the search for its closing marker resumes (and whether inside a CDATA section there),
  // whether its start went out, and whether it ended early (broken after its start: the rest of
  // its text is dropped).
  std::optional<ToolCallReader> call_;
  std::string call_text_;
  size_t call_fed_ = 0;
  size_t close_search_from_ = 0;
  bool close_search_in_cdata_ = false;
  bool call_started_ = false;
  bool call_ended_ = false;
};

}  // namespace kiln
