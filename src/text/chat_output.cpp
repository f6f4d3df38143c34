#include "text/chat_output.h"

#include "core/error.h"
#include "engine/grammar/json_schema.h"

#include <algorithm>
#include <span>

namespace kiln {
namespace {

constexpr std::string_view kThinkOpen = "<think>", kThinkClose = "</think>";
constexpr std::string_view kCallOpen = "<tool_call>", kCallClose = "</tool_call>";
// MiniCPM5's calls have no wrapper: the function element itself is the call.
constexpr std::string_view kFunctionOpen = "<function name=", kFunctionClose = "</function>";
constexpr std::string_view kCdataOpen = "<![CDATA[", kCdataClose = "]]>";

// The markers that open and close a call in `syntax` (empty for untagged syntaxes).
std::string_view call_open(ToolCallSyntax syntax) {
  if (syntax == ToolCallSyntax::Hermes || syntax == ToolCallSyntax::QwenXml) return kCallOpen;
  if (syntax == ToolCallSyntax::MiniCpmXml) return kFunctionOpen;
  return {};
}
std::string_view call_close(ToolCallSyntax syntax) {
  return syntax == ToolCallSyntax::MiniCpmXml ? kFunctionClose : kCallClose;
}

// Where `close` first stands in `text` outside CDATA sections (a MiniCPM value may hold anything
// in one), or npos.
size_t find_outside_cdata(std::string_view text, std::string_view close) {
  size_t from = 0;
  while (true) {
    const size_t at = text.find(close, from), cdata = text.find(kCdataOpen, from);
    if (at == std::string_view::npos || cdata == std::string_view::npos || at < cdata) return at;
    const size_t cdata_end = text.find(kCdataClose, cdata + kCdataOpen.size());
    if (cdata_end == std::string_view::npos) return std::string_view::npos;
    from = cdata_end + kCdataClose.size();
  }
}

bool is_space(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

std::string_view trimmed(std::string_view text) {
  while (!text.empty() && is_space(text.front())) text.remove_prefix(1);
  while (!text.empty() && is_space(text.back())) text.remove_suffix(1);
  return text;
}

// The length of the longest end of `text` that is a proper beginning of one of `markers`: text a
// marker may still complete, held back until more arrives.
size_t partial_marker(std::string_view text, std::span<const std::string_view> markers) {
  size_t held = 0;
  for (std::string_view marker : markers)
    for (size_t length = std::min(text.size(), marker.size() - 1); length > held; --length)
      if (text.substr(text.size() - length) == marker.substr(0, length)) {
        held = length;
        break;
      }
  return held;
}

// The first of `markers` in `text`: its position and which, or npos.
std::pair<size_t, std::string_view> first_marker(std::string_view text, std::span<const std::string_view> markers) {
  std::pair<size_t, std::string_view> first{std::string_view::npos, {}};
  for (std::string_view marker : markers)
    if (const size_t at = text.find(marker); at < first.first) first = {at, marker};
  return first;
}

// A JSON object, or an object given as a JSON string (some models quote their arguments).
std::optional<nlohmann::ordered_json> arguments_object(const nlohmann::ordered_json& value) {
  if (value.is_object()) return value;
  if (value.is_string()) {
    const auto parsed = nlohmann::ordered_json::parse(value.get<std::string>(), nullptr, false);
    if (!parsed.is_discarded() && parsed.is_object()) return parsed;
  }
  return std::nullopt;
}

// {"name": N, <arguments_key>: {…}} as a call.
std::optional<ToolCall> json_call(std::string_view body, std::initializer_list<const char*> argument_keys) {
  const auto parsed = nlohmann::ordered_json::parse(trimmed(body), nullptr, false);
  if (parsed.is_discarded() || !parsed.is_object()) return std::nullopt;
  const auto name = parsed.find("name");
  if (name == parsed.end() || !name->is_string() || name->get<std::string>().empty()) return std::nullopt;
  for (const char* key : argument_keys)
    if (const auto arguments = parsed.find(key); arguments != parsed.end()) {
      const auto object = arguments_object(*arguments);
      if (!object) return std::nullopt;
      return ToolCall{name->get<std::string>(), object->dump()};
    }
  return ToolCall{name->get<std::string>(), "{}"};
}

// Text between `open` (ending in '>') and `close`, the name between `open_prefix` and '>'.
struct XmlElement {
  std::string name, body;
  size_t end = 0;  // past the closing tag
};
std::optional<XmlElement> xml_element(std::string_view text, size_t from, std::string_view open_prefix,
                                      std::string_view close) {
  const size_t open = text.find(open_prefix, from);
  if (open == std::string_view::npos || !trimmed(text.substr(from, open - from)).empty()) return std::nullopt;
  const size_t name_end = text.find('>', open + open_prefix.size());
  if (name_end == std::string_view::npos) return std::nullopt;
  const size_t closing = text.find(close, name_end + 1);
  if (closing == std::string_view::npos) return std::nullopt;
  XmlElement element;
  element.name = std::string(text.substr(open + open_prefix.size(), name_end - open - open_prefix.size()));
  std::string_view body = text.substr(name_end + 1, closing - name_end - 1);
  // The template writes a newline after the opening tag and before the closing one.
  if (!body.empty() && body.front() == '\n') body.remove_prefix(1);
  if (!body.empty() && body.back() == '\n') body.remove_suffix(1);
  element.body = std::string(body);
  element.end = closing + close.size();
  return element;
}

std::optional<ToolCall> qwen_xml_call(std::string_view body, const nlohmann::ordered_json& tools) {
  const auto function = xml_element(body, 0, "<function=", "</function>");
  if (!function || function->name.empty() || !trimmed(body.substr(function->end)).empty()) return std::nullopt;
  std::vector<std::pair<std::string, std::string>> parameters;
  size_t at = 0;
  const std::string_view inner = function->body;
  while (!trimmed(inner.substr(at)).empty()) {
    const auto parameter = xml_element(inner, at, "<parameter=", "</parameter>");
    if (!parameter || parameter->name.empty()) return std::nullopt;
    parameters.emplace_back(parameter->name, parameter->body);
    at = parameter->end;
  }
  return ToolCall{function->name, typed_xml_arguments(parameters, tools, function->name).dump()};
}

// A quoted attribute value at `at` ("…" or '…'): the value and the position past its closing quote.
std::optional<std::pair<std::string, size_t>> quoted(std::string_view text, size_t at) {
  if (at >= text.size() || (text[at] != '"' && text[at] != '\'')) return std::nullopt;
  const size_t end = text.find(text[at], at + 1);
  if (end == std::string_view::npos) return std::nullopt;
  return std::pair{std::string(text.substr(at + 1, end - at - 1)), end + 1};
}

size_t skip_spaces(std::string_view text, size_t at) {
  while (at < text.size() && is_space(text[at])) ++at;
  return at;
}

// A MiniCPM call's body: what follows `<function name=` up to its `</function>`, i.e.
// "N"><param name="K">V</param>…
std::optional<ToolCall> minicpm_xml_call(std::string_view body, const nlohmann::ordered_json& tools) {
  const auto name = quoted(body, 0);
  if (!name || name->first.empty() || name->second >= body.size() || body[name->second] != '>') return std::nullopt;
  constexpr std::string_view kParamOpen = "<param name=", kParamClose = "</param>";
  std::vector<std::pair<std::string, std::string>> parameters;
  size_t at = skip_spaces(body, name->second + 1);
  while (at < body.size()) {
    if (body.substr(at, kParamOpen.size()) != kParamOpen) return std::nullopt;
    const auto key = quoted(body, at + kParamOpen.size());
    if (!key || key->second >= body.size() || body[key->second] != '>') return std::nullopt;
    size_t value_start = key->second + 1;
    std::string value;
    if (body.substr(value_start, kCdataOpen.size()) == kCdataOpen) {
      const size_t cdata_end = body.find(kCdataClose, value_start + kCdataOpen.size());
      if (cdata_end == std::string_view::npos) return std::nullopt;
      value = std::string(body.substr(value_start + kCdataOpen.size(), cdata_end - value_start - kCdataOpen.size()));
      value_start = cdata_end + kCdataClose.size();
      if (body.substr(value_start, kParamClose.size()) != kParamClose) return std::nullopt;
      at = value_start + kParamClose.size();
    } else {
      const size_t close = body.find(kParamClose, value_start);
      if (close == std::string_view::npos) return std::nullopt;
      value = std::string(body.substr(value_start, close - value_start));
      at = close + kParamClose.size();
    }
    parameters.emplace_back(key->first, std::move(value));
    at = skip_spaces(body, at);
  }
  return ToolCall{name->first, typed_xml_arguments(parameters, tools, name->first).dump()};
}

}  // namespace

ChatOutputSyntax chat_output_syntax(std::string_view chat_template) {
  ChatOutputSyntax syntax;
  syntax.reasoning = chat_template.find(kThinkOpen) != std::string_view::npos;
  if (chat_template.find(kFunctionOpen) != std::string_view::npos &&
      chat_template.find("<param name=") != std::string_view::npos)
    syntax.tool_calls = ToolCallSyntax::MiniCpmXml;
  else if (chat_template.find(kCallOpen) != std::string_view::npos)
    syntax.tool_calls = chat_template.find("<function=") != std::string_view::npos ? ToolCallSyntax::QwenXml
                                                                                    : ToolCallSyntax::Hermes;
  else if (chat_template.find("<|python_tag|>") != std::string_view::npos ||
           chat_template.find("\"parameters\": ") != std::string_view::npos)
    syntax.tool_calls = ToolCallSyntax::LlamaJson;
  return syntax;
}

bool prompt_opens_reasoning(std::string_view prompt) {
  const size_t opened = prompt.rfind("<think>"), closed = prompt.rfind("</think>");
  return opened != std::string_view::npos && (closed == std::string_view::npos || closed < opened);
}

const char* tool_call_syntax_name(ToolCallSyntax syntax) {
  switch (syntax) {
    case ToolCallSyntax::None: return "none";
    case ToolCallSyntax::Hermes: return "hermes";
    case ToolCallSyntax::QwenXml: return "qwen_xml";
    case ToolCallSyntax::LlamaJson: return "llama_json";
    case ToolCallSyntax::MiniCpmXml: return "minicpm_xml";
  }
  return "?";
}

nlohmann::ordered_json typed_xml_arguments(const std::vector<std::pair<std::string, std::string>>& parameters,
                                           const nlohmann::ordered_json& tools, const std::string& function) {
  const nlohmann::ordered_json* properties = nullptr;
  if (tools.is_array())
    for (const auto& tool : tools) {
      const auto& spec = tool.contains("function") ? tool["function"] : tool;
      if (spec.is_object() && spec.value("name", "") == function && spec.contains("parameters") &&
          spec["parameters"].is_object() && spec["parameters"].contains("properties"))
        properties = &spec["parameters"]["properties"];
    }
  nlohmann::ordered_json arguments = nlohmann::ordered_json::object();
  for (const auto& [key, value] : parameters) {
    bool as_string = true;
    if (properties && properties->is_object() && properties->contains(key) && (*properties)[key].is_object()) {
      const auto& type = (*properties)[key].value("type", nlohmann::ordered_json());
      as_string = type.is_string() ? type.get<std::string>() == "string"
                                   : type.is_array() && std::find(type.begin(), type.end(), "string") != type.end();
      if (type.is_null()) as_string = true;
    }
    if (!as_string) {
      const auto parsed = nlohmann::ordered_json::parse(value, nullptr, false);
      if (!parsed.is_discarded()) {
        arguments[key] = parsed;
        continue;
      }
    }
    arguments[key] = value;
  }
  return arguments;
}

grammar::Grammar tool_call_grammar(ToolCallSyntax syntax, const nlohmann::ordered_json& tools,
                                   const std::optional<std::string>& forced, bool several) {
  if (syntax != ToolCallSyntax::Hermes && syntax != ToolCallSyntax::LlamaJson)
    fail("forcing a tool call is supported for Hermes and Llama JSON tool calls; this chat template's are {}",
         tool_call_syntax_name(syntax));
  grammar::Grammar rules;
  const int32_t call = rules.add_rule("call");
  for (const auto& tool : tools) {
    const std::string name = tool["function"]["name"];
    if (forced && name != *forced) continue;
    const nlohmann::ordered_json parameters =
        tool["function"].value("parameters", nlohmann::ordered_json{{"type", "object"}});
    int32_t arguments;
    try {
      arguments = grammar::add_json_schema(rules, parameters);
    } catch (const Error& error) {
      fail("the parameters of tool {}: {}", name, error.what());
    }
    const std::string opening = nlohmann::ordered_json(name).dump();
    grammar::Sequence body =
        syntax == ToolCallSyntax::Hermes
            ? grammar::literal("<tool_call>\n{\"name\":" + opening + ",\"arguments\":")
            : grammar::literal("{\"name\":" + opening + ",\"parameters\":");
    body.push_back(grammar::Symbol::reference(arguments));
    body = grammar::concat(body, grammar::literal(syntax == ToolCallSyntax::Hermes ? "}\n</tool_call>" : "}"));
    rules.add_alternative(call, body);
  }
  if (rules.alternatives(call).empty()) fail("no tool is named \"{}\"", forced.value_or(""));
  if (forced || !several || syntax == ToolCallSyntax::LlamaJson) {
    rules.set_root(call);
    return rules;
  }
  const int32_t calls = rules.add_rule("calls");
  rules.add_alternative(calls, {grammar::Symbol::reference(call)});
  rules.add_alternative(calls, grammar::concat({grammar::Symbol::reference(call)},
                                               grammar::concat(grammar::literal("\n"), {grammar::Symbol::reference(calls)})));
  rules.set_root(calls);
  return rules;
}

ChatOutputParser::ChatOutputParser(ChatOutputSyntax syntax, nlohmann::ordered_json tools, bool in_reasoning)
    : syntax_(syntax),
      tools_(std::move(tools)),
      state_(in_reasoning && syntax.reasoning ? State::Reasoning : State::Content) {}

void ChatOutputParser::emit(std::vector<ChatOutputEvent>& events, ChatOutputEvent::Kind kind, std::string text) {
  // The spaces a template puts after </think> or between calls are layout, not content.
  if (kind == ChatOutputEvent::Kind::Content && skip_spaces_) {
    const size_t first = text.find_first_not_of(" \n\t\r");
    text.erase(0, first == std::string::npos ? text.size() : first);
    if (!text.empty()) skip_spaces_ = false;
  }
  if (text.empty()) return;
  (kind == ChatOutputEvent::Kind::Reasoning ? output_.reasoning : output_.content) += text;
  if (!events.empty() && events.back().kind == kind) {
    events.back().text += text;
    return;
  }
  events.push_back({kind, std::move(text), {}, 0});
}

void ChatOutputParser::emit_call(std::vector<ChatOutputEvent>& events, ToolCall call) {
  output_.tool_calls.push_back(call);
  events.push_back({ChatOutputEvent::Kind::ToolCall, {}, std::move(call), output_.tool_calls.size() - 1});
}

std::optional<ToolCall> ChatOutputParser::parse_call(std::string_view body) const {
  switch (syntax_.tool_calls) {
    case ToolCallSyntax::None: return std::nullopt;
    case ToolCallSyntax::Hermes: return json_call(body, {"arguments", "parameters"});
    case ToolCallSyntax::QwenXml: return qwen_xml_call(body, tools_);
    case ToolCallSyntax::LlamaJson: return json_call(body, {"parameters", "arguments"});
    case ToolCallSyntax::MiniCpmXml: return minicpm_xml_call(body, tools_);
  }
  return std::nullopt;
}

std::vector<ChatOutputEvent> ChatOutputParser::push(std::string_view text) {
  pending_ += text;
  std::vector<ChatOutputEvent> events;
  const std::string_view open = call_open(syntax_.tool_calls), close = call_close(syntax_.tool_calls);
  while (true) {
    if (state_ == State::WholeReply) return events;
    if (state_ == State::ToolCall) {
      const size_t at = syntax_.tool_calls == ToolCallSyntax::MiniCpmXml ? find_outside_cdata(pending_, close)
                                                                          : pending_.find(close);
      if (at == std::string::npos) return events;
      const std::string body = pending_.substr(0, at);
      pending_.erase(0, at + close.size());
      if (auto call = parse_call(body)) {
        emit_call(events, std::move(*call));
        skip_spaces_ = true;
      } else {
        emit(events, ChatOutputEvent::Kind::Content, std::string(open) + body + std::string(close));
      }
      state_ = State::Content;
      continue;
    }
    if (state_ == State::Content && syntax_.tool_calls == ToolCallSyntax::LlamaJson && !started_) {
      const size_t first = pending_.find_first_not_of(" \n\t\r");
      if (first == std::string::npos) return events;  // only spaces so far: undecided
      started_ = true;
      if (pending_[first] == '{') {
        state_ = State::WholeReply;
        return events;
      }
    }
    const bool reasoning = state_ == State::Reasoning;
    std::vector<std::string_view> markers;
    if (reasoning) {
      markers.push_back(kThinkClose);
    } else {
      if (syntax_.reasoning) markers.push_back(kThinkOpen);
      if (!open.empty()) markers.push_back(open);
    }
    const auto kind = reasoning ? ChatOutputEvent::Kind::Reasoning : ChatOutputEvent::Kind::Content;
    const auto [at, marker] = first_marker(pending_, markers);
    if (at == std::string::npos) {
      const size_t held = partial_marker(pending_, markers);
      emit(events, kind, pending_.substr(0, pending_.size() - held));
      pending_.erase(0, pending_.size() - held);
      return events;
    }
    emit(events, kind, pending_.substr(0, at));
    pending_.erase(0, at + marker.size());
    state_ = marker == kThinkOpen ? State::Reasoning : marker == open ? State::ToolCall : State::Content;
    if (marker == kThinkClose) skip_spaces_ = true;
    started_ = true;
  }
}

std::vector<ChatOutputEvent> ChatOutputParser::finish() {
  std::vector<ChatOutputEvent> events;
  switch (state_) {
    case State::Content: emit(events, ChatOutputEvent::Kind::Content, std::move(pending_)); break;
    case State::Reasoning: emit(events, ChatOutputEvent::Kind::Reasoning, std::move(pending_)); break;
    case State::ToolCall:
      emit(events, ChatOutputEvent::Kind::Content, std::string(call_open(syntax_.tool_calls)) + pending_);
      break;
    case State::WholeReply:
      if (auto call = parse_call(pending_))
        emit_call(events, std::move(*call));
      else
        emit(events, ChatOutputEvent::Kind::Content, std::move(pending_));
      break;
  }
  pending_.clear();
  state_ = State::Content;
  return events;
}

}  // namespace kiln
