// The grammar of a reply made only of tool calls in a chat template's syntax: what a forced tool
// choice holds the reply to (OpenAI's tool_choice "required" or a named function, Anthropic's "any"
// or "tool"). Each syntax is written the one way its reader (text/tool_call_reader.h) reads it
// back, calls separated by a newline:
//
//   Hermes       <tool_call>\n{"name":"N","arguments":{…}}\n</tool_call>
//   Llama JSON   {"name":"N","parameters":{…}}                  (one call per reply)
//   Qwen XML     <tool_call>\n<function=N>\n<parameter=K>\nV\n</parameter>\n…</function>\n</tool_call>
//   MiniCPM XML  <function name="N"><param name="K">V</param>…</function>
//
// JSON arguments are held to the tool's `parameters` schema (engine/grammar/json_schema.h),
// compactly (Hermes: with <, > and & escaped in strings, so that no string closes the call). In the XML syntaxes the parameters are the schema's properties, in its order, the
// required ones always: a value the reader takes as a string (a property whose type allows a
// string, or names none) is written as raw text (MiniCPM: in a CDATA section) that never holds
// what would end it early (Qwen: "</"; MiniCPM: "]]>"), held to its enum or const, format,
// minLength and maxLength; any other value is compact JSON held to its schema, with <, > and &
// escaped inside its strings so that no markup can appear in it.
#pragma once

#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "engine/grammar/grammar.h"
#include "text/tool_call_reader.h"

namespace kiln {

// With `forced`, one call of that tool; without, one call of any of `tools` (OpenAI's shape), or
// one or more where `several` (never in Llama JSON). Fails (kiln::Error) for no syntax, a name
// that is not a tool's, a name or key the syntax cannot write, or a schema the compiler refuses.
grammar::Grammar tool_call_grammar(ToolCallSyntax syntax, const nlohmann::ordered_json& tools,
                                   const std::optional<std::string>& forced, bool several);

}  // namespace kiln
