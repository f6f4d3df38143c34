// One tool call read as its text streams in, in a chat template's call syntax (text/chat_output.h
// lists them): its name as soon as the text names it, then its arguments — the text of a JSON
// object — in pieces, as far as the text so far decides them, and at the end whether the call's
// whole text parsed.
//
//   Hermes, Llama JSON  the arguments object is passed through as the model writes it, byte by
//                       byte as each one proves to continue valid JSON (text/json_scanner.h),
//                       without the whitespace between tokens; arguments given as a JSON string
//                       holding an object come out once that string closes.
//   Qwen XML, MiniCPM   the arguments are built as an object: "{" with the name, then each
//                       parameter's "key":value once the parameter closes (typed by the tool's
//                       schema: a string as written, anything else parsed as JSON when it parses),
//                       and "}" once the function closes.
//
// So the pieces joined are always a prefix of a JSON object's text, and the whole object once the
// call completes: the same text however the call's text was cut.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include <nlohmann/json.hpp>

#include "text/json_scanner.h"

namespace kiln {

enum class ToolCallSyntax { None, Hermes, QwenXml, LlamaJson, MiniCpmXml };

// Whether the XML syntaxes read a parameter's value as the string written: its property's type is
// or allows "string", or it names none (else the value is parsed as JSON when it parses).
bool xml_value_is_string(const nlohmann::ordered_json& property);

class ToolCallReader {
 public:
  // `tools`: the request's tools in OpenAI's shape (the XML syntaxes type values by their schemas).
  ToolCallReader(ToolCallSyntax syntax, std::shared_ptr<const nlohmann::ordered_json> tools);

  // More of the call's text: what follows its opening marker, never any of its closing one.
  void read(std::string_view text);
  // The call's text ended (its closing marker came, or the reply ended).
  void end();

  // The function's name, once the text names it.
  const std::optional<std::string>& name() const { return name_; }
  // The arguments' text read since the last take.
  std::string take_arguments() { return std::exchange(arguments_, {}); }
  // The text can no longer be a call (a byte no call continues with; after end(): anything short
  // of a whole call).
  bool broken() const { return broken_; }
  // end() came and the whole text was one call.
  bool complete() const { return complete_; }

 private:
  void read_json(char byte);
  void start_json_value(char byte);
  void end_json();
  void read_qwen_xml();
  void read_minicpm_xml();
  void end_xml();
  // Appends one parameter's "key":value to the arguments.
  void add_parameter(const std::string& key, const std::string& value);
  void name_function(std::string name);

  ToolCallSyntax syntax_;
  std::shared_ptr<const nlohmann::ordered_json> tools_;
  std::optional<std::string> name_;
  std::string arguments_;  // read and not yet taken
  bool broken_ = false;
  bool complete_ = false;

  // The JSON syntaxes: the call's object {"name": …, "arguments": {…}} and where the scanner
  // stands in its members.
  enum class Member { Between, Key, BeforeValue, Name, Arguments, QuotedArguments, Other };
  JsonScanner scanner_;
  Member member_ = Member::Between;
  std::string raw_;  // the key, name or quoted arguments being read, as written
  std::string key_;  // the key whose value comes next
  bool has_arguments_ = false;

  // The XML syntaxes: the text so far, how far it was parsed, and whether the function closed.
  std::string text_;
  size_t parsed_ = 0;
  size_t search_from_ = 0;  // where the search for the open parameter's end resumes
  size_t parameters_ = 0;
  bool function_closed_ = false;
  const nlohmann::ordered_json* properties_ = nullptr;  // the named tool's, in *tools_
};

}  // namespace kiln
